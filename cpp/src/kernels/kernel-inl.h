// kernel-inl.h: the flash-attention tile loop and its micro-kernels, written once against the
// vector vocabulary `simd` (vec_*.h) and compiled once per instruction set. The including file
// opens `namespace attnx::<isa>` and defines `simd`; everything here stays inside that namespace
// (internal linkage), so no symbol compiled with wide instructions can leak to another ISA.
//
// Online softmax, per query row (state m = running max, l = running sum, O = unnormalised output):
//   for each KV tile:  s_j = q.k_j (scaled) -> softcap -> + bias (ALiBi, mask) -> -inf outside
//                      the visible range; m' = max(m, max_j s_j); alpha = exp(m - m');
//                      p_j = exp(s_j - m'); l = alpha l + sum_j p_j; O = alpha O + sum_j p_j v_j.
// (Prefill tiles fused into the packed QK^T raise m lazily: see kLazyMax.)
// The rules for a row that has seen no visible key, or a NaN score, are those of row_state.h.

// The including file provides <cmath>, <cstring>, <limits>, <type_traits>, kernels.h and row_state.h before
// opening the namespace: no header may be included from inside it.

namespace {

using namespace simd;
using kern::kDotRows;
using kern::kPad;
using kern::kTileK;

// Real (simd's lane type) is what this body computes in: float for every ISA's float32, float16
// and bfloat16 path, double for the float64 kernels (kernels_f64.cpp). kNative is the dtype whose
// rows are already Real: read in place, copied with memcpy.
constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
constexpr DType kNative = sizeof(Real) == 8 ? DType::f64 : DType::f32;
using RowSet = kern::RowSetT<Real>;
using Scratch = kern::ScratchT<Real>;
using FlashState = kern::FlashStateT<Real>;
constexpr int NR = 2;  // vectors per register block along the wide axis (keys or value features)

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Local twins of types.h's is_quantised and dtype_size: an inline function of a shared header,
// compiled here with wide-instruction flags, could be the copy the linker keeps for baseline code
// (see kernels.h); these are static, inside this ISA's namespace.
static inline bool quantised(DType t) { return t == DType::i8 || t == DType::e4m3 || t == DType::e5m2; }
// (float64 only reaches the float64 kernels: in the float ones its test folds away at compile time.)
static inline int64_t elem_bytes(DType t) {
  if (sizeof(Real) == 8 && t == DType::f64) return 8;
  return t == DType::f32 ? 4 : (t == DType::f16 || t == DType::bf16) ? 2 : 1;
}

// Rows j0 .. j0+n-1 as runs of consecutive slots: fn(t, page, off, run) for rows t .. t+run-1 at
// slots off .. off+run-1 of `page` (the block id; -1 and off = j0 for a contiguous source). One
// block-table lookup per page, not a division per row.
template <class Fn>
static inline void each_run(const kern::KVSource& s, int64_t j0, int64_t n, Fn&& fn) {
  if (s.block_table == nullptr) {
    fn(int64_t(0), int64_t(-1), j0, n);
    return;
  }
  int64_t blk = j0 / s.block_size, off = j0 % s.block_size;
  for (int64_t t = 0; t < n; ++blk, off = 0) {
    const int64_t run = imin(s.block_size - off, n - t);
    fn(t, int64_t(s.block_table[blk]), off, run);
    t += run;
  }
}

// Addresses of rows j0 .. j0+n-1 (a branch-free inner loop over each page's run of rows).
static inline void kv_rows(const kern::KVSource& s, int64_t j0, int64_t n, const char** out) {
  const int64_t rs = s.row_stride;
  each_run(s, j0, n, [&](int64_t t, int64_t page, int64_t off, int64_t run) {
    const char* p = s.base + (page < 0 ? 0 : page * s.block_stride) + off * rs;
    for (int64_t k = 0; k < run; ++k) out[t + k] = p + k * rs;
  });
}

// The scales of rows j0 .. j0+n-1 of a quantised source (1 without a scale pointer).
static inline void kv_scales(const kern::KVSource& s, int64_t j0, int64_t n, float* out) {
  if (s.scale == nullptr) {
    for (int64_t t = 0; t < n; ++t) out[t] = 1.f;
    return;
  }
  const int64_t rs = s.scale_row_stride;
  each_run(s, j0, n, [&](int64_t t, int64_t page, int64_t off, int64_t run) {
    const float* p = s.scale + (page < 0 ? 0 : page * s.scale_block_stride) + off * rs;
    for (int64_t k = 0; k < run; ++k) out[t + k] = p[k * rs];
  });
}

// n 1-byte codes times `scale` to fp32, in one pass: code * scale, one float32 product (what
// attnx.reference.dequantize_kv computes). fp8 goes through float16 lanes (vec_*.h load_fp8):
// e4m3fn's float16 view is its value / 256, so it is multiplied by 256 * scale (exact: a power
// of two).
static void load_codes(const void* src, DType dtype, int64_t n, float scale, Real* dst) {
  int64_t i = 0;
  if (dtype == DType::i8) {
    const int8_t* c = static_cast<const int8_t*>(src);
    const V f = set1(scale);
    for (; i + W <= n; i += W) store(dst + i, mul(load_i8(c + i), f));
    for (; i < n; ++i) dst[i] = float(c[i]) * scale;
    return;
  }
  const uint8_t* c = static_cast<const uint8_t*>(src);
  const bool e4 = dtype == DType::e4m3;
  const float mult = e4 ? 256.f * scale : scale;
  const V f = set1(mult);
  for (; i + W <= n; i += W) store(dst + i, mul(load_fp8(c + i, e4), f));
  for (; i < n; ++i) dst[i] = cvt::f16_to_f32(e4 ? cvt::e4m3_as_f16(c[i]) : cvt::e5m2_as_f16(c[i])) * mult;
}

static void load_row(const void* src, DType dtype, int64_t n, Real* dst) {
  int64_t i = 0;
  if (dtype == kNative) {
    std::memcpy(dst, src, size_t(n) * sizeof(Real));
    return;
  }
  if (quantised(dtype)) {  // the codes alone (scale 1): the tile loads apply each row's scale
    load_codes(src, dtype, n, 1.f, dst);
    return;
  }

  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (dtype == DType::f16) {
    for (; i + W <= n; i += W) store(dst + i, load_f16(h + i));
    for (; i < n; ++i) dst[i] = cvt::f16_to_f32(h[i]);
  } else {
    for (; i + W <= n; i += W) store(dst + i, load_bf16(h + i));
    for (; i < n; ++i) dst[i] = cvt::bf16_to_f32(h[i]);
  }
}

// (float dtypes only: quantised rows are written with their scale by the paged write)
static void store_row(const Real* src, int64_t n, DType dtype, void* dst) {
  if (dtype == kNative) {
    std::memcpy(dst, src, size_t(n) * sizeof(Real));
  } else if (dtype == DType::f16) {
    uint16_t* h = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) h[i] = cvt::f32_to_f16(src[i]);
  } else {
    uint16_t* h = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) h[i] = cvt::f32_to_bf16(src[i]);
  }
}

// Converts row `src` (D elements) into `dst`, zero-padded to Dp.
static inline void load_row_padded(const char* src, DType dtype, int64_t D, int64_t Dp, Real* dst) {
  load_row(src, dtype, D, dst);
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
}

// Rows of a later tile to prefetch while the packed QK^T runs: the 64-byte lines of `n` rows of
// `bytes` each, spread evenly over the `calls` register-block calls of the product (call c asks
// for its share), so the misses overlap with the FMAs instead of arriving in one burst.
struct LinePrefetch {
  const char* const* rows = nullptr;
  int64_t lines_per_row = 0, lines = 0, calls = 1;
  // (always inlined: GCC's mod/ref analysis takes a call that only prefetches for one without
  // effect and drops it, as it did for one added to the bf16 tile loop's register blocks: none was emitted)
  ATTNX_INLINE void share(int64_t c) const { range(lines * c / calls, lines * (c + 1) / calls); }
  ATTNX_INLINE void range(int64_t l0, int64_t l1) const {
    for (int64_t l = l0; l < l1; ++l)
      __builtin_prefetch(rows[l / lines_per_row] + l % lines_per_row * 64, 0, 1);
  }
};

// ---- QK^T, packed form: S[r][j] = sum_d Q[r][d] * Kt[d][j] for MR rows x NR*W keys ----------
// With `Online` (a tile every row sees whole, after each row's first: `fusable` below), each
// register block also does the online-softmax update of its scores while they are in registers:
// p = exp(s - m) against the row's running max m, raised (O, l and the row's earlier p of this
// tile rescaled, as softmax_row does per tile) where a score of the block exceeds it: rare after
// a row's first keys. The max pass and the exp pass over S are gone, and the exps run beside the
// next block's FMAs instead of after the whole product.
//
// Here the raise is lazy: only a score above m + kLazyMax raises m (to the block's max), so
// m may lag the true running max by up to kLazyMax and p by up to e^4 ~ 55. Any reference point
// gives the same softmax (O / l and lse = m + log l are unchanged, row_state.h's merge takes any
// m), and p <= 55 is far from overflow. Each raise is a branch the predictor cannot know, taken
// at the end of the block's FMA chains, whose misprediction discards the next block's FMAs
// already in flight: random scores raised a few times per row, which cost 2 points of the FMA
// peak (avx2 prefill 75.4 -> 77.0%, avx512 79.5 -> 82.5%, one thread). With the slack, real and
// random scores almost never raise after a row's first tile. The bf16 path (bf16_dot-inl.h) keeps
// the exact max: it rounds p to bf16 before P V, and a row's largest p is then exactly 1, which
// the flash rule's error bound counts on (with the slack its max error grew past 2x the bf16-P
// emulation's).
constexpr Real kLazyMax = 4;
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
        raise_max(hi, j, s + r * kTileK - j, on.m + r, on.l + r, on.o + r * on.ldo, on.Dvp, lsum + r);
    }
  }
  for (int r = 0; r < MR; ++r) {
    // every score is now <= m (+ kLazyMax where Lazy), or NaN
    const V mr = set1(on.m[r]), neg_m = set1(-on.m[r]);
    V e[NV];
    for (int c = 0; c < NV; ++c)
      e[c] = PExp::exp(Scaled ? fmadd(acc[r][c], f, neg_m) : sub(acc[r][c], mr));
    PExp::store_row(s + r * kTileK, e);
    V sum = e[0];
    for (int c = 1; c < NV; ++c) sum = add(sum, e[c]);
    lsum[r] = add(lsum[r], sum);
  }
}

template <int MR, bool Fused>
static ATTNX_INLINE void qk_packed_block(const Real* q, int64_t ldq, const Real* kt,
                                         int64_t Dkp, Real* s, const LinePrefetch* pf,
                                         int64_t l0, int64_t l1, const Online* on, int64_t j,
                                         V* lsum) {
  V acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = zero();
  for (int64_t d = 0; d < Dkp; ++d) {
    if (pf != nullptr && (d & 7) == 0) pf->range(l0 + (l1 - l0) * d / Dkp, l0 + (l1 - l0) * (d + 8) / Dkp);
    const Real* kd = kt + d * kTileK;
    V k0 = load(kd), k1 = load(kd + W);
    for (int r = 0; r < MR; ++r) {
      V qb = set1(q[r * ldq + d]);
      acc[r][0] = fmadd(qb, k0, acc[r][0]);
      acc[r][1] = fmadd(qb, k1, acc[r][1]);
    }
  }
  if constexpr (Fused) {
    online_block<MR, NR, true>(acc, j, s, *on, lsum);
  } else {
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c) store(s + r * kTileK + c * W, acc[r][c]);
  }
}

template <int MR, bool Fused>
static void qk_packed_rows(const Real* q, int64_t ldq, const Real* kt, int64_t Dkp, int64_t nw,
                           Real* s, const LinePrefetch& pf, int64_t& call, const Online* on) {
  V lsum[MR];
  for (int r = 0; r < MR; ++r) lsum[r] = zero();
  for (int64_t j = 0; j < nw; j += NR * W) {
    const int64_t c = call++;
    qk_packed_block<MR, Fused>(q, ldq, kt + j, Dkp, s + j, &pf, pf.lines * c / pf.calls,
                               pf.lines * (c + 1) / pf.calls, on, j, lsum);
  }
  if constexpr (Fused)
    for (int r = 0; r < MR; ++r) on->l[r] += reduce_add(lsum[r]);
}

// `next` (nn rows of `bytes`, or null) is a later tile's K, prefetched during the product. With
// `on` (non-null: `fusable` tiles), s receives the probabilities and the rows' state is updated.
template <bool Fused>
static void qk_packed_as(int M, const Real* q, int64_t ldq, const Real* kt, int64_t Dkp, int64_t n,
                         Real* s, const char* const* next, int64_t nn, int64_t bytes,
                         const Online* on) {
  const int64_t nw = round_up(n, NR * W);
  constexpr int MR = 6;
  LinePrefetch pf;
  if (next != nullptr && nn > 0) {
    const int64_t lpr = (bytes + 63) / 64;
    pf = LinePrefetch{next, lpr, nn * lpr, (M + MR - 1) / MR * (nw / (NR * W))};
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

// Packs the n rows of a K tile transposed: kt[d][j], zero for j >= n (to a multiple of NR*W) and
// for d >= Dk (to Dkp). `rows` holds kTileK Real row pointers padded with zero rows past n.
static void zero_kt_tail(int64_t n, int64_t Dkp, Real* kt) {
  const int64_t n8 = round_up(n, 8), nw = round_up(n, NR * W);
  for (int64_t d = 0; d < Dkp; ++d)
    for (int64_t j = n8; j < nw; ++j) kt[d * kTileK + j] = 0;
}

static void pack_kt(const Real* const* rows, int64_t n, int64_t Dkp, Real* kt) {
  const int64_t n8 = round_up(n, 8);
  for (int64_t j = 0; j < n8; j += 8)
    for (int64_t d = 0; d < Dkp; d += 8) transpose8x8(rows + j, d, kt + d * kTileK + j, kTileK);
  zero_kt_tail(n, Dkp, kt);
}

// Prefetch of the rows of a later tile, spread through the current tile's loops so the misses
// overlap with the arithmetic instead of stalling in one burst. Into L2 (prefetcht2), not L1: the
// current K and V tiles (up to 64 KiB) already fill L1. On Zen 4, one thread decoding GQA from
// memory: prefetcht2 one tile ahead 14.2 GB/s; two tiles ahead 13.6; prefetcht0 and prefetchnta
// 7-9 (lines land in L1 and are evicted, or skip L2); no prefetch 8.6.
constexpr int64_t kPrefetchTiles = 1;  // flash: the same item's next tile
constexpr int64_t kPrefetchSteps = 1;  // flash_group: the next (item, tile) in execution order
static inline void prefetch_row(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

// Element types of K/V rows read in place by the decode kernels: fp16 and bf16 rows are widened
// in registers as they are loaded (no fp32 copy of the tile). Row pointers are kept as
// `const Real*` and only ever dereferenced as the row's real type.
struct Native {};
struct F16 {};
struct BF16 {};
template <class T> static inline V ld(const Real* row, int64_t d);
template <> inline V ld<Native>(const Real* row, int64_t d) { return load(row + d); }
template <> inline V ld<F16>(const Real* row, int64_t d) {
  return load_f16(reinterpret_cast<const uint16_t*>(row) + d);
}
template <> inline V ld<BF16>(const Real* row, int64_t d) {
  return load_bf16(reinterpret_cast<const uint16_t*>(row) + d);
}

// Quantised rows read in place give their codes (e4m3: code / 256, see load_fp8); the row's scale
// is applied to the scores (K) or the probabilities (V) instead: scale_keys below.
struct I8 {};
struct E4M3 {};
struct E5M2 {};
template <> inline V ld<I8>(const Real* row, int64_t d) {
  return load_i8(reinterpret_cast<const int8_t*>(row) + d);
}
template <> inline V ld<E4M3>(const Real* row, int64_t d) {
  return load_fp8(reinterpret_cast<const uint8_t*>(row) + d, true);
}
template <> inline V ld<E5M2>(const Real* row, int64_t d) {
  return load_fp8(reinterpret_cast<const uint8_t*>(row) + d, false);
}

// Calls f(tag) with the tag type of `dtype`.
template <class Fn>
static inline void with_type(DType dtype, Fn&& f) {
  switch (dtype) {
    case DType::f16: f(F16{}); break;
    case DType::bf16: f(BF16{}); break;
    case DType::i8: f(I8{}); break;
    case DType::e4m3: f(E4M3{}); break;
    case DType::e5m2: f(E5M2{}); break;
    default: f(Native{}); break;
  }
}

// Keys [j0, j0 + n) of a quantised source read in place: multiplies column j of the M rows of
// `s` (scores, or probabilities before P V) by key j's scale (times 256 for e4m3's code / 256).
// q . (code * scale) = (q . code) * scale and p (code * scale) = (p scale) code, so this is
// attention over the dequantised rows up to float32 rounding.
static void scale_keys(int M, Real* s, const kern::KVSource& src, int64_t j0, int64_t n) {
  float f[kTileK];
  kv_scales(src, j0, n, f);
  if (src.dtype == DType::e4m3)
    for (int64_t j = 0; j < n; ++j) f[j] *= 256.f;
  for (int r = 0; r < M; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * kTileK + j] *= f[j];
}

// Integer queries (RowSet::qfactor): row r of the M rows of scores times its factor.
static void scale_rows(int M, Real* s, const Real* f, int64_t n) {
  for (int r = 0; r < M; ++r) {
    const V fr = set1(f[r]);
    for (int64_t j = 0; j < n; j += W) store(s + r * kTileK + j, mul(load(s + r * kTileK + j), fr));
  }
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
// is streamed once per block of rows. The sums go straight to S.
template <int RB, int KB, class T>
static ATTNX_INLINE void qk_dot_block(const Real* q, int64_t ldq, const Real* const* kr,
                                      int64_t Dk, Real* s) {
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
  // a kv head stream K once (2 rows x 4 keys streamed it twice; fp32 decode 5.1-5.7 -> 4.9-5.2
  // ms). Its 8 accumulators at 2 FMAs per cycle and 4 cycles of latency leave no slack, which is
  // why avx2 decode still trails avx512 on Zen 4. The rows left over (a GQA group of 2, 3, 6 or
  // 7: SmolLM2's is 3) form one block too, of 3 or 2 rows x 8 keys (AVX2: x 4), where they took
  // one 1 x 8 pass each: avx2 decode of 3 rows, D 64, L 2048, one thread 53-55 -> 47-48 us;
  // avx512 within the noise (its loads are not the bound there).
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

#if defined(ATTNX_VNNI)
// ---- QK^T of integer queries over int8 keys read in place: VNNI's vpdpbusd -------------------
// vpdpbusd multiplies unsigned bytes by signed ones: the keys go in as k + 128 (their sign bit
// flipped) and the queries as they are, so each sum is q . k + 128 sum(q), corrected per row.
// Every partial sum is an integer below 2^24 (Dk < 1040): the float scores are exactly what the
// FMA path computes over the same codes.

// 128 * the sum of each row's codes (M <= kDotRows rows of ldq bytes): the correction.
static void code_sums(const RowSet& rs, int64_t Dk, float* sum) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int r = 0; r < rs.M; ++r) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t d = 0; d < Dk; d += 64)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_loadu_si512(rs.qcodes + r * rs.ldq + d));
    sum[r] = 128.f * float(_mm512_reduce_add_epi32(acc));
  }
}

template <int RB, int KB>
static ATTNX_INLINE void qk_vnni_block(const int8_t* q8, int64_t ld, int64_t Dk,
                                       const Real* const* kr, Real* s) {
  __m512i acc[RB * KB];
  for (int a = 0; a < RB * KB; ++a) acc[a] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t d = 0; d < Dk; d += 64) {
    __m512i qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = _mm512_loadu_si512(q8 + r * ld + d);
    for (int t = 0; t < KB; ++t) {
      const __m512i kv = _mm512_xor_si512(_mm512_loadu_si512(reinterpret_cast<const int8_t*>(kr[t]) + d), flip);
      for (int r = 0; r < RB; ++r) acc[r * KB + t] = _mm512_dpbusd_epi32(acc[r * KB + t], kv, qv[r]);
    }
  }
  V f[RB * KB];
  for (int a = 0; a < RB * KB; ++a) f[a] = _mm512_cvtepi32_ps(acc[a]);
  reduce_block<RB, KB>(f, s);
}

// S = Q K^T (the codes' sums) of the M integer query rows (rs.qcodes) against the tile's n int8
// key rows (Dk a multiple of 64).
// The first block of rows prefetches `next` (nn rows of `bytes`, or null: the next tile's K) as
// it goes, a few rows per block of keys, as qk_dot_rows does.
static void qk_vnni(const RowSet& rs, const Real* const* krow, int64_t n, int64_t Dk, Real* s,
                    const char* const* next, int64_t nn, int64_t bytes) {
  const int M = rs.M;
  const int64_t ld = rs.ldq;
  int r = 0;
  auto ahead = [&](int64_t j, int64_t kb) {
    if (r == 0 && next != nullptr)
      for (int64_t t = j; t < imin(j + kb, nn); ++t) prefetch_row(next[t], bytes);
  };
  for (; r + 4 <= M; r += 4)
    for (int64_t j = 0; j < n; j += 4) {
      ahead(j, 4);
      qk_vnni_block<4, 4>(rs.qcodes + r * ld, ld, Dk, krow + j, s + r * kTileK + j);
    }
  for (; r + 2 <= M; r += 2)
    for (int64_t j = 0; j < n; j += 4) {
      ahead(j, 4);
      qk_vnni_block<2, 4>(rs.qcodes + r * ld, ld, Dk, krow + j, s + r * kTileK + j);
    }
  for (; r < M; ++r)
    for (int64_t j = 0; j < n; j += 8) {
      ahead(j, 8);
      qk_vnni_block<1, 8>(rs.qcodes + r * ld, ld, Dk, krow + j, s + r * kTileK + j);
    }
  float sum[kern::kDotRows];
  code_sums(rs, Dk, sum);
  for (int i = 0; i < M; ++i) {
    const V corr = set1(sum[i]);
    for (int64_t j = 0; j < n; j += W) store(s + i * kTileK + j, sub(load(s + i * kTileK + j), corr));
  }
}
#endif

// ---- O += P V: MR rows x NB*W value features per register block ------------------------------
template <int MR, int NB, class T>
static ATTNX_INLINE void pv_block(const Real* p, const Real* const* vrow, int64_t n, int64_t c,
                                  Real* o, int64_t ldo, const char* const* next, int64_t nn,
                                  int64_t blo, int64_t bhi) {
  V acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NB; ++k) acc[r][k] = load(o + r * ldo + c + k * W);
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
    for (int k = 0; k < NB; ++k) store(o + r * ldo + c + k * W, acc[r][k]);
}

// `next` (nn rows of `bytes`, or null) is a later tile's V. Each pass over a block of columns
// prefetches its share of those rows' lines, so the requests are spread over the whole product.
// With 32 registers, up to 4 rows take 4 vectors per pass (16 accumulators): half the passes, and
// half the broadcasts of p per FMA; 16 rows take 1 vector (pv below).
template <int MR, class T>
static void pv_rows(const Real* p, const Real* const* vrow, int64_t n, int64_t Dvp, Real* o,
                    int64_t ldo, const char* const* next, int64_t nn, int64_t bytes) {
  constexpr int NB = MR > 8 ? 1 : (W >= 16 && MR <= 4) ? 2 * NR : NR;
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
  // widen each value vector once for 16 rows instead of three times (6 + 6 + 4 rows): a
  // shared prefix's 16-row fp16 tile took 2-4% less CPU time (alternating runs, 1 thread).
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

// The online-softmax update of R rows of scores (row i at s + i * kTileK, -inf outside what it
// sees, nw a whole number of vectors): m' = max(m, max_j s_j), s_j becomes p_j = exp(s_j - m'),
// l = alpha l + sum_j p_j and O = alpha O with alpha = exp(m - m'). Returns false, changing
// nothing, where a row has seen nothing visible yet (m' = -inf: the update would compute
// exp(-inf - -inf)); the caller then skips that row's update (row_state.h).
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
                               int64_t j0, Real softcap, Real slope, int64_t pos, Real* m,
                               Real* l, Real* orow, int64_t Dvp) {
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
      for (int64_t d = 0; d < Dv; d += W) store(o + r * ldo + d, fmadd(pb, load(vrow[j] + d), load(o + r * ldo + d)));
    }
}

// Real row pointers (into `rows`) to rows [j0, j0 + n) of `s` at addr (D elements each): the
// rows themselves where read in place, else their copies in Real, zero-padded, in buf (n x Dp),
// quantised rows with their scales (code * scale, one float32 product: what
// attnx.reference.dequantize_kv computes).
static inline const Real** real_rows(const kern::KVSource& s, int64_t j0, const char* const* addr,
                                     int64_t n, int64_t D, bool inplace, Real* buf,
                                     const Real** rows) {
  const int64_t Dp = round_up(D, kPad);
  if (inplace) {
    for (int64_t t = 0; t < n; ++t) rows[t] = reinterpret_cast<const Real*>(addr[t]);
    return rows;
  }
  float scl[kTileK];
  const bool scaled = quantised(s.dtype);
  if (scaled) kv_scales(s, j0, n, scl);
  for (int64_t t = 0; t < n; ++t) {
    Real* dst = buf + t * Dp;
    if (scaled) {
      load_codes(addr[t], s.dtype, D, scl[t], dst);
      for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
    } else {
      load_row_padded(addr[t], s.dtype, D, Dp, dst);
    }
    rows[t] = dst;
  }
  return rows;
}

// Real row pointers to keys [j0, j0 + n), converted into scratch unless read in place; rows past
// n point at zeros so register blocks never read past the tile.
static const Real** key_rows(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                             bool inplace, const Scratch& sc) {
  kv_rows(ks, j0, n, sc.kaddr);
  const Real** krow = real_rows(ks, j0, sc.kaddr, n, Dk, inplace, sc.kf, sc.krow);
  for (int64_t t = n; t < kTileK; ++t) krow[t] = sc.zero;
  return krow;
}

// Keys [j0, j0 + n) transposed into kt (Dkp x kTileK), zero past n and past Dk.
static void pack_k(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                   const Scratch& sc, Real* kt) {
  const int64_t Dkp = round_up(Dk, kPad);
  const bool inplace = (ks.dtype == kNative || ks.dtype == DType::f16) && Dk % 8 == 0;
  const int64_t dk = inplace ? Dk : Dkp;  // converted rows are already zero-padded
  if (inplace && ks.dtype == DType::f16) {
    // float16 rows widened inside the transpose, read in place: the fp32 copy of the tile and
    // its reload cost a 16-row fp16 tile ~6% of its CPU time (alternating runs, 1 thread)
    kv_rows(ks, j0, n, sc.kaddr);
    const uint16_t* rows[8];
    for (int64_t j = 0; j < n; j += 8) {
      for (int64_t t = 0; t < 8; ++t)
        rows[t] = reinterpret_cast<const uint16_t*>(j + t < n ? sc.kaddr[j + t]
                                                              : reinterpret_cast<const char*>(sc.zero));
      for (int64_t d = 0; d < Dk; d += 8) transpose8x8_f16(rows, d, kt + d * kTileK + j, kTileK);
    }
    zero_kt_tail(n, Dk, kt);
  } else if (inplace) {
    pack_kt(key_rows(ks, j0, n, Dk, true, sc), n, dk, kt);
  } else {
    // Converted 8 rows at a time into the head of kf, each 8 transposed before the next are
    // converted. A whole converted tile (32 KiB at D 128) beside the packed one evicted itself
    // from L1, and the conversion stalled on its stores: a sixth of a 16-row fp16 tile's cycles.
    kv_rows(ks, j0, n, sc.kaddr);
    const Real* rows[8];
    for (int64_t j = 0; j < n; j += 8) {
      const int64_t m = imin(8, n - j);
      real_rows(ks, j0 + j, sc.kaddr + j, m, Dk, false, sc.kf, rows);
      for (int64_t t = m; t < 8; ++t) rows[t] = sc.zero;
      for (int64_t d = 0; d < Dkp; d += 8) transpose8x8(rows, d, kt + d * kTileK + j, kTileK);
    }
    zero_kt_tail(n, Dkp, kt);
  }
  for (int64_t d = dk; d < Dkp; ++d)
    for (int64_t j = 0; j < kTileK; ++j) kt[d * kTileK + j] = 0.f;
}

// Keys [j0, j0 + n) packed by pack(j0, n, dst): the kv head's shared packed tile (packing it if no
// item has yet), or a private one in scratch. (pack_k here; bf16 pairs in the avx512bf16 kernels.)
// pack returns a flag (0 or 1) that stays with the tile (in its ready state: 2 + flag) and is
// returned in *flag.
template <class Pack>
static const Real* shared_tile(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                                const Scratch& sc, Pack&& pack, int* flag) {
  if (ks.kt != nullptr && j0 % kTileK == 0) {
    Real* shared = static_cast<Real*>(ks.kt) + j0 / kTileK * round_up(Dk, kPad) * kTileK;
    int* ready = ks.kt_ready + j0 / kTileK;
    int state = __atomic_load_n(ready, __ATOMIC_ACQUIRE);
    if (state >= 2) {
      *flag = state - 2;
      return shared;
    }
    if (state == 0 &&
        __atomic_compare_exchange_n(ready, &state, 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      // the whole tile, whatever part of it this item needs: later items may need the rest
      *flag = pack(j0, imin(kTileK, ks.kt_keys - j0), shared);
      __atomic_store_n(ready, 2 + *flag, __ATOMIC_RELEASE);
      return shared;
    }
  }
  *flag = pack(j0, n, sc.kt);
  return sc.kt;
}

// K^T of keys [j0, j0 + n) (pack_k's layout), shared by the kv head's items where it can be.
static const Real* packed_tile(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                               const Scratch& sc) {
  int unused;
  return shared_tile(
      ks, j0, n, Dk, sc,
      [&](int64_t jj, int64_t nn, Real* dst) {
        pack_k(ks, jj, nn, Dk, sc, dst);
        return 0;
      },
      &unused);
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
    if (rs.lo[i] > j0 || rs.hi[i] < j0 + n || (rs.slope != nullptr && rs.slope[i] != 0.f)) return false;
  return true;
}

// Whether the packed QK^T of keys [j0, j0 + n) can do the online-softmax update itself
// (qk_packed with Online): every row sees every key, no soft-cap or ALiBi (the mask is the
// caller's test), every row has a finite running max (not its first visible tile: the update
// is skipped while it has seen nothing, see row_state.h) and the tile is whole register blocks
// (zero keys past n would score 0).
static bool fusable(const RowSet& rs, int64_t j0, int64_t n, Real softcap, const FlashState& st) {
  if (softcap > 0.f || n % (NR * W) != 0 || rs.qfactor != nullptr || !sees_whole(rs, 0, rs.M, j0, n))
    return false;
  for (int r = 0; r < rs.M; ++r)
    if (!(st.m[r] > kNegInf && st.m[r] < -kNegInf)) return false;
  return true;
}

// The online-softmax update of the M rows of scores s over keys [j0, j0 + n) (bias: the mask tile
// or null); s becomes the probabilities. Returns whether some row sees only part of the tile.
static bool softmax_rows(const RowSet& rs, int64_t j0, int64_t n, const Real* bias,
                         Real softcap, int64_t Dvp, Real* s, const FlashState& st) {
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

// ---- machine probes ---------------------------------------------------------------------------
// 10 independent accumulators hide the FMA latency (4 cycles x 2 ports needs >= 8 in flight).
[[maybe_unused]] static Real fma_probe(int64_t iters) {
  V a[10];
  for (int i = 0; i < 10; ++i) a[i] = set1(Real(i) * 1e-3f);
  const V x = set1(0.999999f), y = set1(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 10; ++i) a[i] = fmadd(a[i], x, y);
  V s = zero();
  for (int i = 0; i < 10; ++i) s = add(s, a[i]);
  return reduce_add(s);
}

[[maybe_unused]] static Real read_probe(const Real* p, int64_t n) {
  V s0 = zero(), s1 = zero(), s2 = zero(), s3 = zero();
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    s0 = add(s0, load(p + i));
    s1 = add(s1, load(p + i + W));
    s2 = add(s2, load(p + i + 2 * W));
    s3 = add(s3, load(p + i + 3 * W));
  }
  Real r = reduce_add(add(add(s0, s1), add(s2, s3)));
  for (; i < n; ++i) r += p[i];
  return r;
}

}  // namespace
