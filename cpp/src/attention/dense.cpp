// attention.cpp: dense attention over strided (B, H, S, D) tensors, as a problem for the shared
// flash driver.
#include "attnx/attention.h"

#include "attnx/dispatch.h"
#include "attention/driver.h"

namespace attnx {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i8: return "int8";
    case DType::e4m3: return "float8_e4m3fn";
    case DType::e5m2: return "float8_e5m2";
    case DType::f64: return "float64";
  }
  return "?";
}

namespace {

// Dense (B, H, S, D) tensors as a problem for run_flash, computed in T (float, or double for
// float64).
template <class T>
struct DenseProblem : detail::BasicFlashProblem<T> {
  using Base = detail::BasicFlashProblem<T>;
  const BasicAttentionParams<T>& a;
  std::size_t es;  // bytes per element of q, k, v and out

  explicit DenseProblem(const BasicAttentionParams<T>& p)
      : Base(p.B, p.Hq, p.Hkv, p.Dk, p.Dv, p.scale, p.causal, p.var, p.dtype),
        a(p),
        es(dtype_size(p.dtype)) {
    this->mask_kind = p.mask_kind;
    this->mask_sk = p.m_sk * mask_elem();
  }

  // An additive mask is in T (float32, or float64 for float64 inputs).
  int64_t mask_elem() const {
    return this->mask_kind == MaskKind::boolean ? 1 : int64_t(sizeof(T));
  }
  int64_t rows(int64_t) const { return a.Sq; }
  int64_t lq(int64_t b) const { return a.q_lens ? a.q_lens[b] : a.Sq; }
  int64_t lk(int64_t b) const { return a.kv_lens ? a.kv_lens[b] : a.Sk; }
  const char* q_row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<const char*>(a.q.data) +
           (b * a.q.sb + h * a.q.sh + i * a.q.ss) * int64_t(es);
  }
  void* out_row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<char*>(a.out) + (b * a.o_sb + h * a.o_sh + i * a.o_ss) * int64_t(es);
  }
  T* lse_at(int64_t b, int64_t h, int64_t i) const {
    return a.lse ? a.lse + b * a.l_sb + h * a.l_sh + i * a.l_ss : nullptr;
  }
  const char* mask_row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<const char*>(a.mask) + (b * a.m_sb + h * a.m_sh + i * a.m_sq) * mask_elem();
  }
  kern::KVSource src(const Strided4& t, int64_t b, int64_t kvh) const {
    kern::KVSource s;
    s.base = static_cast<const char*>(t.data) + (b * t.sb + kvh * t.sh) * int64_t(es);
    s.dtype = a.dtype;
    s.row_stride = t.ss * int64_t(es);
    return s;
  }
  kern::KVSource k_src(int64_t b, int64_t kvh) const { return src(a.k, b, kvh); }
  kern::KVSource v_src(int64_t b, int64_t kvh) const { return src(a.v, b, kvh); }
};

template <class T>
void run_dense(const BasicAttentionParams<T>& p) {
  if (p.Hkv <= 0 || p.Hq % p.Hkv != 0) throw InvalidArgument("Hq must be a multiple of Hkv");
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;  // Dv == 0 still has an lse to write
  DenseProblem<T> prob(p);
  detail::run_flash(prob, resolve_threads(p.num_threads));
}

}  // namespace

void attention(const AttentionParams& p) {
  if (p.dtype == DType::f64) throw InvalidArgument("float64 inputs take AttentionParams64");
  run_dense(p);
}

void attention(const AttentionParams64& p) {
  if (p.dtype != DType::f64)
    throw InvalidArgument("AttentionParams64: q, k, v and out must be float64");
  run_dense(p);
}

}  // namespace attnx
