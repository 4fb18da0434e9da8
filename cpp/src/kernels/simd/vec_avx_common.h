// vec_avx_common.h: AVX2 helpers shared by the AVX2 and AVX-512 vocabularies (both translation
// units are compiled with -mavx2 -mfma -mf16c). Included inside the ISA's own namespace.
#pragma once
#include <immintrin.h>

// 2^f for |f| <= 1/2, highest power first: degree 6, constant term 1 (exp(0) = 1 exactly), fitted
// for relative error (2.0e-9 in exact arithmetic; 7.9e-8 = 1.3 ulp evaluated by Horner in
// float32: as accurate as a degree-7 Taylor series, one FMA shorter). Shared by the 8- and
// 16-lane exp.
constexpr int kExp2Terms = 7;
constexpr float kExp2Poly[kExp2Terms] = {1.5354042e-4f, 1.3398790e-3f, 9.6184341e-3f, 5.5503327e-2f,
                                         2.4022648e-1f, 6.9314718e-1f, 1.0f};

// 2^f for |f| <= 1/2 to 2.9e-6 relative (degree 4, fitted for relative error): the bf16 path's
// probabilities, which are rounded to bf16 (2^-8) before P V.
constexpr int kExp2TermsBf16 = 5;
constexpr float kExp2PolyBf16[kExp2TermsBf16] = {9.5828529e-3f, 5.5906426e-2f, 2.4024099e-1f,
                                                 6.9312418e-1f, 1.0f};

// tanh(x) / x - 1 = z P(z) for |x| < kTanhSmall, z = x^2, highest power first: degree 4, fitted
// for tanh's relative error (4.4e-9 in exact arithmetic; 0.7 ulp evaluated by Horner in float32).
// Above it the exp form's cancellation costs under a bit (it cost ~3 bits at the old 0.125).
constexpr int kTanhTerms = 5;
constexpr float kTanhPoly[kTanhTerms] = {-5.70498221e-3f, 2.06390824e-2f, -5.37397154e-2f,
                                         1.33314416e-1f, -3.33332807e-1f};
constexpr float kTanhSmall = 0.625f;

// exp on 8 lanes: t = x log2(e), n = round(t), f = t - n (|f| <= 1/2), 2^f by the polynomial
// above, 2^n through the exponent bits. t is clamped to [-127, 128]: n = -127 puts 0 in the
// exponent field, so exp(-inf) = 0 exactly (masked scores must weigh nothing) and anything below
// ~2^-126.5 flushes to 0; n = 128 gives inf (from x > 88.38, a little early). NaN stays NaN: every
// clamp puts t in the second operand of MAXPS/MINPS, and NaN's shifted bits make 2^n = 0.
// n is rounded by adding 1.5 * 2^23 + 127, which leaves round(t) + 127 in the low mantissa bits,
// shifted into the exponent field as they are: 14 instructions, against 16 with VROUNDPS and
// VCVTPS2DQ and a degree-7 polynomial (prefill's softmax is mostly this function).
// Top = false: for x <= 64 (or NaN) only, which needs no clamp at the top (one instruction less).
template <bool Top = true>
static inline __m256 exp256(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  t = _mm256_max_ps(_mm256_set1_ps(-127.f), t);
  if constexpr (Top) t = _mm256_min_ps(_mm256_set1_ps(128.f), t);
  const __m256 magic = _mm256_set1_ps(12583039.f);  // 1.5 * 2^23 + 127
  const __m256 biased = _mm256_add_ps(t, magic);
  const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(biased, magic));
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(biased), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)) for |x| >= 0.625, where that form loses at most a
// bit to cancellation; below, x + x z P(z) with z = x^2 and kTanhPoly (0.7 ulp in float32).
static inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 e = exp256(_mm256_add_ps(ax, ax));
  __m256 big =
      _mm256_sub_ps(_mm256_set1_ps(1.0f),
                    _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  const __m256 z = _mm256_mul_ps(ax, ax);
  __m256 s = _mm256_set1_ps(kTanhPoly[0]);
  for (int i = 1; i < kTanhTerms; ++i) s = _mm256_fmadd_ps(s, z, _mm256_set1_ps(kTanhPoly[i]));
  s = _mm256_fmadd_ps(_mm256_mul_ps(s, z), ax, ax);
  const __m256 small = _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ);
  __m256 r = _mm256_blendv_ps(big, s, small);
  // NaN: both branches are NaN already; the sign bit of NaN is irrelevant
  return _mm256_or_ps(r, sign);
}

static inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline float hadd256(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// out[t] = sum of the 8 lanes of a[t]: a transpose-and-add tree, 9 instructions for 8 sums.
static ATTNX_INLINE __m256 hsum8x256(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  t0 = _mm256_hadd_ps(t0, t1);  // lanes: a0..a3 partial sums, low half | high half
  t2 = _mm256_hadd_ps(t2, t3);  // a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}
static ATTNX_INLINE void store_halves(__m256 s, float* lo, float* hi) {
  _mm_storeu_ps(lo, _mm256_castps256_ps128(s));
  _mm_storeu_ps(hi, _mm256_extractf128_ps(s, 1));
}

// dst[c * ldd + r] = src[r][col + c] for an 8 x 8 block
// (rows r0 .. r7 already in registers)
static ATTNX_INLINE void transpose8x8_regs(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4,
                                           __m256 r5, __m256 r6, __m256 r7, float* dst,
                                           int64_t ldd) {
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * ldd, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// (transpose8x8 and transpose8x8_f16 are the vocabulary names of both ISAs: 8 x 8 blocks either
// way)
static inline void transpose8x8(const float* const* src, int64_t col, float* dst, int64_t ldd) {
  transpose8x8_regs(_mm256_loadu_ps(src[0] + col), _mm256_loadu_ps(src[1] + col),
                    _mm256_loadu_ps(src[2] + col), _mm256_loadu_ps(src[3] + col),
                    _mm256_loadu_ps(src[4] + col), _mm256_loadu_ps(src[5] + col),
                    _mm256_loadu_ps(src[6] + col), _mm256_loadu_ps(src[7] + col), dst, ldd);
}

static inline __m256 load_f16_256(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 float16s of x, rounded to nearest even (F16C), the bits cvt::f32_to_f16 gives (checked over
// every float): a NaN becomes the canonical quiet NaN with its sign, its payload dropped.
static inline void store_f16_256(uint16_t* p, __m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 canon = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.f)),
                                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(_mm256_blendv_ps(x, canon, nan),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// transpose8x8 of float16 rows, widened as they are loaded (no fp32 copy of the rows)
static inline void transpose8x8_f16(const uint16_t* const* src, int64_t col, float* dst,
                                    int64_t ldd) {
  transpose8x8_regs(load_f16_256(src[0] + col), load_f16_256(src[1] + col),
                    load_f16_256(src[2] + col), load_f16_256(src[3] + col),
                    load_f16_256(src[4] + col), load_f16_256(src[5] + col),
                    load_f16_256(src[6] + col), load_f16_256(src[7] + col), dst, ldd);
}
// 1-byte KV codes (see convert.h): 8 int8 to fp32; fp8 sign-extended to 16-bit lanes and made
// float16 bits (fp8_as_f16_*)
static inline __m256 load_i8_256(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// fp8 codes, sign-extended to 16 bits (x: s...s eeee mmm for e4m3fn, s...s eeeee mm for e5m2), as
// float16: e5m2 is float16's top byte. e4m3fn's float16 view is its value / 256 (same mantissa,
// exponent field 4 bits into 5, subnormals included): x << 7 puts eeee mmm in place and the sign
// at bits 15 and 14; clearing bit 14 leaves s 0 eeee mmm 0000000. The NaN codes (magnitude 0x7f)
// would read 1.75 / 256 that way (0x3f80) and become a float16 NaN (exponent all ones): adding 0x80
// carries into the cleared bit 14 for that magnitude alone, and h | that bit is 0x7f80, a float16
// NaN. 5 integer instructions, fewer than a zero-extended form (e4m3 decode's widening competes
// with its FMAs).
// e4m3_as_f16_*: the first two, for codes known to hold no NaN code (avx2's load_e4m3_in_place).
static inline __m128i e4m3_as_f16_128(__m128i x) {
  return _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16(-0x4001));  // ~0x4000
}
static inline __m256i e4m3_as_f16_256(__m256i x) {
  return _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16(-0x4001));
}
static inline __m128i fp8_as_f16_128(__m128i x, bool e4) {
  if (!e4) return _mm_slli_epi16(x, 8);
  const __m128i h = e4m3_as_f16_128(x);
  const __m128i carry = _mm_add_epi16(h, _mm_set1_epi16(0x80));
  return _mm_or_si128(h, _mm_and_si128(carry, _mm_set1_epi16(0x4000)));
}
static inline __m256i fp8_as_f16_256(__m256i x, bool e4) {
  if (!e4) return _mm256_slli_epi16(x, 8);
  const __m256i h = e4m3_as_f16_256(x);
  const __m256i carry = _mm256_add_epi16(h, _mm256_set1_epi16(0x80));
  return _mm256_or_si256(h, _mm256_and_si256(carry, _mm256_set1_epi16(0x4000)));
}
static inline __m256 load_fp8_256(const uint8_t* p, bool e4) {
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(fp8_as_f16_128(x, e4));
}
static inline __m256 load_e4m3_finite_256(const uint8_t* p) {
  const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(e4m3_as_f16_128(x));
}
static inline __m256 load_bf16_256(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
