// idot_avx2.h: the integer dot products of the avx2vnni unit (compiled with -mavxvnni besides the
// avx2 flags), beside vec_avx2.h's `simd`: int8 codes (qk-inl.h, ATTNX_INT8_DOT) and AVX-VNNI's
// vpdpbusd (the VEX form, 256 bits), which adds four byte products to an int32 lane, unsigned by
// signed: the keys go in as code + 128 (kKeyBias). The lanes keep `simd`'s order (V: 8 floats).
// ATTNX_VNNI_EVEX (the avx2vnni-evex unit, for tests on CPUs with AVX512-VNNI but not AVX-VNNI):
// the same instruction in its EVEX form (AVX512-VNNI with AVX512VL), the same sums.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "vec_avx2.h"

namespace attnx {
namespace avx2 {
namespace dot {
using simd::V;
using simd::W;

using I8 = __m256i;    // kI8Bytes codes
using IAcc = __m256i;  // W int32 sums
constexpr int kI8Bytes = 32;
constexpr int kKeyBias = 128;  // load_keys's codes are the keys' + kKeyBias
// keys per 4-row register block (qk_int8): 4 x 2 sums, 4 query and 1 key vector in 16 registers
constexpr int kQuadKeys = 2;
static inline IAcc izero() { return _mm256_setzero_si256(); }
static inline I8 load_codes(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// (the sign bit flipped: code + 128 as an unsigned byte)
static inline I8 load_keys(const int8_t* p) {
  return _mm256_xor_si256(load_codes(p), _mm256_set1_epi8(char(0x80)));
}
// acc + the products of k's and q's bytes, four to a lane (k unsigned, q signed)
static inline IAcc idot(IAcc acc, I8 k, I8 q) {
#if defined(ATTNX_VNNI_EVEX)
  return _mm256_dpbusd_epi32(acc, k, q);
#else
  return _mm256_dpbusd_avx_epi32(acc, k, q);
#endif
}
static inline V to_real(IAcc a) { return _mm256_cvtepi32_ps(a); }
// the sum of n codes (n a multiple of kI8Bytes)
static inline int32_t code_sum(const int8_t* q, int64_t n) {
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i acc = _mm256_setzero_si256();
  for (int64_t d = 0; d < n; d += kI8Bytes) acc = idot(acc, ones, load_codes(q + d));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace dot
}  // namespace avx2
}  // namespace attnx
