// delta_rule.cpp: the gated delta-rule driver: one work item per (sequence, group of value heads
// that read one key head; see group_size), shared out across threads; each head's state lives in
// place in the caller's final-state buffer where its rows are already padded, else in per-thread
// scratch. The maths is in kernels/delta-inl.h.
#include "attnx/delta_rule.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "attnx/dispatch.h"
#include "kernels/delta_kernels.h"
#include "kernels/tables.h"
#include "runtime/parallel.h"
#include "runtime/scratch.h"  // aligned_malloc

namespace attnx {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr double kWorkPerThread = 1 << 18;  // state multiply-adds (tokens x K x V per head) that
                                            // make another thread worth waking (~0.1 ms)

struct FreeDeleter {
  void operator()(float* p) const { detail::aligned_free(p); }
};

// Sizes shared by every work item of one call.
struct DeltaPlan {
  int64_t Kp = 0, Vp = 0;
  int G = 1;              // value heads per work item (sharing one key head's q and k)
  bool in_place = false;  // the state is advanced inside final_state (V is already padded)
  int64_t kernel = 0;     // floats of kernel scratch per thread
  int64_t work = 0;       // floats of scratch per thread, kernel + G states if not in place
};

DeltaPlan plan(const DeltaRuleParams& p, int G) {
  DeltaPlan pl;
  pl.Kp = round_up(std::max<int64_t>(p.K, 1), kern::kPad);
  pl.Vp = round_up(std::max<int64_t>(p.V, 1), kern::kPad);
  pl.G = G;
  pl.in_place = p.final_state != nullptr && pl.Vp == p.V;
  pl.kernel = kern::delta_work_floats(pl.Kp, pl.Vp, G);
  pl.work = round_up(pl.kernel + (pl.in_place ? 0 : G * p.K * pl.Vp), 16);
  return pl;
}

// Value heads per work item: the heads that read one key head share its q and k rows and their
// pair products (kernels/delta-inl.h), so a chunked call takes up to kDeltaGroupMax of them
// together, as long as the items still split evenly over the threads. Decode gains nothing.
int group_size(const DeltaRuleParams& p, int threads) {
  bool chunked = p.mode == DeltaMode::chunked;
  for (int64_t n = 0; n < p.N && p.mode == DeltaMode::automatic; ++n)
    chunked = chunked || p.seq_len[n] > kern::kDeltaRecurrentMax;
  if (!chunked) return 1;
  const int64_t ratio = p.Hv / p.Hk;
  for (int G = kern::kDeltaGroupMax; G > 1; G /= 2)
    if (ratio % G == 0 && (p.N * p.Hv / G) % threads == 0) return G;
  return 1;
}

// Where (sequence n, head h)'s state lives for the kernel (d.S, d.lds) and where the kernel
// reads it before the first token (d.S_in): in place, the caller's initial state is read there
// directly (a decode step then streams the state once in, once out, with no copy before it).
void prepare_state(const DeltaRuleParams& p, const DeltaPlan& pl, int64_t n, int64_t h,
                   float* scratch, kern::DeltaHead& d) {
  const int64_t off = (n * p.Hv + h) * p.K * p.V;
  const float* init = p.initial_state ? p.initial_state + off : nullptr;
  if (pl.in_place) {
    d.S = p.final_state + off;
    d.lds = p.V;
    if (init == nullptr) std::memset(d.S, 0, sizeof(float) * p.K * p.V);
    d.S_in = init ? init : d.S;
    return;
  }
  d.S = scratch;
  d.S_in = scratch;
  d.lds = pl.Vp;
  std::memset(scratch, 0, sizeof(float) * p.K * pl.Vp);
  if (init)
    for (int64_t c = 0; c < p.K; ++c)
      std::memcpy(scratch + c * pl.Vp, init + c * p.V, sizeof(float) * p.V);
}

// The kernel's view of (sequence n, head h): pointers offset to its first position.
kern::DeltaHead head_view(const DeltaRuleParams& p, const DeltaPlan& pl, int64_t n, int64_t h) {
  const int64_t b = p.seq_batch[n], t0 = p.seq_start[n], hk = h / (p.Hv / p.Hk);
  const int64_t es = int64_t(dtype_size(p.dtype));
  auto at = [&](const Strided3& s, int64_t head) {
    return static_cast<const char*>(s.data) + (b * s.sb + t0 * s.st + head * s.sh) * es;
  };
  kern::DeltaHead d;
  d.T = p.seq_len[n];
  d.K = p.K;
  d.V = p.V;
  d.Kp = pl.Kp;
  d.Vp = pl.Vp;
  d.dtype = p.dtype;
  d.q = at(p.q, hk);
  d.k = at(p.k, hk);
  d.v = at(p.v, h);
  d.q_st = p.q.st * es;
  d.k_st = p.k.st * es;
  d.v_st = p.v.st * es;
  d.g = p.g + b * p.g_sb + t0 * p.g_st + h * p.g_sh;
  d.g_st = p.g_st;
  d.g_per_channel = p.g_per_channel;
  d.beta = p.beta + b * p.beta_sb + t0 * p.beta_st + h * p.beta_sh;
  d.beta_st = p.beta_st;
  d.out = static_cast<char*>(p.out) + (b * p.o_sb + t0 * p.o_st + h * p.o_sh) * es;
  d.o_st = p.o_st * es;
  d.scale = p.scale;
  d.l2norm = p.qk_l2norm;
  d.chunked = p.mode == DeltaMode::chunked ||
              (p.mode == DeltaMode::automatic && d.T > kern::kDeltaRecurrentMax);
  return d;
}

// Work item: pl.G consecutive value heads of one sequence (they read the same key head).
void run_item(const DeltaRuleParams& p, const DeltaPlan& pl, const kern::DeltaKernels* table,
              int64_t item, float* buf) {
  const int64_t groups = p.Hv / pl.G, n = item / groups, h0 = item % groups * pl.G;
  kern::DeltaHead ds[kern::kDeltaGroupMax];
  for (int g = 0; g < pl.G; ++g) {
    ds[g] = head_view(p, pl, n, h0 + g);
    ds[g].work = buf;
    prepare_state(p, pl, n, h0 + g, buf + pl.kernel + g * p.K * pl.Vp, ds[g]);
  }
  if (ds[0].T > 0) table->heads(ds, pl.G);
  for (int g = 0; g < pl.G; ++g) {
    const kern::DeltaHead& d = ds[g];
    if (d.T == 0 && d.S_in != d.S)  // empty sequence: the state is the initial one
      std::memcpy(d.S, d.S_in, sizeof(float) * p.K * p.V);
    if (!p.final_state || pl.in_place) continue;
    float* dst = p.final_state + (n * p.Hv + h0 + g) * p.K * p.V;
    for (int64_t c = 0; c < p.K; ++c)
      std::memcpy(dst + c * p.V, d.S + c * d.lds, sizeof(float) * p.V);
  }
}

}  // namespace

void gated_delta_rule(const DeltaRuleParams& p) {
  const int64_t items = p.N * p.Hv;
  if (items == 0 || p.K == 0 || p.V == 0) return;  // nothing to read or write (no state to advance)
  const kern::DeltaKernels* table = active_tables()->delta;
  // A thread per work item at most, and only for enough work: starting a team costs more than
  // a small decode step (a few (sequence, head) states of a few KiB) takes.
  double work = 0;
  for (int64_t n = 0; n < p.N; ++n)
    work += double(std::max<int64_t>(p.seq_len[n], 1)) * p.Hv * p.K * p.V;
  const int64_t by_work = std::max<int64_t>(1, int64_t(work / kWorkPerThread));
  const int threads =
      int(std::min({int64_t(std::max(resolve_threads(p.num_threads), 1)), items, by_work}));
  const DeltaPlan pl = plan(p, group_size(p, threads));
  // All scratch up front: a failed allocation throws here, before any thread starts.
  const std::size_t bytes = sizeof(float) * std::size_t(pl.work) * std::size_t(threads);
  std::unique_ptr<float, FreeDeleter> scratch(
      static_cast<float*>(detail::aligned_malloc(64, bytes)));
  if (!scratch) throw std::bad_alloc();
  float* base = scratch.get();
  parallel(threads, [&](Team& team) {
    float* buf = base + int64_t(team.id()) * pl.work;
    team.for_dynamic(items / pl.G, [&](int64_t i) { run_item(p, pl, table, i, buf); });
  });
}

}  // namespace attnx
