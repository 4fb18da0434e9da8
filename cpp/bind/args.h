// args.h: the binding's one check vocabulary (arrays, dtypes, strides, scalars, the score
// modifiers) and its calling machinery (METH_FASTCALL entry points that bind their own arguments,
// C++ errors mapped to Python exceptions, the GIL released around long kernels). Every message
// names the argument and says what was expected; nothing is written before every check passes
// (docs/hardening.md).
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "attnx/types.h"

namespace attnx::bind {

namespace py = pybind11;

// Named extents, ("B", 2), ...: an expected shape, printed as (B=2, ...).
using Dims = std::initializer_list<std::pair<const char*, int64_t>>;

[[noreturn]] void value_error(const std::string& msg);
[[noreturn]] void type_error(const std::string& msg);

// ---- words for messages ----------------------------------------------------------------------
std::string shape_str(const py::array& a);  // (2, 3) or (2,)
std::string dims_str(Dims dims);            // (B=2, Hq=3)
std::string dtype_str(const py::array& a);  // float32
std::string type_name(py::handle h);        // the Python type's name: list, Tensor
std::string num_str(double x);

// ---- dtypes and byte order -------------------------------------------------------------------
int ml_dtype_num(const char* name);  // an ml_dtypes type's NumPy type number, -1 without ml_dtypes
int bfloat16_num();
bool native_order(const py::dtype& dt);
bool is_float32(const py::dtype& dt);  // float32 in native byte order
void check_native(const py::array& a, const char* name);
// A float storage dtype (float32, float16, bfloat16); float64 too where `f64_ok`.
DType dtype_of(const py::array& a, const char* name, bool f64_ok = false);
// The dtype of KV pages: a float dtype, or a quantised one (int8, float8_e4m3fn, float8_e5m2).
DType page_dtype_of(const py::array& a, const char* name);

// ---- arrays ----------------------------------------------------------------------------------
// A NumPy array argument as it is (no conversion).
py::array array_arg(py::handle obj, const char* name);
// A read-only array argument in native byte order (a byte-swapped one is converted: one copy).
py::array native_input(py::handle obj, const char* name);
// native_input, then a C-ordered copy where the kernels cannot address it through element strides
// (misaligned, or, with `unit_last`, a strided last axis): attnx._validate.kernel_array's rule.
py::array kernel_input(py::handle obj, const char* name, bool unit_last = true);

// NumPy's ALIGNED flag: asked of every array that pybind11 converts here, so that a misaligned
// integer array is copied rather than read through a misaligned pointer. The conversion also
// brings any byte order to the native one.
constexpr int kAligned = py::detail::npy_api::NPY_ARRAY_ALIGNED_;
template <typename T>
using Native = py::array_t<T, py::array::c_style | py::array::forcecast | kAligned>;

// Why the kernels cannot address `a` through element strides, or nullptr if they can.
const char* stride_problem(const py::array& a, bool unit_last);
// Element strides of `a` (0 on axes of extent 1); refuses what element strides cannot express.
std::vector<int64_t> elem_strides(const py::array& a, const char* name, bool unit_last = true);
void check_rank(const py::array& a, const char* name, int ndim,
                const char* axes);  // "(B, Hq, Sq, Dk)"
void check_shape(const py::array& a, const char* name, Dims dims);
// An optional (n,) integer array as int32, every value in [0, hi].
py::array_t<int32_t> int_vector(py::handle obj, const char* name, int64_t n, int64_t hi,
                                const char* hi_name);

// ---- scalars and modifiers ---------------------------------------------------------------------
// T: float, or double for the float64 kernels (explicitly instantiated for both in args.cpp).
template <class T = float>
T positive_float(double x, const char* name);
double real_arg(py::handle h, const char* name);
int64_t int_arg(py::handle h, const char* name, int64_t dflt);
template <class T = float>
T scale_arg(py::handle h, int64_t Dk);  // None: 1/sqrt(Dk)
template <class T = float>
py::array_t<T> head_vector(py::handle obj, const char* name, int64_t n);
// alibi_slopes: head_vector's, and each slope times `reach` (no query-key distance of the call is
// larger) finite in T, where the bias -slope * distance is formed
template <class T = float>
py::array_t<T> alibi_vector(py::handle obj, int64_t n, int64_t reach);
template <class T = float>
BasicVariants<T> variants(py::handle window, py::handle softcap);
int threads_arg(int64_t n);

// ---- calls -------------------------------------------------------------------------------------
// The entry points are METH_FASTCALL functions that bind their arguments here, by name, as Python
// does (positional first, then keywords). pybind11's dispatcher looks every declared parameter up
// by string; a caller's keyword names are interned, so they match here by pointer.
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
  Args(Signature& sig, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames);
  // The argument, None when absent.
  py::handle operator[](std::size_t j) const {
    return vals_[j] ? py::handle(vals_[j]) : py::handle(Py_None);
  }
  // A bool argument: its truth value, or `dflt` when absent.
  bool flag(std::size_t j, bool dflt) const;

 private:
  std::size_t index(PyObject* key) const;
  const Signature& sig_;
  std::vector<PyObject*> vals_;  // borrowed from the call
};

using EntryPoint = py::object (*)(const Args&);

// Runs f on the call's arguments; a C++ error becomes the Python exception pybind11 would raise
// (its dispatcher is bypassed), and the result nullptr.
PyObject* call_entry(EntryPoint f, Signature& sig, PyObject* const* args, Py_ssize_t nargs,
                     PyObject* kwnames);

template <EntryPoint F, Signature* S>
PyObject* fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return call_entry(F, *S, args, nargs, kwnames);
}

using FastcallFn = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*);
void add_entry_point(py::module_& m, FastcallFn fn, const char* name, const char* doc);

// Adds F as m.<S->function>, documented by `doc` (its Python signature).
template <EntryPoint F, Signature* S>
void def_entry_point(py::module_& m, const char* doc) {
  add_entry_point(m, &fastcall<F, S>, S->function, doc);
}

// Registers attnx._core.InvalidArgument (a ValueError) as what InvalidArgument becomes.
void register_errors(py::module_& m);

// Below this many multiply-adds a call keeps the GIL (the work takes a few microseconds).
constexpr double kGilFreeWork = 1 << 16;

// Runs `f` without the GIL unless the work (multiply-adds) is too small to pay for releasing it.
template <typename F>
void run_kernel(double work, F&& f) {
  if (work < kGilFreeWork) {
    f();
  } else {
    py::gil_scoped_release nogil;
    f();
  }
}

}  // namespace attnx::bind
