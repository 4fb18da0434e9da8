// vec_lane-inl.h: the vector vocabulary with one lane of type Real (no intrinsics), shared by the
// portable float path (vec_scalar.h, Real = float) and the float64 kernels (vec_f64.h, Real =
// double). The including file opens its `simd` namespace and defines Real first; <cmath>,
// <cstdint>, <limits> and convert.h are included before that.

constexpr int W = 1;
using V = Real;

static inline V zero() { return V(0); }
static inline V set1(Real x) { return x; }
static inline V load(const Real* p) { return *p; }
static inline void store(Real* p, V v) { *p = v; }
static inline V add(V a, V b) { return a + b; }
static inline V sub(V a, V b) { return a - b; }
static inline V mul(V a, V b) { return a * b; }
static inline V fmadd(V a, V b, V c) { return a * b + c; }
// max(a, x) that lets a NaN in x through, like MAXPS with x as the second operand
static inline V max(V a, V x) { return a > x ? a : x; }
static inline V abs(V x) { return std::fabs(x); }
// s + b, but exactly b where b is -inf: a blocked score stays blocked even if s is NaN
static inline V mask_add(V s, V b) {
  return b == -std::numeric_limits<Real>::infinity() ? b : s + b;
}
// true if every lane is finite (not inf, not NaN)
static inline bool all_finite(V x) { return std::isfinite(x); }
// lane tests: greater(a, b) lane by lane (false for NaN lanes), or-ed, any lane set
using Mask = bool;
static inline Mask greater(V a, V b) { return a > b; }
static inline Mask mask_or(Mask a, Mask b) { return a || b; }
static inline bool any(Mask m) { return m; }
static inline Real reduce_max(V v) { return v; }
static inline Real reduce_add(V v) { return v; }
static inline V iota() { return V(0); }
// exp with exp(-inf) == 0 exactly and NaN preserved
static inline V exp(V x) { return std::exp(x); }
static inline V exp_small(V x) { return std::exp(x); }  // x <= 64 or NaN
static inline V tanh(V x) { return std::tanh(x); }
static inline V load_f16(const uint16_t* p) { return cvt::f16_to_f32(*p); }
static inline void store_f16(uint16_t* p, V x) { *p = cvt::f32_to_f16(float(x)); }
static inline V load_bf16(const uint16_t* p) { return cvt::bf16_to_f32(*p); }
// bfloat16 in the "bf16 order" (vec_avx512.h): with one lane, the natural one.
static inline V load_bf16_ordered(const uint16_t* p) { return load_bf16(p); }
static inline V to_bf16_order(V v) { return v; }
static inline V from_bf16_order(V v) { return v; }
// a 1-byte KV code: int8 as its value; fp8 as its float16 view (e4m3fn: the value / 256)
static inline V load_i8(const int8_t* p) { return V(*p); }
static inline V load_fp8(const uint8_t* p, bool e4) {
  return cvt::f16_to_f32(e4 ? cvt::e4m3_as_f16(*p) : cvt::e5m2_as_f16(*p));
}
// e4m3fn rows read in place: one lane's widening is the scalar conversion, the NaN code's test
// included (kE4m3TestInWidening)
constexpr bool kE4m3TestInWidening = true;
static inline V load_e4m3_in_place(const uint8_t* p) { return load_fp8(p, true); }
// hsum8: out[t] = horizontal sum of a[t], t < 8; hsum8_split: sums 0-3 at lo, 4-7 at hi
static ATTNX_INLINE void hsum8(const V* a, Real* out) {
  for (int t = 0; t < 8; ++t) out[t] = a[t];
}
static ATTNX_INLINE void hsum8_split(const V* a, Real* lo, Real* hi) {
  for (int t = 0; t < 4; ++t) {
    lo[t] = a[t];
    hi[t] = a[4 + t];
  }
}
// 8 x 8 transpose: dst[c * ldd + r] = src[r][c]
static inline void transpose8x8(const Real* const* src, int64_t col, Real* dst, int64_t ldd) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) dst[c * ldd + r] = src[r][col + c];
}
static inline void transpose8x8_f16(const uint16_t* const* src, int64_t col, Real* dst,
                                    int64_t ldd) {
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) dst[c * ldd + r] = Real(cvt::f16_to_f32(src[r][col + c]));
}
