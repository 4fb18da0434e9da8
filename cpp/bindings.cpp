// bindings.cpp: the one pybind11 file. It checks every array (shape, dtype, strides, ranges)
// with a message that names the argument, releases the GIL, calls into the C++ core, and maps
// C++ errors to Python exceptions. No maths here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "attnx/attention.h"
#include "attnx/dispatch.h"
#include "attnx/paged.h"
#include "attnx/probes.h"

namespace py = pybind11;
using namespace attnx;

namespace {

std::string shape_str(const py::array& a) {
  std::ostringstream os;
  os << "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

std::string dims_str(std::initializer_list<std::pair<const char*, int64_t>> dims) {
  std::ostringstream os;
  os << "(";
  bool first = true;
  for (auto& d : dims) {
    os << (first ? "" : ", ") << d.first << "=" << d.second;
    first = false;
  }
  os << ")";
  return os.str();
}

// Below this many multiply-adds a call keeps the GIL (the work takes a few microseconds).
constexpr double kGilFreeWork = 1 << 16;

[[noreturn]] void value_error(const std::string& msg) { throw py::value_error(msg); }
[[noreturn]] void type_error(const std::string& msg) { throw py::type_error(msg); }

// An ml_dtypes type's NumPy type number (assigned at registration), or -1 without ml_dtypes.
int ml_dtype_num(const char* name) {
  try {
    return py::module_::import("numpy").attr("dtype")(py::module_::import("ml_dtypes").attr(name)).cast<py::dtype>().num();
  } catch (py::error_already_set&) {
    return -1;
  }
}
int bfloat16_num() {
  static int num = ml_dtype_num("bfloat16");
  return num;
}

// Kind and size decide (dtype.name is computed in Python by NumPy: too slow for a 5 us call).
DType dtype_of(const py::array& a, const char* name) {
  const py::dtype dt = a.dtype();
  if (dt.kind() == 'f' && dt.itemsize() == 4) return DType::f32;
  if (dt.kind() == 'f' && dt.itemsize() == 2) return DType::f16;
  if (dt.itemsize() == 2 && dt.num() == bfloat16_num()) return DType::bf16;
  const std::string got = py::str(dt);
  const char k = dt.kind();
  type_error(std::string(name) + ": expected dtype float32, float16 or bfloat16, got " + got +
             (k == 'f' || k == 'i' || k == 'u' || k == 'b' ? " (cast with .astype(np.float32))" : ""));
}

// The dtype of KV pages: a float dtype, or a quantised one (int8, float8_e4m3fn, float8_e5m2).
DType page_dtype_of(const py::array& a, const char* name) {
  static const int e4m3 = ml_dtype_num("float8_e4m3fn"), e5m2 = ml_dtype_num("float8_e5m2");
  const py::dtype dt = a.dtype();
  if (dt.itemsize() != 1) return dtype_of(a, name);
  if (dt.kind() == 'i') return DType::i8;
  if (dt.num() == e4m3) return DType::e4m3;
  if (dt.num() == e5m2) return DType::e5m2;
  type_error(std::string(name) + ": expected dtype float32, float16, bfloat16, int8, float8_e4m3fn or "
             "float8_e5m2, got " + std::string(py::str(dt)));
}

// Element strides of `a` (which must have `ndim` dims and a unit-stride last axis).
std::vector<int64_t> elem_strides(const py::array& a, const char* name) {
  std::vector<int64_t> s(std::size_t(a.ndim()));
  if (a.size() == 0) return s;  // nothing is read or written: NumPy's strides may be anything
  const int64_t es = int64_t(a.itemsize());
  if (reinterpret_cast<std::uintptr_t>(a.data()) % std::uintptr_t(es) != 0)
    value_error(std::string(name) + ": the array is not aligned to its item size (use np.ascontiguousarray)");
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (a.strides(i) % es != 0) value_error(std::string(name) + ": strides must be multiples of the item size");
    s[std::size_t(i)] = a.strides(i) / es;
  }
  if (a.ndim() > 0 && a.shape(a.ndim() - 1) > 1 && s.back() != 1)
    value_error(std::string(name) + ": the last axis must be contiguous (use np.ascontiguousarray)");
  return s;
}

void check_shape(const py::array& a, const char* name, std::initializer_list<std::pair<const char*, int64_t>> dims) {
  bool ok = a.ndim() == py::ssize_t(dims.size());
  py::ssize_t i = 0;
  for (auto& d : dims) {
    if (ok && a.shape(i) != d.second) ok = false;
    ++i;
  }
  if (!ok) value_error(std::string(name) + ": expected shape " + dims_str(dims) + ", got " + shape_str(a));
}

// An optional (n,) integer array as int32, every value in [0, hi].
py::array_t<int32_t> int_vector(const py::object& obj, const char* name, int64_t n, int64_t hi,
                                const char* hi_name) {
  py::array a = py::array::ensure(obj);
  if (!a) type_error(std::string(name) + ": expected an integer array");
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') type_error(std::string(name) + ": expected an integer array, got dtype " + std::string(py::str(a.dtype())));
  if (a.ndim() != 1 || a.shape(0) != n)
    value_error(std::string(name) + ": expected shape (" + std::to_string(n) + ",), got " + shape_str(a));
  // Lengths are int32 in the kernels: anything larger is refused, never narrowed.
  hi = std::min<int64_t>(hi, std::numeric_limits<int32_t>::max());
  if (kind == 'i' && a.itemsize() == 4) {  // already int32: checked and used as it is (no copy
    py::array_t<int32_t, py::array::c_style | py::array::forcecast> r(a);  // unless strided)
    for (int64_t i = 0; i < n; ++i)
      if (r.data()[i] < 0 || r.data()[i] > hi)
        value_error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(r.data()[i]) +
                    " is out of range [0, " + std::to_string(hi) + "] (" + hi_name + ")");
    return r;
  }
  if (kind == 'u') {
    py::array_t<uint64_t, py::array::c_style | py::array::forcecast> u(a);
    for (int64_t i = 0; i < n; ++i)
      if (u.data()[i] > uint64_t(hi))
        value_error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(u.data()[i]) +
                    " is out of range [0, " + std::to_string(hi) + "] (" + hi_name + ")");
  }
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> w(a);
  const int64_t* p = w.data();
  py::array_t<int32_t> r(n);
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < 0 || p[i] > hi)
      value_error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                  " is out of range [0, " + std::to_string(hi) + "] (" + hi_name + ")");
    r.mutable_data()[i] = int32_t(p[i]);
  }
  return r;
}

// An optional (n,) float32 vector of per-head parameters.
py::array_t<float> head_vector(const py::object& obj, const char* name, int64_t n) {
  py::array a = py::array::ensure(obj);
  const char kind = a ? a.dtype().kind() : 'O';
  if (!a || (kind != 'f' && kind != 'i' && kind != 'u' && a.dtype().num() != bfloat16_num()))
    type_error(std::string(name) + ": expected a real array of shape (" + std::to_string(n) + ",)");
  if (a.ndim() != 1 || a.shape(0) != n)
    value_error(std::string(name) + ": expected shape (Hq=" + std::to_string(n) + ",), got " + shape_str(a));
  py::array_t<float, py::array::c_style | py::array::forcecast> f(py::module_::import("numpy").attr("asarray")(a, "float32"));
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(f.data()[i])) value_error(std::string(name) + ": values must be finite");
  return f;
}

float check_scale(double scale) {
  if (!std::isfinite(scale) || scale <= 0)
    value_error("scale: expected a finite positive number, got " + std::to_string(scale));
  return float(scale);
}

Variants variants(const py::object& window, const py::object& softcap) {
  Variants v;
  if (!window.is_none()) {
    auto t = window.cast<py::tuple>();
    if (t.size() != 2) value_error("window: expected (left, right)");
    int64_t side[2];
    for (int i = 0; i < 2; ++i) {
      if (t[i].is_none()) {
        side[i] = -1;
        continue;
      }
      if (!py::isinstance<py::int_>(t[i]) || py::isinstance<py::bool_>(t[i]))
        type_error("window: sides must be ints or None");
      // A side wider than any sequence is no bound at all: it must not overflow int64 positions.
      const py::int_ huge(int64_t(1) << 40), zero(0);
      if (PyObject_RichCompareBool(t[i].ptr(), zero.ptr(), Py_LT) == 1)
        value_error("window: sides must be >= 0 or None, got " + std::string(py::str(t[i])));
      side[i] = PyObject_RichCompareBool(t[i].ptr(), huge.ptr(), Py_GE) == 1 ? -1 : t[i].cast<int64_t>();
    }
    v.window_left = side[0];
    v.window_right = side[1];
  }
  if (!softcap.is_none()) {
    const double c = softcap.cast<double>();
    if (!std::isfinite(c) || c <= 0) value_error("softcap: expected a finite positive number, got " + std::to_string(c));
    v.softcap = float(c);
  }
  return v;
}

py::array check_out(const py::object& out, const char* what, DType dt, std::initializer_list<std::pair<const char*, int64_t>> dims) {
  py::array o = py::array::ensure(out);
  if (!o) type_error("out: expected a numpy array");
  if (dtype_of(o, "out") != dt) type_error(std::string("out: expected dtype ") + dtype_name(dt) + " (the dtype of " + what + "), got " + std::string(py::str(o.dtype())));
  check_shape(o, "out", dims);
  if (!o.writeable()) value_error("out: array is not writable");
  return o;
}

int threads_arg(int n) {
  if (n < 0) value_error("num_threads: expected a positive int or None");
  return n;
}

// ---- attention ------------------------------------------------------------------------------
py::object py_attention(py::array q, py::array k, py::array v, py::object mask, py::object kv_lens,
                        py::object q_lens, bool causal, double scale, py::object out, bool return_lse,
                        int num_threads, py::object window, py::object softcap, py::object sinks,
                        py::object alibi_slopes) {
  AttentionParams p;
  if (q.ndim() != 4) value_error("q: expected 4 dims (B, Hq, Sq, Dk), got " + shape_str(q));
  if (k.ndim() != 4) value_error("k: expected 4 dims (B, Hkv, Sk, Dk), got " + shape_str(k));
  if (v.ndim() != 4) value_error("v: expected 4 dims (B, Hkv, Sk, Dv), got " + shape_str(v));
  p.dtype = dtype_of(q, "q");
  if (dtype_of(k, "k") != p.dtype || dtype_of(v, "v") != p.dtype)
    type_error(std::string("q, k, v: expected one dtype, got ") + std::string(py::str(q.dtype())) + ", " +
               std::string(py::str(k.dtype())) + ", " + std::string(py::str(v.dtype())));
  p.B = q.shape(0); p.Hq = q.shape(1); p.Sq = q.shape(2); p.Dk = q.shape(3);
  p.Hkv = k.shape(1); p.Sk = k.shape(2); p.Dv = v.shape(3);
  // Positions and lengths are int32 inside the kernels.
  if (p.Sq > std::numeric_limits<int32_t>::max() || p.Sk > std::numeric_limits<int32_t>::max())
    value_error("q, k: sequence lengths must be below 2**31, got Sq=" + std::to_string(p.Sq) +
                ", Sk=" + std::to_string(p.Sk));
  check_shape(k, "k", {{"B", p.B}, {"Hkv", p.Hkv}, {"Sk", p.Sk}, {"Dk", p.Dk}});
  check_shape(v, "v", {{"B", p.B}, {"Hkv", p.Hkv}, {"Sk", p.Sk}, {"Dv", p.Dv}});
  if (p.Hkv == 0 || p.Hq % p.Hkv != 0)
    value_error("k: the number of kv heads (" + std::to_string(p.Hkv) + ") must divide the number of query heads (" + std::to_string(p.Hq) + ")");
  p.scale = check_scale(scale);
  p.causal = causal;
  p.var = variants(window, softcap);
  auto qs = elem_strides(q, "q"), ks = elem_strides(k, "k"), vs = elem_strides(v, "v");
  p.q = {q.data(), qs[0], qs[1], qs[2]};
  p.k = {k.data(), ks[0], ks[1], ks[2]};
  p.v = {v.data(), vs[0], vs[1], vs[2]};

  py::array mask_arr;
  if (!mask.is_none()) {
    mask_arr = py::array::ensure(mask);
    if (mask_arr.ndim() != 4) value_error("mask: expected 4 dims after broadcasting to (B, Hq, Sq, Sk)");
    const int64_t target[4] = {p.B, p.Hq, p.Sq, p.Sk};
    int64_t ms[4];
    const char kind = mask_arr.dtype().kind();
    if (kind == 'b') p.mask_kind = MaskKind::boolean;
    else if (kind == 'f' && mask_arr.itemsize() == 4) p.mask_kind = MaskKind::additive;
    else type_error("mask: expected a boolean or float32 additive mask, got " + std::string(py::str(mask_arr.dtype())));
    for (int i = 0; i < 4; ++i) {
      if (mask_arr.shape(i) != target[i] && mask_arr.shape(i) != 1)
        value_error("mask: shape " + shape_str(mask_arr) + " does not broadcast to " +
                    dims_str({{"B", p.B}, {"Hq", p.Hq}, {"Sq", p.Sq}, {"Sk", p.Sk}}));
      ms[i] = mask_arr.shape(i) == 1 ? 0 : mask_arr.strides(i) / mask_arr.itemsize();
    }
    p.mask = mask_arr.data();
    p.m_sb = ms[0]; p.m_sh = ms[1]; p.m_sq = ms[2]; p.m_sk = ms[3];
  }
  py::array_t<int32_t> kvl, ql;
  if (!kv_lens.is_none()) { kvl = int_vector(kv_lens, "kv_lens", p.B, p.Sk, "Sk"); p.kv_lens = kvl.data(); }
  if (!q_lens.is_none()) { ql = int_vector(q_lens, "q_lens", p.B, p.Sq, "Sq"); p.q_lens = ql.data(); }
  py::array_t<float> sk, al;
  if (!sinks.is_none()) { sk = head_vector(sinks, "sinks", p.Hq); p.var.sinks = sk.data(); }
  if (!alibi_slopes.is_none()) { al = head_vector(alibi_slopes, "alibi_slopes", p.Hq); p.var.alibi_slopes = al.data(); }

  py::array o;
  if (out.is_none()) {
    o = py::array(q.dtype(), std::vector<py::ssize_t>{p.B, p.Hq, p.Sq, p.Dv});
  } else {
    o = check_out(out, "q", p.dtype, {{"B", p.B}, {"Hq", p.Hq}, {"Sq", p.Sq}, {"Dv", p.Dv}});
  }
  auto os = elem_strides(o, "out");
  p.out = o.mutable_data();
  p.o_sb = os[0]; p.o_sh = os[1]; p.o_ss = os[2];
  py::array_t<float> lse;
  if (return_lse) {
    lse = py::array_t<float>(std::vector<py::ssize_t>{p.B, p.Hq, p.Sq});
    p.lse = lse.mutable_data();
    p.l_sb = p.Hq * p.Sq; p.l_sh = p.Sq; p.l_ss = 1;
  }
  p.num_threads = threads_arg(num_threads);
  if (double(p.B) * double(p.Hq) * double(p.Sq) * double(p.Sk) * double(p.Dk + p.Dv) < kGilFreeWork) {
    attention(p);  // a few microseconds: releasing the GIL would cost more than it frees
  } else {
    py::gil_scoped_release nogil;
    attention(p);
  }
  if (return_lse) return py::make_tuple(o, lse);
  return o;
}

// ---- paged attention -----------------------------------------------------------------------
struct PagedArrays {
  py::array_t<int32_t> bt, sl;
  std::vector<int64_t> q_start;
};

void check_pages(const py::array& kp, const py::array& vp, PagedParams& p) {
  if (kp.ndim() != 4) value_error("k_pages: expected 4 dims (num_blocks, Hkv, block_size, Dk), got " + shape_str(kp));
  if (vp.ndim() != 4) value_error("v_pages: expected 4 dims (num_blocks, Hkv, block_size, Dv), got " + shape_str(vp));
  p.kv_dtype = page_dtype_of(kp, "k_pages");
  if (page_dtype_of(vp, "v_pages") != p.kv_dtype) type_error("v_pages: expected the dtype of k_pages");
  p.num_blocks = kp.shape(0); p.Hkv = kp.shape(1); p.block_size = kp.shape(2); p.Dk = kp.shape(3);
  p.Dv = vp.shape(3);
  check_shape(vp, "v_pages", {{"num_blocks", p.num_blocks}, {"Hkv", p.Hkv}, {"block_size", p.block_size}, {"Dv", p.Dv}});
  if (p.block_size <= 0) value_error("k_pages: block_size must be positive");
  if (p.Hkv <= 0) value_error("k_pages: expected at least one kv head, got shape " + shape_str(kp));
  auto ks = elem_strides(kp, "k_pages"), vs = elem_strides(vp, "v_pages");
  p.k_pages = kp.data(); p.k_sblk = ks[0]; p.k_sh = ks[1]; p.k_ss = ks[2];
  p.v_pages = vp.data(); p.v_sblk = vs[0]; p.v_sh = vs[1]; p.v_ss = vs[2];
}

// The scale pages of quantised pages (and only of them): float32 in native byte order,
// (num_blocks, Hkv, block_size), writable when a step writes into them.
py::array scale_pages(const py::object& obj, const char* name, const PagedParams& p, bool quantised,
                      bool write) {
  const std::string n(name);
  if (obj.is_none() != !quantised)
    type_error(n + (quantised ? ": pages of dtype " + std::string(dtype_name(p.kv_dtype)) + " need their float32 scales"
                              : ": only quantised pages (int8, float8_e4m3fn, float8_e5m2) have scales; pass None"));
  if (!quantised) return py::array();
  if (!py::isinstance<py::array>(obj)) type_error(n + ": expected a numpy float32 array, got " + std::string(py::str(obj.get_type())));
  py::array a = py::reinterpret_borrow<py::array>(obj);
  const py::dtype dt = a.dtype();
  if (dt.kind() != 'f' || dt.itemsize() != 4 || !dt.attr("isnative").cast<bool>())
    type_error(n + ": expected float32 in native byte order, got " + std::string(py::str(dt)));
  check_shape(a, name, {{"num_blocks", p.num_blocks}, {"Hkv", p.Hkv}, {"block_size", p.block_size}});
  if (write && !a.writeable()) value_error(n + ": array is not writable (a step stores the new rows' scales)");
  return a;
}

void check_scales(const py::object& k_scales, const py::object& v_scales, bool write, PagedParams& p,
                  py::array& ks, py::array& vs) {
  const bool q = is_quantised(p.kv_dtype);
  ks = scale_pages(k_scales, "k_scales", p, q, write);
  vs = scale_pages(v_scales, "v_scales", p, q, write);
  if (!q) return;
  auto kst = elem_strides(ks, "k_scales"), vst = elem_strides(vs, "v_scales");
  p.k_scales = static_cast<const float*>(ks.data()); p.ks_sblk = kst[0]; p.ks_sh = kst[1]; p.ks_ss = kst[2];
  p.v_scales = static_cast<const float*>(vs.data()); p.vs_sblk = vst[0]; p.vs_sh = vst[1]; p.vs_ss = vst[2];
}

// The new keys and values of a cache step: checked with everything else before the first write.
struct NewKV {
  py::array k, v;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> slots;
  PagedWrite wk, wv;
};

// v_new may be None when the values are a view of the keys (latent attention: one write).
void prepare_new_kv(NewKV& n, py::object k_new, py::object v_new, py::object slots, const PagedParams& p,
                    py::array& kp, py::array& vp, py::array& ksc, py::array& vsc) {
  n.k = py::array::ensure(k_new);
  if (!n.k) type_error("k: expected a numpy array");
  if (!kp.writeable()) value_error("k_pages: array is not writable");
  if (n.k.ndim() != 3) value_error("k: expected 3 dims (T, Hkv, Dk), got " + shape_str(n.k));
  check_shape(n.k, "k", {{"T", p.N}, {"Hkv", p.Hkv}, {"Dk", p.Dk}});
  const DType kd = dtype_of(n.k, "k");
  n.slots = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(slots);
  if (n.slots.ndim() != 1 || n.slots.shape(0) != p.N) value_error("slots: expected shape (T,)");
  for (int64_t t = 0; t < p.N; ++t)
    if (n.slots.data()[t] < 0 || n.slots.data()[t] >= p.num_blocks * p.block_size) value_error("slots: slot out of range");
  auto ks = elem_strides(n.k, "k");
  n.wk = PagedWrite{p.N, p.Hkv, p.Dk, n.k.data(), kd, ks[0], ks[1], kp.mutable_data(), p.kv_dtype,
                    p.block_size, p.k_sblk, p.k_sh, p.k_ss, n.slots.data()};
  if (p.k_scales != nullptr) {
    n.wk.scales = static_cast<float*>(ksc.mutable_data());
    n.wk.sc_sblk = p.ks_sblk; n.wk.sc_sh = p.ks_sh; n.wk.sc_ss = p.ks_ss;
  }
  if (v_new.is_none()) return;
  n.v = py::array::ensure(v_new);
  if (!n.v) type_error("v: expected a numpy array");
  if (!vp.writeable()) value_error("v_pages: array is not writable");
  check_shape(n.v, "v", {{"T", p.N}, {"Hkv", p.Hkv}, {"Dv", p.Dv}});
  const DType vd = dtype_of(n.v, "v");
  auto vs = elem_strides(n.v, "v");
  n.wv = PagedWrite{p.N, p.Hkv, p.Dv, n.v.data(), vd, vs[0], vs[1], vp.mutable_data(), p.kv_dtype,
                    p.block_size, p.v_sblk, p.v_sh, p.v_ss, n.slots.data()};
  if (p.v_scales != nullptr) {
    n.wv.scales = static_cast<float*>(vsc.mutable_data());
    n.wv.sc_sblk = p.vs_sblk; n.wv.sc_sh = p.vs_sh; n.wv.sc_ss = p.vs_ss;
  }
}

py::object py_paged_attention(py::array q, py::array kp, py::array vp, py::array block_tables,
                              py::array seq_lens, py::object q_lens, bool causal, double scale,
                              py::object out, bool return_lse, int num_threads, py::object window,
                              py::object softcap, py::object sinks, py::object alibi_slopes,
                              py::object k_new, py::object v_new, py::object slots,
                              py::object k_scales, py::object v_scales) {
  PagedParams p;
  check_pages(kp, vp, p);
  py::array ksc, vsc;
  check_scales(k_scales, v_scales, !k_new.is_none(), p, ksc, vsc);
  if (q.ndim() != 3) value_error("q: expected 3 dims (N, Hq, Dk), got " + shape_str(q));
  p.q_dtype = dtype_of(q, "q");
  p.N = q.shape(0); p.Hq = q.shape(1);
  check_shape(q, "q", {{"N", p.N}, {"Hq", p.Hq}, {"Dk", p.Dk}});
  if (p.Hq % p.Hkv != 0)
    value_error("k_pages: the number of kv heads (" + std::to_string(p.Hkv) + ") must divide the number of query heads (" + std::to_string(p.Hq) + ")");
  {
    const char kind = block_tables.dtype().kind();
    if (kind != 'i' && kind != 'u') type_error("block_tables: expected an integer array");
  }
  if (block_tables.ndim() != 2) value_error("block_tables: expected 2 dims (B, max_blocks), got " + shape_str(block_tables));
  p.B = block_tables.shape(0); p.max_blocks = block_tables.shape(1);
  PagedArrays keep;
  // An int32 table is read as it is (the usual case: no copy). Any other integer type is
  // range-checked in int64 first (a cast to int32 would wrap 2**32 + b to a valid-looking b) and
  // copied to int32.
  const bool bt_int32 = block_tables.dtype().kind() == 'i' && block_tables.itemsize() == 4;
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> bt64;
  if (bt_int32) {
    keep.bt = py::array_t<int32_t, py::array::c_style | py::array::forcecast>(block_tables);
  } else {
    bt64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(block_tables);
    keep.bt = py::array_t<int32_t>(std::vector<py::ssize_t>{p.B, p.max_blocks});
  }
  keep.sl = int_vector(seq_lens, "seq_lens", p.B, std::numeric_limits<int32_t>::max(), "int32");
  py::array_t<int32_t> ql = q_lens.is_none() ? py::array_t<int32_t>() : int_vector(q_lens, "q_lens", p.B, std::numeric_limits<int32_t>::max(), "int32");
  keep.q_start.assign(std::size_t(p.B + 1), 0);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t nq = q_lens.is_none() ? 1 : ql.data()[b];
    const int64_t len = keep.sl.data()[b];
    if (nq > len) value_error("q_lens[" + std::to_string(b) + "] = " + std::to_string(nq) + " exceeds seq_lens[" + std::to_string(b) + "] = " + std::to_string(len));
    const int64_t nb = (len + p.block_size - 1) / p.block_size;
    if (nb > p.max_blocks) value_error("seq_lens[" + std::to_string(b) + "] = " + std::to_string(len) + " needs " + std::to_string(nb) + " blocks but block_tables has " + std::to_string(p.max_blocks) + " columns");
    for (int64_t j = 0; j < (bt_int32 ? nb : p.max_blocks); ++j) {
      const int64_t blk = bt_int32 ? int64_t(keep.bt.data()[b * p.max_blocks + j])
                                   : bt64.data()[b * p.max_blocks + j];
      if (j < nb && (blk < 0 || blk >= p.num_blocks))
        value_error("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(blk) + " is out of range [0, " + std::to_string(p.num_blocks) + ")");
      if (!bt_int32) keep.bt.mutable_data()[b * p.max_blocks + j] = j < nb ? int32_t(blk) : 0;  // unused entries are never read
    }
    keep.q_start[std::size_t(b + 1)] = keep.q_start[std::size_t(b)] + nq;
  }
  if (keep.q_start.back() != p.N)
    value_error("q: expected N = " + std::string(q_lens.is_none() ? "B" : "sum(q_lens)") + " = " + std::to_string(keep.q_start.back()) + " query tokens, got " + std::to_string(p.N));
  p.block_tables = keep.bt.data(); p.bt_stride = p.max_blocks;
  p.seq_lens = keep.sl.data(); p.q_start = keep.q_start.data();
  p.causal = causal;
  p.scale = check_scale(scale);
  p.var = variants(window, softcap);
  py::array_t<float> sk, al;
  if (!sinks.is_none()) { sk = head_vector(sinks, "sinks", p.Hq); p.var.sinks = sk.data(); }
  if (!alibi_slopes.is_none()) { al = head_vector(alibi_slopes, "alibi_slopes", p.Hq); p.var.alibi_slopes = al.data(); }
  auto qs = elem_strides(q, "q");
  p.q = q.data(); p.q_sn = qs[0]; p.q_sh = qs[1];
  py::array o = out.is_none() ? py::array(q.dtype(), std::vector<py::ssize_t>{p.N, p.Hq, p.Dv})
                              : check_out(out, "q", p.q_dtype, {{"N", p.N}, {"Hq", p.Hq}, {"Dv", p.Dv}});
  auto os = elem_strides(o, "out");
  p.out = o.mutable_data(); p.o_sn = os[0]; p.o_sh = os[1];
  py::array_t<float> lse;
  if (return_lse) {
    lse = py::array_t<float>(std::vector<py::ssize_t>{p.N, p.Hq});
    p.lse = lse.mutable_data(); p.l_sn = p.Hq; p.l_sh = 1;
  }
  p.num_threads = threads_arg(num_threads);
  NewKV nkv;
  const bool write = !k_new.is_none();
  if (write) prepare_new_kv(nkv, k_new, v_new, slots, p, kp, vp, ksc, vsc);
  auto run = [&]() {
    if (write) {
      paged_write(nkv.wk);
      if (nkv.v) paged_write(nkv.wv);
    }
    paged_attention(p);
  };
  double work = 0;
  for (int64_t b = 0; b < p.B; ++b)
    work += double(keep.q_start[std::size_t(b + 1)] - keep.q_start[std::size_t(b)]) * double(keep.sl.data()[b]);
  if (work * double(p.Hq) * double(p.Dk + p.Dv) < kGilFreeWork) {
    run();  // a few microseconds: releasing the GIL would cost more than it frees
  } else {
    py::gil_scoped_release nogil;
    run();
  }
  if (return_lse) return py::make_tuple(o, lse);
  return o;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attnx C++ core (see the attnx package for the documented API)";
  py::register_local_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  m.def("attention", &py_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("kv_lens"), py::arg("q_lens"), py::arg("causal"), py::arg("scale"), py::arg("out"),
        py::arg("return_lse"), py::arg("num_threads"), py::arg("window"), py::arg("softcap"),
        py::arg("sinks"), py::arg("alibi_slopes"));
  m.def("paged_attention", &py_paged_attention, py::arg("q"), py::arg("k_pages"), py::arg("v_pages"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("q_lens"), py::arg("causal"),
        py::arg("scale"), py::arg("out"), py::arg("return_lse"), py::arg("num_threads"),
        py::arg("window"), py::arg("softcap"), py::arg("sinks"), py::arg("alibi_slopes"),
        py::arg("k_new") = py::none(), py::arg("v_new") = py::none(), py::arg("slots") = py::none(),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none());

  m.def("cpu_features", []() {
    const CpuFeatures f = cpu_features();
    py::dict d;
    d["sse2"] = f.sse2; d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avx512f"] = f.avx512f;
    return d;
  });
  m.def("active_isa", []() { return std::string(active_isa()); });
  m.def("set_isa", [](const std::string& name) { set_isa(name); }, py::arg("name"));
  m.def("set_num_threads", [](int n) {
    if (n < 0) value_error("n: expected a positive int (or 0 to follow OpenMP)");
    set_num_threads(n);
  }, py::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("probe_fma_gflops", [](int nt, double seconds) {
    py::gil_scoped_release nogil;
    return probe_fma_gflops(resolve_threads(nt), seconds);
  }, py::arg("num_threads"), py::arg("seconds") = 0.3);
  m.def("probe_read_gbps", [](int nt, int64_t bytes, double seconds) {
    py::gil_scoped_release nogil;
    return probe_read_gbps(resolve_threads(nt), bytes, seconds);
  }, py::arg("num_threads"), py::arg("bytes") = int64_t(1) << 30, py::arg("seconds") = 0.5);
#ifdef _OPENMP
  m.attr("has_openmp") = true;
#else
  m.attr("has_openmp") = false;
#endif
}
