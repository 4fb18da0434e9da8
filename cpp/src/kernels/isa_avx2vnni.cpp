// isa_avx2vnni.cpp: the avx2 kernels, with AVX-VNNI's integer dot products for integer queries
// over int8 keys (qk-inl.h, ATTNX_INT8_DOT; simd/idot_avx2.h): the path of the CPUs with AVX-VNNI
// and no AVX-512 (Intel's Alder Lake and later client cores, Sierra Forest's E-cores). Every
// other call computes what ATTNX_ISA=avx2 does, bit for bit, and so do the integer queries (their
// code sums are exact). CMake compiles this file with -mavxvnni besides the avx2 flags;
// dispatch.cpp uses it where the CPU has AVX2, FMA, F16C and AVX-VNNI.
// With ATTNX_VNNI_EVEX (isa_avx2vnni_evex.cpp, compiled with -mavx512vnni -mavx512vl instead of
// -mavxvnni) the same unit is the table avx2vnni-evex: the same kernels over the EVEX form of the
// same instruction, a path for tests on CPUs with AVX512-VNNI but not AVX-VNNI (Zen 4, Ice Lake).
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
#include "kernels/simd/vec_avx2.h"
#include "kernels/simd/idot_avx2.h"

#if defined(ATTNX_VNNI_EVEX)
#define ATTNX_AVX2VNNI_UNIT avx2vnni_evex
#else
#define ATTNX_AVX2VNNI_UNIT avx2vnni
#endif

namespace attnx {
namespace ATTNX_AVX2VNNI_UNIT {
namespace simd = avx2::simd;
namespace dot = avx2::dot;
#include "kernels/load-inl.h"
#include "kernels/softmax-inl.h"
#include "kernels/qk-inl.h"
#include "kernels/pv-inl.h"
#include "kernels/int8_tiles-inl.h"
#include "kernels/tile-inl.h"
}  // namespace ATTNX_AVX2VNNI_UNIT

namespace kern {
#if defined(ATTNX_VNNI_EVEX)
const IsaTables* isa_avx2vnni_evex() {
  static constexpr const char* kName = "avx2vnni-evex";
#else
const IsaTables* isa_avx2vnni() {
  static constexpr const char* kName = "avx2vnni";
#endif
  // avx2's tables but for `flash` (the delta rule and the probes have no integer products)
  static const FlashKernels<float> flash = [] {
    FlashKernels<float> t = *isa_avx2()->flash;
    t.flash = &ATTNX_AVX2VNNI_UNIT::flash;
    t.flash_group = &ATTNX_AVX2VNNI_UNIT::flash_group;
    return t;
  }();
  static const IsaTables isa{kName, &flash, isa_avx2()->delta, isa_avx2()->probes, false, true};
  return &isa;
}
}  // namespace kern
}  // namespace attnx
