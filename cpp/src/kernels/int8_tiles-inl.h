// int8_tiles-inl.h: S = Q K^T of integer queries over int8 keys on int8 tiles (AMX-INT8's
// tdpbssd: C[16 x 16] int32 += A[16 x 64 int8] B[16 x 64 int8], B holding 4 consecutive features
// of one key in each 32 bits), and the tiles' portable emulation (EmuTiles: the same layouts,
// loads, stores and integer sums in plain C++), so the packing and the tiling run and are tested
// on every CPU. The hardware tiles (AmxTiles) exist where the including unit defines
// ATTNX_AMX_TILES (isa_amx.cpp, compiled with -mamx-tile -mamx-int8 -mamx-bf16). Both also
// carry AMX-BF16's product (dp_bf16), which amx-inl.h's tile loop runs on.
//
// Numerics: each score is the exact integer sum q_q . k_q (int32; exact in Real for Dk < 1040),
// times the key's scale, then (tile-inl.h qk_tile) times the row's factor: the float operations
// of qk-inl.h's VNNI kernel in the same order, so the scores are those of every other integer
// query path bit for bit. The softmax and P V are tile-inl.h's, in floating point.
//
// Layouts: A = the query codes as the driver wrote them (RowSet::qcodes, read in place): features
// zero-padded to kQuadRow (64), ldc bytes a row, rows to a pair of row blocks. B = the key tile
// packed once (pack_k_i8, shared by the kv head's items like pack_k's tiles): kp[g][j] = the 4
// codes k[j][4g .. 4g + 3] (zeros past Dk and past the tile's keys), kTileK 32-bit quads a row, one
// row per quad of features; a tile's 16 columns are 16 keys, its 16 rows 64 features. Included
// after pv-inl.h, before tile-inl.h (whose qk_tile calls qk_int8_tiles), inside the unit's
// namespace; the including file provides <cmath>, <cstring>, <limits> and <vector>.

namespace {

constexpr int kTileRows = 16;                  // rows of a tile
constexpr int kQuadRow = int(kern::kCodeRow);  // int8 features of a tile row (16 quads)
constexpr int kTileCols = 16;                  // int32 columns of a tile: 16 keys
constexpr int kQuadLd = kTileK * 4;            // bytes of a row of packed K: kTileK keys' quads
constexpr int kRowsPad = 64 + 2 * kTileRows;   // kRowsPerItem rounded up to whole row-block pairs
static_assert(kern::kQuadRows == kTileCols, "qquads: one row per column of a tile");

// ---- the tile operations: eight tiles of 16 rows x 64 bytes ----------------------------------
// The emulation: each tile in memory. dp<C, A, B>() is tdpbssd: C[m][n] += sum over k < 64 of
// A[m][k] * B[k / 4][4 n + k % 4], int8 x int8 summed in int32.
struct EmuTiles {
  alignas(64) int32_t t[8][kTileRows * kTileCols];
  // each tile's rows, as a configuration gives them (all 16 but under amx_decode-inl.h's)
  int rows[8] = {kTileRows, kTileRows, kTileRows, kTileRows,
                 kTileRows, kTileRows, kTileRows, kTileRows};
  template <int T>
  void zero() {
    std::memset(t[T], 0, sizeof t[T]);
  }
  template <int T>
  void load(const void* p, int64_t stride) {
    for (int r = 0; r < rows[T]; ++r)
      std::memcpy(t[T] + r * kTileCols, static_cast<const char*>(p) + r * stride, kQuadRow);
  }
  template <int T>
  void store(void* p, int64_t stride) const {
    for (int r = 0; r < rows[T]; ++r)
      std::memcpy(static_cast<char*>(p) + r * stride, t[T] + r * kTileCols, kQuadRow);
  }
  template <int C, int A, int B>
  void dp() {
    const int8_t* a = reinterpret_cast<const int8_t*>(t[A]);
    const int8_t* b = reinterpret_cast<const int8_t*>(t[B]);
    for (int m = 0; m < rows[C]; ++m)
      for (int n = 0; n < kTileCols; ++n) {
        int32_t sum = 0;
        for (int k = 0; k < kQuadRow; ++k)
          sum += int32_t(a[m * kQuadRow + k]) * int32_t(b[k / 4 * kQuadRow + 4 * n + k % 4]);
        t[C][m * kTileCols + n] += sum;
      }
  }
  // tdpbf16ps: C[m][n] (fp32) += A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over the 16 pairs
  // k of a row, one fp32 addition per product in that order (each product of two bf16 is exact
  // in fp32), with the instruction's DAZ and FTZ: subnormal bf16 inputs read as zero, and a
  // subnormal sum becomes zero (of its sign).
  template <int C, int A, int B>
  void dp_bf16() {
    uint16_t a[kTileRows * 2 * kTilePairsBf16], b[kTileRows * 2 * kTilePairsBf16];
    float c[kTileRows * kTileCols];
    std::memcpy(a, t[A], sizeof a);
    std::memcpy(b, t[B], sizeof b);
    std::memcpy(c, t[C], sizeof c);
    for (int m = 0; m < rows[C]; ++m)
      for (int n = 0; n < kTileCols; ++n) {
        float acc = c[m * kTileCols + n];
        for (int k = 0; k < kTilePairsBf16; ++k)
          for (int i = 0; i < 2; ++i)
            acc = ftz(acc + daz(a[m * 2 * kTilePairsBf16 + 2 * k + i]) *
                                daz(b[k * 2 * kTilePairsBf16 + 2 * n + i]));
        c[m * kTileCols + n] = acc;
      }
    std::memcpy(t[C], c, sizeof c);
  }

 private:
  static constexpr int kTilePairsBf16 = kQuadRow / 4;  // bf16 pairs in a tile row
  static float daz(uint16_t h) {                       // a bf16's value, zero for a subnormal one
    const uint32_t u = (h & 0x7f80u) == 0 ? uint32_t(h & 0x8000u) << 16 : uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static float ftz(float x) {
    return std::fabs(x) < std::numeric_limits<float>::min() ? std::copysign(0.f, x) : x;
  }
};

#if defined(ATTNX_AMX_TILES)
// The palette-1 configuration of every tile: 16 rows of 64 bytes (AMX-BF16's tiles too).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures the tiles for this thread while alive; releases them after (the tile state then
// costs a context switch nothing).
class TileScope {
 public:
  TileScope() { _tile_loadconfig(&config()); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  // (one object for every scope: GCC 12 dropped the column stores of a copy built on the stack
  // next to the int8 path, leaving a zero-width configuration that ldtilecfg faults on)
  static const TileConfig& config() {
    static const TileConfig cfg = [] {
      TileConfig c;
      for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = kTileRows;
      }
      return c;
    }();
    return cfg;
  }
};

// The hardware tiles (configured by a TileScope around the call). Inline assembly, not the
// intrinsics: these name their tile in the instruction's text (no template argument can), and
// declare no memory access (a "memory" clobber here keeps the buffers' stores before the loads).
struct AmxTiles {
  template <int T>
  void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  void load(const void* p, int64_t stride) {
    asm volatile("{tileloadd\t(%0,%1,1), %%tmm%c2|tileloadd\t%%tmm%c2, [%0+%1*1]}" ::"r"(p),
                 "r"(stride), "i"(T)
                 : "memory");
  }
  template <int T>
  void store(void* p, int64_t stride) const {
    asm volatile("{tilestored\t%%tmm%c2, (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm%c2}" ::"r"(p),
                 "r"(stride), "i"(T)
                 : "memory");
  }
  // C += A B (tdpbssd, both signed)
  template <int C, int A, int B>
  void dp() {
    asm volatile(
        "{tdpbssd\t%%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbssd\t%%tmm%c0, %%tmm%c1, %%tmm%c2}" ::"i"(C),
        "i"(A), "i"(B));
  }
  // C += A B (tdpbf16ps: bf16 pairs, fp32 sums)
  template <int C, int A, int B>
  void dp_bf16() {
    asm volatile(
        "{tdpbf16ps\t%%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps\t%%tmm%c0, %%tmm%c1, %%tmm%c2}" ::"i"(
            C),
        "i"(A), "i"(B));
  }
};
#endif

// ---- scratch ------------------------------------------------------------------------------------
// Per thread: the int32 sums (up to kern::code_rows(M) rows of kTileK) and the emulation's tiles.
// Few-row items (qk_i8_unpacked) also: keys staged where a chunk of 16 does not lie at one
// stride (16 rows of Dk bytes a chunk).
struct I8Scratch {
  kern::Carve<int32_t> raw;
  int32_t* c = nullptr;
  int64_t rows = 0;
  std::vector<char> stage;
  EmuTiles emu;
  void size(int64_t M) {
    if (kern::code_rows(M) <= rows) return;
    rows = kern::code_rows(M);
    raw.reset(rows * kTileK);
    c = raw.take(rows * kTileK);
  }
  // room to stage a tile's kTileK keys of Dk bytes
  char* staging(int64_t Dk) {
    if (stage.size() < std::size_t(kTileK * Dk)) stage.resize(std::size_t(kTileK * Dk));
    return stage.data();
  }
};
static I8Scratch& i8_scratch() {
  static thread_local I8Scratch sc;
  return sc;
}

// ---- packing ------------------------------------------------------------------------------------
// Keys [j0, j0 + n) of an int8 source into kp (round_up(Dk, 64) / 4 rows of kQuadLd bytes):
// kp[g][j] = k[j][4g .. 4g + 3], zeros past Dk and for keys n .. kTileK. The codes alone: each
// key's scale is applied to its score (scale_keys).
static void pack_k_i8(const kern::KVSource& ks, int64_t j0, int64_t n, int64_t Dk,
                      const Scratch& sc, int8_t* kp) {
  const int64_t quads = round_up(Dk, kQuadRow) / 4, full = Dk / 4;
  kv_rows(ks, j0, n, sc.kaddr);
  for (int64_t j = 0; j < kTileK; ++j) {
    int8_t* dst = kp + j * 4;
    const int8_t* row = j < n ? reinterpret_cast<const int8_t*>(sc.kaddr[j]) : nullptr;
    int64_t g = 0;
    if (row != nullptr)
      for (; g < full; ++g) std::memcpy(dst + g * kQuadLd, row + 4 * g, 4);
    for (; g < quads; ++g) {
      int8_t quad[4] = {0, 0, 0, 0};
      for (int64_t d = 4 * g; row != nullptr && d < imin(Dk, 4 * g + 4); ++d)
        quad[d - 4 * g] = row[d];
      std::memcpy(dst + g * kQuadLd, quad, 4);
    }
  }
}

// The tile's packed K: the kv head's shared tile where it has one and the item is a packed-path
// one (every such item of the kv head takes the int8 tiles: dispatch.cpp's int8_tiles), else a
// private pack in sc.kt (pack_k's buffer: Dkp x kTileK Reals, more than the int8 layout needs).
static const int8_t* packed_tile_i8(const RowSet& rs, const kern::KVSource& ks, int64_t j0,
                                    int64_t n, int64_t Dk, const Scratch& sc) {
  auto pack = [&](int64_t jj, int64_t nn, Real* dst) {
    pack_k_i8(ks, jj, nn, Dk, sc, reinterpret_cast<int8_t*>(dst));
    return 0;
  };
  if (rs.M <= kDotRows) {
    pack(j0, n, sc.kt);
    return reinterpret_cast<const int8_t*>(sc.kt);
  }
  int unused;
  return reinterpret_cast<const int8_t*>(shared_tile(ks, j0, n, Dk, sc, pack, &unused));
}

// ---- the products --------------------------------------------------------------------------
// The accumulators, tiles 0-3, set to zero.
template <class Tiles>
static void zero_c(Tiles& t) {
  t.template zero<0>();
  t.template zero<1>();
  t.template zero<2>();
  t.template zero<3>();
}

// C (32 rows x 32 keys, ldc int32 a row) = A B over nkb blocks of 64 features: tiles 0-3 the four
// 16 x 16 blocks of C, 4-5 A's two row blocks (a: lda bytes a row), 6-7 B's two column blocks
// (b: the first key's quad in kp).
template <class Tiles>
static void block_2x2(Tiles& t, const int8_t* a, int64_t lda, const int8_t* b, int64_t nkb,
                      int32_t* c, int64_t ldc) {
  zero_c(t);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int8_t* bk = b + kb * kTileRows * kQuadLd;
    t.template load<4>(a + kb * kQuadRow, lda);
    t.template load<5>(a + kTileRows * lda + kb * kQuadRow, lda);
    t.template load<6>(bk, kQuadLd);
    t.template load<7>(bk + kTileCols * 4, kQuadLd);
    t.template dp<0, 4, 6>();
    t.template dp<1, 4, 7>();
    t.template dp<2, 5, 6>();
    t.template dp<3, 5, 7>();
  }
  t.template store<0>(c, ldc * 4);
  t.template store<1>(c + kTileCols, ldc * 4);
  t.template store<2>(c + kTileRows * ldc, ldc * 4);
  t.template store<3>(c + kTileRows * ldc + kTileCols, ldc * 4);
}

// C (16 rows x all kTileK keys) = A B: one row block (few rows: decode groups, a last partial
// block; a: lda bytes a row) against the tile's four column blocks, tiles 0-3 C, 4 A, 5-7 B (5
// twice).
template <class Tiles>
static void block_1x4(Tiles& t, const int8_t* a, int64_t lda, const int8_t* b, int64_t nkb,
                      int32_t* c) {
  zero_c(t);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int8_t* bk = b + kb * kTileRows * kQuadLd;
    t.template load<4>(a + kb * kQuadRow, lda);
    t.template load<5>(bk, kQuadLd);
    t.template load<6>(bk + kTileCols * 4, kQuadLd);
    t.template load<7>(bk + 2 * kTileCols * 4, kQuadLd);
    t.template dp<0, 4, 5>();
    t.template dp<1, 4, 6>();
    t.template dp<2, 4, 7>();
    t.template load<5>(bk + 3 * kTileCols * 4, kQuadLd);
    t.template dp<3, 4, 5>();
  }
  t.template store<0>(c, kTileK * 4);
  t.template store<1>(c + kTileCols, kTileK * 4);
  t.template store<2>(c + 2 * kTileCols, kTileK * 4);
  t.template store<3>(c + 3 * kTileCols, kTileK * 4);
}

// The int32 sums of the M rows (q: ldq bytes a row, rows to a multiple of 32) against the
// tile's kTileK keys (kp) into c (kTileK a row): pairs of row blocks, the last lone block alone.
template <class Tiles>
static void qk_i8_sums(Tiles& t, int M, const int8_t* q, int64_t ldq, const int8_t* kp,
                       int32_t* c) {
  const int64_t nkb = ldq / kQuadRow;
  int r = 0;
  for (; M - r > kTileRows; r += 2 * kTileRows)
    for (int k = 0; k < kTileK; k += 2 * kTileCols)
      block_2x2(t, q + r * ldq, ldq, kp + k * 4, nkb, c + r * kTileK + k, kTileK);
  if (r < M) block_1x4(t, q + r * ldq, ldq, kp, nkb, c + r * kTileK);
}

// ---- few rows: K read where it lies -------------------------------------------------------------
// An item of at most 16 rows (decode: the query heads of one kv head; a short chunk) would pack
// the tile's 64 keys for those few rows (block_1x4), which costs more than the products. It takes
// S^T = K Q^T instead (kern::unpacked_codes): A = 16 keys' codes as they lie in the pages (a tile
// row: 64 features of one key), B = the rows' codes as quads (RowSet::qquads, laid out by the
// driver once per item), C = 16 keys x 16 rows; nothing is packed. Dk a whole number of tile rows,
// so that a row of A never runs past its key.
// The int32 sums of the M rows against keys [j0, j0 + n) into x.c, key by key: c[j * 16 + r]
// (zero for keys n .. kTileK). `next` (nn rows of Dk bytes: the next tile's K, or null) is
// prefetched before the products, as qk_int8 does.
template <class Tiles>
static void qk_i8_unpacked(Tiles& t, const RowSet& rs, const kern::KVSource& ks, int64_t j0,
                           int64_t n, int64_t Dk, const char* const* next, int64_t nn,
                           I8Scratch& x) {
  const int64_t nkb = Dk / kQuadRow;
  char* stage = x.staging(Dk);
  if (next != nullptr)
    for (int64_t k = 0; k < nn; ++k) prefetch_row(next[k], Dk);
  const int nc = int((n + kTileKeys - 1) / kTileKeys);
  TileRows kr[kTileK / kTileKeys];
  for (int c = 0; c < nc; ++c)
    kr[c] = tile_rows(ks, j0 + c * kTileKeys, imin(kTileKeys, n - c * kTileKeys), Dk,
                      stage + c * kTileKeys * Dk);
  // C: tiles 0-3 (one a chunk of 16 keys); A: 4, 6, 7, then 4 again; B: 5. The loads go first:
  // the tile unit runs in order, and a product waits for its load's L2 latency.
  zero_c(t);
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t at = kb * kQuadRow;
    t.template load<5>(rs.qquads + kb * kTileRows * kern::kQuadRows, kern::kQuadRows * 4);
    t.template load<4>(kr[0].p + at, kr[0].stride);
    if (nc > 1) t.template load<6>(kr[1].p + at, kr[1].stride);
    if (nc > 2) t.template load<7>(kr[2].p + at, kr[2].stride);
    t.template dp<0, 4, 5>();
    if (nc > 1) t.template dp<1, 6, 5>();
    if (nc > 2) t.template dp<2, 7, 5>();
    if (nc > 3) {
      t.template load<4>(kr[3].p + at, kr[3].stride);
      t.template dp<3, 4, 5>();
    }
  }
  t.template store<0>(x.c, kTileCols * 4);
  t.template store<1>(x.c + kTileKeys * kTileCols, kTileCols * 4);
  t.template store<2>(x.c + 2 * kTileKeys * kTileCols, kTileCols * 4);
  t.template store<3>(x.c + 3 * kTileKeys * kTileCols, kTileCols * 4);
}

// S = Q K^T of keys [j0, j0 + n) into sc.s for the M integer query rows (rs.qcodes): the exact
// int32 sums on tiles `t` (AMX-INT8's, or the emulation), times the row's factor and each key's
// scale f[j] (1 past n). Columns n .. kTileK hold what the tile holds there (zeros, or a shared
// tile's later keys) times the row's factor.
template <class Tiles>
static void qk_i8_tiles(Tiles& t, const RowSet& rs, const kern::KVSource& ks, int64_t j0, int64_t n,
                        int64_t Dk, const Scratch& sc, const float* f, const char* const* next,
                        int64_t nn) {
  const int M = rs.M;
  I8Scratch& x = i8_scratch();
  x.size(imax(M, kTileRows));
  // the sum of row r and key j at c[r * lr + j * lj]
  int64_t lr = kTileK, lj = 1;
  if (rs.qquads != nullptr) {  // (the driver's kern::unpacked_codes)
    qk_i8_unpacked(t, rs, ks, j0, n, Dk, next, nn, x);
    lr = 1;
    lj = kTileCols;
  } else {
    qk_i8_sums(t, M, rs.qcodes, rs.ldc, packed_tile_i8(rs, ks, j0, n, Dk, sc), x.c);
  }
  // s = (sum * row factor) * key scale in one pass: scale_rows' then scale_keys' products, in
  // their order
  for (int r = 0; r < M; ++r) {
    const Real qf = rs.qfactor[r];
#if defined(ATTNX_AMX_TILES)
    if (lj != 1) {  // (a row's sums down a column of the 16-wide blocks)
      for (int64_t j = 0; j < kTileK; j += W)
        store(sc.s + r * kTileK + j,
              mul(mul(dot::int_column(x.c + r + j * lj, int(lj)), set1(qf)), load(f + j)));
      continue;
    }
#endif
    for (int64_t j = 0; j < kTileK; ++j)
      sc.s[r * kTileK + j] = Real(x.c[r * lr + j * lj]) * qf * f[j];
  }
}

// The hook tile-inl.h's qk_tile calls for rows with rs.int8_tiles set: the hardware tiles where
// this unit has them (the caller holds a TileScope), else the emulation. False, having done
// nothing, where the tile's key scales cannot be applied to the sums (scales_in_place): the
// caller then reads the keys dequantised.
static bool qk_int8_tiles(const RowSet& rs, const kern::KVSource& ks, int64_t j0, int64_t n,
                          int64_t Dk, const Scratch& sc, const char* const* next, int64_t nn) {
  float f[kTileK];
  kv_scales(ks, j0, n, f);
  if (!scales_in_place(f, n)) return false;
  for (int64_t j = n; j < kTileK; ++j) f[j] = 1.f;
#if defined(ATTNX_AMX_TILES)
  if (rs.int8_tiles == Int8Tiles::amx) {
    AmxTiles hw;
    qk_i8_tiles(hw, rs, ks, j0, n, Dk, sc, f, next, nn);
    return true;
  }
#endif
  qk_i8_tiles(i8_scratch().emu, rs, ks, j0, n, Dk, sc, f, next, nn);
  return true;
}

}  // namespace
