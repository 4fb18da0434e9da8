// pv-inl.h: O += P V of one tile, over V rows read in place (widened in registers) or converted,
// and its slow path where a row must skip keys it cannot see (non-finite values).
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, tile, probes), after
// <cmath>, <cstring>, <limits>, <type_traits>, tables.h and attention/state.h: no header may be
// included from inside the namespace. Everything here stays in an anonymous namespace (internal
// linkage), so no symbol compiled with wide instructions can leak to another ISA (tables.h).

namespace {

// ---- O += P V: MR rows x NB*W value features per register block ------------------------------
template <int MR, int NB, class T>
static ATTNX_INLINE void pv_block(const Real* p, const Real* const* vrow, int64_t n, int64_t c,
                                  Real* o, int64_t ldo, const char* const* next, int64_t nn,
                                  int64_t blo, int64_t bhi) {
  V acc[MR][NB];  // (in the order ld<T> gives the values: load-inl.h)
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NB; ++k) acc[r][k] = to_order<T>(load(o + r * ldo + c + k * W));
  auto key = [&](int64_t j) {
    V v[NB];
    for (int k = 0; k < NB; ++k) v[k] = ld<T>(vrow[j], c + k * W);
    for (int r = 0; r < MR; ++r) {
      const V pb = set1(p[r * kTileK + j]);
      for (int k = 0; k < NB; ++k) acc[r][k] = fmadd(pb, v[k], acc[r][k]);
    }
  };
  // the keys that prefetch a row, then the rest: a test per key cost ~4 of the ~30 instructions
  // of an AVX2 6-row key (prefill: PV at ~90% of its FMA bound, the front end the limit)
  const int64_t np = next != nullptr ? imin(nn, n) : 0;
  int64_t j = 0;
  for (; j < np; ++j) {
    prefetch_row(next[j] + blo, bhi - blo);
    key(j);
  }
#pragma GCC unroll 4
  for (; j < n; ++j) key(j);
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NB; ++k) store(o + r * ldo + c + k * W, from_order<T>(acc[r][k]));
}

// `next` (nn rows of `bytes`, or null) is a later tile's V. Each pass over a block of columns
// prefetches its share of those rows' lines, so the requests are spread over the whole product.
// With 32 registers, up to 6 rows take 4 vectors per pass (24 accumulators): half the passes, and
// half the broadcasts of p per FMA; 16 rows take 1 vector (pv below).
template <int MR, class T>
static void pv_rows(const Real* p, const Real* const* vrow, int64_t n, int64_t Dvp, Real* o,
                    int64_t ldo, const char* const* next, int64_t nn, int64_t bytes) {
  constexpr int NB = MR > 8 ? 1 : (W >= 16 && MR <= 6) ? 2 * NR : NR;
  const int64_t wide = Dvp / (NB * W) * (NB * W);
  const int64_t lines = (bytes + 63) / 64, passes = wide / (NB * W) + (Dvp - wide) / (NR * W);
  int64_t c = 0, i = 0;
  for (; c < wide; c += NB * W, ++i)
    pv_block<MR, NB, T>(p, vrow, n, c, o, ldo, next, nn, lines * i / passes * 64,
                        lines * (i + 1) / passes * 64);
  for (; c < Dvp; c += NR * W, ++i)
    pv_block<MR, NR, T>(p, vrow, n, c, o, ldo, next, nn, lines * i / passes * 64,
                        lines * (i + 1) / passes * 64);
}

template <class T>
static void pv(int M, const Real* p, const Real* const* vrow, int64_t n, int64_t Dvp, Real* o,
               int64_t ldo, const char* const* next, int64_t nn, int64_t bytes) {
  constexpr int MR = 6;
  int r = 0;
  // Half-precision values are widened as they are loaded, once per row block: on Zen 4 the
  // widening (vcvtph2ps) competes with the FMAs. With 32 registers, blocks of 16 rows x 1 vector
  // widen each value vector once for 16 rows instead of three times (6 + 6 + 4 rows).
  if constexpr (W >= 16 && (std::is_same<T, F16>::value || std::is_same<T, BF16>::value))
    for (; r + 16 <= M; r += 16, next = nullptr)
      pv_rows<16, T>(p + r * kTileK, vrow, n, Dvp, o + r * ldo, ldo, next, nn, bytes);
  for (; r + MR <= M; r += MR, next = nullptr)
    pv_rows<MR, T>(p + r * kTileK, vrow, n, Dvp, o + r * ldo, ldo, next, nn, bytes);
  const Real* pr = p + r * kTileK;
  Real* orr = o + r * ldo;
  switch (M - r) {
    case 5: pv_rows<5, T>(pr, vrow, n, Dvp, orr, ldo, next, nn, bytes); break;
    case 4: pv_rows<4, T>(pr, vrow, n, Dvp, orr, ldo, next, nn, bytes); break;
    case 3: pv_rows<3, T>(pr, vrow, n, Dvp, orr, ldo, next, nn, bytes); break;
    case 2: pv_rows<2, T>(pr, vrow, n, Dvp, orr, ldo, next, nn, bytes); break;
    case 1: pv_rows<1, T>(pr, vrow, n, Dvp, orr, ldo, next, nn, bytes); break;
    default: break;
  }
}

static bool values_finite(const Real* const* vrow, int64_t n, int64_t Dv) {
  V acc = zero();
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < Dv; d += W) acc = add(acc, mul(load(vrow[j] + d), zero()));
  return all_finite(acc);  // 0 * finite = 0; 0 * inf = NaN; NaN stays NaN
}

// O += P V over only the keys each row can see (its range, and the mask's bias is not -inf).
static void pv_visible(const RowSet& rs, int64_t j0, const Real* bias, const Real* p,
                       const Real* const* vrow, int64_t n, int64_t Dv, Real* o, int64_t ldo) {
  for (int r = 0; r < rs.M; ++r)
    for (int64_t j = imax(rs.lo[r] - j0, 0); j < imin(rs.hi[r] - j0, n); ++j) {
      if (bias != nullptr && bias[r * kTileK + j] == kNegInf) continue;
      const Real pj = p[r * kTileK + j];
      const V pb = set1(pj);
      for (int64_t d = 0; d < Dv; d += W)
        store(o + r * ldo + d, fmadd(pb, load(vrow[j] + d), load(o + r * ldo + d)));
    }
}

}  // namespace
