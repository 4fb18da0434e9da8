// isa_amx.cpp: the avx512 kernels, with AMX-BF16 tile products for prefill over bf16 q, k and v
// (amx-inl.h) and for bf16 items of 2 to 16 rows (decode: amx_decode-inl.h), and for integer
// queries over int8 keys AMX-INT8 tiles (int8_tiles-inl.h) where dispatch.cpp's int8_tiles says,
// else AVX512-VNNI (qk-inl.h). ATTNX_AMX_TILES: this unit runs the hardware tiles
// (isa_avx512bf16.cpp compiles amx-inl.h and amx_decode-inl.h over their emulation). Every other
// call runs the float32-widening flash stages, bit for bit what ATTNX_ISA=avx512 computes.
// The gated delta rule is avx512's (delta-inl.h) but for bf16 chunked calls, whose products
// against the state run on AMX-BF16 tiles (delta_amx-inl.h).
// The flash stages and bf16_dot-inl.h are compiled here again for what the tile loop shares with
// them (masks, online softmax, the bf16 pair layouts). CMake compiles this file with -mamx-tile
// -mamx-bf16 -mamx-int8 besides the avx512bf16 flags; dispatch.cpp uses isa_amx() only where the
// CPU has AMX-BF16 and the kernel has granted this process the tile state (amx_permitted()).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#define ATTNX_INT8_DOT 1
#define ATTNX_AMX_TILES 1

#include "kernels/delta_kernels.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_avx512.h"
#include "kernels/simd/dot_avx512.h"

namespace attnx {
namespace amx {
namespace simd = avx512::simd;
namespace dot = avx512::dot;
#include "kernels/load-inl.h"
#include "kernels/softmax-inl.h"
#include "kernels/qk-inl.h"
#include "kernels/pv-inl.h"
#include "kernels/int8_tiles-inl.h"
#include "kernels/tile-inl.h"
#include "kernels/probes-inl.h"
#include "kernels/bf16_dot-inl.h"
#include "kernels/amx-inl.h"
#include "kernels/amx_decode-inl.h"
namespace delta {
#define ATTNX_DELTA_TILES 1
#include "kernels/delta_amx-inl.h"
#include "kernels/delta-inl.h"
#undef ATTNX_DELTA_TILES
// The table's delta entry: delta-inl.h's, with the products against the state on tiles for bf16
// chunked calls (the tiles configured once per group of heads).
static void delta_heads_amx(const kern::DeltaHead* hs, int G) {
  if (hs[0].dtype != DType::bf16 || !hs[0].chunked) {
    delta_heads(hs, G);
    return;
  }
  TileScope tiles;
  delta_heads(hs, G);
}
}  // namespace delta
}  // namespace amx

namespace kern {
const IsaTables* isa_amx() {
  // avx512bf16's tables but for `flash` and `flash_group`
  static const FlashKernels<float> flash = [] {
    FlashKernels<float> t = *isa_avx512bf16()->flash;
    t.flash = &amx::flash_amx;
    t.flash_group = &amx::flash_group_amx;
    return t;
  }();
  static const DeltaKernels delta{&amx::delta::delta_heads_amx};
  static const IsaTables isa{"amx", &flash, &delta, isa_avx512bf16()->probes, true, true};
  return &isa;
}
}  // namespace kern
}  // namespace attnx
