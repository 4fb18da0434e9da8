// convert.h: portable scalar float16 / bfloat16 <-> float32 conversions (round to nearest even).
// Everything here is `static inline` so each translation unit keeps its own copy, compiled with
// its own instruction-set flags (see the note in kernels/tables.h).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attnx {
namespace cvt {

static inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal half: value = man * 2^-24
    float f = float(man) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow -> inf
  if (u < 0x38800000u) {                                  // subnormal or zero half
    // value * 2^24 rounded to nearest even integer is the subnormal mantissa
    float a = bits_to_float(u) * 16777216.0f;
    uint32_t m = uint32_t(a);
    float rem = a - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t exp = ((u >> 23) - 112) << 10, man = (u >> 13) & 0x3ffu;
  uint32_t h = exp | man, rest = u & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: fine
  return uint16_t(sign | h);
}

// ---- fp8 (ml_dtypes float8_e4m3fn: bias 7, 3 mantissa bits, no inf, NaN = S.1111.111;
// float8_e5m2: bias 15, 2 mantissa bits, IEEE-like: the top byte of a float16) ------------------
static inline float e5m2_to_f32(uint8_t b);

// An e4m3fn code with its 7 magnitude bits moved to float16's exponent and mantissa fields is
// the same number scaled by 2^(7 - 15) (subnormals included): decode through float16, times 256.
// Its NaN code (magnitude 0x7f) becomes a float16 NaN (0x7e00 or-ed in). The vector loads
// (vec_*.h, load_fp8) do the same, lane by lane.
static inline uint16_t e4m3_as_f16(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  return uint16_t(((b & 0x80u) << 8) | (mag << 7) | (mag == 0x7fu ? 0x7e00u : 0u));
}
static inline float e4m3_to_f32(uint8_t b) { return f16_to_f32(e4m3_as_f16(b)) * 256.f; }
static inline uint16_t e5m2_as_f16(uint8_t b) { return uint16_t(uint16_t(b) << 8); }
static inline float e5m2_to_f32(uint8_t b) { return f16_to_f32(e5m2_as_f16(b)); }

// x (finite, |x| <= the format's largest finite value) to the fp8 code with `mbits` mantissa bits
// and exponent bias `bias`, rounded to nearest even (the quantised cache clips before this).
static inline uint8_t f32_to_fp8(float x, int mbits, int bias) {
  uint32_t u = float_to_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7fffffffu;
  uint32_t code;
  if (u < uint32_t(127 + 1 - bias) << 23) {
    // below the smallest normal: the code is |x| / 2^(1 - bias - mbits) rounded to an integer
    // (the power-of-two scaling is exact); 2^mbits is the smallest normal's code, as it should be
    const float step_inv = bits_to_float(uint32_t(127 + bias - 1 + mbits) << 23);
    code = uint32_t(std::nearbyint(bits_to_float(u) * step_inv));
  } else {
    const int shift =
        23 - mbits;  // round the float32 mantissa to mbits, carrying into the exponent
    u += ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u);
    code = (u >> shift) - (uint32_t(127 - bias) << mbits);
  }
  return uint8_t(sign | code);
}
static inline uint8_t f32_to_e4m3(float x) { return f32_to_fp8(x, 3, 7); }
static inline uint8_t f32_to_e5m2(float x) { return f32_to_fp8(x, 2, 15); }

}  // namespace cvt
}  // namespace attnx
