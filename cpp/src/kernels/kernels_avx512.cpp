// kernels_avx512.cpp: the attention micro-kernels for the avx512 instruction set. The body is shared
// by every ISA (kernel-inl.h); this file only picks the vector vocabulary and exports the table.
// CMake compiles it with this ISA's flags; dispatch.cpp calls table_avx512() only on CPUs that
// have the instructions.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_avx512.h"

namespace attnx {
namespace avx512 {
#include "kernels/kernel-inl.h"
}  // namespace avx512

namespace kern {
const KernelTable* table_avx512() {
  static const KernelTable table{{&avx512::flash, &avx512::flash_group, &avx512::pack_k,
                                   &avx512::load_row, &avx512::store_row},
                                 "avx512",
                                 &avx512::fma_probe, &avx512::read_probe,
                                 &delta_head_avx512, avx512::simd::W};
  return &table;
}
}  // namespace kern
}  // namespace attnx
