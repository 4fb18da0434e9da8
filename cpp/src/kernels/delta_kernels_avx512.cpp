// delta_kernels_avx512.cpp: the gated delta-rule kernel (delta-inl.h) for the avx512 instruction set.
// CMake compiles it with this ISA's flags; kernels_avx512.cpp puts delta_head_avx512 in its table,
// which dispatch.cpp selects only on CPUs that have the instructions.
#include <cmath>
#include <cstring>

#include "kernels/delta_kernels.h"
#include "kernels/tables.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx {
namespace avx512 {
#include "kernels/delta-inl.h"
}  // namespace avx512

namespace kern {
void delta_head_avx512(const DeltaHead* heads, int G) { avx512::delta_heads(heads, G); }
}  // namespace kern
}  // namespace attnx
