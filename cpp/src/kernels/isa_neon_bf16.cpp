// isa_neon_bf16.cpp: the neon kernels, with bf16 dot products (FEAT_BF16's BFDOT) for prefill over
// bf16 q, k and v (bf16_dot-inl.h), and FEAT_DotProd's SDOT for integer queries over int8 keys
// (qk-inl.h, ATTNX_INT8_DOT), both in simd/dot_neon.h. Every other call runs the flash stages as
// isa_neon.cpp does: the same code, bit for bit the same results. CMake compiles this unit in
// aarch64 builds only, with BF16 and DotProd (GCC: -march=armv8.2-a+bf16+dotprod, clang:
// -mcpu=generic+bf16+dotprod); dispatch.cpp uses isa_neon_bf16() only on CPUs that report both
// BF16 and DotProd (every one with BF16 has DotProd: Neoverse V1/V2/N2, Graviton 3/4, Apple M2
// and later).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#define ATTNX_INT8_DOT 1

#include "attention/state.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_neon.h"
#include "kernels/simd/dot_neon.h"

namespace attnx {
namespace neon_bf16 {
namespace simd = neon::simd;
namespace dot = neon::dot;
#include "kernels/load-inl.h"
#include "kernels/softmax-inl.h"
#include "kernels/qk-inl.h"
#include "kernels/pv-inl.h"
#include "kernels/int8_tiles-inl.h"
#include "kernels/tile-inl.h"
#include "kernels/bf16_dot-inl.h"
}  // namespace neon_bf16

namespace kern {
const IsaTables* isa_neon_bf16() {
  // neon's tables but for `flash` and `flash_group` (this unit's: bf16 prefill on BFDOT, integer
  // queries on SDOT; pack_k stays the fp32 layout's, as in isa_avx512bf16.cpp)
  static const FlashKernels<float> flash = [] {
    FlashKernels<float> t = *isa_neon()->flash;
    t.flash = &neon_bf16::flash_bf16;
    t.flash_group = &neon_bf16::flash_group;
    return t;
  }();
  static const IsaTables isa{"neon-bf16",        &flash, isa_neon()->delta,
                             isa_neon()->probes, true,   true};
  return &isa;
}
}  // namespace kern
}  // namespace attnx
