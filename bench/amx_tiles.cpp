// amx_tiles.cpp: what AMX tile instructions cost on this core, the bf16 prefill kernel's tile work
// (cpp/src/kernels/amx-inl.h: QkSteps and PvSteps, the 2 x 2 blocking, its layouts) for one row
// pair (32 query rows) x one wide block (256 keys) at D = 64 without the softmax, and how 512-bit
// vector instructions share the core with tdpbf16ps (bench/NOTES.md, issue 33, 2026-12-03).
// Thread CPU time, best of 5 runs; ns per tdpbf16ps (a 16 x 16 x 32 product) or per tile moved.
// Every buffer is 64-byte aligned, as the kernel's are: tile rows that straddle cache lines cost
// 2-4x.
// Standalone (no attnx sources), Linux on x86-64 with AMX-BF16:
//   g++ -O2 -mamx-tile -mamx-bf16 bench/amx_tiles.cpp -o amx_tiles && ./amx_tiles
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <vector>

namespace {

using Pair = int32_t;  // two bf16
constexpr int64_t kD = 64, kTileK = 64, kWideKeys = 256, kNkb = kD / 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double thread_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e9 + double(t.tv_nsec);
}

// n elements of v (which holds n + 64) from a 64-byte boundary
template <class T>
T* aligned(std::vector<T>& v) {
  return reinterpret_cast<T*>((uintptr_t(v.data()) + 63) & ~uintptr_t(63));
}

// best of 5 runs of f(), divided by `per`
template <class F>
double best_ns(F f, double per) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = thread_ns();
    f();
    const double t = thread_ns() - t0;
    best = t < best ? t : best;
  }
  return best / per;
}

// ---- the kernel's blocks (amx-inl.h): C in tiles 0-3, A in 4-5, B in 6-7 ----
void c_zero() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
void c_store(float* c, int64_t ldc) {
  _tile_stored(0, c, ldc * 4);
  _tile_stored(1, c + 16, ldc * 4);
  _tile_stored(2, c + 16 * ldc, ldc * 4);
  _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}
void c_load(float* c, int64_t ldc) {
  _tile_loadd(0, c, ldc * 4);
  _tile_loadd(1, c + 16, ldc * 4);
  _tile_loadd(2, c + 16 * ldc, ldc * 4);
  _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
}
void c_dp(const Pair* a, int64_t lda, const Pair* b, int64_t ldb) {
  _tile_loadd(4, a, lda * 4);
  _tile_loadd(5, a + 16 * lda, lda * 4);
  _tile_loadd(6, b, ldb * 4);
  _tile_loadd(7, b + 16, ldb * 4);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// One wide block's packed K and V (pack_k_bf16 / pack_v_bf16 layouts: per 64-key tile, K as
// kTileK pairs a row per feature pair, then V as kD pairs a row per key pair).
constexpr int64_t kTilePack = kD / 2 * kTileK + kTileK / 2 * kD;

// S = Q K^T of a row pair over the block: 8 steps of 32 x 32 scores (QkSteps)
void qk_steps(const Pair* q, const Pair* kv, float* s) {
  for (int step = 0; step < 8; ++step) {
    const Pair* kp = kv + step / 2 * kTilePack;
    const int64_t c = step % 2 * 32;
    c_zero();
    for (int64_t kb = 0; kb < kNkb; ++kb)
      c_dp(q + kb * 16, kD / 2, kp + kb * 16 * kTileK + c, kTileK);
    c_store(s + step / 2 * kTileK + c, kWideKeys);
  }
}

// O += P V of a row pair over the block: 2 column pairs x 4 steps of 2 key blocks (PvSteps)
void pv_steps(const Pair* p, const Pair* kv, float* o) {
  for (int step = 0; step < 8; ++step) {
    const int64_t c = step / 4 * 32, kb0 = step % 4 * 2;
    if (kb0 == 0) c_load(o + c, kD);
    for (int64_t kb = kb0; kb < kb0 + 2; ++kb) {
      const Pair* vp = kv + kb / 2 * kTilePack + kD / 2 * kTileK;
      c_dp(p + kb * 16, kWideKeys, vp + kb % 2 * 16 * kD + c, kD);
    }
    if (kb0 + 2 == 8) c_store(o + c, kD);
  }
}

// ---- single instructions ----
double tdp_alone() {
  return best_ns(
      [] {
        for (int i = 0; i < 100000; ++i) {
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      },
      400000);
}

// tile loads cycling over kib KiB (1 KiB a tile, contiguous), with one tdp per load or none
double loads(int64_t kib, bool with_tdp) {
  std::vector<char> buf(std::size_t(kib * 1024 + 64), 0);
  const char* b = reinterpret_cast<const char*>((uintptr_t(buf.data()) + 63) & ~uintptr_t(63));
  return best_ns(
      [&] {
        int64_t t = 0;
        for (int i = 0; i < 100000; ++i) {
          const char* at = b + t * 4096;
          _tile_loadd(4, at, 64);
          _tile_loadd(5, at + 1024, 64);
          _tile_loadd(6, at + 2048, 64);
          _tile_loadd(7, at + 3072, 64);
          if (with_tdp) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          t = (t + 1) % (kib / 4);
        }
      },
      400000);
}

double stores() {
  std::vector<float> buf(16 * 1024 / 4 + 64);
  float* b = aligned(buf);
  return best_ns(
      [&] {
        for (int i = 0; i < 100000; ++i) c_store(b + i % 4 * 32 * 16, 16);  // rows of 64 bytes
      },
      400000);
}

// 16 k independent 512-bit FMAs (or additions) an iteration, with one tdpbf16ps or without:
// while a tile product runs, FMA-unit instructions issue at about half their rate
#define ATTNX_R16(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
template <bool Add>
double vector_ops(int k, bool with_tdp) {
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-7f);
#define ATTNX_DECL(i) __m512 a##i = _mm512_set1_ps(1.f + 0.01f * i);
  ATTNX_R16(ATTNX_DECL)
  return best_ns(
      [&] {
        for (int i = 0; i < 100000; ++i) {
          if (with_tdp) _tile_dpbf16ps(0, 4, 6);
          for (int j = 0; j < k; ++j) {
#define ATTNX_OP(i) a##i = Add ? _mm512_add_ps(a##i, m) : _mm512_fmadd_ps(a##i, m, c);
            ATTNX_R16(ATTNX_OP)
          }
#define ATTNX_KEEP(i) __asm__ volatile("" : "+v"(a##i));
          ATTNX_R16(ATTNX_KEEP)
        }
      },
      100000);
}

}  // namespace

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::puts("AMX refused by the kernel");
    return 1;
  }
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
  std::printf("tdpbf16ps, 4 independent accumulators: %5.2f ns each\n", tdp_alone());
  for (int64_t kib : {16, 256})
    std::printf("tile loads over %3lld KiB: %5.2f ns each alone, %5.2f with a tdp each\n",
                static_cast<long long>(kib), loads(kib, false), loads(kib, true));
  std::printf("tile stores (L1): %5.2f ns each\n", stores());
  // the kernel's tile work, K and V cycled over `blocks` wide blocks (1: in L1 and L2; 8: L2)
  std::vector<Pair> q0(32 * kD / 2 + 64, 0x3c003c00);
  std::vector<float> s0(2 * 32 * kWideKeys + 64, 0.f), o0(32 * kD + 64, 0.f);
  const Pair* q = aligned(q0);
  float *s = aligned(s0), *o = aligned(o0);
  for (int64_t blocks : {1, 8}) {
    std::vector<Pair> kv0(std::size_t(blocks * 4 * kTilePack + 64), 0x3c003c00);
    const Pair* kv = aligned(kv0);
    constexpr int kIters = 2000;
    auto run = [&](bool qk, bool pv) {
      for (int it = 0; it < kIters; ++it) {
        const Pair* blk = kv + it % blocks * 4 * kTilePack;
        float* s_next = s + it % 2 * 32 * kWideKeys;
        const Pair* p = reinterpret_cast<const Pair*>(s + (it + 1) % 2 * 32 * kWideKeys);
        if (pv) pv_steps(p, blk, o);
        if (qk) qk_steps(q, blk, s_next);
      }
    };
    const double both = best_ns([&] { run(true, true); }, kIters * 128.0);
    const double qk = best_ns([&] { run(true, false); }, kIters * 64.0);
    const double pv = best_ns([&] { run(false, true); }, kIters * 64.0);
    std::printf("kernel steps, K/V over %lld block(s): QK %5.2f, PV %5.2f, both %5.2f ns a tdp\n",
                static_cast<long long>(blocks), qk, pv, both);
  }
  for (int k : {1, 2, 4})
    std::printf("%2d FMAs: %5.2f ns alone, %5.2f with a tdp; %2d adds: %5.2f, %5.2f\n", 16 * k,
                vector_ops<false>(k, false), vector_ops<false>(k, true), 16 * k,
                vector_ops<true>(k, false), vector_ops<true>(k, true));
}
