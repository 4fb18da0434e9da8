// row_state.h: the online-softmax state of one query row and every rule about it, in one place
// (the shape of FlashInfer's state_t: init, update, merge, finalize). Used by the per-ISA kernels
// (the update) and by the flash driver (init, merge of split-KV parts, finalize).
//
// A row's state is (O, m, l): O its output so far, unnormalised (Dv floats); m the largest score
// seen; l the sum of exp(s - m) over the scores seen. The rules:
//   init      m = -inf, l = 0, O = 0: a row that has seen no visible key.
//   update    (kernel-inl.h softmax_row) m' = max(m, the tile's largest score); O and l are scaled
//             by rescale(m, m') before the tile's exp(s - m') are added. While m' = -inf (nothing
//             visible yet, or every visible score is -inf) the update is skipped: it would compute
//             exp(-inf - -inf) = NaN. A NaN score is still a score, though: keep_nan sets l = NaN,
//             which poisons the row (its output and lse are NaN, as in the reference).
//   merge     parts of one row over disjoint key ranges (split-KV, a shared prefix's part
//             computed by another call: `finished`) combine by log-sum-exp:
//             m = max m_s, l = sum l_s e^(m_s - m), O likewise; a part with m_s = -inf adds nothing
//             but its NaN (keep_nan).
//   finalize  a sink (a logit in the denominator that carries no value) is folded into m and l;
//             then a row with l = 0 (no visible key and no sink: empty or fully masked) is written
//             as zeros with lse = -inf, any other as O / l with lse = m + log(l).
//
// Every function here has internal linkage (static): the kernel files include this header with
// wide instruction sets enabled, and an inline (COMDAT) copy compiled with AVX could otherwise be
// the one the linker keeps for the baseline driver (see kernels.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attnx {
namespace row {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// M rows (O rows ldo floats apart, zeroed over ldo) in the state of a row that has seen nothing.
static inline void init(int64_t M, float* o, int64_t ldo, float* m, float* l) {
  std::memset(o, 0, sizeof(float) * std::size_t(M * ldo));
  for (int64_t r = 0; r < M; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
  }
}

// The factor for O and l accumulated under max m_old once the max is m_new (finite): a row that
// had seen nothing has nothing to scale (0, not exp(-inf - -inf)).
static inline float rescale(float m_old, float m_new) {
  return m_old == kNegInf ? 0.f : std::exp(m_old - m_new);
}

// The NaN rule: `seen` is a score (or a part's l) met while the row has nothing visible
// (m = -inf), where the update is skipped. If it is NaN, the row's l becomes NaN.
static inline void keep_nan(float* l, float seen) {
  if (std::isnan(seen)) *l = std::numeric_limits<float>::quiet_NaN();
}

// Merges n parts of one row: part s has max m[s * ml_stride], sum l[s * ml_stride] and O at
// o + s * o_stride. Writes the merged O (Dv floats) into `out` and returns the merged m and l.
struct MaxSum {
  float m, l;
};
// One part of a row: its max, sum and O (Dv floats).
struct Part {
  float m, l;
  const float* o;
};
// The merge of n parts, part(s) giving part s; `out` (Dv floats) must not be any part's O.
template <class PartFn>
static inline MaxSum merge_parts(int64_t n, PartFn part, int64_t Dv, float* out) {
  float mm = kNegInf;
  for (int64_t s = 0; s < n; ++s) mm = std::max(mm, part(s).m);
  float ll = 0.f;
  for (int64_t d = 0; d < Dv; ++d) out[d] = 0.f;
  for (int64_t s = 0; s < n; ++s) {
    const Part ps = part(s);
    if (ps.m == kNegInf) {
      keep_nan(&ll, ps.l);
      continue;
    }
    const float a = std::exp(ps.m - mm);
    ll += ps.l * a;
    for (int64_t d = 0; d < Dv; ++d) out[d] += ps.o[d] * a;
  }
  return {mm, ll};
}
static inline MaxSum merge(int64_t n, const float* m, const float* l, int64_t ml_stride,
                           const float* o, int64_t o_stride, int64_t Dv, float* out) {
  return merge_parts(
      n, [&](int64_t s) { return Part{m[s * ml_stride], l[s * ml_stride], o + s * o_stride}; }, Dv,
      out);
}

// A finished part (a normalised output and its lse, -inf where it saw no key: what a call with
// return_lse gives) as a part: O = out, m = lse, l = 1 (out = O / l, lse = m + log l).
static inline Part finished(const float* out, float lse) { return {lse, 1.f, out}; }

// Finishes a row: folds in the sink (null: none), normalises O into `out` (Dv floats; may be o)
// and sets *lse. Returns false for a row with no visible key and no sink: the caller writes zeros
// and lse = -inf.
static inline bool finalize(const float* o, float m, float l, const float* sink, int64_t Dv,
                            float* out, float* lse) {
  if (sink != nullptr) {
    const float m2 = std::max(m, *sink);  // the sink is finite: so is m2
    const float a = rescale(m, m2);
    l = l * a + std::exp(*sink - m2);
    for (int64_t d = 0; d < Dv; ++d) out[d] = o[d] * a;
    o = out;
    m = m2;
  }
  if (l == 0.f) return false;
  const float inv = 1.f / l;
  for (int64_t d = 0; d < Dv; ++d) out[d] = o[d] * inv;
  *lse = m + std::log(l);
  return true;
}

}  // namespace row
}  // namespace attnx
