// state.h: the online-softmax state of one query row and every rule about it, in one place
// (the shape of FlashInfer's state_t: init, update, merge, finalize). Used by the per-ISA kernels
// (the update) and by the flash driver (init, merge of split-KV parts, finalize).
//
// A row's state is (O, m, l): O its output so far, unnormalised (Dv values of the compute type T:
// float, or double for float64 inputs; every rule is a template on T); m the largest score
// seen; l the sum of exp(s - m) over the scores seen. (Float32 and float64 prefill tiles fused
// into the packed QK product let m lag the largest score by up to kLazyMax = 4, see softmax-inl.h:
// m is a reference point, and no rule below needs more than exp(s - m) staying far from
// overflow.) The rules:
//   init      m = -inf, l = 0, O = 0: a row that has seen no visible key.
//   update    (softmax-inl.h softmax_row) m' = max(m, the tile's largest score); O and l are scaled
//             by rescale(m, m') before the tile's exp(s - m') are added. While m' = -inf (nothing
//             visible yet, or every visible score is -inf) the update is skipped: it would compute
//             exp(-inf - -inf) = NaN. A NaN score is still a score, though: keep_nan sets l = NaN,
//             which poisons the row (its output and lse are NaN, as in the reference).
//   merge     parts of one row over disjoint key ranges (split-KV, a shared prefix's part
//             computed by another call: `finished`) combine by log-sum-exp:
//             m = max m_s, l = sum l_s e^(m_s - m), O likewise; a part with m_s = -inf adds nothing
//             but its NaN (keep_nan). A row merged with a finished part (merge_shares) weighs each
//             part's O by its share of l instead, so that it cannot overflow (see "overflow").
//   finalize  a sink (a logit in the denominator that carries no value) is folded into m and l;
//             then a row with l = 0 (no visible key and no sink: empty or fully masked) is written
//             as zeros with lse = -inf, any other as O / l with lse = m + log(l).
//   overflow  O sums p v before the division by l, so values near the type's largest (3e38 in
//             float) can overflow it where O / l, a weighted mean of the values, is finite.
//             `overflowed` finds such a row (m and l finite, O not); the driver computes it again
//             from the start with m = restart_max(m, its keys), which keeps sum p |v| below the
//             largest value. A row whose O is still not finite then has an infinite or NaN value
//             among its own: the driver computes it once more as it was first.
//
// Every function here has internal linkage (static): the kernel files include this header with
// wide instruction sets enabled, and an inline (COMDAT) copy compiled with AVX could otherwise be
// the one the linker keeps for the baseline driver (see kernels/tables.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attnx {
namespace row {

template <class T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// M rows (O rows ldo apart, zeroed over ldo) in the state of a row that has seen nothing.
template <class T>
static inline void init(int64_t M, T* o, int64_t ldo, T* m, T* l) {
  std::memset(o, 0, sizeof(T) * std::size_t(M * ldo));
  for (int64_t r = 0; r < M; ++r) {
    m[r] = neg_inf<T>();
    l[r] = T(0);
  }
}

// The factor for O and l accumulated under max m_old once the max is m_new (finite): a row that
// had seen nothing has nothing to scale (0, not exp(-inf - -inf)).
template <class T>
static inline T rescale(T m_old, T m_new) {
  return m_old == neg_inf<T>() ? T(0) : std::exp(m_old - m_new);
}

// The NaN rule: `seen` is a score (or a part's l) met while the row has nothing visible
// (m = -inf), where the update is skipped. If it is NaN, the row's l becomes NaN.
template <class T>
static inline void keep_nan(T* l, T seen) {
  if (std::isnan(seen)) *l = std::numeric_limits<T>::quiet_NaN();
}

// A row's running max and sum (of a merge's result).
template <class T>
struct MaxSum {
  T m, l;
};
// One part of a row: its max, sum and O (Dv values).
template <class T>
struct Part {
  T m, l;
  const T* o;
};
// The merge of n parts, part(s) giving part s; `out` (Dv values) must not be any part's O.
template <class T, class PartFn>
static inline MaxSum<T> merge_parts(int64_t n, PartFn part, int64_t Dv, T* out) {
  T mm = neg_inf<T>();
  for (int64_t s = 0; s < n; ++s) mm = std::max(mm, part(s).m);
  T ll = T(0);
  for (int64_t d = 0; d < Dv; ++d) out[d] = T(0);
  for (int64_t s = 0; s < n; ++s) {
    const Part<T> ps = part(s);
    if (ps.m == neg_inf<T>()) {
      keep_nan(&ll, ps.l);
      continue;
    }
    const T a = std::exp(ps.m - mm);
    ll += ps.l * a;
    for (int64_t d = 0; d < Dv; ++d) out[d] += ps.o[d] * a;
  }
  return {mm, ll};
}
// Merges n parts of one row: part s has max m[s * ml_stride], sum l[s * ml_stride] and O at
// o + s * o_stride. Writes the merged O (Dv values) into `out` and returns the merged m and l.
template <class T>
static inline MaxSum<T> merge(int64_t n, const T* m, const T* l, int64_t ml_stride, const T* o,
                              int64_t o_stride, int64_t Dv, T* out) {
  return merge_parts<T>(
      n, [&](int64_t s) { return Part<T>{m[s * ml_stride], l[s * ml_stride], o + s * o_stride}; },
      Dv, out);
}

// The merge of two parts into a finished row state: O the parts' outputs weighted by their shares
// of the merged sum (O_s e^(m_s - m) / l), l = 1 and m the merged lse. merge_parts adds the
// parts' unnormalised O, which overflows for values near the type's largest where the weighted
// mean is finite; here each term is at most its part's largest |value| times its share. -inf
// parts and NaN as in merge_parts (a NaN l leaves O at 0 and l NaN: the row finalizes to NaN).
template <class T>
static inline MaxSum<T> merge_shares(const Part<T>& a, const Part<T>& b, int64_t Dv, T* out) {
  const Part<T> ps[2] = {a, b};
  const T mm = std::max(std::max(neg_inf<T>(), a.m), b.m);
  T ll = T(0), e[2] = {T(0), T(0)};
  for (int s = 0; s < 2; ++s) {
    if (ps[s].m == neg_inf<T>()) {
      keep_nan(&ll, ps[s].l);
      continue;
    }
    e[s] = std::exp(ps[s].m - mm);
    ll += ps[s].l * e[s];
  }
  for (int64_t d = 0; d < Dv; ++d) out[d] = T(0);
  if (!(ll > T(0))) return {mm, ll};  // nothing visible (0), or NaN
  for (int s = 0; s < 2; ++s) {
    if (ps[s].m == neg_inf<T>()) continue;
    const T share = e[s] / ll;
    for (int64_t d = 0; d < Dv; ++d) out[d] += ps[s].o[d] * share;
  }
  return {mm + std::log(ll), T(1)};
}

// A finished part (a normalised output and its lse, -inf where it saw no key: what a call with
// return_lse gives) as a part: O = out, m = lse, l = 1 (out = O / l, lse = m + log l).
template <class T>
static inline Part<T> finished(const T* out, T lse) {
  return {lse, T(1), out};
}

// Finishes a row: folds in the sink (null: none), normalises O into `out` (Dv values; may be o)
// and sets *lse (lse null: the caller does not want it, and no log is taken). Returns false for a
// row with no visible key and no sink: the caller writes zeros and lse = -inf.
template <class T>
static inline bool finalize(const T* o, T m, T l, const T* sink, int64_t Dv, T* out, T* lse) {
  if (sink != nullptr) {
    const T m2 = std::max(m, *sink);  // the sink is finite: so is m2
    const T a = rescale(m, m2);
    l = l * a + std::exp(*sink - m2);
    for (int64_t d = 0; d < Dv; ++d) out[d] = o[d] * a;
    o = out;
    m = m2;
  }
  if (l == T(0)) return false;
  const T inv = T(1) / l;
  for (int64_t d = 0; d < Dv; ++d) out[d] = o[d] * inv;
  if (lse != nullptr) *lse = m + std::log(l);
  return true;
}

// Whether the row's O overflowed while its max and sum stayed finite (see "overflow" above). A
// NaN or infinite value, or a NaN score (l = NaN), makes O non-finite legitimately: the first two
// are found here too, and computing such a row again gives the same non-finite result.
template <class T>
static inline bool overflowed(const T* o, T m, T l, int64_t Dv) {
  if (!(std::isfinite(m) && std::isfinite(l) && l > T(0))) return false;
  const T top = std::numeric_limits<T>::max();
  int bad = 0;  // (this form vectorises: a compare and an OR per vector)
  for (int64_t d = 0; d < Dv; ++d) bad |= !(std::fabs(o[d]) <= top);
  return bad != 0;
}

// The running max to compute an overflowed row of n keys again with, from the m it ended with:
// m lags the row's largest score by at most kLazyMax = 4, so every p = exp(s - m') is then at most
// e^(4 - 5 - ln n) = 1 / (e n), and sum p |v| stays below the largest |v| / e. The shift is no
// larger than that needs, because each exp's argument s - m' is rounded at its own size (measured:
// the rows come out as accurate as the same problem with the values scaled down, which does not
// overflow; tests/kernels/test_numerics.py).
template <class T>
static inline T restart_max(T m, int64_t n) {
  return m + T(5) + std::log(T(n > 1 ? n : 1));
}

}  // namespace row
}  // namespace attnx
