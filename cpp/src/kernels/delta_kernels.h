// delta_kernels.h: the contract between the gated delta-rule driver (delta_rule.cpp) and its
// per-ISA kernel (delta-inl.h, compiled once per instruction set by isa_<isa>.cpp and reached
// through DeltaKernels::heads, tables.h). Plain structs and `static` helpers only (see the note
// at the top of tables.h on why nothing here may be an inline function with external linkage).
#pragma once
#include <cstdint>

#include "attnx/attention.h"

namespace attnx {
namespace kern {

constexpr int kDeltaChunk = 16;    // tokens per chunk of the chunked (WY / UT-transform) form. The
                                   // chunk products cost 6 K V per token whatever C is; the pair
                                   // matrices, the solve and P U add 2 C (K + V): a third more at
                                   // C = 64, a twelfth at 16 (bench/NOTES.md)
constexpr int kDeltaSub = 16;      // per-channel gates: sub-chunk whose end is the reference point
                                   // that keeps every exp() of the chunk's decays <= 1
constexpr int kDeltaGroupMax = 4;  // value heads run together on one key head's q and k (their
                                   // pair products are shared), at most
constexpr int kDeltaRecurrentMax = 16;  // automatic mode: sequences up to this long run the
                                        // token-by-token recurrence (decode), longer ones chunked

// One (sequence, value head): T tokens, the head's rows already offset. Byte strides between
// consecutive positions for q, k, v, out; element strides for g and beta (float32).
struct DeltaHead {
  int64_t T = 0, K = 0, V = 0, Kp = 0, Vp = 0;  // Kp, Vp: K, V rounded up to kPad
  DType dtype = DType::f32;
  const char* q = nullptr;
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t q_st = 0, k_st = 0, v_st = 0;
  const float* g = nullptr;  // (T, K) per channel or (T,) per head
  int64_t g_st = 0;
  bool g_per_channel = false;
  const float* beta = nullptr;
  int64_t beta_st = 0;
  char* out = nullptr;
  int64_t o_st = 0;
  float* S = nullptr;  // the state, K rows of Vp floats (row stride lds >= Vp), columns >= V zero
  int64_t lds = 0;
  const float* S_in = nullptr;  // the state before the first token (row stride lds): S itself, or
                                // the caller's initial state, read once instead of copied first
  float scale = 1.f;
  bool l2norm = false;
  bool chunked = true;
  float* work = nullptr;  // the group's delta_work_floats(Kp, Vp, G) floats, 64-byte aligned (the
                          // first head's pointer is the one read)
};

// Scratch floats a group of G heads needs: q, k and their pair products once, the rest per
// head (every segment a multiple of 16 floats, so each stays 64-byte aligned; delta-inl.h
// carves them in this order).
static inline int64_t delta_work_floats(int64_t Kp, int64_t Vp, int G) {
  const int64_t C = kDeltaChunk;
  const int64_t shared = Kp * (2 * C + 1) + 2 * C * C;
  const int64_t head = Kp * (6 * C + kDeltaSub + 1) + Vp * (4 * C + 1) + 2 * C * C + 3 * C;
  return shared + G * head;
}

}  // namespace kern
}  // namespace attnx
