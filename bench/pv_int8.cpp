// pv_int8.cpp: what O += P V costs over int8 value codes on this core, three ways, for a decode
// tile of 4 query rows (a GQA-4 kv head) x 64 keys x 128 features, codes in L1 (bench/NOTES.md,
// issue 33, "int8 decode on Zen 4"):
//   float: the codes widened (vpmovsxbd, vcvtdq2ps) and 4 rows of FMAs: what attnx runs;
//   bf16:  P rounded to bf16 and the codes made key-interleaved bf16 pairs (|code| looked up with
//          two vpermi2b, the sign OR-ed in), vdpbf16ps: P V inside issue 33's contract;
//   int16: P quantised per row to int16 against its largest p, the codes sign-extended into
//          key-interleaved int16 pairs, vpdpwssd: integer P V, outside the contract.
// The pair forms permute the features within 128-bit lanes (consistently); the check compares
// each row's sum. ns per key (all 4 rows and 128 features), best of 20 runs of 20000 tiles.
// Standalone (no attnx sources), x86-64 with AVX512-BF16, -VNNI and -VBMI:
// (one command, the kernel units' flags and -mavx512vbmi; GCC 12's own headers warn uninitialized)
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx512vnni -mavx512vbmi -mavx2 -mfma
//       bench/pv_int8.cpp -o pv_int8 && ./pv_int8
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
constexpr int K = 64, D = 128, M = 4;
alignas(64) int8_t V[K][D];
alignas(64) float P[M][K];
alignas(64) float O[M][D];

__attribute__((noinline)) void pv_float(float* o) {
  for (int c = 0; c < D; c += 64) {  // 4 vectors per pass, 4 rows: 16 accumulators
    __m512 acc[M][4];
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_load_ps(o + r * D + c + 16 * k);
    for (int j = 0; j < K; ++j) {
      __m512 v[4];
      for (int k = 0; k < 4; ++k)
        v[k] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(&V[j][c + 16 * k]))));
      for (int r = 0; r < M; ++r) {
        __m512 p = _mm512_set1_ps(P[r][j]);
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_fmadd_ps(p, v[k], acc[r][k]);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < 4; ++k) _mm512_store_ps(o + r * D + c + 16 * k, acc[r][k]);
  }
}

// bf16: for each key pair, the 2 x 128 codes -> 8 zmm of (v_j[d], v_j+1[d]) bf16 pairs (d permuted
// within 128-bit lanes, consistently), via |code| lookups of bf16's high and low bytes.
alignas(64) uint8_t LOB[128], HIB[128];
__attribute__((noinline)) void pv_bf16(float* o) {
  const __m512i tlo0 = _mm512_load_si512(LOB), tlo1 = _mm512_load_si512(LOB + 64);
  const __m512i thi0 = _mm512_load_si512(HIB), thi1 = _mm512_load_si512(HIB + 64);
  alignas(64) int32_t pp[M][K / 2];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < K; j += 32) {
      __m512bh b = _mm512_cvtne2ps_pbh(_mm512_load_ps(&P[r][j + 16]), _mm512_load_ps(&P[r][j]));
      // pairs (p_j, p_j+1) in order: vcvtne2ps gives [a0..a15, b0..b15]; permute into pairs
      const __m512i idx =
          _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                           13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      _mm512_store_si512(&pp[r][j / 2], _mm512_permutexvar_epi16(idx, (__m512i)b));
    }
  __m512 acc[M][8];
  for (int r = 0; r < M; ++r)
    for (int k = 0; k < 8; ++k) acc[r][k] = _mm512_load_ps(o + r * D + 16 * k);
  for (int j = 0; j < K; j += 2) {
    __m512i w[8];
    for (int h = 0; h < 2; ++h) {  // 64 features at a time
      const __m512i a = _mm512_load_si512(&V[j][64 * h]), b = _mm512_load_si512(&V[j + 1][64 * h]);
      const __m512i il[2] = {_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b)};
      for (int u = 0; u < 2; ++u) {
        const __m512i x = il[u], ax = _mm512_abs_epi8(x);
        const __m512i lo = _mm512_permutex2var_epi8(tlo0, ax, tlo1);
        __m512i hi = _mm512_permutex2var_epi8(thi0, ax, thi1);
        hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8(char(0x80)),
                                       0xF8);  // hi | (x & 0x80)
        w[4 * h + 2 * u] = _mm512_unpacklo_epi8(lo, hi);
        w[4 * h + 2 * u + 1] = _mm512_unpackhi_epi8(lo, hi);
      }
    }
    for (int r = 0; r < M; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pp[r][j / 2]);
      for (int k = 0; k < 8; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], (__m512bh)w[k], p);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int k = 0; k < 8; ++k) _mm512_store_ps(o + r * D + 16 * k, acc[r][k]);
}

// int16: P quantised per row (max -> 32767), codes -> int16 pairs (unpack + sign-extend), vpdpwssd
__attribute__((noinline)) void pv_i16(float* o) {
  alignas(64) int32_t pp[M][K / 2];
  float sc[M];
  for (int r = 0; r < M; ++r) {
    __m512 mx = _mm512_setzero_ps();
    for (int j = 0; j < K; j += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(&P[r][j]));
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 f = _mm512_set1_ps(32767.f / m);
    sc[r] = m / 32767.f;
    for (int j = 0; j < K; j += 16)
      _mm256_store_si256(
          (__m256i*)((int16_t*)pp[r] + j),
          _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(&P[r][j]), f))));
  }
  for (int c = 0; c < D; c += 64) {
    __m512i acc[M][4];
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_si512();
    for (int j = 0; j < K; j += 2) {
      __m512i w[4];
      for (int h = 0; h < 2; ++h) {
        const __m256i a = _mm256_load_si256((const __m256i*)&V[j][c + 32 * h]),
                      b = _mm256_load_si256((const __m256i*)&V[j + 1][c + 32 * h]);
        w[2 * h] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
        w[2 * h + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
      }
      for (int r = 0; r < M; ++r) {
        const __m512i p = _mm512_set1_epi32(pp[r][j / 2]);
        for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpwssd_epi32(acc[r][k], w[k], p);
      }
    }
    for (int r = 0; r < M; ++r) {
      const __m512 s = _mm512_set1_ps(sc[r]);
      for (int k = 0; k < 4; ++k) {
        float* dst = o + r * D + c + 16 * k;
        _mm512_store_ps(dst,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][k]), s, _mm512_load_ps(dst)));
      }
    }
  }
}

template <class F> double bench(F f, const char* name) {
  double best = 1e30;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20000; ++i) f(&O[0][0]);
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / 20000 / K;
    if (ns < best) best = ns;
  }
  printf("%-6s %.2f ns a key (%.0f cycles at 3.69 GHz)\n", name, best, best * 3.69);
  return best;
}
int main() {
  for (int j = 0; j < K; ++j)
    for (int d = 0; d < D; ++d) V[j][d] = int8_t((j * 37 + d * 11) % 255 - 127);
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < K; ++j) P[r][j] = std::exp(-0.05f * ((j * 7 + r) % 64));
  for (int x = 0; x < 128; ++x) {
    float f = float(x);
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t b = uint16_t(u >> 16);
    LOB[x] = b & 0xff;
    HIB[x] = b >> 8;
  }
  // each variant once from O = 0, against the float32 sums
  float ref[M][D] = {};
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < K; ++j)
      for (int d = 0; d < D; ++d) ref[r][d] += P[r][j] * V[j][d];
  auto check = [&](void (*f)(float*), const char* n) {
    memset(O, 0, sizeof O);
    f(&O[0][0]);
    double worst = 0;  // the largest difference of a row's sum, over the row's sum of |o|
    for (int r = 0; r < M; ++r) {
      double s = 0, s_ref = 0, mag = 0;
      for (int d = 0; d < D; ++d) s += O[r][d], s_ref += ref[r][d], mag += std::fabs(ref[r][d]);
      worst = std::fmax(worst, std::fabs(s - s_ref) / mag);
    }
    printf("%-6s row sums within %.2g of float32's (relative to the row's sum of |o|)\n", n, worst);
  };
  check(pv_float, "float");
  check(pv_bf16, "bf16");
  check(pv_i16, "int16");
  for (int k = 0; k < 2; ++k) {
    bench(pv_float, "float");
    bench(pv_bf16, "bf16");
    bench(pv_i16, "int16");
  }
}
