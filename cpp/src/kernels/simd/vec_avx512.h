// vec_avx512.h: the vector vocabulary on AVX-512F/BW/VL (16 fp32 lanes). tanh runs as two AVX2
// halves (only soft-capping uses it); exp, on the softmax's hot path, is native.
#pragma once
#include <cstdint>
#include <immintrin.h>

#if !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "vec_avx512.h: compile with -mavx512bw -mavx512vl (the avx512 units' baseline)"
#endif

#include "convert.h"

namespace attnx {
namespace avx512 {
namespace simd {

#include "vec_avx_common.h"

constexpr int W = 16;
using V = __m512;
using Real = float;  // the type of a lane: what the kernels compute in

static inline __m256 lo256(V v) { return _mm512_castps512_ps256(v); }
static inline __m256 hi256(V v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
static inline V join(__m256 a, __m256 b) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

static inline V zero() { return _mm512_setzero_ps(); }
static inline V set1(float x) { return _mm512_set1_ps(x); }
static inline V load(const float* p) { return _mm512_loadu_ps(p); }
static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V max(V a, V x) { return _mm512_max_ps(a, x); }
static inline V abs(V x) {
  return _mm512_castsi512_ps(
      _mm512_and_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}
// s + b, but exactly b where b is -inf: a blocked score stays blocked even if s is NaN
static inline V mask_add(V s, V b) {
  const __mmask16 blocked = _mm512_cmp_ps_mask(b, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
  return _mm512_mask_blend_ps(blocked, _mm512_add_ps(s, b), b);
}
// lane tests: greater(a, b) lane by lane (false for NaN lanes), or-ed, any lane set
using Mask = __mmask16;
static inline Mask greater(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline Mask mask_or(Mask a, Mask b) { return Mask(a | b); }
static inline bool any(Mask m) { return m != 0; }
static inline bool all_finite(V x) {
  return _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0;
}
static inline float reduce_max(V v) { return hmax256(_mm256_max_ps(lo256(v), hi256(v))); }
static inline float reduce_add(V v) { return hadd256(_mm256_add_ps(lo256(v), hi256(v))); }
static inline V iota() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// 2^t = 2^n 2^f for t <= 128 (or NaN), n = round(t), |f| <= 1/2: exp256's polynomial (Poly,
// Terms of it) for 2^f and VSCALEFPS for 2^n, which also saturates to inf. n is taken by adding
// and taking away 1.5 * 2^23 (rounding to nearest even, exact for |t| <= 2^22): additions, which
// keep their rate beside AMX tile products, where VRNDSCALEPS, like FMAs, issues at half rate
// then. Below t = -126 the result is 0 (exp(-inf) = 0 exactly), by the zero mask of VSCALEFPS:
// a subnormal or underflowing result costs Intel cores a microcode assist per instruction, and a
// softmax whose probabilities underflowed ran 10x slower (bench/NOTES.md). The masked lanes
// raise nothing, so t needs no clamp. AVX2's exp256 flushes likewise, below ~2^-126.5.
template <int Terms, const float* Poly>
static inline V exp2_reduced(V t) {
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);  // or NaN
  const V magic = _mm512_set1_ps(12582912.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const V n = _mm512_sub_round_ps(_mm512_add_round_ps(t, magic, kNearest), magic, kNearest);
  const V f = _mm512_sub_ps(t, n);
  V p = _mm512_set1_ps(Poly[0]);
  for (int i = 1; i < Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(Poly[i]));
  return _mm512_maskz_scalef_ps(normal, p, n);
}
// exp(x) = 2^t with t = x log2(e), clamped to at most 128 (exp(+inf) = inf) with x in the second
// operand of MIN so that NaN stays NaN. Half the instructions of two AVX2 halves.
// Top = false: for x <= 64 (or NaN) only, no clamp at the top. Poly: kExp2Poly, or the shorter
// kExp2PolyBf16 (exp_bf16).
template <bool Top = true, int Terms = kExp2Terms, const float* Poly = kExp2Poly>
static inline V exp_(V x) {
  V t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  if constexpr (Top) t = _mm512_min_ps(_mm512_set1_ps(128.f), t);
  return exp2_reduced<Terms, Poly>(t);
}
// exp(x) for x <= 64 (or NaN) to 2.9e-6 relative: for probabilities that are rounded to bf16
// (2^-8) before they are used, where exp_'s 1.3 ulp buys nothing.
static inline V exp_bf16(V x) { return exp_<false, kExp2TermsBf16, kExp2PolyBf16>(x); }
// 2^t for t <= 92 (or NaN), as exp_bf16(t / log2(e)): for callers that fold log2(e) into their
// factors (one multiply fewer a vector).
static inline V exp2_bf16(V t) { return exp2_reduced<kExp2TermsBf16, kExp2PolyBf16>(t); }
static inline V exp(V x) { return exp_<true>(x); }
static inline V exp_small(V x) { return exp_<false>(x); }  // x <= 64 or NaN
static inline V tanh(V x) { return join(tanh256(lo256(x)), tanh256(hi256(x))); }
static inline V load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// W float16s of x: store_f16_256's rounding and NaN, 16 at a time
static inline void store_f16(uint16_t* p, V x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i canon =
      _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int(0x80000000u))),
                      _mm512_set1_epi32(0x7fc00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(_mm512_mask_blend_ps(nan, x, _mm512_castsi512_ps(canon)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// W 1-byte KV codes: int8 as its value; fp8 as its float16 view (e4m3fn: the value / 256).
// load_e4m3_in_place: e4m3fn rows read in place, with the NaN code's test (kE4m3TestInWidening):
// here 4 instructions per W codes beside 32 registers cost less than a pass over each tile's codes
// for the code (bench/NOTES.md), which waited on the tile's first reads from memory.
constexpr bool kE4m3TestInWidening = true;
static inline V load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline V load_fp8(const uint8_t* p, bool e4) {
  const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(fp8_as_f16_256(x, e4));
}
static inline V load_e4m3_in_place(const uint8_t* p) { return load_fp8(p, true); }
static inline V load_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// bfloat16 rows read in place (load_bf16_ordered): W values in their natural order, by one load
// and one zero-masked word permute (AVX512BW's vpermw: each bf16 to the top half of its float32),
// where load_bf16 takes a widening and a shift. The natural order leaves nothing to reorder
// (to_bf16_order, from_bf16_order: AVX2's vocabulary has another), and a decode 3-8% faster on
// Zen 4 than the even/odd order's byte shuffle of a broadcast load (bench/NOTES.md).
static inline V load_bf16_ordered(const uint16_t* p) {
  const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i idx = _mm512_slli_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 16);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, x));
}
static inline V to_bf16_order(V v) { return v; }
static inline V from_bf16_order(V v) { return v; }
// out[t] = horizontal sum of a[t], t < 8; hsum8_split: sums 0-3 at lo, 4-7 at hi
static ATTNX_INLINE __m256 hsum8v(const V* a) {
  __m256 h[8];
  for (int t = 0; t < 8; ++t) h[t] = _mm256_add_ps(lo256(a[t]), hi256(a[t]));
  return hsum8x256(h);
}
static ATTNX_INLINE void hsum8(const V* a, float* out) { _mm256_storeu_ps(out, hsum8v(a)); }
static ATTNX_INLINE void hsum8_split(const V* a, float* lo, float* hi) {
  store_halves(hsum8v(a), lo, hi);
}

}  // namespace simd
}  // namespace avx512
}  // namespace attnx
