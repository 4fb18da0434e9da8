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
#include "attnx/delta_rule.h"
#include "attnx/dispatch.h"
#include "attnx/paged.h"
#include "attnx/probes.h"
#include "bind/cascade.h"
#include "src/cascade.h"

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

// ---- dtypes, byte order and strides ----------------------------------------------------------
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
constexpr char kNativeOrder = '>';
#else
constexpr char kNativeOrder = '<';
#endif

// Kind, size and byte order decide (dtype.name is computed in Python by NumPy: too slow for a
// 5 us call). A byte-swapped array would be read as garbage, so every dtype check asks for the
// native order: inputs are converted to it first (native_input), what is written in place (pages,
// `out`) is refused.
bool native_order(const py::dtype& dt) {
  const char b = dt.byteorder();
  return b == '=' || b == '|' || b == kNativeOrder;
}

std::string dtype_str(const py::array& a) { return std::string(py::str(a.dtype())); }

void check_native(const py::array& a, const char* name) {
  if (!native_order(a.dtype()))
    type_error(std::string(name) + ": expected native byte order, got dtype " + dtype_str(a) +
               " (convert with a.astype(a.dtype.newbyteorder('=')))");
}

// A float storage dtype; float64 too where `f64_ok` (dense attention computes it in float64; pages
// and the other entry points have no float64 path).
DType dtype_of(const py::array& a, const char* name, bool f64_ok = false) {
  const py::dtype dt = a.dtype();
  check_native(a, name);
  if (dt.kind() == 'f' && dt.itemsize() == 4) return DType::f32;
  if (dt.kind() == 'f' && dt.itemsize() == 2) return DType::f16;
  if (dt.itemsize() == 2 && dt.num() == bfloat16_num()) return DType::bf16;
  if (f64_ok && dt.kind() == 'f' && dt.itemsize() == 8) return DType::f64;
  const char k = dt.kind();
  const bool f64 = k == 'f' && dt.itemsize() == 8;  // here only where there is no float64 path
  type_error(std::string(name) + ": expected dtype float32, float16" + (f64_ok ? ", bfloat16 or float64" : " or bfloat16") +
             ", got " + dtype_str(a) +
             (f64 ? " (float64 runs only in dense attention, attnx.attention; cast with .astype(np.float32))"
                  : k == 'f' || k == 'i' || k == 'u' || k == 'b' ? " (cast with .astype(np.float32))" : ""));
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
             "float8_e5m2, got " + dtype_str(a));
}

// A read-only array argument in native byte order (a byte-swapped one is converted: one copy).
py::array native_input(py::handle obj, const char* name) {
  py::array a = py::array::ensure(obj);
  if (!a) type_error(std::string(name) + ": expected a numpy array");
  if (native_order(a.dtype())) return a;
  return py::array::ensure(a.attr("astype")(a.dtype().attr("newbyteorder")("=")));
}

// NumPy's ALIGNED flag: asked of every array that pybind11 converts here, so that a misaligned
// integer array is copied rather than read through a misaligned pointer. The conversion also
// brings any byte order to the native one.
constexpr int kAligned = py::detail::npy_api::NPY_ARRAY_ALIGNED_;
template <typename T>
using Native = py::array_t<T, py::array::c_style | py::array::forcecast | kAligned>;

// Why the kernels cannot address `a` through element strides, or nullptr if they can. Axes of
// extent 1 are never stepped, so their strides (NumPy may report anything there) do not count.
const char* stride_problem(const py::array& a, bool unit_last) {
  if (a.size() == 0) return nullptr;  // nothing is read or written
  const auto es = a.itemsize();
  if (reinterpret_cast<std::uintptr_t>(a.data()) % std::uintptr_t(es) != 0)
    return "the array is not aligned to its item size (copy it with np.array(a))";
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) > 1 && a.strides(i) % es != 0)
      return "byte strides must be multiples of the item size (a field of a structured array? "
             "copy it with np.array(a))";
  if (unit_last && a.ndim() > 0 && a.shape(a.ndim() - 1) > 1 && a.strides(a.ndim() - 1) != es)
    return "the last axis must be contiguous (use np.ascontiguousarray)";
  return nullptr;
}

// Element strides of `a` (0 on axes of extent 1); refuses what element strides cannot express.
std::vector<int64_t> elem_strides(const py::array& a, const char* name, bool unit_last = true) {
  if (const char* why = stride_problem(a, unit_last)) value_error(std::string(name) + ": " + why);
  std::vector<int64_t> s(std::size_t(a.ndim()), 0);
  if (a.size() == 0) return s;
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) > 1) s[std::size_t(i)] = a.strides(i) / a.itemsize();
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

[[noreturn]] void out_of_range(const char* name, int64_t i, const std::string& value, int64_t hi,
                               const char* hi_name) {
  value_error(std::string(name) + "[" + std::to_string(i) + "] = " + value + " is out of range [0, " +
              std::to_string(hi) + "] (" + hi_name + ")");
}

// An optional (n,) integer array as int32, every value in [0, hi].
py::array_t<int32_t> int_vector(py::handle obj, const char* name, int64_t n, int64_t hi,
                                const char* hi_name) {
  py::array a = py::array::ensure(obj);
  if (!a) type_error(std::string(name) + ": expected an integer array");
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') type_error(std::string(name) + ": expected an integer array, got dtype " + dtype_str(a));
  if (a.ndim() != 1 || a.shape(0) != n)
    value_error(std::string(name) + ": expected shape (" + std::to_string(n) + ",), got " + shape_str(a));
  // Lengths are int32 in the kernels: anything larger is refused, never narrowed.
  hi = std::min<int64_t>(hi, std::numeric_limits<int32_t>::max());
  if (kind == 'i' && a.itemsize() == 4) {  // already int32: checked and used as it is (no copy
    Native<int32_t> r(a);                   // unless strided, misaligned or byte-swapped)
    for (int64_t i = 0; i < n; ++i)
      if (r.data()[i] < 0 || r.data()[i] > hi) out_of_range(name, i, std::to_string(r.data()[i]), hi, hi_name);
    return r;
  }
  if (kind == 'u') {
    Native<uint64_t> u(a);
    for (int64_t i = 0; i < n; ++i)
      if (u.data()[i] > uint64_t(hi)) out_of_range(name, i, std::to_string(u.data()[i]), hi, hi_name);
  }
  Native<int64_t> w(a);
  const int64_t* p = w.data();
  py::array_t<int32_t> r(n);
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < 0 || p[i] > hi) out_of_range(name, i, std::to_string(p[i]), hi, hi_name);
    r.mutable_data()[i] = int32_t(p[i]);
  }
  return r;
}

// ---- scalars ---------------------------------------------------------------------------------
// The kernels hold scale and softcap in float32 (and use 1/softcap): outside float32's normal
// range a value would become inf or 0, or its reciprocal overflow, and change the result without
// a word. Refused there, with the range. The float64 kernels take them as doubles, within the
// same range (one rule for every dtype).
constexpr double kFloatMin = double(std::numeric_limits<float>::min());  // smallest normal
constexpr double kFloatMax = double(std::numeric_limits<float>::max());

std::string num_str(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// x as T (float, or double for the float64 kernels), once it is within float32's normal range.
template <class T = float>
T positive_float(double x, const char* name) {
  if (!(x >= kFloatMin && x <= kFloatMax))
    value_error(std::string(name) + ": expected a finite positive number within float32's normal range [" +
                num_str(kFloatMin) + ", " + num_str(kFloatMax) + "], got " + num_str(x));
  return T(x);
}

// The name of a Python object's type, for error messages ("list", "Tensor").
std::string type_name(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

double real_arg(py::handle h, const char* name) {
  if (PyBool_Check(h.ptr())) type_error(std::string(name) + ": expected a float, got bool");
  const double x = PyFloat_AsDouble(h.ptr());
  if (x == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    type_error(std::string(name) + ": expected a float, got " + type_name(h));
  }
  return x;
}

// None: the default 1/sqrt(Dk).
template <class T = float>
T scale_arg(py::handle h, int64_t Dk) {
  if (h.is_none()) {
    if (Dk == 0) value_error("scale: the default 1/sqrt(Dk) needs Dk > 0");
    return T(1.0 / std::sqrt(double(Dk)));
  }
  return positive_float<T>(real_arg(h, "scale"), "scale");
}

int64_t int_arg(py::handle h, const char* name, int64_t dflt) {
  if (h.is_none()) return dflt;
  if (PyBool_Check(h.ptr())) type_error(std::string(name) + ": expected an int, got a bool");
  py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(h.ptr()));
  if (!i) {
    PyErr_Clear();
    type_error(std::string(name) + ": expected an int, got " + type_name(h));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow) value_error(std::string(name) + ": " + std::string(py::str(h)) + " is out of range");
  return int64_t(v);
}

// An optional (n,) vector of per-head float parameters, as T (float32; float64 for the float64
// kernels): finite and within float32's range (a float64 1e39 would become inf in float32).
template <class T = float>
py::array_t<T> head_vector(py::handle obj, const char* name, int64_t n) {
  py::array a = py::array::ensure(obj);
  const char kind = a ? a.dtype().kind() : 'O';
  if (!a || (kind != 'f' && kind != 'i' && kind != 'u' && a.dtype().num() != bfloat16_num()))
    type_error(std::string(name) + ": expected a real array of shape (" + std::to_string(n) + ",)");
  if (a.ndim() != 1 || a.shape(0) != n)
    value_error(std::string(name) + ": expected shape (Hq=" + std::to_string(n) + ",), got " + shape_str(a));
  Native<double> d(py::module_::import("numpy").attr("asarray")(a, "float64"));
  py::array_t<T> f(n);
  for (int64_t i = 0; i < n; ++i) {
    const double x = d.data()[i];
    if (!(std::fabs(x) <= kFloatMax))
      value_error(std::string(name) + ": values must be finite and within float32's range, got " +
                  num_str(x) + " at [" + std::to_string(i) + "]");
    f.mutable_data()[i] = T(x);
  }
  return f;
}

template <class T = float>
BasicVariants<T> variants(py::handle window, py::handle softcap) {
  BasicVariants<T> v;
  if (!window.is_none()) {
    if (!py::isinstance<py::tuple>(window) && !py::isinstance<py::list>(window))
      value_error("window: expected (left, right)");
    auto t = py::reinterpret_borrow<py::sequence>(window);
    if (t.size() != 2) value_error("window: expected (left, right)");
    int64_t side[2];
    for (int i = 0; i < 2; ++i) {
      const py::object s = t[i];
      if (s.is_none()) {
        side[i] = -1;
        continue;
      }
      if (!py::isinstance<py::int_>(s) || py::isinstance<py::bool_>(s))
        type_error("window: sides must be ints or None");
      // A side wider than any sequence is no bound at all: it must not overflow int64 positions.
      const py::int_ huge(int64_t(1) << 40), zero(0);
      if (PyObject_RichCompareBool(s.ptr(), zero.ptr(), Py_LT) == 1)
        value_error("window: sides must be >= 0 or None, got " + std::string(py::str(s)));
      side[i] = PyObject_RichCompareBool(s.ptr(), huge.ptr(), Py_GE) == 1 ? -1 : s.cast<int64_t>();
    }
    v.window_left = side[0];
    v.window_right = side[1];
  }
  if (!softcap.is_none()) v.softcap = positive_float<T>(real_arg(softcap, "softcap"), "softcap");
  return v;
}

// A call's thread count; 0 (None) is resolved here, so that a bad default (ATTNX_NUM_THREADS)
// is refused before a step writes its new keys, not after.
int threads_arg(int64_t n) {
  if (n < 0 || n > std::numeric_limits<int>::max()) value_error("num_threads: expected a positive int or None");
  return n == 0 ? get_num_threads() : int(n);
}

// ---- out -------------------------------------------------------------------------------------
// The bytes [first, last] that `a` spans: np.may_share_memory's rule (no overlap for an empty array).
bool may_share_memory(const py::array& a, const py::array& b) {
  if (a.size() == 0 || b.size() == 0) return false;
  auto span = [](const py::array& x) {
    auto lo = reinterpret_cast<std::intptr_t>(x.data()), hi = lo;
    for (py::ssize_t i = 0; i < x.ndim(); ++i) {
      const std::intptr_t step = std::intptr_t(x.shape(i) - 1) * std::intptr_t(x.strides(i));
      (step < 0 ? lo : hi) += step;
    }
    return std::make_pair(lo, hi + std::intptr_t(x.itemsize()) - 1);
  };
  const auto sa = span(a), sb = span(b);
  return sa.first <= sb.second && sb.first <= sa.second;
}

// Whether two elements of `a` share a byte (a broadcast view, an `expand`ed tensor, as_strided):
// written there, one element's result would replace another's. Exact: axes of extent 1 are never
// stepped; sorted by |stride|, each axis stepping past everything the smaller ones span rules
// overlap out (every ordinary, transposed or sliced array), a zero stride rules it in, and
// anything else (interleaved strides) is settled by marking each element's bytes.
bool self_overlaps(const py::array& a) {
  if (a.size() <= 1) return false;
  const int64_t es = int64_t(a.itemsize());
  std::vector<std::pair<int64_t, int64_t>> axes;  // (|byte stride|, extent) of stepped axes
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) > 1) axes.emplace_back(std::abs(int64_t(a.strides(i))), int64_t(a.shape(i)));
  std::sort(axes.begin(), axes.end());
  if (axes.front().first == 0) return true;
  int64_t span = es;  // bytes spanned by the axes before this one
  bool nested = true;
  for (auto& [stride, n] : axes) {
    if (stride < span) { nested = false; break; }
    span += stride * (n - 1);
  }
  if (nested) return false;
  span = es;
  for (auto& [stride, n] : axes) span += stride * (n - 1);
  std::vector<bool> used(std::size_t(span), false);
  std::vector<int64_t> idx(axes.size(), 0);
  for (int64_t off = 0;;) {  // odometer over the elements, offsets from the lowest address
    for (int64_t b = off; b < off + es; ++b) {
      if (used[std::size_t(b)]) return true;
      used[std::size_t(b)] = true;
    }
    std::size_t d = 0;
    for (; d < axes.size(); ++d) {
      off += axes[d].first;
      if (++idx[d] < axes[d].second) break;
      off -= axes[d].first * axes[d].second;
      idx[d] = 0;
    }
    if (d == axes.size()) return false;
  }
}

// Where the kernel writes a call's result. `out` (checked first: dtype, byte order, shape,
// writable) is written directly when the kernel can address it and it shares no memory with
// anything the call reads; otherwise the kernel writes a fresh array that result() copies into
// `out`, so an `out` aliasing q, the pages or a mask never changes what is read. Every entry
// point with `out=` goes through here. An `out` that element strides cannot address is copied
// into the same way where `strided_ok` (dense attention's contract), refused otherwise.
struct OutTarget {
  py::object out = py::none();  // the caller's array, or None
  py::array write;  // what the kernel writes
  py::object result() const {
    if (out.is_none()) return write;
    if (!out.is(write)) {
      static const py::handle copyto = py::object(py::module_::import("numpy").attr("copyto")).release();  // kept for good
      copyto(out, write);
    }
    return out;
  }
};

OutTarget out_target(py::handle out, const char* of, DType dt, const py::dtype& fresh,
                     std::initializer_list<std::pair<const char*, int64_t>> dims,
                     std::initializer_list<py::handle> reads, bool strided_ok) {
  std::vector<py::ssize_t> shape;
  for (auto& d : dims) shape.push_back(d.second);
  OutTarget t;
  if (out.is_none()) {
    t.write = py::array(fresh, shape);
    return t;
  }
  if (!py::isinstance<py::array>(out)) type_error("out: expected a numpy array");
  const auto o = py::reinterpret_borrow<py::array>(out);
  if (dtype_of(o, "out", true) != dt)
    type_error(std::string("out: expected dtype ") + dtype_name(dt) + " (the dtype of " + of + "), got " + dtype_str(o));
  check_shape(o, "out", dims);
  if (!o.writeable()) value_error("out: array is not writable");
  if (self_overlaps(o))
    value_error("out: elements of the array overlap one another (a broadcast or expanded view, "
                "byte strides " + std::string(py::str(o.attr("strides"))) + "): each result needs its own memory; pass a fresh array");
  if (!strided_ok) elem_strides(o, "out");  // refuses what the kernel cannot address
  bool direct = stride_problem(o, true) == nullptr;
  for (py::handle r : reads)
    if (direct && py::isinstance<py::array>(r)) direct = !may_share_memory(o, py::reinterpret_borrow<py::array>(r));
  t.out = o;
  t.write = direct ? o : py::array(fresh, shape);
  return t;
}

// ---- calls -----------------------------------------------------------------------------------
// The entry points are METH_FASTCALL functions that bind their arguments here, by name, as Python
// does (positional first, then keywords). pybind11's dispatcher looks every declared parameter up
// by string (about 60 ns each: a quarter of a small call with fifteen of them); a caller's keyword
// names are interned, so they match here by pointer. Bad values get errors that name them.
struct Signature {
  const char* function;
  std::vector<const char*> params;  // in positional order
  std::size_t required;             // the first `required` must be given
  // Interned on first use (with the GIL held) and owned for good: the Signatures are globals,
  // and a py::object here would be released by their destructors at exit, after the interpreter
  // has finalised (Python 3.13 frees its object allocator first: that release crashed).
  std::vector<PyObject*> names;
};

class Args {
 public:
  Args(Signature& sig, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames)
      : sig_(sig), vals_(sig.params.size(), nullptr) {
    if (sig.names.size() < sig.params.size())  // all or, after a failed allocation, a prefix
      for (std::size_t j = sig.names.size(); j < sig.params.size(); ++j) {
        PyObject* name = PyUnicode_InternFromString(sig.params[j]);
        if (name == nullptr) throw py::error_already_set();
        sig.names.push_back(name);
      }
    if (std::size_t(nargs) > vals_.size())
      type_error(std::string(sig.function) + "() takes at most " + std::to_string(vals_.size()) + " positional arguments");
    for (Py_ssize_t i = 0; i < nargs; ++i) vals_[std::size_t(i)] = args[i];
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; ++i) {
      const std::size_t j = index(PyTuple_GET_ITEM(kwnames, i));
      if (vals_[j]) type_error(std::string(sig.function) + "() got multiple values for argument '" + sig.params[j] + "'");
      vals_[j] = args[nargs + i];
    }
    for (std::size_t j = 0; j < sig.required; ++j)
      if (!vals_[j]) type_error(std::string(sig.function) + "() missing required argument '" + sig.params[j] + "'");
  }
  // The argument, None when absent.
  py::handle operator[](std::size_t j) const { return vals_[j] ? py::handle(vals_[j]) : py::handle(Py_None); }
  // A bool argument: its truth value, or `dflt` when absent.
  bool flag(std::size_t j, bool dflt) const {
    if (!vals_[j]) return dflt;
    const int t = PyObject_IsTrue(vals_[j]);
    if (t < 0) {
      PyErr_Clear();
      type_error(std::string(sig_.params[j]) + ": expected a bool");
    }
    return t == 1;
  }

 private:
  std::size_t index(PyObject* key) const {
    for (std::size_t j = 0; j < sig_.names.size(); ++j)
      if (key == sig_.names[j]) return j;
    for (std::size_t j = 0; j < sig_.names.size(); ++j)
      if (PyUnicode_Compare(key, sig_.names[j]) == 0) return j;
    PyErr_Clear();
    type_error(std::string(sig_.function) + "() got an unexpected keyword argument '" + std::string(py::str(key)) + "'");
  }
  const Signature& sig_;
  std::vector<PyObject*> vals_;  // borrowed from the call
};

// C++ errors become Python exceptions as pybind11 would map them (its dispatcher is bypassed).
PyObject* invalid_argument_type = nullptr;  // attnx._core.InvalidArgument, a ValueError

void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const InvalidArgument& e) {
    PyErr_SetString(invalid_argument_type ? invalid_argument_type : PyExc_ValueError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "attnx: unknown C++ exception");
  }
}

template <py::object (*F)(const Args&), Signature* S>
PyObject* fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  try {
    return F(Args(*S, args, nargs, kwnames)).release().ptr();
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

// Runs `f` without the GIL unless the work (multiply-adds) is too small to pay for releasing it.
template <typename F>
void run_kernel(double work, F&& f) {
  if (work < kGilFreeWork) {
    f();  // a few microseconds: releasing the GIL would cost more than it frees
  } else {
    py::gil_scoped_release nogil;
    f();
  }
}

// ---- attention ------------------------------------------------------------------------------
enum DenseArg { kQ, kK, kV, kMask, kKvLens, kQLens, kCausal, kScale, kOut, kReturnLse, kThreads,
                kWindow, kSoftcap, kSinks, kAlibi };
Signature dense_signature{"attention", {"q", "k", "v", "mask", "kv_lens", "q_lens", "causal", "scale", "out",
                          "return_lse", "num_threads", "window", "softcap", "sinks", "alibi_slopes"}, 3, {}};

// The one dtype of q, k and v (float64 included: computed in float64), after their ranks.
DType dense_dtype(const py::array& q, const py::array& k, const py::array& v) {
  if (q.ndim() != 4) value_error("q: expected 4 dims (B, Hq, Sq, Dk), got " + shape_str(q));
  if (k.ndim() != 4) value_error("k: expected 4 dims (B, Hkv, Sk, Dk), got " + shape_str(k));
  if (v.ndim() != 4) value_error("v: expected 4 dims (B, Hkv, Sk, Dv), got " + shape_str(v));
  const DType dt = dtype_of(q, "q", true);
  if (dtype_of(k, "k", true) != dt || dtype_of(v, "v", true) != dt)
    type_error("q, k, v: expected one dtype, got " + dtype_str(q) + ", " + dtype_str(k) + ", " + dtype_str(v));
  return dt;
}

template <class T>
void check_dense_qkv(const py::array& q, const py::array& k, const py::array& v, DType dt,
                     BasicAttentionParams<T>& p) {
  p.dtype = dt;
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
  py::array m = py::array::ensure(mask);
  if (!m) type_error("mask: expected a numpy array");
  if (m.ndim() != 4) value_error("mask: expected 4 dims after broadcasting to (B, Hq, Sq, Sk)");
  const char kind = m.dtype().kind();
  if (kind == 'b') p.mask_kind = MaskKind::boolean;
  else if (kind == 'f' && m.itemsize() == py::ssize_t(sizeof(T))) p.mask_kind = MaskKind::additive;
  else type_error(std::string("mask: expected a boolean or ") + (sizeof(T) == 8 ? "float64" : "float32") +
                  " additive mask, got " + dtype_str(m));
  check_native(m, "mask");
  const int64_t target[4] = {p.B, p.Hq, p.Sq, p.Sk};
  for (int i = 0; i < 4; ++i)
    if (m.shape(i) != target[i] && m.shape(i) != 1)
      value_error("mask: shape " + shape_str(m) + " does not broadcast to " +
                  dims_str({{"B", p.B}, {"Hq", p.Hq}, {"Sq", p.Sq}, {"Sk", p.Sk}}));
  const auto ms = elem_strides(m, "mask", false);  // broadcast axes (extent 1) get stride 0
  p.mask = m.data();
  p.m_sb = ms[0]; p.m_sh = ms[1]; p.m_sq = ms[2]; p.m_sk = ms[3];
  return m;
}

// Dense attention computed in T: float for float32, float16 and bfloat16, double for float64
// (then scale, the modifiers, an additive mask and lse are float64 too).
template <class T>
py::object dense_call(const Args& a, const py::array& q, const py::array& k, const py::array& v, DType dt) {
  BasicAttentionParams<T> p;
  check_dense_qkv(q, k, v, dt, p);
  p.scale = scale_arg<T>(a[kScale], p.Dk);
  p.causal = a.flag(kCausal, false);
  p.var = variants<T>(a[kWindow], a[kSoftcap]);
  const py::object mask = dense_mask(a[kMask], p);
  py::array_t<int32_t> kvl, ql;
  if (!a[kKvLens].is_none()) { kvl = int_vector(a[kKvLens], "kv_lens", p.B, p.Sk, "Sk"); p.kv_lens = kvl.data(); }
  if (!a[kQLens].is_none()) { ql = int_vector(a[kQLens], "q_lens", p.B, p.Sq, "Sq"); p.q_lens = ql.data(); }
  py::array_t<T> sk, al;
  if (!a[kSinks].is_none()) { sk = head_vector<T>(a[kSinks], "sinks", p.Hq); p.var.sinks = sk.data(); }
  if (!a[kAlibi].is_none()) { al = head_vector<T>(a[kAlibi], "alibi_slopes", p.Hq); p.var.alibi_slopes = al.data(); }
  OutTarget o = out_target(a[kOut], "q", p.dtype, q.dtype(), {{"B", p.B}, {"Hq", p.Hq}, {"Sq", p.Sq}, {"Dv", p.Dv}},
                                 {q, k, v, mask, kvl, ql, sk, al}, true);
  auto os = elem_strides(o.write, "out");
  p.out = o.write.mutable_data();
  p.o_sb = os[0]; p.o_sh = os[1]; p.o_ss = os[2];
  const bool return_lse = a.flag(kReturnLse, false);
  py::array_t<T> lse;
  if (return_lse) {
    lse = py::array_t<T>(std::vector<py::ssize_t>{p.B, p.Hq, p.Sq});
    p.lse = lse.mutable_data();
    p.l_sb = p.Hq * p.Sq; p.l_sh = p.Sq; p.l_ss = 1;
  }
  p.num_threads = threads_arg(int_arg(a[kThreads], "num_threads", 0));
  run_kernel(double(p.B) * double(p.Hq) * double(p.Sq) * double(p.Sk) * double(p.Dk + p.Dv),
             [&] { attention(p); });
  if (return_lse) return py::make_tuple(o.result(), lse);
  return o.result();
}

py::object py_attention(const Args& a) {
  const py::array q = native_input(a[kQ], "q"), k = native_input(a[kK], "k"), v = native_input(a[kV], "v");
  const DType dt = dense_dtype(q, k, v);
  return dt == DType::f64 ? dense_call<double>(a, q, k, v, dt) : dense_call<float>(a, q, k, v, dt);
}

// ---- paged attention -----------------------------------------------------------------------
enum PagedArg { pQ, pKPages, pVPages, pBlockTables, pSeqLens, pQLens, pCausal, pScale, pOut,
                pReturnLse, pThreads, pWindow, pSoftcap, pSinks, pAlibi, pKNew, pVNew, pSlots,
                pKScales, pVScales, pPriorOut, pPriorLse, pMinShared };
Signature paged_signature{"paged_attention", {"q", "k_pages", "v_pages", "block_tables", "seq_lens", "q_lens",
                          "causal", "scale", "out", "return_lse", "num_threads", "window", "softcap",
                          "sinks", "alibi_slopes", "k_new", "v_new", "slots", "k_scales", "v_scales",
                          "prior_out", "prior_lse", "min_shared_keys"},
                          5, {}};

struct PagedArrays {
  py::array_t<int32_t> bt, sl, ql;  // ql: empty when q_lens is None
  std::vector<int64_t> q_start;
  bool has_ql = false;
  int64_t B = 0, max_blocks = 0;
  int64_t tokens() const { return q_start.back(); }  // sum(q_lens), or B
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
py::array scale_pages(py::handle obj, const char* name, const PagedParams& p, bool quantised, bool write) {
  const std::string n(name);
  if (obj.is_none() != !quantised)
    type_error(n + (quantised ? ": pages of dtype " + std::string(dtype_name(p.kv_dtype)) + " need their float32 scales"
                              : ": only quantised pages (int8, float8_e4m3fn, float8_e5m2) have scales; pass None"));
  if (!quantised) return py::array();
  if (!py::isinstance<py::array>(obj)) type_error(n + ": expected a numpy float32 array, got " + type_name(obj));
  py::array a = py::reinterpret_borrow<py::array>(obj);
  const py::dtype dt = a.dtype();
  if (dt.kind() != 'f' || dt.itemsize() != 4 || !native_order(dt))
    type_error(n + ": expected float32 in native byte order, got " + dtype_str(a));
  check_shape(a, name, {{"num_blocks", p.num_blocks}, {"Hkv", p.Hkv}, {"block_size", p.block_size}});
  if (write && !a.writeable()) value_error(n + ": array is not writable (a step stores the new rows' scales)");
  return a;
}

void check_scales(py::handle k_scales, py::handle v_scales, bool write, PagedParams& p, py::array& ks,
                  py::array& vs) {
  const bool q = is_quantised(p.kv_dtype);
  ks = scale_pages(k_scales, "k_scales", p, q, write);
  vs = scale_pages(v_scales, "v_scales", p, q, write);
  if (!q) return;
  auto kst = elem_strides(ks, "k_scales", false), vst = elem_strides(vs, "v_scales", false);  // any strides
  p.k_scales = static_cast<const float*>(ks.data()); p.ks_sblk = kst[0]; p.ks_sh = kst[1]; p.ks_ss = kst[2];
  p.v_scales = static_cast<const float*>(vs.data()); p.vs_sblk = vst[0]; p.vs_sh = vst[1]; p.vs_ss = vst[2];
}

// Points p at tables checked by check_tables (against pages of p's num_blocks and block_size).
void use_tables(const PagedArrays& keep, PagedParams& p) {
  p.B = keep.B; p.max_blocks = keep.max_blocks;
  p.block_tables = keep.bt.data(); p.bt_stride = keep.max_blocks;
  p.seq_lens = keep.sl.data(); p.q_start = keep.q_start.data();
}

// block_tables (B, max_blocks) as int32, with seq_lens and q_lens: every entry a sequence reads
// is checked < num_blocks, and q_start gets the prefix sums of q_lens (the query tokens' count,
// which q must match: run_paged checks it).
void check_tables(py::handle bt_obj, py::handle seq_lens, py::handle q_lens, PagedParams& p, PagedArrays& keep) {
  py::array block_tables = py::array::ensure(bt_obj);
  const char kind = block_tables ? block_tables.dtype().kind() : 'O';
  if (kind != 'i' && kind != 'u') type_error("block_tables: expected an integer array");
  if (block_tables.ndim() != 2) value_error("block_tables: expected 2 dims (B, max_blocks), got " + shape_str(block_tables));
  p.B = block_tables.shape(0); p.max_blocks = block_tables.shape(1);
  // An int32 table is read as it is (the usual case: no copy). Any other integer type is
  // range-checked in int64 first (a cast to int32 would wrap 2**32 + b to a valid-looking b) and
  // copied to int32.
  const bool bt_int32 = kind == 'i' && block_tables.itemsize() == 4;
  Native<int64_t> bt64;
  if (bt_int32) {
    keep.bt = Native<int32_t>(block_tables);
  } else {
    bt64 = Native<int64_t>(block_tables);
    keep.bt = py::array_t<int32_t>(std::vector<py::ssize_t>{p.B, p.max_blocks});
  }
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  keep.sl = int_vector(seq_lens, "seq_lens", p.B, kMax32, "int32");
  const bool has_ql = keep.has_ql = !q_lens.is_none();
  keep.B = p.B; keep.max_blocks = p.max_blocks;
  if (has_ql) keep.ql = int_vector(q_lens, "q_lens", p.B, kMax32, "int32");
  keep.q_start.assign(std::size_t(p.B + 1), 0);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t nq = has_ql ? keep.ql.data()[b] : 1;
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
  use_tables(keep, p);
}

// The new keys and values of a cache step: checked with everything else before the first write.
struct NewKV {
  py::array k, v;
  PagedWrite wk, wv;
};

// slots (T,): where each of the T new tokens goes, block * block_size + offset, in the pool.
Native<int64_t> check_slots(py::handle slots, int64_t tokens, int64_t num_blocks, int64_t block_size) {
  if (slots.is_none()) value_error("slots: expected the new tokens' slots (T,)");
  Native<int64_t> s(py::reinterpret_borrow<py::object>(slots));
  if (s.ndim() != 1 || s.shape(0) != tokens) value_error("slots: expected shape (T,)");
  for (int64_t t = 0; t < tokens; ++t)
    if (s.data()[t] < 0 || s.data()[t] >= num_blocks * block_size) value_error("slots: slot out of range");
  return s;
}

// A step's new rows, read while the pages are written: a copy if they share memory with the pages.
py::array new_rows(py::handle obj, const char* name, const py::array& kp, const py::array& vp) {
  py::array x = native_input(obj, name);
  if (may_share_memory(x, kp) || may_share_memory(x, vp)) x = py::array::ensure(x.attr("copy")());
  return x;
}

// v_new may be None when the values are a view of the keys (latent attention: one write).
void prepare_new_kv(NewKV& n, py::handle k_new, py::handle v_new, const Native<int64_t>& slots, const PagedParams& p,
                    py::array& kp, py::array& vp, py::array& ksc, py::array& vsc) {
  n.k = new_rows(k_new, "k", kp, vp);
  if (!kp.writeable()) value_error("k_pages: array is not writable");
  if (n.k.ndim() != 3) value_error("k: expected 3 dims (T, Hkv, Dk), got " + shape_str(n.k));
  check_shape(n.k, "k", {{"T", p.N}, {"Hkv", p.Hkv}, {"Dk", p.Dk}});
  const DType kd = dtype_of(n.k, "k");
  auto ks = elem_strides(n.k, "k");
  n.wk = PagedWrite{p.N, p.Hkv, p.Dk, n.k.data(), kd, ks[0], ks[1], kp.mutable_data(), p.kv_dtype,
                    p.block_size, p.k_sblk, p.k_sh, p.k_ss, slots.data()};
  if (p.k_scales != nullptr) {
    n.wk.scales = static_cast<float*>(ksc.mutable_data());
    n.wk.sc_sblk = p.ks_sblk; n.wk.sc_sh = p.ks_sh; n.wk.sc_ss = p.ks_ss;
  }
  if (v_new.is_none()) return;
  n.v = new_rows(v_new, "v", kp, vp);
  if (!vp.writeable()) value_error("v_pages: array is not writable");
  check_shape(n.v, "v", {{"T", p.N}, {"Hkv", p.Hkv}, {"Dv", p.Dv}});
  const DType vd = dtype_of(n.v, "v");
  auto vs = elem_strides(n.v, "v");
  n.wv = PagedWrite{p.N, p.Hkv, p.Dv, n.v.data(), vd, vs[0], vs[1], vp.mutable_data(), p.kv_dtype,
                    p.block_size, p.v_sblk, p.v_sh, p.v_ss, slots.data()};
  if (p.v_scales != nullptr) {
    n.wv.scales = static_cast<float*>(vsc.mutable_data());
    n.wv.sc_sblk = p.vs_sblk; n.wv.sc_sh = p.vs_sh; n.wv.sc_ss = p.vs_ss;
  }
}

// prior_out (N, Hq, Dv) and prior_lse (N, Hq), float32: each row's finished part over keys
// outside the call (attnx._shared), merged in before the row is written. Both or neither.
void check_prior(py::handle out_obj, py::handle lse_obj, PagedParams& p, py::array& po, py::array& pl) {
  if (out_obj.is_none() != lse_obj.is_none()) value_error("prior_out, prior_lse: pass both or neither");
  if (out_obj.is_none()) return;
  auto f32 = [](py::handle obj, const char* name) {
    py::array x = py::array::ensure(obj);
    if (!x || x.dtype().kind() != 'f' || x.dtype().itemsize() != 4 || !native_order(x.dtype()))
      type_error(std::string(name) + ": expected a float32 numpy array");
    return x;
  };
  po = f32(out_obj, "prior_out");
  pl = f32(lse_obj, "prior_lse");
  check_shape(po, "prior_out", {{"N", p.N}, {"Hq", p.Hq}, {"Dv", p.Dv}});
  check_shape(pl, "prior_lse", {{"N", p.N}, {"Hq", p.Hq}});
  const auto os = elem_strides(po, "prior_out"), ls = elem_strides(pl, "prior_lse", false);
  p.prior_out = static_cast<const float*>(po.data()); p.po_sn = os[0]; p.po_sh = os[1];
  p.prior_lse = static_cast<const float*>(pl.data()); p.pl_sn = ls[0]; p.pl_sh = ls[1];
}

// A paged call's per-call inputs (everything but the pages and the tables): what
// py_paged_attention takes from its arguments and StepPlan::attend from its own.
struct PagedInputs {
  py::handle q, k_new, v_new, out = Py_None, scale = Py_None, window = Py_None, softcap = Py_None,
             sinks = Py_None, alibi = Py_None, prior_out = Py_None, prior_lse = Py_None;
  bool causal = true, return_lse = false;
  py::handle threads = Py_None;
  int64_t max_left = -1;  // >= 0: the pages keep only the last max_left + 1 keys (a sliding window)
  const Native<int64_t>* slots = nullptr;  // checked; required with k_new
  const CascadePlan* cascade = nullptr;  // the step's shared-prefix groups (cascade.h), or none
};

// The variants of a call, with a sliding-window cache's rule: the window defaults to
// (max_left, None) and may not reach further left.
Variants paged_variants(const PagedInputs& in) {
  Variants var = variants(in.window, in.softcap);
  if (in.max_left >= 0) {
    if (in.window.is_none()) {
      var.window_left = in.max_left;
    } else if (var.window_left < 0 || var.window_left > in.max_left) {
      value_error("window: this cache keeps a sliding window of " + std::to_string(in.max_left + 1) +
                  " tokens, so the left side must be <= " + std::to_string(in.max_left) + ", got " +
                  std::string(py::repr(in.window)));
    }
  }
  return var;
}

// Checks q and everything after the pages and tables (p holds both), writes the new rows, runs
// the kernel. Nothing is written before every argument has been checked.
py::object run_paged(PagedParams& p, py::array& kp, py::array& vp, py::array& ksc, py::array& vsc,
                     const PagedArrays& keep, const PagedInputs& in) {
  const py::array q = native_input(in.q, "q");
  if (q.ndim() != 3) value_error("q: expected 3 dims (N, Hq, Dk), got " + shape_str(q));
  p.q_dtype = dtype_of(q, "q");
  p.N = q.shape(0); p.Hq = q.shape(1);
  check_shape(q, "q", {{"N", p.N}, {"Hq", p.Hq}, {"Dk", p.Dk}});
  if (p.Hq % p.Hkv != 0)
    value_error("k_pages: the number of kv heads (" + std::to_string(p.Hkv) + ") must divide the number of query heads (" + std::to_string(p.Hq) + ")");
  if (keep.tokens() != p.N)
    value_error("q: expected N = " + std::string(keep.has_ql ? "sum(q_lens)" : "B") + " = " + std::to_string(keep.tokens()) + " query tokens, got " + std::to_string(p.N));
  p.causal = in.causal;
  p.scale = scale_arg(in.scale, p.Dk);
  p.var = paged_variants(in);
  py::array_t<float> sk, al;
  if (!in.sinks.is_none()) { sk = head_vector(in.sinks, "sinks", p.Hq); p.var.sinks = sk.data(); }
  if (!in.alibi.is_none()) { al = head_vector(in.alibi, "alibi_slopes", p.Hq); p.var.alibi_slopes = al.data(); }
  auto qs = elem_strides(q, "q");
  p.q = q.data(); p.q_sn = qs[0]; p.q_sh = qs[1];
  py::array po, pl;
  check_prior(in.prior_out, in.prior_lse, p, po, pl);
  NewKV nkv;
  if (!in.k_new.is_none()) prepare_new_kv(nkv, in.k_new, in.v_new, *in.slots, p, kp, vp, ksc, vsc);
  OutTarget o = out_target(in.out, "q", p.q_dtype, q.dtype(), {{"N", p.N}, {"Hq", p.Hq}, {"Dv", p.Dv}},
                                 {q, kp, vp, keep.bt, keep.sl, keep.ql, sk, al, nkv.k, nkv.v, ksc, vsc, po, pl}, false);
  auto os = elem_strides(o.write, "out");
  p.out = o.write.mutable_data(); p.o_sn = os[0]; p.o_sh = os[1];
  py::array_t<float> lse;
  if (in.return_lse) {
    lse = py::array_t<float>(std::vector<py::ssize_t>{p.N, p.Hq});
    p.lse = lse.mutable_data(); p.l_sn = p.Hq; p.l_sh = 1;
  }
  p.num_threads = threads_arg(int_arg(in.threads, "num_threads", 0));
  const PagedStep step{p, nkv.wk, nkv.wv, in.cascade};  // no new keys: both writes are empty
  double work = 0;
  for (int64_t b = 0; b < p.B; ++b)
    work += double(keep.q_start[std::size_t(b + 1)] - keep.q_start[std::size_t(b)]) * double(keep.sl.data()[b]);
  run_kernel(work * double(p.Hq) * double(p.Dk + p.Dv), [&]() { paged_step(step); });
  if (in.return_lse) return py::make_tuple(o.result(), lse);
  return o.result();
}

py::array page_array(py::handle obj, const char* name) {
  py::array a = py::array::ensure(obj);
  if (!a) type_error(std::string(name) + ": expected a numpy array");
  return a;
}

py::object py_paged_attention(const Args& a) {
  PagedParams p;
  py::array kp = page_array(a[pKPages], "k_pages"), vp = page_array(a[pVPages], "v_pages");
  check_pages(kp, vp, p);
  py::array ksc, vsc;
  check_scales(a[pKScales], a[pVScales], !a[pKNew].is_none(), p, ksc, vsc);
  PagedArrays keep;
  check_tables(a[pBlockTables], a[pSeqLens], a[pQLens], p, keep);
  PagedInputs in;
  in.q = a[pQ]; in.k_new = a[pKNew]; in.v_new = a[pVNew]; in.out = a[pOut]; in.scale = a[pScale];
  in.window = a[pWindow]; in.softcap = a[pSoftcap]; in.sinks = a[pSinks]; in.alibi = a[pAlibi];
  in.prior_out = a[pPriorOut]; in.prior_lse = a[pPriorLse]; in.threads = a[pThreads];
  CascadePlan cascade;  // min_shared_keys: sequences sharing leading blocks read them once (cascade.h)
  if (!a[pMinShared].is_none()) {
    cascade = plan_cascade(p, int_arg(a[pMinShared], "min_shared_keys", 0));
    in.cascade = &cascade;
  }
  in.causal = a.flag(pCausal, true);
  in.return_lse = a.flag(pReturnLse, false);
  Native<int64_t> slots;
  if (!in.k_new.is_none()) {
    slots = check_slots(a[pSlots], keep.tokens(), p.num_blocks, p.block_size);
    in.slots = &slots;
  }
  return run_paged(p, kp, vp, ksc, vsc, keep, in);
}

// ---- a cache step's plan --------------------------------------------------------------------
// attnx.Step's per-layer call: the tables and slots of one step, checked once, then one call per
// model layer that reads that layer's pages (num_layers tuples (k_pages, v_pages, k_scales,
// v_scales) of one cache). A decode step calls it once per layer, inside the model's loop, where
// each Python step around it costs several times what it costs alone (bench/NOTES.md): so the
// plan takes the model's (B, H, S, D) arrays as they are, besides the packed (T, H, D) ones.
class StepPlan {
 public:
  StepPlan(py::sequence layers, py::handle block_tables, py::handle seq_lens, py::handle q_lens,
           py::handle slots, bool values_from_keys, py::handle max_left, py::handle min_shared_keys)
      : layers_(layers), values_from_keys_(values_from_keys) {
    if (py::len(layers_) == 0) value_error("layers: expected at least one layer's pages");
    PagedParams p;
    py::array kp, vp;
    pages(0, p, kp, vp);
    num_blocks_ = p.num_blocks; block_size_ = p.block_size;
    check_tables(block_tables, seq_lens, q_lens, p, keep_);
    slots_ = check_slots(slots, keep_.tokens(), num_blocks_, block_size_);
    max_left_ = max_left.is_none() ? -1 : int_arg(max_left, "max_left", -1);
    if (!max_left.is_none() && max_left_ < 0) value_error("max_left: expected an int >= 0 or None");
    // the shared-prefix groups, for every layer (none with a sliding window: cascade.h)
    if (!min_shared_keys.is_none() && max_left_ < 0)
      cascade_ = plan_cascade(p, int_arg(min_shared_keys, "min_shared_keys", 0));
  }

  // One layer: writes the new k and v rows into `layer`'s pages and attends. q (T, Hq, Dk) with k,
  // v (T, Hkv, D) returns (T, Hq, Dv); q (B, Hq, S, Dk) with k, v (B, Hkv, S, D), B * S = T (every
  // sequence with S new tokens) returns (B, S, Hq, Dv), the layout a model's o_proj reads.
  py::object attend(py::handle layer, py::handle q, py::handle k, py::handle v, py::handle scale,
                    py::handle softcap, py::handle window, py::handle sinks, py::handle alibi,
                    py::handle threads, bool return_lse, bool shared_prefix) {
    if (values_from_keys_ && !v.is_none())
      value_error("v: this cache reads values from the keys (value_from_key=True): pass v=None");
    if (!values_from_keys_ && v.is_none()) value_error("v: expected the new values (T, num_kv_heads, value_dim)");
    const int64_t nl = int64_t(py::len(layers_));
    int64_t li = -1;
    if (!PyBool_Check(layer.ptr()) && PyIndex_Check(layer.ptr())) li = int_arg(layer, "layer", -1);
    if (li < 0 || li >= nl)
      value_error("layer: expected an int in [0, " + std::to_string(nl) + "), got " + std::string(py::repr(layer)));
    PagedParams p;
    py::array kp, vp;
    pages(li, p, kp, vp);
    py::array ksc, vsc;
    py::tuple t = layers_[li];
    check_scales(t[2], t[3], true, p, ksc, vsc);
    use_tables(keep_, p);
    PagedInputs in;
    const bool model_layout = py::isinstance<py::array>(q) && py::reinterpret_borrow<py::array>(q).ndim() == 4;
    // (T, H, D) arrays the kernels can address: a model's (B, H, S, D) ones as token views
    const py::object qt = model_layout ? tokens(q, "q") : kernel_input(q, "q");
    const py::object kt = model_layout ? tokens(k, "k") : kernel_input(k, "k");
    const py::object vt = v.is_none() ? py::object(py::none()) : model_layout ? tokens(v, "v") : kernel_input(v, "v");
    in.q = qt; in.k_new = kt; in.v_new = vt;
    if (shared_prefix) in.cascade = &cascade_;
    in.scale = scale; in.softcap = softcap; in.window = window; in.sinks = sinks; in.alibi = alibi;
    in.threads = threads; in.return_lse = return_lse; in.max_left = max_left_; in.slots = &slots_;
    py::object r = run_paged(p, kp, vp, ksc, vsc, keep_, in);
    if (!model_layout) return r;
    const auto qa = py::reinterpret_borrow<py::array>(q);
    const py::ssize_t B = qa.shape(0), S = qa.shape(2);
    auto shaped = [&](py::handle x) {
      auto a = py::reinterpret_borrow<py::array>(x);
      std::vector<py::ssize_t> shape{B, S};
      for (py::ssize_t i = 1; i < a.ndim(); ++i) shape.push_back(a.shape(i));
      return py::object(a.reshape(shape));
    };
    if (return_lse) {
      py::tuple rt = r;
      return py::make_tuple(shaped(rt[0]), shaped(rt[1]));
    }
    return shaped(r);
  }

 private:
  // Layer li's pages into p (checked: the tables were checked against layer 0's pool size).
  void pages(int64_t li, PagedParams& p, py::array& kp, py::array& vp) {
    py::object item = layers_[li];
    if (!py::isinstance<py::tuple>(item) || py::len(item) != 4)
      type_error("layers: expected (k_pages, v_pages, k_scales, v_scales) per layer");
    py::tuple t = item;
    kp = page_array(t[0], "k_pages"); vp = page_array(t[1], "v_pages");
    check_pages(kp, vp, p);
    if (num_blocks_ >= 0 && (p.num_blocks != num_blocks_ || p.block_size != block_size_))
      value_error("k_pages: layer " + std::to_string(li) + " holds a pool of another size than layer 0");
  }

  // An input as an array the kernels can address through element strides: a copy where its
  // last axis is strided or it is misaligned (attnx._validate.kernel_array's rule).
  static py::object kernel_input(py::handle obj, const char* name) {
    py::array a = native_input(obj, name);
    if (stride_problem(a, true) == nullptr) return std::move(a);
    return py::module_::import("numpy").attr("array")(a, py::arg("order") = "C");
  }

  // A model's (B, H, S, D) array as the step's (T = B * S, H, D) tokens: a view when its strides
  // allow (S = 1, B = 1, or the (B, S, H, D) memory a projection writes), else a packed copy.
  py::object tokens(py::handle obj, const char* name) const {
    py::array a = py::reinterpret_borrow<py::array>(kernel_input(obj, name));
    if (a.ndim() != 4) value_error(std::string(name) + ": expected 4 dims (B, H, S, D) like q, got " + shape_str(a));
    const py::ssize_t B = a.shape(0), H = a.shape(1), S = a.shape(2), D = a.shape(3);
    bool uniform = B == keep_.B;  // row b is sequence b, with S new tokens
    for (int64_t b = 0; uniform && b < keep_.B; ++b)
      uniform = keep_.q_start[std::size_t(b + 1)] - keep_.q_start[std::size_t(b)] == S;
    if (!uniform)
      value_error(std::string(name) + ": a (B, H, S, D) array needs B = " + std::to_string(keep_.B) +
                  " sequences with S new tokens each (this step has " + std::to_string(keep_.tokens()) +
                  " tokens in all: pass them packed, (T, H, D)), got shape " + shape_str(a));
    const py::ssize_t sb = a.strides(0), sh = a.strides(1), ss = a.strides(2), sd = a.strides(3);
    py::ssize_t sn = 0;
    if (S == 1) sn = sb;
    else if (B == 1 || sb == S * ss) sn = ss;
    else {  // not one token axis: pack (B, S, H, D) in order
      py::array packed = py::array::ensure(py::module_::import("numpy").attr("ascontiguousarray")(a.attr("transpose")(0, 2, 1, 3)));
      return packed.reshape({B * S, H, D});
    }
    return py::array(a.dtype(), {B * S, H, D}, {sn, sh, sd}, a.data(), a);
  }

  py::sequence layers_;
  bool values_from_keys_;
  int64_t num_blocks_ = -1, block_size_ = -1, max_left_ = -1;
  PagedArrays keep_;
  Native<int64_t> slots_;
  CascadePlan cascade_;  // empty: no groups
};

}  // namespace

// ---- gated delta rule (linear attention) ------------------------------------------------------
// Self-contained on purpose (its own small checks): attnx.linear has already normalised layouts
// and dtypes, so these checks are the last line and name the same arguments.
namespace delta_binding {

[[noreturn]] void fail(const std::string& msg) { throw py::value_error(msg); }

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

void expect_shape(const py::array& a, const char* name, std::vector<int64_t> dims) {
  bool ok = a.ndim() == py::ssize_t(dims.size());
  for (std::size_t i = 0; ok && i < dims.size(); ++i) ok = a.shape(py::ssize_t(i)) == dims[i];
  if (!ok) {
    std::string want = "(";
    for (std::size_t i = 0; i < dims.size(); ++i) want += (i ? ", " : "") + std::to_string(dims[i]);
    fail(std::string(name) + ": expected shape " + want + "), got " + shape_of(a));
  }
}

// (b, t, h) element strides of a 3- or 4-dim array whose last axis (if 4-dim) is contiguous.
std::vector<int64_t> strides_of(const py::array& a, const char* name) {
  const int64_t es = int64_t(a.itemsize());
  std::vector<int64_t> s;
  if (a.size() == 0) return std::vector<int64_t>(std::size_t(a.ndim()), 0);  // nothing is read or written
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (a.strides(i) % es != 0) fail(std::string(name) + ": strides must be multiples of the item size");
    s.push_back(a.strides(i) / es);
  }
  if (a.ndim() == 4 && a.shape(3) > 1 && s[3] != 1) fail(std::string(name) + ": the last axis must be contiguous");
  return s;
}

DType storage_of(const py::array& a, const char* name) {
  const py::dtype dt = a.dtype();
  if (dt.kind() == 'f' && dt.itemsize() == 4) return DType::f32;
  if (dt.kind() == 'f' && dt.itemsize() == 2) return DType::f16;
  if (dt.itemsize() == 2 && std::string(py::str(dt)) == "bfloat16") return DType::bf16;
  throw py::type_error(std::string(name) + ": expected dtype float32, float16 or bfloat16, got " + std::string(py::str(dt)));
}

py::array_t<float> float32_array(const py::array& a, const char* name) {
  if (!(a.dtype().kind() == 'f' && a.itemsize() == 4)) throw py::type_error(std::string(name) + ": expected float32");
  return py::array_t<float>::ensure(a);
}

// Every argument checked; the returned params point into the arrays (kept alive by the caller).
DeltaRuleParams check_delta_rule(const py::array& q, const py::array& k, const py::array& v,
                                 const py::array_t<float>& g, const py::array_t<float>& beta,
                                 const py::array_t<int64_t>& seqs, const py::object& initial_state,
                                 double scale) {
  DeltaRuleParams p;
  if (q.ndim() != 4) fail("q: expected 4 dims (B, T, Hk, K), got " + shape_of(q));
  if (k.ndim() != 4) fail("k: expected 4 dims (B, T, Hk, K), got " + shape_of(k));
  if (v.ndim() != 4) fail("v: expected 4 dims (B, T, Hv, V), got " + shape_of(v));
  p.dtype = storage_of(q, "q");
  if (storage_of(k, "k") != p.dtype || storage_of(v, "v") != p.dtype) throw py::type_error("q, k, v: expected one dtype");
  const int64_t B = q.shape(0), T = q.shape(1);
  p.Hk = q.shape(2); p.K = q.shape(3); p.Hv = v.shape(2); p.V = v.shape(3);
  expect_shape(k, "k", {B, T, p.Hk, p.K});
  expect_shape(v, "v", {B, T, p.Hv, p.V});
  if (p.Hk < 1 || p.Hv % p.Hk != 0)
    fail("v: the number of value heads (" + std::to_string(p.Hv) + ") must be a multiple of the key heads (" + std::to_string(p.Hk) + ")");
  p.g_per_channel = g.ndim() == 4;
  if (p.g_per_channel) expect_shape(g, "g", {B, T, p.Hv, p.K});
  else expect_shape(g, "g", {B, T, p.Hv});
  expect_shape(beta, "beta", {B, T, p.Hv});
  if (seqs.ndim() != 2 || seqs.shape(1) != 3) fail("sequences: expected (N, 3) int64 rows (batch, start, length)");
  p.N = seqs.shape(0);
  auto sq = seqs.unchecked<2>();
  for (int64_t n = 0; n < p.N; ++n)
    if (sq(n, 0) < 0 || sq(n, 0) >= B || sq(n, 1) < 0 || sq(n, 2) < 0 || sq(n, 1) + sq(n, 2) > T)
      fail("sequence " + std::to_string(n) + ": positions [" + std::to_string(sq(n, 1)) + ", " +
           std::to_string(sq(n, 1) + sq(n, 2)) + ") of batch row " + std::to_string(sq(n, 0)) + " are outside (B=" +
           std::to_string(B) + ", T=" + std::to_string(T) + ")");
  if (!initial_state.is_none()) {
    py::array s = py::array::ensure(initial_state);
    if (!s || !(s.dtype().kind() == 'f' && s.itemsize() == 4) || !(s.flags() & py::array::c_style))
      throw py::type_error("initial_state: expected a C-contiguous float32 array");
    expect_shape(s, "initial_state", {p.N, p.Hv, p.K, p.V});
    p.initial_state = static_cast<const float*>(s.data());
  }
  if (!std::isfinite(scale)) fail("scale: expected a finite number");
  p.scale = float(scale);
  auto qs = strides_of(q, "q"), ks = strides_of(k, "k"), vs = strides_of(v, "v");
  auto gs = strides_of(g, "g"), bs = strides_of(beta, "beta");
  p.q = {q.data(), qs[0], qs[1], qs[2]};
  p.k = {k.data(), ks[0], ks[1], ks[2]};
  p.v = {v.data(), vs[0], vs[1], vs[2]};
  p.g = g.data(); p.g_sb = gs[0]; p.g_st = gs[1]; p.g_sh = gs[2];
  p.beta = beta.data(); p.beta_sb = bs[0]; p.beta_st = bs[1]; p.beta_sh = bs[2];
  return p;
}

py::object gated_delta_rule(py::array q, py::array k, py::array v, py::array g, py::array beta,
                            py::array_t<int64_t, py::array::c_style | py::array::forcecast> seqs,
                            py::object initial_state, bool output_final_state, double scale,
                            bool qk_l2norm, int mode, int num_threads) {
  py::array_t<float> g32 = float32_array(g, "g"), b32 = float32_array(beta, "beta");
  DeltaRuleParams p = check_delta_rule(q, k, v, g32, b32, seqs, initial_state, scale);
  if (mode < 0 || mode > 2) fail("mode: expected 0 (automatic), 1 (chunked) or 2 (recurrent)");
  if (num_threads < 0) fail("num_threads: expected a positive int or None");
  auto sq = seqs.unchecked<2>();
  std::vector<int64_t> sb(std::size_t(p.N)), st(std::size_t(p.N)), sl(std::size_t(p.N));
  for (int64_t n = 0; n < p.N; ++n) { sb[n] = sq(n, 0); st[n] = sq(n, 1); sl[n] = sq(n, 2); }
  p.seq_batch = sb.data(); p.seq_start = st.data(); p.seq_len = sl.data();
  // Positions outside every sequence stay zero.
  py::array o = py::module_::import("numpy").attr("zeros")(
      py::make_tuple(q.shape(0), q.shape(1), p.Hv, p.V), q.dtype()).cast<py::array>();
  const auto os = strides_of(o, "out");
  p.out = o.mutable_data(); p.o_sb = os[0]; p.o_st = os[1]; p.o_sh = os[2];
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

}  // namespace delta_binding

PYBIND11_MODULE(_core, m) {
  m.doc() = "attnx C++ core (see the attnx package for the documented API)";

  invalid_argument_type = py::register_local_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError).ptr();

  // The entry points bind their arguments themselves (see Args); the attnx package documents them.
  static PyMethodDef entry_points[] = {
      {"attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastcall<py_attention, &dense_signature>)),
       METH_FASTCALL | METH_KEYWORDS,
       "attention(q, k, v, mask=None, kv_lens=None, q_lens=None, causal=False, scale=None, out=None, "
       "return_lse=False, num_threads=0, window=None, softcap=None, sinks=None, alibi_slopes=None)"},
      {"paged_attention", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastcall<py_paged_attention, &paged_signature>)),
       METH_FASTCALL | METH_KEYWORDS,
       "paged_attention(q, k_pages, v_pages, block_tables, seq_lens, q_lens=None, causal=True, scale=None, "
       "out=None, return_lse=False, num_threads=0, window=None, softcap=None, sinks=None, "
       "alibi_slopes=None, k_new=None, v_new=None, slots=None, k_scales=None, v_scales=None, "
       "prior_out=None, prior_lse=None, min_shared_keys=None)"},
  };
  for (PyMethodDef& def : entry_points)
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, m.ptr(), m.attr("__name__").ptr())));

  py::class_<StepPlan>(m, "StepPlan")
      .def(py::init<py::sequence, py::handle, py::handle, py::handle, py::handle, bool, py::handle, py::handle>(),
           py::arg("layers"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("q_lens"),
           py::arg("slots"), py::arg("values_from_keys"), py::arg("max_left"),
           py::arg("min_shared_keys") = py::none())
      .def("attend", &StepPlan::attend);

  bind_cascade(m);
  m.def("cpu_features", []() {
    const CpuFeatures f = cpu_features();
    py::dict d;
    d["sse2"] = f.sse2; d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw; d["avx512vl"] = f.avx512vl; d["avx512bf16"] = f.avx512bf16;
    d["avx512_vnni"] = f.avx512_vnni; d["avx_vnni"] = f.avx_vnni; d["avx512_fp16"] = f.avx512_fp16;
    d["amx_tile"] = f.amx_tile; d["amx_bf16"] = f.amx_bf16; d["amx_int8"] = f.amx_int8;
    d["amx_fp16"] = f.amx_fp16; d["amx_permitted"] = f.amx_permitted;
    // aarch64
    d["neon"] = f.neon; d["dotprod"] = f.dotprod; d["bf16"] = f.bf16; d["i8mm"] = f.i8mm; d["sve"] = f.sve;
    return d;
  });
  m.def("bf16_dot_gain", &bf16_dot_gain);
  m.def("set_int8_query", [](bool on) { set_int8_query(on); }, py::arg("on"));
  m.def("int8_query", &int8_query);
  m.def("active_isa", []() { return std::string(active_isa()); });
  m.def("set_isa", [](const std::string& name) { set_isa(name); }, py::arg("name"));
  m.def("set_num_threads", [](int n) {
    if (n < 0) value_error("n: expected an int >= 0 (0: the default, OMP_NUM_THREADS or the CPUs)");
    set_num_threads(n);
  }, py::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("_max_threads", &max_threads);
  m.def("_pool_threads", &pool_workers_used);
  m.def("share_blas_threads", [](bool on) { return share_blas_threads(on); }, py::arg("on"));
  m.def("share_omp_threads", [](bool on) { return share_omp_threads(on); }, py::arg("on"));
  m.def("probe_fma_gflops", [](int nt, double seconds) {
    py::gil_scoped_release nogil;
    return probe_fma_gflops(resolve_threads(nt), seconds);
  }, py::arg("num_threads"), py::arg("seconds") = 0.3);
  m.def("probe_read_gbps", [](int nt, int64_t bytes, double seconds) {
    py::gil_scoped_release nogil;
    return probe_read_gbps(resolve_threads(nt), bytes, seconds);
  }, py::arg("num_threads"), py::arg("bytes") = int64_t(1) << 30, py::arg("seconds") = 0.5);
  m.def("gated_delta_rule", &delta_binding::gated_delta_rule, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("sequences"), py::arg("initial_state"),
        py::arg("output_final_state"), py::arg("scale"), py::arg("qk_l2norm"), py::arg("mode"),
        py::arg("num_threads"));
}
