// attnx/attention.h: the plain-C++ interface of the attention kernels (no Python in here).
// Every pointer is borrowed; every stride is in elements of the tensor's own dtype; the innermost
// (feature) stride is always 1: callers copy a tensor whose last axis is strided before calling.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace attnx {

// i8, e4m3, e5m2: quantised KV pages (int8, float8_e4m3fn, float8_e5m2), read as code * scale with
// one float32 scale per row; only pages (never q or out) have these dtypes.
enum class DType : int { f32 = 0, f16 = 1, bf16 = 2, i8 = 3, e4m3 = 4, e5m2 = 5 };
inline std::size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : (t == DType::f16 || t == DType::bf16) ? 2 : 1;
}
inline bool is_quantised(DType t) { return t == DType::i8 || t == DType::e4m3 || t == DType::e5m2; }
const char* dtype_name(DType t);

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// Thrown for arguments that the binding could not check (it checks everything it can first).
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Score modifiers shared by every entry point; the defaults switch them off.
struct Variants {
  int64_t window_left = -1;      // keys j >= pos - window_left are visible; -1: unbounded
  int64_t window_right = -1;     // keys j <= pos + window_right are visible; -1: unbounded
  float softcap = 0.f;           // > 0: s = softcap * tanh(s / softcap) before bias and mask
  const float* sinks = nullptr;  // (Hq,) logits in the softmax denominator that carry no value
  const float* alibi_slopes = nullptr;  // (Hq,): s -= slope[h] * |pos - j|
};

// A strided (B, H, S, D) view: element (b, h, s, d) is at data[b*sb + h*sh + s*ss + d].
struct Strided4 {
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
};

// Dense attention: q (B, Hq, Sq, Dk), k (B, Hkv, Sk, Dk), v (B, Hkv, Sk, Dv) -> out (B, Hq, Sq, Dv).
// q, k, v and out share `dtype`. Semantics (bottom-right causal, padding, fully masked rows) are
// those of attnx.reference.attention.
struct AttentionParams {
  int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, Dk = 0, Dv = 0;
  DType dtype = DType::f32;
  Strided4 q, k, v;
  void* out = nullptr;
  int64_t o_sb = 0, o_sh = 0, o_ss = 0;
  float* lse = nullptr;  // optional (B, Hq, Sq) float32
  int64_t l_sb = 0, l_sh = 0, l_ss = 0;
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;  // uint8 (boolean, nonzero = may attend) or float32 (additive)
  int64_t m_sb = 0, m_sh = 0, m_sq = 0, m_sk = 0;  // broadcast axes have stride 0
  const int32_t* kv_lens = nullptr;  // optional (B,)
  const int32_t* q_lens = nullptr;   // optional (B,)
  bool causal = false;
  float scale = 1.f;
  Variants var;
  int num_threads = 1;
};

void attention(const AttentionParams& p);

}  // namespace attnx
