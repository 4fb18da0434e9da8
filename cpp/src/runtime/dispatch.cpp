// dispatch.cpp: CPU detection, the instruction-set choice (once, at first use, or forced by
// ATTNX_ISA), and the thread-count policy.
#include "attnx/dispatch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "attnx/attention.h"
#include "kernels/tables.h"
#include "runtime/parallel.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace attnx {

namespace {

#if defined(__x86_64__) || defined(__i386__)
// XCR0: the register states the OS saves (bits 17-18: the AMX tile configuration and data).
uint64_t xcr0() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  // no OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}
#endif

#if defined(__x86_64__) || defined(__i386__)
// Asks Linux for the AMX tile data state, once per process (a forked child and every thread
// inherit it). A refusal, or another OS, means no AMX: a tile instruction would be SIGILL.
bool request_amx() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}
#endif

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
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx512_vnni = f.avx512f && (c & (1u << 11));
    f.avx512_fp16 = f.avx512f && (d & (1u << 23));
    const bool tiles_saved = (xcr0() & (3u << 17)) == (3u << 17);
    f.amx_bf16 = tiles_saved && (d & (1u << 22));
    f.amx_tile = tiles_saved && (d & (1u << 24));
    f.amx_int8 = tiles_saved && (d & (1u << 25));
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (a >= 1 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) {
      f.avx_vnni = f.avx2 && (a1 & (1u << 4));
      f.amx_fp16 = tiles_saved && (a1 & (1u << 21));
    }
    f.amx_permitted = f.amx_tile && request_amx();
  }
#endif
  arm_features(f);
  return f;
}

namespace {

std::atomic<const kern::IsaTables*> g_table{nullptr};
std::atomic<int> g_threads{0};

bool has_avx2(const CpuFeatures& f) { return f.avx2 && f.fma && f.f16c; }
bool has_avx2vnni(const CpuFeatures& f) { return has_avx2(f) && f.avx_vnni; }
// AVX-512 with BW and VL, as every AVX-512 CPU but the Xeon Phi has (Skylake-SP and later, Zen 4
// and later): the bf16 loads (simd/vec_avx512.h) need BW
bool has_avx512(const CpuFeatures& f) {
  return has_avx2(f) && f.avx512f && f.avx512bw && f.avx512vl;
}
bool has_avx512vnni(const CpuFeatures& f) { return has_avx512(f) && f.avx512_vnni; }
bool has_avx512bf16(const CpuFeatures& f) { return has_avx512vnni(f) && f.avx512bf16; }
bool has_amx(const CpuFeatures& f) { return has_avx512bf16(f) && f.amx_bf16 && f.amx_permitted; }

// The wide kernels' tables exist only where CMake compiled them (x86-64: ATTNX_X86_KERNELS);
// nothing else names them, so another build does not link against them. Elsewhere every
// feature above reads false, except on 32-bit x86, which gets the portable path too.
enum class Wide {
  avx2,
  avx2vnni,
  avx2vnni_evex,
  avx512,
  avx512vnni,
  avx512bf16,
  amx,
  amx_emulated
};
#if defined(ATTNX_X86_KERNELS) && ATTNX_X86_KERNELS
constexpr bool kWideKernels = true;
const kern::IsaTables* wide_table(Wide w) {
  switch (w) {
    case Wide::avx2: return kern::isa_avx2();
    case Wide::avx2vnni: return kern::isa_avx2vnni();
    case Wide::avx2vnni_evex: return kern::isa_avx2vnni_evex();
    case Wide::avx512: return kern::isa_avx512();
    case Wide::avx512vnni: return kern::isa_avx512vnni();
    case Wide::avx512bf16: return kern::isa_avx512bf16();
    case Wide::amx_emulated: return kern::isa_amx_emulated();
    case Wide::amx: break;
  }
  return kern::isa_amx();
}
// Seconds per multiply-add of f(iters) (the fastest of 3 runs).
template <class Probe>
double seconds_per_mac(Probe f, int64_t iters, double macs_per_iter) {
  double best = 1e30;
  volatile float sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = sink + f(iters);
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count());
  }
  return best / (double(iters) * macs_per_iter);
}
double measure_bf16_dot_gain() {
  constexpr int64_t kIters = 4000;  // ~50k instructions of each: tens of microseconds
  const kern::ProbeKernels& p = *kern::isa_avx512bf16()->probes;
  p.fma512(kIters);  // (wakes the 512-bit units before either is timed)
  const double fma = seconds_per_mac(p.fma512, kIters, 12 * 16);
  const double dot = seconds_per_mac(p.bf16_dot, kIters, 12 * 32);
  return fma / dot;
}
#else
constexpr bool kWideKernels = false;
const kern::IsaTables* wide_table(Wide) {
  throw InvalidArgument(
      "this build of attnx has only the portable scalar kernels (not an x86-64 build)");
}
double measure_bf16_dot_gain() { return 0; }
#endif

// The NEON tables exist only in aarch64 builds (ATTNX_NEON_KERNELS), and every aarch64 CPU has
// Advanced SIMD, so there neon is the default; neon-bf16 where the CPU has BF16 and DotProd
// (BFDOT does twice FMLA's multiply-adds per instruction and issues at FMLA's rate on the
// Neoverse cores' published tables; unmeasured here, so no probe decides it as on x86).
bool has_neon_bf16(const CpuFeatures& f) { return f.neon && f.bf16 && f.dotprod; }
#if defined(ATTNX_NEON_KERNELS) && ATTNX_NEON_KERNELS
constexpr bool kNeonKernels = true;
const kern::IsaTables* neon_table(bool bf16) {
  return bf16 ? kern::isa_neon_bf16() : kern::isa_neon();
}
#else
constexpr bool kNeonKernels = false;
const kern::IsaTables* neon_table(bool bf16) {
  throw InvalidArgument(std::string("ATTNX_ISA=") + (bf16 ? "neon-bf16" : "neon") +
                        ": this build of attnx has no NEON kernels (not an aarch64 build)");
}
#endif

// Every path ATTNX_ISA and set_isa name: whether this CPU (and OS) can run it, what a refusal
// says it lacks, and its tables. (A build without NEON kernels refuses neon by the build, not
// the CPU: neon_table says so.)
struct NamedPath {
  const char* name;
  bool (*runs)(const CpuFeatures&);
  const char* lacks;
  const kern::IsaTables* (*table)();
};
const NamedPath kPaths[] = {
    {"scalar", [](const CpuFeatures&) { return true; }, "", &kern::isa_scalar},
    {"avx2", &has_avx2, "AVX2, FMA or F16C", [] { return wide_table(Wide::avx2); }},
    {"avx2vnni", &has_avx2vnni, "AVX-VNNI (or AVX2, FMA, F16C)",
     [] { return wide_table(Wide::avx2vnni); }},
    // avx2vnni's kernels over AVX512-VNNI's form of the instruction: for tests
    {"avx2vnni-evex", &has_avx512vnni, "AVX512-VNNI (or AVX-512F/BW/VL)",
     [] { return wide_table(Wide::avx2vnni_evex); }},
    {"avx512", &has_avx512, "AVX-512F/BW/VL", [] { return wide_table(Wide::avx512); }},
    {"avx512vnni", &has_avx512vnni, "AVX512-VNNI (or AVX-512F/BW/VL)",
     [] { return wide_table(Wide::avx512vnni); }},
    {"avx512bf16", &has_avx512bf16, "AVX512_BF16 (or AVX-512BW/VL/VNNI)",
     [] { return wide_table(Wide::avx512bf16); }},
    {"amx", &has_amx, "AMX-BF16 (or AVX512_BF16)", [] { return wide_table(Wide::amx); }},
    // the amx path's tile loop over emulated tiles: for tests
    {"amx-emulated", &has_avx512bf16, "AVX512_BF16 (or AVX-512BW/VL/VNNI)",
     [] { return wide_table(Wide::amx_emulated); }},
    {"neon", [](const CpuFeatures& f) { return !kNeonKernels || f.neon; }, "Advanced SIMD",
     [] { return neon_table(false); }},
    {"neon-bf16", [](const CpuFeatures& f) { return !kNeonKernels || has_neon_bf16(f); },
     "BF16 or DotProd", [] { return neon_table(true); }},
};

const kern::IsaTables* table_for(const std::string& name, const CpuFeatures& f) {
  if (name == "amx" && has_avx512bf16(f) && f.amx_bf16 && !f.amx_permitted)
    throw InvalidArgument("ATTNX_ISA=amx: the OS did not grant this process the AMX tile state");
  std::string names;
  for (const NamedPath& p : kPaths) {
    if (name == p.name) {
      if (!p.runs(f)) throw InvalidArgument("ATTNX_ISA=" + name + ": this CPU lacks " + p.lacks);
      return p.table();
    }
    names += std::string(names.empty() ? "" : ", ") + p.name;
  }
  throw InvalidArgument("unknown instruction set '" + name + "' (expected one of " + names + ")");
}

// The fastest path for every kind of call: AMX tiles for bf16 prefill where the OS allows them
// (the float32-widening kernels for the rest), else bf16 dot products where they measure faster
// than float32 FMAs (bf16_dot_gain), else the widest vectors, with VNNI's integer products for
// integer queries where the CPU has them.
const kern::IsaTables* best_table() {
  const CpuFeatures f = cpu_features();
  if (kNeonKernels && f.neon) return neon_table(has_neon_bf16(f));
  if (!kWideKernels) return kern::isa_scalar();
  if (has_amx(f)) return wide_table(Wide::amx);
  if (has_avx512bf16(f) && bf16_dot_gain() > kBf16DotGain) return wide_table(Wide::avx512bf16);
  if (has_avx512vnni(f)) return wide_table(Wide::avx512vnni);
  if (has_avx512(f)) return wide_table(Wide::avx512);
  if (has_avx2vnni(f)) return wide_table(Wide::avx2vnni);
  if (has_avx2(f)) return wide_table(Wide::avx2);
  return kern::isa_scalar();
}

}  // namespace

const kern::IsaTables* active_tables() {
  const kern::IsaTables* t = g_table.load(std::memory_order_acquire);
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

const char* active_isa() { return active_tables()->name; }

namespace {
std::atomic<int> g_int8_query{kInt8QueryAuto};
}  // namespace
void set_int8_query(int setting) {
  if (setting != kInt8QueryOff && setting != kInt8QueryOn && setting != kInt8QueryAuto)
    throw InvalidArgument("int8 query setting " + std::to_string(setting) +
                          ": expected 0 (off), 1 (on) or -1 (auto)");
  g_int8_query.store(setting, std::memory_order_relaxed);
}
int int8_query_setting() { return g_int8_query.load(std::memory_order_relaxed); }
bool int8_query() {
  const int setting = int8_query_setting();
  return setting == kInt8QueryAuto ? active_integer_products() : setting == kInt8QueryOn;
}
bool active_integer_products() { return active_tables()->integer_products; }

namespace {
std::atomic<bool> g_f32_bf16{false};
// int8 tiles: the mode (0 auto, 1 off, 2 emulate) and the fewest rows of an item that takes them
constexpr const char* kInt8TileModes[] = {"auto", "off", "emulate"};
// packed as mode * 16 + min_rows in one atomic, so that a call never reads half of a change
std::atomic<int> g_int8_tiles{kern::kInt8TileRows};
}  // namespace
void set_float32_bf16_products(bool on) { g_f32_bf16.store(on, std::memory_order_relaxed); }
bool float32_bf16_products() { return g_f32_bf16.load(std::memory_order_relaxed); }
bool active_bf16_products() { return active_tables()->bf16_products; }

void set_int8_tiles(const std::string& mode, int min_rows) {
  int m = 0;
  while (m < 3 && mode != kInt8TileModes[m]) ++m;
  if (m == 3)
    throw InvalidArgument("mode: expected 'auto', 'off' or 'emulate', got '" + mode + "'");
  // (above kDotRows + 1, items of a kv head that share its packed K tiles could disagree on
  // their layout: every packed-path item must take the tiles alike)
  if (min_rows < 1 || min_rows > kern::kDotRows + 1)
    throw InvalidArgument("min_rows: expected 1 .. " + std::to_string(kern::kDotRows + 1) +
                          ", got " + std::to_string(min_rows));
  g_int8_tiles.store(m * 16 + min_rows, std::memory_order_relaxed);
}
Int8TilesRule int8_tiles_rule() {
  const int v = g_int8_tiles.load(std::memory_order_relaxed);
  return Int8TilesRule{v / 16, v % 16};
}
std::string int8_tiles_mode() { return kInt8TileModes[int8_tiles_rule().mode]; }
int int8_tiles_min_rows() { return int8_tiles_rule().min_rows; }

Int8Tiles int8_tiles(int rows, Int8TilesRule rule) {
  if (rule.mode == 1 || rows < rule.min_rows) return Int8Tiles::none;
  if (rule.mode == 2) return Int8Tiles::emulated;
  static const bool amx_int8 = cpu_features().amx_int8;
  return amx_int8 && std::strcmp(active_tables()->name, "amx") == 0 ? Int8Tiles::amx
                                                                    : Int8Tiles::none;
}

double bf16_dot_gain() {
  static const double gain = has_avx512bf16(cpu_features()) ? measure_bf16_dot_gain() : 0.0;
  return gain;
}

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

// ATTNX_NUM_THREADS: attnx's own default, before OMP_NUM_THREADS (so attnx and the OpenMP
// libraries beside it can be given different counts); read at each call like it. Unset or blank:
// 0. Anything but one positive integer (blanks around it allowed) is refused, not ignored: the
// call raises ValueError (InvalidArgument) before any work.
int attnx_num_threads_env() {
  const char* env = std::getenv("ATTNX_NUM_THREADS");
  if (env == nullptr) return 0;
  const char* p = env;
  while (*p == ' ' || *p == '\t') ++p;
  if (*p == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(p, &end, 10);
  while (end != p && (*end == ' ' || *end == '\t')) ++end;
  if (end == p || *end != '\0' || v < 1)
    throw InvalidArgument(std::string("ATTNX_NUM_THREADS: expected a positive integer (or unset), "
                                      "got '") +
                          env + "'");
  return int(std::min<long>(v, kThreadLimit));
}

// Every thread count passes here: at most max_threads(), which is never below 4 (so the common
// small counts skip its affinity system call).
int capped(int n) { return n <= 4 ? n : std::min(n, max_threads()); }

}  // namespace

void set_num_threads(int n) { g_threads.store(n < 0 ? 0 : n); }
int get_num_threads() {
  int n = g_threads.load();
  if (n <= 0) n = attnx_num_threads_env();
  if (n <= 0) n = omp_num_threads_env();
  return capped(n > 0 ? n : available_cpus());
}
int resolve_threads(int requested) { return requested > 0 ? capped(requested) : get_num_threads(); }

}  // namespace attnx
