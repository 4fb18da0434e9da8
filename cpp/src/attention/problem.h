// problem.h: what run_flash needs of a problem (dense tensors, a paged pool): the fields every
// problem shares, in one base, and the member functions an adapter adds, checked at compile time.
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

#include "attnx/dispatch.h"
#include "attnx/types.h"
#include "kernels/tables.h"

namespace attnx {
namespace detail {

// The base of every problem adapter. Sequence b has rows(b) query rows per head, of which the
// first lq(b) are real (the rest are padding, finalised to zeros and lse = -inf), and lk(b) keys.
// Query row i of sequence b sees the keys j with
//   pos = i + lk(b) - lq(b) (bottom-right aligned),   j < pos + 1 if causal,
//   pos - var.window_left <= j <= pos + var.window_right (each bound where >= 0).
// An adapter derives from it, fills these fields and adds (all const, b sequence, h query head,
// kvh kv head, i query row):
//   int64_t rows(b), lq(b), lk(b)
//   const char* q_row(b, h, i)     the query row (q_dtype, Dk elements)
//   void* out_row(b, h, i)         where its output goes (out_dtype, Dv elements)
//   Real* lse_at(b, h, i)          where its lse goes, or null
//   kern::KVSource k_src(b, kvh), v_src(b, kvh)   where the keys and values are
// and, with a user mask (mask_kind != none), mask_row(b, h, i): the address of the row's mask
// element for key 0 (the next key's is mask_sk bytes on). check_problem<P>() checks this list.
// T (Real) is the type the problem is computed in, and that of scale, the modifiers, lse and an
// additive mask: float (float32, float16, bfloat16 storage) or double (float64).
// An adapter may also hide prior(b, h, i): a finished part of the row over keys outside this
// problem (an output of Dv values of T, or null, and its lse), merged in before the row is
// finished (attention/state.h): the shared-prefix path's part of a sequence's attention.
template <class T>
struct BasicFlashProblem {
  using Real = T;
  int64_t B, Hq, Hkv, Dk, Dv;  // Hq is a multiple of Hkv
  T scale;
  bool causal;
  BasicVariants<T> var;
  DType q_dtype, out_dtype;  // q; out (the lse is T)
  // float32 q, k, v may take bf16 products (set_float32_bf16_products): the setting as this
  // problem was made, so that every item of the call sees one value.
  bool bf16_products = float32_bf16_products();
  Int8TilesRule int8_tiles_rule = attnx::int8_tiles_rule();  // (the same, for integer queries)
  bool int8_query = attnx::int8_query();                     // (and whether they are on)
  // No user mask unless an adapter sets one (and hides mask_row with its own).
  MaskKind mask_kind = MaskKind::none;
  int64_t mask_sk = 0;
  const char* mask_row(int64_t, int64_t, int64_t) const { return nullptr; }
  struct Prior {
    const T* out;
    T lse;
  };
  Prior prior(int64_t, int64_t, int64_t) const { return {nullptr, T(0)}; }

  BasicFlashProblem(int64_t B_, int64_t Hq_, int64_t Hkv_, int64_t Dk_, int64_t Dv_, T scale_,
                    bool causal_, const BasicVariants<T>& var_, DType dtype)
      : B(B_),
        Hq(Hq_),
        Hkv(Hkv_),
        Dk(Dk_),
        Dv(Dv_),
        scale(scale_),
        causal(causal_),
        var(var_),
        q_dtype(dtype),
        out_dtype(dtype) {}
};
using FlashProblem = BasicFlashProblem<float>;

namespace contract {
template <class P>
using Rows = decltype(std::declval<const P&>().rows(int64_t()));
template <class P>
using Lq = decltype(std::declval<const P&>().lq(int64_t()));
template <class P>
using Lk = decltype(std::declval<const P&>().lk(int64_t()));
template <class P>
using QRow = decltype(std::declval<const P&>().q_row(int64_t(), int64_t(), int64_t()));
template <class P>
using OutRow = decltype(std::declval<const P&>().out_row(int64_t(), int64_t(), int64_t()));
template <class P>
using LseAt = decltype(std::declval<const P&>().lse_at(int64_t(), int64_t(), int64_t()));
template <class P>
using MaskRow = decltype(std::declval<const P&>().mask_row(int64_t(), int64_t(), int64_t()));
template <class P>
using KSrc = decltype(std::declval<const P&>().k_src(int64_t(), int64_t()));
template <class P>
using VSrc = decltype(std::declval<const P&>().v_src(int64_t(), int64_t()));
// returns<Op, P, R>: P has the member Op names, returning R (false, not an error, if it has none).
template <template <class> class Op, class P, class = void>
struct Detected {
  using type = void;
};
template <template <class> class Op, class P>
struct Detected<Op, P, std::void_t<Op<P>>> {
  using type = Op<P>;
};
template <template <class> class Op, class P, class R>
constexpr bool returns = std::is_same<typename Detected<Op, P>::type, R>::value;
}  // namespace contract

// Fails to compile, naming what is missing, unless P is a problem run_flash can run.
template <class P>
constexpr bool check_problem() {
  using namespace contract;
  using Real = typename P::Real;
  static_assert(std::is_base_of<BasicFlashProblem<Real>, P>::value,
                "a problem derives from BasicFlashProblem (FlashProblem)");
  static_assert(returns<Rows, P, int64_t>, "int64_t P::rows(b) const");
  static_assert(returns<Lq, P, int64_t>, "int64_t P::lq(b) const");
  static_assert(returns<Lk, P, int64_t>, "int64_t P::lk(b) const");
  static_assert(returns<QRow, P, const char*>, "const char* P::q_row(b, h, i) const");
  static_assert(returns<OutRow, P, void*>, "void* P::out_row(b, h, i) const");
  static_assert(returns<LseAt, P, Real*>, "Real* P::lse_at(b, h, i) const");
  static_assert(returns<MaskRow, P, const char*>, "const char* P::mask_row(b, h, i) const");
  static_assert(returns<KSrc, P, kern::KVSource>, "kern::KVSource P::k_src(b, kvh) const");
  static_assert(returns<VSrc, P, kern::KVSource>, "kern::KVSource P::v_src(b, kvh) const");
  return true;
}

}  // namespace detail
}  // namespace attnx
