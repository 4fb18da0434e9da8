// out.h: where an entry point writes its result, and the memory-overlap rules behind it
// (docs/hardening.md: an `out` aliasing an input never changes what is read).
#pragma once
#include <initializer_list>

#include "args.h"

namespace attnx::bind {

// Whether the bytes that a and b span intersect: np.may_share_memory's rule (an empty array
// overlaps nothing).
bool may_share_memory(const py::array& a, const py::array& b);

// Whether two elements of `a` share a byte (a broadcast view, an `expand`ed tensor, as_strided):
// written there, one element's result would replace another's.
bool self_overlaps(const py::array& a);

// Where the kernel writes a call's result. `out` (checked first: dtype, byte order, shape,
// writable) is written directly when the kernel can address it and it shares no memory with
// anything the call reads; otherwise the kernel writes a fresh array that result() copies into
// `out`, so an `out` aliasing q, the pages or a mask never changes what is read. Every entry
// point with `out=` goes through here. An `out` that element strides cannot address is copied
// into the same way where `strided_ok` (dense attention's contract), refused otherwise.
struct OutTarget {
  py::object out = py::none();  // the caller's array, or None
  py::array write;              // what the kernel writes
  py::object result() const;    // `out` once written (copied into where needed), else `write`
};

// `of` names the input whose dtype `out` must have (dt); `fresh` is the dtype of a new array.
OutTarget out_target(py::handle out, const char* of, DType dt, const py::dtype& fresh, Dims dims,
                     std::initializer_list<py::handle> reads, bool strided_ok);

}  // namespace attnx::bind
