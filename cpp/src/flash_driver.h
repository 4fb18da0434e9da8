// flash_driver.h: the scheduling shared by dense and paged attention. A problem adapter says where
// each query row, output row and KV row lives; this driver cuts the work into items (sequence, kv
// head, group of query heads, chunk of queries), optionally splits each item's key range across
// threads (split-KV), runs the ISA's flash kernel on each, and merges and finalises the rows.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include <atomic>
#include <mutex>

#include "attnx/attention.h"
#include "kernels/kernels.h"
#include "parallel.h"

namespace attnx {

const kern::KernelTable* active_table();

namespace detail {

constexpr int kRowsPerItem = 64;      // query rows per work item: Q (64 x 128 fp32) is 32 KiB
constexpr int64_t kMinSplitKeys = 256;  // a split-KV part covers at least this many keys
constexpr int64_t kMaxGroup = 16;       // decode items run interleaved in groups of at most this
constexpr int64_t kPackBudget = int64_t(64) << 20;  // bytes of shared packed K per call, at most
constexpr int64_t kPackKeep = int64_t(16) << 20;    // ... and kept for the next call, at most
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// 64-byte aligned float storage that only grows: one per thread, reused across calls.
class FloatBuf {
 public:
  float* get(std::size_t n) {
    if (n > cap_) {
      std::free(ptr_);
      ptr_ = static_cast<float*>(std::aligned_alloc(64, round_up(int64_t(n) * 4, 64)));
      if (ptr_ == nullptr) {
        cap_ = 0;
        throw std::bad_alloc();
      }
      cap_ = n;
    }
    return ptr_;
  }
  // Frees the storage if it holds more than max_floats.
  void trim(std::size_t max_floats) {
    if (cap_ <= max_floats) return;
    std::free(ptr_);
    ptr_ = nullptr;
    cap_ = 0;
  }
  ~FloatBuf() { std::free(ptr_); }

 private:
  float* ptr_ = nullptr;
  std::size_t cap_ = 0;
};

struct Item {
  int64_t b, kvh, h0, nh, i0, ni;  // sequence, kv head, first query head and count, query rows
};

// Items [first, first + n) that run together (one item, or the kv heads of one decode step).
struct Unit {
  int64_t first, n;
};

struct ThreadScratch {
  FloatBuf buf;
  FloatBuf packed_k;  // the calling thread's: K tiles packed once per call (see run_flash)
  std::vector<int> packed_ready;
  std::vector<const float*> ptrs;
  std::vector<const char*> addrs;
  std::vector<int64_t> ints;
  std::vector<const char*> mask_rows;
  std::vector<float> slopes;
};

inline ThreadScratch& thread_scratch() {
  static thread_local ThreadScratch ts;
  return ts;
}

// Runs attention for problem `P`. P provides: B, Hq, Hkv, Dk, Dv, scale, var, q_dtype, out_dtype,
// mask_kind, mask_sk (bytes), and
//   rows(b), lq(b), lk(b); q_row(b,h,i); out_row(b,h,i); lse_at(b,h,i) (may be null);
//   mask_row(b,h,i); k_src(b,kvh); v_src(b,kvh)
template <class P>
void run_flash(const P& p, int num_threads) {
  const kern::KernelTable* table = active_table();
  const int64_t G = p.Hq / p.Hkv;
  const int64_t Dkp = round_up(p.Dk, kern::kPad), Dvp = round_up(p.Dv, kern::kPad);
  const int64_t hg = std::min<int64_t>(G, kRowsPerItem);

  // Decode-like problems (every item has at most kDotRows rows: few queries per sequence) are
  // memory bound. Their items are grouped by (sequence, query chunk) and each group walks its
  // keys once, tile by tile, for all its kv heads in turn: see flash_group.
  int64_t max_rows = 0;
  for (int64_t b = 0; b < p.B; ++b) max_rows = std::max(max_rows, p.rows(b));
  const int64_t M_max = hg * std::min<int64_t>(max_rows, std::max<int64_t>(1, kRowsPerItem / hg));
  // Grouping pays where one head's keys are short runs in memory (pages of a pool that stores a
  // block's heads side by side, or rows of a (B, L, H, D) array): the group then reads whole
  // blocks front to back. A (B, H, L, D) array already gives each head one long run: there the
  // plain per-item order measured 5-10% faster.
  bool short_runs = false;
  if (p.B > 0 && p.Hkv > 1) {
    const kern::KVSource ks = p.k_src(0, 0);
    const int64_t row_bytes = p.Dk * int64_t(dtype_size(ks.dtype));
    short_runs = ks.row_stride != row_bytes || ks.block_table != nullptr;
  }
  const bool grouped = short_runs && M_max <= kern::kDotRows;

  std::vector<Item> items;
  std::vector<Unit> units;
  int64_t max_lk = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t rows = p.rows(b);
    if (rows == 0) continue;
    max_lk = std::max(max_lk, p.lk(b));
    const int64_t chunk = std::min<int64_t>(rows, std::max<int64_t>(1, kRowsPerItem / hg));
    auto add = [&](int64_t kvh, int64_t h0, int64_t i0) {
      items.push_back({b, kvh, h0, std::min(hg, (kvh + 1) * G - h0), i0,
                       std::min(chunk, rows - i0)});
      const int64_t ix = int64_t(items.size()) - 1;
      const Item* lead = units.empty() ? nullptr : &items[std::size_t(units.back().first)];
      if (grouped && lead != nullptr && units.back().n < kMaxGroup && lead->b == b && lead->i0 == i0)
        ++units.back().n;
      else
        units.push_back({ix, 1});
    };
    if (grouped) {
      for (int64_t i0 = 0; i0 < rows; i0 += chunk)
        for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
          for (int64_t h0 = kvh * G; h0 < (kvh + 1) * G; h0 += hg) add(kvh, h0, i0);
    } else {
      for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
        for (int64_t h0 = kvh * G; h0 < (kvh + 1) * G; h0 += hg)
          for (int64_t i0 = 0; i0 < rows; i0 += chunk) add(kvh, h0, i0);
    }
  }
  if (items.empty()) return;
  const int64_t n_items = int64_t(items.size()), n_units = int64_t(units.size());
  const int64_t max_group = grouped ? kMaxGroup : 1;

  // Prefill: the many-row QK^T path transposes each K tile it visits. Where several work items
  // (query chunks, head groups) share a kv head, the first item to reach a tile packs it into a
  // buffer shared by the call and the others read it (kern::KVSource::kt): each K tile of a
  // 2048-token causal GQA prefill was otherwise transposed by 128 items. An up-front packing pass
  // measured worse where few items share a head (it reads K with no compute to hide behind). The
  // buffer, one fp32 copy of those K (O(S * D)), is kept by the calling thread between calls, like
  // the per-thread scratch: a fresh allocation paid its page faults on every call. At most
  // kPackBudget bytes (the kv heads beyond it pack per item, as before), and at most kPackKeep
  // bytes are kept after the call: a long prefill's K would otherwise stay resident.
  const int64_t tile_floats = Dkp * kern::kTileK;
  std::vector<int64_t> kt_tile0;  // per (b, kvh): its first tile's index in the buffer, or -1
  int64_t n_tiles = 0;
  if (!grouped && M_max > kern::kDotRows) {
    std::vector<int64_t> users(std::size_t(p.B * p.Hkv), 0);
    for (const Item& it : items) ++users[std::size_t(it.b * p.Hkv + it.kvh)];
    kt_tile0.assign(std::size_t(p.B * p.Hkv), -1);
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
        const int64_t tiles = ceil_div(p.lk(b), kern::kTileK);
        if (users[std::size_t(b * p.Hkv + kvh)] < 2 ||
            (n_tiles + tiles) * tile_floats * 4 > kPackBudget)
          continue;
        kt_tile0[std::size_t(b * p.Hkv + kvh)] = n_tiles;
        n_tiles += tiles;
      }
  }
  float* kt_all = nullptr;
  int* kt_ready = nullptr;
  if (n_tiles > 0) {
    ThreadScratch& caller = thread_scratch();
    kt_all = caller.packed_k.get(std::size_t(n_tiles * tile_floats));
    caller.packed_ready.assign(std::size_t(n_tiles), 0);
    kt_ready = caller.packed_ready.data();
  }

  // Small problems run on the calling thread: waking a team costs more than the work.
  double flops = 0;
  for (int64_t b = 0; b < p.B; ++b) flops += double(p.rows(b)) * double(p.lk(b));
  flops *= double(p.Hq) * double(p.Dk + p.Dv) * 2.0;
  if (flops < 4e6) num_threads = 1;  // ~50 us of work: a team wake-up and barrier cost more

  // Split-KV: with fewer units than threads, give each thread a slice of the key range instead.
  int64_t nsplit = 1;
  if (n_units < 2 * num_threads && max_lk >= 2 * kMinSplitKeys)
    nsplit = std::min(ceil_div(2 * num_threads, n_units), max_lk / kMinSplitKeys);

  std::vector<float> part_o, part_ml;
  if (nsplit > 1) {
    part_o.resize(std::size_t(n_items * nsplit * M_max * Dvp));
    part_ml.resize(std::size_t(n_items * nsplit * M_max * 2));
  }

  // Per thread: Q, O, m and l for each item of a unit, and the tile buffers the items share.
  const std::size_t per_thread =
      std::size_t(max_group * (M_max * Dkp + M_max * Dvp + 2 * M_max) + Dkp * kern::kTileK +
                  kern::kTileK * Dkp + kern::kTileK * Dvp + 2 * M_max * kern::kTileK +
                  std::max(Dkp, Dvp) + Dvp + M_max + 64 * 12);

  // Rows of an item are ordered head-major: r = (h - h0) * ni + (i - i0).
  // Fills slot g of the thread's scratch with the item's rows.
  auto prepare = [&](const Item& it, ThreadScratch& ts, int64_t g, float* qs, kern::RowSet& rs) {
    const int M = int(it.nh * it.ni);
    int64_t* lo = ts.ints.data() + g * 3 * M_max;
    int64_t* hi = lo + M;
    int64_t* pos = hi + M;
    const char** mask_rows = ts.mask_rows.data() + g * M_max;
    const int64_t Lq = p.lq(it.b), Lk = p.lk(it.b), off = Lk - Lq;
    for (int64_t hh = 0; hh < it.nh; ++hh) {
      for (int64_t ii = 0; ii < it.ni; ++ii) {
        const int64_t r = hh * it.ni + ii, h = it.h0 + hh, i = it.i0 + ii;
        int64_t a = 0, e = Lk;
        if (i >= Lq) e = 0;  // padding query row: sees nothing, finalised to zeros
        if (p.causal) e = std::min(e, i + off + 1);
        if (p.var.window_left >= 0) a = std::max(a, i + off - p.var.window_left);
        if (p.var.window_right >= 0) e = std::min(e, i + off + p.var.window_right + 1);
        lo[r] = a;
        hi[r] = std::max(a, e);
        pos[r] = i + off;
        float* qr = qs + r * Dkp;
        table->load_row(p.q_row(it.b, h, i), p.q_dtype, p.Dk, qr);
        for (int64_t d = 0; d < p.Dk; ++d) qr[d] *= p.scale;
        for (int64_t d = p.Dk; d < Dkp; ++d) qr[d] = 0.f;
        if (p.mask_kind != MaskKind::none) mask_rows[r] = p.mask_row(it.b, h, i);
      }
    }
    rs.M = M;
    rs.q = qs;
    rs.ldq = Dkp;
    rs.lo = lo;
    rs.hi = hi;
    rs.pos = pos;
    rs.mask_kind = p.mask_kind;
    rs.mask_row = mask_rows;
    rs.mask_sk = p.mask_sk;
    if (p.var.alibi_slopes != nullptr) {
      float* slopes = ts.slopes.data() + g * M_max;
      for (int r = 0; r < M; ++r) slopes[r] = p.var.alibi_slopes[it.h0 + r / it.ni];
      rs.slope = slopes;
    }
  };

  // Writes one finished row: folds in the sink, normalises, converts, and stores out and lse.
  auto finalize_row = [&](const Item& it, int64_t r, const float* o, float m, float l, float* tmp) {
    const int64_t h = it.h0 + r / it.ni, i = it.i0 + r % it.ni;
    void* dst = p.out_row(it.b, h, i);
    float* lse = p.lse_at(it.b, h, i);
    if (i >= p.lq(it.b)) {  // padding row
      std::memset(dst, 0, std::size_t(p.Dv) * dtype_size(p.out_dtype));
      if (lse) *lse = kNegInf;
      return;
    }
    if (p.var.sinks != nullptr) {
      const float sink = p.var.sinks[h];
      const float m2 = std::max(m, sink);  // sink finite: m2 finite
      const float a = m == kNegInf ? 0.f : std::exp(m - m2);
      l = l * a + std::exp(sink - m2);
      for (int64_t d = 0; d < p.Dv; ++d) tmp[d] = o[d] * a;
      o = tmp;
      m = m2;
    }
    if (l == 0.f) {  // no visible key: zeros, lse = -inf
      std::memset(dst, 0, std::size_t(p.Dv) * dtype_size(p.out_dtype));
      if (lse) *lse = kNegInf;
      return;
    }
    const float inv = 1.f / l;
    for (int64_t d = 0; d < p.Dv; ++d) tmp[d] = o[d] * inv;
    table->store_row(tmp, p.Dv, p.out_dtype, dst);
    if (lse) *lse = m + std::log(l);
  };

  // Exceptions (only allocation failures can occur) must not leave a parallel region: each
  // thread records the first one and skips its remaining work, and the caller rethrows it.
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<bool> any_failed{false};
  auto record = [&]() {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!error) error = std::current_exception();
    any_failed.store(true);
  };
  parallel(num_threads, [&](Team& team) {
    ThreadScratch& ts = thread_scratch();
    float* base = nullptr;
    try {
      base = ts.buf.get(per_thread);
      ts.ptrs.resize(2 * kern::kTileK);
      ts.addrs.resize(4 * kern::kTileK);
      ts.ints.resize(std::size_t(max_group * 3 * M_max));
      ts.mask_rows.resize(std::size_t(max_group * M_max));
      ts.slopes.resize(std::size_t(max_group * M_max));
    } catch (...) {
      base = nullptr;
      record();
    }
    // Nothing is written until every thread has its scratch: a failed allocation anywhere
    // leaves `out` untouched (the call raises MemoryError).
    team.barrier();
    if (any_failed.load()) base = nullptr;
    float* qs = base;                       // max_group x (M_max, Dkp)
    float* o = qs + max_group * M_max * Dkp;  // max_group x (M_max, Dvp)
    float* m = o + max_group * M_max * Dvp;   // max_group x M_max
    float* l = m + max_group * M_max;         // max_group x M_max
    float* kt = l + max_group * M_max;
    float* kf = kt + Dkp * kern::kTileK;
    float* vf = kf + kern::kTileK * Dkp;
    float* s = vf + kern::kTileK * Dvp;
    float* bias = s + M_max * kern::kTileK;
    float* zero = bias + M_max * kern::kTileK;
    float* tmp = zero + std::max(Dkp, Dvp);
    if (base != nullptr) std::memset(zero, 0, sizeof(float) * std::size_t(std::max(Dkp, Dvp)));
    kern::Scratch sc{kt, kf, vf, s, bias, zero, ts.ptrs.data(), ts.ptrs.data() + kern::kTileK,
                     ts.addrs.data(), ts.addrs.data() + 2 * kern::kTileK};


    team.for_dynamic(n_units * nsplit, [&](int64_t w) {
      if (base == nullptr) return;
      const Unit& u = units[std::size_t(w / nsplit)];
      const int64_t split = w % nsplit;
      kern::RowSet rs[kMaxGroup];
      kern::KVSource ks[kMaxGroup], vs[kMaxGroup];
      kern::FlashState st[kMaxGroup];
      bool aligned = false;  // packed tiles start at multiples of kTileK: so must the item's tiles
      // the unit's key range (the union of its rows'), cut into nsplit tile-aligned parts
      int64_t jb = std::numeric_limits<int64_t>::max(), je = 0;
      for (int64_t g = 0; g < u.n; ++g) {
        const Item& it = items[std::size_t(u.first + g)];
        prepare(it, ts, g, qs + g * M_max * Dkp, rs[g]);
        for (int r = 0; r < rs[g].M; ++r)
          if (rs[g].lo[r] < rs[g].hi[r]) {
            jb = std::min(jb, rs[g].lo[r]);
            je = std::max(je, rs[g].hi[r]);
          }
      }
      if (je <= jb) jb = je = 0;
      for (int64_t g = 0; g < u.n && !kt_tile0.empty(); ++g) {
        const Item& it = items[std::size_t(u.first + g)];
        aligned = aligned || kt_tile0[std::size_t(it.b * p.Hkv + it.kvh)] >= 0;
      }
      if (aligned) jb = jb / kern::kTileK * kern::kTileK;
      const int64_t part = round_up(ceil_div(je - jb, nsplit), kern::kTileK);
      const int64_t pb = std::min(je, jb + split * part), pe = std::min(je, pb + part);

      for (int64_t g = 0; g < u.n; ++g) {
        const Item& it = items[std::size_t(u.first + g)];
        const int64_t ix = u.first + g, M = rs[g].M;
        float* os = nsplit > 1 ? part_o.data() + std::size_t((ix * nsplit + split) * M_max * Dvp)
                               : o + g * M_max * Dvp;
        float* ms = nsplit > 1 ? part_ml.data() + std::size_t((ix * nsplit + split) * M_max * 2)
                               : m + g * M_max;
        float* ls = nsplit > 1 ? ms + M_max : l + g * M_max;
        std::memset(os, 0, sizeof(float) * std::size_t(M * Dvp));
        for (int r = 0; r < M; ++r) {
          ms[r] = kNegInf;
          ls[r] = 0.f;
        }
        ks[g] = p.k_src(it.b, it.kvh);
        vs[g] = p.v_src(it.b, it.kvh);
        const int64_t tile0 = kt_tile0.empty() ? -1 : kt_tile0[std::size_t(it.b * p.Hkv + it.kvh)];
        if (tile0 >= 0) {
          ks[g].kt = kt_all + tile0 * tile_floats;
          ks[g].kt_ready = kt_ready + tile0;
          ks[g].kt_keys = p.lk(it.b);
        }
        st[g] = kern::FlashState{os, Dvp, ms, ls};
      }
      if (pe > pb) {
        if (u.n == 1)
          table->flash(rs[0], ks[0], vs[0], pb, pe, p.Dk, p.Dv, p.var.softcap, sc, st[0]);
        else
          table->flash_group(int(u.n), rs, ks, vs, pb, pe, p.Dk, p.Dv, p.var.softcap, sc, st);
      }
      if (nsplit == 1)
        for (int64_t g = 0; g < u.n; ++g)
          for (int r = 0; r < rs[g].M; ++r)
            finalize_row(items[std::size_t(u.first + g)], r, st[g].o + r * Dvp, st[g].m[r],
                         st[g].l[r], tmp);
    });

    if (nsplit > 1) {
      // merge the parts by log-sum-exp: m = max m_s, l = sum l_s e^(m_s - m), O likewise
      team.for_static(n_items, [&](int64_t ix) {
        if (base == nullptr) return;
        const Item& it = items[std::size_t(ix)];
        const int64_t M = it.nh * it.ni;
        for (int64_t r = 0; r < M; ++r) {
          float mm = kNegInf;
          for (int64_t sp = 0; sp < nsplit; ++sp)
            mm = std::max(mm, part_ml[std::size_t((ix * nsplit + sp) * M_max * 2 + r)]);
          float ll = 0.f;
          for (int64_t d = 0; d < Dvp; ++d) o[d] = 0.f;  // slot 0's O is free by now
          for (int64_t sp = 0; sp < nsplit; ++sp) {
            const std::size_t w = std::size_t(ix * nsplit + sp);
            const float ms = part_ml[w * M_max * 2 + r], ls = part_ml[w * M_max * 2 + M_max + r];
            if (ms == kNegInf) {
              if (std::isnan(ls)) ll = ls;  // a NaN score seen before anything visible
              continue;
            }
            const float a = std::exp(ms - mm);
            ll += ls * a;
            const float* os = part_o.data() + w * M_max * Dvp + r * Dvp;
            for (int64_t d = 0; d < p.Dv; ++d) o[d] += os[d] * a;
          }
          finalize_row(it, r, o, mm, ll, tmp);
        }
      });
    }
  });
  if (n_tiles > 0) thread_scratch().packed_k.trim(std::size_t(kPackKeep / 4));
  if (error) std::rethrow_exception(error);
}

}  // namespace detail
}  // namespace attnx
