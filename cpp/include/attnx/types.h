// attnx/types.h: the vocabulary every layer shares (the public APIs, the drivers and the per-ISA
// kernels): element types, mask kinds, score modifiers, strided views and the argument error.
// Kept apart from the entry points so that the kernels see the words and none of the API.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace attnx {

// i8, e4m3, e5m2: quantised KV pages (int8, float8_e4m3fn, float8_e5m2), read as code * scale with
// one float32 scale per row; only pages (never q or out) have these dtypes. f64: dense attention
// only (q, k, v, out all float64, computed in float64); never pages.
enum class DType : int { f32 = 0, f16 = 1, bf16 = 2, i8 = 3, e4m3 = 4, e5m2 = 5, f64 = 6 };
inline std::size_t dtype_size(DType t) {
  return t == DType::f64 ? 8 : t == DType::f32 ? 4 : (t == DType::f16 || t == DType::bf16) ? 2 : 1;
}
inline bool is_quantised(DType t) { return t == DType::i8 || t == DType::e4m3 || t == DType::e5m2; }
const char* dtype_name(DType t);

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// How integer query rows over int8 keys compute Q K^T (set_int8_tiles): the vector kernels
// (VNNI's dot products, or FMAs), AMX-INT8 tiles, or the tiles' portable emulation (the same
// layouts and sums in plain C++, so that the tiling is tested on every CPU).
enum class Int8Tiles : int { none = 0, amx = 1, emulated = 2 };

// Thrown for arguments that the binding could not check (it checks everything it can first).
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Score modifiers shared by every entry point; the defaults switch them off. T is the type the
// scores are computed in: float (float32, float16 and bfloat16 storage), double (float64).
template <class T>
struct BasicVariants {
  int64_t window_left = -1;         // keys j >= pos - window_left are visible; -1: unbounded
  int64_t window_right = -1;        // keys j <= pos + window_right are visible; -1: unbounded
  T softcap = 0;                    // > 0: s = softcap * tanh(s / softcap) before bias and mask
  const T* sinks = nullptr;         // (Hq,) logits in the softmax denominator that carry no value
  const T* alibi_slopes = nullptr;  // (Hq,): s -= slope[h] * |pos - j|
};
using Variants = BasicVariants<float>;

// A strided (B, H, S, D) view: element (b, h, s, d) is at data[b*sb + h*sh + s*ss + d].
struct Strided4 {
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
};

}  // namespace attnx
