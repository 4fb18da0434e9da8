// vec_neon.h: the vector vocabulary on AArch64 Advanced SIMD (NEON: 4 fp32 lanes, fused
// multiply-add, 32 registers). Every operation here is in the AArch64 baseline (ARMv8.0-A: FMLA,
// FCVTL for float16, FDIV, the across-lane reductions), so this unit needs no compiler flags and
// runs on every aarch64 CPU. The operations keep the x86 vocabularies' semantics lane by lane (NaN
// in max's second operand passes, exp(-inf) = 0 exactly), so the shared body's rules hold here.
#pragma once
#include <arm_neon.h>
#include <cstdint>
#include <cstring>

#include "convert.h"

namespace attnx {
namespace neon {
namespace simd {

constexpr int W = 4;
using V = float32x4_t;
using Real = float;  // the type of a lane: what the kernels compute in

static inline V zero() { return vdupq_n_f32(0.f); }
static inline V set1(float x) { return vdupq_n_f32(x); }
static inline V load(const float* p) { return vld1q_f32(p); }
static inline void store(float* p, V v) { vst1q_f32(p, v); }
static inline V add(V a, V b) { return vaddq_f32(a, b); }
static inline V sub(V a, V b) { return vsubq_f32(a, b); }
static inline V mul(V a, V b) { return vmulq_f32(a, b); }
static inline V fmadd(V a, V b, V c) { return vfmaq_f32(c, a, b); }  // a * b + c, one rounding
// max(a, x) that lets a NaN in x through, like MAXPS with x as the second operand (FMAX would
// return NaN for a NaN in either): a > x ? a : x, lane by lane
static inline V max(V a, V x) { return vbslq_f32(vcgtq_f32(a, x), a, x); }
static inline V abs(V x) { return vabsq_f32(x); }
// s + b, but exactly b where b is -inf: a blocked score stays blocked even if s is NaN
static inline V mask_add(V s, V b) {
  return vbslq_f32(vceqq_f32(b, vdupq_n_f32(-__builtin_inff())), b, vaddq_f32(s, b));
}
// lane tests: greater(a, b) lane by lane (false for NaN lanes), or-ed, any lane set
using Mask = uint32x4_t;
static inline Mask greater(V a, V b) { return vcgtq_f32(a, b); }
static inline Mask mask_or(Mask a, Mask b) { return vorrq_u32(a, b); }
static inline bool any(Mask m) { return vmaxvq_u32(m) != 0; }
// true if every lane is finite: x - x is 0 for finite x and NaN for inf or NaN
static inline bool all_finite(V x) {
  return vminvq_u32(vceqq_f32(vsubq_f32(x, x), vdupq_n_f32(0.f))) != 0;
}
// the largest lane that is a number (FMAXNMV; NaN only if every lane is), and the sum
static inline float reduce_max(V v) { return vmaxnmvq_f32(v); }
static inline float reduce_add(V v) { return vaddvq_f32(v); }
static inline V iota() {
  static const float k[4] = {0, 1, 2, 3};
  return vld1q_f32(k);
}

// 2^f for |f| <= 1/2, highest power first: the x86 paths' polynomial (vec_avx_common.h,
// kExp2Poly: degree 6, 1.3 ulp in float32), so every path computes the same p to the ulp.
constexpr int kExp2Terms = 7;
constexpr float kExp2Poly[kExp2Terms] = {1.5354042e-4f, 1.3398790e-3f, 9.6184341e-3f, 5.5503327e-2f,
                                         2.4022648e-1f, 6.9314718e-1f, 1.0f};
// 2^f to 2.9e-6 relative (degree 4): the bf16 path's probabilities (kExp2PolyBf16, the same)
constexpr int kExp2TermsBf16 = 5;
constexpr float kExp2PolyBf16[kExp2TermsBf16] = {9.5828529e-3f, 5.5906426e-2f, 2.4024099e-1f,
                                                 6.9312418e-1f, 1.0f};

// tanh(x) / x - 1 = z P(z) below kTanhSmall: the x86 paths' polynomial (vec_avx_common.h)
constexpr int kTanhTerms = 5;
constexpr float kTanhPoly[kTanhTerms] = {-5.70498221e-3f, 2.06390824e-2f, -5.37397154e-2f,
                                         1.33314416e-1f, -3.33332807e-1f};
constexpr float kTanhSmall = 0.625f;

// exp as exp256 computes it (vec_avx_common.h): t = x log2(e) clamped to [-127, 128], n =
// round(t) by adding 1.5 * 2^23 + 127 (leaving n + 127 in the low mantissa bits, shifted into the
// exponent field as they are), f = t - n, 2^f by the polynomial. exp(-inf) = 0 exactly; FMAX/FMIN
// return NaN for a NaN operand, and NaN's shifted bits make 2^n = 0, so NaN stays NaN.
// Top = false: for x <= 64 (or NaN) only, which needs no clamp at the top. Poly: kExp2Poly, or the
// shorter kExp2PolyBf16 (exp_bf16).
template <bool Top = true, int Terms = kExp2Terms, const float* Poly = kExp2Poly>
static inline V exp_(V x) {
  V t = vmulq_f32(x, vdupq_n_f32(1.44269504088896341f));
  t = vmaxq_f32(t, vdupq_n_f32(-127.f));
  if constexpr (Top) t = vminq_f32(t, vdupq_n_f32(128.f));
  const V magic = vdupq_n_f32(12583039.f);  // 1.5 * 2^23 + 127
  const V biased = vaddq_f32(t, magic);
  const V f = vsubq_f32(t, vsubq_f32(biased, magic));
  V p = vdupq_n_f32(Poly[0]);
  for (int i = 1; i < Terms; ++i) p = vfmaq_f32(vdupq_n_f32(Poly[i]), p, f);
  const uint32x4_t e = vshlq_n_u32(vreinterpretq_u32_f32(biased), 23);
  return vmulq_f32(p, vreinterpretq_f32_u32(e));
}
static inline V exp(V x) { return exp_<true>(x); }
static inline V exp_small(V x) { return exp_<false>(x); }  // x <= 64 or NaN
// exp(x) for x <= 64 (or NaN) to 2.9e-6 relative: for probabilities rounded to bf16 (2^-8)
static inline V exp_bf16(V x) { return exp_<false, kExp2TermsBf16, kExp2PolyBf16>(x); }

// tanh as tanh256 computes it (vec_avx_common.h): the exp form for |x| >= kTanhSmall, x + x z P(z)
// below it.
static inline V tanh(V x) {
  const uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u));
  const V ax = vabsq_f32(x);
  const V e = exp(vaddq_f32(ax, ax));
  const V big =
      vsubq_f32(vdupq_n_f32(1.0f), vdivq_f32(vdupq_n_f32(2.0f), vaddq_f32(e, vdupq_n_f32(1.0f))));
  const V z = vmulq_f32(ax, ax);
  V s = vdupq_n_f32(kTanhPoly[0]);
  for (int i = 1; i < kTanhTerms; ++i) s = vfmaq_f32(vdupq_n_f32(kTanhPoly[i]), s, z);
  s = vfmaq_f32(ax, vmulq_f32(s, z), ax);
  const V r = vbslq_f32(vcltq_f32(ax, vdupq_n_f32(kTanhSmall)), s, big);
  return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(r), sign));
}

// float16 and bfloat16 storage, widened as it is loaded (FCVTL; a shift for bfloat16)
static inline V load_f16(const uint16_t* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
static inline void store_f16(uint16_t* p, V x) {  // cvt's rounding and NaN, lane by lane
  float t[4];
  vst1q_f32(t, x);
  for (int i = 0; i < 4; ++i) p[i] = cvt::f32_to_f16(t[i]);
}
static inline V load_bf16(const uint16_t* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
// bfloat16 in the "bf16 order" (vec_avx512.h): the natural one (the widening is one shift).
static inline V load_bf16_ordered(const uint16_t* p) { return load_bf16(p); }
static inline V to_bf16_order(V v) { return v; }
static inline V from_bf16_order(V v) { return v; }
// W 1-byte KV codes: int8 as its value; fp8 as its float16 view (e4m3fn: the value / 256; the
// rule of vec_avx_common.h's fp8_as_f16_128, on sign-extended 16-bit lanes); load_e4m3_in_place:
// e4m3fn rows read in place, none of whose codes is the NaN code, without its test, the tile
// checked for the code first (kE4m3TestInWidening: avx2's choice, unmeasured on ARM)
constexpr bool kE4m3TestInWidening = false;
static inline int16x4_t load4_s8_as_s16(const void* p) {
  int32_t u;
  std::memcpy(&u, p, 4);
  return vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(u))));
}
static inline int16x4_t e4m3_as_f16_s16(int16x4_t x) {
  return vand_s16(vshl_n_s16(x, 7), vdup_n_s16(-0x4001));  // ~0x4000
}
static inline V load_i8(const int8_t* p) { return vcvtq_f32_s32(vmovl_s16(load4_s8_as_s16(p))); }
static inline V load_fp8(const uint8_t* p, bool e4) {
  const int16x4_t x = load4_s8_as_s16(p);
  int16x4_t h;
  if (!e4) {
    h = vshl_n_s16(x, 8);
  } else {
    h = e4m3_as_f16_s16(x);
    const uint16x4_t nan = vceq_s16(vand_s16(h, vdup_n_s16(0x3f80)), vdup_n_s16(0x3f80));
    h = vorr_s16(h, vand_s16(vreinterpret_s16_u16(nan), vdup_n_s16(0x7e00)));
  }
  return vcvt_f32_f16(vreinterpret_f16_s16(h));
}
static inline V load_e4m3_in_place(const uint8_t* p) {
  return vcvt_f32_f16(vreinterpret_f16_s16(e4m3_as_f16_s16(load4_s8_as_s16(p))));
}

// The sums of four vectors' lanes as one vector: three pairwise adds (FADDP)
static ATTNX_INLINE V hsum4(const V* a) {
  return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}
// out[t] = horizontal sum of a[t], t < 8; hsum8_split: sums 0-3 at lo, 4-7 at hi
static ATTNX_INLINE void hsum8(const V* a, float* out) {
  vst1q_f32(out, hsum4(a));
  vst1q_f32(out + 4, hsum4(a + 4));
}
static ATTNX_INLINE void hsum8_split(const V* a, float* lo, float* hi) {
  vst1q_f32(lo, hsum4(a));
  vst1q_f32(hi, hsum4(a + 4));
}

// dst[c * ldd + r] = rows r0..r3 lane c, for c < 4 (a 4 x 4 transpose: TRN1/TRN2 on 32- then
// 64-bit elements)
static ATTNX_INLINE void transpose4x4_store(V r0, V r1, V r2, V r3, float* dst, int64_t ldd) {
  const V t0 = vtrn1q_f32(r0, r1), t1 = vtrn2q_f32(r0, r1);
  const V t2 = vtrn1q_f32(r2, r3), t3 = vtrn2q_f32(r2, r3);
  auto lo = [](V a, V b) {
    return vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b)));
  };
  auto hi = [](V a, V b) {
    return vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b)));
  };
  vst1q_f32(dst + 0 * ldd, lo(t0, t2));
  vst1q_f32(dst + 1 * ldd, lo(t1, t3));
  vst1q_f32(dst + 2 * ldd, hi(t0, t2));
  vst1q_f32(dst + 3 * ldd, hi(t1, t3));
}
// 8 x 8 transpose as four 4 x 4 blocks: dst[c * ldd + r] = src[r][col + c]
template <class Load>
static ATTNX_INLINE void transpose8x8_by(Load&& ld, float* dst, int64_t ldd) {
  for (int rb = 0; rb < 8; rb += 4)
    for (int cb = 0; cb < 8; cb += 4)
      transpose4x4_store(ld(rb, cb), ld(rb + 1, cb), ld(rb + 2, cb), ld(rb + 3, cb),
                         dst + cb * ldd + rb, ldd);
}
static inline void transpose8x8(const float* const* src, int64_t col, float* dst, int64_t ldd) {
  transpose8x8_by([&](int r, int c) { return vld1q_f32(src[r] + col + c); }, dst, ldd);
}
// transpose8x8 of float16 rows, widened as they are loaded
static inline void transpose8x8_f16(const uint16_t* const* src, int64_t col, float* dst,
                                    int64_t ldd) {
  transpose8x8_by([&](int r, int c) { return load_f16(src[r] + col + c); }, dst, ldd);
}

}  // namespace simd
}  // namespace neon
}  // namespace attnx
