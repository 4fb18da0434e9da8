// vec_avx2.h: the vector vocabulary on AVX2 + FMA (8 fp32 lanes).
#pragma once
#include <cstdint>
#include <immintrin.h>

#include "convert.h"

namespace attnx {
namespace avx2 {
namespace simd {

#include "vec_avx_common.h"

constexpr int W = 8;
using V = __m256;
using Real = float;  // the type of a lane: what the kernels compute in

static inline V zero() { return _mm256_setzero_ps(); }
static inline V set1(float x) { return _mm256_set1_ps(x); }
static inline V load(const float* p) { return _mm256_loadu_ps(p); }
static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V max(V a, V x) { return _mm256_max_ps(a, x); }
static inline V abs(V x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
// s + b, but exactly b where b is -inf: a blocked score stays blocked even if s is NaN
static inline V mask_add(V s, V b) {
  return _mm256_blendv_ps(_mm256_add_ps(s, b), b,
                          _mm256_cmp_ps(b, _mm256_set1_ps(-__builtin_inff()), _CMP_EQ_OQ));
}
// lane tests: greater(a, b) lane by lane (false for NaN lanes), or-ed, any lane set
using Mask = __m256;
static inline Mask greater(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
static inline Mask mask_or(Mask a, Mask b) { return _mm256_or_ps(a, b); }
static inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
// true if every lane is finite: x - x is 0 for finite x and NaN for inf or NaN
static inline bool all_finite(V x) {
  return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x, x), _mm256_setzero_ps(), _CMP_NEQ_UQ)) ==
         0;
}
static inline float reduce_max(V v) { return hmax256(v); }
static inline float reduce_add(V v) { return hadd256(v); }
static inline V iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
static inline V exp(V x) { return exp256(x); }
static inline V exp_small(V x) { return exp256<false>(x); }  // x <= 64 or NaN
static inline V tanh(V x) { return tanh256(x); }
static inline V load_f16(const uint16_t* p) { return load_f16_256(p); }
static inline void store_f16(uint16_t* p, V x) { store_f16_256(p, x); }
static inline V load_bf16(const uint16_t* p) { return load_bf16_256(p); }
// bfloat16 rows read in place in the "bf16 order" (load-inl.h): the even-indexed elements of W,
// then the odd ones, by one load (the 16 bytes broadcast to both halves) and one byte shuffle
// (AVX2 has no word permute across the halves, AVX-512's natural-order load).
static inline int bf16_to_top(int a) {  // a byte shuffle's control: bytes a, a + 1 to the top half
  return int(0x8080u | unsigned(a) << 16 | unsigned(a + 1) << 24);
}
static inline V load_bf16_ordered(const uint16_t* p) {
  const __m256i x =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i ctl =
      _mm256_setr_epi32(bf16_to_top(0), bf16_to_top(4), bf16_to_top(8), bf16_to_top(12),
                        bf16_to_top(2), bf16_to_top(6), bf16_to_top(10), bf16_to_top(14));
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(x, ctl));
}
static inline V to_bf16_order(V v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}
static inline V from_bf16_order(V v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
// W 1-byte KV codes: int8 as its value; fp8 as its float16 view (e4m3fn: the value / 256);
// load_e4m3_in_place: e4m3fn rows read in place, none of whose codes is the NaN code, without its
// test. With 16 registers and W = 8 the test costs more than a pass over each tile's codes for the
// NaN code (bench/NOTES.md): the tile is checked first (kE4m3TestInWidening).
constexpr bool kE4m3TestInWidening = false;
static inline V load_i8(const int8_t* p) { return load_i8_256(p); }
static inline V load_fp8(const uint8_t* p, bool e4) { return load_fp8_256(p, e4); }
static inline V load_e4m3_in_place(const uint8_t* p) { return load_e4m3_finite_256(p); }
// out[t] = horizontal sum of a[t], t < 8; hsum8_split: sums 0-3 at lo, 4-7 at hi
static ATTNX_INLINE void hsum8(const V* a, float* out) { _mm256_storeu_ps(out, hsum8x256(a)); }
static ATTNX_INLINE void hsum8_split(const V* a, float* lo, float* hi) {
  store_halves(hsum8x256(a), lo, hi);
}

}  // namespace simd
}  // namespace avx2
}  // namespace attnx
