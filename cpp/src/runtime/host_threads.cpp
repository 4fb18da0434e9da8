// host_threads.cpp: one set of threads for the BLAS matmul and the attention call that follows it.
//
// In a model's loop every attention call comes right after a matrix product. Under NumPy that
// product runs on OpenBLAS's pthreads pool, whose idle workers spin (sched_yield) for about
// 2^28 cycles, ~70 ms, after each call: attention started inside that window shares both cores
// with them (bench/NOTES.md measures it). OpenBLAS
// 0.3.28+ lets the program run its parallel regions on another pool instead
// (openblas_set_threads_callback_function). Handing it attnx's pool leaves one pool in the
// process: the matmul's threads are attnx's workers, which spin ~100 us and then sleep, and the
// attention call that follows finds them warm instead of fighting them.
//
// The callback's contract: run dojob(slot, jobdata + i * elsize, tag) for every i in [0, numjobs),
// all at the same time (OpenBLAS's level-3 jobs wait on each other's packed panels), and return
// when all are done. `slot` picks OpenBLAS's per-thread packing buffer and status word, so jobs
// running at the same time, in this call or in a concurrent one from another Python thread, must
// have different slots, each below the library's MAX_THREADS, and none that OpenBLAS's own
// threads use (take_slots and blas_callback).
//
// Both sharings find the libraries already loaded in the process (loaded_libraries): through the
// ELF loader's list (dl_iterate_phdr, <link.h>) on Linux and the BSDs, dyld's image list on
// macOS. Windows builds have neither sharing (both calls report none).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if !defined(_WIN32)
#include <dlfcn.h>
#endif
#if defined(__APPLE__)
#include <mach-o/dyld.h>
#elif !defined(_WIN32)
#include <link.h>
#endif

#include "runtime/parallel.h"

namespace attnx {
namespace {

// ---- the loaded libraries ---------------------------------------------------------------------

// The paths of the loaded shared objects whose path `match` accepts.
std::vector<std::string> loaded_libraries(bool (*match)(const char* path)) {
  std::vector<std::string> found;
#if defined(__APPLE__)
  for (uint32_t i = 0, n = _dyld_image_count(); i < n; ++i) {
    const char* name = _dyld_get_image_name(i);
    if (name != nullptr && match(name)) found.emplace_back(name);
  }
#elif !defined(_WIN32)
  struct Search {
    bool (*match)(const char*);
    std::vector<std::string>* found;
  } search{match, &found};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* arg) {
        const Search& s = *static_cast<Search*>(arg);
        if (info->dlpi_name != nullptr && s.match(info->dlpi_name))
          s.found->emplace_back(info->dlpi_name);
        return 0;
      },
      &search);
#else
  (void)match;
#endif
  return found;
}

// A handle on a library that is already loaded (never loads one: RTLD_NOLOAD), its symbols, and
// the handle's release (the library stays loaded).
void* open_loaded(const std::string& path) {
#if defined(_WIN32)
  (void)path;
  return nullptr;
#else
  return dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
#endif
}
void* find_symbol(void* lib, const char* name) {
#if defined(_WIN32)
  (void)lib, (void)name;
  return nullptr;
#else
  return dlsym(lib, name);
#endif
}
void close_loaded(void* lib) {
#if defined(_WIN32)
  (void)lib;
#else
  dlclose(lib);
#endif
}

using DoJob = void (*)(int thread_num, void* jobdata, int tag);
using Callback = void (*)(int sync, DoJob dojob, int numjobs, std::size_t elsize, void* jobdata,
                          int tag);
using SetCallback = void (*)(Callback);

// OpenBLAS's per-thread buffer slots in use by running jobs, one bit each; g_slot_limit is the
// smallest MAX_THREADS among the libraries handed the pool (their buffers' count).
std::atomic<uint64_t> g_slots{0};
std::atomic<int> g_slot_limit{64};

// Takes n free slots at once (all or none, so that two calls cannot each hold half of what they
// need), waiting while fewer are free; returns their bits.
uint64_t take_slots(int n, int limit) {
  for (;;) {
    uint64_t used = g_slots.load(std::memory_order_relaxed);
    uint64_t mine = 0;
    for (int s = 0, got = 0; s < limit && got < n; ++s) {
      if (!(used >> s & 1)) mine |= uint64_t(1) << s, ++got;
    }
    if (__builtin_popcountll(mine) == n &&
        g_slots.compare_exchange_weak(used, used | mine, std::memory_order_acquire))
      return mine;
    std::this_thread::yield();  // another call holds the slots (or the CAS raced): its jobs are
                                // short
  }
}

void give_slots(uint64_t mine) { g_slots.fetch_and(~mine, std::memory_order_release); }

struct Jobs {
  DoJob dojob;
  char* data;
  std::size_t elsize;
  int tag;
  int slot[64];
  void run(int i) const { dojob(slot[i], data + std::size_t(i) * elsize, tag); }
};

// Member i of the team runs job i. A team smaller than numjobs (no more threads could be made, or
// the call comes from inside an attnx region) gets the rest on threads of their own: running
// them one after another could wait forever.
void run_jobs(const Jobs& jobs, int numjobs, Team& team) {
  if (team.id() != 0) {
    jobs.run(team.id());
    return;
  }
  std::vector<std::thread> extra;  // the jobs that attnx's pool had no member for
  extra.reserve(std::size_t(numjobs));
  for (int i = team.size(); i < numjobs; ++i) {
    try {
      extra.emplace_back([&jobs, i] { jobs.run(i); });
    } catch (const std::system_error&) {
      std::fputs(
          "attnx: cannot start a thread for an OpenBLAS job (ATTNX_SHARE_BLAS=0 avoids this)\n",
          stderr);
      std::abort();  // as OpenBLAS itself does when its own pool cannot start
    }
  }
  jobs.run(0);
  for (std::thread& t : extra) t.join();
}

void blas_callback(int /*sync: always 1 (OpenBLAS waits for the call's return)*/, DoJob dojob,
                   int numjobs, std::size_t elsize, void* jobdata, int tag) {
  if (numjobs <= 0) return;
  const int limit = g_slot_limit.load(std::memory_order_relaxed);
  if (numjobs > limit) {  // cannot happen: numjobs <= MAX_THREADS
    std::fputs("attnx: an OpenBLAS call asked for more jobs than it has buffers\n", stderr);
    std::abort();
  }
  Jobs jobs{dojob, static_cast<char*>(jobdata), elsize, tag, {}};
  const uint64_t mine = take_slots(numjobs, limit);
  // Slots count down from the top: OpenBLAS's own threads, which it still uses for a few
  // asynchronous routines (getrf's panel work), hold the low indices of the same tables.
  for (int s = 0, i = 0; i < numjobs; ++s) {
    if (mine >> s & 1) jobs.slot[i++] = limit - 1 - s;
  }
  parallel(numjobs, [&](Team& team) { run_jobs(jobs, numjobs, team); });
  give_slots(mine);
}

// The loaded shared objects whose file name contains "openblas" (NumPy's and SciPy's wheels
// carry renamed copies such as libscipy_openblas64_-<hash>.so).
std::vector<std::string> loaded_openblas() {
  return loaded_libraries(
      [](const char* name) { return std::strstr(name, "openblas") != nullptr; });
}

// The setter's names in the builds people have: upstream, 64-bit-integer builds, and the
// scipy-openblas wheels that NumPy and SciPy ship (prefix scipy_, suffix 64_ for ILP64).
constexpr const char* kSetters[] = {
    "openblas_set_threads_callback_function",
    "openblas_set_threads_callback_function64_",
    "scipy_openblas_set_threads_callback_function",
    "scipy_openblas_set_threads_callback_function64_",
};

// The library's MAX_THREADS (its per-thread buffers), from openblas_get_config(); 0 if unknown.
int max_threads_of(void* lib) {
  for (const char* name : {"openblas_get_config", "openblas_get_config64_",
                           "scipy_openblas_get_config", "scipy_openblas_get_config64_"}) {
    if (auto config = reinterpret_cast<const char* (*)()>(find_symbol(lib, name))) {
      const char* at = std::strstr(config(), "MAX_THREADS=");
      return at != nullptr ? std::atoi(at + 12) : 0;
    }
  }
  return 0;
}

// ---- OpenMP: attnx's regions on torch's team ------------------------------------------------
//
// torch runs its ops on an OpenMP team (its bundled libgomp), whose idle threads spin for a few
// milliseconds after each op (GOMP_SPINCOUNT). attnx's own pool between two torch ops means three
// or four runnable threads on two cores: the attention call after a matmul is slowed by the
// spinning team, and each torch op after attnx waits for its team. Running attnx's regions on that
// same team (GOMP_parallel: the libgomp ABI, also provided by LLVM's and Intel's runtimes) leaves
// one set of threads, warm for both.

using GompParallel = void (*)(void (*)(void*), void*, unsigned num_threads, unsigned flags);

struct HostOmp {
  GompParallel parallel = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

HostOmp g_omp;                              // the runtime found (written before g_omp_on is set)
std::atomic<bool> g_omp_on{false};          // regions go to it
std::atomic<uint32_t> g_omp_generation{0};  // fork generation it was switched on in

// The first loaded OpenMP runtime (libgomp, libiomp or libomp in its name; torch's first, e.g.
// torch/lib/libgomp-<hash>.so.1) with the whole entry set; its symbols stay valid while it is
// loaded (never unloaded once torch imported it).
bool find_omp(HostOmp& out) {
  std::vector<std::string> libs = loaded_libraries([](const char* name) {
    return std::strstr(name, "libgomp") || std::strstr(name, "libiomp") ||
           std::strstr(name, "libomp");
  });
  // torch's own runtime first, where another library loaded a second one
  std::stable_partition(libs.begin(), libs.end(),
                        [](const std::string& p) { return p.find("torch") != std::string::npos; });
  for (const std::string& path : libs) {
    void* lib = open_loaded(path);
    if (lib == nullptr) continue;
    HostOmp h;
    h.parallel = reinterpret_cast<GompParallel>(find_symbol(lib, "GOMP_parallel"));
    h.thread_num = reinterpret_cast<int (*)()>(find_symbol(lib, "omp_get_thread_num"));
    h.num_threads = reinterpret_cast<int (*)()>(find_symbol(lib, "omp_get_num_threads"));
    close_loaded(lib);  // still loaded: it was before the dlopen
    if (h.parallel && h.thread_num && h.num_threads) {
      out = h;
      return true;
    }
  }
  return false;
}

struct OmpRegion {
  void (*fn)(void*, Team&);
  void* ctx;
  TeamShared* shared;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
};

void omp_member(void* arg) {
  OmpRegion& r = *static_cast<OmpRegion*>(arg);
  const bool outer = enter_region();
  try {
    Team team(g_omp.thread_num(), g_omp.num_threads(), r.shared);
    r.fn(r.ctx, team);
  } catch (...) {
    if (!r.failed.exchange(true)) r.error = std::current_exception();
  }
  leave_region(outer);
}

}  // namespace

bool run_on_host_omp(int num_threads, void (*fn)(void*, Team&), void* ctx) {
  if (!g_omp_on.load(std::memory_order_acquire) ||
      g_omp_generation.load(std::memory_order_relaxed) != fork_generation())
    return false;  // off, or a forked child: its libgomp team does not exist here
  OmpRegion region{fn, ctx, new_team_shared(), {}, nullptr};
  g_omp.parallel(&omp_member, &region, unsigned(num_threads), 0);
  delete_team_shared(region.shared);
  if (region.error) std::rethrow_exception(region.error);
  return true;
}

bool share_omp_threads(bool on) {
  if (!on) {
    g_omp_on.store(false);
    return false;
  }
  if (!g_omp_on.load()) {
    HostOmp h;
    if (!find_omp(h)) return false;
    g_omp = h;  // no region reads it while g_omp_on is false
    g_omp_generation.store(fork_generation());
    g_omp_on.store(true, std::memory_order_release);
  }
  return true;
}

int share_blas_threads(bool on) {
  int shared = 0;
  for (const std::string& path : loaded_openblas()) {
    void* lib = open_loaded(path);  // only what is already loaded
    if (lib == nullptr) continue;
    bool hooked = false;
    const int limit = std::min(max_threads_of(lib), 64);
    if (on && limit <= 0) {  // no way to know how many buffer slots it has: leave it alone
      close_loaded(lib);
      continue;
    }
    if (on && limit < g_slot_limit.load()) g_slot_limit.store(limit);
    for (const char* name : kSetters) {
      if (auto set = reinterpret_cast<SetCallback>(find_symbol(lib, name))) {
        set(on ? &blas_callback : nullptr);
        hooked = true;
      }
    }
    shared += hooked ? 1 : 0;
    close_loaded(lib);  // balances open_loaded above; the library stays loaded
  }
  return on ? shared : 0;
}

}  // namespace attnx
