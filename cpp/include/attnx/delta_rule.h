// attnx/delta_rule.h: the plain-C++ interface of gated delta-rule linear attention (no Python in
// here). Per value head, with a float32 state S (K x V):
//   S <- diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale q_t)
// g_t is one log-decay per head (Gated DeltaNet) or one per key channel (Kimi Delta Attention).
#pragma once
#include <cstdint>

#include "attnx/attention.h"

namespace attnx {

// A strided (batch, position, head, feature) view with a contiguous feature axis: element
// (b, t, h, d) is at data[b*sb + t*st + h*sh + d], in elements of the tensor's own dtype.
struct Strided3 {
  const void* data = nullptr;
  int64_t sb = 0, st = 0, sh = 0;
};

enum class DeltaMode : int { automatic = 0, chunked = 1, recurrent = 2 };

// q, k (B, T, Hk, K) and v (B, T, Hv, V) share `dtype`; g (B, T, Hv) or (B, T, Hv, K) and beta
// (B, T, Hv) are float32. Sequence n reads batch row seq_batch[n], positions [seq_start[n],
// seq_start[n] + seq_len[n]); its value head h reads key head h / (Hv / Hk). out (B, T, Hv, V)
// has `dtype`; only the positions of some sequence are written. initial_state (N, Hv, K, V)
// float32 contiguous or null (zeros); final_state likewise or null (not wanted). The two may be
// the same buffer (the state is then updated in place).
struct DeltaRuleParams {
  int64_t N = 0, Hk = 0, Hv = 0, K = 0, V = 0;
  DType dtype = DType::f32;
  Strided3 q, k, v;
  const float* g = nullptr;
  int64_t g_sb = 0, g_st = 0, g_sh = 0;
  bool g_per_channel = false;
  const float* beta = nullptr;
  int64_t beta_sb = 0, beta_st = 0, beta_sh = 0;
  void* out = nullptr;
  int64_t o_sb = 0, o_st = 0, o_sh = 0;
  const int64_t* seq_batch = nullptr;
  const int64_t* seq_start = nullptr;
  const int64_t* seq_len = nullptr;
  const float* initial_state = nullptr;
  float* final_state = nullptr;
  float scale = 1.f;
  bool qk_l2norm = false;
  DeltaMode mode = DeltaMode::automatic;
  int num_threads = 1;
};

void gated_delta_rule(const DeltaRuleParams& p);

}  // namespace attnx
