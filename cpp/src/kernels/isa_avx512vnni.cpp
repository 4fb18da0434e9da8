// isa_avx512vnni.cpp: the avx512 kernels, with AVX512-VNNI's integer dot products for integer
// queries over int8 keys (qk-inl.h, ATTNX_INT8_DOT; simd/idot_avx512.h) and nothing else of the
// dot-product paths: bf16 runs the float32-widening stages. For the CPUs with VNNI where bf16 dot
// products are not the faster bf16 path: Intel's Cascade Lake and Ice Lake (no AVX512_BF16), and
// Sapphire Rapids and later where the OS refuses AMX (vdpbf16ps there gives half the multiply-adds
// of float32 FMAs). Every other call computes what ATTNX_ISA=avx512 does, bit for bit, and so do
// the integer queries (their code sums are exact).
// CMake compiles this file with -mavx512vnni besides the avx512 flags (AVX-512F/BW/VL), and never
// -mavx512bf16: dispatch.cpp uses it on CPUs with avx512's set and VNNI, BF16 or not.
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
#include "kernels/simd/vec_avx512.h"
#include "kernels/simd/idot_avx512.h"

namespace attnx {
namespace avx512vnni {
namespace simd = avx512::simd;
namespace dot = avx512::dot;
#include "kernels/load-inl.h"
#include "kernels/softmax-inl.h"
#include "kernels/qk-inl.h"
#include "kernels/pv-inl.h"
#include "kernels/int8_tiles-inl.h"
#include "kernels/tile-inl.h"
}  // namespace avx512vnni

namespace kern {
const IsaTables* isa_avx512vnni() {
  // avx512's tables but for `flash` (the delta rule and the probes have no integer products)
  static const FlashKernels<float> flash = [] {
    FlashKernels<float> t = *isa_avx512()->flash;
    t.flash = &avx512vnni::flash;
    t.flash_group = &avx512vnni::flash_group;
    return t;
  }();
  static const IsaTables isa{"avx512vnni",         &flash, isa_avx512()->delta,
                             isa_avx512()->probes, false,  true};
  return &isa;
}
}  // namespace kern
}  // namespace attnx
