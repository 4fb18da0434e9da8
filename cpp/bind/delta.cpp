// delta.cpp: attnx._core.gated_delta_rule, gated delta-rule linear attention (attnx/delta_rule.h).
// attnx.gated_delta_rule has already normalised layouts and dtypes: these checks are the last
// line, in the binding's one vocabulary, and name the same arguments.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "attnx/delta_rule.h"

namespace attnx::bind {
namespace {

using Sequences = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// q, k (B, T, Hk, K) and v (B, T, Hv, V) of one dtype, Hk dividing Hv; returns (B, T).
std::pair<int64_t, int64_t> check_qkv(const py::array& q, const py::array& k, const py::array& v,
                                      DeltaRuleParams& p) {
  check_rank(q, "q", 4, "(B, T, Hk, K)");
  check_rank(k, "k", 4, "(B, T, Hk, K)");
  check_rank(v, "v", 4, "(B, T, Hv, V)");
  p.dtype = dtype_of(q, "q");
  if (dtype_of(k, "k") != p.dtype || dtype_of(v, "v") != p.dtype)
    type_error("q, k, v: expected one dtype, got " + dtype_str(q) + ", " + dtype_str(k) + ", " +
               dtype_str(v));
  const int64_t B = q.shape(0), T = q.shape(1);
  p.Hk = q.shape(2);
  p.K = q.shape(3);
  p.Hv = v.shape(2);
  p.V = v.shape(3);
  check_shape(k, "k", {{"B", B}, {"T", T}, {"Hk", p.Hk}, {"K", p.K}});
  check_shape(v, "v", {{"B", B}, {"T", T}, {"Hv", p.Hv}, {"V", p.V}});
  if (p.Hk < 1 || p.Hv % p.Hk != 0)
    value_error("v: the number of value heads (" + std::to_string(p.Hv) +
                ") must be a multiple of the key heads (" + std::to_string(p.Hk) + ")");
  return {B, T};
}

// g (B, T, Hv) or (B, T, Hv, K) (one decay per key channel) and beta (B, T, Hv), float32.
void check_gates(const py::array& g, const py::array& beta, int64_t B, int64_t T,
                 DeltaRuleParams& p) {
  p.g_per_channel = g.ndim() == 4;
  if (p.g_per_channel)
    check_shape(g, "g", {{"B", B}, {"T", T}, {"Hv", p.Hv}, {"K", p.K}});
  else
    check_shape(g, "g", {{"B", B}, {"T", T}, {"Hv", p.Hv}});
  check_shape(beta, "beta", {{"B", B}, {"T", T}, {"Hv", p.Hv}});
}

// sequences (N, 3) rows (batch, start, length), each inside (B, T).
void check_sequences(const Sequences& seqs, int64_t B, int64_t T, DeltaRuleParams& p) {
  if (seqs.ndim() != 2 || seqs.shape(1) != 3)
    value_error("sequences: expected (N, 3) int64 rows (batch, start, length)");
  p.N = seqs.shape(0);
  auto sq = seqs.unchecked<2>();
  for (int64_t n = 0; n < p.N; ++n)
    if (sq(n, 0) < 0 || sq(n, 0) >= B || sq(n, 1) < 0 || sq(n, 2) < 0 || sq(n, 1) + sq(n, 2) > T)
      value_error("sequence " + std::to_string(n) + ": positions [" + std::to_string(sq(n, 1)) +
                  ", " + std::to_string(sq(n, 1) + sq(n, 2)) + ") of batch row " +
                  std::to_string(sq(n, 0)) + " are outside " + dims_str({{"B", B}, {"T", T}}));
}

// initial_state (N, Hv, K, V), C-contiguous float32, or None (zeros).
void check_initial_state(const py::object& initial_state, DeltaRuleParams& p) {
  if (initial_state.is_none()) return;
  py::array s = py::array::ensure(initial_state);
  if (!s || !is_float32(s.dtype()) || !(s.flags() & py::array::c_style))
    type_error("initial_state: expected a C-contiguous float32 array");
  check_shape(s, "initial_state", {{"N", p.N}, {"Hv", p.Hv}, {"K", p.K}, {"V", p.V}});
  p.initial_state = static_cast<const float*>(s.data());
}

// g or beta: float32, as an array the kernels can address (a 4-dim g reads whole rows).
py::array gate_input(const py::array& a, const char* name) {
  if (!(a.dtype().kind() == 'f' && a.itemsize() == 4))
    type_error(std::string(name) + ": expected float32");
  return kernel_input(a, name, a.ndim() == 4);
}

// The inputs' element strides into p (the arrays stay alive in the caller).
void point_inputs(const py::array& q, const py::array& k, const py::array& v, const py::array& g,
                  const py::array& beta, DeltaRuleParams& p) {
  auto qs = elem_strides(q, "q"), ks = elem_strides(k, "k"), vs = elem_strides(v, "v");
  auto gs = elem_strides(g, "g", p.g_per_channel), bs = elem_strides(beta, "beta", false);
  p.q = {q.data(), qs[0], qs[1], qs[2]};
  p.k = {k.data(), ks[0], ks[1], ks[2]};
  p.v = {v.data(), vs[0], vs[1], vs[2]};
  p.g = static_cast<const float*>(g.data());
  p.g_sb = gs[0];
  p.g_st = gs[1];
  p.g_sh = gs[2];
  p.beta = static_cast<const float*>(beta.data());
  p.beta_sb = bs[0];
  p.beta_st = bs[1];
  p.beta_sh = bs[2];
}

struct DeltaInputs {
  py::array q, k, v, g, beta;
};

// Every argument checked; the returned params point into `in` (kept alive by the caller).
DeltaRuleParams check_delta_rule(const DeltaInputs& in, const Sequences& seqs,
                                 const py::object& initial_state, double scale) {
  DeltaRuleParams p;
  const auto [B, T] = check_qkv(in.q, in.k, in.v, p);
  check_gates(in.g, in.beta, B, T, p);
  check_sequences(seqs, B, T, p);
  check_initial_state(initial_state, p);
  if (!std::isfinite(scale)) value_error("scale: expected a finite number");
  p.scale = float(scale);
  point_inputs(in.q, in.k, in.v, in.g, in.beta, p);
  return p;
}

py::object gated_delta_rule(py::array q, py::array k, py::array v, py::array g, py::array beta,
                            Sequences seqs, py::object initial_state, bool output_final_state,
                            double scale, bool qk_l2norm, int mode, int num_threads) {
  const DeltaInputs in{kernel_input(q, "q"), kernel_input(k, "k"), kernel_input(v, "v"),
                       gate_input(g, "g"), gate_input(beta, "beta")};
  DeltaRuleParams p = check_delta_rule(in, seqs, initial_state, scale);
  if (mode < 0 || mode > 2)
    value_error("mode: expected 0 (automatic), 1 (chunked) or 2 (recurrent)");
  if (num_threads < 0) value_error("num_threads: expected a positive int or None");
  auto sq = seqs.unchecked<2>();
  std::vector<int64_t> sb(std::size_t(p.N)), st(std::size_t(p.N)), sl(std::size_t(p.N));
  for (int64_t n = 0; n < p.N; ++n) {
    sb[n] = sq(n, 0);
    st[n] = sq(n, 1);
    sl[n] = sq(n, 2);
  }
  p.seq_batch = sb.data();
  p.seq_start = st.data();
  p.seq_len = sl.data();
  // Positions outside every sequence stay zero.
  py::array o =
      py::module_::import("numpy")
          .attr("zeros")(py::make_tuple(in.q.shape(0), in.q.shape(1), p.Hv, p.V), in.q.dtype())
          .cast<py::array>();
  const auto os = elem_strides(o, "out");
  p.out = o.mutable_data();
  p.o_sb = os[0];
  p.o_st = os[1];
  p.o_sh = os[2];
  py::object final_state = py::none();
  if (output_final_state) {
    py::array_t<float> fs(std::vector<py::ssize_t>{p.N, p.Hv, p.K, p.V});
    p.final_state = fs.mutable_data();
    final_state = fs;
  }
  p.qk_l2norm = qk_l2norm;
  p.mode = DeltaMode(mode);
  p.num_threads = num_threads;
  {
    py::gil_scoped_release nogil;
    attnx::gated_delta_rule(p);
  }
  return py::make_tuple(o, final_state);
}

}  // namespace

void bind_delta(py::module_& m) {
  m.def("gated_delta_rule", &gated_delta_rule, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("sequences"), py::arg("initial_state"),
        py::arg("output_final_state"), py::arg("scale"), py::arg("qk_l2norm"), py::arg("mode"),
        py::arg("num_threads"));
}

}  // namespace attnx::bind
