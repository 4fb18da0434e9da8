// isa_avx512.cpp: every kernel of the avx512 instruction set: the flash-attention stages and the
// gated delta rule, written once against the vector vocabulary (simd/vec_avx512.h) and compiled
// here, and this ISA's tables (tables.h). CMake compiles this unit with the AVX-512F/BW/VL flags;
// dispatch.cpp uses it only on CPUs that have them (and AVX2's set).
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/state.h"
#include "kernels/delta_kernels.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx {
namespace avx512 {
#include "kernels/load-inl.h"
#include "kernels/softmax-inl.h"
#include "kernels/qk-inl.h"
#include "kernels/pv-inl.h"
#include "kernels/int8_tiles-inl.h"
#include "kernels/tile-inl.h"
#include "kernels/probes-inl.h"
namespace delta {
#include "kernels/delta-inl.h"
}  // namespace delta
}  // namespace avx512

namespace kern {
namespace {
const FlashKernels<float> kFlash = avx512::flash_table();
const DeltaKernels kDelta{&avx512::delta::delta_heads};
const ProbeKernels kProbes{avx512::simd::W, &avx512::fma_probe, &avx512::read_probe, nullptr,
                           nullptr};
const IsaTables kIsa{"avx512", &kFlash, &kDelta, &kProbes};
}  // namespace

const IsaTables* isa_avx512() { return &kIsa; }
}  // namespace kern
}  // namespace attnx
