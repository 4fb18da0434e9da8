// delta_kernels_avx2.cpp: the gated delta-rule kernel (delta-inl.h) for the avx2 instruction set.
// CMake compiles it with this ISA's flags; kernels_avx2.cpp puts delta_head_avx2 in its table,
// which dispatch.cpp selects only on CPUs that have the instructions.
#include <cmath>
#include <cstring>

#include "kernels/delta_kernels.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_avx2.h"

namespace attnx {
namespace avx2 {
#include "kernels/delta-inl.h"
}  // namespace avx2

namespace kern {
void delta_head_avx2(const DeltaHead* heads, int G) { avx2::delta_heads(heads, G); }
}  // namespace kern
}  // namespace attnx
