// bf16_dot-inl.h: the prefill tile loop (many query rows) with bf16 dot products (each float lane
// adds two bf16 x bf16 products: AVX512_BF16's vdpbf16ps, FEAT_BF16's BFDOT), for bf16 q, k and v,
// and for float32 ones where the caller allows bf16 products (RowSet::bf16_products: they are
// rounded to bf16 as they are packed). Written against the dot vocabulary `dot` (simd/dot_*.h)
// besides `simd`; isa_avx512bf16.cpp, isa_amx.cpp and isa_neon_bf16.cpp include it after the
// flash stages, inside the same namespace: it reuses that file's masks, online-softmax update and
// shared packed tiles. Everything else (other dtypes, few rows: decode) runs tile-inl.h's
// fp32-widening `flash`.
//
// Numerics (the flash-attention rule; README "dtypes"):
//   S = scale * (q . k): the bf16 q and k as they are (q is taken back from the driver's scaled
//       fp32 copy: q * scale / scale rounds to the bf16 value exactly), each product exact in
//       fp32, the sums in fp32 (both instructions flush bf16 subnormals, |x| < 1.2e-38, to zero;
//       BFDOT rounds the pair's sum before adding it, vdpbf16ps adds one product at a time). This
//       is the fp32 path's S up to the order of the additions. float32 q, k, v are first rounded
//       to bf16 (round to nearest even; q from the scaled row times 1 / scale, which is q itself
//       but within a float32 ulp or two of a bf16 tie; beyond bf16's largest finite value, inf).
//   softcap, ALiBi, masks, max, exp, the row sums l and the rescaling of O: fp32, as in
//   softmax-inl.h,
//       but for the exps of the fused tiles where no lse is returned: 2.9e-6 (Bf16P below).
//   P V: P rounded to bf16 (round to nearest even) before the product, as FlashAttention and
//       torch's bf16 SDPA do; O accumulated in fp32. This rounding (2^-8 relative per p, at most)
//       is the only error the path adds to the fp32-widening kernels:
//       tests/kernels/test_bf16_dot.py holds its error against the float64 reference within a small
//       multiple of a same-precision implementation's (attnx.reference's bf16_products twin, and
//       torch's bf16 SDPA).

// The including file provides <cmath>, <cstring>, <limits>, <type_traits>, and `dot`.

namespace {

// Two bf16 values in 32 bits, the lower index in the low half: what dot::dot_pairs multiplies
// pairwise.
using Pair = int32_t;

// Calls f(std::integral_constant<int, R>{}, r) for the rows left from r, R of them (0 < R < MR).
template <int R, class Fn>
static ATTNX_INLINE void row_tail(int left, int r, Fn& f) {
  if constexpr (R > 0) {
    if (left == R)
      f(std::integral_constant<int, R>{}, r);
    else
      row_tail<R - 1>(left, r, f);
  }
}
// Calls f(std::integral_constant<int, MR>{}, r) for the blocks of MR rows starting at r, then
// for the 1 .. MR - 1 rows left (the bf16 register blocks below are 6 rows by 4 vectors: 24
// accumulators, of AVX-512's and NEON's 32 registers).
template <int MR, class Fn>
static ATTNX_INLINE void row_blocks(int M, Fn&& f) {
  int r = 0;
  for (; r + MR <= M; r += MR) f(std::integral_constant<int, MR>{}, r);
  row_tail<MR - 1>(M - r, r, f);
}

// ---- packing ----------------------------------------------------------------------------------
// A float32 row of Dk features rounded to bf16 pairs (round to nearest even), zero from Dk to
// Dkp: the loads read only the row's own elements.
static void round_row_bf16(const float* x, int64_t Dk, int64_t Dkp, Pair* dst) {
  for (int64_t d = 0; d < Dkp; d += 2 * W)
    dot::store_rounded(dst + d / 2, dot::load_upto(x + d, Dk - d),
                       dot::load_upto(x + d + W, Dk - d - W));
}

// The M query rows (fp32, multiplied by scale) back to bf16 pairs along the features:
// qb[r][d2] = (q[r][2 d2], q[r][2 d2 + 1]), Dkp / 2 pairs a row, zero past Dk.
static void pack_q_bf16(const kern::RowSet& rs, int64_t Dkp, float inv_scale, Pair* qb) {
  const V f = set1(inv_scale);
  for (int r = 0; r < rs.M; ++r) {
    const float* q = rs.q + r * rs.ldq;
    for (int64_t d = 0; d < Dkp; d += 2 * W)
      dot::store_rounded(qb + r * (Dkp / 2) + d / 2, mul(load(q + d), f), mul(load(q + d + W), f));
  }
}

// Keys [j0, j0 + n) as bf16 pairs along the features, kp[d2][j] = (k[j][2 d2], k[j][2 d2 + 1])
// (Dkp / 2 x kTileK pairs, zero past n and past Dk): one dot_pairs multiplies a query's pair by
// W keys' pairs. A pair is 32 bits, so this is pack_kt's transpose of the rows seen as pairs.
// bf16 rows are read in place where they hold whole 8 x 8 blocks of pairs, else copied
// zero-padded; float32 rows are rounded to bf16 into that copy.
static void pack_k_bf16(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                        const kern::Scratch& sc, float* kp) {
  const int64_t Dkp = round_up(Dk, kPad);
  const bool f32 = ks.dtype == DType::f32;
  const bool inplace = !f32 && Dk % (2 * 8) == 0;
  kv_rows(ks, j0, n, sc.kaddr);
  for (int64_t t = 0; t < n; ++t) {
    if (inplace) {
      sc.krow[t] = reinterpret_cast<const float*>(sc.kaddr[t]);
      continue;
    }
    char* dst = reinterpret_cast<char*>(sc.kf) + t * Dkp * 2;  // zero-padded bf16 row
    if (f32) {
      round_row_bf16(reinterpret_cast<const float*>(sc.kaddr[t]), Dk, Dkp,
                     reinterpret_cast<Pair*>(dst));
    } else {
      std::memcpy(dst, sc.kaddr[t], std::size_t(Dk) * 2);
      std::memset(dst + Dk * 2, 0, std::size_t(Dkp - Dk) * 2);
    }
    sc.krow[t] = reinterpret_cast<const float*>(dst);
  }
  for (int64_t t = n; t < kTileK; ++t) sc.krow[t] = sc.zero;
  const int64_t d2 = (inplace ? Dk : Dkp) / 2;
  pack_kt(sc.krow, n, d2, kp);  // zero past n to a multiple of NR * W keys
  for (int64_t d = 0; d < d2; ++d)
    std::memset(kp + d * kTileK + round_up(n, NR * W), 0,
                sizeof(float) * std::size_t(kTileK - round_up(n, NR * W)));
  std::memset(kp + d2 * kTileK, 0, sizeof(float) * std::size_t((Dkp / 2 - d2) * kTileK));
}

// W bf16 values of a bf16 row from element d (zeros from element Dv on). The loads read only the
// row's own elements.
static ATTNX_INLINE dot::H bf16_lanes(const char* row, int64_t d, int64_t Dv) {
  return dot::bf16_upto(reinterpret_cast<const uint16_t*>(row) + d, Dv - d);
}

// Values [j0, j0 + n) (row addresses addr; bf16, or float32 rows rounded to bf16) as bf16 pairs
// along the keys, vp[t][d] = (v[2 t][d], v[2 t + 1][d]) (Dvp pairs a row, zero past n and past
// Dv, and zero pair rows from (n + 1) / 2 to pad_rows): one dot_pairs multiplies a row's pair of
// probabilities by W features' pairs. Returns whether every value is finite (no bf16 with an
// all-ones exponent: a float32 beyond bf16's largest finite value counts as the inf it rounds to).
template <bool F32>
static bool pack_v_pairs(const char* const* addr, int64_t n, int64_t Dv, const float* zero,
                         Pair* vp, int64_t pad_rows = kTileK / 2) {
  const int64_t Dvp = round_up(Dv, kPad);
  dot::Bad bad = dot::no_bad();
  for (int64_t t = 0; t < (n + 1) / 2; ++t) {
    const char* a = addr[2 * t];
    const char* b = 2 * t + 1 < n ? addr[2 * t + 1] : reinterpret_cast<const char*>(zero);
    for (int64_t d = 0; d < Dvp; d += W) {
      if constexpr (F32) {
        bad |= dot::zip_rounded(vp + t * Dvp + d, reinterpret_cast<const float*>(a) + d,
                                reinterpret_cast<const float*>(b) + d, Dv - d);
      } else {
        const dot::H x = bf16_lanes(a, d, Dv), y = bf16_lanes(b, d, Dv);
        bad |= dot::nonfinite(x) | dot::nonfinite(y);
        dot::store_zipped(vp + t * Dvp + d, x, y);
      }
    }
  }
  // zero pair rows to the tile's end: AMX's tile products read whole blocks of 16 pairs
  for (int64_t t = (n + 1) / 2; t < pad_rows; ++t)
    std::memset(vp + t * Dvp, 0, sizeof(Pair) * std::size_t(Dvp));
  return dot::none(bad);
}
static bool pack_v_bf16(DType dt, const char* const* addr, int64_t n, int64_t Dv, const float* zero,
                        Pair* vp) {
  return dt == DType::f32 ? pack_v_pairs<true>(addr, n, Dv, zero, vp)
                          : pack_v_pairs<false>(addr, n, Dv, zero, vp);
}

// The P V of a tile that has a non-finite value which some row must not see (a key outside its
// range, or past this item's keys in a shared tile's last pair): each row adds only its keys, in
// float32 (softmax-inl.h pv_visible), from s (P, kTileK floats a row), over the values rounded to
// bf16 as the pairs hold them.
static void pv_visible_bf16(const kern::RowSet& rs, const kern::KVSource& vs, int64_t j0, int64_t n,
                            int64_t Dv, const float* bias, float* s, const kern::Scratch& sc,
                            const kern::FlashState& st) {
  const int64_t Dvp = round_up(Dv, kPad);
  kv_rows(vs, j0, n, sc.vaddr);
  const float* const* fv = real_rows(vs, j0, sc.vaddr, n, Dv, false, sc.vf, sc.vrow);
  if (vs.dtype == DType::f32)  // (the copies in sc.vf, rounded in place)
    for (int64_t i = 0; i < n * Dvp; i += W) store(sc.vf + i, dot::round_bf16(load(sc.vf + i)));
  pv_visible(rs, j0, bias, s, fv, n, Dvp, st.o, st.ldo);
}

// Keys [c, c + 2W) of a row (a, b: their p) as 16 pairs at [c / 2, c / 2 + 16): at or before
// the floats they came from.
static ATTNX_INLINE void store_pairs(float* row, int64_t c, V a, V b) {
  dot::store_rounded(reinterpret_cast<Pair*>(row + c / 2), a, b);
}

// The probabilities of M rows (s, kTileK floats a row) rounded to bf16, as n2 key pairs in place
// at the start of each row (a row's pair t is at int32 index t of the row). Fused tiles store
// them so from registers (Bf16P::store_row) and skip this pass.
static void pack_p_bf16(int M, float* s, int64_t n2) {
  for (int r = 0; r < M; ++r) {
    float* row = s + int64_t(r) * kTileK;
    for (int64_t c = 0; c < 2 * n2; c += 2 * W)
      store_pairs(row, c, load(row + c), load(row + c + W));
  }
}

// The fused tiles' p = exp(s - m) where the rows return no lse: P is rounded to bf16 (2^-8)
// before P V, so exp_bf16's 2.9e-6 costs nothing measurable, and it is two FMAs shorter than
// exp's (B1 H8 S2048 D64 prefill +2-3%). l then carries the same 2.9e-6: O / l keeps it, far
// below bf16's rounding, but lse = m + log l would lose its float32 accuracy, so rows that return
// an lse (RowSet::exact_l) keep the exact exp.
template <bool Short>
struct Bf16P {
  static ATTNX_INLINE V exp(V x) { return Short ? simd::exp_bf16(x) : simd::exp_small(x); }
  // P V's operand at once: the row's pairs where pack_p_bf16 would put them
  template <int NV>
  static ATTNX_INLINE void store_row(float* srow, const V (&e)[NV]) {
    static_assert(NV % 2 == 0, "whole pairs of vectors");
    for (int c = 0; c < NV; c += 2) store_pairs(srow, c * W, e[c], e[c + 1]);
  }
};

// ---- S = scale * Q K^T: MR rows x 4 vectors of keys per register block -------------------------
// kFuseBf16: the block is the whole tile (AVX-512's 16 lanes), so it can also do the rows'
// online-softmax update: p is stored as bf16 pairs at once, and a raise of a row's max after an
// earlier block's p were stored would have to rescale bf16 values (rounding them twice). With
// narrower vectors (NEON: 4 blocks a tile) the tile's S is stored and softmax_rows updates it.
constexpr int kKeyVecs = 4;
constexpr bool kFuseBf16 = kKeyVecs * W == kTileK;
// With `on` (a whole tile every row sees, after each row's first: softmax-inl.h's fusable
// rule; kFuseBf16 only), the rows' online-softmax update is done here too, and s receives the
// probabilities (PExp: Bf16P<false> where the rows return an lse, else Bf16P<true>).
template <int MR, class PExp>
static ATTNX_INLINE void qk_bf16_block(const Pair* qb, int64_t ldq, const Pair* kp, int64_t d2n,
                                       float scale, float* s, const Online* on) {
  constexpr int NC = kKeyVecs;
  V acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = zero();
  for (int64_t d = 0; d < d2n; ++d) {
    dot::PV k[NC];
    for (int c = 0; c < NC; ++c) k[c] = dot::load_pairs(kp + d * kTileK + c * W);
    for (int r = 0; r < MR; ++r) {
      const dot::PV qp = dot::bcast_pair(qb + r * ldq + d);
      for (int c = 0; c < NC; ++c) acc[r][c] = dot::dot_pairs(acc[r][c], k[c], qp);
    }
  }
  if (!kFuseBf16 || on == nullptr) {
    const V f = set1(scale);
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NC; ++c) store(s + r * kTileK + c * W, mul(acc[r][c], f));
    return;
  }
  V sum[MR];
  for (int r = 0; r < MR; ++r) sum[r] = zero();
  online_block<MR, NC, false, true, PExp>(acc, 0, s, *on, sum, scale);
  for (int r = 0; r < MR; ++r) on->l[r] += reduce_add(sum[r]);
}

// d2n: the pairs that hold features (ceil(Dk / 2)); the zero pairs past them are skipped.
template <class PExp>
static void qk_bf16(int M, const Pair* qb, int64_t ldq, const Pair* kp, int64_t d2n, float scale,
                    float* s, const Online* on) {
  row_blocks<6>(M, [&](auto mr, int r) {
    if constexpr (kFuseBf16) {
      const Online rows = on ? on->rows(r) : Online{};
      qk_bf16_block<decltype(mr)::value, PExp>(qb + r * ldq, ldq, kp, d2n, scale,
                                               s + int64_t(r) * kTileK, on ? &rows : nullptr);
    } else {
      for (int64_t j = 0; j < kTileK; j += kKeyVecs * W)
        qk_bf16_block<decltype(mr)::value, PExp>(qb + r * ldq, ldq, kp + j, d2n, scale,
                                                 s + int64_t(r) * kTileK + j, nullptr);
    }
  });
}

// ---- O += P V: MR rows x NB vectors of value features per register block ----------------------
template <int MR, int NB>
static ATTNX_INLINE void pv_bf16_block(const Pair* p, const Pair* vp, int64_t n2, int64_t Dvp,
                                       int64_t c, float* o, int64_t ldo) {
  V acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NB; ++k) acc[r][k] = load(o + r * ldo + c + k * W);
  for (int64_t t = 0; t < n2; ++t) {
    dot::PV v[NB];
    for (int k = 0; k < NB; ++k) v[k] = dot::load_pairs(vp + t * Dvp + c + k * W);
    for (int r = 0; r < MR; ++r) {
      const dot::PV pp = dot::bcast_pair(p + r * kTileK + t);
      for (int k = 0; k < NB; ++k) acc[r][k] = dot::dot_pairs(acc[r][k], v[k], pp);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int k = 0; k < NB; ++k) store(o + r * ldo + c + k * W, acc[r][k]);
}

// Dvp is a multiple of kPad = 2 vectors: blocks of 4 vectors, then one of 2.
static void pv_bf16(int M, const Pair* p, const Pair* vp, int64_t n2, int64_t Dvp, float* o,
                    int64_t ldo) {
  row_blocks<6>(M, [&](auto mr, int r) {
    constexpr int MR = decltype(mr)::value;
    const Pair* pr = p + int64_t(r) * kTileK;
    float* orow = o + r * ldo;
    int64_t c = 0;
    for (; c + 4 * W <= Dvp; c += 4 * W) pv_bf16_block<MR, 4>(pr, vp, n2, Dvp, c, orow, ldo);
    if (c < Dvp) pv_bf16_block<MR, 2>(pr, vp, n2, Dvp, c, orow, ldo);
  });
}

// ---- the tile loop ----------------------------------------------------------------------------
// Where the packed K and V pairs of a tile are (kp: pack_k_bf16's layout, vp: pack_v_bf16's), how
// many keys they hold (a shared tile holds all of its keys, whatever part an item needs) and
// whether all of those values are finite.
struct PackedKV {
  const Pair* kp;
  const Pair* vp;
  int64_t keys;
  bool finite;
};

// The tile's K pairs, shared by the kv head's items where the driver gave a buffer (kt). Its V
// pairs go with them where they fit (Dvp <= Dkp: the fp32-sized tile holds both), packed once
// per kv head as well; else each item packs V into its scratch (sc.vf).
static PackedKV packed_kv(const kern::KVSource& ks, const kern::KVSource& vs, int64_t j0, int64_t n,
                          int64_t Dk, int64_t Dv, const kern::Scratch& sc) {
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  const bool joint = Dvp <= Dkp;
  const int64_t v_at = Dkp / 2 * kTileK;  // floats: V pairs after the K pairs
  int bad = 0;
  const float* kp = shared_tile(
      ks, j0, n, Dk, sc,
      [&](int64_t jj, int64_t nn, float* dst) {
        pack_k_bf16(ks, jj, nn, Dk, sc, dst);
        if (!joint) return 0;
        kv_rows(vs, jj, nn, sc.vaddr);
        return pack_v_bf16(vs.dtype, sc.vaddr, nn, Dv, sc.zero, reinterpret_cast<Pair*>(dst + v_at))
                   ? 0
                   : 1;
      },
      &bad);
  const int64_t keys = kp == sc.kt ? n : imin(kTileK, ks.kt_keys - j0);
  PackedKV out{reinterpret_cast<const Pair*>(kp), reinterpret_cast<const Pair*>(kp + v_at), keys,
               bad == 0};
  if (!joint) {
    kv_rows(vs, j0, n, sc.vaddr);
    out.vp = reinterpret_cast<const Pair*>(sc.vf);
    out.keys = n;
    out.finite = pack_v_bf16(vs.dtype, sc.vaddr, n, Dv, sc.zero, reinterpret_cast<Pair*>(sc.vf));
  }
  return out;
}

// Accumulates keys [j0, j_end) of one tile (at most kTileK keys) into the state. qb: the rows'
// queries as bf16 pairs (pack_q_bf16), qscale the factor their dot products take.
static void flash_tile_bf16(const kern::RowSet& rs, const Pair* qb, float qscale,
                            const kern::KVSource& ks, const kern::KVSource& vs, int64_t j0,
                            int64_t j_end, int64_t Dk, int64_t Dv, float softcap,
                            const kern::Scratch& sc, const kern::FlashState& st) {
  const int64_t n = imin(kTileK, j_end - j0), n2 = (n + 1) / 2;
  const int64_t Dkp = round_up(Dk, kPad), Dvp = round_up(Dv, kPad);
  const float* bias = nullptr;
  if (!tile_open(rs, j0, n, sc, &bias)) return;
  const PackedKV kv = packed_kv(ks, vs, j0, n, Dk, Dv, sc);
  // (the block is the whole tile: keys past n would score 0, so only whole tiles fuse)
  const bool fused = kFuseBf16 && bias == nullptr && n == kTileK && fusable(rs, j0, n, softcap, st);
  const Online on{st.m, st.l, st.o, st.ldo, Dvp};
  const auto qk = rs.exact_l ? qk_bf16<Bf16P<false>> : qk_bf16<Bf16P<true>>;
  qk(rs.M, qb, Dkp / 2, kv.kp, (Dk + 1) / 2, qscale, sc.s, fused ? &on : nullptr);
  const bool partial = !fused && softmax_rows(rs, j0, n, bias, softcap, Dvp, sc.s, st);
  // A key a row cannot see has p = 0, and 0 * inf or 0 * NaN in its value would still reach the
  // row: as in flash_tile, such tiles take the fp32 path where each row adds only its keys. (Also
  // a shared tile with keys past this item's n: with n odd, the last pair holds key n.)
  if (!kv.finite && (partial || kv.keys > n)) {
    pv_visible_bf16(rs, vs, j0, n, Dv, bias, sc.s, sc, st);
    return;
  }
  if (!fused) pack_p_bf16(rs.M, sc.s, n2);  // (fused: qk_bf16 stored the pairs)
  pv_bf16(rs.M, reinterpret_cast<const Pair*>(sc.s), kv.vp, n2, Dvp, st.o, st.ldo);
}

// Whether an item takes the bf16 product path: many rows (the packed, prefill-shaped QK^T;
// every item of a kv head with a shared packed K decides alike, so they agree on its layout) and
// q, k and v all bf16, or all float32 where the call allows bf16 products (rs.bf16_products: one
// value for every item of a call). Not for Dk = 0, whose scores are all 0 (qk_tile).
static bool bf16_prefill(const kern::RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                         int64_t Dk) {
  const bool dtype = rs.q_dtype == DType::bf16 || (rs.q_dtype == DType::f32 && rs.bf16_products);
  return rs.M > kDotRows && Dk > 0 && dtype && ks.dtype == rs.q_dtype && vs.dtype == rs.q_dtype;
}

// The M query rows as bf16 pairs in qb (pack_q_bf16): q / scale, which is the bf16 query itself
// (a float32 one rounded: see the head of this file), unless the scale is 0 or its inverse
// overflows: then the scaled query itself is rounded to bf16. Returns the factor the pairs'
// products take (scale, or 1).
static float pack_query(const kern::RowSet& rs, int64_t Dkp, Pair* qb) {
  const float inv = 1.f / rs.scale;
  const bool back = rs.scale != 0.f && std::isfinite(rs.scale) && std::isfinite(inv);
  pack_q_bf16(rs, Dkp, back ? inv : 1.f, qb);
  return back ? rs.scale : 1.f;
}

// The table's `flash`: bf16 prefill items on bf16 dot products, the rest on the unit's own flash.
static void flash_bf16(const kern::RowSet& rs, const kern::KVSource& ks, const kern::KVSource& vs,
                       int64_t j_begin, int64_t j_end, int64_t Dk, int64_t Dv, float softcap,
                       const kern::Scratch& sc, const kern::FlashState& st) {
  if (!bf16_prefill(rs, ks, vs, Dk)) {
    flash(rs, ks, vs, j_begin, j_end, Dk, Dv, softcap, sc, st);  // (tile-inl.h's, this unit's)
    return;
  }
  Pair* qb = reinterpret_cast<Pair*>(sc.qb);
  const float qscale = pack_query(rs, round_up(Dk, kPad), qb);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileK)
    flash_tile_bf16(rs, qb, qscale, ks, vs, j0, imin(j0 + kTileK, j_end), Dk, Dv, softcap, sc, st);
}

}  // namespace
