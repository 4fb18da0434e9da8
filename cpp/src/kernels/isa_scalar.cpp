// isa_scalar.cpp: every kernel of the scalar instruction set: the flash-attention stages and the
// gated delta rule, written once against the vector vocabulary (simd/vec_scalar.h) and compiled
// here, and this ISA's tables (tables.h). the portable scalar kernels (one float lane), for every
// CPU: CMake compiles this unit without flags; it is the path where nothing wider is, and
// ATTNX_ISA=scalar.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/state.h"
#include "kernels/delta_kernels.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_scalar.h"

namespace attnx {
namespace scalar {
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
}  // namespace scalar

namespace kern {
namespace {
const FlashKernels<float> kFlash = scalar::flash_table();
const DeltaKernels kDelta{&scalar::delta::delta_heads};
const ProbeKernels kProbes{scalar::simd::W, &scalar::fma_probe, &scalar::read_probe, nullptr,
                           nullptr};
const IsaTables kIsa{"scalar", &kFlash, &kDelta, &kProbes};
}  // namespace

const IsaTables* isa_scalar() { return &kIsa; }
}  // namespace kern
}  // namespace attnx
