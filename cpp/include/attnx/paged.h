// attnx/paged.h: attention over a paged KV cache and the writes that fill its pages.
//
// Page layout, per layer: k_pages (num_blocks, Hkv, block_size, Dk), v_pages (num_blocks, Hkv,
// block_size, Dv). A decode work item is one (sequence, kv head): it walks that head's rows of each
// page of the sequence, and with this layout those rows are one contiguous run of
// block_size * D elements per page, which the hardware prefetcher streams at full bandwidth.
#pragma once
#include "attnx/types.h"

namespace attnx {

struct PagedParams {
  int64_t B = 0;  // sequences
  int64_t N = 0;  // packed query tokens, sum of q_lens
  int64_t Hq = 0, Hkv = 0, Dk = 0, Dv = 0;
  DType q_dtype = DType::f32;   // q and out
  DType kv_dtype = DType::f32;  // the pages
  const void* q = nullptr;      // (N, Hq, Dk)
  int64_t q_sn = 0, q_sh = 0;
  const void* k_pages = nullptr;  // (num_blocks, Hkv, block_size, Dk)
  const void* v_pages = nullptr;  // (num_blocks, Hkv, block_size, Dv)
  int64_t num_blocks = 0, block_size = 0;
  int64_t k_sblk = 0, k_sh = 0, k_ss = 0;
  int64_t v_sblk = 0, v_sh = 0, v_ss = 0;
  // Quantised pages (kv_dtype i8, e4m3, e5m2): float32 scales (num_blocks, Hkv, block_size), one
  // per row, element strides (block, head, slot). Null for float pages.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  int64_t ks_sblk = 0, ks_sh = 0, ks_ss = 0;
  int64_t vs_sblk = 0, vs_sh = 0, vs_ss = 0;
  const int32_t* block_tables = nullptr;  // (B, max_blocks), entries checked < num_blocks
  int64_t bt_stride = 0, max_blocks = 0;
  const int32_t* seq_lens = nullptr;  // (B,) kv length including the new tokens
  const int64_t* q_start = nullptr;   // (B + 1,) prefix sums of q_lens
  bool causal = true;
  float scale = 1.f;
  Variants var;
  void* out = nullptr;  // (N, Hq, Dv), q_dtype
  int64_t o_sn = 0, o_sh = 0;
  float* lse = nullptr;  // optional (N, Hq)
  int64_t l_sn = 0, l_sh = 0;
  // Optional: each row's finished part over keys outside this call (float32 output (N, Hq, Dv)
  // and its lse (N, Hq), -inf where it saw none), merged in by log-sum-exp before the row is
  // written: a shared prefix's part, so the tails' call writes the whole result. Null: none.
  const float* prior_out = nullptr;
  int64_t po_sn = 0, po_sh = 0;
  const float* prior_lse = nullptr;
  int64_t pl_sn = 0, pl_sh = 0;
  int num_threads = 1;
};

void paged_attention(const PagedParams& p);

// Writes n new token rows (n, H, D) of `src` (dtype src_dtype) into the pages at the given slots
// (slot = block * block_size + offset), converting to the pages' dtype. Quantised pages also get
// each (token, head) row's scale in `scales` (float32, element strides sc_sblk, sc_sh, sc_ss),
// quantised as attnx.quant.quantize_kv defines; or, with fixed_scale > 0 (fp8 pages), every row
// is quantised with that one scale and none is stored.
struct PagedWrite {
  int64_t n = 0, H = 0, D = 0;
  const void* src = nullptr;
  DType src_dtype = DType::f32;
  int64_t s_sn = 0, s_sh = 0;
  void* pages = nullptr;
  DType page_dtype = DType::f32;
  int64_t block_size = 0, p_sblk = 0, p_sh = 0, p_ss = 0;
  const int64_t* slots = nullptr;
  float* scales = nullptr;
  int64_t sc_sblk = 0, sc_sh = 0, sc_ss = 0;
  float fixed_scale = 0.f;
};

// Quantises one row x (n floats) into codes of `dtype` (i8, e4m3 or e5m2) at dst; returns its
// scale: s = max|x| / qmax, codes = round(clip(x / s)); s = 0 (and zero codes) when s underflows
// or the row is zero; s = NaN (zero codes) when the row holds a NaN or an inf.
float quantise_row(const float* x, int64_t n, DType dtype, void* dst);
// Quantises one row x with a given scale s (> 0, finite) into fp8 codes (e4m3 or e5m2) at dst:
// codes = cast(clip(x / s)) where x is finite, the format's NaN code where it is not.
void quantise_row_fixed(const float* x, int64_t n, DType dtype, float s, uint8_t* dst);
void paged_write(const PagedWrite& w);

// One step of a paged cache: writes the step's new keys and values into their slots, then attends
// over the pages (which then hold them). Everything is checked before the first write. A write
// of n = 0 rows writes nothing: v is empty when the values are a view of the keys (latent
// attention), and both are for a step that only attends.
// With `cascade` (a plan of this step's tables, cascade.h), sequences that share leading blocks
// read them once for all their queries, where the call's variants allow it.
struct CascadePlan;
struct PagedStep {
  PagedParams attend;
  PagedWrite k, v;
  const CascadePlan* cascade = nullptr;
};
void paged_step(const PagedStep& step);

}  // namespace attnx
