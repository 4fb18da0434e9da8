// kernels_scalar.cpp: the attention micro-kernels for the scalar instruction set. The body is shared
// by every ISA (kernel-inl.h); this file only picks the vector vocabulary and exports the table.
// CMake compiles it with this ISA's flags; dispatch.cpp calls table_scalar() only on CPUs that
// have the instructions.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_scalar.h"

namespace attnx {
namespace scalar {
#include "kernels/kernel-inl.h"
}  // namespace scalar

namespace kern {
const KernelTable* table_scalar() {
  static const KernelTable table{{&scalar::flash, &scalar::flash_group, &scalar::pack_k,
                                   &scalar::load_row, &scalar::store_row},
                                 "scalar",
                                 &scalar::fma_probe, &scalar::read_probe,
                                 &delta_head_scalar, scalar::simd::W};
  return &table;
}
}  // namespace kern
}  // namespace attnx
