// dense.cpp: attnx._core.attention, dense attention over (B, H, S, D) arrays.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "args.h"
#include "attnx/attention.h"
#include "out.h"

namespace attnx::bind {
namespace {

enum DenseArg {
  kQ,
  kK,
  kV,
  kMask,
  kKvLens,
  kQLens,
  kCausal,
  kScale,
  kOut,
  kReturnLse,
  kThreads,
  kWindow,
  kSoftcap,
  kSinks,
  kAlibi
};
Signature dense_signature{
    "attention",
    {"q", "k", "v", "mask", "kv_lens", "q_lens", "causal", "scale", "out", "return_lse",
     "num_threads", "window", "softcap", "sinks", "alibi_slopes"},
    3,
    {}};

// The one dtype of q, k and v (float64 included: computed in float64), after their ranks.
DType dense_dtype(const py::array& q, const py::array& k, const py::array& v) {
  check_rank(q, "q", 4, "(B, Hq, Sq, Dk)");
  check_rank(k, "k", 4, "(B, Hkv, Sk, Dk)");
  check_rank(v, "v", 4, "(B, Hkv, Sk, Dv)");
  const DType dt = dtype_of(q, "q", true);
  if (dtype_of(k, "k", true) != dt || dtype_of(v, "v", true) != dt)
    type_error("q, k, v: expected one dtype, got " + dtype_str(q) + ", " + dtype_str(k) + ", " +
               dtype_str(v));
  return dt;
}

template <class T>
void check_dense_qkv(const py::array& q, const py::array& k, const py::array& v, DType dt,
                     BasicAttentionParams<T>& p) {
  p.dtype = dt;
  p.B = q.shape(0);
  p.Hq = q.shape(1);
  p.Sq = q.shape(2);
  p.Dk = q.shape(3);
  p.Hkv = k.shape(1);
  p.Sk = k.shape(2);
  p.Dv = v.shape(3);
  // Positions and lengths are int32 inside the kernels.
  if (p.Sq > std::numeric_limits<int32_t>::max() || p.Sk > std::numeric_limits<int32_t>::max())
    value_error("q, k: sequence lengths must be below 2**31, got Sq=" + std::to_string(p.Sq) +
                ", Sk=" + std::to_string(p.Sk));
  check_shape(k, "k", {{"B", p.B}, {"Hkv", p.Hkv}, {"Sk", p.Sk}, {"Dk", p.Dk}});
  check_shape(v, "v", {{"B", p.B}, {"Hkv", p.Hkv}, {"Sk", p.Sk}, {"Dv", p.Dv}});
  if (p.Hkv == 0 || p.Hq % p.Hkv != 0)
    value_error("k: the number of kv heads (" + std::to_string(p.Hkv) +
                ") must divide the number of query heads (" + std::to_string(p.Hq) + ")");
  auto qs = elem_strides(q, "q"), ks = elem_strides(k, "k"), vs = elem_strides(v, "v");
  p.q = {q.data(), qs[0], qs[1], qs[2]};
  p.k = {k.data(), ks[0], ks[1], ks[2]};
  p.v = {v.data(), vs[0], vs[1], vs[2]};
}

// A boolean or additive mask (float32; float64 with float64 inputs, whose kernels read it as
// double), 4-D and broadcastable to (B, Hq, Sq, Sk); None if none.
template <class T>
py::object dense_mask(py::handle mask, BasicAttentionParams<T>& p) {
  if (mask.is_none()) return py::none();
  py::array m = array_arg(mask, "mask");
  if (m.ndim() != 4) value_error("mask: expected 4 dims after broadcasting to (B, Hq, Sq, Sk)");
  const char kind = m.dtype().kind();
  if (kind == 'b')
    p.mask_kind = MaskKind::boolean;
  else if (kind == 'f' && m.itemsize() == py::ssize_t(sizeof(T)))
    p.mask_kind = MaskKind::additive;
  else
    type_error(std::string("mask: expected a boolean or ") +
               (sizeof(T) == 8 ? "float64" : "float32") + " additive mask, got " + dtype_str(m));
  check_native(m, "mask");
  const int64_t target[4] = {p.B, p.Hq, p.Sq, p.Sk};
  for (int i = 0; i < 4; ++i)
    if (m.shape(i) != target[i] && m.shape(i) != 1)
      value_error("mask: shape " + shape_str(m) + " does not broadcast to " +
                  dims_str({{"B", p.B}, {"Hq", p.Hq}, {"Sq", p.Sq}, {"Sk", p.Sk}}));
  const auto ms = elem_strides(m, "mask", false);  // broadcast axes (extent 1) get stride 0
  p.mask = m.data();
  p.m_sb = ms[0];
  p.m_sh = ms[1];
  p.m_sq = ms[2];
  p.m_sk = ms[3];
  return m;
}

// The optional per-call arrays (lengths, per-head vectors), checked and kept alive for the call.
template <class T>
struct DenseExtras {
  py::object mask;
  py::array_t<int32_t> kv_lens, q_lens;
  py::array_t<T> sinks, alibi;
};

template <class T>
DenseExtras<T> dense_extras(const Args& a, BasicAttentionParams<T>& p) {
  DenseExtras<T> x;
  x.mask = dense_mask(a[kMask], p);
  if (!a[kKvLens].is_none()) {
    x.kv_lens = int_vector(a[kKvLens], "kv_lens", p.B, p.Sk, "Sk");
    p.kv_lens = x.kv_lens.data();
  }
  if (!a[kQLens].is_none()) {
    x.q_lens = int_vector(a[kQLens], "q_lens", p.B, p.Sq, "Sq");
    p.q_lens = x.q_lens.data();
  }
  if (!a[kSinks].is_none()) {
    x.sinks = head_vector<T>(a[kSinks], "sinks", p.Hq);
    p.var.sinks = x.sinks.data();
  }
  if (!a[kAlibi].is_none()) {
    x.alibi = alibi_vector<T>(a[kAlibi], p.Hq, std::max(p.Sq, p.Sk));
    p.var.alibi_slopes = x.alibi.data();
  }
  return x;
}

// Dense attention computed in T: float for float32, float16 and bfloat16, double for float64
// (then scale, the modifiers, an additive mask and lse are float64 too).
template <class T>
py::object dense_call(const Args& a, const py::array& q, const py::array& k, const py::array& v,
                      DType dt) {
  BasicAttentionParams<T> p;
  check_dense_qkv(q, k, v, dt, p);
  p.scale = scale_arg<T>(a[kScale], p.Dk);
  p.causal = a.flag(kCausal, false);
  p.var = variants<T>(a[kWindow], a[kSoftcap]);
  const DenseExtras<T> x = dense_extras(a, p);
  OutTarget o = out_target(a[kOut], "q", p.dtype, q.dtype(),
                           {{"B", p.B}, {"Hq", p.Hq}, {"Sq", p.Sq}, {"Dv", p.Dv}},
                           {q, k, v, x.mask, x.kv_lens, x.q_lens, x.sinks, x.alibi}, true);
  auto os = elem_strides(o.write, "out");
  p.out = o.write.mutable_data();
  p.o_sb = os[0];
  p.o_sh = os[1];
  p.o_ss = os[2];
  const bool return_lse = a.flag(kReturnLse, false);
  py::array_t<T> lse;
  if (return_lse) {
    lse = py::array_t<T>(std::vector<py::ssize_t>{p.B, p.Hq, p.Sq});
    p.lse = lse.mutable_data();
    p.l_sb = p.Hq * p.Sq;
    p.l_sh = p.Sq;
    p.l_ss = 1;
  }
  p.num_threads = threads_arg(int_arg(a[kThreads], "num_threads", 0));
  run_kernel(double(p.B) * double(p.Hq) * double(p.Sq) * double(p.Sk) * double(p.Dk + p.Dv),
             [&] { attention(p); });
  if (return_lse) return py::make_tuple(o.result(), lse);
  return o.result();
}

py::object py_attention(const Args& a) {
  const py::array q = native_input(a[kQ], "q"), k = native_input(a[kK], "k"),
                  v = native_input(a[kV], "v");
  const DType dt = dense_dtype(q, k, v);
  return dt == DType::f64 ? dense_call<double>(a, q, k, v, dt) : dense_call<float>(a, q, k, v, dt);
}

}  // namespace

void bind_dense(py::module_& m) {
  def_entry_point<py_attention, &dense_signature>(
      m,
      "attention(q, k, v, mask=None, kv_lens=None, q_lens=None, causal=False, scale=None, "
      "out=None, "
      "return_lse=False, num_threads=0, window=None, softcap=None, sinks=None, alibi_slopes=None)");
}

}  // namespace attnx::bind
