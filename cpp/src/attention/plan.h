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
  // Packed K shared by the items of a kv head (plan_packed_k): per (b, kvh), its index among the
  // packed heads (in item order), or -1 (that head packs per item). Packed head k uses slot
  // k % n_slots of the call's buffer, slot_tiles tiles of tile_elems elements (of the problem's
  // compute type) each; head_items[k] counts its items. Where heads share a slot, each takes it
  // over once every item of the one before it has finished (driver.h SharedPackedK).
  std::vector<int64_t> packed_head, head_items;
  int64_t n_packed = 0, n_slots = 0, slot_tiles = 0, tile_elems = 0;

  int64_t n_items() const { return int64_t(items.size()); }
  int64_t n_units() const { return int64_t(units.size()); }
  int64_t n_tiles() const { return n_slots * slot_tiles; }
  // The item's packed head, or -1.
  int64_t packed(const Item& it) const {
    return packed_head.empty() ? -1 : packed_head[std::size_t(it.b * Hkv + it.kvh)];
  }
  // The first tile of the item's packed slot, or -1.
  int64_t kt_tile(const Item& it) const {
    const int64_t k = packed(it);
    return k < 0 ? -1 : k % n_slots * slot_tiles;
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
// pass is worse where few items share a head (it reads K with no compute to hide behind).
// The buffer is a ring of slots, one kv head's tiles each, kept by the calling thread between
// calls like the per-thread scratch (a fresh allocation would pay its page faults on every call),
// and bounded by the threads, not by the batch: the kv heads of a call take turns. The items run in
// plan order, a kv head's items one after another, so a slot can pass to a later head once the
// items of the one before have finished; an item that starts before its slot is free packs its own
// tiles. kMinSlotsPerThread slots per thread (a thread can run a head ahead of a slow item of
// another's) where kPackBudget allows, at most one per packed head. With split-KV every head keeps
// its own slot (merge_item reads the tiles again after every unit has run), at most kPackBudget
// bytes of them; the heads beyond pack per item.
constexpr int64_t kMinSlotsPerThread = 2;

template <class P>
void plan_packed_k(const P& p, Plan& plan) {
  plan.tile_elems = plan.Dkp * kern::kTileK;
  const int64_t tile_bytes = plan.tile_elems * int64_t(sizeof(typename P::Real));
  std::vector<int64_t> users(std::size_t(p.B * p.Hkv), 0), items(users.size(), 0);
  for (const Item& it : plan.items) {  // (items of kDotRows rows or fewer read K in place)
    ++items[std::size_t(it.b * p.Hkv + it.kvh)];
    if (it.nh * it.ni > kern::kDotRows) ++users[std::size_t(it.b * p.Hkv + it.kvh)];
  }
  auto tiles = [&](int64_t b) { return ceil_div(p.lk(b), kern::kTileK); };
  auto packs = [&](int64_t b, int64_t kvh) {  // shared, has keys, and its slot fits the budget
    return users[std::size_t(b * p.Hkv + kvh)] >= 2 && tiles(b) > 0 &&
           tiles(b) * tile_bytes <= kPackBudget;
  };
  int64_t heads = 0;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
      if (packs(b, kvh)) {
        plan.slot_tiles = std::max(plan.slot_tiles, tiles(b));
        ++heads;
      }
  if (heads == 0) return;
  const int64_t fit = kPackBudget / (plan.slot_tiles * tile_bytes);
  plan.n_slots =
      std::min({heads, fit, plan.nsplit > 1 ? heads : kMinSlotsPerThread * plan.num_threads});
  plan.packed_head.assign(std::size_t(p.B * p.Hkv), -1);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
      if (packs(b, kvh) && (plan.nsplit == 1 || plan.n_packed < plan.n_slots)) {
        plan.packed_head[std::size_t(b * p.Hkv + kvh)] = plan.n_packed++;
        plan.head_items.push_back(items[std::size_t(b * p.Hkv + kvh)]);
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
  // no more threads than pieces of work: the others would only wake and wait at the barriers
  plan.num_threads = int(std::min<int64_t>(plan.num_threads, n_units * plan.nsplit));
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
  plan_threads(p, num_threads, max_lk, plan);
  if (plan.M_max > kern::kDotRows && p.Dk > 0) plan_packed_k(p, plan);  // (Dk = 0: nothing to pack)
  return plan;
}

}  // namespace detail
}  // namespace attnx
