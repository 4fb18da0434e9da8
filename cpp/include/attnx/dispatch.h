// attnx/dispatch.h: CPU detection and the choice of instruction set for the kernels.
#pragma once
#include <string>

namespace attnx {

struct CpuFeatures {
  bool sse2 = true, avx2 = false, fma = false, f16c = false, avx512f = false;
};

CpuFeatures cpu_features();
// The active instruction set: "scalar", "avx2" or "avx512".
const char* active_isa();
// Forces an instruction set (as ATTNX_ISA does); throws InvalidArgument if the CPU lacks it.
void set_isa(const std::string& name);

// Threads: an explicit global setting (0 = follow OpenMP's default at call time).
void set_num_threads(int n);
int get_num_threads();
int resolve_threads(int requested);  // requested > 0 wins, then the global setting, then OpenMP

}  // namespace attnx
