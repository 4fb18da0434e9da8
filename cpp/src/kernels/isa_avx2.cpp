// isa_avx2.cpp: every kernel of the avx2 instruction set: the flash-attention stages and the
// gated delta rule, written once against the vector vocabulary (simd/vec_avx2.h) and compiled
// here, and this ISA's tables (tables.h). CMake compiles this unit with -mavx2 -mfma -mf16c;
// dispatch.cpp uses it only on CPUs that have AVX2, FMA and F16C.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/state.h"
#include "kernels/delta_kernels.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_avx2.h"

namespace attnx {
namespace avx2 {
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
}  // namespace avx2

namespace kern {
namespace {
const FlashKernels<float> kFlash = avx2::flash_table();
const DeltaKernels kDelta{&avx2::delta::delta_heads};
const ProbeKernels kProbes{avx2::simd::W, &avx2::fma_probe, &avx2::read_probe, nullptr, nullptr};
const IsaTables kIsa{"avx2", &kFlash, &kDelta, &kProbes};
}  // namespace

const IsaTables* isa_avx2() { return &kIsa; }
}  // namespace kern
}  // namespace attnx
