// kernels_amx.cpp: the avx512 kernels, with AMX-BF16 tile products for prefill over bf16 q, k and
// v (amx-inl.h). Every other call runs avx512's own table entries (kernels_avx512.cpp): the
// float32-widening kernels, bit for bit what ATTNX_ISA=avx512 computes. kernel-inl.h and
// bf16_dot-inl.h are compiled here again for what the tile loop shares with them (masks, online
// softmax, the bf16 pair layouts). CMake compiles this file with -mamx-tile -mamx-bf16 besides
// the avx512bf16 flags; dispatch.cpp calls table_amx() only where the CPU has AMX-BF16 and the
// kernel has granted this process the tile state (amx_permitted()).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "row_state.h"
#include "kernels/vec_avx512.h"

namespace attnx {
namespace amx {
namespace simd = avx512::simd;
#include "kernels/kernel-inl.h"
#include "kernels/bf16_dot-inl.h"
#include "kernels/amx-inl.h"
}  // namespace amx

namespace kern {
const KernelTable* table_amx() {
  static const KernelTable table = [] {
    KernelTable t = *table_avx512();
    t.name = "amx";
    t.flash = &amx::flash_amx;
    return t;
  }();
  return &table;
}
}  // namespace kern
}  // namespace attnx
