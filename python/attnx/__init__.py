"""attnx: exact, fast attention for the CPU.

``attnx.attention`` computes ``softmax(q kᵀ · scale + M) v`` with a tiled, online-softmax C++
kernel (SIMD chosen at import, OpenMP threads); ``attnx.PagedKVCache`` keeps keys and values in a
pool of fixed-size blocks and decodes many sequences at once; ``attnx.reference`` is the pure-NumPy
definition that every kernel is tested against.
"""

from __future__ import annotations

import os as _os

import numpy as _np

from . import _core
from . import reference
from ._api import attention, paged_attention
from .cache import CacheFullError, PagedKVCache, StaleStepError, Step
from .layers import MultiHeadAttention
from .merge import merge_attention
from .torch_compat import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "attention",
    "paged_attention",
    "merge_attention",
    "cpu_features",
    "set_num_threads",
    "get_num_threads",
    "reference",
    "PagedKVCache",
    "Step",
    "CacheFullError",
    "StaleStepError",
    "MultiHeadAttention",
    "scaled_dot_product_attention",
]


def cpu_features():
    """What this CPU offers and which kernel path is active.

    Returns a dict: ``{"sse2", "avx2", "fma", "f16c", "avx512f": bool, "isa": "scalar" | "avx2" |
    "avx512", "openmp": bool}``. The path is the best the CPU supports unless ``ATTNX_ISA``
    (``scalar``, ``avx2`` or ``avx512``) forced one at import.
    """
    f = dict(_core.cpu_features())
    f["isa"] = _core.active_isa()
    f["openmp"] = bool(_core.has_openmp)
    return f


def set_num_threads(n):
    """Threads for every later call (``n >= 1``); ``0`` returns to OpenMP's setting
    (``OMP_NUM_THREADS``), read at each call. The process's OpenMP setting is never changed."""
    if isinstance(n, bool) or not isinstance(n, (int, _np.integer)) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    _core.set_num_threads(int(n))


def get_num_threads():
    """Threads a call uses when it is not given ``num_threads``."""
    return _core.get_num_threads()


def _select_isa_from_env():
    # Fail at import, with a clear message, if ATTNX_ISA asks for what this CPU lacks.
    isa = _os.environ.get("ATTNX_ISA", "").strip()
    if isa:
        try:
            _core.set_isa(isa)
        except ValueError as exc:
            raise ImportError(f"attnx: {exc}") from None


_select_isa_from_env()
