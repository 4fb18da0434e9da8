// cascade.h: shared-prefix (cascade) attention over a paged cache. Sequences of one step whose
// block tables start with the same blocks (forks, prefix-cache hits) read those blocks once for
// all of them: each group's queries, stacked, attend to the group's shared run as one sequence of
// many queries (every key block is read once per kv head, whatever the number of queries); groups
// nest (a shared system prompt, then each conversation's forks); then every sequence attends to
// its own tail (its table past its deepest group's run), and each row's parts are merged by
// log-sum-exp with the one rule of state.h (the problem's prior, problem.h).
//
// A block is shared only if it lies wholly before every query of each sequence of the group: it
// is then fully visible to all of them, and the tails keep their bottom-right causal alignment.
// Positional variants that depend on where the query is (windows, ALiBi) and sinks (to be counted
// once) do not split: cascade_applies says no, and the step runs as plain paged attention.
//
// The plan depends only on the step's tables (never on a layer's pages or data): a cache step
// makes it once and every layer's call reuses it.
#pragma once
#include <cstdint>
#include <vector>

#include "attnx/paged.h"

namespace attnx {

// One group: the sequences `rows` (indices into the step's batch, ascending) share table entries
// [b0, b1), and every entry before b0 in their enclosing groups (depth: how many enclose it).
struct CascadeGroup {
  std::vector<int64_t> rows;
  int64_t b0 = 0, b1 = 0, depth = 0;
};

// The groups of one depth as the sequences of one paged problem: sequence g is group g's stacked
// queries (their packed token indices, `tokens`, from q_start[g]) over its shared run (the table
// row of its first member, from b0 on: table[g * max_blocks ...], lens[g] keys).
struct CascadeLevel {
  std::vector<int32_t> table, lens;
  std::vector<int64_t> q_start, tokens;
  int64_t max_blocks = 0;
};

struct CascadePlan {
  std::vector<CascadeGroup> groups;  // depth first: a group, then the groups nested in it
  std::vector<CascadeLevel> levels;  // levels[d]: the groups of depth d
  // Each sequence's table and length past the blocks its groups share (B rows of max_blocks).
  std::vector<int32_t> tail_table, tail_lens;
  // The tables the plan was made from (cascade_attend checks a call against them).
  std::vector<int64_t> q_start;
  std::vector<int32_t> seq_lens;
  int64_t B = 0, max_blocks = 0, block_size = 0;

  bool empty() const { return groups.empty(); }
};

// The groups of the tables in `tables` (B, block_tables, bt_stride, max_blocks, seq_lens,
// q_start, block_size) worth splitting: those that save at least max(min_saved_keys, 1) key reads
// per kv head (shared tokens times the sharing sequences but one).
CascadePlan plan_cascade(const PagedParams& tables, int64_t min_saved_keys);

// Whether call p can run through plan: it has groups, and p has no window, ALiBi, sinks or prior
// of its own. (Causal or not: the shared blocks lie before every query, visible either way.)
bool cascade_applies(const CascadePlan& plan, const PagedParams& p);

// Attention of call p (its tables checked, as paged_attention checks them, and those the plan was
// made from) through the plan: the shared parts level by level, then the tails, which merge them
// in and write p's out and lse. Throws InvalidArgument if p's tables are not the plan's.
void cascade_attend(const CascadePlan& plan, const PagedParams& p);

}  // namespace attnx
