// parallel.cpp: the threading runtime behind parallel.h (here: OpenMP).
#include "parallel.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace attnx {

struct TeamShared {
  std::atomic<int64_t> next{0};
};

void Team::barrier() {
#ifdef _OPENMP
  if (size_ > 1) {
#pragma omp barrier
  }
#endif
}

std::atomic<int64_t>& Team::counter() { return shared_->next; }

void run_team(int num_threads, void (*fn)(void*, Team&), void* ctx) {
  TeamShared shared;
#ifdef _OPENMP
  if (num_threads > 1) {
#pragma omp parallel num_threads(num_threads)
    {
      Team team(omp_get_thread_num(), omp_get_num_threads(), &shared);
      fn(ctx, team);
    }
    return;
  }
#endif
  Team team(0, 1, &shared);
  fn(ctx, team);
}

}  // namespace attnx
