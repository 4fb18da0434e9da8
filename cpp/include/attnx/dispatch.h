// attnx/dispatch.h: CPU detection and the choice of instruction set for the kernels.
#pragma once
#include <string>

namespace attnx {

struct CpuFeatures {
  bool sse2 = true, avx2 = false, fma = false, f16c = false, avx512f = false;
  bool avx512bw = false, avx512vl = false, avx512bf16 = false;  // the avx512bf16 path needs all 3
};

CpuFeatures cpu_features();
// The active instruction set: "scalar", "avx2", "avx512" or "avx512bf16" (avx512, with bf16 dot
// products for bf16 prefill).
const char* active_isa();
// Forces an instruction set (as ATTNX_ISA does); throws InvalidArgument if the CPU lacks it.
void set_isa(const std::string& name);

// Threads: an explicit global setting (0 = the default at call time: OMP_NUM_THREADS if set, else
// the CPUs this process may run on). Every count is capped at max_threads() (parallel.h).
void set_num_threads(int n);
int get_num_threads();
int resolve_threads(int requested);  // requested > 0 wins, then the global setting, then default
int available_cpus();  // the CPUs this process may run on (sched_getaffinity), read at each call
int max_threads();     // the cap on every count: min(4 x available_cpus(), 1024); see parallel.h
// Workers of the calling thread's pool that have run a region (0 before any, or after a fork
// until the child's first multi-threaded call); for tests.
int pool_workers_used();

}  // namespace attnx
