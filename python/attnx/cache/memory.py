"""Arrays for pages: zeroed, and starting on a 4 KiB boundary.

NumPy's large arrays start 16 bytes past a page boundary (the allocator's header), so a 64-byte
tile row or vector load of such a page straddles two cache lines, and a block of keys straddles
two 4 KiB pages, the span the hardware prefetcher follows. A page array made here starts on a
boundary, so every block whose size is a multiple of 64 bytes (4 KiB) keeps its lines (pages)
whole. bench/NOTES.md measures what it moves.
"""

from __future__ import annotations

import math

import numpy as np

PAGE_ALIGN = 4096


def aligned_zeros(shape: tuple[int, ...], dtype, align: int = PAGE_ALIGN) -> np.ndarray:
    """``np.zeros(shape, dtype)`` whose data starts on an ``align``-byte boundary (a view into a
    slightly larger buffer, which it keeps alive). Large buffers are mapped lazily, as
    ``np.zeros``'s: memory is committed when first written."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def aligned_copy(a: np.ndarray, align: int = PAGE_ALIGN) -> np.ndarray:
    """A C-contiguous copy of ``a`` that starts on an ``align``-byte boundary."""
    out = aligned_zeros(a.shape, a.dtype, align)
    out[...] = a
    return out
