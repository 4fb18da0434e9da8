// tile-inl.h: the flash tile loop: one tile is its stages in order (open, load, QK^T, softmax,
// P V), over one work item's keys or a group of items interleaved tile by tile.
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, tile, probes), after
// <cmath>, <cstring>, <limits>, <type_traits>, tables.h and attention/state.h: no header may be
// included from inside the namespace. Everything here stays in an anonymous namespace (internal
// linkage), so no symbol compiled with wide instructions can leak to another ISA (tables.h).

namespace {

// Keys to prefetch while a tile is computed: rows [j, j + n) of the sources k and v (n = 0: none).
struct Ahead {
  const kern::KVSource* k = nullptr;
  const kern::KVSource* v = nullptr;
  int64_t j = 0, n = 0;
};

// Accumulates keys [j0, j_end) of one tile (at most kTileK keys) into the state.
static void flash_tile(const RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                       int64_t j0, int64_t j_end, int64_t Dk, int64_t Dv, Real softcap,
                       const Scratch& sc, const FlashState& st, const Ahead& ahead) {
  const int M = rs.M;
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  const bool packed = M > kDotRows;
  // Rows whose width is a whole number of register blocks are read in place (fp16/bf16 widened
  // in registers); the packed (prefill) QK path needs Real rows to transpose.
  // Quantised rows too (their scales applied to the scores and probabilities: scale_keys); the
  // packed path and ragged widths convert them, with their scales, into the tile buffers.
  const bool k_inplace = packed ? ks.dtype == kNative && Dk % 8 == 0 : Dk % W == 0;
  const bool v_inplace = Dv % (NR * W) == 0;
  const DType kdt = k_inplace ? ks.dtype : kNative, vdt = v_inplace ? vs.dtype : kNative;
  const int64_t vw = v_inplace ? Dv : Dvp;  // value features the PV kernel walks

  const int64_t n = imin(kTileK, j_end - j0);
  const Real* bias = nullptr;
  if (!tile_open(rs, j0, n, sc, &bias)) return;
  // Row addresses of this tile (of K only where QK^T reads the rows themselves).
  const char** vaddr = sc.vaddr;
  kv_rows(vs, j0, n, vaddr);
  // Few rows (decode) make this loop memory bound, and pages are scattered, so the hardware
  // prefetcher cannot guess what comes next: ask for a later tile while this one is computed.
  // Many rows over pages (a shared prefix's stacked queries) too: without it, a 16-row fp16 tile
  // stalled on its K conversion and its first P V pass (a fifth of its cycles).
  const char** kn = nullptr;
  const char** vn = nullptr;
  const int64_t nn = ahead.n;
  if (nn > 0) {
    kn = sc.kaddr + kTileK;
    vn = sc.vaddr + kTileK;
    kv_rows(*ahead.k, ahead.j, nn, kn);
    kv_rows(*ahead.v, ahead.j, nn, vn);
  }
  // S = Q K^T
  bool fused = false;
  if (packed) {
    // (the next K tile is prefetched only where this item packs its own: a shared packed tile
    // is read from the buffer, not the pages)
    const Online on{st.m, st.l, st.o, st.ldo, Dvp};
    fused = bias == nullptr && fusable(rs, j0, n, softcap, st);
    qk_packed(M, rs.q, rs.ldq, packed_tile(ks, j0, n, Dk, sc), Dkp, n, sc.s,
              ks.kt == nullptr ? kn : nullptr, nn, Dk * elem_bytes(ks.dtype), fused ? &on : nullptr);
  } else {
    const Real** krow = key_rows(ks, j0, n, Dk, k_inplace, sc);
#if defined(ATTNX_VNNI)
    if (rs.qcodes != nullptr && kdt == DType::i8 && Dk % 64 == 0)
      qk_vnni(rs, krow, n, Dk, sc.s, kn, nn, Dk);
    else
#endif
    with_type(kdt, [&](auto t) {
      qk_dot<decltype(t)>(M, rs.q, rs.ldq, krow, n, k_inplace ? Dk : Dkp, sc.s, kn, nn,
                          Dk * elem_bytes(ks.dtype));
    });
    if (k_inplace && quantised(ks.dtype)) scale_keys(M, sc.s, ks, j0, n);
  }
  if (rs.qfactor != nullptr) scale_rows(M, sc.s, rs.qfactor, n);
  // (a fused tile's S is already P: every row sees it whole, so none sees it in part)
  const bool partial = !fused && softmax_rows(rs, j0, n, bias, softcap, Dvp, sc.s, st);
  // O += P V
  const Real* const* vrow = real_rows(vs, j0, vaddr, n, Dv, v_inplace, sc.vf, sc.vrow);
  // A key that a row cannot see has p = 0 there, and 0 * inf or 0 * NaN in its value would
  // still leak into the row. Tiles that some row sees only in part are checked for
  // non-finite values; if there are any, each row adds only the keys it sees.
  if (partial) {
    const Real* const* fv = vrow;
    if (vdt != kNative)  // the check and its slow path read Real rows (in K's pointers,
                         // no longer needed in this tile), quantised ones with their scales
      fv = real_rows(vs, j0, vaddr, n, Dv, false, sc.vf, sc.krow);
    if (!values_finite(fv, n, vw)) {
      pv_visible(rs, j0, bias, sc.s, fv, n, vw, st.o, st.ldo);
      return;
    }
  }
  if (v_inplace && quantised(vs.dtype)) scale_keys(M, sc.s, vs, j0, n);
  with_type(vdt, [&](auto t) {
    pv<decltype(t)>(M, sc.s, vrow, n, vw, st.o, st.ldo, vn, nn, Dv * elem_bytes(vs.dtype));
  });
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
                        int64_t Dv, Real softcap, const Scratch& sc,
                        const FlashState* st) {
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

}  // namespace
