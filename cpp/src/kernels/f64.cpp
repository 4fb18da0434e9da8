// f64.cpp: the attention micro-kernels for float64 inputs: the flash stages every ISA shares
// (load-inl.h .. tile-inl.h) over a one-lane double vocabulary, so that float64 runs the same
// tiled online softmax (O(S * D) memory) in float64. Scalar on every CPU: float64 is asked for its
// precision (NumPy's default dtype, the reference's), not its speed.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/carve.h"
#include "kernels/tables.h"
#include "attention/state.h"
#include "kernels/simd/vec_f64.h"

namespace attnx {
namespace f64 {
#include "kernels/load-inl.h"
#include "kernels/softmax-inl.h"
#include "kernels/qk-inl.h"
#include "kernels/pv-inl.h"
#include "kernels/int8_tiles-inl.h"
#include "kernels/tile-inl.h"
#include "kernels/probes-inl.h"
}  // namespace f64

namespace kern {
const FlashKernels<double>* flash_f64() {
  static const FlashKernels<double> table = f64::flash_table();
  return &table;
}
}  // namespace kern
}  // namespace attnx
