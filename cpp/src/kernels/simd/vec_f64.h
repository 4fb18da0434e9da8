// vec_f64.h: the vector vocabulary with one double lane, for the float64 kernels (kernels/f64.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#include "convert.h"

namespace attnx {
namespace f64 {
namespace simd {

using Real = double;  // the type of a lane: float64 inputs are computed in float64
#include "kernels/simd/vec_lane-inl.h"

}  // namespace simd
}  // namespace f64
}  // namespace attnx
