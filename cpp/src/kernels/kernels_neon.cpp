// kernels_neon.cpp: the attention micro-kernels for the neon instruction set. The body is shared
// by every ISA (kernel-inl.h); this file only picks the vector vocabulary and exports the table.
// CMake compiles it on aarch64 only, where NEON is baseline (no flags); dispatch.cpp picks it
// there.
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_neon.h"

namespace attnx {
namespace neon {
#include "kernels/kernel-inl.h"
}  // namespace neon

namespace kern {
const KernelTable* table_neon() {
  static const KernelTable table{{&neon::flash, &neon::flash_group, &neon::pack_k,
                                   &neon::load_row, &neon::store_row},
                                 "neon",
                                 &neon::fma_probe, &neon::read_probe,
                                 &delta_head_neon, neon::simd::W};
  return &table;
}
}  // namespace kern
}  // namespace attnx
