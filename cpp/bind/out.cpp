// out.cpp: out targets and the overlap checks of out.h.
#include "out.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace attnx::bind {

bool may_share_memory(const py::array& a, const py::array& b) {
  if (a.size() == 0 || b.size() == 0) return false;
  auto span = [](const py::array& x) {  // the bytes [first, last] that x spans
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

namespace {

using Axes = std::vector<std::pair<int64_t, int64_t>>;  // (|byte stride|, extent) of stepped axes

// Sorted by |stride|: true when each axis steps past everything the smaller ones span (every
// ordinary, transposed or sliced array), so that no two elements can meet.
bool nested(const Axes& axes, int64_t es) {
  int64_t span = es;  // bytes spanned by the axes before this one
  for (auto& [stride, n] : axes) {
    if (stride < span) return false;
    span += stride * (n - 1);
  }
  return true;
}

// Interleaved strides: marks each element's bytes, odometer over the elements.
bool bytes_collide(const Axes& axes, int64_t es) {
  int64_t span = es;
  for (auto& [stride, n] : axes) span += stride * (n - 1);
  std::vector<bool> used(std::size_t(span), false);
  std::vector<int64_t> idx(axes.size(), 0);
  for (int64_t off = 0;;) {  // offsets from the lowest address
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

}  // namespace

// Exact: axes of extent 1 are never stepped; a zero stride rules overlap in, nested strides rule
// it out, and anything else is settled byte by byte.
bool self_overlaps(const py::array& a) {
  if (a.size() <= 1) return false;
  const int64_t es = int64_t(a.itemsize());
  Axes axes;
  for (py::ssize_t i = 0; i < a.ndim(); ++i)
    if (a.shape(i) > 1) axes.emplace_back(std::abs(int64_t(a.strides(i))), int64_t(a.shape(i)));
  std::sort(axes.begin(), axes.end());
  if (axes.front().first == 0) return true;
  return !nested(axes, es) && bytes_collide(axes, es);
}

py::object OutTarget::result() const {
  if (out.is_none()) return write;
  if (!out.is(write)) {
    static const py::handle copyto =
        py::object(py::module_::import("numpy").attr("copyto")).release();  // kept for good
    copyto(out, write);
  }
  return out;
}

OutTarget out_target(py::handle out, const char* of, DType dt, const py::dtype& fresh, Dims dims,
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
    type_error(std::string("out: expected dtype ") + dtype_name(dt) + " (the dtype of " + of +
               "), got " + dtype_str(o));
  check_shape(o, "out", dims);
  if (!o.writeable()) value_error("out: array is not writable");
  if (self_overlaps(o))
    value_error(
        "out: elements of the array overlap one another (a broadcast or expanded view, "
        "byte strides " +
        std::string(py::str(o.attr("strides"))) +
        "): each result needs its own memory; pass a fresh array");
  if (!strided_ok) elem_strides(o, "out");  // refuses what the kernel cannot address
  bool direct = stride_problem(o, true) == nullptr;
  for (py::handle r : reads)
    if (direct && py::isinstance<py::array>(r))
      direct = !may_share_memory(o, py::reinterpret_borrow<py::array>(r));
  t.out = o;
  t.write = direct ? o : py::array(fresh, shape);
  return t;
}

}  // namespace attnx::bind
