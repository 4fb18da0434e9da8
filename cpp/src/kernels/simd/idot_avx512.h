// idot_avx512.h: the integer dot products of the units with AVX512-VNNI (avx512vnni, and through
// dot_avx512.h avx512bf16 and amx; they compile it with -mavx512vnni -mavx512bw -mavx512vl besides
// the avx512 flags), beside vec_avx512.h's `simd`: int8 codes (qk-inl.h, ATTNX_INT8_DOT) and
// vpdpbusd, which adds four byte products to an int32 lane, unsigned by signed: the keys go in
// as code + 128 (kKeyBias). The lanes keep `simd`'s order (V: 16 floats).
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "vec_avx512.h"

namespace attnx {
namespace avx512 {
namespace dot {
using simd::V;
using simd::W;

using I8 = __m512i;    // kI8Bytes codes
using IAcc = __m512i;  // W int32 sums
constexpr int kI8Bytes = 64;
constexpr int kKeyBias = 128;  // load_keys's codes are the keys' + kKeyBias
constexpr int kQuadKeys = 4;   // keys per 4-row register block (qk_int8): 32 registers
static inline IAcc izero() { return _mm512_setzero_si512(); }
static inline I8 load_codes(const int8_t* p) { return _mm512_loadu_si512(p); }
// (the sign bit flipped: code + 128 as an unsigned byte)
static inline I8 load_keys(const int8_t* p) {
  return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(char(0x80)));
}
// acc + the products of k's and q's bytes, four to a lane (k unsigned, q signed)
static inline IAcc idot(IAcc acc, I8 k, I8 q) { return _mm512_dpbusd_epi32(acc, k, q); }
static inline V to_real(IAcc a) { return _mm512_cvtepi32_ps(a); }
// the sum of n codes (n a multiple of kI8Bytes)
static inline int32_t code_sum(const int8_t* q, int64_t n) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t d = 0; d < n; d += kI8Bytes) acc = _mm512_dpbusd_epi32(acc, ones, load_codes(q + d));
  return _mm512_reduce_add_epi32(acc);
}

}  // namespace dot
}  // namespace avx512
}  // namespace attnx
