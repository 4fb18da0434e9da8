// delta-inl.h: gated delta-rule linear attention for one sequence and a group of value heads
// that read the same key head (q, k and the pair products k.k, q.k of a per-head gate are then
// computed once for the group; everything else is per value head), written once
// against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per instruction set (the
// unit isa_<isa>.cpp opens `namespace attnx::<isa>::delta`, apart from the flash stages' names;
// everything here has internal linkage).
//
// The recurrence (per head, state S of K x V floats, gate G_t the cumulative log-decay):
//   S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
// (q_t already multiplied by scale). Decode runs it token by token (recurrent_token). Prefill
// runs it a chunk of C tokens at a time (the WY / UT-transform form). Within a chunk, with G_t
// the gate summed from the chunk start through t and S0 the state before the chunk:
//   A_ts = sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])      (s < t)
//   P_ts = sum_c q_t[c] k_s[c] exp(G_t[c] - G_s[c])      (s <= t)
//   (I + diag(beta) A) U = diag(beta) (V - (exp(G) * K) S0)      lower triangular: forward
//   substitution O = (exp(G) * Q) S0 + P U S = diag(exp(G_last)) S0 + (exp(G_last - G) * K)^T U
// Every exp() argument is a difference G_t - G_s with s <= t (<= 0 for decaying gates), never an
// exp(-G_s) on its own, which overflows once a chunk's decays sum past -88. With one gate per
// channel, A and P need exp(G_t[c] - G_s[c]) for every pair: pairs inside one sub-chunk of
// kDeltaSub tokens take it directly; for the others the sub-chunk's last position e splits it as
// exp(G_t - G_e) exp(G_e - G_s), both factors <= 1, so those pairs become plain dot products.
// With one gate per head, exp(G_t - G_s) is one number per pair: A and P are the raw dot products
// times it, and exp(G) scales rows of K S0 and Q S0 instead of K and Q.
// Non-finite values reach only the positions from their own on, as in the recurrence: a gate
// that resets the state (exp(g) = 0, -inf included) starts a new segment of the chunk instead of
// entering a gate difference (see kResetGate), and no product multiplies a later position's
// values by a zero (the triangle of P U; see gemm_block).

// The including file provides <cmath>, <cstring>, tables.h and delta_kernels.h before opening
// the namespace: no header may be included from inside it.

namespace {

using namespace simd;
using kern::kDeltaChunk;
using kern::kDeltaSub;

constexpr int kC = kDeltaChunk;
// Register block of the chunk's products: kGemmMR rows x kGemmNR vectors of accumulators (24
// of AVX-512's 32 registers, 12 of AVX2's 16).
constexpr int kGemmNR = W == 16 ? 4 : 2;
constexpr int kGemmMR = W == 1 ? 4 : 6;
// Lines of the next chunk asked for after each register block of a product (see NextRows): a
// block is MR x NR vector FMAs per step of depth, so this keeps a few requests in flight.
constexpr int kPrefetchLines = 4 * kGemmNR;
constexpr float kL2Eps = 1e-6f;  // q / sqrt(sum q^2 + eps), as flash-linear-attention's l2norm

static inline int64_t dmin(int64_t a, int64_t b) { return a < b ? a : b; }

// ---- rows in and out ------------------------------------------------------------------------
// (Out: load-inl.h's store_row, which every unit that runs the delta rule has with Real = float.)
// n elements of src (dtype) to fp32 at dst, zero-padded to np.
static inline void row_to_f32(const char* src, DType dt, int64_t n, int64_t np, float* dst) {
  int64_t i = 0;
  if (dt == DType::f32) {
    std::memcpy(dst, src, size_t(n) * sizeof(float));
    i = n;
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
    if (dt == DType::f16) {
      for (; i + W <= n; i += W) store(dst + i, load_f16(h + i));
      for (; i < n; ++i) dst[i] = cvt::f16_to_f32(h[i]);
    } else {
      for (; i + W <= n; i += W) store(dst + i, load_bf16(h + i));
      for (; i < n; ++i) dst[i] = cvt::bf16_to_f32(h[i]);
    }
  }
  for (; i < np; ++i) dst[i] = 0.f;
}

// x (np floats, a multiple of W) scaled by `scale`, after an l2 normalisation if asked.
static inline void scale_row(float* x, int64_t np, bool l2norm, float scale) {
  if (l2norm) {
    V acc = zero();
    for (int64_t c = 0; c < np; c += W) acc = fmadd(load(x + c), load(x + c), acc);
    scale /= std::sqrt(reduce_add(acc) + kL2Eps);
  }
  if (scale == 1.f) return;
  const V s = set1(scale);
  for (int64_t c = 0; c < np; c += W) store(x + c, mul(load(x + c), s));
}

// dst[c] = src[c] * exp(a[c] - b[c]) over np floats (b may be null: exp(a[c]))
static inline void gated_row(const float* src, const float* a, const float* b, int64_t np,
                             float* dst) {
  for (int64_t c = 0; c < np; c += W) {
    const V e = b ? exp(sub(load(a + c), load(b + c))) : exp(load(a + c));
    store(dst + c, mul(load(src + c), e));
  }
}

// The next chunk's q, k and v rows, asked for a few lines at a time while this chunk computes:
// the rows of one head are strided (the other heads lie between them), the inputs are usually
// cold, and the hardware prefetcher cannot follow three interleaved strides. Asked for all at
// once (1,500 lines for 64 tokens of K = V = 128), most requests are dropped; a few lines at a
// time spread over the work keep up (bench/NOTES.md). gemm_panel asks for a few lines after each
// register block.
struct NextRows {
  static constexpr int kMax = 2 + kern::kDeltaGroupMax;  // q, k and each value head's v
  const char* base[kMax] = {};
  int64_t stride[kMax] = {}, bytes[kMax] = {};
  int64_t rows = 0, r = 0, off = 0;
  int arrays = 0, a = 0;

  void issue(int lines) {
    for (; lines > 0 && r < rows; --lines) {
      __builtin_prefetch(base[a] + r * stride[a] + off, 0, 1);
      off += 64;
      if (off < bytes[a]) continue;
      off = 0;
      if (++a == arrays) a = 0, ++r;
    }
  }

  void add(const char* p, int64_t t0, int64_t st, int64_t nbytes) {
    base[arrays] = p + t0 * st;
    stride[arrays] = st;
    bytes[arrays++] = nbytes;
  }
};

// Rows [t0, t0 + n) of the group's q, k and v (all heads of a group share q and k).
static NextRows next_rows(const kern::DeltaHead* hs, int G, int64_t t0, int64_t n) {
  const kern::DeltaHead& h = hs[0];
  const int64_t es = h.dtype == DType::f32 ? 4 : 2;  // (dtype_size is inline: see kernels/tables.h)
  NextRows pf;
  pf.add(h.q, t0, h.q_st, h.K * es);
  pf.add(h.k, t0, h.k_st, h.K * es);
  for (int g = 0; g < G; ++g) pf.add(hs[g].v, t0, hs[g].v_st, h.V * es);
  pf.rows = n > 0 ? n : 0;
  return pf;
}

// ---- dense products ---------------------------------------------------------------------------
// out[r] = x . y[r] for r < 8 (rows of np floats): 8 accumulators reduced together.
static ATTNX_INLINE void dots8(const float* x, const float* const* y, int64_t np, float* out) {
  V acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = zero();
  for (int64_t c = 0; c < np; c += W) {
    const V xv = load(x + c);
    for (int r = 0; r < 8; ++r) acc[r] = fmadd(xv, load(y[r] + c), acc[r]);
  }
  hsum8(acc, out);
}

// out[s] = x . Y[s] for s < ns (Y rows of np floats, ld ldy); `zero` is a row of np zeros that
// stands in for the missing rows of the last group of 8.
static void row_dots(const float* x, const float* Y, int64_t ldy, int64_t ns, int64_t np,
                     const float* zero_row, float* out) {
  for (int64_t s0 = 0; s0 < ns; s0 += 8) {
    const float* y[8];
    float res[8];
    for (int r = 0; r < 8; ++r) y[r] = s0 + r < ns ? Y + (s0 + r) * ldy : zero_row;
    dots8(x, y, np, res);
    for (int r = 0; r < 8 && s0 + r < ns; ++r) out[s0 + r] = res[r];
  }
}

// Where a product's C starts: diag(scale) in (in with C's row stride; scale null: 1), or zero
// (in null). Folding a row scaling into the block's first load saves a pass over C.
struct CStart {
  const float* in = nullptr;
  const float* scale = nullptr;
};

static inline CStart shifted(CStart s, int64_t rows, int64_t cols, int64_t ld) {
  if (s.in) s.in += rows * ld + cols;
  if (s.scale) s.scale += rows;
  return s;
}

// C[0:MR, 0:NR*W] = start + A(0:MR, 0:depth) B(0:depth, 0:NR*W), with A(i, p) = a[i*ai + p*ap]:
// the register block of `gemm` (MR x NR vectors of accumulators; B rows streamed, A broadcast).
// Tri: A also has an MR x MR lower triangle at depth [depth, depth + MR) (the diagonal block of
// a lower triangular A): row r takes columns depth..depth + r only. The zeros above the diagonal
// are skipped, not multiplied: 0 times a NaN or inf row of B is NaN, which would carry a
// non-finite value of a later position back to earlier rows.
template <int MR, int NR, bool Tri>
static ATTNX_INLINE void gemm_block(const float* a, int64_t ai, int64_t ap, int64_t depth,
                                    const float* b, int64_t ldb, float* c, int64_t ldc, CStart st) {
  V x[MR][NR];
  for (int r = 0; r < MR; ++r) {
    const V sc = set1(st.scale ? st.scale[r] : 1.f);
    for (int v = 0; v < NR; ++v) {
      if (!st.in)
        x[r][v] = zero();
      else if (st.scale)
        x[r][v] = mul(sc, load(st.in + r * ldc + v * W));
      else
        x[r][v] = load(st.in + r * ldc + v * W);
    }
  }
  for (int64_t p = 0; p < depth; ++p) {
    V bv[NR];
    for (int v = 0; v < NR; ++v) bv[v] = load(b + p * ldb + v * W);
    for (int r = 0; r < MR; ++r) {
      const V av = set1(a[r * ai + p * ap]);
      for (int v = 0; v < NR; ++v) x[r][v] = fmadd(av, bv[v], x[r][v]);
    }
  }
  if constexpr (Tri)
    for (int d = 0; d < MR; ++d) {
      const int64_t p = depth + d;
      V bv[NR];
      for (int v = 0; v < NR; ++v) bv[v] = load(b + p * ldb + v * W);
      for (int r = d; r < MR; ++r) {
        const V av = set1(a[r * ai + p * ap]);
        for (int v = 0; v < NR; ++v) x[r][v] = fmadd(av, bv[v], x[r][v]);
      }
    }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NR; ++v) store(c + r * ldc + v * W, x[r][v]);
}

// One panel of NR vectors of columns: full blocks of kGemmMR rows, then the remaining rows as one
// smaller block. Lower: A is m x m (depth == m) and lower triangular, so a block starting at row
// i takes depth i in full and its own diagonal block as a triangle.
template <int NR, bool Lower>
static void gemm_panel(int64_t m, int64_t depth, const float* a, int64_t ai, int64_t ap,
                       const float* b, int64_t ldb, float* c, int64_t ldc, CStart st,
                       NextRows* pf) {
  int64_t i = 0;
  for (; i + kGemmMR <= m; i += kGemmMR) {
    gemm_block<kGemmMR, NR, Lower>(a + i * ai, ai, ap, Lower ? i : depth, b, ldb, c + i * ldc, ldc,
                                   shifted(st, i, 0, ldc));
    if (pf) pf->issue(kPrefetchLines);
  }
  const int64_t d = Lower ? i : depth;
  a += i * ai;
  c += i * ldc;
  st = shifted(st, i, 0, ldc);
  switch (m - i) {  // fewer than kGemmMR rows left (kGemmMR <= 8)
    case 7: gemm_block<7, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    case 6: gemm_block<6, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    case 5: gemm_block<5, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    case 4: gemm_block<4, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    case 3: gemm_block<3, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    case 2: gemm_block<2, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    case 1: gemm_block<1, NR, Lower>(a, ai, ap, d, b, ldb, c, ldc, st); break;
    default: break;
  }
}

// C (m x nc) = start + A (m x depth) B (depth x nc), nc a multiple of 2W. Column panels outermost:
// one panel of B (depth x NR vectors) stays in L1 across the row blocks. Wide panels where the
// registers allow (32 on AVX-512): one broadcast of A then feeds 4 FMAs instead of 2, and on
// CPUs that split 512-bit operations in two (Zen 4) the broadcasts are what limits the block.
// `lower`: A is square and lower triangular (only entries on and below the diagonal are read).
// `pf`, if given, is asked for a few lines of the next chunk after each register block.
static void gemm(int64_t m, int64_t nc, int64_t depth, const float* a, int64_t ai, int64_t ap,
                 const float* b, int64_t ldb, float* c, int64_t ldc, CStart st, bool lower,
                 NextRows* pf = nullptr) {
  int64_t j = 0;
  for (; j + kGemmNR * W <= nc; j += kGemmNR * W) {
    const CStart sj = shifted(st, 0, j, ldc);
    if (lower)
      gemm_panel<kGemmNR, true>(m, depth, a, ai, ap, b + j, ldb, c + j, ldc, sj, pf);
    else
      gemm_panel<kGemmNR, false>(m, depth, a, ai, ap, b + j, ldb, c + j, ldc, sj, pf);
  }
  for (; j < nc; j += 2 * W) {
    const CStart sj = shifted(st, 0, j, ldc);
    if (lower)
      gemm_panel<2, true>(m, depth, a, ai, ap, b + j, ldb, c + j, ldc, sj, pf);
    else
      gemm_panel<2, false>(m, depth, a, ai, ap, b + j, ldb, c + j, ldc, sj, pf);
  }
}

// y += a * x over np floats
static inline void axpy(float a, const float* x, float* y, int64_t np) {
  const V av = set1(a);
  for (int64_t c = 0; c < np; c += W) store(y + c, fmadd(av, load(x + c), load(y + c)));
}

// ---- the chunk's working set --------------------------------------------------------------
// One value head's view. q, k, zero, kk and qk are shared by the heads of a group (they read
// the same key head): kk and qk hold the raw k_t . k_s and q_t . k_s of a per-head gate.
struct Chunk {
  float *q, *k, *G, *kqg, *kd, *lk, *lq, *r, *dec, *zero;  // rows of Kp
  float *v, *x, *u, *o;                                    // rows of Vp
  float *a, *p, *kk, *qk;                                  // C x C
  float *gs, *beta, *eg;                                   // C
  int head = 0;                                            // the value head's place in its group
};

// The group's scratch in the order of kern::delta_work_floats: the shared part, then each head's.
static void carve(float* w, int64_t Kp, int64_t Vp, int G, Chunk* cs) {
  auto take = [&w](int64_t n) {
    float* p = w;
    w += n;
    return p;
  };
  Chunk s;
  s.q = take(kC * Kp);
  s.k = take(kC * Kp);
  s.zero = take(Kp);
  s.kk = take(kC * kC);
  s.qk = take(kC * kC);
  for (int g = 0; g < G; ++g) {
    Chunk& c = cs[g];
    c.head = g;
    c.q = s.q;
    c.k = s.k;
    c.zero = s.zero;
    c.kk = s.kk;
    c.qk = s.qk;
    c.G = take(kC * Kp);
    c.kqg = take(2 * kC * Kp);
    c.kd = take(kC * Kp);
    c.lk = take(kC * Kp);
    c.lq = take(kC * Kp);
    c.r = take(kDeltaSub * Kp);
    c.dec = take(Kp);
    c.v = take(kC * Vp);
    c.x = take(2 * kC * Vp);
    c.u = take(kC * Vp);
    c.o = take(Vp);
    c.a = take(kC * kC);
    c.p = take(kC * kC);
    c.gs = take(kC);
    c.beta = take(kC);
    c.eg = take(kC);
  }
}

// Positions [t0, t0 + n) of q (scaled, normalised if asked) and k in fp32: once per group.
static void load_qk(const kern::DeltaHead& h, int64_t t0, int64_t n, const Chunk& c) {
  const int64_t Kp = h.Kp;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i;
    float* q = c.q + i * Kp;
    float* k = c.k + i * Kp;
    row_to_f32(h.q + t * h.q_st, h.dtype, h.K, Kp, q);
    row_to_f32(h.k + t * h.k_st, h.dtype, h.K, Kp, k);
    scale_row(q, Kp, h.l2norm, h.scale);
    scale_row(k, Kp, h.l2norm, 1.f);
  }
}

// A gate whose decay exp(g) is 0 in float32 (g below about -103.97; -inf included) multiplies
// the state, or its row, by 0: a reset. The chunked form cannot take it as a gate difference
// (-inf - -inf is NaN, and a huge finite g swallows the gates summed after it), so a chunk is
// split there (run_segments). NaN is no reset: it is a gate like any other and reaches the
// positions from its own on, as in the recurrence.
constexpr float kResetGate = -104.f;
static inline bool resets(float g) { return g < kResetGate; }

// The gates of position t reset the state (any channel's, for per-channel gates).
static inline bool any_reset(const kern::DeltaHead& h, int64_t t) {
  const float* g = h.g + t * h.g_st;
  bool r = false;
  for (int64_t ch = 0; ch < (h.g_per_channel ? h.K : 1); ++ch) r = r || resets(g[ch]);
  return r;
}

// The same positions of one value head, as far as the segment goes: v, beta, and the gates summed
// from t0 through each position: G (a row per position) for per-channel gates, gs for per-head
// ones. The segment stops before the first position after t0 whose gates reset the state; a
// reset at t0 itself the caller has applied (reset_rows), so its gate counts as 0 here (the
// rows it zeroed stay zero whatever they are scaled by). Returns the segment's length.
static int64_t load_head(const kern::DeltaHead& h, int64_t t0, int64_t n, const Chunk& c) {
  const int64_t Kp = h.Kp;
  int64_t i = 0;
  for (; i < n; ++i) {
    const int64_t t = t0 + i;
    const float* g = h.g + t * h.g_st;
    if (i > 0 && any_reset(h, t)) break;
    row_to_f32(h.v + t * h.v_st, h.dtype, h.V, h.Vp, c.v + i * h.Vp);
    c.beta[i] = h.beta[t * h.beta_st];
    if (!h.g_per_channel) {
      c.gs[i] = (i ? c.gs[i - 1] : 0.f) + (resets(g[0]) ? 0.f : g[0]);
      continue;
    }
    float* G = c.G + i * Kp;
    const float* prev = i ? G - Kp : nullptr;
    for (int64_t ch = 0; ch < h.K; ++ch)
      G[ch] = (prev ? prev[ch] : 0.f) + (resets(g[ch]) ? 0.f : g[ch]);
    for (int64_t ch = h.K; ch < Kp; ++ch) G[ch] = 0.f;
  }
  for (int64_t j = i; j < kC; ++j) c.gs[j] = 0.f;
  return i;
}

// The state before position t (at src) with the rows whose gate at t resets multiplied by 0, as
// exp(g) S does (a NaN or inf there becomes NaN, as in the recurrence), into h.S. Returns where
// the state now is: h.S, or src untouched if nothing at t resets.
static const float* reset_rows(const kern::DeltaHead& h, const float* src, int64_t t) {
  if (!any_reset(h, t)) return src;
  const float* g = h.g + t * h.g_st;
  for (int64_t ch = 0; ch < h.K; ++ch) {
    const float f = resets(g[h.g_per_channel ? ch : 0]) ? 0.f : 1.f;
    const float* s = src + ch * h.lds;
    float* d = h.S + ch * h.lds;
    if (f == 1.f && s == d) continue;
    const V fv = set1(f);
    for (int64_t j = 0; j < h.Vp; j += W) store(d + j, mul(fv, load(s + j)));
  }
  return h.S;
}

// x0 . y[r] and x1 . y[r] for r < kPairCols (rows of np floats) at once: each row of y loaded
// feeds two FMAs, where one x against 8 rows is load bound (9 loads for 8 FMAs).
constexpr int kPairCols = W == 16 ? 8 : 4;  // 2 x kPairCols accumulators: 16 of AVX-512's 32
                                            // registers, 8 of AVX2's 16
static ATTNX_INLINE void dots_x2(const float* x0, const float* x1, const float* const* y,
                                 int64_t np, float* out0, float* out1) {
  V acc[2 * kPairCols];
  for (int r = 0; r < 2 * kPairCols; ++r) acc[r] = zero();
  for (int64_t c = 0; c < np; c += W) {
    const V a = load(x0 + c), b = load(x1 + c);
    for (int r = 0; r < kPairCols; ++r) {
      const V yv = load(y[r] + c);
      acc[r] = fmadd(a, yv, acc[r]);
      acc[kPairCols + r] = fmadd(b, yv, acc[kPairCols + r]);
    }
  }
  float res[2 * kPairCols];
  for (int g = 0; g < 2 * kPairCols; g += 8) hsum8(acc + g, res + g);
  for (int r = 0; r < kPairCols; ++r) out0[r] = res[r], out1[r] = res[kPairCols + r];
}

// k_t . k_s and q_t . k_s (s <= t) into kk and qk, once per group: both in one pass over the
// k_s.
static void pair_dots(int64_t n, int64_t Kp, const Chunk& c) {
  alignas(64) float ka[kC + kPairCols], qa[kC + kPairCols];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t s0 = 0; s0 <= t; s0 += kPairCols) {
      const float* y[kPairCols];
      for (int r = 0; r < kPairCols; ++r) y[r] = s0 + r <= t ? c.k + (s0 + r) * Kp : c.zero;
      dots_x2(c.k + t * Kp, c.q + t * Kp, y, Kp, ka + s0, qa + s0);
    }
    for (int64_t s = 0; s <= t; ++s) c.kk[t * kC + s] = ka[s], c.qk[t * kC + s] = qa[s];
  }
}

// A (scaled by -beta_t, so that forward substitution only adds) and P for a per-head gate: the
// group's dot products times this head's exp(G_t - G_s), W of those exps at a time (gs is zero
// past n).
static void pair_matrices_head(int64_t n, const Chunk& c) {
  alignas(64) float e[kC + W];
  for (int64_t t = 0; t < n; ++t) {
    const V gt = set1(c.gs[t]);
    for (int64_t s = 0; s <= t; s += W) store(e + s, exp(sub(gt, load(c.gs + s))));
    const float nb = -c.beta[t];
    const float *kk = c.kk + t * kC, *qk = c.qk + t * kC;
    for (int64_t s = 0; s < t; ++s) c.a[t * kC + s] = nb * kk[s] * e[s];
    for (int64_t s = 0; s <= t; ++s) c.p[t * kC + s] = qk[s] * e[s];
  }
}

// The same for per-channel gates (see the head of this file): pairs inside a sub-chunk directly,
// the others through the sub-chunk's last position e.
static void pair_matrices_channel(int64_t n, int64_t Kp, const Chunk& c) {
  for (int64_t j0 = 0; j0 < n; j0 += kDeltaSub) {
    const int64_t j1 = dmin(j0 + kDeltaSub, n);
    for (int64_t t = j0; t < j1; ++t) {  // same sub-chunk: s in [j0, t]
      const float *kt = c.k + t * Kp, *qt = c.q + t * Kp, *Gt = c.G + t * Kp;
      for (int64_t s = j0; s <= t; ++s) {
        const float *ks = c.k + s * Kp, *Gs = c.G + s * Kp;
        V aa = zero(), pp = zero();
        for (int64_t ch = 0; ch < Kp; ch += W) {
          const V ke = mul(load(ks + ch), exp(sub(load(Gt + ch), load(Gs + ch))));
          aa = fmadd(load(kt + ch), ke, aa);
          pp = fmadd(load(qt + ch), ke, pp);
        }
        if (s < t) c.a[t * kC + s] = -c.beta[t] * reduce_add(aa);
        c.p[t * kC + s] = reduce_add(pp);
      }
    }
    if (j1 == n) break;
    const int64_t e = j1 - 1;  // later rows t > e against this sub-chunk's columns s <= e
    const float* Ge = c.G + e * Kp;
    for (int64_t s = j0; s < j1; ++s)
      gated_row(c.k + s * Kp, Ge, c.G + s * Kp, Kp, c.r + (s - j0) * Kp);
    float row[kDeltaSub];
    for (int64_t t = j1; t < n; ++t) {
      gated_row(c.k + t * Kp, c.G + t * Kp, Ge, Kp, c.lk);
      gated_row(c.q + t * Kp, c.G + t * Kp, Ge, Kp, c.lq);
      row_dots(c.lk, c.r, Kp, j1 - j0, Kp, c.zero, row);
      for (int64_t s = j0; s < j1; ++s) c.a[t * kC + s] = -c.beta[t] * row[s - j0];
      row_dots(c.lq, c.r, Kp, j1 - j0, Kp, c.zero, row);
      for (int64_t s = j0; s < j1; ++s) c.p[t * kC + s] = row[s - j0];
    }
  }
}

// U <- (I + diag(beta) A)^-1 U, A strictly lower (stored as -beta_t A_ts): blocks of kGemmMR
// rows take the rows above them as one product, then resolve among themselves.
static void forward_substitute(int64_t n, int64_t Vp, const Chunk& c) {
  for (int64_t i0 = 0; i0 < n; i0 += kGemmMR) {
    const int64_t i1 = dmin(i0 + kGemmMR, n);
    float* ui = c.u + i0 * Vp;
    if (i0 > 0) gemm(i1 - i0, Vp, i0, c.a + i0 * kC, kC, 1, c.u, Vp, ui, Vp, {ui}, false);
    for (int64_t t = i0 + 1; t < i1; ++t)
      for (int64_t s = i0; s < t; ++s) axpy(c.a[t * kC + s], c.u + s * Vp, c.u + t * Vp, Vp);
  }
}

// The gates against S0 and into the new state: exp(G_last - G) K (kd), exp(G_last) (dec, the
// decay of S0 over the chunk, a row scale of the new state's product) and, against S0, exp(G):
// per channel it scales K and Q (kqg, eg = 1); per head it is one number per row (eg), which
// scales rows of K S0 and Q S0 instead, so K and Q go into the product as they are.
static void gate_rows(const kern::DeltaHead& h, int64_t n, const Chunk& c) {
  const int64_t Kp = h.Kp;
  const float* Gl = c.G + (n - 1) * Kp;
  if (!h.g_per_channel)
    for (int64_t ch = 0; ch < Kp; ++ch) c.dec[ch] = std::exp(c.gs[n - 1]);
  for (int64_t i = 0; i < n; ++i) {
    const float *k = c.k + i * Kp, *q = c.q + i * Kp;
    float *kg = c.kqg + i * Kp, *qg = c.kqg + (kC + i) * Kp, *kd = c.kd + i * Kp;
    if (h.g_per_channel) {
      const float* Gi = c.G + i * Kp;
      gated_row(k, Gi, nullptr, Kp, kg);
      gated_row(q, Gi, nullptr, Kp, qg);
      gated_row(k, Gl, Gi, Kp, kd);
      c.eg[i] = 1.f;
      continue;
    }
    c.eg[i] = std::exp(c.gs[i]);
    const V ed = set1(std::exp(c.gs[n - 1] - c.gs[i]));
    for (int64_t ch = 0; ch < Kp; ch += W) store(kd + ch, mul(load(k + ch), ed));
  }
  if (h.g_per_channel)
    for (int64_t ch = 0; ch < Kp; ch += W) store(c.dec + ch, exp(load(Gl + ch)));
}

// The products against the state: on AMX tiles for bf16 inputs where the unit has them
// (isa_amx.cpp defines ATTNX_DELTA_TILES and includes delta_amx-inl.h first), else vector
// products. X = [K; Q] S0: rows 0..n-1 of c.x the keys', kC.. the queries'. `packed`: src is the
// state the previous chunk's products_state wrote (the tiles kept its bf16 pairs).
static void products_x(const kern::DeltaHead& h, int64_t n, const float* kx, const float* qx,
                       const float* src, const Chunk& c, bool packed, NextRows& next) {
#if defined(ATTNX_DELTA_TILES)
  if (h.dtype == DType::bf16) {
    x_tiles(h, c.head, packed, n, kx, qx, src, c.x, [&next] { next.issue(kPrefetchLines); });
    return;
  }
#endif
  (void)packed;
  gemm(n, h.Vp, h.K, kx, h.Kp, 1, src, h.lds, c.x, h.Vp, {}, false, &next);
  gemm(n, h.Vp, h.K, qx, h.Kp, 1, src, h.lds, c.x + kC * h.Vp, h.Vp, {}, false, &next);
}

// S = diag(exp(G_last)) S0 + (exp(G_last - G) K)^T U, into h.S.
static void products_state(const kern::DeltaHead& h, int64_t n, const float* src, const Chunk& c,
                           NextRows& next) {
#if defined(ATTNX_DELTA_TILES)
  if (h.dtype == DType::bf16) {
    state_tiles(h, c.head, n, c.kd, c.u, src, c.dec, [&next] { next.issue(kPrefetchLines / 2); });
    return;
  }
#endif
  gemm(h.K, h.Vp, n, c.kd, 1, h.Kp, c.u, h.Vp, h.S, h.lds, {src, c.dec}, false, &next);
}

// One segment of up to n tokens from position t0 (it ends before the next reset; see
// load_head): outputs written, state advanced from src into h.S. q and k are loaded (and, for a
// per-head gate, their pair products taken) by the caller; `next` asks for the group's next rows.
// Returns the segment's length.
static int64_t run_segment(const kern::DeltaHead& h, const float* src, int64_t t0, int64_t n,
                           const Chunk& c, bool packed, NextRows& next) {
  const int64_t Kp = h.Kp, Vp = h.Vp;
  n = load_head(h, t0, n, c);
  gate_rows(h, n, c);
  // X = [K; Q] S0 (gated per channel: see gate_rows): rows 0..n-1 the keys', kC.. the queries'
  const float* kx = h.g_per_channel ? c.kqg : c.k;
  const float* qx = h.g_per_channel ? c.kqg + kC * Kp : c.q;
  products_x(h, n, kx, qx, src, c, packed, next);
  std::memset(c.a, 0, sizeof(float) * kC * kC);
  std::memset(c.p, 0, sizeof(float) * kC * kC);
  if (h.g_per_channel)
    pair_matrices_channel(n, Kp, c);
  else
    pair_matrices_head(n, c);
  for (int64_t i = 0; i < n; ++i) {  // U = diag(beta) (V - exp(G) K S0), then solved
    const V b = set1(c.beta[i]), e = set1(c.eg[i]);
    const float *vi = c.v + i * Vp, *xi = c.x + i * Vp;
    for (int64_t j = 0; j < Vp; j += W)
      store(c.u + i * Vp + j, mul(b, sub(load(vi + j), mul(e, load(xi + j)))));
  }
  forward_substitute(n, Vp, c);
  float* o = c.x + kC * Vp;  // O = exp(G) Q S0 + P U
  gemm(n, Vp, n, c.p, kC, 1, c.u, Vp, o, Vp, {o, c.eg}, true);
  for (int64_t i = 0; i < n; ++i) store_row(o + i * Vp, h.V, h.dtype, h.out + (t0 + i) * h.o_st);
  products_state(h, n, src, c, next);
  return n;
}

// One chunk of n tokens from position t0, as segments split where a gate resets the state (at
// most one segment without resets, the usual case): each reset applied to the state (reset_rows),
// then the segment from it run with q, k and their pair products from its first position.
static void run_chunk(const kern::DeltaHead& h, const float* src, int64_t t0, int64_t n,
                      const Chunk& c, NextRows& next) {
  for (int64_t a = 0; a < n;) {
    // the previous chunk's last segment wrote src (and its pairs), and no reset changes it here
    const bool packed = a == 0 && t0 > 0 && !any_reset(h, t0);
    src = reset_rows(h, src, t0 + a);
    Chunk seg = c;
    seg.q += a * h.Kp;
    seg.k += a * h.Kp;
    seg.kk += a * kC + a;
    seg.qk += a * kC + a;
    a += run_segment(h, src, t0 + a, n - a, seg, packed, next);
    src = h.S;
  }
}

// ---- the recurrence, one token at a time (decode) ----------------------------------------------
// Columns [j, j + NB*W) of the state for one token: they are independent of the other columns
// (u and o are per column), so each block streams the state's rows twice while its accumulators
// stay in registers: S^T (decayed) k first, then the update with o = S^T q on the way.
template <int NB>
static ATTNX_INLINE void recurrent_cols(const float* src, float* S, int64_t lds, int64_t K,
                                        const float* q, const float* k, const float* v,
                                        const float* dec, float beta, float* o) {
  V acc[NB], u[NB];
  for (int b = 0; b < NB; ++b) acc[b] = zero();
  for (int64_t ch = 0; ch < K; ++ch) {
    const V kd = set1(k[ch] * dec[ch]);
    for (int b = 0; b < NB; ++b) acc[b] = fmadd(kd, load(src + ch * lds + b * W), acc[b]);
  }
  const V bv = set1(beta);
  for (int b = 0; b < NB; ++b) {
    u[b] = mul(bv, sub(load(v + b * W), acc[b]));
    acc[b] = zero();
  }
  for (int64_t ch = 0; ch < K; ++ch) {
    const V d = set1(dec[ch]), kc = set1(k[ch]), qc = set1(q[ch]);
    for (int b = 0; b < NB; ++b) {
      const V sn = fmadd(kc, u[b], mul(d, load(src + ch * lds + b * W)));
      store(S + ch * lds + b * W, sn);
      acc[b] = fmadd(qc, sn, acc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) store(o + b * W, acc[b]);
}

static void recurrent_token(const kern::DeltaHead& h, const float* src, int64_t t, const Chunk& c) {
  const int64_t Kp = h.Kp, Vp = h.Vp;
  row_to_f32(h.q + t * h.q_st, h.dtype, h.K, Kp, c.q);
  row_to_f32(h.k + t * h.k_st, h.dtype, h.K, Kp, c.k);
  row_to_f32(h.v + t * h.v_st, h.dtype, h.V, Vp, c.v);
  scale_row(c.q, Kp, h.l2norm, h.scale);
  scale_row(c.k, Kp, h.l2norm, 1.f);
  const float* g = h.g + t * h.g_st;
  for (int64_t ch = 0; ch < h.K; ++ch) c.dec[ch] = std::exp(g[h.g_per_channel ? ch : 0]);
  const float beta = h.beta[t * h.beta_st];
  int64_t j = 0;
  for (; j + 4 * W <= Vp; j += 4 * W)
    recurrent_cols<4>(src + j, h.S + j, h.lds, h.K, c.q, c.k, c.v + j, c.dec, beta, c.o + j);
  for (; j < Vp; j += W)
    recurrent_cols<1>(src + j, h.S + j, h.lds, h.K, c.q, c.k, c.v + j, c.dec, beta, c.o + j);
  store_row(c.o, h.V, h.dtype, h.out + t * h.o_st);
}

// The whole sequence of G value heads that read the same q and k (T and the gate's kind are the
// same for all): chunk by chunk, q and k loaded (and paired, for per-head gates) once for all
// of them; or the token-by-token recurrence, head by head.
static void delta_heads(const kern::DeltaHead* hs, int G) {
  Chunk cs[kern::kDeltaGroupMax];
  const kern::DeltaHead& h0 = hs[0];
  carve(h0.work, h0.Kp, h0.Vp, G, cs);
  for (int64_t ch = 0; ch < h0.Kp; ++ch) cs[0].zero[ch] = 0.f;
  // The first token (or chunk) reads the state from S_in, every later one from S.
  if (!h0.chunked) {
    for (int g = 0; g < G; ++g)
      for (int64_t t = 0; t < h0.T; ++t) recurrent_token(hs[g], t ? hs[g].S : hs[g].S_in, t, cs[g]);
    return;
  }
  for (int64_t t0 = 0; t0 < h0.T; t0 += kC) {
    const int64_t n = dmin(kC, h0.T - t0);
    load_qk(h0, t0, n, cs[0]);
    if (!h0.g_per_channel) pair_dots(n, h0.Kp, cs[0]);
    NextRows next = next_rows(hs, G, t0 + n, dmin(kC, h0.T - t0 - n));
    for (int g = 0; g < G; ++g) run_chunk(hs[g], t0 ? hs[g].S : hs[g].S_in, t0, n, cs[g], next);
  }
}

}  // namespace
