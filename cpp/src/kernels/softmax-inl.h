// softmax-inl.h: the online softmax of a tile's scores, masks and modifiers.
//
// Online softmax, per query row (state m = running max, l = running sum, O = unnormalised output):
//   for each KV tile:  s_j = q.k_j (scaled) -> softcap -> + bias (ALiBi, mask) -> -inf outside
//                      the visible range; m' = max(m, max_j s_j); alpha = exp(m - m');
//                      p_j = exp(s_j - m'); l = alpha l + sum_j p_j; O = alpha O + sum_j p_j v_j.
// (Prefill tiles fused into the packed QK^T raise m lazily: see kLazyMax.)
// The rules for a row that has seen no visible key, or a NaN score, are those of attention/state.h.
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, tile, probes), after
// <cmath>, <cstring>, <limits>, <type_traits>, tables.h and attention/state.h: no header may be
// included from inside the namespace. Everything here stays in an anonymous namespace (internal
// linkage), so no symbol compiled with wide instructions can leak to another ISA (tables.h).

namespace {

// ---- the online update fused into the packed QK^T (qk-inl.h) ---------------------------------
// With `Online` (a tile every row sees whole, after each row's first: `fusable` below), each
// register block also does the online-softmax update of its scores while they are in registers:
// p = exp(s - m) against the row's running max m, raised (O, l and the row's earlier p of this
// tile rescaled, as softmax_row does per tile) where a score of the block exceeds it: rare after
// a row's first keys. The max pass and the exp pass over S are gone, and the exps run beside the
// next block's FMAs instead of after the whole product.
//
// Here the raise is lazy: only a score above m + kLazyMax raises m (to the block's max), so
// m may lag the true running max by up to kLazyMax and p by up to e^4 ~ 55. Any reference point
// gives the same softmax (O / l and lse = m + log l are unchanged, attention/state.h's merge takes
// any m), and p <= 55 is far from overflow. Each raise is a branch the predictor cannot know,
// taken at the end of the block's FMA chains, whose misprediction discards the next block's FMAs
// already in flight (bench/NOTES.md). With the slack, real and random scores almost never raise
// after a row's first tile. The bf16 path (bf16_dot-inl.h) keeps the exact max: it rounds p to
// bf16 before P V, and a row's largest p is then exactly 1, which the flash rule's error bound
// counts on (docs/numerics.md).
constexpr Real kLazyMax = 4;

// Scaled scores (scale * a of raw products a: the bf16 paths) take exp's argument as one FMA,
// fmadd(a, scale, -m), whose product is exact; against the rounded max m, the row's largest
// product is then off by up to half an ulp of m (a separate multiply is no cure: the compiler
// contracts it into the same FMA). While |m| < kFusedExpMax that moves its p by under 2^-9, which
// bf16 rounds to exactly 1, as the error bound counts on. Beyond, it reaches ~e^88 near |m| ~ 1e9
// and p overflows (NaN rows): there the arguments are shifted by their own max where that is
// above 0 or the block holds the row's max (fused_exp_shift), so that key's p is exactly 1 again.
// The shift is below half an ulp of m: the error of the scores' own float32 rounding.
constexpr Real kFusedExpMax = 1e4f;
static ATTNX_INLINE bool fused_exp_ok(Real m) { return m > -kFusedExpMax && m < kFusedExpMax; }
// top: the largest fmadd(a, scale, -m) of a row's block; holds_max: whether the block's largest
// score (rounded) is m
static ATTNX_INLINE Real fused_exp_shift(Real top, bool holds_max) {
  return top > 0 || holds_max ? top : Real(0);
}
struct Online {
  Real* m;
  Real* l;
  Real* o;
  int64_t ldo, Dvp;
  Online rows(int r0) const { return Online{m + r0, l + r0, o + r0 * ldo, ldo, Dvp}; }
};

// Raises row r's running max to the largest score in `hi` (the block's scores of the row, lane
// by lane), rescaling its O, l, this tile's sum so far and its p of keys [0, j) of this tile.
[[gnu::noinline, gnu::cold]] static void raise_max(V hi, int64_t j, Real* srow, Real* m, Real* l,
                                                   Real* orow, int64_t Dvp, V* lsum) {
  const Real block_max = reduce_max(hi);
  const Real m_new = block_max > *m ? block_max : *m;
  const Real alpha = row::rescale(*m, m_new);
  const V a = set1(alpha);
  *l *= alpha;
  *lsum = mul(*lsum, a);
  for (int64_t d = 0; d < Dvp; d += W) store(orow + d, mul(a, load(orow + d)));
  for (int64_t t = 0; t < j; t += W) store(srow + t, mul(a, load(srow + t)));
  *m = m_new;
}

template <int NV>
static ATTNX_INLINE V lanes_max(const V* sv) {
  V hi = sv[0];
  for (int c = 1; c < NV; ++c) hi = max(hi, sv[c]);
  return hi;
}

// p = exp(s - m) of the MR rows x NV score vectors of a register block (keys j .. j + NV * W of
// the tile), stored at s + r * kTileK (s: the block's first key) and added to lsum[r] (this
// tile's sums so far), against each row's running max, raised first where a score exceeds it
// (Lazy: exceeds it by more than kLazyMax). One test and one branch for the whole block.
// Scaled: the scores are scale * acc (scale > 0; the bf16 path's products), folded into the
// exps' argument (one FMA) and, for the test, into each row's largest (max(acc) * scale is the
// largest scaled score: rounding is monotone).
// PExp: how the block's p are computed and stored (exp, store): ExactP, float32 p with exp's
// 1.3 ulp; the bf16 path's own (bf16_dot-inl.h) store them as bf16 pairs.
struct ExactP {
  static ATTNX_INLINE V exp(V x) { return exp_small(x); }
  template <int NV>
  static ATTNX_INLINE void store_row(Real* srow, const V (&e)[NV]) {
    for (int c = 0; c < NV; ++c) simd::store(srow + c * W, e[c]);
  }
};
template <int MR, int NV, bool Lazy, bool Scaled = false, class PExp = ExactP>
static ATTNX_INLINE void online_block(const V (&acc)[MR][NV], int64_t j, Real* s, const Online& on,
                                      V* lsum, Real scale = 1) {
  const V f = set1(scale);
  auto row_max = [&](int r) {
    const V hi = lanes_max<NV>(acc[r]);
    return Scaled ? mul(hi, f) : hi;
  };
  auto bound = [&](int r) { return set1(Lazy ? on.m[r] + kLazyMax : on.m[r]); };
  Mask up = greater(row_max(0), bound(0));
  for (int r = 1; r < MR; ++r) up = mask_or(up, greater(row_max(r), bound(r)));
  if (any(up)) [[unlikely]] {
    for (int r = 0; r < MR; ++r) {
      const V hi = row_max(r);
      if (any(greater(hi, bound(r))))
        raise_max(hi, j, s + r * kTileK - j, on.m + r, on.l + r, on.o + r * on.ldo, on.Dvp,
                  lsum + r);
    }
  }
  for (int r = 0; r < MR; ++r) {
    // every score is now <= m (+ kLazyMax where Lazy), or NaN
    const V mr = set1(on.m[r]), neg_m = set1(-on.m[r]);
    V e[NV];
    if (!Scaled) {
      for (int c = 0; c < NV; ++c) e[c] = PExp::exp(sub(acc[r][c], mr));
    } else if (fused_exp_ok(on.m[r])) [[likely]] {
      for (int c = 0; c < NV; ++c) e[c] = PExp::exp(fmadd(acc[r][c], f, neg_m));
    } else {
      V x[NV];
      for (int c = 0; c < NV; ++c) x[c] = fmadd(acc[r][c], f, neg_m);
      const V shift =
          set1(fused_exp_shift(reduce_max(lanes_max<NV>(x)), reduce_max(row_max(r)) == on.m[r]));
      for (int c = 0; c < NV; ++c) e[c] = PExp::exp(sub(x[c], shift));
    }
    PExp::store_row(s + r * kTileK, e);
    V sum = e[0];
    for (int c = 1; c < NV; ++c) sum = add(sum, e[c]);
    lsum[r] = add(lsum[r], sum);
  }
}

// The online-softmax update of R rows of scores (row i at s + i * kTileK, -inf outside what it
// sees, nw a whole number of vectors): m' = max(m, max_j s_j), s_j becomes p_j = exp(s_j - m'),
// l = alpha l + sum_j p_j and O = alpha O with alpha = exp(m - m'). Returns false, changing
// nothing, where a row has seen nothing visible yet (m' = -inf: the update would compute
// exp(-inf - -inf)); the caller then skips that row's update (attention/state.h).
// softmax_rows runs it over 4 rows at once (2 on AVX2, whose 16 registers spilled 4 rows' sums):
// one row's max reduction and exp chains leave the pipes idle (a row and 64-key tile is ~200
// instructions at ~1.5 per cycle), several rows' overlap; the same operations in the same order
// per row, so the same bits.
template <int R>
static inline bool online_update(Real* s, int64_t nw, Real* m, Real* l, Real* o, int64_t ldo,
                                 int64_t Dvp) {
  V mv[R];
  for (int i = 0; i < R; ++i) mv[i] = set1(kNegInf);
  for (int64_t j = 0; j < nw; j += W)
    for (int i = 0; i < R; ++i) mv[i] = max(mv[i], load(s + i * kTileK + j));
  Real m_new[R];
  for (int i = 0; i < R; ++i) {
    const Real tile_max = reduce_max(mv[i]);
    m_new[i] = tile_max > m[i] ? tile_max : m[i];
    if (m_new[i] == kNegInf) return false;
  }
  V mn[R], sum[R];
  for (int i = 0; i < R; ++i) {
    mn[i] = set1(m_new[i]);
    sum[i] = zero();
  }
  for (int64_t j = 0; j < nw; j += W)
    for (int i = 0; i < R; ++i) {
      V e = exp(sub(load(s + i * kTileK + j), mn[i]));
      store(s + i * kTileK + j, e);
      sum[i] = add(sum[i], e);
    }
  for (int i = 0; i < R; ++i) {
    const Real alpha = row::rescale(m[i], m_new[i]);
    l[i] = l[i] * alpha + reduce_add(sum[i]);
    m[i] = m_new[i];
    if (alpha != 1.f) {
      const V a = set1(alpha);
      Real* orow = o + i * ldo;
      for (int64_t d = 0; d < Dvp; d += W) store(orow + d, mul(a, load(orow + d)));
    }
  }
  return true;
}

// ---- one tile row: modifiers, masks and the online-softmax update --------------------------
static inline void softmax_row(Real* srow, const Real* brow, int64_t n, int64_t vlo, int64_t vhi,
                               int64_t j0, Real softcap, Real slope, int64_t pos, Real* m, Real* l,
                               Real* orow, int64_t Dvp) {
  // 1. modifiers over the whole tile width (entries past n are overwritten below)
  if (softcap > 0.f) {
    const V cap = set1(softcap), inv = set1(Real(1) / softcap);
    for (int64_t j = 0; j < n; j += W) store(srow + j, mul(cap, tanh(mul(load(srow + j), inv))));
  }
  if (slope != 0.f) {
    // s -= slope * |pos - (j0 + j)|
    const V ns = set1(-slope), p = set1(Real(pos - j0));
    V jv = iota();
    for (int64_t j = 0; j < n; j += W, jv = add(jv, set1(Real(W))))
      store(srow + j, fmadd(ns, abs(sub(p, jv)), load(srow + j)));
  }
  if (brow != nullptr)
    for (int64_t j = 0; j < n; j += W) store(srow + j, mask_add(load(srow + j), load(brow + j)));
  // 2. the visible range [vlo, vhi) of this row within the tile; -inf elsewhere
  for (int64_t j = 0; j < vlo; ++j) srow[j] = kNegInf;
  for (int64_t j = vhi; j < round_up(n, W); ++j) srow[j] = kNegInf;
  // 3. online softmax over the tile's width rounded to whole vectors
  if (!online_update<1>(srow, round_up(n, W), m, l, orow, 0, Dvp)) {
    // nothing visible so far: the update is skipped, but a NaN score is kept
    for (int64_t j = vlo; j < vhi; ++j) row::keep_nan(l, srow[j]);
    std::memset(srow, 0, sizeof(Real) * kTileK);
  }
}

// The user mask over keys [j0, j0 + n) as an additive bias tile (M rows of kTileK, zero past n to
// a whole vector). Returns whether any row's visible range has a key the mask lets through.
static inline bool mask_tile(const RowSet& rs, int64_t j0, int64_t n, Real* bias) {
  bool open = false;
  for (int r = 0; r < rs.M; ++r) {
    Real* br = bias + int64_t(r) * kTileK;
    const char* mr = rs.mask_row[r] + j0 * rs.mask_sk;
    if (rs.mask_kind == MaskKind::boolean) {
      for (int64_t t = 0; t < n; ++t) br[t] = mr[t * rs.mask_sk] ? 0.f : kNegInf;
    } else {
      for (int64_t t = 0; t < n; ++t) std::memcpy(br + t, mr + t * rs.mask_sk, sizeof(Real));
    }
    for (int64_t t = n; t < round_up(n, W); ++t) br[t] = 0.f;
    const int64_t a = imax(rs.lo[r] - j0, 0), b = imin(rs.hi[r] - j0, n);
    for (int64_t t = a; t < b && !open; ++t) open = br[t] != kNegInf;
  }
  return open;
}

// Whether some row sees a key of [j0, j0 + n): tiles outside every row's causal / window /
// padding range, or whose visible pairs the user mask all blocks, are skipped. *bias: the mask as
// an additive bias tile (in sc.bias), or null without a mask.
static bool tile_open(const RowSet& rs, int64_t j0, int64_t n, const Scratch& sc,
                      const Real** bias) {
  bool any = false;
  for (int r = 0; r < rs.M && !any; ++r) any = rs.lo[r] < j0 + n && rs.hi[r] > j0;
  if (!any) return false;
  *bias = nullptr;
  if (rs.mask_kind == MaskKind::none) return true;
  *bias = sc.bias;
  return mask_tile(rs, j0, n, sc.bias);
}

// Whether rows [r, r + R) all see every key of [j0, j0 + n), without an ALiBi slope.
static inline bool sees_whole(const RowSet& rs, int r, int R, int64_t j0, int64_t n) {
  for (int i = r; i < r + R; ++i)
    if (rs.lo[i] > j0 || rs.hi[i] < j0 + n || (rs.slope != nullptr && rs.slope[i] != 0.f))
      return false;
  return true;
}

// Whether the packed QK^T of keys [j0, j0 + n) can do the online-softmax update itself
// (qk_packed with Online): every row sees every key, no soft-cap or ALiBi (the mask is the
// caller's test), every row has a finite running max (not its first visible tile: the update
// is skipped while it has seen nothing, see attention/state.h) and the tile is whole register
// blocks (zero keys past n would score 0). (Integer queries multiply packed keys with their
// values, RowSet::qvals: no row factor follows the products.)
static bool fusable(const RowSet& rs, int64_t j0, int64_t n, Real softcap, const FlashState& st) {
  if (softcap > 0.f || n % (QR * W) != 0 || !sees_whole(rs, 0, rs.M, j0, n)) return false;
  for (int r = 0; r < rs.M; ++r)
    if (!(st.m[r] > kNegInf && st.m[r] < -kNegInf)) return false;
  return true;
}

// The online-softmax update of the M rows of scores s over keys [j0, j0 + n) (bias: the mask tile
// or null); s becomes the probabilities. Returns whether some row sees only part of the tile.
static bool softmax_rows(const RowSet& rs, int64_t j0, int64_t n, const Real* bias, Real softcap,
                         int64_t Dvp, Real* s, const FlashState& st) {
  bool partial = bias != nullptr;
  constexpr int R = W >= 16 ? 4 : 2;  // rows updated together (online_update)
  const bool plain = bias == nullptr && softcap <= 0.f;
  const int64_t nw = round_up(n, W);
  for (int r = 0; r < rs.M; ++r) {
    if (plain && r % R == 0 && r + R <= rs.M && sees_whole(rs, r, R, j0, n)) {
      // R rows at once (online_update); a row that has seen nothing yet sends them one by one
      Real* sr = s + int64_t(r) * kTileK;
      for (int i = 0; i < R; ++i)
        for (int64_t j = n; j < nw; ++j) sr[i * kTileK + j] = kNegInf;
      if (online_update<R>(sr, nw, st.m + r, st.l + r, st.o + int64_t(r) * st.ldo, st.ldo, Dvp)) {
        r += R - 1;
        continue;
      }
    }
    const int64_t vlo = imax(rs.lo[r] - j0, 0), vhi = imin(rs.hi[r] - j0, n);
    partial = partial || vlo > 0 || vhi < n;
    Real* srow = s + int64_t(r) * kTileK;
    if (vlo >= vhi) {
      std::memset(srow, 0, sizeof(Real) * kTileK);
      continue;
    }
    softmax_row(srow, bias ? bias + int64_t(r) * kTileK : nullptr, n, vlo, vhi, j0, softcap,
                rs.slope ? rs.slope[r] : 0.f, rs.pos[r], st.m + r, st.l + r,
                st.o + int64_t(r) * st.ldo, Dvp);
  }
  return partial;
}

}  // namespace
