// load-inl.h: the first flash stage: the vocabulary every later stage uses (types, constants),
// and the tile loaders: row addresses through the block table, conversion of stored dtypes
// (float16, bfloat16, quantised codes with their scales) to Real, K tiles packed transposed and
// shared by the items of a kv head, and the prefetch of later tiles.
// Written once against the vector vocabulary `simd` (simd/vec_*.h) and compiled once per
// instruction set: the including unit (isa_<isa>.cpp, f64.cpp) opens `namespace attnx::<isa>`,
// defines `simd` and includes the stages in order (load, softmax, qk, pv, tile, probes), after
// <cmath>, <cstring>, <limits>, <type_traits>, tables.h and attention/state.h: no header may be
// included from inside the namespace. Everything here stays in an anonymous namespace (internal
// linkage), so no symbol compiled with wide instructions can leak to another ISA (tables.h).

namespace {

using namespace simd;
using kern::kDotRows;
using kern::kPad;
using kern::kTileK;

// Real (simd's lane type) is what this body computes in: float for every ISA's float32, float16
// and bfloat16 path, double for the float64 kernels (f64.cpp). kNative is the dtype whose
// rows are already Real: read in place, copied with memcpy.
constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
constexpr DType kNative = sizeof(Real) == 8 ? DType::f64 : DType::f32;
using RowSet = kern::RowSetT<Real>;
using Scratch = kern::ScratchT<Real>;
using FlashState = kern::FlashStateT<Real>;
constexpr int NR = 2;  // vectors per register block along the wide axis (keys or value features)
// Key vectors per packed QK^T register block (qk-inl.h): with 32 registers, 4 rows x 4 vectors
// take 0.5 loads per FMA where 6 x 2 took 0.67 (the rows' broadcasts and the K vectors).
constexpr int QR = W >= 16 ? 4 : NR;

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Local twins of types.h's is_quantised and dtype_size: an inline function of a shared header,
// compiled here with wide-instruction flags, could be the copy the linker keeps for baseline code
// (see kernels/tables.h); these are static, inside this ISA's namespace.
static inline bool quantised(DType t) {
  return t == DType::i8 || t == DType::e4m3 || t == DType::e5m2;
}
// (float64 only reaches the float64 kernels: in the float ones its test folds away at compile
// time.)
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

// Keys [j, j + m) (m <= kTileKeys) of a source as the kTileKeys rows of a matrix tile
// (amx_decode-inl.h, int8_tiles-inl.h): where they lie, if all lie at one stride (a whole chunk
// inside one page), else copied to `stage` (`bytes` a row, zero rows past m).
constexpr int64_t kTileKeys = 16;
struct TileRows {
  const char* p;
  int64_t stride;
};
static inline TileRows tile_rows(const kern::KVSource& s, int64_t j, int64_t m, int64_t bytes,
                                 char* stage) {
  if (m == kTileKeys) {
    if (s.block_table == nullptr) return {s.base + j * s.row_stride, s.row_stride};
    const int64_t off = j % s.block_size;
    if (off + kTileKeys <= s.block_size)
      return {
          s.base + int64_t(s.block_table[j / s.block_size]) * s.block_stride + off * s.row_stride,
          s.row_stride};
  }
  const char* addr[kTileKeys];
  kv_rows(s, j, m, addr);
  for (int64_t t = 0; t < m; ++t) std::memcpy(stage + t * bytes, addr[t], std::size_t(bytes));
  std::memset(stage + m * bytes, 0, std::size_t((kTileKeys - m) * bytes));
  return {stage, bytes};
}

// The scale of slot `off` of `page` (each_run's arguments) in a quantised source's scale pages.
static inline const float* scale_at(const kern::KVSource& s, int64_t page, int64_t off) {
  return s.scale + (page < 0 ? 0 : page * s.scale_block_stride) + off * s.scale_row_stride;
}

// The scales of rows j0 .. j0+n-1 of a quantised source (1 without a scale pointer).
static inline void kv_scales(const kern::KVSource& s, int64_t j0, int64_t n, float* out) {
  if (s.scale == nullptr) {
    for (int64_t t = 0; t < n; ++t) out[t] = 1.f;
    return;
  }
  const int64_t rs = s.scale_row_stride;
  each_run(s, j0, n, [&](int64_t t, int64_t page, int64_t off, int64_t run) {
    const float* p = scale_at(s, page, off);
    for (int64_t k = 0; k < run; ++k) out[t + k] = p[k * rs];
  });
}

// n 1-byte codes times `scale` to fp32, in one pass: code * scale, one float32 product (what
// attnx.reference.dequantize_kv computes). fp8 goes through float16 lanes (vec_*.h load_fp8):
// e4m3fn's float16 view is its value / 256, so it is multiplied by 256 * scale (exact: a power
// of two), or by 256 and then by the scale where 256 * scale overflows.
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
  const bool apart = e4 && std::isinf(256.f * scale) && std::isfinite(scale);
  const float pre = apart ? 256.f : 1.f, mult = apart ? scale : e4 ? 256.f * scale : scale;
  const V f = set1(mult), fp = set1(pre);
  if (apart)
    for (; i + W <= n; i += W) store(dst + i, mul(mul(load_fp8(c + i, e4), fp), f));
  for (; i + W <= n; i += W) store(dst + i, mul(load_fp8(c + i, e4), f));
  for (; i < n; ++i)
    dst[i] = cvt::f16_to_f32(e4 ? cvt::e4m3_as_f16(c[i]) : cvt::e5m2_as_f16(c[i])) * pre * mult;
}

// Whether any of the n rows (`bytes` e4m3fn codes each) holds the NaN code (magnitude 0x7f):
// (c & 0x7f) + 1 reaches bit 7 only from 0x7f, or-ed over the whole tile 32 codes at a time (one
// vector where the ISA has them, with no reduction per row), a run of adjacent rows (a page's
// rows of one head) at a time.
static bool e4m3_nan_in(const char* const* rows, int64_t n, int64_t bytes) {
  uint8_t acc[32] = {}, tail = 0;
  for (int64_t j = 0; j < n;) {
    const uint8_t* c = reinterpret_cast<const uint8_t*>(rows[j]);
    int64_t len = bytes;
    while (++j < n && rows[j] == rows[j - 1] + bytes) len += bytes;
    const int64_t body = len / 32 * 32;
    for (int64_t i = 0; i < body; i += 32)
      for (int k = 0; k < 32; ++k) acc[k] |= uint8_t((c[i + k] & 0x7f) + 1);
    for (int64_t i = body; i < len; ++i) tail |= uint8_t((c[i] & 0x7f) + 1);
  }
  for (int k = 0; k < 32; ++k) tail |= acc[k];
  return (tail & 0x80) != 0;
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
    int64_t i = 0;
    for (; i + W <= n; i += W) store_f16(h + i, load(src + i));
    for (; i < n; ++i) h[i] = cvt::f32_to_f16(src[i]);
  } else {
    uint16_t* h = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) h[i] = cvt::f32_to_bf16(src[i]);
  }
}

// A query row for the driver (FlashKernels::load_query): D elements of src times `scale`, zero to
// Dp.
static void load_query(const void* src, DType dtype, int64_t D, Real scale, int64_t Dp, Real* dst) {
  const Real* from = static_cast<const Real*>(src);  // (the compute type's rows: no copy first)
  if (dtype != kNative) {
    load_row(src, dtype, D, dst);
    from = dst;
  }
  int64_t d = 0;
  const V s = set1(scale);
  for (; d + W <= D; d += W) store(dst + d, mul(load(from + d), s));
  for (; d < D; ++d) dst[d] = from[d] * scale;
  for (; d < Dp; ++d) dst[d] = Real(0);
}

// Converts row `src` (D elements) into `dst`, zero-padded to Dp.
static inline void load_row_padded(const char* src, DType dtype, int64_t D, int64_t Dp, Real* dst) {
  load_row(src, dtype, D, dst);
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
}

// Rows of a later tile to prefetch while the packed QK^T runs: the 64-byte lines of `n` rows of
// `bytes` each, spread evenly over the `calls` register-block calls of the product (call c takes
// lines [lines * c / calls, lines * (c + 1) / calls)), so the misses overlap with the FMAs instead
// of arriving in one burst. A call walks its share with a LineCursor, a few lines at a time, with
// no division per line (an idiv per line and per step cost ~10% of the product on Zen 3).
struct LineCursor {
  const char* const* row = nullptr;
  int64_t lines_per_row = 1, line = 0, left = 0;  // the next line: row[0] + line * 64
  // (always inlined: GCC's mod/ref analysis takes a call that only prefetches for one without
  // effect and drops it, as it did for one added to the bf16 tile loop's register blocks: none was
  // emitted)
  ATTNX_INLINE void take(int64_t n) {
    for (n = imin(n, left), left -= n; n > 0; --n) {
      __builtin_prefetch(*row + line * 64, 0, 1);
      if (++line == lines_per_row) {
        line = 0;
        ++row;
      }
    }
  }
};
struct LinePrefetch {
  const char* const* rows = nullptr;
  int64_t lines_per_row = 0, lines = 0, calls = 1;
  LineCursor share(int64_t c) const {
    if (rows == nullptr) return {};
    const int64_t l0 = lines * c / calls, l1 = lines * (c + 1) / calls;
    return {rows + l0 / lines_per_row, lines_per_row, l0 % lines_per_row, l1 - l0};
  }
};

// Packs the n rows of a K tile transposed: kt[d][j], zero for j >= n (to a multiple of QR*W) and
// for d >= Dk (to Dkp). `rows` holds kTileK Real row pointers padded with zero rows past n.
static void zero_kt_tail(int64_t n, int64_t Dkp, Real* kt) {
  const int64_t n8 = round_up(n, 8), nw = round_up(n, QR * W);
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
// current K and V tiles (up to 64 KiB) already fill L1; prefetcht0 and prefetchnta land lines in
// L1 to be evicted, or skip L2 (bench/NOTES.md compares them).
constexpr int64_t kPrefetchTiles = 1;  // flash: the same item's next tile
constexpr int64_t kPrefetchSteps = 1;  // flash_group: the next (item, tile) in execution order
static inline void prefetch_row(const char* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

// The scales of rows j0 .. j0+n-1 of a quantised source, prefetched: a page's scales are a line
// of their own, apart from its rows, so a tile that reads them cold waits for memory once per page.
static inline void prefetch_scales(const kern::KVSource& s, int64_t j0, int64_t n) {
  if (s.scale == nullptr) return;
  const int64_t rs = s.scale_row_stride;
  each_run(s, j0, n, [&](int64_t, int64_t page, int64_t off, int64_t run) {
    prefetch_row(reinterpret_cast<const char*>(scale_at(s, page, off)),
                 ((run - 1) * rs + 1) * int64_t(sizeof(float)));
  });
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
// bf16 rows come W features at a time in the vocabulary's bf16 order (load_bf16_ordered: the
// cheapest widening there, a permutation of the W features: AVX2's even/odd order, the natural
// one elsewhere); the kernels that read them put the other operand in that order: the query rows
// (bf16_order_rows), the P V accumulators (to_order, from_order). Each accumulator goes back to
// the natural order before it is summed (Q K^T) or stored (P V), so every sum is taken as over
// float32 rows of the same values: the same bits.
template <> inline V ld<BF16>(const Real* row, int64_t d) {
  return load_bf16_ordered(reinterpret_cast<const uint16_t*>(row) + d);
}
template <class T> static inline V to_order(V v) {
  if constexpr (std::is_same<T, BF16>::value) return to_bf16_order(v);
  return v;
}
template <class T> static inline V from_order(V v) {
  if constexpr (std::is_same<T, BF16>::value) return from_bf16_order(v);
  return v;
}
// M rows of q (ldq apart, D a multiple of W) into dst (ldd apart) in the bf16 order.
static void bf16_order_rows(int M, const Real* q, int64_t ldq, int64_t D, Real* dst, int64_t ldd) {
  for (int r = 0; r < M; ++r)
    for (int64_t d = 0; d < D; d += W)
      store(dst + r * ldd + d, to_bf16_order(load(q + r * ldq + d)));
}

// Quantised rows read in place give their codes (e4m3: code / 256, see load_fp8); the row's scale
// is applied to the scores (K) or the probabilities (V) instead: scale_keys below. e4m3 rows are
// widened with the NaN code's test where the vocabulary finds that cheaper (kE4m3TestInWidening),
// else without it, and read in place only from tiles that hold no NaN code (tile_reads).
struct I8 {};
struct E4M3 {};
struct E5M2 {};
template <> inline V ld<I8>(const Real* row, int64_t d) {
  return load_i8(reinterpret_cast<const int8_t*>(row) + d);
}
template <> inline V ld<E4M3>(const Real* row, int64_t d) {
  return load_e4m3_in_place(reinterpret_cast<const uint8_t*>(row) + d);
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

// Whether keys of a quantised source may be read in place (scale_keys), by their n scales `f`:
// each NaN, 0, or of magnitude in [2^-102, FLT_MAX / 256]. In place, a key's scale multiplies its
// score or its probability p (<= 1) instead of its codes; outside that range the product would
// lose bits below float32's normal range (p * s for the p that count, down to 2^-24), overflow
// (256 * s for e4m3's code / 256) or, for s = +-inf, turn the key's score into -inf (a key
// skipped) where the dequantised row (code * s) gives the reference's NaN. Such tiles are read
// from dequantised copies instead (real_rows).
static bool scales_in_place(const float* f, int64_t n) {
  constexpr float kLo = 0x1p-102f, kHi = std::numeric_limits<float>::max() / 256.f;
  int bad = 0;  // (this form vectorises: compares and ORs, no branch per key)
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::fabs(f[j]);
    bad |= int(a > kHi) | (int(a < kLo) & int(a != 0.f));  // (NaN: every comparison false)
  }
  return bad == 0;
}

// Keys read in place from a quantised source of `dtype`: multiplies column j of the M rows of `s`
// (scores, or probabilities before P V) by key j's scale f[j] (times 256 for e4m3's code / 256).
// q . (code * scale) = (q . code) * scale and p (code * scale) = (p scale) code, so this is
// attention over the dequantised rows up to float32 rounding.
static void scale_keys(int M, Real* s, const float* f, DType dtype, int64_t n) {
  const float e4 = dtype == DType::e4m3 ? 256.f : 1.f;
  for (int r = 0; r < M; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * kTileK + j] *= f[j] * e4;
}

// Integer queries (RowSet::qfactor): row r of the M rows of scores times its factor.
static void scale_rows(int M, Real* s, const Real* f, int64_t n) {
  for (int r = 0; r < M; ++r) {
    const V fr = set1(f[r]);
    for (int64_t j = 0; j < n; j += W) store(s + r * kTileK + j, mul(load(s + r * kTileK + j), fr));
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
static void pack_k(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk, const Scratch& sc,
                   Real* kt) {
  const int64_t Dkp = round_up(Dk, kPad);
  const bool inplace = (ks.dtype == kNative || ks.dtype == DType::f16) && Dk % 8 == 0;
  const int64_t dk = inplace ? Dk : Dkp;  // converted rows are already zero-padded
  if (inplace && ks.dtype == DType::f16) {
    // float16 rows widened inside the transpose, read in place: no fp32 copy of the tile to
    // write and read back
    kv_rows(ks, j0, n, sc.kaddr);
    const uint16_t* rows[8];
    for (int64_t j = 0; j < n; j += 8) {
      for (int64_t t = 0; t < 8; ++t)
        rows[t] = reinterpret_cast<const uint16_t*>(
            j + t < n ? sc.kaddr[j + t] : reinterpret_cast<const char*>(sc.zero));
      for (int64_t d = 0; d < Dk; d += 8) transpose8x8_f16(rows, d, kt + d * kTileK + j, kTileK);
    }
    zero_kt_tail(n, Dk, kt);
  } else if (inplace) {
    pack_kt(key_rows(ks, j0, n, Dk, true, sc), n, dk, kt);
  } else {
    // Converted 8 rows at a time into the head of kf, each 8 transposed before the next are
    // converted: a whole converted tile (32 KiB at D 128) beside the packed one would evict
    // itself from L1, and the conversion would stall on its stores.
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

}  // namespace
