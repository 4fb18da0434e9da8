// delta_amx-inl.h: the gated delta rule's products against the state on AMX-BF16 tiles, for bf16
// q, k and v: X = [K; Q] S0 (a chunk's keys and queries against the state before it) and the new
// state S = diag(dec) S0 + Kd^T U. These are 6 K V of the chunk's 6 K V + 2 C (K + V) flops a
// token (delta_kernels.h); the pair matrices, the solve and P U stay on the vector units.
// isa_amx.cpp includes this file inside namespace amx::delta, after amx-inl.h (the accumulator
// blocks c_tiles_*) and bf16_dot-inl.h (the pair packers), before delta-inl.h, which calls x_tiles
// and state_tiles where ATTNX_DELTA_TILES is defined and the head's dtype is bf16, inside
// isa_amx.cpp's TileScope.
//
// Numerics: each operand is rounded to bf16 (round to nearest even) as it is packed: the rows of
// K and Q (bf16 inputs, then l2-normalised, scaled and, per channel, gated in float32), S0, the
// gated keys Kd and U. The products are exact in fp32 and summed in fp32 (tdpbf16ps); Kd^T U is
// then added to diag(dec) S0 in fp32 (one fmadd). The state stays float32 from chunk to chunk:
// only the copy a product reads is rounded.
// docs/numerics.md states the error this adds.

// The including file provides <vector> and <immintrin.h>.

namespace {

static_assert(kern::kDeltaChunk <= kTileRows, "a chunk's keys (and queries) fill one row block");
static_assert(kern::kDeltaChunk <= 2 * kTilePairs, "a chunk's tokens fill one block of pairs");
static_assert(kern::kPad % (2 * kTilePairs) == 0, "Kp and Vp are whole 2 x 2 tile blocks");

// A chunk's tokens as pairs: at most kTokenPairs of them hold data, the rest of a 16-pair block of
// the reduction stays zero from the buffers' allocation on.
constexpr int64_t kTokenPairs = (kern::kDeltaChunk + 1) / 2;

// Per thread: the products' operands as bf16 pairs. The state's pairs are kept per value head of
// a group (slot = the head's place in it): the update of one chunk writes them beside the float32
// state, and the next chunk's X reads them where nothing changed the state in between.
struct DeltaTiles {
  kern::Carve<float> raw;
  std::vector<const char*> rows;  // row addresses for pack_v_pairs (K of them, or a chunk's)
  Pair* kq = nullptr;             // [K; Q]: 2 kTileRows rows of Kp / 2 pairs (along the features)
  Pair* s[kern::kDeltaGroupMax] = {};  // S0 per slot: Kp / 2 rows of Vp pairs (along the features)
  Pair* kdp = nullptr;                 // Kd as pairs along the tokens: kTokenPairs rows of Kp pairs
  Pair* kdt = nullptr;                 // its transpose, Kd^T: Kp rows of kTilePairs pairs
  Pair* u = nullptr;                   // U: kTilePairs rows of Vp pairs (along the tokens)
  float* zero = nullptr;               // max(Kp, Vp) zeros
  float* d = nullptr;                  // Kd^T U of one 2 x 2 tile block: 2 kTileRows x 32 floats
  int64_t k = -1, vp = -1;
  // (re)allocated, zero, for another K or V: the pair rows past K's stay zero while K does
  void size(int64_t K, int64_t Kp, int64_t Vp) {
    if (K == k && Vp == vp) return;
    const int64_t wide = Kp > Vp ? Kp : Vp;
    const int64_t n_kq = kTileRows * Kp, n_s = Kp / 2 * Vp, n_kdp = kTokenPairs * Kp,
                  n_kdt = Kp * kTilePairs, n_u = kTilePairs * Vp, n_d = 2 * kTileRows * 32;
    raw.reset(n_kq + kern::kDeltaGroupMax * n_s + n_kdp + n_kdt + n_u + wide + n_d);
    rows.assign(std::size_t(Kp > kern::kDeltaChunk ? Kp : kern::kDeltaChunk), nullptr);
    kq = reinterpret_cast<Pair*>(raw.take(n_kq));
    for (auto& slot : s) slot = reinterpret_cast<Pair*>(raw.take(n_s));
    kdp = reinterpret_cast<Pair*>(raw.take(n_kdp));
    kdt = reinterpret_cast<Pair*>(raw.take(n_kdt));
    u = reinterpret_cast<Pair*>(raw.take(n_u));
    zero = raw.take(wide);
    d = raw.take(n_d);
    k = K;
    vp = Vp;
  }
};
static DeltaTiles& delta_tiles(const kern::DeltaHead& h) {
  static thread_local DeltaTiles t;
  t.size(h.K, h.Kp, h.Vp);
  return t;
}

// n rows of m floats, ld apart, as bf16 pairs along the rows (pack_v_pairs: pair row i holds rows
// 2i and 2i + 1, round_up(m, kPad) pairs a row), zero pair rows from (n + 1) / 2 to pad_rows.
static void pairs_down(DeltaTiles& dt, const float* x, int64_t ld, int64_t n, int64_t m,
                       int64_t pad_rows, Pair* out) {
  for (int64_t i = 0; i < n; ++i) dt.rows[i] = reinterpret_cast<const char*>(x + i * ld);
  pack_v_pairs<true>(dt.rows.data(), n, m, dt.zero, out, pad_rows);
}

// X = [K; Q] S0: rows 0..n-1 of x the keys' (kx, n rows of Kp floats), rows kTileRows.. the
// queries' (qx); S0 is K rows of V floats, lds apart, whose pairs slot `slot` holds already
// where `packed` (state_tiles wrote them), else they are packed first. x: 2 kTileRows rows of Vp
// floats (the rows past n hold products of zero rows). after() runs after each column block.
template <class Fn>
static void x_tiles(const kern::DeltaHead& h, int slot, bool packed, int64_t n, const float* kx,
                    const float* qx, const float* src, float* x, Fn&& after) {
  const int64_t Kp = h.Kp, Vp = h.Vp, K2 = Kp / 2;
  DeltaTiles& dt = delta_tiles(h);
  for (int64_t i = 0; i < kTileRows; ++i) {
    if (i < n) {
      round_row_bf16(kx + i * Kp, h.K, Kp, dt.kq + i * K2);
      round_row_bf16(qx + i * Kp, h.K, Kp, dt.kq + (kTileRows + i) * K2);
    } else {
      std::memset(dt.kq + i * K2, 0, sizeof(Pair) * std::size_t(K2));
      std::memset(dt.kq + (kTileRows + i) * K2, 0, sizeof(Pair) * std::size_t(K2));
    }
  }
  Pair* sp = dt.s[slot];
  if (!packed) pairs_down(dt, src, h.lds, h.K, h.V, K2, sp);
  for (int64_t c = 0; c < Vp; c += 2 * kTilePairs) {
    c_tiles_zero();
    for (int64_t kb = 0; kb < K2; kb += kTilePairs)
      c_tiles_dp(dt.kq + kb, K2, sp + kb * Vp + c, Vp);
    c_tiles_store(x + c, Vp);
    after();
  }
}

// Rows [r0, r0 + rows) x columns [c, c + 32) of S = diag(dec) S0 + D (D: that block of Kd^T U, 32
// floats a row), and their bf16 pairs (rows 2i and 2i + 1 of S) into sp for the next chunk.
static void state_block(const kern::DeltaHead& h, int64_t r0, int64_t rows, int64_t c,
                        const float* src, const float* dec, const float* D, Pair* sp) {
  const int64_t lds = h.lds;
  for (int64_t r = 0; r < rows; r += 2) {
    V out[2][2];
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        if (r + i == rows) {  // K odd: the last pair's second row is zero
          out[i][j] = zero();
          continue;
        }
        const int64_t row = r0 + r + i;
        out[i][j] = fmadd(set1(dec[row]), load(src + row * lds + c + j * W),
                          load(D + (r + i) * 32 + j * W));
        store(h.S + row * lds + c + j * W, out[i][j]);
      }
    for (int j = 0; j < 2; ++j)
      dot::zip_round(sp + (r0 + r) / 2 * h.Vp + c + j * W, out[0][j], out[1][j]);
  }
}

// S = diag(dec) S0 + Kd^T U: kd n rows of Kp floats, u n rows of Vp floats, S0 (src) and S K rows
// of Vp floats, lds apart (src may be S); S's pairs into slot `slot` for the next chunk's X. Per
// 2 x 2 tile block (32 state rows x 32 columns): Kd^T U on tiles (one 16-pair block of tokens
// deep), then the block of S and its pairs on the vector units while it is in L1; after() runs
// after each block.
template <class Fn>
static void state_tiles(const kern::DeltaHead& h, int slot, int64_t n, const float* kd,
                        const float* u, const float* src, const float* dec, Fn&& after) {
  const int64_t K = h.K, Kp = h.Kp, Vp = h.Vp;
  DeltaTiles& dt = delta_tiles(h);
  pairs_down(dt, u, Vp, n, h.V, kTokenPairs, dt.u);
  pairs_down(dt, kd, Kp, n, K, kTokenPairs, dt.kdp);
  for (int64_t ch = 0; ch < Kp; ++ch)  // Kd^T: row ch holds the tokens' pairs of channel ch
    for (int64_t t2 = 0; t2 < kTokenPairs; ++t2)
      dt.kdt[ch * kTilePairs + t2] = dt.kdp[t2 * Kp + ch];
  for (int64_t r0 = 0; r0 < K; r0 += 2 * kTileRows) {
    const int64_t rows = K - r0 < 2 * kTileRows ? K - r0 : 2 * kTileRows;
    for (int64_t c = 0; c < Vp; c += 2 * kTilePairs) {
      c_tiles_zero();
      c_tiles_dp(dt.kdt + r0 * kTilePairs, kTilePairs, dt.u + c, Vp);
      c_tiles_store(dt.d, 2 * kTilePairs);
      state_block(h, r0, rows, c, src, dec, dt.d, dt.s[slot]);
      after();
    }
  }
}

}  // namespace
