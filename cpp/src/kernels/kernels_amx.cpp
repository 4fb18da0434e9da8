// kernels_amx.cpp: the avx512 kernels, with AMX-BF16 tile products for prefill over bf16 q, k and
// v (amx-inl.h), and AVX512-VNNI for integer queries over int8 keys (kernel-inl.h, ATTNX_VNNI).
// Every other call runs kernel-inl.h's float32-widening kernels, bit for bit what
// ATTNX_ISA=avx512 computes. kernel-inl.h and
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

#define ATTNX_VNNI 1

#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_avx512.h"

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
    t.flash_group = &amx::flash_group;
    return t;
  }();
  return &table;
}
}  // namespace kern
}  // namespace attnx
