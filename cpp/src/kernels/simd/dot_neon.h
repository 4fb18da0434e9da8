// dot_neon.h: the dot-product vocabulary of the neon-bf16 unit (compiled with +bf16+dotprod),
// beside vec_neon.h's `simd`; the same operations as dot_avx512.h's, on 4 float lanes:
//   bf16 pairs (bf16_dot-inl.h): two bf16 values in 32 bits, the lower index in the low half, and
//     FEAT_BF16's BFDOT, which adds the two products of each pair to a float lane;
//   int8 codes (qk-inl.h, ATTNX_INT8_DOT): FEAT_DotProd's SDOT, which adds four signed byte
//     products to an int32 lane: keys and queries go in as they are (kKeyBias = 0).
#pragma once
#include <arm_neon.h>

#include <cstdint>

#include "vec_neon.h"

namespace attnx {
namespace neon {
namespace dot {
using simd::V;
using simd::W;

// ---- bf16 pairs --------------------------------------------------------------------------------
using PV = bfloat16x8_t;  // W pairs
static inline PV bcast_pair(const int32_t* p) { return vreinterpretq_bf16_s32(vld1q_dup_s32(p)); }
static inline PV load_pairs(const int32_t* p) { return vreinterpretq_bf16_s32(vld1q_s32(p)); }
// acc + a[2i] b[2i] + a[2i + 1] b[2i + 1] in lane i (BFDOT: each product exact in fp32, their sum
// and its addition rounded; bf16 subnormals flushed, as vdpbf16ps does)
static inline V dot_pairs(V acc, PV a, PV b) { return vbfdotq_f32(acc, a, b); }
// 2W floats (a then b) rounded to bf16 (BFCVTN: round to nearest even) as W pairs at dst
static inline void store_rounded(int32_t* dst, V a, V b) {
  vst1q_bf16(reinterpret_cast<bfloat16_t*>(dst), vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(a), b));
}
// The lanes from x's first, `left` of them: zero past it (reads only those)
static inline V load_upto(const float* x, int64_t left) {
  if (left >= W) return vld1q_f32(x);
  float t[W] = {};
  for (int64_t i = 0; i < left; ++i) t[i] = x[i];
  return vld1q_f32(t);
}
// W bf16 values: a bf16 row's own, or float32 ones rounded, zero past `left`
using H = uint16x4_t;
static inline H bf16_upto(const uint16_t* x, int64_t left) {
  if (left >= W) return vld1_u16(x);
  uint16_t t[W] = {};
  for (int64_t i = 0; i < left; ++i) t[i] = x[i];
  return vld1_u16(t);
}
static inline H round_upto(const float* x, int64_t left) {
  return vreinterpret_u16_bf16(vcvt_bf16_f32(load_upto(x, left)));
}
// the lanes of x that are inf or NaN (an all-ones exponent), or-ed with |
using Bad = uint16x4_t;
static inline Bad no_bad() { return vdup_n_u16(0); }
static inline Bad nonfinite(H x) {
  const uint16x4_t expo = vdup_n_u16(0x7f80);
  return vceq_u16(vand_u16(x, expo), expo);
}
static inline bool none(Bad b) { return vmaxv_u16(b) == 0; }
// W pairs (x[i], y[i]) at dst (ST2: interleaved)
static inline void store_zipped(int32_t* dst, H x, H y) {
  const uint16x4x2_t xy = {{x, y}};  // (clang's vst2_u16 is a macro: no braces in its call)
  vst2_u16(reinterpret_cast<uint16_t*>(dst), xy);
}
// W pairs (a[i], b[i]) of float32 rows rounded to bf16 (zero past `left`) at dst, and the
// lanes where either is inf or NaN
static inline Bad zip_rounded(int32_t* dst, const float* a, const float* b, int64_t left) {
  const H x = round_upto(a, left), y = round_upto(b, left);
  store_zipped(dst, x, y);
  return vorr_u16(nonfinite(x), nonfinite(y));
}
// x rounded to bf16 (round to nearest even), as float
static inline V round_bf16(V x) { return vcvt_f32_bf16(vcvt_bf16_f32(x)); }

// ---- int8 codes --------------------------------------------------------------------------------
using I8 = int8x16_t;    // kI8Bytes codes
using IAcc = int32x4_t;  // W int32 sums
constexpr int kI8Bytes = 16;
constexpr int kKeyBias = 0;   // load_keys's codes are the keys' own
constexpr int kQuadKeys = 4;  // keys per 4-row register block (qk_int8): 32 registers
static inline IAcc izero() { return vdupq_n_s32(0); }
static inline I8 load_codes(const int8_t* p) { return vld1q_s8(p); }
static inline I8 load_keys(const int8_t* p) { return vld1q_s8(p); }
// acc + the products of k's and q's bytes, four to a lane (both signed)
static inline IAcc idot(IAcc acc, I8 k, I8 q) { return vdotq_s32(acc, k, q); }
static inline V to_real(IAcc a) { return vcvtq_f32_s32(a); }
// (with no bias, nothing needs the codes' sums)
static inline int32_t code_sum(const int8_t*, int64_t) { return 0; }

}  // namespace dot
}  // namespace neon
}  // namespace attnx
