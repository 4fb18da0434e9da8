// parallel.cpp: the threading runtime behind parallel.h, attnx's own thread pool.
//
// Why not OpenMP: GNU libgomp does not survive fork(): once the parent has run a parallel
// region, the first region in a forked child (multiprocessing's default start method on Linux)
// waits forever for threads that do not exist there. Our own pool also means no OpenMP runtime
// to vendor in the wheel, and a wait policy we control (see kDefaultSpinMicros).
//
// The model:
// * Each calling OS thread (the "owner") has its own pool of workers, created lazily, grown on
//   demand and reused, like libgomp's team per master thread: calls from several Python threads
//   never serialise on one pool. The pool lives in a thread_local holder; when its owner exits,
//   its workers are told to stop and joined.
// * A region: the owner writes the region (fn, ctx, size), bumps the `go` word of each worker it
//   needs, runs member 0 itself, then waits until `pending` (workers still running) is 0.
// * Waits (a worker for its next region, the owner for its workers, a team at a barrier) spin
//   briefly, then sleep on the word (atomic_wait.h: a futex on Linux). See kDefaultSpinMicros.
// * fork (POSIX): a pthread_atfork child handler bumps g_generation. A pool made in an older
// generation
//   is abandoned (its workers do not exist in the child: never joined, never woken, its memory
//   deliberately leaked) and the next call makes fresh workers, so a child runs multi-threaded.
//   Nothing a region touches is a process-wide lock, so a fork while another thread is inside a
//   region leaves the child nothing held.
#include "runtime/parallel.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <new>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "runtime/atomic_wait.h"

#ifndef _WIN32
#include <pthread.h>
#include <signal.h>
#endif
#ifdef __linux__
#include <sched.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace attnx {

namespace {

// ---- waiting: spin briefly, then sleep ----------------------------------------------------------

// How long a waiting thread spins before it sleeps (atomic_wait). Back-to-back regions (a decode
// loop calls attention once per layer, a few microseconds of Python apart) find their workers
// still spinning and start without a wake-up system call and a wait for the scheduler to run the
// worker again. Spinning much longer would keep idle attnx threads on the cores the model's
// own matmul pool (OpenBLAS, torch) runs on between attention calls; libgomp's default spins for
// up to ~300,000 iterations (milliseconds) and is the reason OMP_WAIT_POLICY exists.
// ATTNX_SPIN_US overrides it (read at import; 0 sleeps at once, e.g. on an oversubscribed machine).
constexpr int kDefaultSpinMicros = 100;
constexpr int kMaxSpinMicros = 100000;  // an env value above this is clamped (0.1 s)

int read_spin_micros() {
  const char* env = std::getenv("ATTNX_SPIN_US");
  if (env == nullptr || *env == '\0') return kDefaultSpinMicros;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (end == env || *end != '\0' || v < 0) return kDefaultSpinMicros;  // malformed: default
  return int(std::min<long>(v, kMaxSpinMicros));
}
// Read when the library loads (import attnx), not lazily: a function-local static's guard could
// be caught held by a fork.
const int g_spin_micros = read_spin_micros();

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// A word that threads wait on until it changes, with a count of sleepers so that a change wakes
// (a system call) only when someone sleeps. Both sides use seq_cst: either the changer sees the
// sleeper, or the sleeper's re-check (and atomic_wait's own compare) sees the change.
struct alignas(64) Signal {
  WaitWord word{0};
  std::atomic<int> sleepers{0};

  uint32_t load() const { return word.load(std::memory_order_acquire); }

  // Returns once word != value.
  void wait_while(uint32_t value) {
    if (word.load(std::memory_order_acquire) != value) return;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::microseconds(g_spin_micros);
    for (int i = 1;; ++i) {
      cpu_relax();
      if (word.load(std::memory_order_acquire) != value) return;
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= deadline) break;
    }
    while (true) {
      sleepers.fetch_add(1);
      if (word.load() == value) atomic_wait(word, value);
      sleepers.fetch_sub(1);
      if (word.load(std::memory_order_acquire) != value) return;
    }
  }

  void wake() {
    if (sleepers.load() > 0) atomic_wake_all(word);
  }
  void add(uint32_t d) {
    word.fetch_add(d);
    wake();
  }
};

// ---- fork -------------------------------------------------------------------------------------

std::atomic<uint32_t> g_generation{0};

// Registered when the library loads (no thread can be inside attnx yet, so no lock is needed).
// (Windows has no fork: the generation never changes there.)
#ifndef _WIN32
const bool g_atfork_registered = [] {
  pthread_atfork(nullptr, nullptr, [] { g_generation.fetch_add(1); });
  return true;
}();
#endif

}  // namespace

// ---- a region's shared state ----------------------------------------------------------------

struct TeamShared {
  alignas(64) std::atomic<int64_t> next{0};  // for_dynamic's counter
  alignas(64) std::atomic<uint32_t> arrived{0};
  Signal phase;  // bumped each time the whole team has reached a barrier
};

void Team::barrier() {
  if (size_ <= 1) return;
  TeamShared& s = *shared_;
  const uint32_t phase = s.phase.load();
  if (s.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == uint32_t(size_)) {
    s.arrived.store(0, std::memory_order_relaxed);  // ordered before the phase bump (seq_cst)
    s.phase.add(1);
  } else {
    s.phase.wait_while(phase);
  }
}

std::atomic<int64_t>& Team::counter() { return shared_->next; }

namespace {

// ---- the pool -----------------------------------------------------------------------------------

thread_local bool t_in_region = false;  // this thread runs a region's body (nested calls: serial)

class Pool {
 public:
  Pool() : generation_(g_generation.load()) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  bool current() const { return generation_ == g_generation.load(); }
  int workers() const { return int(workers_.size()); }

  // Starts workers until there are n (or thread creation fails); returns how many there are.
  // Out of threads or memory, it stops early: the region runs with the team there is.
  int grow(int n) noexcept {
    try {
      workers_.reserve(std::size_t(n));  // push_back below cannot throw once a thread runs
      while (int(workers_.size()) < n) {
        auto w = std::make_unique<Worker>();
        w->pool = this;
        w->index = int(workers_.size());
        if (!start_thread(*w)) break;
        workers_.push_back(std::move(w));
      }
    } catch (const std::bad_alloc&) {
    }
    return int(workers_.size());
  }

  // Runs fn on the owner and workers [0, size - 1); returns when all have finished. An exception
  // from fn (a contract breach: see parallel.h) is rethrown here once every member is done, so
  // that no worker still uses the caller's stack; the first one wins.
  void run(int size, void (*fn)(void*, Team&), void* ctx) {
    TeamShared shared;
    fn_ = fn;
    ctx_ = ctx;
    shared_ = &shared;
    size_ = size;
    error_ = nullptr;
    pending_.word.store(uint32_t(size - 1));
    for (int i = 0; i < size - 1; ++i) workers_[std::size_t(i)]->go.add(1);
    std::exception_ptr mine = call(0);
    for (uint32_t left; (left = pending_.load()) != 0;) pending_.wait_while(left);
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

  // How many workers have run at least one region body (tests: a child really uses threads).
  int workers_used() const {
    int n = 0;
    for (const auto& w : workers_) n += w->used.load(std::memory_order_relaxed) ? 1 : 0;
    return n;
  }

  // Stops and joins the workers (the owner is exiting; never for an abandoned pool).
  ~Pool() {
    stop_ = true;
    for (auto& w : workers_) w->go.add(1);
    for (auto& w : workers_) w->thread.join();
  }

 private:
  struct Worker {
    Signal go;  // bumped by the owner to start a region (or to stop)
    Pool* pool = nullptr;
    int index = 0;
    std::atomic<bool> used{false};
    std::thread thread;
  };

  // Runs member `id`'s body; returns what it threw, if anything.
  std::exception_ptr call(int id) noexcept {
    try {
      Team team(id, size_, shared_);
      fn_(ctx_, team);
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  bool start_thread(Worker& w) {
#ifndef _WIN32
    // Workers block every asynchronous signal, so that SIGINT and friends go to the Python
    // threads (the new thread inherits the creating thread's mask, restored right after).
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
#endif
    bool ok = true;
    try {
      w.thread = std::thread(&Pool::worker_main, &w);
    } catch (const std::system_error&) {  // out of threads
      ok = false;
    }
#ifndef _WIN32
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
#endif
    return ok;
  }

  static void worker_main(Worker* wp) {
    Worker& w = *wp;
#ifdef __linux__
    char name[32];  // "attnx-<member>", cut to the 15 characters a thread name may have
    std::snprintf(name, sizeof name, "attnx-%d", w.index + 1);
    name[15] = '\0';
    pthread_setname_np(pthread_self(), name);
#endif
    t_in_region = true;  // a worker's body is always inside a region
    Pool& p = *w.pool;
    for (uint32_t seen = 0;;) {
      w.go.wait_while(seen);
      seen = w.go.load();
      if (p.stop_) return;
      w.used.store(true, std::memory_order_relaxed);
      if (std::exception_ptr e = p.call(w.index + 1)) {
        std::lock_guard<std::mutex> lock(p.error_mutex_);
        if (!p.error_) p.error_ = e;
      }
      if (p.pending_.word.fetch_sub(1) == 1) p.pending_.wake();
    }
  }

  const uint32_t generation_;
  std::vector<std::unique_ptr<Worker>> workers_;  // stable addresses: workers hold theirs
  // The region, written by the owner before it bumps the workers' `go` (release/acquire there).
  void (*fn_)(void*, Team&) = nullptr;
  void* ctx_ = nullptr;
  TeamShared* shared_ = nullptr;
  int size_ = 1;
  bool stop_ = false;
  std::mutex error_mutex_;  // the pool's own: a fork abandons the pool with it
  std::exception_ptr error_;
  Signal pending_;  // workers of the current region that have not finished
};

// The calling thread's pool; its destructor (thread exit) joins the workers, unless the pool
// comes from before a fork, where they do not exist.
struct PoolHolder {
  Pool* pool = nullptr;
  ~PoolHolder() {
    if (pool != nullptr && pool->current()) delete pool;
  }
  // The current pool, made on first use and after a fork (the stale one leaks, on purpose);
  // nullptr when there is no memory for one (the caller then runs alone).
  Pool* get() {
    if (pool == nullptr || !pool->current()) pool = new (std::nothrow) Pool();
    return pool;
  }
};
thread_local PoolHolder t_pool;

}  // namespace

uint32_t fork_generation() { return g_generation.load(); }
bool enter_region() {
  const bool was = t_in_region;
  t_in_region = true;
  return was;
}
void leave_region(bool was) { t_in_region = was; }
TeamShared* new_team_shared() { return new TeamShared(); }
void delete_team_shared(TeamShared* s) { delete s; }

void run_team(int num_threads, void (*fn)(void*, Team&), void* ctx) {
  if (num_threads > 1 && !t_in_region &&
      run_on_host_omp(std::min(num_threads, kThreadLimit), fn, ctx))
    return;  // torch's team ran it (share_omp_threads)
  // A region inside a region (fn calling parallel) runs on its thread alone, as OpenMP does by
  // default: the pool is busy with the outer one.
  Pool* pool = num_threads > 1 && !t_in_region ? t_pool.get() : nullptr;
  if (pool != nullptr) {
    const int want = std::min(num_threads, kThreadLimit) - 1;
    const int size = 1 + std::min(want, pool->grow(want));
    if (size > 1) {
      struct InRegion {  // reset even when run() rethrows
        InRegion() { t_in_region = true; }
        ~InRegion() { t_in_region = false; }
      } in_region;
      pool->run(size, fn, ctx);
      return;
    }
  }
  TeamShared shared;
  Team team(0, 1, &shared);
  fn(ctx, team);
}

// ---- thread counts ----------------------------------------------------------------------------

int available_cpus() {
#ifdef __linux__
  // The CPUs this process may run on (taskset, cgroup cpusets). A fixed set covers 1024 CPUs
  // without an allocation (this runs on every call that follows the default); larger machines
  // get larger sets, up to 32768 CPUs.
  cpu_set_t fixed;
  if (sched_getaffinity(0, sizeof fixed, &fixed) == 0) return std::max(CPU_COUNT(&fixed), 1);
  for (int n = 2048; n <= 32768; n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) break;
    const std::size_t bytes = CPU_ALLOC_SIZE(n);
    const bool ok = sched_getaffinity(0, bytes, set) == 0;
    const int count = ok ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (ok) return std::max(count, 1);
  }
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? int(online) : 1;
#else
  const unsigned n = std::thread::hardware_concurrency();  // 0 if unknown
  return n > 0 ? int(n) : 1;
#endif
}

int max_threads() { return std::min(4 * available_cpus(), kThreadLimit); }

int pool_workers_used() {
  const Pool* p = t_pool.pool;
  return p != nullptr && p->current() ? p->workers_used() : 0;
}

}  // namespace attnx
