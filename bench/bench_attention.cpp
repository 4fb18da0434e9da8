// bench_attention.cpp: google-benchmark cases for the C++ core, named <op>_<dtype>_<isa>, with
// rate counters (FLOP/s for prefill, bytes/s of K and V read for decode) so the output reads as
// throughput. The shapes are those of `python -m attnx bench` (python/attnx/bench.py), without
// the Python call overhead. Threads: attnx's default (OMP_NUM_THREADS or all cores).
//
//   bench_attention --benchmark_filter='decode_.*_avx2'      one family on one ISA
//   ATTNX_BENCH_REPS=5 bench_attention                        repetitions, medians reported
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnx/attention.h"
#include "attnx/dispatch.h"
#include "attnx/paged.h"
#include "attnx/probes.h"

namespace {

using attnx::DType;

// A small, fast generator (xorshift32): filling hundreds of MB with std::mt19937 took longer
// than the benchmarks themselves.
struct XorShift {
  uint32_t s;
  explicit XorShift(uint32_t seed) : s(seed * 2654435761u + 1u) {}
  uint32_t operator()() {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    return s;
  }
};

// Storage for one tensor of `dtype`, filled with normal-range random values. Half-precision
// values are drawn as bit patterns (exponent for |x| in [1/4, 2)), so no conversion code is
// needed and every value is exactly representable.
struct Buffer {
  std::vector<uint8_t> bytes;
  DType dtype;
  Buffer(int64_t n, DType t, uint32_t seed)
      : bytes(std::size_t(n) * attnx::dtype_size(t)), dtype(t) {
    XorShift rng(seed);
    if (t == DType::f32) {
      float* p = reinterpret_cast<float*>(bytes.data());
      for (int64_t i = 0; i < n; ++i)
        p[i] = float(int32_t(rng() >> 8) - (1 << 23)) * (1.f / (1 << 23));
      return;
    }
    uint16_t* p = reinterpret_cast<uint16_t*>(bytes.data());
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t r = rng();
      const uint16_t sign = uint16_t((r & 1u) << 15);
      if (t == DType::f16)  // exponent 13..16 (bias 15), 10 mantissa bits
        p[i] = uint16_t(sign | ((13 + ((r >> 1) & 3u)) << 10) | ((r >> 3) & 0x3ffu));
      else  // bfloat16: exponent 125..128 (bias 127), 7 mantissa bits
        p[i] = uint16_t(sign | ((125 + ((r >> 1) & 3u)) << 7) | ((r >> 3) & 0x7fu));
    }
  }
  void* data() { return bytes.data(); }
};

const char* dtype_tag(DType t) {
  return t == DType::f32 ? "f32" : t == DType::f16 ? "f16" : "bf16";
}

// Selects the ISA for this case; false (and the case reports an error) if the CPU lacks it.
bool use_isa(benchmark::State& state, const std::string& isa) {
  try {
    attnx::set_isa(isa);
  } catch (const std::exception& e) {
    state.SkipWithError(("CPU lacks " + isa + ": " + e.what()).c_str());
    return false;
  }
  return true;
}

void common_counters(benchmark::State& state, int threads) { state.counters["threads"] = threads; }

// Dense attention, bhsd contiguous: prefill (self-attention over S tokens).
void bm_dense(benchmark::State& state, std::string isa, DType dt, int64_t B, int64_t Hq,
              int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D, bool causal, bool padded) {
  if (!use_isa(state, isa)) return;
  Buffer q(B * Hq * Sq * D, dt, 1), k(B * Hkv * Sk * D, dt, 2), v(B * Hkv * Sk * D, dt, 3),
      out(B * Hq * Sq * D, dt, 4);
  attnx::AttentionParams p;
  p.B = B;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.Sq = Sq;
  p.Sk = Sk;
  p.Dk = D;
  p.Dv = D;
  p.dtype = dt;
  p.q = {q.data(), Hq * Sq * D, Sq * D, D};
  p.k = {k.data(), Hkv * Sk * D, Sk * D, D};
  p.v = {v.data(), Hkv * Sk * D, Sk * D, D};
  p.out = out.data();
  p.o_sb = Hq * Sq * D;
  p.o_sh = Sq * D;
  p.o_ss = D;
  p.causal = causal;
  p.scale = 1.f / std::sqrt(float(D));
  p.num_threads = attnx::resolve_threads(0);
  // padded: an encoder batch whose sequences have kv_lens random in [Sk/2, Sk] (fixed seed)
  std::vector<int32_t> kv_lens(static_cast<std::size_t>(B), static_cast<int32_t>(Sk));
  if (padded) {
    std::mt19937 rng(6);
    std::uniform_int_distribution<int32_t> u(int32_t(Sk / 2), int32_t(Sk));
    for (auto& x : kv_lens) x = u(rng);
    p.kv_lens = kv_lens.data();
  }
  const double keys = std::accumulate(kv_lens.begin(), kv_lens.end(), 0.0);
  for (auto _ : state) {
    attnx::attention(p);
    benchmark::ClobberMemory();
  }
  // causal halves the work only for the square case the suite uses
  const double flops = 4.0 * double(Hq) * double(Sq) * keys * double(D) / (causal ? 2 : 1);
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  common_counters(state, p.num_threads);
}

// Paged decode: one new query token per sequence against L cached tokens in scrambled pages.
void bm_decode(benchmark::State& state, std::string isa, DType kv, int64_t B, int64_t Hq,
               int64_t Hkv, int64_t L, int64_t D, int64_t bs) {
  if (!use_isa(state, isa)) return;
  const int64_t nper = (L + bs - 1) / bs, nb = B * nper;
  Buffer q(B * Hq * D, DType::f32, 1), out(B * Hq * D, DType::f32, 2);
  Buffer kp(nb * Hkv * bs * D, kv, 3), vp(nb * Hkv * bs * D, kv, 4);
  // a random permutation of the pool, as after a while of allocating and freeing
  std::vector<int32_t> table(static_cast<std::size_t>(nb));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(5));
  std::vector<int32_t> seq_lens(static_cast<std::size_t>(B), static_cast<int32_t>(L));
  std::vector<int64_t> q_start(static_cast<std::size_t>(B + 1));
  for (int64_t b = 0; b <= B; ++b) q_start[std::size_t(b)] = b;
  attnx::PagedParams p;
  p.B = B;
  p.N = B;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.Dk = D;
  p.Dv = D;
  p.q_dtype = DType::f32;
  p.kv_dtype = kv;
  p.q = q.data();
  p.q_sn = Hq * D;
  p.q_sh = D;
  p.k_pages = kp.data();
  p.v_pages = vp.data();
  p.num_blocks = nb;
  p.block_size = bs;
  p.k_sblk = p.v_sblk = Hkv * bs * D;
  p.k_sh = p.v_sh = bs * D;
  p.k_ss = p.v_ss = D;
  p.block_tables = table.data();
  p.bt_stride = nper;
  p.max_blocks = nper;
  p.seq_lens = seq_lens.data();
  p.q_start = q_start.data();
  p.causal = true;
  p.scale = 1.f / std::sqrt(float(D));
  p.out = out.data();
  p.o_sn = Hq * D;
  p.o_sh = D;
  p.num_threads = attnx::resolve_threads(0);
  for (auto _ : state) {
    attnx::paged_attention(p);
    benchmark::ClobberMemory();
  }
  const double bytes =
      2.0 * double(B * Hkv) * double(L) * double(D) * double(attnx::dtype_size(kv));
  state.counters["B/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate,
                                             benchmark::Counter::kIs1000);
  state.counters["tok/s"] =
      benchmark::Counter(double(B), benchmark::Counter::kIsIterationInvariantRate);
  common_counters(state, p.num_threads);
}

// The machine's limits with each ISA's kernels (the denominators of the Python table).
void bm_probe_fma(benchmark::State& state, std::string isa, int threads) {
  if (!use_isa(state, isa)) return;
  double g = 0;
  for (auto _ : state) g = attnx::probe_fma_gflops(threads, 0.2);
  state.counters["FLOP/s"] = benchmark::Counter(g * 1e9);
  common_counters(state, threads);
}

void bm_probe_read(benchmark::State& state, std::string isa) {
  if (!use_isa(state, isa)) return;
  const int threads = attnx::resolve_threads(0);
  double g = 0;
  for (auto _ : state) g = attnx::probe_read_gbps(threads, int64_t(1) << 30, 0.3);
  state.counters["B/s"] =
      benchmark::Counter(g * 1e9, benchmark::Counter::kDefaults, benchmark::Counter::kIs1000);
  common_counters(state, threads);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int reps = std::getenv("ATTNX_BENCH_REPS") ? std::atoi(std::getenv("ATTNX_BENCH_REPS")) : 1;
  auto tune = [reps](benchmark::internal::Benchmark* b) {
    b->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
    if (reps > 1) b->Repetitions(reps)->ReportAggregatesOnly(true);
    return b;
  };
  const int all = attnx::resolve_threads(0);
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  for (const std::string isa : {"scalar", "avx2", "avx512"}) {
    const std::string s = "_" + isa;
    benchmark::RegisterBenchmark(("probe_fma_1thread_f32" + s).c_str(), bm_probe_fma, isa, 1)
        ->Iterations(1)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("probe_fma_f32" + s).c_str(), bm_probe_fma, isa, all)
        ->Iterations(1)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("probe_read_f32" + s).c_str(), bm_probe_read, isa)
        ->Iterations(1)
        ->UseRealTime();
    for (DType dt : dtypes)  // B1 H8 S2048 D64, non-causal
      tune(benchmark::RegisterBenchmark(("prefill_" + std::string(dtype_tag(dt)) + s).c_str(),
                                        bm_dense, isa, dt, 1, 8, 8, 2048, 2048, 64, false, false));
    tune(benchmark::RegisterBenchmark(("prefill_gqa_causal_f32" + s).c_str(), bm_dense, isa,
                                      DType::f32, 1, 32, 8, 2048, 2048, 128, true, false));
    tune(benchmark::RegisterBenchmark(("encoder_f32" + s).c_str(), bm_dense, isa, DType::f32, 4, 12,
                                      12, 512, 512, 64, false, true));
    for (DType dt : dtypes)  // B8 Hq32 Hkv8, 2048 tokens, D128, block 16
      tune(benchmark::RegisterBenchmark(("decode_" + std::string(dtype_tag(dt)) + s).c_str(),
                                        bm_decode, isa, dt, 8, 32, 8, 2048, 128, 16));
    tune(benchmark::RegisterBenchmark(("decode_long_f32" + s).c_str(), bm_decode, isa, DType::f32,
                                      1, 32, 8, 32768, 128, 16));
    tune(benchmark::RegisterBenchmark(("small_f32" + s).c_str(), bm_dense, isa, DType::f32, 1, 1, 1,
                                      1, 16, 64, false, false))
        ->Unit(benchmark::kMicrosecond);
  }
  // bf16 dot products (issue 13): the bf16 prefill shapes on the avx512bf16 path, beside the
  // avx512 rows above (fp32, and bf16 widened to fp32)
  tune(benchmark::RegisterBenchmark("prefill_bf16_avx512bf16", bm_dense, "avx512bf16", DType::bf16,
                                    1, 8, 8, 2048, 2048, 64, false, false));
  tune(benchmark::RegisterBenchmark("prefill_gqa_causal_bf16_avx512bf16", bm_dense, "avx512bf16",
                                    DType::bf16, 1, 32, 8, 2048, 2048, 128, true, false));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
