// kernels_avx2.cpp: the attention micro-kernels for the avx2 instruction set. The body is shared
// by every ISA (kernel-inl.h); this file only picks the vector vocabulary and exports the table.
// CMake compiles it with this ISA's flags; dispatch.cpp calls table_avx2() only on CPUs that
// have the instructions.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_avx2.h"

namespace attnx {
namespace avx2 {
#include "kernels/kernel-inl.h"
}  // namespace avx2

namespace kern {
const KernelTable* table_avx2() {
  static const KernelTable table{{&avx2::flash, &avx2::flash_group, &avx2::pack_k,
                                   &avx2::load_row, &avx2::store_row},
                                 "avx2",
                                 &avx2::fma_probe, &avx2::read_probe,
                                 &delta_head_avx2, avx2::simd::W};
  return &table;
}
}  // namespace kern
}  // namespace attnx
