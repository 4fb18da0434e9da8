// tile-inl.h: the flash tile loop: one tile is its stages in order (open, load, QK^T, softmax,
// P V), over one work item's keys or a group of items interleaved tile by tile.
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, int8_tiles, tile,
// probes), after <cmath>, <cstring>, <limits>, <type_traits>, <vector>, tables.h and
// attention/state.h: no header may be included from inside the namespace. Everything here stays in
// an anonymous namespace (internal linkage), so no symbol compiled with wide instructions can leak
// to another ISA (tables.h).

namespace {

// Keys to prefetch while a tile is computed: rows [j, j + n) of the sources k and v (n = 0: none).
struct Ahead {
  const kern::KVSource* k = nullptr;
  const kern::KVSource* v = nullptr;
  int64_t j = 0, n = 0;
};

// How a tile's K and V rows are read. Rows whose width is a whole number of register blocks are
// read in place (fp16/bf16 widened in registers); the packed (prefill) QK path needs Real rows
// to transpose. Quantised rows too (their scales applied to the scores and probabilities:
// scale_keys); the packed path and ragged widths convert them, with their scales, into the tile
// buffers. So does a tile whose scales are out of scales_in_place's range, and, where the
// vocabulary widens e4m3 without the NaN code's test (kE4m3TestInWidening false: 4 instructions
// per W codes, not 8, where one pass over the tile's codes costs less than that test), a tile of
// e4m3 rows that holds the NaN code. V's pass runs just before P V (value_reads): the first touch
// of the tile's value rows then comes after Q K^T and the softmax, not before them. (vaddr: the
// tile's n value rows.)
struct TileReads {
  bool k_inplace, v_inplace;
  DType kdt, vdt;  // the row type QK^T and P V read: the source's where in place, else Real's
  int64_t vw;      // value features the PV kernel walks
  float kscale[kTileK], vscale[kTileK];  // quantised sources: the tile's scales (scale_keys)
};
static TileReads tile_reads(int M, const kern::KVSource& ks, const kern::KVSource& vs, int64_t j0,
                            int64_t n, int64_t Dk, int64_t Dv, const Scratch& sc) {
  TileReads t;
  t.k_inplace = M > kDotRows ? ks.dtype == kNative && Dk % 8 == 0 : Dk % W == 0;
  t.v_inplace = Dv % (NR * W) == 0;
  if (t.k_inplace && quantised(ks.dtype)) {
    kv_scales(ks, j0, n, t.kscale);
    t.k_inplace = scales_in_place(t.kscale, n);
  }
  if (t.v_inplace && quantised(vs.dtype)) {
    kv_scales(vs, j0, n, t.vscale);
    t.v_inplace = scales_in_place(t.vscale, n);
  }
  if (!kE4m3TestInWidening && t.k_inplace && ks.dtype == DType::e4m3) {
    kv_rows(ks, j0, n, sc.kaddr);
    t.k_inplace = !e4m3_nan_in(sc.kaddr, n, Dk);
  }
  t.kdt = t.k_inplace ? ks.dtype : kNative;
  t.vdt = t.v_inplace ? vs.dtype : kNative;
  t.vw = t.v_inplace ? Dv : round_up(Dv, kPad);
  return t;
}

// The value side of tile_reads, for P V: e4m3 value rows holding the NaN code are converted.
static void value_reads(TileReads& t, const kern::KVSource& vs, int64_t n, int64_t Dv,
                        const char* const* vaddr) {
  if (!kE4m3TestInWidening && t.v_inplace && vs.dtype == DType::e4m3 && e4m3_nan_in(vaddr, n, Dv)) {
    t.v_inplace = false;
    t.vdt = kNative;
    t.vw = round_up(Dv, kPad);
  }
}

// Row addresses of a later tile (`ahead`), prefetched while this one is computed (n = 0: none).
// Few rows (decode) make the tile loop memory bound, and pages are scattered, so the hardware
// prefetcher cannot guess what comes next. Many rows over pages (a shared prefix's stacked
// queries) too: without it, such a tile stalls on its K conversion and its first P V pass.
struct NextRows {
  const char** k = nullptr;
  const char** v = nullptr;
  int64_t n = 0;
};
static NextRows next_rows(const Ahead& ahead, const Scratch& sc) {
  NextRows nx;
  nx.n = ahead.n;
  if (nx.n > 0) {
    nx.k = sc.kaddr + kTileK;
    nx.v = sc.vaddr + kTileK;
    kv_rows(*ahead.k, ahead.j, nx.n, nx.k);
    kv_rows(*ahead.v, ahead.j, nx.n, nx.v);
    prefetch_scales(*ahead.k, ahead.j, nx.n);
    prefetch_scales(*ahead.v, ahead.j, nx.n);
  }
  return nx;
}

// The query rows that products over dequantised keys (code * scale) take: integer queries'
// values (codes times factor, RowSet::qvals), else q.
static const Real* dequantised_q(const RowSet& rs) { return rs.qvals != nullptr ? rs.qvals : rs.q; }

// S = Q K^T of keys [j0, j0 + n) into sc.s (integer queries: codes times each row's factor where
// the keys are read in place, their values where not).
// Returns whether the packed product also did the online-softmax update (sc.s is then P).
static bool qk_tile(const RowSet& rs, const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                    int64_t Dvp, Real softcap, const Scratch& sc, const FlashState& st,
                    const TileReads& rd, const NextRows& nx, const Real* bias) {
  const int M = rs.M;
  const int64_t Dkp = round_up(Dk, kPad);
  bool fused = false;
  if (Dk == 0) {  // no features: every score is exactly 0 (the products' paths assume Dk > 0)
    for (int r = 0; r < M; ++r) std::memset(sc.s + r * kTileK, 0, std::size_t(n) * sizeof(Real));
    return false;
  }
  // (int8_tiles-inl.h: with the rows' factors, where the tile's key scales allow it)
  if (rs.int8_tiles != Int8Tiles::none && qk_int8_tiles(rs, ks, j0, n, Dk, sc, nx.k, nx.n))
    return false;
  if (M > kDotRows) {
    // (the next K tile is prefetched only where this item packs its own: a shared packed tile
    // is read from the buffer, not the pages)
    const Online on{st.m, st.l, st.o, st.ldo, Dvp};
    fused = bias == nullptr && fusable(rs, j0, n, softcap, st);
    qk_packed(M, dequantised_q(rs), rs.ldq, packed_tile(ks, j0, n, Dk, sc), Dkp, n, sc.s,
              ks.kt == nullptr ? nx.k : nullptr, nx.n, Dk * elem_bytes(ks.dtype),
              fused ? &on : nullptr);
  } else {
    const Real** krow = key_rows(ks, j0, n, Dk, rd.k_inplace, sc);
#if defined(ATTNX_INT8_DOT)
    if (rs.qcodes != nullptr && rd.kdt == DType::i8 && Dk % dot::kI8Bytes == 0)
      qk_int8(rs, krow, n, Dk, sc.s, nx.k, nx.n, Dk);
    else
#endif
      with_type(rd.kdt, [&](auto t) {
        using T = decltype(t);
        const Real* q = rd.k_inplace ? rs.q : dequantised_q(rs);
        int64_t ldq = rs.ldq;
        if constexpr (std::is_same<T, BF16>::value) {  // (K is read in place: kf is free)
          bf16_order_rows(M, rs.q, rs.ldq, Dk, sc.kf, Dkp);
          q = sc.kf;
          ldq = Dkp;
        }
        qk_dot<T>(M, q, ldq, krow, n, rd.k_inplace ? Dk : Dkp, sc.s, nx.k, nx.n,
                  Dk * elem_bytes(ks.dtype));
      });
    if (rd.k_inplace && rs.qfactor != nullptr) scale_rows(M, sc.s, rs.qfactor, n);
    if (rd.k_inplace && quantised(ks.dtype)) scale_keys(M, sc.s, rd.kscale, ks.dtype, n);
  }
  return fused;
}

// O += P V of keys [j0, j0 + n) (their value rows at vaddr; sc.s holds P). `partial`: some row
// sees the tile only in part. A key that a row cannot see has p = 0 there, and 0 * inf or 0 * NaN
// in its value would still leak into the row: such tiles are checked for non-finite values, and
// where there are any, each row adds only the keys it sees.
static void pv_tile(const RowSet& rs, const kern::KVSource& vs, int64_t j0, int64_t n, int64_t Dv,
                    const Scratch& sc, const FlashState& st, const TileReads& rd,
                    const char* const* vaddr, const NextRows& nx, bool partial, const Real* bias) {
  const Real* const* vrow = real_rows(vs, j0, vaddr, n, Dv, rd.v_inplace, sc.vf, sc.vrow);
  if (partial) {
    const Real* const* fv = vrow;
    if (rd.vdt != kNative)  // the check and its slow path read Real rows (in K's pointers,
                            // no longer needed in this tile), quantised ones with their scales
      fv = real_rows(vs, j0, vaddr, n, Dv, false, sc.vf, sc.krow);
    if (!values_finite(fv, n, rd.vw)) {
      pv_visible(rs, j0, bias, sc.s, fv, n, rd.vw, st.o, st.ldo);
      return;
    }
  }
  if (rd.v_inplace && quantised(vs.dtype)) scale_keys(rs.M, sc.s, rd.vscale, vs.dtype, n);
  with_type(rd.vdt, [&](auto t) {
    pv<decltype(t)>(rs.M, sc.s, vrow, n, rd.vw, st.o, st.ldo, nx.v, nx.n,
                    Dv * elem_bytes(vs.dtype));
  });
}

// Accumulates keys [j0, j_end) of one tile (at most kTileK keys) into the state: the tile's
// visible rows and mask (tile_open), S = Q K^T, the online softmax (S becomes P), O += P V.
static void flash_tile(const RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                       int64_t j0, int64_t j_end, int64_t Dk, int64_t Dv, Real softcap,
                       const Scratch& sc, const FlashState& st, const Ahead& ahead) {
  const int64_t Dvp = round_up(Dv, kPad);
  const int64_t n = imin(kTileK, j_end - j0);
  const Real* bias = nullptr;
  if (!tile_open(rs, j0, n, sc, &bias)) return;
  // Row addresses of this tile (of K only where QK^T reads the rows themselves).
  const char** vaddr = sc.vaddr;
  kv_rows(vs, j0, n, vaddr);
  TileReads rd = tile_reads(rs.M, ks, vs, j0, n, Dk, Dv, sc);
  const NextRows nx = next_rows(ahead, sc);
  const bool fused = qk_tile(rs, ks, j0, n, Dk, Dvp, softcap, sc, st, rd, nx, bias);
  // (a fused tile's S is already P: every row sees it whole, so none sees it in part)
  const bool partial = !fused && softmax_rows(rs, j0, n, bias, softcap, Dvp, sc.s, st);
  value_reads(rd, vs, n, Dv, vaddr);
  pv_tile(rs, vs, j0, n, Dv, sc, st, rd, vaddr, nx, partial, bias);
}

// One work item: keys [j_begin, j_end) tile by tile, prefetching the tile kPrefetchTiles ahead.
static void flash(const RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                  int64_t j_begin, int64_t j_end, int64_t Dk, int64_t Dv, Real softcap,
                  const Scratch& sc, const FlashState& st) {
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK) {
    const int64_t jp = j0 + kPrefetchTiles * kTileK;
    const Ahead ahead{&ks, &vs, jp, imax(0, imin(kTileK, j_end - jp))};
    flash_tile(rs, ks, vs, j0, imin(j0 + kTileK, j_end), Dk, Dv, softcap, sc, st, ahead);
  }
}

// Work items that share a key range (the kv heads of one decoding sequence), interleaved tile by
// tile: for each tile, every item in turn. A paged pool stores a block's heads next to each other,
// so this order reads each block's K and V front to back (hardware prefetchers follow it), where
// one item at a time would read 1/Hkv of every block and jump. The prefetch runs kPrefetchSteps
// (item, tile) steps ahead in this order.
static void flash_group(int n_items, const RowSet* rs, const kern::KVSource* ks,
                        const kern::KVSource* vs, int64_t j_begin, int64_t j_end, int64_t Dk,
                        int64_t Dv, Real softcap, const Scratch& sc, const FlashState* st) {
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK) {
    for (int g = 0; g < n_items; ++g) {
      const int64_t step = g + kPrefetchSteps, pg = step % n_items;
      const int64_t jp = j0 + step / n_items * kTileK;
      const Ahead ahead{ks + pg, vs + pg, jp, imax(0, imin(kTileK, j_end - jp))};
      flash_tile(rs[g], ks[g], vs[g], j0, imin(j0 + kTileK, j_end), Dk, Dv, softcap, sc, st[g],
                 ahead);
    }
  }
}

// This unit's flash table (kernels/tables.h): the stages above, and the driver's row operations
// compiled at the unit's width.
static kern::FlashKernels<Real> flash_table() {
  return {&flash,
          &flash_group,
          &pack_k,
          &load_row,
          &store_row,
          &load_query,
          &row::finalize<Real>,
          &row::overflowed<Real>};
}

}  // namespace
