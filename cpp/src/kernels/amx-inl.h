// amx-inl.h: the prefill tile loop on AMX tiles (AMX-BF16's tdpbf16ps: C[16 x 16] fp32 +=
// A[16 x 32 bf16] B[32 bf16 x 16], B in pairs along its rows), for bf16 q, k and v (and float32
// ones where the caller allows bf16 products: bf16_prefill).
// isa_amx.cpp includes it after the flash stages (load-inl.h .. probes-inl.h) and bf16_dot-inl.h,
// inside the same namespace: the packed layouts (Q, K and V as bf16 pairs: pack_q_bf16,
// pack_k_bf16, pack_v_bf16), the masks, the online softmax and the P rounding are theirs; only the
// two products move to tiles. isa_avx512bf16.cpp includes it the same way, without
// ATTNX_AMX_TILES: there the tiles are int8_tiles-inl.h's EmuTiles (the same layouts, loads,
// stores and tdpbf16ps sums in plain C++), the `amx-emulated` path that tests this loop on CPUs
// without AMX.
//
// Numerics: those of bf16_dot-inl.h (README "dtypes"): the same products, each exact in fp32,
// summed in fp32 in the tiles' order; P rounded to bf16 before P V; O accumulated in fp32. The
// wide blocks' exps for rows without an lse fold log2(e) into their factors (WideExp below).
//
// Tiles: all eight are configured 16 rows x 64 bytes (16 fp32, or 16 bf16 pairs). A product is
// blocked 2 x 2: tiles 0-3 accumulate rows [r, r + 32) x columns [c, c + 32) (C), 4-5 hold the
// two row blocks of A (Q or P), 6-7 the two column blocks of B (K or V pairs): 4 loads feed 4
// tile products. Row blocks past M read zero rows of a padded copy (Q) or land in a staging copy
// (O), so a tile never reads or writes past an array.

// The including file provides <immintrin.h> and <utility> (compiled with -mamx-tile -mamx-bf16
// where it defines ATTNX_AMX_TILES).

namespace {

constexpr int kTilePairs = 16;  // bf16 pairs (or fp32) along a tile row: 64 bytes
// (kTileRows, kRowsPad, TileConfig and TileScope: int8_tiles-inl.h, whose tiles are configured
// alike)

// Keys per wide block: up to kWideTiles KV tiles (wide_keys below) go through one softmax pass and
// one P V product, so each output tile is loaded and stored once per 256 keys instead of once per
// 64, and each P V accumulation runs 16 tile products deep.
constexpr int kWideTiles = 4;
constexpr int64_t kWideKeys = kWideTiles * kTileK;

// The tiles' own buffers, per thread: Q as pairs and S (then P) for up to kRowsPad rows, a
// staging copy of the output rows of a partial row block, the scores of a wide block's row pair,
// and the K and V pairs of a wide block's tiles where they are not shared.
struct AmxScratch {
  kern::Carve<float> raw;
  Pair* qb = nullptr;       // (kRowsPad, Dkp / 2): zero rows past M
  float* s = nullptr;       // (kRowsPad, kTileK)
  float* ostage = nullptr;  // (2 * kTileRows, Dvp)
  float* sw = nullptr;      // 2 x (2 * kTileRows, kWideKeys): two row pairs' scores
  // three wide blocks' private packs (the current block, the next, and the one whose last row
  // pair's P V is still running): each tile's K pairs (Dkp * kTileK, then its V pairs), and V
  // pairs where they do not fit beside K (kTileK * Dvp)
  static constexpr int kSets = 3;
  float* kv[kSets][kWideTiles] = {};
  float* vf[kSets][kWideTiles] = {};
  int64_t dkp = -1, dvp = -1;
  void size(int64_t Dkp, int64_t Dvp) {
    if (Dkp == dkp && Dvp == dvp) return;
    const int64_t nq = kRowsPad * Dkp / 2, ns = kRowsPad * kTileK, no = 2 * kTileRows * Dvp;
    const int64_t nw = 2 * 2 * kTileRows * kWideKeys, nk = Dkp * kTileK, nv = kTileK * Dvp;
    raw.reset(nq + ns + no + nw + kSets * kWideTiles * (nk + nv));
    qb = reinterpret_cast<Pair*>(raw.take(nq));
    s = raw.take(ns);
    ostage = raw.take(no);
    sw = raw.take(nw);
    for (int b = 0; b < kSets; ++b)
      for (int t = 0; t < kWideTiles; ++t) {
        kv[b][t] = raw.take(nk);
        vf[b][t] = raw.take(nv);
      }
    dkp = Dkp;
    dvp = Dvp;
  }
};
static AmxScratch& amx_scratch() {
  static thread_local AmxScratch sc;
  return sc;
}

// ---- The tiles: the hardware's (configured by a TileScope), or their emulation, per thread. The
// hardware's loads and stores are int8_tiles-inl.h's inline assembly, which tells the compiler
// they read and write memory (GCC's _tile_loadd and _tile_stored do not: the vector stores of P
// could be moved past the tile loads that read it).
#if defined(ATTNX_AMX_TILES)
using BfTiles = AmxTiles;
using BfScope = TileScope;
#else
using BfTiles = EmuTiles;
struct BfScope {};
#endif
static BfTiles& bf_tiles() {
  static thread_local BfTiles t;
  return t;
}

// ---- The accumulator block: four float32 tiles (0..3) over 32 rows x 32 columns of C, where c is
// its first element and ldc its floats a row; tiles 4..7 carry A's two 16-row blocks and B's two
// 16-column halves through one 16-pair block of the reduction.
// -------------------------------------
static inline void c_tiles_zero() {
  BfTiles& t = bf_tiles();
  t.zero<0>();
  t.zero<1>();
  t.zero<2>();
  t.zero<3>();
}

static inline void c_tiles_load(const float* c, int64_t ldc) {
  BfTiles& t = bf_tiles();
  t.load<0>(c, ldc * 4);
  t.load<1>(c + kTilePairs, ldc * 4);
  t.load<2>(c + kTileRows * ldc, ldc * 4);
  t.load<3>(c + kTileRows * ldc + kTilePairs, ldc * 4);
}

static inline void c_tiles_store(float* c, int64_t ldc) {
  BfTiles& t = bf_tiles();
  t.store<0>(c, ldc * 4);
  t.store<1>(c + kTilePairs, ldc * 4);
  t.store<2>(c + kTileRows * ldc, ldc * 4);
  t.store<3>(c + kTileRows * ldc + kTilePairs, ldc * 4);
}

// C += A B over one 16-pair block: a is the block's first pair in A's first row (lda pairs a row),
// b its first pair in B (ldb pairs a row, one row per pair of the reduction).
static inline void c_tiles_dp(const Pair* a, int64_t lda, const Pair* b, int64_t ldb) {
  BfTiles& t = bf_tiles();
  t.load<4>(a, lda * 4);
  t.load<5>(a + kTileRows * lda, lda * 4);
  t.load<6>(b, ldb * 4);
  t.load<7>(b + kTilePairs, ldb * 4);
  t.dp_bf16<0, 4, 6>();
  t.dp_bf16<1, 4, 7>();
  t.dp_bf16<2, 5, 6>();
  t.dp_bf16<3, 5, 7>();
}

// ---- S = Q K^T (unscaled) for rows [0, M) rounded up to 32, all kTileK keys of one tile -------
// qb: ldq pairs a row; kp: pack_k_bf16's layout (kTileK pairs a row, one row per feature pair);
// nkb: the 16-pair blocks of features that hold data. s: kTileK floats a row.
static void qk_amx(int M, const Pair* qb, int64_t ldq, const Pair* kp, int64_t nkb, float* s) {
  for (int r = 0; r < M; r += 2 * kTileRows) {
    const Pair* a = qb + r * ldq;
    for (int c = 0; c < kTileK; c += 2 * kTilePairs) {
      c_tiles_zero();
      for (int64_t kb = 0; kb < nkb; ++kb)
        c_tiles_dp(a + kb * kTilePairs, ldq, kp + kb * kTilePairs * kTileK + c, kTileK);
      c_tiles_store(s + int64_t(r) * kTileK + c, kTileK);
    }
  }
}

// ---- O += P V: p holds each row's key pairs at its start (kTileK floats a row), zero from pair
// n2 to a whole block; vp: pack_v_bf16's layout (Dvp pairs a row, one row per key pair), zero
// rows from n2 to a whole block. Rows past M (to a multiple of 32) go through `stage`. -----------
static void pv_amx(int M, const Pair* p, const Pair* vp, int64_t n2, int64_t Dvp, float* o,
                   int64_t ldo, float* stage) {
  const int64_t nkb = (n2 + kTilePairs - 1) / kTilePairs;
  for (int r = 0; r < M; r += 2 * kTileRows) {
    const int rows = M - r < 2 * kTileRows ? M - r : 2 * kTileRows;
    float* orow = o + r * ldo;
    int64_t ld = ldo;
    if (rows < 2 * kTileRows) {  // a partial pair of row blocks: its rows, then zeros
      for (int i = 0; i < rows; ++i)
        std::memcpy(stage + i * Dvp, orow + i * ldo, sizeof(float) * std::size_t(Dvp));
      std::memset(stage + rows * Dvp, 0, sizeof(float) * std::size_t((2 * kTileRows - rows) * Dvp));
      orow = stage;
      ld = Dvp;
    }
    const Pair* a = p + int64_t(r) * kTileK;
    for (int64_t c = 0; c < Dvp; c += 2 * kTilePairs) {
      c_tiles_load(orow + c, ld);
      for (int64_t kb = 0; kb < nkb; ++kb)
        c_tiles_dp(a + kb * kTilePairs, kTileK, vp + kb * kTilePairs * Dvp + c, Dvp);
      c_tiles_store(orow + c, ld);
    }
    if (orow == stage)
      for (int i = 0; i < rows; ++i)
        std::memcpy(o + (r + i) * ldo, stage + i * Dvp, sizeof(float) * std::size_t(Dvp));
  }
}

// The fused tiles' online-softmax update (softmax-inl.h online_block) of the M rows of raw
// products in s (each times `scale` is a score): p as bf16 pairs at the start of each row.
template <class PExp>
static void online_rows(int M, float* s, float scale, const Online& on) {
  constexpr int NC = kTileK / W;
  auto block = [&](auto mr, int r) {
    constexpr int MR = decltype(mr)::value;
    V acc[MR][NC];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < NC; ++c) acc[i][c] = load(s + (r + i) * kTileK + c * W);
    V sum[MR];
    for (int i = 0; i < MR; ++i) sum[i] = zero();
    const Online rows = on.rows(r);
    online_block<MR, NC, false, true, PExp>(acc, 0, s + int64_t(r) * kTileK, rows, sum, scale);
    for (int i = 0; i < MR; ++i) rows.l[i] += reduce_add(sum[i]);
  };
  row_blocks<4>(M, block);
}

// Accumulates keys [j0, j_end) of one tile (at most kTileK keys) into the state; qb: the rows'
// queries as bf16 pairs (zero rows to a multiple of 32), qscale the factor their products take.
static void flash_tile_amx(const kern::RowSet& rs, const Pair* qb, float qscale,
                           const kern::KVSource& ks, const kern::KVSource& vs, int64_t j0,
                           int64_t j_end, int64_t Dk, int64_t Dv, float softcap,
                           const kern::Scratch& sc, const kern::FlashState& st, AmxScratch& ax) {
  const int64_t n = imin(kTileK, j_end - j0), n2 = (n + 1) / 2;
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  const float* bias = nullptr;
  if (!tile_open(rs, j0, n, sc, &bias)) return;
  const PackedKV kv = packed_kv(ks, vs, j0, n, Dk, Dv, sc);
  const int M = rs.M;
  float* s = ax.s;
  qk_amx(M, qb, Dkp / 2, kv.kp, ((Dk + 1) / 2 + kTilePairs - 1) / kTilePairs, s);
  // (the block is the whole tile: keys past n would score 0, so only whole tiles fuse)
  const bool fused = bias == nullptr && n == kTileK && fusable(rs, j0, n, softcap, st);
  bool partial = false;
  if (fused) {
    const Online on{st.m, st.l, st.o, st.ldo, Dvp};
    if (rs.exact_l)
      online_rows<Bf16P<false>>(M, s, qscale, on);
    else
      online_rows<Bf16P<true>>(M, s, qscale, on);
  } else {
    const V f = set1(qscale);
    for (int r = 0; r < M; ++r)
      for (int64_t j = 0; j < kTileK; j += W)
        store(s + r * kTileK + j, mul(load(s + r * kTileK + j), f));
    partial = softmax_rows(rs, j0, n, bias, softcap, Dvp, s, st);
  }
  // Keys a row cannot see, with a non-finite value: as in flash_tile_bf16.
  if (!kv.finite && (partial || kv.keys > n)) {
    pv_visible_bf16(rs, vs, j0, n, Dv, bias, s, sc, st);
    return;
  }
  if (!fused) pack_p_bf16(M, s, n2);
  const int64_t n2r = round_up(n2, kTilePairs);  // pairs past n2 must be zeros, not stale floats
  if (n2r > n2)
    for (int r = 0; r < M; ++r)
      std::memset(s + r * kTileK + n2, 0, sizeof(float) * std::size_t(n2r - n2));
  pv_amx(M, reinterpret_cast<const Pair*>(s), kv.vp, n2, Dvp, st.o, st.ldo, ax.ostage);
}

// ---- wide runs: tiles in blocks of up to kWideTiles -------------------------------------------
// How many keys from j0 the wide path takes: none under a user mask, a soft-cap or ALiBi, a
// non-positive score factor (the raw products' max times it must be the scores' max), or a row
// whose running max is +inf or NaN; else the keys of each tile up to j_end (the last may be
// partial) that some row sees. Rows need not see all of a tile (the causal diagonal, a window,
// kv_lens, the keys past j_end of a partial tile): wide_softmax gives the keys a row cannot see a
// score of -inf. A row may have seen nothing yet (m = -inf: an item's first tiles). Before, an
// item's first tile took the general tile path (~3.5x a wide key's time), its whole tiles after
// the last whole block the fused one (~1.4x), and its partial and diagonal tiles the general one.
static int64_t wide_keys(const kern::RowSet& rs, int64_t j0, int64_t j_end, float softcap,
                         float qscale, const kern::FlashState& st) {
  if (rs.mask_kind != MaskKind::none || !(qscale > 0.f) || softcap > 0.f) return 0;
  for (int r = 0; r < rs.M; ++r)
    if (!(st.m[r] < -kNegInf) || (rs.slope != nullptr && rs.slope[r] != 0.f)) return 0;
  int64_t j = j0;
  for (; j < j_end; j += kTileK) {
    bool open = false;
    for (int r = 0; r < rs.M && !open; ++r) open = rs.lo[r] < j + kTileK && rs.hi[r] > j;
    if (!open) break;
  }
  return imin(j, j_end) - j0;
}

// The keys [jb, jb + n) of one wide block (at most kWideKeys; its tiles are whole but perhaps the
// last), and what row r sees of them: [vlo(r), vhi(r)).
struct WideBlock {
  const kern::RowSet* rs;
  int64_t jb, n;
  int64_t vlo(int r) const { return imax(rs->lo[r] - jb, 0); }
  int64_t vhi(int r) const { return imin(rs->hi[r] - jb, n); }
  bool whole() const { return n % kTileK == 0 && sees_whole(*rs, 0, rs->M, jb, n); }
  int tiles() const { return int((n + kTileK - 1) / kTileK); }
};

// The tile products of a wide block's row pair, cut into steps so that they can run between the
// rows of another row pair's softmax: the tile unit works through a step's few instructions
// (tens of cycles each) while the vector units run the exps that follow them in program order.
// Run back to back instead, each waits for the other (products then softmax, per row pair).
//   QkSteps: S = Q K^T of 32 rows x the block's keys, one 32 x 32 block of scores a step.
//   PvSteps: O += P V of 32 rows, two 16-pair blocks of keys a step (the output tiles loaded at
//   a column pair's first step and stored at its last).
struct QkSteps {
  const Pair* a;  // the row pair's first query row (ldq pairs a row)
  int64_t ldq, nkb;
  const Pair* const* kp;
  float* s;   // kWideKeys floats a row
  int tiles;  // the block's
  int step_ = 0;
  int steps() const { return tiles * 2; }
  void step() {
    const int t = step_ / 2, c = step_ % 2 * 2 * kTilePairs;
    ++step_;
    c_tiles_zero();
    for (int64_t kb = 0; kb < nkb; ++kb)
      c_tiles_dp(a + kb * kTilePairs, ldq, kp[t] + kb * kTilePairs * kTileK + c, kTileK);
    c_tiles_store(s + t * kTileK + c, kWideKeys);
  }
};

struct PvSteps {
  static constexpr int64_t kTileBlocks = kTileK / 2 / kTilePairs;  // 16-pair blocks of a tile
  const Pair* p;  // the row pair's P: pairs at the start of each row, kWideKeys floats a row
  const Pair* const* vp;
  int64_t Dvp;
  float* o;  // the row pair's output rows (ldo floats a row; a staging copy for a partial pair)
  int64_t ldo;
  int tiles;              // the block's
  int step_ = 0, t_ = 0;  // steps done; the next step's tile
  int64_t c_ = 0;         // the next step's column pair
  int steps() const { return int(Dvp / (2 * kTilePairs)) * tiles; }
  void step() {  // tile t_'s keys into column pair c_
    const int t = t_;
    float* oc = o + c_;
    if (t == 0) c_tiles_load(oc, ldo);
    for (int64_t kb = 0; kb < kTileBlocks; ++kb)
      c_tiles_dp(p + (t * kTileBlocks + kb) * kTilePairs, kWideKeys,
                 vp[t] + kb * kTilePairs * Dvp + c_, Dvp);
    if (t == tiles - 1) c_tiles_store(oc, ldo);
    ++step_;
    if (++t_ == tiles) {
      t_ = 0;
      c_ += 2 * kTilePairs;
    }
  }
};

// Up to two step sequences run one after the other (a row pair's P V, then the next one's Q K^T),
// spread evenly over `rows` calls of at(i).
struct TileSteps {
  PvSteps* pv = nullptr;
  QkSteps* qk = nullptr;
  int total = 0, done = 0, rows = 1;
  TileSteps(PvSteps* p, QkSteps* q, int r) : pv(p), qk(q), rows(r) {
    total = (p ? p->steps() : 0) + (q ? q->steps() : 0);
  }
  void one() {
    if (pv && pv->step_ < pv->steps())
      pv->step();
    else
      qk->step();
    ++done;
  }
  void at(int i) {  // after row i of `rows`
    const int due = int(int64_t(total) * (i + 1) / rows);
    while (done < due) one();
  }
  void finish() {
    while (done < total) one();
  }
};

// A wide block's p = exp(scale * s - m) from its raw products s. Rows that return no lse
// (Bf16P<true>) take 2^(s (scale log2 e) - m log2 e): log2(e) folded into the two factors, one
// multiply fewer a vector. The fold moves the exponent t by at most 3 |t| 2^-24 and leaves p's
// error (exp_bf16's 2.9e-6 relative) far below P's rounding to bf16 (2^-9); a row's max still
// gives P = 1 exactly (while |m| < kFusedExpMax: wide_softmax shifts the arguments beyond it).
// Rows that return an lse keep PExp's exp.
template <class PExp>
struct WideExp {
  V f, neg_m;
  WideExp(float scale, float m) : f(set1(scale)), neg_m(set1(-m)) {}
  ATTNX_INLINE V operator()(V s) const { return PExp::exp(fmadd(s, f, neg_m)); }
};
template <>
struct WideExp<Bf16P<true>> {
  static constexpr float kLog2e = 1.44269504088896341f;
  V f, neg_m;
  WideExp(float scale, float m) : f(set1(scale * kLog2e)), neg_m(set1(-(m * kLog2e))) {}
  ATTNX_INLINE V operator()(V s) const { return simd::exp2_bf16(fmadd(s, f, neg_m)); }
};

// softmax_rows' update of one row of a wide block (n raw products at srow, each times f a
// score; the exact exp, skipped while nothing is visible), then its p rounded to pairs as
// pack_p_bf16 does: for a row that has seen nothing and whose block max is not finite.
template <int64_t N>
static void wide_general_row(float* srow, V f, float* m, float* l, float* orow, int64_t Dvp) {
  for (int64_t c = 0; c < N / W; ++c) store(srow + c * W, mul(load(srow + c * W), f));
  if (!online_update<1>(srow, N, m, l, orow, 0, Dvp)) {
    for (int64_t j = 0; j < N; ++j) row::keep_nan(l, srow[j]);
    std::memset(srow, 0, sizeof(float) * std::size_t(N));
  }
  for (int64_t c = 0; c < N / W; c += 2)
    store_pairs(srow, c * W, load(srow + c * W), load(srow + (c + 1) * W));
}

// A wide block's row: p = exp(scale * s - m) of its N raw products, rounded to bf16 pairs at the
// row's start, their sum added to *l. holds_max: whether the block's largest score is m. Beyond
// softmax-inl.h's kFusedExpMax the FMA arguments are shifted by their own largest.
template <class PExp, int64_t N>
static ATTNX_INLINE void wide_exps(float* srow, float scale, float m, bool holds_max, float* l) {
  constexpr int64_t nv = N / W;
  V sum = zero();
  auto run = [&](auto p) {
    for (int64_t c = 0; c < nv; c += 2) {
      const V e0 = p(load(srow + c * W)), e1 = p(load(srow + (c + 1) * W));
      store_pairs(srow, c * W, e0, e1);
      sum = add(sum, add(e0, e1));
    }
  };
  if (fused_exp_ok(m)) [[likely]] {
    run(WideExp<PExp>(scale, m));
  } else {
    const V f = set1(scale), neg_m = set1(-m);
    V top = fmadd(load(srow), f, neg_m);
    for (int64_t c = 1; c < nv; ++c) top = max(top, fmadd(load(srow + c * W), f, neg_m));
    const V shift = set1(fused_exp_shift(reduce_max(top), holds_max));
    run([&](V x) { return PExp::exp(sub(fmadd(x, f, neg_m), shift)); });
  }
  *l += reduce_add(sum);
}

// The online-softmax update of rows [r0, r1) over a wide block's raw products (s: row r at
// (r - r0) * kWideKeys): m' = max(m, scale * max_j s_j), O and l rescaled by exp(m - m'), then
// p_j = exp(scale * s_j - m') rounded to bf16 pairs at the start of the row and added to l.
// The exact max (no lazy slack): a row's largest p is exactly 1, as the bf16 path's error bound
// counts on (softmax-inl.h kLazyMax). `tiles` runs its steps between the rows.
// Rows go two at a time, both maxima before either row's exps: a row's exps wait for its max
// (a reduction, then the state's update), and the other row's work fills that wait.
// Keys a row cannot see score -inf (p = 0). A row that has seen nothing (m = -inf) takes m' =
// the block's max where that is finite (alpha = 0); where it is not (nothing visible, every score
// -inf, or +inf), wide_general_row gives it softmax_rows' update.
template <class PExp, int NT>
static void wide_softmax(int r0, int r1, float* s, float scale, const WideBlock& wb, int64_t Dvp,
                         const kern::FlashState& st, TileSteps& tiles) {
  constexpr int64_t n = NT * kTileK;
  const V f = set1(scale);
  auto row_of = [&](int r) { return s + int64_t(r - r0) * kWideKeys; };
  struct RowMax {
    bool exps;   // false: wide_general_row has updated the row
    float m;     // the max its exps take
    bool holds;  // whether the block's largest score is m
  };
  // row r's new max, its O and l rescaled to it
  auto raise_max = [&](int r) -> RowMax {
    float* srow = row_of(r);
    float* orow = st.o + int64_t(r) * st.ldo;
    const int64_t lo = wb.vlo(r), hi = wb.vhi(r);
    for (int64_t j = 0; j < imin(lo, n); ++j) srow[j] = kNegInf;
    for (int64_t j = imax(hi, 0); j < n; ++j) srow[j] = kNegInf;
    V top_v = load(srow);
    for (int64_t c = 1; c < n / W; ++c) top_v = max(top_v, load(srow + c * W));
    const float top = reduce_max(mul(top_v, f));
    if (st.m[r] == kNegInf && !(top > kNegInf && top < -kNegInf)) {
      wide_general_row<n>(srow, f, st.m + r, st.l + r, orow, Dvp);
      return {false, kNegInf, false};
    }
    if (!(top > st.m[r])) return {true, st.m[r], top == st.m[r]};  // (exp(m - m) = 1)
    const float alpha = row::rescale(st.m[r], top);
    if (alpha != 1.f) {
      const V a = set1(alpha);
      for (int64_t d = 0; d < Dvp; d += W) store(orow + d, mul(a, load(orow + d)));
      st.l[r] *= alpha;
      st.m[r] = top;
    }
    return {true, top, true};
  };
  auto update = [&](int r, const RowMax& rm) {
    if (rm.exps) wide_exps<PExp, n>(row_of(r), scale, rm.m, rm.holds, st.l + r);
    tiles.at(r - r0);
  };
  int r = r0;
  for (; r + 1 < r1; r += 2) {
    const RowMax a = raise_max(r), b = raise_max(r + 1);
    update(r, a);
    update(r + 1, b);
  }
  if (r < r1) update(r, raise_max(r));
  tiles.finish();
}

// wide_softmax for the block's number of tiles (a compile-time count: its loops unrolled as for
// whole blocks; a run-time count measured 2-10% slower, bench/NOTES.md).
template <class PExp>
static void wide_softmax(int r0, int r1, float* s, float scale, const WideBlock& wb, int64_t Dvp,
                         const kern::FlashState& st, TileSteps& tiles) {
  static_assert(kWideTiles == 4, "a case for each count");
  switch (wb.tiles()) {
    case 1: return wide_softmax<PExp, 1>(r0, r1, s, scale, wb, Dvp, st, tiles);
    case 2: return wide_softmax<PExp, 2>(r0, r1, s, scale, wb, Dvp, st, tiles);
    case 3: return wide_softmax<PExp, 3>(r0, r1, s, scale, wb, Dvp, st, tiles);
    default: return wide_softmax<PExp, kWideTiles>(r0, r1, s, scale, wb, Dvp, st, tiles);
  }
}

// The packed K and V pairs of one wide block (shared tiles, or its own buffers of set `set`), and
// whether its values are finite.
struct WideKV {
  const Pair* kp[kWideTiles];
  const Pair* vp[kWideTiles];
  bool finite = true;
};
static WideKV pack_wide(const kern::KVSource& ks, const kern::KVSource& vs, const WideBlock& wb,
                        int64_t Dk, int64_t Dv, const kern::Scratch& sc, AmxScratch& ax, int set) {
  WideKV w;
  for (int t = 0; t < wb.tiles(); ++t) {
    // each tile's pairs in its own buffer where it is not shared (packed_kv packs into sc.kt)
    kern::Scratch own = sc;
    own.kt = ax.kv[set][t];
    own.vf = ax.vf[set][t];
    const PackedKV kv =
        packed_kv(ks, vs, wb.jb + t * kTileK, imin(kTileK, wb.n - t * kTileK), Dk, Dv, own);
    w.kp[t] = kv.kp;
    w.vp[t] = kv.vp;
    w.finite = w.finite && kv.finite;
  }
  return w;
}

// The output rows of row pair p of M rows: in place where the pair is whole, else a staging copy
// of 2 kTileRows rows of Dvp floats (`stage`; its rows past M zero), copied in, then back.
struct PairRows {
  int M;
  int64_t Dvp;
  const kern::FlashState& st;
  float* stage;
  int rows(int p) const { return int(imin(M, (p + 1) * 2 * kTileRows)) - p * 2 * kTileRows; }
  std::pair<float*, int64_t> in(int p) const {
    float* o = st.o + int64_t(p) * 2 * kTileRows * st.ldo;
    const int n = rows(p);
    if (n == 2 * kTileRows) return {o, st.ldo};
    for (int r = 0; r < n; ++r)
      std::memcpy(stage + r * Dvp, o + r * st.ldo, sizeof(float) * std::size_t(Dvp));
    std::memset(stage + n * Dvp, 0, sizeof(float) * std::size_t((2 * kTileRows - n) * Dvp));
    return {stage, Dvp};
  }
  void back(int p) const {
    const int n = rows(p);
    if (n == 2 * kTileRows) return;
    float* o = st.o + int64_t(p) * 2 * kTileRows * st.ldo;
    for (int r = 0; r < n; ++r)
      std::memcpy(o + r * st.ldo, stage + r * Dvp, sizeof(float) * std::size_t(Dvp));
  }
};

// Accumulates keys [j0, j0 + keys) (wide_keys) into the state, in blocks of kWideTiles tiles (the
// last may be shorter); returns the keys it took. The row pairs of all the blocks form one
// sequence, and row pair i's softmax runs beside row pair i-1's P V and row pair i+1's Q K^T
// (TileSteps), across the blocks' boundaries: the tile unit waits for the vector units only
// before the first Q K^T and after the last P V. A block that some row sees only in
// part, with a non-finite value, ends the run before it (p = 0 times inf would reach the row: the
// tile path adds only each row's keys there, as flash_tile_amx does).
static int64_t flash_wide_amx(const kern::RowSet& rs, const Pair* qb, float qscale,
                              const kern::KVSource& ks, const kern::KVSource& vs, int64_t j0,
                              int64_t keys, int64_t Dk, int64_t Dv, const kern::Scratch& sc,
                              const kern::FlashState& st, AmxScratch& ax) {
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  const int64_t nkb = ((Dk + 1) / 2 + kTilePairs - 1) / kTilePairs;
  const int pairs = int((rs.M + 2 * kTileRows - 1) / (2 * kTileRows));
  const int64_t blocks = (keys + kWideKeys - 1) / kWideKeys;
  auto block = [&](int64_t b) {
    return WideBlock{&rs, j0 + b * kWideKeys, imin(kWideKeys, keys - b * kWideKeys)};
  };
  WideKV kv[AmxScratch::kSets];
  auto set_of = [](int64_t blk) { return int(blk % AmxScratch::kSets); };
  // block b's pairs into its set; false where it may not run (see above)
  auto pack = [&](int64_t b) {
    const WideBlock wb = block(b);
    kv[set_of(b)] = pack_wide(ks, vs, wb, Dk, Dv, sc, ax, set_of(b));
    return kv[set_of(b)].finite || wb.whole();
  };
  if (!pack(0)) return 0;
  int64_t items = blocks * pairs;
  auto sbuf = [&](int64_t i) { return ax.sw + i % 2 * (2 * kTileRows * kWideKeys); };
  auto pair_of = [&](int64_t i) { return int(i % pairs); };
  auto qk_steps = [&](int64_t i) {
    return QkSteps{qb + pair_of(i) * 2 * kTileRows * (Dkp / 2),
                   Dkp / 2,
                   nkb,
                   kv[set_of(i / pairs)].kp,
                   sbuf(i),
                   block(i / pairs).tiles()};
  };
  const PairRows out{rs.M, Dvp, st, ax.ostage};
  QkSteps first = qk_steps(0);
  TileSteps(nullptr, &first, 1).finish();
  PvSteps pv_prev{};
  bool pv_due = false;  // pv_prev has yet to run
  for (int64_t i = 0; i < items; ++i) {
    const int64_t blk = i / pairs;
    const int p = pair_of(i);
    // the next block's pairs before its first Q K^T (set blk + 1: neither this block's nor the
    // previous one's, whose last P V may still be ahead)
    if (i + 1 < items && (i + 1) % pairs == 0 && !pack(blk + 1)) items = i + 1;
    if (pv_due && pairs == 1) {
      // one row pair: the previous block's P V adds to the rows this softmax rescales, so it
      // runs first (only Q K^T runs beside the softmax)
      TileSteps(&pv_prev, nullptr, 1).finish();
      out.back(0);
      pv_due = false;
    }
    QkSteps next = qk_steps(i + 1 < items ? i + 1 : i);
    TileSteps tiles(pv_due ? &pv_prev : nullptr, i + 1 < items ? &next : nullptr, out.rows(p));
    const int r0 = p * 2 * kTileRows;
    const WideBlock wb = block(blk);
    if (rs.exact_l)
      wide_softmax<Bf16P<false>>(r0, r0 + out.rows(p), sbuf(i), qscale, wb, Dvp, st, tiles);
    else
      wide_softmax<Bf16P<true>>(r0, r0 + out.rows(p), sbuf(i), qscale, wb, Dvp, st, tiles);
    if (pv_due) out.back(pair_of(i - 1));
    const auto [o, ldo] = out.in(p);
    pv_prev = PvSteps{
        reinterpret_cast<const Pair*>(sbuf(i)), kv[set_of(blk)].vp, Dvp, o, ldo, wb.tiles()};
    pv_due = true;
  }
  TileSteps(&pv_prev, nullptr, 1).finish();
  out.back(pair_of(items - 1));
  return imin(keys, items / pairs * kWideKeys);
}

// bf16 prefill items (bf16_prefill) on AMX tiles, the rest on tile-inl.h's flash (the
// float32-widening kernels, with VNNI for integer queries: on the CPUs that have AMX they are
// faster than AVX512_BF16's vdpbf16ps, see dispatch.cpp). (The table's `flash` is
// amx_decode-inl.h's, which takes few-row bf16 items first.)
static void flash_prefill_amx(const kern::RowSet& rs, const kern::KVSource& ks,
                              const kern::KVSource& vs, int64_t j_begin, int64_t j_end, int64_t Dk,
                              int64_t Dv, float softcap, const kern::Scratch& sc,
                              const kern::FlashState& st) {
#if defined(ATTNX_AMX_TILES)
  if (rs.int8_tiles == Int8Tiles::amx) {  // integer queries: Q K^T on int8 tiles
    TileScope tiles;
    flash(rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);
    return;
  }
#endif
  if (!bf16_prefill(rs, ks, vs, Dk)) {
    flash(rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);  // (tile-inl.h's, this unit's)
    return;
  }
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  AmxScratch& ax = amx_scratch();
  ax.size(Dkp, Dvp);
  const float qscale = pack_query(rs, Dkp, ax.qb);
  const int Mr = int(round_up(rs.M, 2 * kTileRows));
  std::memset(ax.qb + rs.M * (Dkp / 2), 0, sizeof(Pair) * std::size_t((Mr - rs.M) * (Dkp / 2)));
  BfScope tiles;
  for (int64_t j0 = j_begin; j0 < j_end;) {
    if (const int64_t keys = wide_keys(rs, j0, j_end, softcap, qscale, st))
      if (const int64_t done =
              flash_wide_amx(rs, ax.qb, qscale, ks, vs, j0, keys, Dk, Dv, sc, st, ax)) {
        j0 += done;
        continue;
      }
    flash_tile_amx(rs, ax.qb, qscale, ks, vs, j0, imin(j0 + kTileK, j_end), Dk, Dv, softcap, sc, st,
                   ax);
    j0 += kTileK;
  }
}

}  // namespace
