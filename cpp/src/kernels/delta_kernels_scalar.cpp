// delta_kernels_scalar.cpp: the gated delta-rule kernel (delta-inl.h) for the scalar instruction set.
// CMake compiles it with this ISA's flags; kernels_scalar.cpp puts delta_head_scalar in its table,
// which dispatch.cpp selects only on CPUs that have the instructions.
#include <cmath>
#include <cstring>

#include "kernels/delta_kernels.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_scalar.h"

namespace attnx {
namespace scalar {
#include "kernels/delta-inl.h"
}  // namespace scalar

namespace kern {
void delta_head_scalar(const DeltaHead* heads, int G) { scalar::delta_heads(heads, G); }
}  // namespace kern
}  // namespace attnx
