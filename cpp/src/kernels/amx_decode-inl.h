// amx_decode-inl.h: few-row work items (decode: the query heads of one kv head, or a short
// chunk's rows) over bf16 K and V on AMX tiles, reading keys and values where they lie.
// isa_amx.cpp (the hardware tiles) and isa_avx512bf16.cpp (EmuTiles: the amx-emulated path that
// tests this file on CPUs without AMX) include it after amx-inl.h, inside the same namespace.
//
// The prefill tiles (amx-inl.h) pack K transposed and V in key pairs once per tile and spread
// that cost over dozens of query rows. A decode item has a handful, and packing would cost more
// than the vector path's whole tile, so nothing is packed here:
//   S^T = K Q^T: A = 16 keys' rows as they are in memory (a tile row: 16 feature pairs of one
//     key), B = the item's queries as feature pairs by rows (qt, laid out once per item). The
//     16 keys x 16 rows of C are stored and gathered into each row's scores.
//   O += P V: B = 16 value rows as they are (a tile row: 16 pairs of adjacent features of one
//     key). tdpbf16ps sums over a row's pairs, so an A holding each key's p in the low half of
//     its 32 bits (zero in the high half) picks the even features of V, and one holding it in the
//     high half the odd ones: two products per V tile instead of a pass that packs V. While the
//     item runs, each 32-feature block of its O rows holds its 16 even features, then its 16 odd
//     ones (decode_begin and decode_end convert).
// The P and O tiles have the item's M rows, not 16: tdpbf16ps takes about half the time at up
// to 8 rows (bench/NOTES.md).
//
// Numerics: amx-inl.h's (each bf16 product exact, fp32 sums in the tiles' order, P rounded to
// bf16 before P V, bf16 subnormals read as zero); so decode on amx does not give float32's bits
// as few rows do on the other paths (docs/numerics.md). The zero half of A times an inf or NaN
// value is NaN in the neighbouring feature: an item whose O is not finite at its end (such a
// value, seen or not, or an overflow) is computed again on the vector path, from the state it
// came in with (saved by decode_begin), which applies the rules of attention/state.h.

namespace {

// Query rows from which an item takes the decode tiles: below it the vector path's widening
// dot products cost less than a tile's fixed work (bench/NOTES.md measures the crossover).
constexpr int kDecodeMinRows = 2;
constexpr int kChunk = int(kTileKeys);         // keys per S^T tile and per V tile
constexpr int64_t kFeatures = 2 * kTilePairs;  // bf16 features in a tile row

// The tiles: 0 S^T (16 keys x 16 rows); 2 a block of qt; 3 a K or V tile; 5 and 6 P's even and
// odd halves, 7 and 1 O's even and odd features (these four: M rows).
enum : int { kTS = 0, kTOo = 1, kTQ = 2, kTKV = 3, kTPe = 5, kTPo = 6, kTOe = 7 };
static bool m_rows_tile(int t) { return t == kTOo || t == kTPe || t == kTPo || t == kTOe; }

#if defined(ATTNX_AMX_TILES)
// The configuration for items of M rows, for the thread while alive.
class DecodeScope {
 public:
  explicit DecodeScope(int M) { _tile_loadconfig(&configs().c[M]); }
  ~DecodeScope() { _tile_release(); }
  DecodeScope(const DecodeScope&) = delete;
  DecodeScope& operator=(const DecodeScope&) = delete;

 private:
  struct Configs {
    TileConfig c[kTileRows + 1];
  };
  static const Configs& configs() {  // (static, as TileScope's: see there)
    static const Configs cfgs = [] {
      Configs a;
      for (int M = 1; M <= kTileRows; ++M)
        for (int t = 0; t < 8; ++t) {
          a.c[M].colsb[t] = 64;
          a.c[M].rows[t] = uint8_t(m_rows_tile(t) ? M : kTileRows);
        }
      return a;
    }();
    return cfgs;
  }
};
#else
class DecodeScope {
 public:
  explicit DecodeScope(int M) {
    for (int t = 0; t < 8; ++t) bf_tiles().rows[t] = m_rows_tile(t) ? M : kTileRows;
  }
  ~DecodeScope() {
    for (int t = 0; t < 8; ++t) bf_tiles().rows[t] = kTileRows;
  }
  DecodeScope(const DecodeScope&) = delete;
  DecodeScope& operator=(const DecodeScope&) = delete;
};
#endif

// Whether an item takes the decode tiles: bf16 q, k and v (no integer queries), few rows (more
// take amx-inl.h's prefill tiles), and features in whole tile rows.
static bool decode_tiles(const kern::RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                         int64_t Dk, int64_t Dv) {
  return rs.M >= kDecodeMinRows && rs.M <= kTileRows && rs.q_dtype == DType::bf16 &&
         ks.dtype == DType::bf16 && vs.dtype == DType::bf16 && rs.qfactor == nullptr && Dk > 0 &&
         Dk % kFeatures == 0 && Dv % kFeatures == 0;
}

// One item's own buffers while it runs.
struct DecodeItem {
  Pair* qt;      // (Dk / 2, kTileRows): qt[d2][r] = row r's feature pair d2, zero past row M
  float qscale;  // the factor the products take (pack_query)
  float* saved;  // the O rows it came in with (M x Dv), then m and l
};

// Per thread: the tile's S^T, P's even halves, and each item's buffers.
struct DecodeScratch {
  kern::Carve<float> raw;
  float* st = nullptr;  // (kTileK, kTileRows): S^T
  float* pe = nullptr;  // (kTileRows, kTileK): P's even halves (the odd ones: sc.s)
  float* qb = nullptr;  // (kTileRows, Dk / 2) pairs: pack_query's rows
  std::vector<DecodeItem> items;
  int64_t n = 0, dk = -1, dv = -1;
  void size(int64_t n_items, int64_t Dk, int64_t Dv) {
    if (n_items <= n && Dk == dk && Dv == dv) return;
    n = imax(n_items, n);
    const int64_t nq = Dk / 2 * kTileRows, ns = kTileRows * (Dv + 2);
    raw.reset(2 * kTileK * kTileRows + nq + n * (nq + ns));
    st = raw.take(kTileK * kTileRows);
    pe = raw.take(kTileK * kTileRows);
    qb = raw.take(nq);
    items.resize(std::size_t(n));
    for (auto& it : items) {
      it.qt = reinterpret_cast<Pair*>(raw.take(nq));
      it.saved = raw.take(ns);
    }
    dk = Dk;
    dv = Dv;
  }
};
static DecodeScratch& decode_scratch() {
  static thread_local DecodeScratch sc;
  return sc;
}

// The item's queries as qt, its state saved, and its O rows to the even-then-odd order.
static void decode_begin(const kern::RowSet& rs, int64_t Dk, int64_t Dv, const kern::FlashState& st,
                         float* qb, DecodeItem& it) {
  const int M = rs.M;
  const int64_t d2n = Dk / 2;
  it.qscale = pack_query(rs, Dk, reinterpret_cast<Pair*>(qb));
  std::memset(it.qt, 0, sizeof(Pair) * std::size_t(d2n * kTileRows));
  const Pair* q = reinterpret_cast<const Pair*>(qb);
  for (int r = 0; r < M; ++r)
    for (int64_t d = 0; d < d2n; ++d) it.qt[d * kTileRows + r] = q[r * d2n + d];
  for (int r = 0; r < M; ++r) {
    float* o = st.o + r * st.ldo;
    std::memcpy(it.saved + r * Dv, o, sizeof(float) * std::size_t(Dv));
    for (int64_t c = 0; c < Dv; c += 2 * W) {
      V even, odd;
      dot::unzip(load(o + c), load(o + c + W), &even, &odd);
      store(o + c, even);
      store(o + c + W, odd);
    }
  }
  std::memcpy(it.saved + M * Dv, st.m, sizeof(float) * std::size_t(M));
  std::memcpy(it.saved + M * Dv + M, st.l, sizeof(float) * std::size_t(M));
}

// The item's O rows back to their order. False where one is not finite (or a row's l is NaN):
// the state is then as the item came in, for the vector path to compute again.
static bool decode_end(int M, int64_t Dv, const kern::FlashState& st, const DecodeItem& it) {
  bool finite = true;
  for (int r = 0; r < M; ++r) {
    float* o = st.o + r * st.ldo;
    for (int64_t c = 0; c < Dv; c += 2 * W) {
      V a, b;
      dot::zip(load(o + c), load(o + c + W), &a, &b);
      finite = finite && all_finite(a) && all_finite(b);
      store(o + c, a);
      store(o + c + W, b);
    }
    finite = finite && !std::isnan(st.l[r]);
  }
  if (finite) return true;
  for (int r = 0; r < M; ++r)
    std::memcpy(st.o + r * st.ldo, it.saved + r * Dv, sizeof(float) * std::size_t(Dv));
  std::memcpy(st.m, it.saved + M * Dv, sizeof(float) * std::size_t(M));
  std::memcpy(st.l, it.saved + M * Dv + M, sizeof(float) * std::size_t(M));
  return false;
}

// The rows of the next (item, tile) step, prefetched a few lines at a time between this tile's
// tile operations: in one burst, the prefetches stall on the fill buffers while the tiles wait,
// and the tiles then run while memory idles.
class Prefetch {
 public:
  Prefetch(const NextRows& nx, int64_t kbytes, int64_t vbytes, int64_t slots)
      : nx_(nx), lines_{(kbytes + 63) / 64, (vbytes + 63) / 64}, side_(nx.n > 0 ? 0 : 2) {
    const int64_t rows = 2 * nx.n;
    quota_ = slots > 0 ? (rows + slots - 1) / slots : rows;
  }
  void step() { issue(quota_); }
  void rest() { issue(std::numeric_limits<int64_t>::max()); }

 private:
  // whole rows at a time: the bookkeeping once a row, not once a line
  void issue(int64_t rows) {
    for (; rows > 0 && side_ < 2; --rows) {
      const char* row = (side_ == 0 ? nx_.k : nx_.v)[r_];
      for (int64_t l = 0; l < lines_[side_]; ++l) __builtin_prefetch(row + 64 * l, 0, 1);
      if (++r_ < nx_.n) continue;
      r_ = 0;
      ++side_;
    }
  }
  const NextRows& nx_;
  int64_t lines_[2];
  int64_t quota_ = 0, r_ = 0;
  int side_;
};

// The fused tiles' p (online_rows), rounded to bf16 and stored as floats: P's odd halves.
template <bool Short>
struct RoundedP {
  static ATTNX_INLINE V exp(V x) { return Bf16P<Short>::exp(x); }
  template <int NV>
  static ATTNX_INLINE void store_row(float* srow, const V (&e)[NV]) {
    for (int c = 0; c < NV; ++c) store(srow + c * W, dot::round_bf16(e[c]));
  }
};

// S^T of keys [j0, j0 + 16 nc) into dx.st, then each row's raw products into sc.s.
static void decode_qk(int M, const DecodeItem& it, const TileRows* kr, int nc, int64_t Dk,
                      const kern::Scratch& sc, DecodeScratch& dx, Prefetch& pf) {
  BfTiles& t = bf_tiles();
  for (int c = 0; c < nc; ++c) {
    t.zero<kTS>();
    for (int64_t d = 0; d < Dk / kFeatures; ++d) {
      t.load<kTQ>(it.qt + d * kTilePairs * kTileRows, kTileRows * 4);
      t.load<kTKV>(kr[c].p + d * kFeatures * 2, kr[c].stride);
      t.dp_bf16<kTS, kTKV, kTQ>();
      pf.step();
    }
    t.store<kTS>(dx.st + c * kChunk * kTileRows, kTileRows * 4);
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < nc; ++c)
      store(sc.s + r * kTileK + c * kChunk,
            dot::gather_column(dx.st + c * kChunk * kTileRows + r, kTileRows));
}

// O += P V over the nc chunks (P's odd halves in sc.s, even ones in dx.pe).
static void decode_pv(const TileRows* vr, int nc, int64_t Dv, const kern::Scratch& sc,
                      const kern::FlashState& st, const DecodeScratch& dx, Prefetch& pf) {
  BfTiles& t = bf_tiles();
  const int64_t ld = st.ldo * 4;
  for (int64_t f = 0; f < Dv; f += kFeatures) {
    float* o = st.o + f;  // its even features, then (W on) its odd ones
    t.load<kTOe>(o, ld);
    t.load<kTOo>(o + W, ld);
    for (int c = 0; c < nc; ++c) {
      t.load<kTKV>(vr[c].p + f * 2, vr[c].stride);
      t.load<kTPe>(dx.pe + c * kChunk, kTileK * 4);
      t.load<kTPo>(sc.s + c * kChunk, kTileK * 4);
      t.dp_bf16<kTOe, kTPe, kTKV>();
      t.dp_bf16<kTOo, kTPo, kTKV>();
      pf.step();
    }
    t.store<kTOe>(o, ld);
    t.store<kTOo>(o + W, ld);
  }
}

// Accumulates keys [j0, j_end) of one tile (at most kTileK keys) of an item into its state,
// prefetching the rows of `ahead`.
static void decode_tile(const kern::RowSet& rs, const DecodeItem& it, const kern::KVSource& ks,
                        const kern::KVSource& vs, int64_t j0, int64_t j_end, int64_t Dk, int64_t Dv,
                        float softcap, const kern::Scratch& sc, const kern::FlashState& st,
                        DecodeScratch& dx, const Ahead& ahead) {
  const int M = rs.M;
  const int64_t n = imin(kTileK, j_end - j0);
  const float* bias = nullptr;
  if (!tile_open(rs, j0, n, sc, &bias)) return;
  const int nc = int((n + kChunk - 1) / kChunk);
  const NextRows nx = next_rows(ahead, sc);
  Prefetch pf(nx, Dk * 2, Dv * 2, nc * (Dk + Dv) / kFeatures);
  TileRows kr[kTileK / kChunk], vr[kTileK / kChunk];
  for (int c = 0; c < nc; ++c) {
    const int64_t m = imin(kChunk, n - c * kChunk);
    kr[c] = tile_rows(ks, j0 + c * kChunk, m, Dk * 2,
                      reinterpret_cast<char*>(sc.kf) + c * kChunk * Dk * 2);
    vr[c] = tile_rows(vs, j0 + c * kChunk, m, Dv * 2,
                      reinterpret_cast<char*>(sc.vf) + c * kChunk * Dv * 2);
  }
  decode_qk(M, it, kr, nc, Dk, sc, dx, pf);
  const int64_t nw = nc * kChunk;
  if (bias == nullptr && n == kTileK && fusable(rs, j0, n, softcap, st)) {
    const Online on{st.m, st.l, st.o, st.ldo, Dv};
    if (rs.exact_l)
      online_rows<RoundedP<false>>(M, sc.s, it.qscale, on);
    else
      online_rows<RoundedP<true>>(M, sc.s, it.qscale, on);
  } else {
    const V f = set1(it.qscale);
    for (int r = 0; r < M; ++r)
      for (int64_t j = 0; j < nw; j += W)
        store(sc.s + r * kTileK + j, mul(load(sc.s + r * kTileK + j), f));
    softmax_rows(rs, j0, n, bias, softcap, Dv, sc.s, st);
    for (int r = 0; r < M; ++r)
      for (int64_t j = 0; j < nw; j += W)
        store(sc.s + r * kTileK + j, dot::round_bf16(load(sc.s + r * kTileK + j)));
  }
  for (int r = 0; r < M; ++r)
    for (int64_t j = 0; j < nw; j += W)
      store(dx.pe + r * kTileK + j, dot::low_half(load(sc.s + r * kTileK + j)));
  decode_pv(vr, nc, Dv, sc, st, dx, pf);
  pf.rest();
}

// n items (the kv heads of one sequence, all of M rows) over keys [j_begin, j_end), interleaved
// tile by tile as tile-inl.h's flash_group; an item whose O ends non-finite runs again on the
// vector path.
static void decode_group(int n, const kern::RowSet* rs, const kern::KVSource* ks,
                         const kern::KVSource* vs, int64_t j_begin, int64_t j_end, int64_t Dk,
                         int64_t Dv, float softcap, const kern::Scratch& sc,
                         const kern::FlashState* st) {
  DecodeScratch& dx = decode_scratch();
  dx.size(n, Dk, Dv);
  for (int g = 0; g < n; ++g) decode_begin(rs[g], Dk, Dv, st[g], dx.qb, dx.items[std::size_t(g)]);
  {
    DecodeScope tiles(rs[0].M);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK)
      for (int g = 0; g < n; ++g) {
        const int64_t step = g + kPrefetchSteps, pg = step % n;
        const int64_t jp = j0 + step / n * kTileK;
        const Ahead ahead{ks + pg, vs + pg, jp, imax(0, imin(kTileK, j_end - jp))};
        decode_tile(rs[g], dx.items[std::size_t(g)], ks[g], vs[g], j0, imin(j0 + kTileK, j_end), Dk,
                    Dv, softcap, sc, st[g], dx, ahead);
      }
  }
  for (int g = 0; g < n; ++g)
    if (!decode_end(rs[g].M, Dv, st[g], dx.items[std::size_t(g)]))
      flash(rs[g], ks[g], vs[g], j_begin, j_end, Dk, Dv, softcap, sc, st[g]);
}

// Whether n items can run as one decode group: each takes the decode tiles, all with the same
// rows (one tile configuration).
static bool decode_group_ok(int n, const kern::RowSet* rs, const kern::KVSource* ks,
                            const kern::KVSource* vs, int64_t Dk, int64_t Dv) {
  for (int g = 0; g < n; ++g)
    if (rs[g].M != rs[0].M || !decode_tiles(rs[g], ks[g], vs[g], Dk, Dv)) return false;
  return true;
}

// The table's `flash`: a few-row bf16 item on the decode tiles, else amx-inl.h's.
static void flash_amx(const kern::RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                      int64_t j_begin, int64_t j_end, int64_t Dk, int64_t Dv, float softcap,
                      const kern::Scratch& sc, const kern::FlashState& st) {
  if (decode_tiles(rs, ks, vs, Dk, Dv))
    decode_group(1, &rs, &ks, &vs, j_begin, j_end, Dk, Dv, softcap, sc, &st);
  else
    flash_prefill_amx(rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);
}

// The table's `flash_group` (decode groups): the decode tiles where every item takes them, else
// tile-inl.h's, inside a TileScope where an item's integer queries take the int8 tiles.
static void flash_group_amx(int n, const kern::RowSet* rs, const kern::KVSource* ks,
                            const kern::KVSource* vs, int64_t j_begin, int64_t j_end, int64_t Dk,
                            int64_t Dv, float softcap, const kern::Scratch& sc,
                            const kern::FlashState* st) {
  if (decode_group_ok(n, rs, ks, vs, Dk, Dv)) {
    decode_group(n, rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);
    return;
  }
#if defined(ATTNX_AMX_TILES)
  bool tiles = false;
  for (int g = 0; g < n; ++g) tiles = tiles || rs[g].int8_tiles == Int8Tiles::amx;
  if (tiles) {
    TileScope scope;
    flash_group(n, rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);
    return;
  }
#endif
  flash_group(n, rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);
}

}  // namespace
