// vec_scalar.h: the vector vocabulary with one float lane, for the portable path (no intrinsics).
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#include "convert.h"

namespace attnx {
namespace scalar {
namespace simd {

using Real = float;  // the type of a lane: what the kernels compute in
#include "kernels/simd/vec_lane-inl.h"

}  // namespace simd
}  // namespace scalar
}  // namespace attnx
