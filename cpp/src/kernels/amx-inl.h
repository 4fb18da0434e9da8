// amx-inl.h: the prefill tile loop on AMX tiles (AMX-BF16's tdpbf16ps: C[16 x 16] fp32 +=
// A[16 x 32 bf16] B[32 bf16 x 16], B in pairs along its rows), for bf16 q, k and v.
// kernels_amx.cpp includes it after kernel-inl.h and bf16_dot-inl.h, inside the same namespace:
// the packed layouts (Q, K and V as bf16 pairs: pack_q_bf16, pack_k_bf16, pack_v_bf16), the
// masks, the online softmax and the P rounding are theirs; only the two products move to tiles.
//
// Numerics: those of bf16_dot-inl.h (README "dtypes"): the same products, each exact in fp32,
// summed in fp32 in the tiles' order; P rounded to bf16 before P V; O accumulated in fp32.
//
// Tiles: all eight are configured 16 rows x 64 bytes (16 fp32, or 16 bf16 pairs). A product is
// blocked 2 x 2: tiles 0-3 accumulate rows [r, r + 32) x columns [c, c + 32) (C), 4-5 hold the
// two row blocks of A (Q or P), 6-7 the two column blocks of B (K or V pairs): 4 loads feed 4
// tile products. Row blocks past M read zero rows of a padded copy (Q) or land in a staging copy
// (O), so a tile never reads or writes past an array.

// The including file provides <immintrin.h> (compiled with -mamx-tile -mamx-bf16).

namespace {

constexpr int kTileRows = 16;   // rows of a tile
constexpr int kTilePairs = 16;  // bf16 pairs (or fp32) along a tile row: 64 bytes

// The palette-1 configuration of every tile: 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures the tiles for this thread while alive; releases them after (the tile state then
// costs a context switch nothing).
class TileScope {
 public:
  TileScope() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = kTileRows;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// The tiles' own buffers, per thread: Q as pairs and S (then P) for up to kRowsPad rows, and a
// staging copy of the output rows of a partial row block.
constexpr int kRowsPad = 64 + 2 * kTileRows;  // kRowsPerItem rounded up to whole row-block pairs
struct AmxScratch {
  std::vector<float, std::allocator<float>> raw;
  Pair* qb = nullptr;  // (kRowsPad, Dkp / 2): zero rows past M
  float* s = nullptr;  // (kRowsPad, kTileK)
  float* ostage = nullptr;  // (2 * kTileRows, Dvp)
  int64_t dkp = -1, dvp = -1;
  void size(int64_t Dkp, int64_t Dvp) {
    if (Dkp == dkp && Dvp == dvp) return;
    const int64_t nq = kRowsPad * Dkp / 2, ns = kRowsPad * kTileK, no = 2 * kTileRows * Dvp;
    raw.assign(std::size_t(nq + ns + no + 16), 0.f);
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(raw.data()) + 63) & ~uintptr_t(63));
    qb = reinterpret_cast<Pair*>(base);
    s = base + nq;
    ostage = s + ns;
    dkp = Dkp;
    dvp = Dvp;
  }
};
static AmxScratch& amx_scratch() {
  static thread_local AmxScratch sc;
  return sc;
}

// ---- S = Q K^T (unscaled) for rows [0, M) rounded up to 32, all kTileK keys ---------------------
// qb: ldq pairs a row; kp: pack_k_bf16's layout (kTileK pairs a row, one row per feature pair);
// nkb: the 16-pair blocks of features that hold data.
static void qk_amx(int M, const Pair* qb, int64_t ldq, const Pair* kp, int64_t nkb, float* s) {
  const int64_t lda = ldq * 4, ldb = kTileK * 4, lds = kTileK * 4;
  for (int r = 0; r < M; r += 2 * kTileRows) {
    const Pair* a = qb + r * ldq;
    for (int c = 0; c < kTileK; c += 2 * kTilePairs) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const Pair* b = kp + kb * kTilePairs * kTileK + c;
        _tile_loadd(4, a + kb * kTilePairs, lda);
        _tile_loadd(5, a + kTileRows * ldq + kb * kTilePairs, lda);
        _tile_loadd(6, b, ldb);
        _tile_loadd(7, b + kTilePairs, ldb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = s + int64_t(r) * kTileK + c;
      _tile_stored(0, out, lds);
      _tile_stored(1, out + kTilePairs, lds);
      _tile_stored(2, out + kTileRows * kTileK, lds);
      _tile_stored(3, out + kTileRows * kTileK + kTilePairs, lds);
    }
  }
}

// ---- O += P V: p holds each row's key pairs at its start (kTileK floats a row), zero from pair
// n2 to a whole block; vp: pack_v_bf16's layout (Dvp pairs a row, one row per key pair), zero
// rows from n2 to a whole block. Rows past M (to a multiple of 32) go through `stage`. -----------
static void pv_amx(int M, const Pair* p, const Pair* vp, int64_t n2, int64_t Dvp, float* o,
                   int64_t ldo, float* stage) {
  const int64_t nkb = (n2 + kTilePairs - 1) / kTilePairs;
  const int64_t lda = kTileK * 4, ldb = Dvp * 4;
  for (int r = 0; r < M; r += 2 * kTileRows) {
    const int rows = M - r < 2 * kTileRows ? M - r : 2 * kTileRows;
    float* orow = o + r * ldo;
    int64_t ld = ldo;
    if (rows < 2 * kTileRows) {  // a partial pair of row blocks: its rows, then zeros
      for (int i = 0; i < rows; ++i) std::memcpy(stage + i * Dvp, orow + i * ldo, sizeof(float) * std::size_t(Dvp));
      std::memset(stage + rows * Dvp, 0, sizeof(float) * std::size_t((2 * kTileRows - rows) * Dvp));
      orow = stage;
      ld = Dvp;
    }
    const Pair* a = p + int64_t(r) * kTileK;
    for (int64_t c = 0; c < Dvp; c += 2 * kTilePairs) {
      float* oc = orow + c;
      _tile_loadd(0, oc, ld * 4);
      _tile_loadd(1, oc + kTilePairs, ld * 4);
      _tile_loadd(2, oc + kTileRows * ld, ld * 4);
      _tile_loadd(3, oc + kTileRows * ld + kTilePairs, ld * 4);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const Pair* b = vp + kb * kTilePairs * Dvp + c;
        _tile_loadd(4, a + kb * kTilePairs, lda);
        _tile_loadd(5, a + kTileRows * kTileK + kb * kTilePairs, lda);
        _tile_loadd(6, b, ldb);
        _tile_loadd(7, b + kTilePairs, ldb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, oc, ld * 4);
      _tile_stored(1, oc + kTilePairs, ld * 4);
      _tile_stored(2, oc + kTileRows * ld, ld * 4);
      _tile_stored(3, oc + kTileRows * ld + kTilePairs, ld * 4);
    }
    if (orow == stage)
      for (int i = 0; i < rows; ++i) std::memcpy(o + (r + i) * ldo, stage + i * Dvp, sizeof(float) * std::size_t(Dvp));
  }
}

// The fused tiles' online-softmax update (kernel-inl.h online_block) of the M rows of raw
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
  int r = 0;
  for (; r + 4 <= M; r += 4) block(std::integral_constant<int, 4>{}, r);
  switch (M - r) {
    case 3: block(std::integral_constant<int, 3>{}, r); break;
    case 2: block(std::integral_constant<int, 2>{}, r); break;
    case 1: block(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
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
      for (int64_t j = 0; j < kTileK; j += W) store(s + r * kTileK + j, mul(load(s + r * kTileK + j), f));
    partial = softmax_rows(rs, j0, n, bias, softcap, Dvp, s, st);
  }
  // Keys a row cannot see, with a non-finite value: as in flash_tile_bf16.
  if (!kv.finite && (partial || kv.keys > n)) {
    kv_rows(vs, j0, n, sc.vaddr);
    const float* const* fv = real_rows(vs, j0, sc.vaddr, n, Dv, false, sc.vf, sc.vrow);
    pv_visible(rs, j0, bias, s, fv, n, Dvp, st.o, st.ldo);
    return;
  }
  if (!fused) pack_p_bf16(M, s, n2);
  const int64_t n2r = round_up(n2, kTilePairs);  // pairs past n2 must be zeros, not stale floats
  if (n2r > n2)
    for (int r = 0; r < M; ++r) std::memset(s + r * kTileK + n2, 0, sizeof(float) * std::size_t(n2r - n2));
  pv_amx(M, reinterpret_cast<const Pair*>(s), kv.vp, n2, Dvp, st.o, st.ldo, ax.ostage);
}

// The table's `flash`: bf16 prefill items on AMX tiles, the rest on avx512's own flash (the
// float32-widening kernels: on the CPUs that have AMX they are faster than AVX512_BF16's
// vdpbf16ps, see dispatch.cpp).
static void flash_amx(const kern::RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                      int64_t j_begin, int64_t j_end, int64_t Dk, int64_t Dv, float softcap,
                      const kern::Scratch& sc, const kern::FlashState& st) {
  if (!bf16_prefill(rs, ks, vs)) {
    kern::table_avx512()->flash(rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);
    return;
  }
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  AmxScratch& ax = amx_scratch();
  ax.size(Dkp, Dvp);
  // q / scale is the bf16 query (bf16_dot-inl.h's flash_bf16 says when it is not)
  const float inv = 1.f / rs.scale;
  const bool back = rs.scale != 0.f && std::isfinite(rs.scale) && std::isfinite(inv);
  pack_q_bf16(rs, Dkp, back ? inv : 1.f, ax.qb);
  const int Mr = int(round_up(rs.M, 2 * kTileRows));
  std::memset(ax.qb + rs.M * (Dkp / 2), 0, sizeof(Pair) * std::size_t((Mr - rs.M) * (Dkp / 2)));
  TileScope tiles;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK)
    flash_tile_amx(rs, ax.qb, back ? rs.scale : 1.f, ks, vs, j0, imin(j0 + kTileK, j_end), Dk, Dv,
                   softcap, sc, st, ax);
}

}  // namespace
