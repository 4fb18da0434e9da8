"""Types of attnx._core, the pybind11 module built from cpp/bindings.cpp.

Written by hand from the module's ``m.def`` calls: keep the two in step (the names are the
keyword names the binding accepts). ``py::array`` parameters take NumPy arrays only; the
``py::object`` ones (masks, lengths, per-head vectors, new K/V) take anything NumPy converts.
"""

from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

_Array = npt.NDArray[Any]
_Lse = npt.NDArray[np.float32]
_Window = tuple[int | None, int | None]

has_openmp: bool

class InvalidArgument(ValueError): ...

@overload
def attention(q: _Array, k: _Array, v: _Array, mask: npt.ArrayLike | None,
              kv_lens: npt.ArrayLike | None, q_lens: npt.ArrayLike | None, causal: bool,
              scale: float, out: _Array | None, return_lse: Literal[False], num_threads: int,
              window: _Window | None, softcap: float | None, sinks: npt.ArrayLike | None,
              alibi_slopes: npt.ArrayLike | None) -> _Array: ...
@overload
def attention(q: _Array, k: _Array, v: _Array, mask: npt.ArrayLike | None,
              kv_lens: npt.ArrayLike | None, q_lens: npt.ArrayLike | None, causal: bool,
              scale: float, out: _Array | None, return_lse: Literal[True], num_threads: int,
              window: _Window | None, softcap: float | None, sinks: npt.ArrayLike | None,
              alibi_slopes: npt.ArrayLike | None) -> tuple[_Array, _Lse]: ...
@overload
def attention(q: _Array, k: _Array, v: _Array, mask: npt.ArrayLike | None,
              kv_lens: npt.ArrayLike | None, q_lens: npt.ArrayLike | None, causal: bool,
              scale: float, out: _Array | None, return_lse: bool, num_threads: int,
              window: _Window | None, softcap: float | None, sinks: npt.ArrayLike | None,
              alibi_slopes: npt.ArrayLike | None) -> _Array | tuple[_Array, _Lse]: ...

@overload
def paged_attention(q: _Array, k_pages: _Array, v_pages: _Array, block_tables: _Array,
                    seq_lens: _Array, q_lens: npt.ArrayLike | None, causal: bool, scale: float,
                    out: _Array | None, return_lse: Literal[False], num_threads: int,
                    window: _Window | None, softcap: float | None, sinks: npt.ArrayLike | None,
                    alibi_slopes: npt.ArrayLike | None, k_new: npt.ArrayLike | None = None,
                    v_new: npt.ArrayLike | None = None,
                    slots: npt.ArrayLike | None = None) -> _Array: ...
@overload
def paged_attention(q: _Array, k_pages: _Array, v_pages: _Array, block_tables: _Array,
                    seq_lens: _Array, q_lens: npt.ArrayLike | None, causal: bool, scale: float,
                    out: _Array | None, return_lse: Literal[True], num_threads: int,
                    window: _Window | None, softcap: float | None, sinks: npt.ArrayLike | None,
                    alibi_slopes: npt.ArrayLike | None, k_new: npt.ArrayLike | None = None,
                    v_new: npt.ArrayLike | None = None,
                    slots: npt.ArrayLike | None = None) -> tuple[_Array, _Lse]: ...
@overload
def paged_attention(q: _Array, k_pages: _Array, v_pages: _Array, block_tables: _Array,
                    seq_lens: _Array, q_lens: npt.ArrayLike | None, causal: bool, scale: float,
                    out: _Array | None, return_lse: bool, num_threads: int,
                    window: _Window | None, softcap: float | None, sinks: npt.ArrayLike | None,
                    alibi_slopes: npt.ArrayLike | None, k_new: npt.ArrayLike | None = None,
                    v_new: npt.ArrayLike | None = None,
                    slots: npt.ArrayLike | None = None) -> _Array | tuple[_Array, _Lse]: ...

def cpu_features() -> dict[str, bool]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def probe_fma_gflops(num_threads: int, seconds: float = 0.3) -> float: ...
def probe_read_gbps(num_threads: int, bytes: int = 1 << 30, seconds: float = 0.5) -> float: ...
