// dispatch.cpp: CPU detection, the instruction-set choice (once, at first use, or forced by
// ATTNX_ISA), and the thread-count policy.
#include "attnx/dispatch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "attnx/attention.h"
#include "kernels/kernels.h"
#include "parallel.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace attnx {

namespace {

// ---- aarch64 --------------------------------------------------------------------------------
// The ARM features: Linux reports them in the auxiliary vector (the kernel's HWCAP bits, which
// also say the kernel enables them: SVE's state is saved only if HWCAP_SVE is set), macOS in
// sysctl's hw.optional.* names. Advanced SIMD is part of the AArch64 baseline.
#if defined(__aarch64__)
#if defined(__linux__)
// <asm/hwcap.h>'s bit numbers, for C libraries whose headers predate them
constexpr unsigned long kHwcapAsimd = 1ul << 1, kHwcapAsimddp = 1ul << 20, kHwcapSve = 1ul << 22;
constexpr unsigned long kHwcap2I8mm = 1ul << 13, kHwcap2Bf16 = 1ul << 14;
void arm_features(CpuFeatures& f) {
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.neon = (hw & kHwcapAsimd) != 0;
  f.dotprod = (hw & kHwcapAsimddp) != 0;
  f.sve = (hw & kHwcapSve) != 0;
  f.i8mm = (hw2 & kHwcap2I8mm) != 0;
  f.bf16 = (hw2 & kHwcap2Bf16) != 0;
}
#elif defined(__APPLE__)
bool sysctl_flag(const char* name) {
  int v = 0;
  size_t n = sizeof v;
  return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
}
void arm_features(CpuFeatures& f) {
  f.neon = true;
  f.dotprod = sysctl_flag("hw.optional.arm.FEAT_DotProd");
  f.bf16 = sysctl_flag("hw.optional.arm.FEAT_BF16");
  f.i8mm = sysctl_flag("hw.optional.arm.FEAT_I8MM");
  f.sve = false;  // no Apple core has SVE
}
#else
void arm_features(CpuFeatures& f) { f.neon = true; }
#endif
#else
void arm_features(CpuFeatures&) {}
#endif

}  // namespace

CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  __builtin_cpu_init();
  f.sse2 = __builtin_cpu_supports("sse2");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
  arm_features(f);
  return f;
}

namespace {

std::atomic<const kern::KernelTable*> g_table{nullptr};
std::atomic<int> g_threads{0};

bool has_avx2(const CpuFeatures& f) { return f.avx2 && f.fma && f.f16c; }
bool has_avx512(const CpuFeatures& f) { return has_avx2(f) && f.avx512f; }
bool has_avx512bf16(const CpuFeatures& f) {
  return has_avx512(f) && f.avx512bw && f.avx512vl && f.avx512bf16;
}

// The wide kernels' tables exist only where CMake compiled them (x86-64: ATTNX_X86_KERNELS);
// nothing else names them, so another build does not link against them. Elsewhere every
// feature above reads false, except on 32-bit x86, which gets the portable path too.
enum class Wide { avx2, avx512, avx512bf16 };
#if defined(ATTNX_X86_KERNELS) && ATTNX_X86_KERNELS
constexpr bool kWideKernels = true;
const kern::KernelTable* wide_table(Wide w) {
  switch (w) {
    case Wide::avx2: return kern::table_avx2();
    case Wide::avx512: return kern::table_avx512();
    case Wide::avx512bf16: break;
  }
  return kern::table_avx512bf16();
}
#else
constexpr bool kWideKernels = false;
const kern::KernelTable* wide_table(Wide) {
  throw InvalidArgument("this build of attnx has only the portable scalar kernels (not an x86-64 build)");
}
#endif

// The NEON table exists only in aarch64 builds (ATTNX_NEON_KERNELS), and every aarch64 CPU has
// Advanced SIMD, so there it is the default.
#if defined(ATTNX_NEON_KERNELS) && ATTNX_NEON_KERNELS
constexpr bool kNeonKernels = true;
const kern::KernelTable* neon_table() { return kern::table_neon(); }
#else
constexpr bool kNeonKernels = false;
const kern::KernelTable* neon_table() {
  throw InvalidArgument("ATTNX_ISA=neon: this build of attnx has no NEON kernels (not an aarch64 build)");
}
#endif

const kern::KernelTable* table_for(const std::string& name, const CpuFeatures& f) {
  if (name == "scalar") return kern::table_scalar();
  if (name == "neon") {
    if (kNeonKernels && !f.neon) throw InvalidArgument("ATTNX_ISA=neon: this CPU lacks Advanced SIMD");
    return neon_table();
  }
  if (name == "avx2") {
    if (!has_avx2(f)) throw InvalidArgument("ATTNX_ISA=avx2: this CPU lacks AVX2, FMA or F16C");
    return wide_table(Wide::avx2);
  }
  if (name == "avx512") {
    if (!has_avx512(f)) throw InvalidArgument("ATTNX_ISA=avx512: this CPU lacks AVX-512F");
    return wide_table(Wide::avx512);
  }
  if (name == "avx512bf16") {
    if (!has_avx512bf16(f))
      throw InvalidArgument("ATTNX_ISA=avx512bf16: this CPU lacks AVX512_BF16 (or AVX-512BW/VL)");
    return wide_table(Wide::avx512bf16);
  }
  throw InvalidArgument("unknown instruction set '" + name +
                        "' (expected scalar, avx2, avx512, avx512bf16 or neon)");
}

const kern::KernelTable* best_table() {
  const CpuFeatures f = cpu_features();
  if (kNeonKernels && f.neon) return neon_table();
  if (!kWideKernels) return kern::table_scalar();
  if (has_avx512bf16(f)) return wide_table(Wide::avx512bf16);
  if (has_avx512(f)) return wide_table(Wide::avx512);
  if (has_avx2(f)) return wide_table(Wide::avx2);
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

namespace {

// OMP_NUM_THREADS's first entry ("8" or "8,2" for nested levels), as OpenMP reads it; 0 when it is
// unset or malformed. Read at each call: attnx documented "follows OMP_NUM_THREADS at call time"
// when it ran on OpenMP, and os.environ changes reach getenv.
int omp_num_threads_env() {
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env == nullptr) return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  while (end != env && (*end == ' ' || *end == '\t')) ++end;
  if (end == env || (*end != '\0' && *end != ',') || v < 1) return 0;
  return int(std::min<long>(v, kThreadLimit));
}

// Every thread count passes here: at most max_threads(), which is never below 4 (so the common
// small counts skip its affinity system call).
int capped(int n) { return n <= 4 ? n : std::min(n, max_threads()); }

}  // namespace

void set_num_threads(int n) { g_threads.store(n < 0 ? 0 : n); }
int get_num_threads() {
  int n = g_threads.load();
  if (n <= 0) n = omp_num_threads_env();
  return capped(n > 0 ? n : available_cpus());
}
int resolve_threads(int requested) { return requested > 0 ? capped(requested) : get_num_threads(); }

}  // namespace attnx
