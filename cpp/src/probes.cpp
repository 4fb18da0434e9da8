// probes.cpp: measurements of the machine's FMA peak and read bandwidth with the active kernels,
// the denominators of the benchmark table's "% of peak" columns.
#include "attnx/probes.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "flash_driver.h"

namespace attnx {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
volatile float g_sink;
}  // namespace

double probe_fma_gflops(int num_threads, double seconds) {
  const kern::KernelTable* t = active_table();
  const int width = std::string(t->name) == "avx512" ? 16 : std::string(t->name) == "avx2" ? 8 : 1;
  const int64_t iters = 1 << 20;
  double best = 0;
  const double t_end = now() + seconds;
  while (now() < t_end) {
    const double t0 = now();
#pragma omp parallel num_threads(num_threads)
    { g_sink = t->fma_probe(iters); }
    const double dt = now() - t0;
    // 10 accumulators x `width` lanes x 2 flops per FMA, per iteration, per thread
    best = std::max(best, double(iters) * 10 * width * 2 * num_threads / dt / 1e9);
  }
  return best;
}

double probe_read_gbps(int num_threads, int64_t bytes, double seconds) {
  const kern::KernelTable* t = active_table();
  const int64_t n = bytes / 4;
  // On transparent huge pages, like the arrays the kernels read: NumPy asks for them (madvise)
  // on every allocation of 4 MiB or more. On 4 KiB pages this probe measured 22-24 GB/s from one
  // Zen 4 thread against 28.8 on huge pages, and would understate what the memory can deliver.
  constexpr std::size_t kHuge = std::size_t(2) << 20;
  const std::size_t size = (std::size_t(n) * 4 + kHuge - 1) / kHuge * kHuge;
  float* buf = static_cast<float*>(std::aligned_alloc(kHuge, size));
  if (buf == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(buf, size, MADV_HUGEPAGE);  // a hint: without THP the probe runs on small pages
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) buf[i] = 1.0f;  // first touch by the reading thread
  double best = 0;
  const double t_end = now() + seconds;
  while (now() < t_end) {
    const double t0 = now();
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
      const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
      const int nt = 1, id = 0;
#endif
      const int64_t chunk = (n + nt - 1) / nt, b = std::min(n, id * chunk), e = std::min(n, b + chunk);
      g_sink = t->read_probe(buf + b, e - b);
    }
    best = std::max(best, double(n) * 4 / (now() - t0) / 1e9);
  }
  std::free(buf);
  return best;
}

}  // namespace attnx
