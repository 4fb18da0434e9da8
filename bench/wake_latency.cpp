// wake_latency.cpp: the thread pool's region round trip (parallel.h's run_team with an empty body
// on 2 threads), the cost a small decode step pays per call. With ATTNX_SPIN_US=0 every region
// wakes a sleeping worker (atomic_wait.h's wake, a futex on Linux) and waits for it to sleep again;
// with the default spin the worker is still spinning. Built from one revision's parallel.cpp and
// host_threads.cpp alone, so two revisions compare in one sitting:
//   g++ -O2 -std=c++17 -Icpp/include -Icpp/src bench/wake_latency.cpp cpp/src/runtime/parallel.cpp
//   \
//       cpp/src/runtime/host_threads.cpp -pthread -ldl -o wake_new
//   ATTNX_SPIN_US=0 ./wake_new 20000     (prints the median and the 10th/90th percentiles, us)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "runtime/parallel.h"

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 20000;
  std::vector<double> us(std::size_t(n > 0 ? n : 1));
  for (int i = -1000; i < n; ++i) {  // 1000 warm-up regions (the workers start in the first)
    const auto t0 = std::chrono::steady_clock::now();
    attnx::parallel(2, [](attnx::Team&) {});
    const auto t1 = std::chrono::steady_clock::now();
    // let a sleeping worker really fall asleep before the next region (the spin is <= 100 us)
    const auto until = t1 + std::chrono::microseconds(200);
    while (std::chrono::steady_clock::now() < until) {
    }
    if (i >= 0) us[std::size_t(i)] = std::chrono::duration<double, std::micro>(t1 - t0).count();
  }
  std::sort(us.begin(), us.end());
  const auto at = [&](double q) { return us[std::size_t(q * double(us.size() - 1))]; };
  std::printf("region round trip, 2 threads: median %.1f us (p10 %.1f, p90 %.1f), %d regions\n",
              at(0.5), at(0.1), at(0.9), n);
  return 0;
}
