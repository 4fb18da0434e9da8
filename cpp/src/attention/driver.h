// driver.h: the scheduling shared by dense and paged attention. A problem adapter
// (problem.h) says where each query row, output row and KV row lives; run_flash plans the work
// (plan.h), runs the ISA's flash kernel on each unit of items (with split-KV, on a slice of its
// keys), merges the split parts and finalises the rows (attention/state.h). run_stages runs
// several problems in turn on one team (the cascade's levels, then its tails). Everything is a
// template on the problem's compute type T (P::Real): float, or double for float64 inputs, with its
// own kernels (flash_kernels<T>) and per-thread scratch.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>

#include "attnx/dispatch.h"
#include "attnx/paged.h"
#include "kernels/tables.h"
#include "runtime/parallel.h"
#include "attention/plan.h"
#include "attention/problem.h"
#include "attention/state.h"
#include "runtime/scratch.h"

namespace attnx {

namespace detail {

// The flash kernels of compute type T: the active instruction set's for float, the scalar
// float64 kernels for double.
template <class T>
const kern::FlashKernels<T>* flash_kernels();
template <>
inline const kern::FlashKernels<float>* flash_kernels<float>() {
  return active_tables()->flash;
}
template <>
inline const kern::FlashKernels<double>* flash_kernels<double>() {
  return kern::flash_f64();
}

// The K tiles packed once per call and shared by the items of a kv head (plan_packed_k), in the
// calling thread's buffer (a ring of slots); at most kPackKeep bytes of it outlive the call.
template <class T>
class SharedPackedK {
 public:
  explicit SharedPackedK(const Plan& plan) {
    if (plan.n_packed == 0) return;
    ThreadScratch<T>& caller = thread_scratch<T>();
    owner_ = &caller;
    tiles_ = caller.packed_k.get(std::size_t(plan.n_tiles() * plan.tile_elems));
    caller.packed_ready.assign(std::size_t(plan.n_tiles()), 0);
    ready_ = caller.packed_ready.data();
    slot_head_.reset(new std::atomic<int64_t>[std::size_t(plan.n_slots)]);
    for (int64_t s = 0; s < plan.n_slots; ++s) slot_head_[std::size_t(s)].store(s);
    left_.reset(new std::atomic<int64_t>[std::size_t(plan.n_packed)]);
    for (int64_t k = 0; k < plan.n_packed; ++k)
      left_[std::size_t(k)].store(plan.head_items[std::size_t(k)]);
  }
  ~SharedPackedK() {
    if (owner_ != nullptr) owner_->packed_k.trim(std::size_t(kPackKeep) / sizeof(T));
  }
  SharedPackedK(const SharedPackedK&) = delete;
  SharedPackedK& operator=(const SharedPackedK&) = delete;

  // Points the keys of `it` at its kv head's packed tiles, where it has them and its slot has
  // passed to it (else the item packs its own).
  void attach(const Plan& plan, const Item& it, int64_t lk, kern::KVSource& k) const {
    const int64_t head = plan.packed(it);
    if (head < 0 ||
        slot_head_[std::size_t(head % plan.n_slots)].load(std::memory_order_acquire) != head)
      return;
    const int64_t tile0 = plan.kt_tile(it);
    k.kt = tiles_ + tile0 * plan.tile_elems;
    k.kt_ready = ready_ + tile0;
    k.kt_keys = lk;
  }

  // Item `it` has finished (its rows are final, nothing reads its tiles again): the last item of
  // a head passes its slot on, to the next head of the slot that still has items to run, its
  // tiles marked unpacked.
  void finished(const Plan& plan, const Item& it) {
    const int64_t head = plan.packed(it);
    if (head < 0 || plan.n_slots == plan.n_packed ||
        left_[std::size_t(head)].fetch_sub(1, std::memory_order_acq_rel) != 1)
      return;
    const int64_t slot = head % plan.n_slots;
    std::lock_guard<std::mutex> lock(pass_);
    std::atomic<int64_t>& at = slot_head_[std::size_t(slot)];
    int64_t h = at.load(std::memory_order_relaxed);
    while (h + plan.n_slots < plan.n_packed &&
           left_[std::size_t(h)].load(std::memory_order_acquire) == 0) {
      int* ready = ready_ + slot * plan.slot_tiles;
      for (int64_t t = 0; t < plan.slot_tiles; ++t)
        __atomic_store_n(ready + t, 0, __ATOMIC_RELAXED);
      h += plan.n_slots;
      at.store(h, std::memory_order_release);
    }
  }

 private:
  ThreadScratch<T>* owner_ = nullptr;
  T* tiles_ = nullptr;
  int* ready_ = nullptr;
  std::unique_ptr<std::atomic<int64_t>[]> slot_head_;  // per slot: the packed head it serves
  std::unique_ptr<std::atomic<int64_t>[]> left_;       // per packed head: its items yet to finish
  std::mutex pass_;
};

// Split-KV partial row states: per (item, part), M_max rows of O (Dvp values each), and M_max
// maxima followed by M_max sums.
template <class T>
class Partials {
 public:
  explicit Partials(const Plan& plan) : nsplit_(plan.nsplit), M_(plan.M_max), Dvp_(plan.Dvp) {
    if (nsplit_ == 1) return;
    o_.resize(std::size_t(plan.n_items() * nsplit_ * M_ * Dvp_));
    ml_.resize(std::size_t(plan.n_items() * nsplit_ * M_ * 2));
  }
  T* o(int64_t ix, int64_t part) { return o_.data() + (ix * nsplit_ + part) * o_stride(); }
  T* m(int64_t ix, int64_t part) { return ml_.data() + (ix * nsplit_ + part) * ml_stride(); }
  T* l(int64_t ix, int64_t part) { return m(ix, part) + M_; }
  int64_t o_stride() const { return M_ * Dvp_; }  // between the parts of an item
  int64_t ml_stride() const { return 2 * M_; }

 private:
  int64_t nsplit_, M_, Dvp_;
  std::vector<T> o_, ml_;
};

// Exceptions (only allocation failures can occur) must not leave a parallel region: each member
// records the first one and skips its remaining work, and the caller rethrows it.
class TeamErrors {
 public:
  void record() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::current_exception();
    failed_.store(true);
  }
  bool failed() const { return failed_.load(); }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
  std::mutex mutex_;
  std::atomic<bool> failed_{false};
};

// The keys [lo, hi) that query row i of a sequence (Lq real rows, Lk keys) sees, and its position.
struct RowKeys {
  int64_t lo, hi, pos;
};
template <class T>
inline RowKeys row_keys(const BasicFlashProblem<T>& p, int64_t i, int64_t Lq, int64_t Lk) {
  const int64_t off = Lk - Lq;
  int64_t a = 0, e = Lk;
  if (i >= Lq) e = 0;  // padding query row: sees nothing, finalised to zeros
  if (p.causal) e = std::min(e, i + off + 1);
  if (p.var.window_left >= 0) a = std::max(a, i + off - p.var.window_left);
  if (p.var.window_right >= 0) e = std::min(e, i + off + p.var.window_right + 1);
  return {a, std::max(a, e), i + off};
}

// The work of one run_flash call, shared by the team: runs units, merges and finalises rows.
template <class P>
class FlashRun {
 public:
  using T = typename P::Real;
  using Buffers = ThreadBuffers<T>;

  FlashRun(const P& p, const Plan& plan)
      : p_(p), plan_(plan), table_(flash_kernels<T>()), packed_(plan), parts_(plan) {}

  // Work index w: part w % nsplit of unit w / nsplit. With one part, its rows are finished here.
  void run_unit(int64_t w, const Buffers& tb) {
    const int64_t nsplit = plan_.nsplit, split = w % nsplit;
    const Unit& u = plan_.units[std::size_t(w / nsplit)];
    kern::RowSetT<T> rs[kMaxGroup];
    kern::KVSource ks[kMaxGroup], vs[kMaxGroup];
    kern::FlashStateT<T> st[kMaxGroup];
    for (int64_t g = 0; g < u.n; ++g) prepare(item(u.first + g), tb.slot(g), rs[g]);
    const KeyPart keys = unit_keys(u, rs, split);
    for (int64_t g = 0; g < u.n; ++g)
      bind(u.first + g, split, tb.slot(g), rs[g].M, ks[g], vs[g], st[g]);
    const T softcap = p_.var.softcap;
    if (keys.end > keys.begin) {
      if (u.n == 1)
        table_->flash(rs[0], ks[0], vs[0], keys.begin, keys.end, p_.Dk, p_.Dv, softcap, tb.sc,
                      st[0]);
      else
        table_->flash_group(int(u.n), rs, ks, vs, keys.begin, keys.end, p_.Dk, p_.Dv, softcap,
                            tb.sc, st);
    }
    if (nsplit > 1) return;
    for (int64_t g = 0; g < u.n; ++g) {
      rescue(rs[g], ks[g], vs[g], keys, st[g], tb);
      for (int r = 0; r < rs[g].M; ++r)
        finalize_row(item(u.first + g), r, st[g].o + r * plan_.Dvp, st[g].m[r], st[g].l[r], tb.tmp);
      packed_.finished(plan_, item(u.first + g));
    }
  }

  // Merges the split-KV parts of item ix's rows and finishes them. Rows whose merged O
  // overflowed (attention/state.h "overflow") are computed again, the item's keys in one part, in
  // this thread's slot; where that is still not finite, the merged row was right.
  void merge_item(int64_t ix, const Buffers& tb) {
    const Item& it = item(ix);
    const int M = int(it.nh * it.ni);
    auto merged = [&](int r) {
      return row::merge(plan_.nsplit, parts_.m(ix, 0) + r, parts_.l(ix, 0) + r, parts_.ml_stride(),
                        parts_.o(ix, 0) + r * plan_.Dvp, parts_.o_stride(), p_.Dv, tb.merged);
    };
    T m0[kRowsPerItem];  // the merged max of each overflowed row, -inf for the others
    bool any = false;
    for (int r = 0; r < M; ++r) {
      const row::MaxSum<T> ml = merged(r);
      // (an item has at most kRowsPerItem rows: the test only keeps m0 in bounds)
      const bool bad = M <= kRowsPerItem && table_->overflowed(tb.merged, ml.m, ml.l, p_.Dv);
      if (M <= kRowsPerItem) m0[r] = bad ? ml.m : row::neg_inf<T>();
      any = any || bad;
      if (!bad) finalize_row(it, r, tb.merged, ml.m, ml.l, tb.tmp);
    }
    if (!any) return;
    const Slot<T> s = tb.slot(0);  // free: every unit has run
    kern::RowSetT<T> rs;
    prepare(it, s, rs);
    for (int r = 0; r < M; ++r)
      if (m0[r] > row::neg_inf<T>()) m0[r] = row::restart_max(m0[r], rs.hi[r] - rs.lo[r]);
    kern::KVSource k = p_.k_src(it.b, it.kvh), v = p_.v_src(it.b, it.kvh);
    packed_.attach(plan_, it, p_.lk(it.b), k);
    const kern::FlashStateT<T> st{s.o, plan_.Dvp, s.m, s.l};
    again(rs, k, v, span(&rs, 1, plan_.kt_tile(it) >= 0), st, m0, tb);
    for (int r = 0; r < M; ++r) {
      if (!(m0[r] > row::neg_inf<T>())) continue;
      if (!table_->overflowed(s.o + r * plan_.Dvp, s.m[r], s.l[r], p_.Dv)) {
        finalize_row(it, r, s.o + r * plan_.Dvp, s.m[r], s.l[r], tb.tmp);
      } else {
        const row::MaxSum<T> ml = merged(r);
        finalize_row(it, r, tb.merged, ml.m, ml.l, tb.tmp);
      }
    }
  }

 private:
  struct KeyPart {
    int64_t begin, end;
  };

  const Item& item(int64_t ix) const { return plan_.items[std::size_t(ix)]; }

  // Fills slot s with the item's rows, ordered head-major: r = (h - h0) * ni + (i - i0).
  void prepare(const Item& it, const Slot<T>& s, kern::RowSetT<T>& rs) const {
    const int M = int(it.nh * it.ni);
    int64_t* lo = s.lo;
    int64_t* hi = lo + M;
    int64_t* pos = hi + M;
    const int64_t Lq = p_.lq(it.b), Lk = p_.lk(it.b), Dkp = plan_.Dkp;
    const bool q8 = int8_rows(it);
    for (int64_t hh = 0; hh < it.nh; ++hh) {
      for (int64_t ii = 0; ii < it.ni; ++ii) {
        const int64_t r = hh * it.ni + ii, h = it.h0 + hh, i = it.i0 + ii;
        const RowKeys keys = row_keys(p_, i, Lq, Lk);
        lo[r] = keys.lo;
        hi[r] = keys.hi;
        pos[r] = keys.pos;
        T* qr = s.q + r * Dkp;
        table_->load_query(p_.q_row(it.b, h, i), p_.q_dtype, p_.Dk, p_.scale, Dkp, qr);
        if (q8) s.qfactor[r] = quantise_query(qr, s.qcodes + r * s.ldc, s.ldc, s.qvals + r * Dkp);
        if (p_.mask_kind != MaskKind::none) s.mask_rows[r] = p_.mask_row(it.b, h, i);
      }
    }
    rs = kern::RowSetT<T>{M,
                          s.q,
                          Dkp,
                          lo,
                          hi,
                          pos,
                          nullptr,
                          p_.mask_kind,
                          s.mask_rows,
                          p_.mask_sk,
                          p_.q_dtype,
                          p_.scale,
                          p_.lse_at(it.b, it.h0, it.i0) != nullptr,
                          p_.bf16_products};
    if (p_.var.alibi_slopes != nullptr) {
      for (int r = 0; r < M; ++r) s.slopes[r] = p_.var.alibi_slopes[it.h0 + r / it.ni];
      rs.slope = s.slopes;
    }
    if (q8) {
      rs.qfactor = s.qfactor;
      rs.qcodes = s.qcodes;
      rs.qvals = s.qvals;
      rs.ldc = s.ldc;
      rs.int8_tiles = int8_tiles(M, p_.int8_tiles_rule);
      if (rs.int8_tiles != Int8Tiles::none && kern::unpacked_codes(M, p_.Dk)) {
        kern::code_quads(s.qcodes, s.ldc, M, s.qquads);
        rs.qquads = s.qquads;
      }
    }
  }

  // Whether the item's query rows are quantised to int8 (kern::RowSetT::qfactor): over int8
  // keys, float queries, where the call's int8_query (attnx::int8_query()) is on.
  bool int8_rows(const Item& it) const {
    if constexpr (!std::is_same<T, float>::value) {
      return false;
    } else {
      return p_.k_src(it.b, it.kvh).dtype == DType::i8 && p_.int8_query;
    }
  }

  // The scaled query row (Dk values, zero-padded to Dkp) as its int8 codes by the keys' rule
  // (quantise_row): into `codes` (zero-padded to ldc bytes), as values in place, and as codes
  // times their factor into `vals` (Dkp values); returns the factor.
  T quantise_query(T* qr, int8_t* codes, int64_t ldc, T* vals) const {
    if constexpr (!std::is_same<T, float>::value) {
      return T(1);  // (never called: int8_rows is false for float64)
    } else {
      const T f = quantise_row(qr, p_.Dk, DType::i8, codes);
      for (int64_t d = 0; d < p_.Dk; ++d) qr[d] = T(codes[d]);
      for (int64_t d = 0; d < p_.Dk; ++d) vals[d] = qr[d] * f;
      for (int64_t d = p_.Dk; d < plan_.Dkp; ++d) vals[d] = T(0);
      std::memset(codes + p_.Dk, 0, std::size_t(ldc - p_.Dk));
      return f;
    }
  }

  // The union of the key ranges of the rows of n row sets, from a multiple of kTileK where the
  // keys are packed tiles (`aligned`: packed tiles start at multiples of kTileK, so must the
  // items' tiles).
  static KeyPart span(const kern::RowSetT<T>* rs, int64_t n, bool aligned) {
    int64_t jb = std::numeric_limits<int64_t>::max(), je = 0;
    for (int64_t g = 0; g < n; ++g)
      for (int r = 0; r < rs[g].M; ++r)
        if (rs[g].lo[r] < rs[g].hi[r]) {
          jb = std::min(jb, rs[g].lo[r]);
          je = std::max(je, rs[g].hi[r]);
        }
    if (je <= jb) jb = je = 0;
    if (aligned) jb = jb / kern::kTileK * kern::kTileK;
    return {jb, je};
  }

  // The unit's key range (the union of its rows'), cut into nsplit tile-aligned parts: part
  // `split` of it.
  KeyPart unit_keys(const Unit& u, const kern::RowSetT<T>* rs, int64_t split) const {
    bool aligned = false;
    for (int64_t g = 0; g < u.n; ++g) aligned = aligned || plan_.kt_tile(item(u.first + g)) >= 0;
    const KeyPart all = span(rs, u.n, aligned);
    const int64_t part = round_up(ceil_div(all.end - all.begin, plan_.nsplit), kern::kTileK);
    const int64_t pb = std::min(all.end, all.begin + split * part);
    return {pb, std::min(all.end, pb + part)};
  }

  // An item's rows whose O overflowed (attention/state.h "overflow") computed again, from the
  // start, with their max moved up; rows whose O is then still not finite (an infinite or NaN value
  // of their own) are computed a third time as they were the first, the others as in the second.
  void rescue(const kern::RowSetT<T>& rs, const kern::KVSource& k, const kern::KVSource& v,
              const KeyPart& keys, const kern::FlashStateT<T>& st, const Buffers& tb) const {
    if (rs.M > kRowsPerItem) return;  // (never: an item has at most kRowsPerItem rows)
    T m0[kRowsPerItem];
    bool any = false;
    for (int r = 0; r < rs.M; ++r) {
      const bool bad = table_->overflowed(st.o + r * plan_.Dvp, st.m[r], st.l[r], p_.Dv);
      m0[r] = bad ? row::restart_max(st.m[r], rs.hi[r] - rs.lo[r]) : row::neg_inf<T>();
      any = any || bad;
    }
    if (!any) return;
    again(rs, k, v, keys, st, m0, tb);
    bool own = false;
    for (int r = 0; r < rs.M; ++r)
      if (m0[r] > row::neg_inf<T>() &&
          table_->overflowed(st.o + r * plan_.Dvp, st.m[r], st.l[r], p_.Dv)) {
        m0[r] = row::neg_inf<T>();
        own = true;
      }
    if (own) again(rs, k, v, keys, st, m0, tb);
  }

  // Computes the rows of one item again from the start over keys, with running maxima m0.
  void again(const kern::RowSetT<T>& rs, const kern::KVSource& k, const kern::KVSource& v,
             const KeyPart& keys, const kern::FlashStateT<T>& st, const T* m0,
             const Buffers& tb) const {
    row::init(rs.M, st.o, plan_.Dvp, st.m, st.l);
    std::copy(m0, m0 + rs.M, st.m);
    if (keys.end > keys.begin)
      table_->flash(rs, k, v, keys.begin, keys.end, p_.Dk, p_.Dv, p_.var.softcap, tb.sc, st);
  }

  // Item ix's sources, and its state (in the slot, or its split-KV part) initialised.
  void bind(int64_t ix, int64_t split, const Slot<T>& s, int M, kern::KVSource& k,
            kern::KVSource& v, kern::FlashStateT<T>& st) {
    const Item& it = item(ix);
    const bool parted = plan_.nsplit > 1;
    T* o = parted ? parts_.o(ix, split) : s.o;
    T* m = parted ? parts_.m(ix, split) : s.m;
    T* l = parted ? parts_.l(ix, split) : s.l;
    row::init(M, o, plan_.Dvp, m, l);
    k = p_.k_src(it.b, it.kvh);
    v = p_.v_src(it.b, it.kvh);
    packed_.attach(plan_, it, p_.lk(it.b), k);
    st = kern::FlashStateT<T>{o, plan_.Dvp, m, l};
  }

  // Writes row r of the item: zeros and lse = -inf for a padding or empty row, else O / l.
  void finalize_row(const Item& it, int64_t r, const T* o, T m, T l, T* tmp) const {
    const int64_t h = it.h0 + r / it.ni, i = it.i0 + r % it.ni;
    void* dst = p_.out_row(it.b, h, i);
    T* lse = p_.lse_at(it.b, h, i);
    const T* sink = p_.var.sinks != nullptr ? p_.var.sinks + h : nullptr;
    T lse_value = row::neg_inf<T>();
    const typename P::Prior prior = p_.prior(it.b, h, i);
    if (prior.out != nullptr && i < p_.lq(it.b)) {
      const row::MaxSum<T> ml =
          row::merge_shares<T>({m, l, o}, row::finished(prior.out, prior.lse), p_.Dv, tmp);
      o = tmp;
      m = ml.m;
      l = ml.l;
    }
    if (i < p_.lq(it.b) &&
        table_->finalize(o, m, l, sink, p_.Dv, tmp, lse != nullptr ? &lse_value : nullptr))
      table_->store_row(tmp, p_.Dv, p_.out_dtype, dst);
    else
      std::memset(dst, 0, std::size_t(p_.Dv) * dtype_size(p_.out_dtype));
    if (lse != nullptr) *lse = lse_value;
  }

  const P& p_;
  const Plan& plan_;
  const kern::FlashKernels<T>* table_;
  SharedPackedK<T> packed_;
  Partials<T> parts_;
};

// One problem's work in a parallel region that may run several problems in turn (run_stages):
// its plan, made by the caller, and its run (the shared packed K and the split-KV parts), made
// when the stage starts by member 0, the calling thread, whose scratch holds the packed K (so the
// stages of one region never hold it at once).
template <class T>
class Stage {
 public:
  virtual ~Stage() = default;
  virtual const Plan& plan() const = 0;
  virtual void open() = 0;   // member 0, before the stage runs
  virtual void close() = 0;  // member 0, after every member has finished it
  // Every member calls it; it returns once every member has finished the stage (a barrier).
  virtual void run(Team& team, const ThreadBuffers<T>& tb, bool ok) = 0;
};

template <class P>
class FlashStage final : public Stage<typename P::Real> {
 public:
  using T = typename P::Real;
  FlashStage(const P& p, int num_threads) : p_(p), plan_(make_plan(p, num_threads)) {}
  const Plan& plan() const override { return plan_; }
  void open() override { run_.emplace(p_, plan_); }
  void close() override { run_.reset(); }
  void run(Team& team, const ThreadBuffers<T>& tb, bool ok) override {
    team.for_dynamic(plan_.n_units() * plan_.nsplit, [&](int64_t w) {
      if (ok) run_->run_unit(w, tb);
    });
    if (plan_.nsplit > 1)
      team.for_static(plan_.n_items(), [&](int64_t ix) {
        if (ok) run_->merge_item(ix, tb);
      });
  }

 private:
  const P& p_;
  const Plan plan_;
  std::optional<FlashRun<P>> run_;
};

// Runs the stages in order on one team (each starts once every member has finished the one
// before, so a stage may read what earlier ones wrote): the team is woken once, on as many
// threads as the widest stage's plan asks for, and each thread's scratch is sized once for them
// all. A stage with no items is skipped.
template <class T>
void run_stages(Stage<T>* const* stages, std::size_t n) {
  int nt = 0;
  int64_t group = 1, M = 0, Dkp = 0, Dvp = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Plan& plan = stages[i]->plan();
    if (plan.items.empty()) continue;
    nt = std::max(nt, plan.num_threads);
    group = std::max(group, plan.max_group);
    M = std::max(M, plan.M_max);
    Dkp = std::max(Dkp, plan.Dkp);
    Dvp = std::max(Dvp, plan.Dvp);
  }
  if (nt == 0) return;
  const ScratchLayout<T> layout(group, M, Dkp, Dvp);
  TeamErrors errors;
  parallel(nt, [&](Team& team) {
    ThreadBuffers<T> tb;
    try {
      tb = layout.carve(thread_scratch<T>());
    } catch (...) {
      errors.record();
    }
    for (std::size_t i = 0; i < n; ++i) {
      Stage<T>& stage = *stages[i];
      if (stage.plan().items.empty()) continue;
      if (team.id() == 0 && !errors.failed()) {
        try {
          stage.open();
        } catch (...) {
          errors.record();
        }
      }
      // Nothing is written until every thread has its scratch and the stage its run: a failed
      // allocation anywhere leaves the rest of the call's output untouched (MemoryError).
      team.barrier();
      stage.run(team, tb, !errors.failed());
      if (team.id() == 0) stage.close();
    }
  });
  errors.rethrow();
}

// Runs attention for problem `p` (see FlashProblem) on up to num_threads threads.
template <class P>
void run_flash(const P& p, int num_threads) {
  FlashStage<P> stage(p, num_threads);
  Stage<typename P::Real>* stages[] = {&stage};
  run_stages(stages, 1);
}

}  // namespace detail
}  // namespace attnx
