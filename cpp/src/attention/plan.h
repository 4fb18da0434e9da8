// plan.h: how run_flash cuts one call into work: items (sequence, kv head, group of query heads,
// chunk of queries), units of items that run together, the split of each unit's keys across
// threads (split-KV), which kv heads share a packed K buffer, and how many threads to wake.
// A plan depends only on the problem's shapes and lengths, never on the data.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnx/types.h"
#include "kernels/tables.h"
#include "attention/problem.h"

namespace attnx {
namespace detail {

constexpr int kRowsPerItem = 64;        // query rows per work item: Q (64 x 128 fp32) is 32 KiB
constexpr int64_t kMinSplitKeys = 256;  // a split-KV part covers at least this many keys
constexpr int64_t kMaxGroup = 16;       // decode items run interleaved in groups of at most this
constexpr int64_t kPackBudget = int64_t(64) << 20;  // bytes of shared packed K per call, at most
constexpr int64_t kPackKeep = int64_t(16) << 20;    // ... and kept for the next call, at most
constexpr double kTeamFlops = 4e6;  // below: ~50 us of work, less than a team wake-up and barrier
// ... unless it reads at least this many key and value elements: a decode call does few FLOPs
// per element, so the FLOP count undersells it. One query of a SmolLM2 layer (Hq 9, Hkv 3, D 64)
// over 512 keys reads 197k elements (1.2 MFLOP): 49 -> 35 us on two threads in fp32, 46 -> 33 in
// fp16 (over 1024 keys: 77 -> 53 us); over 256 keys (98k) one and two threads were even.
constexpr double kTeamElems = 160e3;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

struct Item {
  int64_t b, kvh, h0, nh, i0, ni;  // sequence, kv head, first query head and count, query rows
};

// Items [first, first + n) that run together (one item, or the kv heads of one decode step).
struct Unit {
  int64_t first, n;
};

struct Plan {
  int64_t Hkv = 0, Dkp = 0, Dvp = 0;  // kv heads; Dk and Dv padded to kern::kPad
  int64_t M_max = 0;      // rows of the largest item (nh * ni); rows are ordered head-major
  int64_t max_group = 1;  // items per unit, at most (kMaxGroup where grouped, else 1)
  std::vector<Item> items;
  std::vector<Unit> units;
  int64_t nsplit = 1;  // parts each unit's key range is cut into (split-KV)
  int num_threads = 1;
  // Packed K shared by the items of a kv head: per (b, kvh), the index of its first tile in the
  // call's buffer, or -1 (that head packs per item); n_tiles tiles of tile_elems elements (of
  // the problem's compute type) in all.
  std::vector<int64_t> kt_tile0;
  int64_t n_tiles = 0, tile_elems = 0;

  int64_t n_items() const { return int64_t(items.size()); }
  int64_t n_units() const { return int64_t(units.size()); }
  // The first packed tile of the item's kv head, or -1.
  int64_t kt_tile(const Item& it) const {
    return kt_tile0.empty() ? -1 : kt_tile0[std::size_t(it.b * Hkv + it.kvh)];
  }
};

// Decode-like sequences (each of their items has at most kDotRows rows: few queries) are memory
// bound. Their items are grouped by (sequence, query chunk) and each group walks its keys once,
// tile by tile, for all its kv heads in turn: see flash_group. Grouping pays where one head's
// keys are short runs in memory (pages of a pool that stores a block's heads side by side, or
// rows of a (B, L, H, D) array): the group then reads whole blocks front to back. A (B, H, L, D)
// array already gives each head one long run: there the plain per-item order is faster
// (bench/NOTES.md). The choice is per sequence (item_rows), so the decoding sequences of a batch
// that also prefills other sequences' chunks are grouped too.
template <class P>
bool plan_grouped(const P& p) {
  if (p.B == 0 || p.Hkv <= 1) return false;
  const kern::KVSource ks = p.k_src(0, 0);
  const int64_t row_bytes = p.Dk * int64_t(dtype_size(ks.dtype));
  return ks.row_stride != row_bytes || ks.block_table != nullptr;  // short runs
}

// Query rows per item of a sequence with `rows` query rows per head: the rows of up to
// kRowsPerItem / hg queries of hg heads.
inline int64_t item_chunk(int64_t rows, int64_t hg) {
  return std::min<int64_t>(rows, std::max<int64_t>(1, kRowsPerItem / hg));
}

// Appends item (b, kvh, h0, i0) to the plan, in the unit of the previous item where it can join.
inline void plan_add(Plan& plan, bool grouped, const Item& it) {
  plan.items.push_back(it);
  const int64_t ix = plan.n_items() - 1;
  const Item* lead =
      plan.units.empty() ? nullptr : &plan.items[std::size_t(plan.units.back().first)];
  if (grouped && lead != nullptr && plan.units.back().n < kMaxGroup && lead->b == it.b &&
      lead->i0 == it.i0)
    ++plan.units.back().n;
  else
    plan.units.push_back({ix, 1});
}

// Items and units (grouped where `grouped` allows it and the sequence decodes); returns the
// longest key range of a sequence with queries.
template <class P>
int64_t plan_items(const P& p, int64_t hg, bool grouped, Plan& plan) {
  const int64_t G = p.Hq / p.Hkv;
  int64_t max_lk = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t rows = p.rows(b);
    if (rows == 0) continue;
    max_lk = std::max(max_lk, p.lk(b));
    const int64_t chunk = item_chunk(rows, hg);
    const bool group_b = grouped && hg * chunk <= kern::kDotRows;
    if (group_b) plan.max_group = kMaxGroup;
    auto add = [&](int64_t kvh, int64_t h0, int64_t i0) {
      plan_add(plan, group_b,
               {b, kvh, h0, std::min(hg, (kvh + 1) * G - h0), i0, std::min(chunk, rows - i0)});
    };
    if (group_b) {
      for (int64_t i0 = 0; i0 < rows; i0 += chunk)
        for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
          for (int64_t h0 = kvh * G; h0 < (kvh + 1) * G; h0 += hg) add(kvh, h0, i0);
    } else {
      for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
        for (int64_t h0 = kvh * G; h0 < (kvh + 1) * G; h0 += hg)
          for (int64_t i0 = 0; i0 < rows; i0 += chunk) add(kvh, h0, i0);
    }
  }
  return max_lk;
}

// Prefill: the many-row QK^T path transposes each K tile it visits. Where several work items
// (query chunks, head groups) share a kv head, the first item to reach a tile packs it into a
// buffer shared by the call and the others read it (kern::KVSource::kt): each K tile of a
// 2048-token causal GQA prefill would otherwise be transposed by 128 items. An up-front packing
// pass is worse where few items share a head (it reads K with no compute to hide behind). The
// buffer, one copy of those K in the compute type (O(S * D)), is kept by the calling thread between
// calls, like the per-thread scratch: a fresh allocation would pay its page faults on every call.
// At most kPackBudget bytes (the kv heads beyond it pack per item), and at most kPackKeep bytes are
// kept after the call: a long prefill's K would otherwise stay resident.
template <class P>
void plan_packed_k(const P& p, Plan& plan) {
  plan.tile_elems = plan.Dkp * kern::kTileK;
  const int64_t elem = int64_t(sizeof(typename P::Real));
  std::vector<int64_t> users(std::size_t(p.B * p.Hkv), 0);
  for (const Item& it : plan.items)  // (items of kDotRows rows or fewer read K in place)
    if (it.nh * it.ni > kern::kDotRows) ++users[std::size_t(it.b * p.Hkv + it.kvh)];
  plan.kt_tile0.assign(std::size_t(p.B * p.Hkv), -1);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      const int64_t tiles = ceil_div(p.lk(b), kern::kTileK);
      if (users[std::size_t(b * p.Hkv + kvh)] < 2 ||
          (plan.n_tiles + tiles) * plan.tile_elems * elem > kPackBudget)
        continue;
      plan.kt_tile0[std::size_t(b * p.Hkv + kvh)] = plan.n_tiles;
      plan.n_tiles += tiles;
    }
}

// Threads: small problems run on the calling thread (waking a team costs more than the work).
// Split-KV: with fewer units than threads, each thread gets a slice of a unit's key range.
template <class P>
void plan_threads(const P& p, int num_threads, int64_t max_lk, Plan& plan) {
  double flops = 0, keys = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    flops += double(p.rows(b)) * double(p.lk(b));
    keys += double(p.lk(b));
  }
  flops *= double(p.Hq) * double(p.Dk + p.Dv) * 2.0;
  const double elems = keys * double(p.Hkv) * double(p.Dk + p.Dv);
  plan.num_threads = flops < kTeamFlops && elems < kTeamElems ? 1 : num_threads;
  const int64_t n_units = plan.n_units();
  plan.nsplit = 1;
  if (n_units < 2 * plan.num_threads && max_lk >= 2 * kMinSplitKeys)
    plan.nsplit = std::min(ceil_div(2 * plan.num_threads, n_units), max_lk / kMinSplitKeys);
}

// The plan of problem p on up to num_threads threads (no items: nothing to run).
template <class P>
Plan make_plan(const P& p, int num_threads) {
  check_problem<P>();
  Plan plan;
  plan.Hkv = p.Hkv;
  plan.Dkp = round_up(p.Dk, kern::kPad);
  plan.Dvp = round_up(p.Dv, kern::kPad);
  const int64_t hg = std::min<int64_t>(p.Hq / p.Hkv, kRowsPerItem);  // query heads per item
  int64_t max_rows = 0;
  for (int64_t b = 0; b < p.B; ++b) max_rows = std::max(max_rows, p.rows(b));
  plan.M_max = hg * item_chunk(max_rows, hg);
  const int64_t max_lk = plan_items(p, hg, plan_grouped(p), plan);
  if (plan.items.empty()) return plan;
  if (plan.M_max > kern::kDotRows) plan_packed_k(p, plan);
  plan_threads(p, num_threads, max_lk, plan);
  return plan;
}

}  // namespace detail
}  // namespace attnx
