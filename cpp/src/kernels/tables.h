// tables.h: the contract between the drivers (attention/, delta/, runtime/) and the per-ISA
// micro-kernels: one table of function pointers per operation, and one IsaTables per instruction
// set. Plain structs only: no inline functions here, so that no code compiled with AVX flags can be
// shared (through COMDAT folding) with code that must run on a baseline x86-64 CPU.
#pragma once
#include <cstdint>
#include <cstring>

#include "attnx/types.h"

// Micro-kernels and the reductions inside them must inline into their loops: as calls, GCC kept
// their accumulator arrays on the stack (zeroed with rep stos, spilled, reloaded), which cost the
// decode QK^T about as much as its FMAs.
#define ATTNX_INLINE inline __attribute__((always_inline))

namespace attnx {
namespace kern {

constexpr int kTileK = 64;   // keys per KV tile: a 64 x 128 fp32 K tile is 32 KiB, one L1D
constexpr int kPad = 32;     // feature widths are padded to the widest register block (AVX-512:
                             // 2 vectors of 16 floats)
constexpr int kDotRows = 8;  // up to this many query rows, QK^T is computed as dot products
                             // against K rows in place; above it, K is packed transposed once
                             // per tile and reused by every row (a GEMM-style B panel)
// Integer query codes (RowSetT::qcodes) are read in place by the int8 tiles: rows padded to
// whole 64-byte lines of features, and the buffer to pairs of the tiles' 16-row blocks.
constexpr int64_t kCodeRow = 64;
constexpr int64_t kCodeRows = 32;
inline int64_t code_ld(int64_t Dk) { return (Dk + kCodeRow - 1) / kCodeRow * kCodeRow; }
inline int64_t code_rows(int64_t M) { return (M + kCodeRows - 1) / kCodeRows * kCodeRows; }
// Items of at most kQuadRows rows whose features fill whole code rows take the int8 tiles with K
// read where it lies (int8_tiles-inl.h qk_i8_unpacked) and their codes as quads by rows
// (RowSetT::qquads): code_ld(Dk) / 4 rows of kQuadRows quads.
constexpr int kQuadRows = 16;
// From this many rows an item's integer queries take the int8 tiles by default, where the path
// has them (runtime/dispatch.cpp int8_tiles): at 4 rows K read in place on the tiles matches
// VNNI's dot products, and passes them from 5 (bench/NOTES.md).
constexpr int kInt8TileRows = 4;
inline bool unpacked_codes(int M, int64_t Dk) { return M <= kQuadRows && Dk % kCodeRow == 0; }
inline int64_t quads_size(int64_t Dk) { return code_ld(Dk) / 4 * kQuadRows; }
// out[g * kQuadRows + r] = the 4 codes of row r's features 4g .. 4g + 3 (codes: M rows of ldc
// bytes), zero for rows M .. kQuadRows - 1.
inline void code_quads(const int8_t* codes, int64_t ldc, int M, int32_t* out) {
  std::memset(out, 0, sizeof(int32_t) * std::size_t(ldc / 4 * kQuadRows));
  for (int r = 0; r < M; ++r)
    for (int64_t g = 0; g < ldc / 4; ++g)
      std::memcpy(out + g * kQuadRows + r, codes + r * ldc + 4 * g, 4);
}

// Where the keys (or values) of one (sequence, kv head) live. Row j is at
//   contiguous: base + j * row_stride
//   paged:      base + block_table[j / block_size] * block_stride + (j % block_size) * row_stride
// (bytes). Feature elements within a row are contiguous.
// Quantised dtypes (i8, e4m3, e5m2) read row j as code * scale, the scale at
//   contiguous: scale + j * scale_row_stride
//   paged:      scale + block_table[j / block_size] * scale_block_stride + (j % block_size) *
//   scale_row_stride
// (floats); rows are converted with their scale as they are loaded into the fp32 tile buffers.
struct KVSource {
  const char* base = nullptr;
  DType dtype = DType::f32;
  int64_t row_stride = 0;
  const int32_t* block_table = nullptr;
  int64_t block_size = 0, block_stride = 0;
  const float* scale = nullptr;
  int64_t scale_row_stride = 0, scale_block_stride = 0;
  // Optional, keys only: room for every tile of keys [t * kTileK, (t + 1) * kTileK) (of the
  // kt_keys keys) packed by pack_k, at kt + t * Dkp * kTileK elements of the kernel's type (float;
  // double for the float64 kernels), shared by the work items of one kv head. kt_ready[t]: 0 = not
  // packed, 1 = being packed, >= 2 = packed (atomic; 2 + a flag the packer keeps with the tile).
  // The first item to need tile t packs it there; the others read it (or, while it is being
  // packed, pack their own).
  void* kt = nullptr;
  int* kt_ready = nullptr;
  int64_t kt_keys = 0;
};

// The structs below are templates on T, the type the kernels compute in: float for float32,
// float16 and bfloat16 storage (RowSet, Scratch, FlashState, FlashKernels), double for float64
// (the scalar float64 kernels, flash_f64).

// The query rows of one work item: up to a few dozen (query, head) pairs that share a kv head.
template <class T>
struct RowSetT {
  int M = 0;
  const T* q = nullptr;  // (M, ldq) queries already multiplied by scale, zero-padded
  int64_t ldq = 0;
  const int64_t* lo = nullptr;  // row r sees keys [lo[r], hi[r]) (causal, window, kv_lens)
  const int64_t* hi = nullptr;
  const int64_t* pos = nullptr;  // the row's bottom-right aligned position i + (Lk - Lq)
  const T* slope = nullptr;      // per-row ALiBi slope, or null
  MaskKind mask_kind = MaskKind::none;
  const char* const* mask_row = nullptr;  // per row: address of mask element (row, key 0)
  int64_t mask_sk = 0;                    // bytes between consecutive keys of a mask row
  // The queries' own dtype and the scale q was multiplied by: the avx512bf16 kernels take bf16
  // queries back (q / scale rounds to the bf16 value exactly) to use bf16 dot products.
  DType q_dtype = DType::f32;
  T scale = 1;
  // The rows' l must be float32-accurate: they return an lse. Where false, the avx512bf16 path
  // (which rounds P to bf16) may compute p to 2.9e-6 instead of 1.3 ulp (bf16_dot-inl.h).
  bool exact_l = true;
  // float32 q, k and v may be multiplied in bf16 (attnx.set_float32_precision("bf16"), read once
  // per call): the paths with bf16 products then take them for prefill as for bf16 inputs.
  bool bf16_products = false;
  // Integer queries over int8 keys (null otherwise): q holds each row quantised like the keys,
  // integers in [-127, 127], and row r's scores take the factor qfactor[r] (its scale times
  // `scale`) before each key's scale: (sum q_q k_q) s_q s_k, in that order, leaves float32's range
  // only where the score does. Sums of code products are exact in T for Dk < 1040, so FMAs over
  // them and VNNI's integer dot products give the same scores.
  const T* qfactor = nullptr;
  // With qfactor: the rows' values, codes times qfactor (ldq a row), which keys read dequantised
  // (code * scale: scales outside scales_in_place's range) multiply, as attnx.reference does.
  const T* qvals = nullptr;
  // With qfactor: the same codes as int8, ldc bytes a row (code_ld(Dk)), zero past Dk. The int8
  // tiles read whole code blocks: kCodeRows-row blocks of ldc bytes, so the buffer holds
  // round_up(M, kCodeRows) rows (those past M left as an earlier item wrote them: the sums of
  // such rows are never read).
  const int8_t* qcodes = nullptr;
  int64_t ldc = 0;
  // With qcodes, for an item on the int8 tiles with unpacked_codes(M, Dk): the codes as quads by
  // rows (code_quads), which qk_i8_unpacked's tiles load as they are.
  const int32_t* qquads = nullptr;
  // With qcodes: whether Q K^T runs on int8 tiles (int8_tiles-inl.h) or the vector kernels.
  Int8Tiles int8_tiles = Int8Tiles::none;
};
using RowSet = RowSetT<float>;

// Per-thread scratch, sized by the driver for M rows (all T buffers 64-byte aligned).
template <class T>
struct ScratchT {
  T* kt = nullptr;           // (Dkp, kTileK) K tile, transposed
  T* kf = nullptr;           // (kTileK, Dkp) K tile, converted to T
  T* vf = nullptr;           // (kTileK, Dvp) V tile, converted to T
  T* s = nullptr;            // (M, kTileK) scores, then probabilities
  T* bias = nullptr;         // (M, kTileK) user mask as additive bias
  T* zero = nullptr;         // max(Dkp, Dvp) zeros, a stand-in row past the end of a tile
  T* qb = nullptr;           // (M, Dkp / 2) Q as bf16 pairs (the avx512bf16 kernels only)
  const T** krow = nullptr;  // kTileK row pointers (to T rows)
  const T** vrow = nullptr;
  const char** kaddr = nullptr;  // 2 x kTileK source row addresses (this tile and the next)
  const char** vaddr = nullptr;
};
using Scratch = ScratchT<float>;

// Running online-softmax state of M rows: O (M, ldo) unnormalised, m the running max, l the sum
// (its rules: attention/state.h).
template <class T>
struct FlashStateT {
  T* o = nullptr;
  int64_t ldo = 0;
  T* m = nullptr;
  T* l = nullptr;
};
using FlashState = FlashStateT<float>;

struct DeltaHead;  // delta_kernels.h

// The flash kernels of one compute type T (what the flash driver calls).
template <class T>
struct FlashKernels {
  // Accumulates keys [j_begin, j_end) into the state (which the driver initialised).
  void (*flash)(const RowSetT<T>& rows, const KVSource& k, const KVSource& v, int64_t j_begin,
                int64_t j_end, int64_t Dk, int64_t Dv, T softcap, const ScratchT<T>& scratch,
                const FlashStateT<T>& state);
  // `flash` for n work items over the same key range, interleaved tile by tile (item g uses
  // rows[g], k[g], v[g] and state[g]; the scratch is shared).
  void (*flash_group)(int n, const RowSetT<T>* rows, const KVSource* k, const KVSource* v,
                      int64_t j_begin, int64_t j_end, int64_t Dk, int64_t Dv, T softcap,
                      const ScratchT<T>& scratch, const FlashStateT<T>* state);
  // Packs keys [j0, j0 + n) (n <= kTileK) transposed into dst (Dkp x kTileK, zero-padded),
  // the layout KVSource::kt holds.
  void (*pack_k)(const KVSource& k, int64_t j0, int64_t n, int64_t Dk, const ScratchT<T>& scratch,
                 T* dst);
  // n elements of `src` (dtype) to T, and back.
  void (*load_row)(const void* src, DType dtype, int64_t n, T* dst);
  void (*store_row)(const T* src, int64_t n, DType dtype, void* dst);
  // The driver's row operations, at the unit's width (the driver is compiled for the baseline):
  // a query row, its D elements times `scale` and zero to Dp; a finished row's O / l and lse
  // (attention/state.h's row::finalize); whether a row's O overflowed (row::overflowed).
  void (*load_query)(const void* src, DType dtype, int64_t D, T scale, int64_t Dp, T* dst);
  bool (*finalize)(const T* o, T m, T l, const T* sink, int64_t Dv, T* out, T* lse);
  bool (*overflowed)(const T* o, T m, T l, int64_t Dv);
};

// The gated delta rule (delta/delta_rule.cpp calls it; delta_kernels.h, delta-inl.h).
struct DeltaKernels {
  // G <= kDeltaGroupMax value heads of one sequence that read the same q and k.
  void (*heads)(const DeltaHead* heads, int G);
};

// The machine probes (runtime/probes.cpp; runtime/dispatch.cpp's path choice).
struct ProbeKernels {
  int lanes;  // float lanes of fma's vectors (its FLOPs per iteration: 10 chains x lanes x 2)
  // Peak-FMA body: `iters` rounds of 10 independent FMA chains; returns a checksum.
  float (*fma)(int64_t iters);
  // Read-bandwidth body: sums n floats.
  float (*read)(const float* p, int64_t n);
  // Multiply-add bodies for the bf16 path choice (avx512bf16 and amx only; null elsewhere):
  // `iters` rounds of 12 independent vdpbf16ps (32 multiply-adds each) and of 12 independent
  // 512-bit FMAs (16 each).
  float (*bf16_dot)(int64_t iters);
  float (*fma512)(int64_t iters);
};

// One instruction set: its name (what cpu_features()['isa'] reports and ATTNX_ISA takes) and its
// table for each operation. A unit kernels/isa_<name>.cpp defines it (docs/architecture.md).
struct IsaTables {
  const char* name;
  const FlashKernels<float>* flash;
  const DeltaKernels* delta;
  const ProbeKernels* probes;
  // Whether `flash` multiplies prefill in bf16 (avx512bf16, amx, neon-bf16): bf16 q, k and v
  // always, float32 ones where RowSet::bf16_products allows it.
  bool bf16_products = false;
  // Whether `flash` computes integer queries' Q K^T with integer dot products (VNNI, AMX-INT8,
  // AVX-VNNI, SDOT: avx2vnni, avx512vnni, avx512bf16, amx, amx-emulated, neon-bf16): where integer
  // queries are the default (attnx::int8_query()).
  bool integer_products = false;
};

const IsaTables* isa_scalar();
const IsaTables* isa_avx2();
const IsaTables* isa_avx2vnni();       // avx2, with AVX-VNNI for integer queries over int8 keys
const IsaTables* isa_avx2vnni_evex();  // avx2vnni over AVX512-VNNI's EVEX form (for tests)
const IsaTables* isa_avx512();
const IsaTables* isa_avx512vnni();    // avx512, with VNNI for integer queries over int8 keys
const IsaTables* isa_avx512bf16();    // avx512, with bf16 dot products for bf16 prefill
const IsaTables* isa_amx();           // avx512, with AMX-BF16 tile products for bf16 prefill
const IsaTables* isa_amx_emulated();  // isa_amx()'s tile loop over emulated tiles (for tests)
const IsaTables* isa_neon();          // aarch64 builds only (ATTNX_NEON_KERNELS)
const IsaTables* isa_neon_bf16();     // neon, with BFDOT for bf16 prefill and SDOT for int8
// The float64 flash kernels: scalar code (float64 is for precision, not speed), one for every CPU.
const FlashKernels<double>* flash_f64();

}  // namespace kern

// The active instruction set's tables (runtime/dispatch.cpp: chosen once, or by ATTNX_ISA).
const kern::IsaTables* active_tables();

}  // namespace attnx
