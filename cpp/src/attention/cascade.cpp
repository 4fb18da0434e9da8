// cascade.cpp: the shared-prefix plan (groups of sequences that share leading blocks, found once
// per step) and the call that runs a step's layer through it. See cascade.h.
#include "attention/cascade.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <memory>

#include "attnx/dispatch.h"
#include "attention/driver.h"
#include "attention/paged_problem.h"

namespace attnx {

namespace {

// Finds the groups of a step's tables, depth first (a tree of shared prefixes: two conversations
// on one system prompt, each sampled several times).
class GroupFinder {
 public:
  GroupFinder(const PagedParams& t, int64_t min_saved_keys, CascadePlan& plan)
      : t_(t),
        min_saved_(std::max<int64_t>(min_saved_keys, 1)),
        plan_(plan),
        shareable_(std::size_t(t.B)) {
    // the blocks of sequence b wholly before its first query (and inside its table)
    for (int64_t b = 0; b < t.B; ++b) {
      const int64_t nq = t.q_start[b + 1] - t.q_start[b];
      const int64_t before = nq > 0 ? (t.seq_lens[b] - nq) / t.block_size : 0;
      shareable_[std::size_t(b)] = std::min(std::max<int64_t>(before, 0), t.max_blocks);
    }
  }

  void run() {
    std::vector<int64_t> rows;
    for (int64_t b = 0; b < t_.B; ++b)
      if (t_.q_start[b + 1] > t_.q_start[b]) rows.push_back(b);
    split(rows, 0, 0);
  }

 private:
  int32_t entry(int64_t b, int64_t j) const { return t_.block_tables[b * t_.bt_stride + j]; }

  // Adds the groups among `rows` (which share entries [0, b0)) that share entries from b0 on,
  // then the groups nested in each. Sequences with the same entry b0 share as many entries as
  // they all hold equal and wholly before their queries; a run too short to save
  // min_saved_ key reads ends that branch (its blocks stay in the members' tails).
  void split(std::vector<int64_t> rows, int64_t b0, int64_t depth) {
    rows.erase(std::remove_if(rows.begin(), rows.end(),
                              [&](int64_t r) { return shareable_[std::size_t(r)] <= b0; }),
               rows.end());
    if (rows.size() < 2) return;
    std::map<int32_t, std::vector<int64_t>> by_block;  // (ascending block ids, rows ascending)
    for (int64_t r : rows) by_block[entry(r, b0)].push_back(r);
    for (auto& kv : by_block) {
      const std::vector<int64_t>& members = kv.second;
      if (members.size() < 2) continue;
      int64_t width = t_.max_blocks;
      for (int64_t r : members) width = std::min(width, shareable_[std::size_t(r)]);
      int64_t b1 = b0 + 1;
      while (b1 < width && all_equal(members, b1)) ++b1;
      if ((b1 - b0) * t_.block_size * int64_t(members.size() - 1) < min_saved_) continue;
      plan_.groups.push_back({members, b0, b1, depth});
      split(members, b1, depth + 1);
    }
  }

  bool all_equal(const std::vector<int64_t>& rows, int64_t j) const {
    for (int64_t r : rows)
      if (entry(r, j) != entry(rows[0], j)) return false;
    return true;
  }

  const PagedParams& t_;
  int64_t min_saved_;
  CascadePlan& plan_;
  std::vector<int64_t> shareable_;
};

// Each depth's groups as the sequences of one problem (CascadeLevel).
void plan_levels(const PagedParams& t, CascadePlan& plan) {
  for (const CascadeGroup& g : plan.groups) {
    if (std::size_t(g.depth) >= plan.levels.size()) plan.levels.resize(std::size_t(g.depth + 1));
    CascadeLevel& lv = plan.levels[std::size_t(g.depth)];
    lv.max_blocks = std::max(lv.max_blocks, g.b1 - g.b0);
  }
  for (CascadeLevel& lv : plan.levels) lv.q_start.assign(1, 0);
  for (const CascadeGroup& g : plan.groups) {
    CascadeLevel& lv = plan.levels[std::size_t(g.depth)];
    const int32_t* row = t.block_tables + g.rows[0] * t.bt_stride;
    lv.table.insert(lv.table.end(), row + g.b0, row + g.b1);
    lv.table.resize(lv.table.size() + std::size_t(lv.max_blocks - (g.b1 - g.b0)), row[g.b0]);
    lv.lens.push_back(int32_t((g.b1 - g.b0) * t.block_size));
    for (int64_t r : g.rows)
      for (int64_t tok = t.q_start[r]; tok < t.q_start[r + 1]; ++tok) lv.tokens.push_back(tok);
    lv.q_start.push_back(int64_t(lv.tokens.size()));
  }
}

// Each sequence's table and length past its deepest group's run (the others unchanged).
void plan_tails(const PagedParams& t, CascadePlan& plan) {
  std::vector<int64_t> depth(std::size_t(t.B), 0);
  for (const CascadeGroup& g : plan.groups)
    for (int64_t r : g.rows) depth[std::size_t(r)] = std::max(depth[std::size_t(r)], g.b1);
  plan.tail_table.resize(std::size_t(t.B * t.max_blocks));
  plan.tail_lens.resize(std::size_t(t.B));
  for (int64_t b = 0; b < t.B; ++b) {
    const int64_t d = depth[std::size_t(b)];
    for (int64_t j = 0; j < t.max_blocks; ++j)  // (entries past the tail are never read)
      plan.tail_table[std::size_t(b * t.max_blocks + j)] =
          t.block_tables[b * t.bt_stride + std::min(j + d, t.max_blocks - 1)];
    plan.tail_lens[std::size_t(b)] = int32_t(t.seq_lens[b] - d * t.block_size);
  }
}

// The queries of one depth's groups over their shared runs, as a paged problem whose sequence g
// is group g: its rows are the group's stacked queries (read from the step's q by token index),
// their outputs and lse go to the float32 parts of the call (by token index), and a nested group
// merges in the part its enclosing groups left there (the prior), in place: a row's prior is read
// before the row is written, by the one thread that finishes it.
struct SharedProblem : detail::PagedProblem {
  const CascadeLevel& lv;
  float* part_out;  // (N, Hq, Dv)
  float* part_lse;  // (N, Hq)
  bool nested;

  SharedProblem(const PagedParams& level, const CascadeLevel& lv_, float* out, float* lse,
                bool nested_)
      : PagedProblem(level), lv(lv_), part_out(out), part_lse(lse), nested(nested_) {
    out_dtype = DType::f32;
  }
  int64_t token(int64_t b, int64_t i) const { return lv.tokens[std::size_t(lv.q_start[b] + i)]; }
  int64_t at(int64_t b, int64_t h, int64_t i) const { return token(b, i) * Hq + h; }
  const char* q_row(int64_t b, int64_t h, int64_t i) const {
    return static_cast<const char*>(a.q) + (token(b, i) * a.q_sn + h * a.q_sh) * int64_t(qes);
  }
  void* out_row(int64_t b, int64_t h, int64_t i) const { return part_out + at(b, h, i) * Dv; }
  float* lse_at(int64_t b, int64_t h, int64_t i) const { return part_lse + at(b, h, i); }
  Prior prior(int64_t b, int64_t h, int64_t i) const {
    if (!nested) return {nullptr, 0.f};
    return {part_out + at(b, h, i) * Dv, part_lse[at(b, h, i)]};
  }
};

// Call p's parameters for one level: its groups as the sequences, every key visible.
PagedParams level_params(const PagedParams& p, const CascadeLevel& lv) {
  PagedParams lp = p;
  lp.B = int64_t(lv.lens.size());
  lp.N = int64_t(lv.tokens.size());
  lp.block_tables = lv.table.data();
  lp.bt_stride = lp.max_blocks = lv.max_blocks;
  lp.seq_lens = lv.lens.data();
  lp.q_start = lv.q_start.data();
  lp.causal = false;
  lp.prior_out = lp.prior_lse = nullptr;
  return lp;
}

// The C++ API's own check (the binding makes the plan from the call's tables): p's tables are
// the plan's, and every entry the plan's problems read is inside the pool.
void check_plan(const CascadePlan& plan, const PagedParams& p) {
  bool ok = plan.B == p.B && plan.block_size == p.block_size && plan.max_blocks <= p.max_blocks;
  for (int64_t b = 0; ok && b < p.B; ++b)
    ok = plan.q_start[std::size_t(b + 1)] == p.q_start[b + 1] &&
         plan.seq_lens[std::size_t(b)] == p.seq_lens[b];
  if (!ok) throw InvalidArgument("cascade: the plan was made for other tables than this call's");
  auto in_pool = [&](int32_t blk) { return blk >= 0 && blk < p.num_blocks; };
  for (const CascadeLevel& lv : plan.levels)
    if (!std::all_of(lv.table.begin(), lv.table.end(), in_pool))
      throw InvalidArgument("cascade: block table entry out of range");
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t n = (int64_t(plan.tail_lens[std::size_t(b)]) + p.block_size - 1) / p.block_size;
    const int32_t* row = plan.tail_table.data() + b * plan.max_blocks;
    if (plan.tail_lens[std::size_t(b)] < 0 || n > plan.max_blocks ||
        !std::all_of(row, row + n, in_pool))
      throw InvalidArgument("cascade: block table entry out of range");
  }
}

}  // namespace

CascadePlan plan_cascade(const PagedParams& t, int64_t min_saved_keys) {
  CascadePlan plan;
  plan.B = t.B;
  plan.max_blocks = t.max_blocks;
  plan.block_size = t.block_size;
  plan.q_start.assign(t.q_start, t.q_start + t.B + 1);
  plan.seq_lens.assign(t.seq_lens, t.seq_lens + t.B);
  if (t.B < 2 || t.max_blocks == 0 || t.block_size <= 0) return plan;
  GroupFinder(t, min_saved_keys, plan).run();
  if (plan.empty()) return plan;
  plan_levels(t, plan);
  plan_tails(t, plan);
  return plan;
}

bool cascade_applies(const CascadePlan& plan, const PagedParams& p) {
  return !plan.empty() && p.var.window_left < 0 && p.var.window_right < 0 &&
         p.var.sinks == nullptr && p.var.alibi_slopes == nullptr && p.prior_out == nullptr;
}

void cascade_attend(const CascadePlan& plan, const PagedParams& p) {
  check_plan(plan, p);
  if (p.N == 0 || p.Hq == 0) return;
  const int nt = resolve_threads(p.num_threads);
  // Each query's part over the blocks its groups share, float32 (the shared parts keep full
  // precision; the tails' call rounds once to q's dtype): lse -inf (nothing seen) for a query in
  // no group, whose out is then never read.
  const int64_t row = p.Hq * p.Dv;
  std::unique_ptr<float[]> out(new float[std::size_t(p.N * row)]);
  std::vector<float> lse(std::size_t(p.N * p.Hq), -std::numeric_limits<float>::infinity());
  const bool bf16 = float32_bf16_products();  // (one value for every part of the call)
  const Int8TilesRule tiles = int8_tiles_rule();
  const bool int8q = int8_query();
  // The levels, then the tails, as stages of one region (detail::run_stages): the team wakes once,
  // and the tails (one short row per query and head) share out over it.
  std::deque<PagedParams> params;  // (stable addresses: each problem holds its parameters)
  std::deque<SharedProblem> levels;
  std::deque<detail::FlashStage<SharedProblem>> level_stages;
  std::vector<detail::Stage<float>*> stages;
  for (std::size_t d = 0; d < plan.levels.size(); ++d) {
    params.push_back(level_params(p, plan.levels[d]));
    levels.emplace_back(params.back(), plan.levels[d], out.get(), lse.data(), d > 0);
    levels.back().bf16_products = bf16;
    levels.back().int8_tiles_rule = tiles;
    levels.back().int8_query = int8q;
    level_stages.emplace_back(levels.back(), nt);
    stages.push_back(&level_stages.back());
  }
  PagedParams tp = p;  // the tails: causal, each row's shared part merged in before it is written
  tp.block_tables = plan.tail_table.data();
  tp.bt_stride = plan.max_blocks;
  tp.seq_lens = plan.tail_lens.data();
  tp.prior_out = out.get();
  tp.po_sn = row;
  tp.po_sh = p.Dv;
  tp.prior_lse = lse.data();
  tp.pl_sn = p.Hq;
  tp.pl_sh = 1;
  detail::PagedProblem tails(tp);
  tails.bf16_products = bf16;
  tails.int8_tiles_rule = tiles;
  tails.int8_query = int8q;
  detail::FlashStage<detail::PagedProblem> tail_stage(tails, nt);
  stages.push_back(&tail_stage);
  detail::run_stages(stages.data(), stages.size());
}

}  // namespace attnx
