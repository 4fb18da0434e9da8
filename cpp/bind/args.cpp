// args.cpp: the check vocabulary and the calling machinery of args.h.
#include "args.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "attnx/dispatch.h"

namespace attnx::bind {

[[noreturn]] void value_error(const std::string& msg) { throw py::value_error(msg); }
[[noreturn]] void type_error(const std::string& msg) { throw py::type_error(msg); }

// (No iostreams in the module: built on an Ubuntu 24.04 image whose gcc 13 linked libstdc++
// statically, a string stream formatting a double in a message segfaulted there instead of raising.
// std::to_string and snprintf use no locale object. bench/NOTES.md, "A crash on an Ubuntu 24.04
// image".)
std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string dims_str(Dims dims) {
  std::string s = "(";
  bool first = true;
  for (auto& d : dims) {
    s += (first ? "" : ", ") + std::string(d.first) + "=" + std::to_string(d.second);
    first = false;
  }
  return s + ")";
}

std::string dtype_str(const py::array& a) { return std::string(py::str(a.dtype())); }

std::string type_name(py::handle h) { return py::str(py::type::handle_of(h).attr("__name__")); }

std::string num_str(double x) {  // as `std::ostream << x` writes it: %g, 6 digits
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// ---- dtypes, byte order and strides ----------------------------------------------------------
int ml_dtype_num(const char* name) {
  try {
    return py::module_::import("numpy")
        .attr("dtype")(py::module_::import("ml_dtypes").attr(name))
        .cast<py::dtype>()
        .num();
  } catch (py::error_already_set&) {
    return -1;
  }
}
int bfloat16_num() {
  static int num = ml_dtype_num("bfloat16");
  return num;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
constexpr char kNativeOrder = '>';
#else
constexpr char kNativeOrder = '<';
#endif

// Kind, size and byte order decide (dtype.name is computed in Python by NumPy, which would cost
// more than a small call's kernel). A byte-swapped array would be read as garbage, so every dtype
// check asks for the native order: inputs are converted to it first (native_input), what is written
// in place (pages, `out`) is refused.
bool native_order(const py::dtype& dt) {
  const char b = dt.byteorder();
  return b == '=' || b == '|' || b == kNativeOrder;
}

bool is_float32(const py::dtype& dt) {
  return dt.kind() == 'f' && dt.itemsize() == 4 && native_order(dt);
}

void check_native(const py::array& a, const char* name) {
  if (!native_order(a.dtype()))
    type_error(std::string(name) + ": expected native byte order, got dtype " + dtype_str(a) +
               " (convert with a.astype(a.dtype.newbyteorder('=')))");
}

// float64 is accepted only where `f64_ok` (dense attention computes it in float64; pages and the
// other entry points have no float64 path).
DType dtype_of(const py::array& a, const char* name, bool f64_ok) {
  const py::dtype dt = a.dtype();
  check_native(a, name);
  if (dt.kind() == 'f' && dt.itemsize() == 4) return DType::f32;
  if (dt.kind() == 'f' && dt.itemsize() == 2) return DType::f16;
  if (dt.itemsize() == 2 && dt.num() == bfloat16_num()) return DType::bf16;
  if (f64_ok && dt.kind() == 'f' && dt.itemsize() == 8) return DType::f64;
  const char k = dt.kind();
  const bool f64 = k == 'f' && dt.itemsize() == 8;  // here only where there is no float64 path
  type_error(std::string(name) + ": expected dtype float32, float16" +
             (f64_ok ? ", bfloat16 or float64" : " or bfloat16") + ", got " + dtype_str(a) +
             (f64 ? " (float64 runs only in dense attention, attnx.attention; cast with "
                    ".astype(np.float32))"
              : k == 'f' || k == 'i' || k == 'u' || k == 'b' ? " (cast with .astype(np.float32))"
                                                             : ""));
}

DType page_dtype_of(const py::array& a, const char* name) {
  static const int e4m3 = ml_dtype_num("float8_e4m3fn"), e5m2 = ml_dtype_num("float8_e5m2");
  const py::dtype dt = a.dtype();
  if (dt.itemsize() != 1) return dtype_of(a, name);
  if (dt.kind() == 'i') return DType::i8;
  if (dt.num() == e4m3) return DType::e4m3;
  if (dt.num() == e5m2) return DType::e5m2;
  type_error(std::string(name) +
             ": expected dtype float32, float16, bfloat16, int8, float8_e4m3fn or "
             "float8_e5m2, got " +
             dtype_str(a));
}

py::array array_arg(py::handle obj, const char* name) {
  py::array a = py::array::ensure(obj);
  if (!a) type_error(std::string(name) + ": expected a numpy array");
  return a;
}

py::array native_input(py::handle obj, const char* name) {
  py::array a = array_arg(obj, name);
  if (native_order(a.dtype())) return a;
  return py::array::ensure(a.attr("astype")(a.dtype().attr("newbyteorder")("=")));
}

py::array kernel_input(py::handle obj, const char* name, bool unit_last) {
  py::array a = native_input(obj, name);
  if (stride_problem(a, unit_last) == nullptr) return a;
  return py::array::ensure(py::module_::import("numpy").attr("array")(a, py::arg("order") = "C"));
}

// Axes of extent 1 are never stepped, so their strides (NumPy may report anything there) do not
// count.
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

std::vector<int64_t> elem_strides(const py::array& a, const char* name, bool unit_last) {
  if (const char* why = stride_problem(a, unit_last)) value_error(std::string(name) + ": " + why);
  std::vector<int64_t> s(std::size_t(a.ndim()), 0);
  if (a.size() == 0) return s;
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) > 1) s[std::size_t(i)] = a.strides(i) / a.itemsize();
  return s;
}

void check_rank(const py::array& a, const char* name, int ndim, const char* axes) {
  if (a.ndim() != ndim)
    value_error(std::string(name) + ": expected " + std::to_string(ndim) + " dims " + axes +
                ", got " + shape_str(a));
}

void check_shape(const py::array& a, const char* name, Dims dims) {
  bool ok = a.ndim() == py::ssize_t(dims.size());
  py::ssize_t i = 0;
  for (auto& d : dims) {
    if (ok && a.shape(i) != d.second) ok = false;
    ++i;
  }
  if (!ok)
    value_error(std::string(name) + ": expected shape " + dims_str(dims) + ", got " + shape_str(a));
}

namespace {

[[noreturn]] void out_of_range(const char* name, int64_t i, const std::string& value, int64_t hi,
                               const char* hi_name) {
  value_error(std::string(name) + "[" + std::to_string(i) + "] = " + value +
              " is out of range [0, " + std::to_string(hi) + "] (" + hi_name + ")");
}

}  // namespace

py::array_t<int32_t> int_vector(py::handle obj, const char* name, int64_t n, int64_t hi,
                                const char* hi_name) {
  py::array a = py::array::ensure(obj);
  if (!a) type_error(std::string(name) + ": expected an integer array");
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u')
    type_error(std::string(name) + ": expected an integer array, got dtype " + dtype_str(a));
  if (a.ndim() != 1 || a.shape(0) != n)
    value_error(std::string(name) + ": expected shape (" + std::to_string(n) + ",), got " +
                shape_str(a));
  // Lengths are int32 in the kernels: anything larger is refused, never narrowed.
  hi = std::min<int64_t>(hi, std::numeric_limits<int32_t>::max());
  if (kind == 'i' && a.itemsize() == 4) {  // already int32: checked and used as it is (no copy
    Native<int32_t> r(a);                  // unless strided, misaligned or byte-swapped)
    for (int64_t i = 0; i < n; ++i)
      if (r.data()[i] < 0 || r.data()[i] > hi)
        out_of_range(name, i, std::to_string(r.data()[i]), hi, hi_name);
    return r;
  }
  if (kind == 'u') {
    Native<uint64_t> u(a);
    for (int64_t i = 0; i < n; ++i)
      if (u.data()[i] > uint64_t(hi))
        out_of_range(name, i, std::to_string(u.data()[i]), hi, hi_name);
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

template <class T>
T positive_float(double x, const char* name) {
  if (!(x >= kFloatMin && x <= kFloatMax))
    value_error(std::string(name) +
                ": expected a finite positive number within float32's normal range [" +
                num_str(kFloatMin) + ", " + num_str(kFloatMax) + "], got " + num_str(x));
  return T(x);
}

double real_arg(py::handle h, const char* name) {
  if (PyBool_Check(h.ptr())) type_error(std::string(name) + ": expected a float, got bool");
  const double x = PyFloat_AsDouble(h.ptr());
  if (x == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    type_error(std::string(name) + ": expected a float, got " + type_name(h));
  }
  return x;
}

template <class T>
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
  if (overflow)
    value_error(std::string(name) + ": " + std::string(py::str(h)) + " is out of range");
  return int64_t(v);
}

// An optional (n,) vector of per-head float parameters: finite and within float32's range (a
// float64 1e39 would become inf in float32).
template <class T>
py::array_t<T> head_vector(py::handle obj, const char* name, int64_t n) {
  py::array a = py::array::ensure(obj);
  const char kind = a ? a.dtype().kind() : 'O';
  if (!a || (kind != 'f' && kind != 'i' && kind != 'u' && a.dtype().num() != bfloat16_num()))
    type_error(std::string(name) + ": expected a real array of shape (" + std::to_string(n) + ",)");
  if (a.ndim() != 1 || a.shape(0) != n)
    value_error(std::string(name) + ": expected shape (Hq=" + std::to_string(n) + ",), got " +
                shape_str(a));
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

template <class T>
py::array_t<T> alibi_vector(py::handle obj, int64_t n, int64_t reach) {
  py::array_t<T> a = head_vector<T>(obj, "alibi_slopes", n);
  const double top = double(std::numeric_limits<T>::max());
  for (int64_t i = 0; i < n; ++i)
    if (!(std::fabs(double(a.data()[i])) * double(reach) <= top))
      value_error("alibi_slopes: each slope times the longest query-key distance (" +
                  std::to_string(reach) + ") must be finite in float32, got " +
                  num_str(double(a.data()[i])) + " at [" + std::to_string(i) + "]");
  return a;
}

namespace {

// One side of window=(left, right): an int >= 0, or -1 (None, or wider than any sequence).
int64_t window_side(const py::object& s) {
  if (s.is_none()) return -1;
  if (!py::isinstance<py::int_>(s) || py::isinstance<py::bool_>(s))
    type_error("window: sides must be ints or None");
  // A side wider than any sequence is no bound at all: it must not overflow int64 positions.
  const py::int_ huge(int64_t(1) << 40), zero(0);
  if (PyObject_RichCompareBool(s.ptr(), zero.ptr(), Py_LT) == 1)
    value_error("window: sides must be >= 0 or None, got " + std::string(py::str(s)));
  return PyObject_RichCompareBool(s.ptr(), huge.ptr(), Py_GE) == 1 ? -1 : s.cast<int64_t>();
}

}  // namespace

template <class T>
BasicVariants<T> variants(py::handle window, py::handle softcap) {
  BasicVariants<T> v;
  if (!window.is_none()) {
    if (!py::isinstance<py::tuple>(window) && !py::isinstance<py::list>(window))
      value_error("window: expected (left, right)");
    auto t = py::reinterpret_borrow<py::sequence>(window);
    if (t.size() != 2) value_error("window: expected (left, right)");
    v.window_left = window_side(t[0]);
    v.window_right = window_side(t[1]);
  }
  if (!softcap.is_none()) v.softcap = positive_float<T>(real_arg(softcap, "softcap"), "softcap");
  return v;
}

template float positive_float<float>(double, const char*);
template double positive_float<double>(double, const char*);
template float scale_arg<float>(py::handle, int64_t);
template double scale_arg<double>(py::handle, int64_t);
template py::array_t<float> head_vector<float>(py::handle, const char*, int64_t);
template py::array_t<double> head_vector<double>(py::handle, const char*, int64_t);
template py::array_t<float> alibi_vector<float>(py::handle, int64_t, int64_t);
template py::array_t<double> alibi_vector<double>(py::handle, int64_t, int64_t);
template BasicVariants<float> variants<float>(py::handle, py::handle);
template BasicVariants<double> variants<double>(py::handle, py::handle);

// A call's thread count; 0 (None) is resolved here, so that a bad default (ATTNX_NUM_THREADS)
// is refused before a step writes its new keys, not after.
int threads_arg(int64_t n) {
  if (n < 0 || n > std::numeric_limits<int>::max())
    value_error("num_threads: expected a positive int or None");
  return n == 0 ? get_num_threads() : int(n);
}

// ---- calls -----------------------------------------------------------------------------------
Args::Args(Signature& sig, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames)
    : sig_(sig), vals_(sig.params.size(), nullptr) {
  if (sig.names.size() < sig.params.size())  // all or, after a failed allocation, a prefix
    for (std::size_t j = sig.names.size(); j < sig.params.size(); ++j) {
      PyObject* name = PyUnicode_InternFromString(sig.params[j]);
      if (name == nullptr) throw py::error_already_set();
      sig.names.push_back(name);
    }
  if (std::size_t(nargs) > vals_.size())
    type_error(std::string(sig.function) + "() takes at most " + std::to_string(vals_.size()) +
               " positional arguments");
  for (Py_ssize_t i = 0; i < nargs; ++i) vals_[std::size_t(i)] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    const std::size_t j = index(PyTuple_GET_ITEM(kwnames, i));
    if (vals_[j])
      type_error(std::string(sig.function) + "() got multiple values for argument '" +
                 sig.params[j] + "'");
    vals_[j] = args[nargs + i];
  }
  for (std::size_t j = 0; j < sig.required; ++j)
    if (!vals_[j])
      type_error(std::string(sig.function) + "() missing required argument '" + sig.params[j] +
                 "'");
}

bool Args::flag(std::size_t j, bool dflt) const {
  if (!vals_[j]) return dflt;
  const int t = PyObject_IsTrue(vals_[j]);
  if (t < 0) {
    PyErr_Clear();
    type_error(std::string(sig_.params[j]) + ": expected a bool");
  }
  return t == 1;
}

std::size_t Args::index(PyObject* key) const {
  for (std::size_t j = 0; j < sig_.names.size(); ++j)
    if (key == sig_.names[j]) return j;
  for (std::size_t j = 0; j < sig_.names.size(); ++j)
    if (PyUnicode_Compare(key, sig_.names[j]) == 0) return j;
  PyErr_Clear();
  type_error(std::string(sig_.function) + "() got an unexpected keyword argument '" +
             std::string(py::str(key)) + "'");
}

namespace {

PyObject* invalid_argument_type = nullptr;  // attnx._core.InvalidArgument, a ValueError

// C++ errors become Python exceptions as pybind11 would map them.
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

}  // namespace

PyObject* call_entry(EntryPoint f, Signature& sig, PyObject* const* args, Py_ssize_t nargs,
                     PyObject* kwnames) {
  try {
    return f(Args(sig, args, nargs, kwnames)).release().ptr();
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

void add_entry_point(py::module_& m, FastcallFn fn, const char* name, const char* doc) {
  // Owned for good: CPython keeps a pointer to the definition for the function's lifetime.
  auto* def = new PyMethodDef{name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)),
                              METH_FASTCALL | METH_KEYWORDS, doc};
  m.add_object(name, py::reinterpret_steal<py::object>(
                         PyCFunction_NewEx(def, m.ptr(), m.attr("__name__").ptr())));
}

void register_errors(py::module_& m) {
  invalid_argument_type =
      py::register_local_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError).ptr();
}

}  // namespace attnx::bind
