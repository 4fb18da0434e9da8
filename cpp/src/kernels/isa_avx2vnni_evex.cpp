// isa_avx2vnni_evex.cpp: isa_avx2vnni.cpp over AVX512-VNNI's EVEX form of vpdpbusd (256 bits,
// AVX512VL): the avx2vnni path's kernels on CPUs with AVX512-VNNI but not AVX-VNNI, for tests
// (never a default). CMake compiles it with -mavx512vnni -mavx512vl besides the avx2 flags.
#define ATTNX_VNNI_EVEX 1
#include "kernels/isa_avx2vnni.cpp"  // NOLINT(bugprone-suspicious-include): one body, two encodings
