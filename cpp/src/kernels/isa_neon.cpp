// isa_neon.cpp: every kernel of the neon instruction set: the flash-attention stages and the
// gated delta rule, written once against the vector vocabulary (simd/vec_neon.h) and compiled
// here, and this ISA's tables (tables.h). CMake compiles this unit on aarch64 only, where Advanced
// SIMD is baseline (no flags); dispatch.cpp picks it there.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/state.h"
#include "kernels/delta_kernels.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_neon.h"

namespace attnx {
namespace neon {
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
}  // namespace neon

namespace kern {
namespace {
const FlashKernels<float> kFlash = neon::flash_table();
const DeltaKernels kDelta{&neon::delta::delta_heads};
const ProbeKernels kProbes{neon::simd::W, &neon::fma_probe, &neon::read_probe, nullptr, nullptr};
const IsaTables kIsa{"neon", &kFlash, &kDelta, &kProbes};
}  // namespace

const IsaTables* isa_neon() { return &kIsa; }
}  // namespace kern
}  // namespace attnx
