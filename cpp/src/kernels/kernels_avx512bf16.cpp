// kernels_avx512bf16.cpp: the avx512 kernels, with bf16 dot products (AVX512_BF16's vdpbf16ps)
// for prefill over bf16 q, k and v (bf16_dot-inl.h). Every other call runs avx512's own table
// entries (kernels_avx512.cpp): the same code, bit for bit the same results. kernel-inl.h is
// compiled here again only for the helpers the bf16 tile loop shares (masks, softmax, packing).
// CMake compiles this file with -mavx512bf16 besides the avx512 flags; dispatch.cpp calls
// table_avx512bf16() only on CPUs that have AVX512_BF16 (and AVX512BW/VL, which bf16_dot-inl.h's
// masked 16-bit loads use; every such CPU has them).
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>

#include "kernels/kernels.h"
#include "row_state.h"
#include "kernels/vec_avx512.h"

namespace attnx {
namespace avx512bf16 {
namespace simd = avx512::simd;
#include "kernels/kernel-inl.h"
#include "kernels/bf16_dot-inl.h"
}  // namespace avx512bf16

namespace kern {
const KernelTable* table_avx512bf16() {
  // avx512's table but for `flash` (pack_k stays the fp32 layout's: nothing outside the kernels
  // calls it, and the bf16 path packs its own tiles, pack_k_bf16, into KVSource::kt)
  static const KernelTable table = [] {
    KernelTable t = *table_avx512();
    t.name = "avx512bf16";
    t.flash = &avx512bf16::flash_bf16;
    return t;
  }();
  return &table;
}
}  // namespace kern
}  // namespace attnx
