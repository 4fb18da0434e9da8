// parallel.h: the one way attnx runs work on several threads. A parallel region is a team of
// threads (the caller is member 0) running one body; inside it, for_dynamic / for_static share
// out loop indices and barrier() waits for the whole team. Drivers use only this interface, so
// the threading runtime behind it (parallel.cpp) can change without touching them.
#pragma once
#include <atomic>
#include <cstdint>

#include "attnx/dispatch.h"  // available_cpus, max_threads

namespace attnx {

struct TeamShared;  // the runtime's per-region state (parallel.cpp)

class Team {
 public:
  Team(int id, int size, TeamShared* shared) : id_(id), size_(size), shared_(shared) {}
  int id() const { return id_; }
  int size() const { return size_; }

  // Waits until every member of the team has reached it.
  void barrier();

  // Calls f(i) for every i in [0, n), handing indices out one at a time to whichever member is
  // free (work items of uneven cost). Every member must call it; it ends with a barrier.
  template <class F>
  void for_dynamic(int64_t n, F&& f) {
    if (size_ == 1) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    std::atomic<int64_t>& next = counter();
    if (id_ == 0) next.store(0, std::memory_order_relaxed);
    barrier();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(i);
    barrier();
  }

  // Calls f(i) for this member's contiguous share of [0, n). Every member must call it; it ends
  // with a barrier.
  template <class F>
  void for_static(int64_t n, F&& f) {
    const int64_t chunk = (n + size_ - 1) / size_;
    const int64_t b = int64_t(id_) * chunk, e = b + chunk < n ? b + chunk : n;
    for (int64_t i = b; i < e; ++i) f(i);
    if (size_ > 1) barrier();
  }

 private:
  std::atomic<int64_t>& counter();
  int id_, size_;
  TeamShared* shared_;
};

// Runs fn(ctx, team) on up to num_threads threads (the caller is member 0) and returns when every
// member has finished. num_threads <= 1 runs it on the calling thread alone, and so does a call
// from inside a region; fewer threads run it when no more can be started (the team's size says
// how many). The workers are the calling thread's own (parallel.cpp), so calls from several
// threads run side by side, and a fork()ed child starts fresh ones.
//
// fn must not throw: an exception is carried out to the caller once every member has finished,
// but members waiting at a barrier the thrower never reaches wait forever. Catch inside fn
// (attention/driver.h records the first exception and rethrows it after the region).
void run_team(int num_threads, void (*fn)(void*, Team&), void* ctx);

// The same for any callable: parallel(n, [&](Team& team) { ... }).
template <class F>
void parallel(int num_threads, F&& body) {
  run_team(num_threads, [](void* ctx, Team& team) { (*static_cast<F*>(ctx))(team); }, &body);
}

// The most threads a call uses (max_threads(), declared with the thread-count policy in
// attnx/dispatch.h): 4x the CPUs this process may run on (available_cpus), never more than
// kThreadLimit. More threads than CPUs only time-slice (attnx's work is compute- or
// memory-bound, never waiting on I/O), and each costs a stack and a scratch buffer; 4x leaves room
// to oversubscribe on purpose (a CPU quota smaller than the CPU set), not to start 4096 threads.
// kThreadLimit bounds it on the largest machines, where one team's barrier would dominate.
constexpr int kThreadLimit = 1024;

// ---- for host_threads.cpp, which runs regions on another runtime's threads ----------------------

// Runs the region on the process's OpenMP team (torch's) when share_omp_threads(true) found one
// and this process is not a fork of the one that turned it on; false: the caller runs it.
bool run_on_host_omp(int num_threads, void (*fn)(void*, Team&), void* ctx);
uint32_t fork_generation();     // bumped in a fork()ed child
bool enter_region();            // marks this thread as inside a region; returns the old mark
void leave_region(bool was);    // restores it
TeamShared* new_team_shared();  // a region's shared state, for a team made elsewhere
void delete_team_shared(TeamShared* s);

}  // namespace attnx
