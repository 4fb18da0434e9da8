// probes.cpp: measurements of the machine's FMA peak and read bandwidth with the active kernels,
// the denominators of the benchmark table's "% of peak" columns.
#include "attnx/probes.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "attention/driver.h"
#include "runtime/parallel.h"

namespace attnx {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::atomic<float> g_sink;  // results the compiler must keep (members store at once)
}  // namespace

double probe_fma_gflops(int num_threads, double seconds) {
  const kern::ProbeKernels* t = active_tables()->probes;
  const int width = t->lanes;
  const int64_t iters = 1 << 20;
  double best = 0;
  const double t_end = now() + seconds;
  while (now() < t_end) {
    const double t0 = now();
    int team_size = 1;
    parallel(num_threads, [&](Team& team) {
      g_sink.store(t->fma(iters), std::memory_order_relaxed);
      if (team.id() == 0) team_size = team.size();
    });
    const double dt = now() - t0;
    // 10 accumulators x `width` lanes x 2 flops per FMA, per iteration, per thread
    best = std::max(best, double(iters) * 10 * width * 2 * team_size / dt / 1e9);
  }
  return best;
}

double probe_read_gbps(int num_threads, int64_t bytes, double seconds) {
  const kern::ProbeKernels* t = active_tables()->probes;
  const int64_t n = bytes / 4;
  // On transparent huge pages, like the arrays the kernels read: NumPy asks for them (madvise)
  // on every allocation of 4 MiB or more. On 4 KiB pages this probe would understate what the
  // memory can deliver (TLB misses; bench/NOTES.md).
  constexpr std::size_t kHuge = std::size_t(2) << 20;
  const std::size_t size = (std::size_t(n) * 4 + kHuge - 1) / kHuge * kHuge;
  float* buf = static_cast<float*>(detail::aligned_malloc(kHuge, size));
  if (buf == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(buf, size, MADV_HUGEPAGE);  // a hint: without THP the probe runs on small pages
#endif
  // Each member's contiguous share of the buffer; the same share for the first touch and the
  // reads, so a share sits on its reader's NUMA node.
  auto share = [n](const Team& team, int64_t& b, int64_t& e) {
    const int64_t chunk = (n + team.size() - 1) / team.size();
    b = std::min(n, team.id() * chunk);
    e = std::min(n, b + chunk);
  };
  parallel(num_threads, [&](Team& team) {
    int64_t b, e;
    share(team, b, e);
    for (int64_t i = b; i < e; ++i) buf[i] = 1.0f;  // first touch by the reading thread
  });
  double best = 0;
  const double t_end = now() + seconds;
  while (now() < t_end) {
    const double t0 = now();
    parallel(num_threads, [&](Team& team) {
      int64_t b, e;
      share(team, b, e);
      g_sink.store(t->read(buf + b, e - b), std::memory_order_relaxed);
    });
    best = std::max(best, double(n) * 4 / (now() - t0) / 1e9);
  }
  detail::aligned_free(buf);
  return best;
}

}  // namespace attnx
