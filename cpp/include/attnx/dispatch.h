// attnx/dispatch.h: CPU detection and the choice of instruction set for the kernels.
#pragma once
#include <string>

#include "attnx/types.h"

namespace attnx {

struct CpuFeatures {
  bool sse2 = false, avx2 = false, fma = false, f16c = false, avx512f = false;  // all false off x86
  bool avx512bw = false, avx512vl = false, avx512bf16 = false;  // (the VNNI paths need BW and VL)
  // Matrix engines and integer dot products (CPUID leaf 7; the AVX-512 ones only where the OS
  // saves the wide registers). amx_permitted: this process may use the tile state (Linux grants
  // it on request, dispatch.cpp); without it a tile instruction is SIGILL.
  bool avx512_vnni = false, avx_vnni = false, avx512_fp16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false, amx_fp16 = false;
  bool amx_permitted = false;
  // aarch64 (all false elsewhere): Advanced SIMD (baseline there: the neon path), the int8 dot
  // products (SDOT), BFloat16 (BFDOT/BFMMLA), int8 matrix multiply (SMMLA) and SVE
  bool neon = false, dotprod = false, bf16 = false, i8mm = false, sve = false;
};

CpuFeatures cpu_features();
// The active instruction set: "scalar", "avx2", "avx2vnni" (avx2, with AVX-VNNI for integer
// queries), "avx512", "avx512vnni" (avx512, with VNNI for integer queries), "avx512bf16"
// (avx512vnni, with bf16 dot products for bf16 prefill) or "amx" (avx512, with AMX-BF16 tiles for
// bf16 prefill); on aarch64 "scalar", "neon" or "neon-bf16" (neon, with BFDOT for bf16 prefill and
// SDOT for integer queries).
const char* active_isa();
// How many more multiply-adds per second this CPU's vdpbf16ps gives than its 512-bit FMAs
// (measured once, at first use; 0 where the CPU lacks AVX512_BF16): the avx512bf16 path is the
// default only where it is above kBf16DotGain.
double bf16_dot_gain();
// vdpbf16ps does twice an FMA's multiply-adds per instruction; where it issues at half the rate
// or less (Intel's Sapphire Rapids: 0.5x the multiply-adds of float32 FMAs, measured) the
// float32-widening kernels are the faster bf16 path, where it issues at an FMA's rate (AMD Zen 4:
// 2x) the bf16 path is. The two are far apart on every CPU measured, so the line sits between.
constexpr double kBf16DotGain = 1.25;
// Forces an instruction set (as ATTNX_ISA does); throws InvalidArgument if the CPU lacks it.
void set_isa(const std::string& name);

// Threads: an explicit global setting (0 = the default at call time: OMP_NUM_THREADS if set, else
// the CPUs this process may run on). Every count is capped at max_threads() (parallel.h).
void set_num_threads(int n);
int get_num_threads();
int resolve_threads(int requested);  // requested > 0 wins, then the global setting, then default
int available_cpus();  // the CPUs this process may run on (sched_getaffinity), read at each call
int max_threads();     // the cap on every count: min(4 x available_cpus(), 1024); see parallel.h
// Workers of the calling thread's pool that have run a region (0 before any, or after a fork
// until the child's first multi-threaded call); for tests.
int pool_workers_used();

// Hands every loaded OpenBLAS that accepts a threading callback (0.3.28+: NumPy's and SciPy's
// wheels) attnx's pool for its parallel regions, or gives them their own back (on = false), so
// that a model's matmul and the attention call after it run on one pool instead of two spinning
// against each other (cpp/src/host_threads.cpp says why). Returns how many libraries now use
// attnx's pool.
int share_blas_threads(bool on);

// Runs attnx's parallel regions on the process's OpenMP team (torch's libgomp), found among the
// loaded libraries, instead of attnx's own pool (on = false: back to the pool). True while a
// team is in use. A fork()ed child uses attnx's pool again (libgomp does not survive fork).
bool share_omp_threads(bool on);

// Integer queries over int8 KV: each query row, times `scale`, is quantised like the keys (s_q =
// max|q| / 127, round half to even) and Q K^T is computed over the codes, exactly (integer dot
// products where the kernels have them), times s_q and each key's scale; off: the float32 query
// against the dequantised keys. The setting: kInt8QueryAuto (the default) turns them on where the
// active path has integer dot products (active_integer_products()), kInt8QueryOff / kInt8QueryOn
// force them. int8_query() is what calls do now.
constexpr int kInt8QueryOff = 0, kInt8QueryOn = 1, kInt8QueryAuto = -1;
void set_int8_query(int setting);  // InvalidArgument for anything but the three values
int int8_query_setting();
bool int8_query();
// Whether the active instruction set computes integer queries' Q K^T with integer dot products
// (AVX512-VNNI and AMX-INT8 on avx512vnni, avx512bf16, amx, amx-emulated; AVX-VNNI on avx2vnni;
// SDOT on neon-bf16).
bool active_integer_products();

// float32 callers' opt-in to bf16 products (off by default; attnx.set_float32_precision): where
// the active path multiplies prefill in bf16 (active_bf16_products()), float32 q, k and v prefill
// takes those products too, q, k, v and P rounded to bf16 (round to nearest even), O, the sums
// and the lse float32. Elsewhere, and for decode, it changes nothing. Read once per call.
void set_float32_bf16_products(bool on);
bool float32_bf16_products();
// Whether the active instruction set multiplies prefill in bf16 (avx512bf16, amx).
bool active_bf16_products();
// Where integer queries take int8 tiles for Q K^T (tdpbssd: int8 x int8 -> int32): "auto" (the
// default) on AMX-INT8 where the amx path runs, "off" never (the vector kernels), "emulate" on
// the tiles' portable emulation on every path (for tests); for items of at least `min_rows` query
// rows (1 .. kDotRows + 1; by default kern::kInt8TileRows: items of up to 16 rows read K in place
// on the tiles, more rows pack it).
// InvalidArgument names a bad mode or min_rows.
void set_int8_tiles(const std::string& mode, int min_rows);
std::string int8_tiles_mode();
int int8_tiles_min_rows();
// The setting as one value (mode: 0 auto, 1 off, 2 emulate), read once per call like
// float32_bf16_products(), so that a change from another thread never splits a call's items.
struct Int8TilesRule {
  int mode;
  int min_rows;
};
Int8TilesRule int8_tiles_rule();
// The one choice: how an item of `rows` integer query rows computes Q K^T on the active path.
Int8Tiles int8_tiles(int rows, Int8TilesRule rule);

}  // namespace attnx
