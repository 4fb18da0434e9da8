// attnx/probes.h: small measurements of the machine's limits, used by the benchmark table.
#pragma once
#include <cstdint>

namespace attnx {

// Peak FP32 fused multiply-add throughput in GFLOP/s, with the active instruction set.
double probe_fma_gflops(int num_threads, double seconds);
// Sustained read bandwidth in GB/s, streaming a buffer of `bytes` (much larger than the caches).
double probe_read_gbps(int num_threads, int64_t bytes, double seconds);

}  // namespace attnx
