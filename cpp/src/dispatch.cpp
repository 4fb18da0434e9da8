// dispatch.cpp: CPU detection, the instruction-set choice (once, at first use, or forced by
// ATTNX_ISA), and the thread-count policy.
#include "attnx/dispatch.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attnx/attention.h"
#include "kernels/kernels.h"

namespace attnx {

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
#endif
  return f;
}

namespace {

std::atomic<const kern::KernelTable*> g_table{nullptr};
std::atomic<int> g_threads{0};

const kern::KernelTable* table_for(const std::string& name, const CpuFeatures& f) {
  if (name == "scalar") return kern::table_scalar();
  if (name == "avx2") {
    if (!(f.avx2 && f.fma && f.f16c))
      throw InvalidArgument("ATTNX_ISA=avx2: this CPU lacks AVX2, FMA or F16C");
    return kern::table_avx2();
  }
  if (name == "avx512") {
    if (!(f.avx512f && f.avx2 && f.fma && f.f16c))
      throw InvalidArgument("ATTNX_ISA=avx512: this CPU lacks AVX-512F");
    return kern::table_avx512();
  }
  throw InvalidArgument("unknown instruction set '" + name + "' (expected scalar, avx2 or avx512)");
}

const kern::KernelTable* best_table() {
  const CpuFeatures f = cpu_features();
  if (f.avx512f && f.avx2 && f.fma && f.f16c) return kern::table_avx512();
  if (f.avx2 && f.fma && f.f16c) return kern::table_avx2();
  return kern::table_scalar();
}

}  // namespace

const kern::KernelTable* active_table() {
  const kern::KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    t = g_table.load();
    if (t == nullptr) {
      const char* env = std::getenv("ATTNX_ISA");
      t = (env != nullptr && *env != '\0') ? table_for(env, cpu_features()) : best_table();
      g_table.store(t, std::memory_order_release);
    }
  }
  return t;
}

const char* active_isa() { return active_table()->name; }

void set_isa(const std::string& name) {
  g_table.store(name == "auto" ? best_table() : table_for(name, cpu_features()),
                std::memory_order_release);
}

void set_num_threads(int n) { g_threads.store(n < 0 ? 0 : n); }
int get_num_threads() {
  const int n = g_threads.load();
  if (n > 0) return n;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
int resolve_threads(int requested) { return requested > 0 ? requested : get_num_threads(); }

}  // namespace attnx
