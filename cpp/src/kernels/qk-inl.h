// qk-inl.h: S = Q K^T of one tile: the packed form (many rows against a transposed K tile, the
// online update fused where it can be), the dot form for few rows (K rows read in place) and
// the integer form for integer queries over int8 keys (ATTNX_INT8_DOT: the unit's `dot`
// vocabulary has integer dot products, AVX512-VNNI's vpdpbusd or FEAT_DotProd's SDOT).
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, tile, probes), after
// <cmath>, <cstring>, <limits>, <type_traits>, tables.h and attention/state.h: no header may be
// included from inside the namespace. Everything here stays in an anonymous namespace (internal
// linkage), so no symbol compiled with wide instructions can leak to another ISA (tables.h).

namespace {

// ---- QK^T, packed form: S[r][j] = sum_d Q[r][d] * Kt[d][j] for MR rows x QR*W keys ----------
template <int MR, bool Fused>
static ATTNX_INLINE void qk_packed_block(const Real* q, int64_t ldq, const Real* kt, int64_t Dkp,
                                         Real* s, LineCursor pf, const Online* on, int64_t j,
                                         V* lsum) {
  V acc[MR][QR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < QR; ++c) acc[r][c] = zero();
  const int64_t steps = (Dkp + 7) / 8, per = (pf.left + steps - 1) / steps;  // lines per 8 features
  for (int64_t d = 0; d < Dkp; ++d) {
    if ((d & 7) == 0) pf.take(per);
    const Real* kd = kt + d * kTileK;
    V kv[QR];
    for (int c = 0; c < QR; ++c) kv[c] = load(kd + c * W);
    for (int r = 0; r < MR; ++r) {
      const V qb = set1(q[r * ldq + d]);
      for (int c = 0; c < QR; ++c) acc[r][c] = fmadd(qb, kv[c], acc[r][c]);
    }
  }
  if constexpr (Fused) {
    online_block<MR, QR, true>(acc, j, s, *on, lsum);
  } else {
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < QR; ++c) store(s + r * kTileK + c * W, acc[r][c]);
  }
}

// (not inlined: each row count gets its own registers; inlined into qk_packed_as, GCC kept five
// of the 4-row block's eight accumulators on the stack)
template <int MR, bool Fused>
__attribute__((noinline)) static void qk_packed_rows(const Real* q, int64_t ldq, const Real* kt,
                                                     int64_t Dkp, int64_t nw, Real* s,
                                                     const LinePrefetch& pf, int64_t& call,
                                                     const Online* on) {
  V lsum[MR];
  for (int r = 0; r < MR; ++r) lsum[r] = zero();
  for (int64_t j = 0; j < nw; j += QR * W)
    qk_packed_block<MR, Fused>(q, ldq, kt + j, Dkp, s + j, pf.share(call++), on, j, lsum);
  if constexpr (Fused)
    for (int r = 0; r < MR; ++r) on->l[r] += reduce_add(lsum[r]);
}

// `next` (nn rows of `bytes`, or null) is a later tile's K, prefetched during the product. With
// `on` (non-null: `fusable` tiles), s receives the probabilities and the rows' state is updated.
template <bool Fused>
static void qk_packed_as(int M, const Real* q, int64_t ldq, const Real* kt, int64_t Dkp, int64_t n,
                         Real* s, const char* const* next, int64_t nn, int64_t bytes,
                         const Online* on) {
  const int64_t nw = round_up(n, QR * W);
  // 4 x 4 with 32 registers: 6 x 4 does not fit beside the rows' sums (its accumulators spill)
  constexpr int MR = W >= 16 ? 4 : 6;
  LinePrefetch pf;
  if (next != nullptr && nn > 0) {
    const int64_t lpr = (bytes + 63) / 64;
    pf = LinePrefetch{next, lpr, nn * lpr, (M + MR - 1) / MR * (nw / (QR * W))};
  }
  int64_t call = 0;
  int r = 0;
  Online o{};
  auto rows = [&](int r0) {  // the state of rows r0 ...
    if (on != nullptr) o = on->rows(r0);
    return &o;
  };
  for (; r + MR <= M; r += MR)
    qk_packed_rows<MR, Fused>(q + r * ldq, ldq, kt, Dkp, nw, s + r * kTileK, pf, call, rows(r));
  const Real* qr = q + r * ldq;
  Real* sr = s + r * kTileK;
  switch (M - r) {
    case 5: qk_packed_rows<5, Fused>(qr, ldq, kt, Dkp, nw, sr, pf, call, rows(r)); break;
    case 4: qk_packed_rows<4, Fused>(qr, ldq, kt, Dkp, nw, sr, pf, call, rows(r)); break;
    case 3: qk_packed_rows<3, Fused>(qr, ldq, kt, Dkp, nw, sr, pf, call, rows(r)); break;
    case 2: qk_packed_rows<2, Fused>(qr, ldq, kt, Dkp, nw, sr, pf, call, rows(r)); break;
    case 1: qk_packed_rows<1, Fused>(qr, ldq, kt, Dkp, nw, sr, pf, call, rows(r)); break;
    default: break;
  }
}

static void qk_packed(int M, const Real* q, int64_t ldq, const Real* kt, int64_t Dkp, int64_t n,
                      Real* s, const char* const* next, int64_t nn, int64_t bytes,
                      const Online* on = nullptr) {
  if (on != nullptr)
    qk_packed_as<true>(M, q, ldq, kt, Dkp, n, s, next, nn, bytes, on);
  else
    qk_packed_as<false>(M, q, ldq, kt, Dkp, n, s, next, nn, bytes, nullptr);
}

// ---- QK^T, dot form for few rows: K rows read in place ---------------------------------------
// Horizontal sums of an RB x KB register block (row r, key t at acc[r * KB + t]) into the RB rows
// of S: 8 keys of a row, or 4 keys of two rows, per hsum8.
template <int RB, int KB>
static ATTNX_INLINE void reduce_block(const V* acc, Real* s) {
  if constexpr (KB == 8) {
    for (int r = 0; r < RB; ++r) hsum8(acc + r * 8, s + r * kTileK);
  } else if constexpr (KB == 4) {
    int r = 0;
    for (; r + 2 <= RB; r += 2) hsum8_split(acc + r * 4, s + r * kTileK, s + (r + 1) * kTileK);
    if constexpr (RB % 2 == 1) {  // the last row's 4 keys, beside 4 zero vectors
      const V pad[8] = {acc[r * 4], acc[r * 4 + 1], acc[r * 4 + 2], acc[r * 4 + 3],
                        zero(),     zero(),         zero(),         zero()};
      Real t[8];
      hsum8_split(pad, s + r * kTileK, t);
    }
  } else {
    static_assert(KB == 2 && RB % 4 == 0, "register blocks are 2, 4 or 8 keys wide");
    for (int r = 0; r < RB; r += 4) {
      Real t[8];
      hsum8(acc + r * 2, t);
      for (int i = 0; i < 8; ++i) s[(r + i / 2) * kTileK + i % 2] = t[i];
    }
  }
}

// A register block is RB rows x KB keys, so each K vector loaded is used RB times and the K tile
// is streamed once per block of rows. The sums go straight to S. (q in the order ld<T> gives K's
// features: load-inl.h; each accumulator back in the natural order before its sum.)
template <int RB, int KB, class T>
static ATTNX_INLINE void qk_dot_block(const Real* q, int64_t ldq, const Real* const* kr, int64_t Dk,
                                      Real* s) {
  V acc[RB * KB];
  for (int a = 0; a < RB * KB; ++a) acc[a] = zero();
  for (int64_t d = 0; d < Dk; d += W) {
    V qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = load(q + r * ldq + d);
    for (int t = 0; t < KB; ++t) {
      const V kv = ld<T>(kr[t], d);
      for (int r = 0; r < RB; ++r) acc[r * KB + t] = fmadd(qv[r], kv, acc[r * KB + t]);
    }
  }
  for (int a = 0; a < RB * KB; ++a) acc[a] = from_order<T>(acc[a]);
  reduce_block<RB, KB>(acc, s);
}

// Rows [r, r + RB) against the tile's n keys; the first block of rows prefetches `next` (nn rows
// of `bytes`, or null: the next tile's K) as it goes.
template <int RB, int KB, class T>
static void qk_dot_rows(int r, const Real* q, int64_t ldq, const Real* const* krow, int64_t n,
                        int64_t Dk, Real* s, const char* const* next, int64_t nn, int64_t bytes) {
  for (int64_t j = 0; j < n; j += KB) {
    if (r == 0 && next != nullptr)
      for (int64_t t = j; t < imin(j + KB, nn); ++t) prefetch_row(next[t], bytes);
    qk_dot_block<RB, KB, T>(q + r * ldq, ldq, krow + j, Dk, s + r * kTileK + j);
  }
}

template <class T>
static void qk_dot(int M, const Real* q, int64_t ldq, const Real* const* krow, int64_t n,
                   int64_t Dk, Real* s, const char* const* next, int64_t nn, int64_t bytes) {
  // AVX-512 has 32 registers: 4 rows x 4 keys. AVX2 has 16: 4 rows x 2 keys, so the 4 GQA rows of
  // a kv head stream K once (2 rows x 4 keys would stream it twice). Its 8 accumulators at 2 FMAs
  // per cycle and 4 cycles of latency leave no slack. The rows left over (a GQA group of 2, 3, 6
  // or 7: SmolLM2's is 3) form one block too, of 3 or 2 rows x 8 keys (AVX2: x 4), so that they
  // too stream K once (bench/NOTES.md).
  constexpr bool wide = W >= 16;
  int r = 0;
  for (; r + 4 <= M; r += 4)
    qk_dot_rows<4, wide ? 4 : 2, T>(r, q, ldq, krow, n, Dk, s, next, nn, bytes);
  switch (M - r) {
    case 3: qk_dot_rows<3, wide ? 8 : 4, T>(r, q, ldq, krow, n, Dk, s, next, nn, bytes); break;
    case 2: qk_dot_rows<2, wide ? 8 : 4, T>(r, q, ldq, krow, n, Dk, s, next, nn, bytes); break;
    case 1: qk_dot_rows<1, 8, T>(r, q, ldq, krow, n, Dk, s, next, nn, bytes); break;
    default: break;
  }
}

#if defined(ATTNX_INT8_DOT)
// ---- QK^T of integer queries over int8 keys read in place: the unit's integer dot products ----
// dot::idot adds 4 byte products to each int32 lane. Where it multiplies unsigned bytes by signed
// ones (vpdpbusd), the keys go in as k + dot::kKeyBias (128: their sign bit flipped) and the
// queries as they are, so each sum is q . k + 128 sum(q), corrected per row; SDOT takes both
// signed (no bias). Every partial sum is an integer below 2^24 (Dk < 1040): the float scores
// are exactly what the FMA path computes over the same codes.

// kKeyBias * the sum of each row's codes (M <= kDotRows rows of ldq bytes): the correction.
static void code_sums(const RowSet& rs, int64_t Dk, float* sum) {
  for (int r = 0; r < rs.M; ++r)
    sum[r] = float(dot::kKeyBias) * float(dot::code_sum(rs.qcodes + r * rs.ldc, Dk));
}

template <int RB, int KB>
static ATTNX_INLINE void qk_int8_block(const int8_t* q8, int64_t ld, int64_t Dk,
                                       const Real* const* kr, Real* s) {
  dot::IAcc acc[RB * KB];
  for (int a = 0; a < RB * KB; ++a) acc[a] = dot::izero();
  for (int64_t d = 0; d < Dk; d += dot::kI8Bytes) {
    dot::I8 qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = dot::load_codes(q8 + r * ld + d);
    for (int t = 0; t < KB; ++t) {
      const dot::I8 kv = dot::load_keys(reinterpret_cast<const int8_t*>(kr[t]) + d);
      for (int r = 0; r < RB; ++r) acc[r * KB + t] = dot::idot(acc[r * KB + t], kv, qv[r]);
    }
  }
  V f[RB * KB];
  for (int a = 0; a < RB * KB; ++a) f[a] = dot::to_real(acc[a]);
  reduce_block<RB, KB>(f, s);
}

// S = Q K^T (the codes' sums) of the M integer query rows (rs.qcodes) against the tile's n int8
// key rows (Dk a multiple of dot::kI8Bytes).
// `next` (nn rows of `bytes`, or null: the next tile's K) is prefetched all at once before the
// products, not spread through them as qk_dot_rows does: this loop is too short to space the
// requests, and interleaved with them its own key loads stalled (bench/NOTES.md).
static void qk_int8(const RowSet& rs, const Real* const* krow, int64_t n, int64_t Dk, Real* s,
                    const char* const* next, int64_t nn, int64_t bytes) {
  const int M = rs.M;
  const int64_t ld = rs.ldc;
  if (next != nullptr)
    for (int64_t t = 0; t < nn; ++t) prefetch_row(next[t], bytes);
  int r = 0;
  for (; r + 4 <= M; r += 4)
    for (int64_t j = 0; j < n; j += dot::kQuadKeys)
      qk_int8_block<4, dot::kQuadKeys>(rs.qcodes + r * ld, ld, Dk, krow + j, s + r * kTileK + j);
  for (; r + 2 <= M; r += 2)
    for (int64_t j = 0; j < n; j += 4)
      qk_int8_block<2, 4>(rs.qcodes + r * ld, ld, Dk, krow + j, s + r * kTileK + j);
  for (; r < M; ++r)
    for (int64_t j = 0; j < n; j += 8)
      qk_int8_block<1, 8>(rs.qcodes + r * ld, ld, Dk, krow + j, s + r * kTileK + j);
  if constexpr (dot::kKeyBias == 0) return;
  float sum[kern::kDotRows];
  code_sums(rs, Dk, sum);
  for (int i = 0; i < M; ++i) {
    const V corr = set1(sum[i]);
    for (int64_t j = 0; j < n; j += W)
      store(s + i * kTileK + j, sub(load(s + i * kTileK + j), corr));
  }
}
#endif

}  // namespace
