// isa_avx512bf16.cpp: the avx512 kernels, with bf16 dot products (AVX512_BF16's vdpbf16ps)
// for prefill over bf16 q, k and v (bf16_dot-inl.h), and AVX512-VNNI's integer dot products for
// integer queries over int8 keys (qk-inl.h, ATTNX_INT8_DOT), both in simd/dot_avx512.h. Every
// other call runs the flash stages as isa_avx512.cpp does: the same code, bit for bit the same
// results. amx-inl.h's and amx_decode-inl.h's tile loops and delta_amx-inl.h's products are
// compiled here too, over the tiles' emulation (no ATTNX_AMX_TILES): isa_amx_emulated(), a path
// for tests, the amx path's layouts and tdpbf16ps sums on CPUs without AMX, far slower than
// either.
// CMake compiles this file with -mavx512bf16 -mavx512vnni besides the avx512 flags;
// dispatch.cpp uses isa_avx512bf16() only on CPUs that have AVX512_BF16, AVX512-VNNI and
// AVX512BW/VL (which dot_avx512.h's masked 16-bit loads use; every CPU with AVX512_BF16 has all
// three).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#define ATTNX_INT8_DOT 1

#include "kernels/delta_kernels.h"
#include "kernels/carve.h"
#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_avx512.h"
#include "kernels/simd/dot_avx512.h"

namespace attnx {
namespace avx512bf16 {
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
namespace delta {  // the delta rule with its bf16 chunked products on the emulated tiles
#define ATTNX_DELTA_TILES 1
#include "kernels/delta_amx-inl.h"
#include "kernels/delta-inl.h"
#undef ATTNX_DELTA_TILES
}  // namespace delta
}  // namespace avx512bf16

namespace kern {
namespace {
// 12 independent chains of each: more than latency x throughput on the CPUs measured (4-5
// cycles x 2 per cycle for FMAs), so the loops time the issue rate, not a dependency.
float bf16_dot_probe(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x33d633d6);  // (1e-7, 1e-7)
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  __m512 s = _mm512_setzero_ps();
  for (int i = 0; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
float fma512_probe(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  __m512 s = _mm512_setzero_ps();
  for (int i = 0; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
}  // namespace

const IsaTables* isa_avx512bf16() {
  // avx512's tables but for `flash` (pack_k stays the fp32 layout's: nothing outside the kernels
  // calls it, and the bf16 path packs its own tiles, pack_k_bf16, into KVSource::kt), and the
  // probes gain the two bodies of the bf16 path choice
  static const FlashKernels<float> flash = [] {
    FlashKernels<float> t = *isa_avx512()->flash;
    t.flash = &avx512bf16::flash_bf16;
    t.flash_group = &avx512bf16::flash_group;
    return t;
  }();
  static const ProbeKernels probes = [] {
    ProbeKernels t = *isa_avx512()->probes;
    t.bf16_dot = &bf16_dot_probe;
    t.fma512 = &fma512_probe;
    return t;
  }();
  static const IsaTables isa{"avx512bf16", &flash, isa_avx512()->delta, &probes, true, true};
  return &isa;
}

const IsaTables* isa_amx_emulated() {
  // isa_amx()'s tables with the tiles emulated: amx-inl.h's flash for bf16 prefill and
  // amx_decode-inl.h's for bf16 items of 2 to 16 rows, the rest the float32-widening kernels (VNNI
  // for integer queries; int8 tiles as set_int8_tiles says), and the delta rule with
  // delta_amx-inl.h's products for bf16 chunked calls
  static const FlashKernels<float> flash = [] {
    FlashKernels<float> t = *isa_avx512bf16()->flash;
    t.flash = &avx512bf16::flash_amx;
    t.flash_group = &avx512bf16::flash_group_amx;
    return t;
  }();
  static const DeltaKernels delta{&avx512bf16::delta::delta_heads};
  static const IsaTables isa{"amx-emulated", &flash, &delta, isa_avx512bf16()->probes, true, true};
  return &isa;
}
}  // namespace kern
}  // namespace attnx
