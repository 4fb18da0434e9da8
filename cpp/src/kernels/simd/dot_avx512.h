// dot_avx512.h: the dot-product vocabulary of the avx512bf16 and amx units (they compile it with
// -mavx512bf16 -mavx512vnni besides the avx512 flags), beside vec_avx512.h's `simd`:
//   bf16 pairs (bf16_dot-inl.h): two bf16 values in 32 bits, the lower index in the low half, and
//     AVX512_BF16's vdpbf16ps, which adds the two products of each pair to a float lane;
//   int8 codes (qk-inl.h, ATTNX_INT8_DOT): AVX512-VNNI's vpdpbusd, in idot_avx512.h (which the
//     avx512vnni unit includes alone).
// Every operation keeps the lane order of `simd` (V: 16 floats), so the shared bodies index alike.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "idot_avx512.h"
#include "vec_avx512.h"

namespace attnx {
namespace avx512 {
namespace dot {
using simd::V;
using simd::W;

// ---- bf16 pairs --------------------------------------------------------------------------------
using PV = __m512bh;  // W pairs
static inline PV bcast_pair(const int32_t* p) { return (PV)_mm512_set1_epi32(*p); }
static inline PV load_pairs(const int32_t* p) { return (PV)_mm512_loadu_si512(p); }
// acc + a[2i] b[2i] + a[2i + 1] b[2i + 1] in lane i (each product exact in fp32, bf16 subnormals
// flushed)
static inline V dot_pairs(V acc, PV a, PV b) { return _mm512_dpbf16_ps(acc, a, b); }
// 2W floats (a then b) rounded to bf16 (round to nearest even) as W pairs at dst
static inline void store_rounded(int32_t* dst, V a, V b) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}
// The lanes from x's first, `left` of them: zero past it (masked: reads only those)
static inline __mmask16 lanes_upto(int64_t left) {
  return left >= W ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}
static inline V load_upto(const float* x, int64_t left) {
  return _mm512_maskz_loadu_ps(lanes_upto(left), x);
}
// W bf16 values of a bf16 row, zero past `left`
using H = __m256i;
static inline H bf16_upto(const uint16_t* x, int64_t left) {
  return _mm256_maskz_loadu_epi16(lanes_upto(left), x);
}
// the lanes of x that are inf or NaN (an all-ones exponent), or-ed with |
using Bad = __mmask16;
static inline Bad no_bad() { return 0; }
static inline Bad nonfinite(H x) {
  const __m256i expo = _mm256_set1_epi16(0x7f80);
  return _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, expo), expo);
}
static inline bool none(Bad b) { return b == 0; }
// W pairs (x[i], y[i]) at dst
static inline void store_zipped(int32_t* dst, H x, H y) {
  const __m512i lo = _mm512_cvtepu16_epi32(x), hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(y), 16);
  _mm512_storeu_si512(dst, _mm512_or_si512(lo, hi));
}
// W pairs (a[i], b[i]) rounded to bf16 at dst, and the lanes where either is inf or NaN: both
// rounded by one vcvtne2ps2bf16, zipped by one vpermw
static inline Bad zip_round(int32_t* dst, V a, V b) {
  const __m512i x = (__m512i)_mm512_cvtne2ps_pbh(b, a);
  const __m512i expo = _mm512_set1_epi16(0x7f80);
  const __mmask32 bad = _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, expo), expo);
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, x));
  return Bad(bad) | Bad(bad >> 16);
}
// the same of float32 rows, zero past `left`
static inline Bad zip_rounded(int32_t* dst, const float* a, const float* b, int64_t left) {
  return zip_round(dst, load_upto(a, left), load_upto(b, left));
}
// x rounded to bf16 (round to nearest even), as float
static inline V round_bf16(V x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// ---- the decode tiles' operands (amx_decode-inl.h) ---------------------------------------------
// A float already rounded to bf16 (round_bf16: its low 16 bits zero), moved to the low half of
// its 32 bits: the bf16 in the low half, zero in the high one.
static inline V low_half(V rounded) {
  return _mm512_castsi512_ps(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
}
// W floats at p, p + stride, ..., p + (W - 1) stride (stride in floats): a column of a row-major
// block
static inline V gather_column(const float* p, int stride) {
  const __m512i at =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(stride));
  return _mm512_i32gather_ps(at, p, 4);
}
// W int32 at p, p + stride, ..., as floats (exact below 2^24: sums of code products)
static inline V int_column(const int32_t* p, int stride) {
  return _mm512_cvtepi32_ps(
      _mm512_castps_si512(gather_column(reinterpret_cast<const float*>(p), stride)));
}
// 2W consecutive floats (a, then b) as their even-indexed elements and their odd-indexed ones
// (unzip), and back (zip)
static inline void unzip(V a, V b, V* even, V* odd) {
  const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i o = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  *even = _mm512_permutex2var_ps(a, e, b);
  *odd = _mm512_permutex2var_ps(a, o, b);
}
static inline void zip(V even, V odd, V* a, V* b) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  *a = _mm512_permutex2var_ps(even, lo, odd);
  *b = _mm512_permutex2var_ps(even, hi, odd);
}

}  // namespace dot
}  // namespace avx512
}  // namespace attnx
