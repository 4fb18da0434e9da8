// attnx/attention.h: the plain-C++ interface of dense attention (no Python in here); the shared
// vocabulary (DType, MaskKind, Variants, Strided4, InvalidArgument) is in attnx/types.h.
// Every pointer is borrowed; every stride is in elements of the tensor's own dtype; the innermost
// (feature) stride is always 1: callers copy a tensor whose last axis is strided before calling.
#pragma once
#include <cstdint>

#include "attnx/types.h"

namespace attnx {

// Dense attention: q (B, Hq, Sq, Dk), k (B, Hkv, Sk, Dk), v (B, Hkv, Sk, Dv) -> out (B, Hq, Sq,
// Dv). q, k, v and out share `dtype`. Semantics (bottom-right causal, padding, fully masked rows)
// are those of attnx.reference.attention. T is the type everything is computed and accumulated in,
// and that of lse, scale, the modifiers and an additive mask: float for float32, float16 and
// bfloat16 (AttentionParams), double for float64 (AttentionParams64, dtype f64).
template <class T>
struct BasicAttentionParams {
  int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, Dk = 0, Dv = 0;
  DType dtype = sizeof(T) == 8 ? DType::f64 : DType::f32;
  Strided4 q, k, v;
  void* out = nullptr;
  int64_t o_sb = 0, o_sh = 0, o_ss = 0;
  T* lse = nullptr;  // optional (B, Hq, Sq)
  int64_t l_sb = 0, l_sh = 0, l_ss = 0;
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;  // uint8 (boolean, nonzero = may attend) or T (additive)
  int64_t m_sb = 0, m_sh = 0, m_sq = 0, m_sk = 0;  // broadcast axes have stride 0
  const int32_t* kv_lens = nullptr;                // optional (B,)
  const int32_t* q_lens = nullptr;                 // optional (B,)
  bool causal = false;
  T scale = 1;
  BasicVariants<T> var;
  int num_threads = 1;
};
using AttentionParams = BasicAttentionParams<float>;
using AttentionParams64 = BasicAttentionParams<double>;

void attention(const AttentionParams& p);
void attention(const AttentionParams64& p);

}  // namespace attnx
