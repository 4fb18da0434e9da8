// delta_kernels_neon.cpp: the gated delta-rule kernel (delta-inl.h) for the neon instruction set.
// CMake compiles it on aarch64 only (NEON is baseline there); kernels_neon.cpp puts
// delta_head_neon in its table.
#include <cmath>
#include <cstring>

#include "kernels/delta_kernels.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_neon.h"

namespace attnx {
namespace neon {
#include "kernels/delta-inl.h"
}  // namespace neon

namespace kern {
void delta_head_neon(const DeltaHead* heads, int G) { neon::delta_heads(heads, G); }
}  // namespace kern
}  // namespace attnx
