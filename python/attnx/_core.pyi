"""Types of attnx._core, the pybind11 module built from cpp/bindings.cpp.

Written by hand from the module's definitions: keep the two in step (the names are the keyword
names the binding accepts; the two entry points take every argument by keyword, or positionally
in this order). ``py::array`` parameters take NumPy arrays only; the
``py::object`` ones (masks, lengths, per-head vectors, new K/V) take anything NumPy converts.
"""

from typing import Any, Literal, Optional, Sequence, Tuple, overload

import numpy as np
import numpy.typing as npt

_Array = npt.NDArray[Any]
_Lse = npt.NDArray[np.float32]
_DenseLse = npt.NDArray[np.float32] | npt.NDArray[np.float64]  # float64 for float64 q, k, v
_Window = tuple[int | None, int | None]

class InvalidArgument(ValueError): ...

@overload
def attention(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, mask: npt.ArrayLike | None = None,
              kv_lens: npt.ArrayLike | None = None, q_lens: npt.ArrayLike | None = None,
              causal: bool = False, scale: float | None = None, out: _Array | None = None,
              return_lse: Literal[False] = ..., num_threads: int = 0, window: _Window | None = None,
              softcap: float | None = None, sinks: npt.ArrayLike | None = None,
              alibi_slopes: npt.ArrayLike | None = None) -> _Array: ...
@overload
def attention(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, mask: npt.ArrayLike | None = None,
              kv_lens: npt.ArrayLike | None = None, q_lens: npt.ArrayLike | None = None,
              causal: bool = False, scale: float | None = None, out: _Array | None = None,
              *, return_lse: Literal[True], num_threads: int = 0, window: _Window | None = None,
              softcap: float | None = None, sinks: npt.ArrayLike | None = None,
              alibi_slopes: npt.ArrayLike | None = None) -> tuple[_Array, _DenseLse]: ...
@overload
def attention(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, mask: npt.ArrayLike | None = None,
              kv_lens: npt.ArrayLike | None = None, q_lens: npt.ArrayLike | None = None,
              causal: bool = False, scale: float | None = None, out: _Array | None = None,
              return_lse: bool = ..., num_threads: int = 0, window: _Window | None = None,
              softcap: float | None = None, sinks: npt.ArrayLike | None = None,
              alibi_slopes: npt.ArrayLike | None = None) -> _Array | tuple[_Array, _DenseLse]: ...

@overload
def paged_attention(q: npt.ArrayLike, k_pages: npt.ArrayLike, v_pages: npt.ArrayLike, block_tables: npt.ArrayLike,
                    seq_lens: npt.ArrayLike, q_lens: npt.ArrayLike | None = None, causal: bool = True,
                    scale: float | None = None, out: _Array | None = None,
                    return_lse: Literal[False] = ..., num_threads: int = 0,
                    window: _Window | None = None, softcap: float | None = None,
                    sinks: npt.ArrayLike | None = None,
                    alibi_slopes: npt.ArrayLike | None = None, k_new: npt.ArrayLike | None = None,
                    v_new: npt.ArrayLike | None = None,
                    slots: npt.ArrayLike | None = None, k_scales: npt.ArrayLike | None = None,
                    v_scales: npt.ArrayLike | None = None, prior_out: npt.ArrayLike | None = None,
                    prior_lse: npt.ArrayLike | None = None,
                    min_shared_keys: int | None = None) -> _Array: ...
@overload
def paged_attention(q: npt.ArrayLike, k_pages: npt.ArrayLike, v_pages: npt.ArrayLike, block_tables: npt.ArrayLike,
                    seq_lens: npt.ArrayLike, q_lens: npt.ArrayLike | None = None, causal: bool = True,
                    scale: float | None = None, out: _Array | None = None,
                    *, return_lse: Literal[True], num_threads: int = 0,
                    window: _Window | None = None, softcap: float | None = None,
                    sinks: npt.ArrayLike | None = None,
                    alibi_slopes: npt.ArrayLike | None = None, k_new: npt.ArrayLike | None = None,
                    v_new: npt.ArrayLike | None = None,
                    slots: npt.ArrayLike | None = None, k_scales: npt.ArrayLike | None = None,
                    v_scales: npt.ArrayLike | None = None, prior_out: npt.ArrayLike | None = None,
                    prior_lse: npt.ArrayLike | None = None,
                    min_shared_keys: int | None = None) -> tuple[_Array, _Lse]: ...
@overload
def paged_attention(q: npt.ArrayLike, k_pages: npt.ArrayLike, v_pages: npt.ArrayLike, block_tables: npt.ArrayLike,
                    seq_lens: npt.ArrayLike, q_lens: npt.ArrayLike | None = None, causal: bool = True,
                    scale: float | None = None, out: _Array | None = None,
                    return_lse: bool = ..., num_threads: int = 0,
                    window: _Window | None = None, softcap: float | None = None,
                    sinks: npt.ArrayLike | None = None,
                    alibi_slopes: npt.ArrayLike | None = None, k_new: npt.ArrayLike | None = None,
                    v_new: npt.ArrayLike | None = None,
                    slots: npt.ArrayLike | None = None, k_scales: npt.ArrayLike | None = None,
                    v_scales: npt.ArrayLike | None = None, prior_out: npt.ArrayLike | None = None,
                    prior_lse: npt.ArrayLike | None = None,
                    min_shared_keys: int | None = None) -> _Array | tuple[_Array, _Lse]: ...

class StepPlan:
    """A cache step's tables and slots, checked once, and its shared-prefix groups, planned once
    (with ``min_shared_keys``); ``attend`` runs one layer (bindings.cpp)."""
    def __init__(self, layers: Sequence[tuple[_Array, _Array, _Array | None, _Array | None]],
                 block_tables: npt.ArrayLike, seq_lens: npt.ArrayLike, q_lens: npt.ArrayLike,
                 slots: npt.ArrayLike, values_from_keys: bool, max_left: int | None,
                 min_shared_keys: int | None = None) -> None: ...
    def attend(self, layer: int, q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike | None,
               scale: float | None, softcap: float | None, window: _Window | None,
               sinks: npt.ArrayLike | None, alibi: npt.ArrayLike | None, threads: int | None,
               return_lse: bool, shared_prefix: bool) -> _Array | tuple[_Array, _Lse]: ...

def plan_cascade(block_tables: npt.ArrayLike, seq_lens: npt.ArrayLike, q_lens: npt.ArrayLike,
                 block_size: int, min_saved_keys: int) -> list[tuple[list[int], int, int]]:
    """The shared-prefix groups of a step's tables, ``(rows, first, end)`` each (cpp/bind/cascade.cpp)."""

def cpu_features() -> dict[str, bool]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...
def bf16_dot_gain() -> float: ...
def set_int8_query(on: bool) -> None: ...
def int8_query() -> bool: ...
def set_num_threads(n: int) -> None: ...
def share_blas_threads(on: bool) -> int: ...
def share_omp_threads(on: bool) -> bool: ...
def get_num_threads() -> int: ...
def _max_threads() -> int: ...
def _pool_threads() -> int: ...
def probe_fma_gflops(num_threads: int, seconds: float = 0.3) -> float: ...
def probe_read_gbps(num_threads: int, bytes: int = 1 << 30, seconds: float = 0.5) -> float: ...
def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     sequences: np.ndarray, initial_state: Optional[np.ndarray],
                     output_final_state: bool, scale: float, qk_l2norm: bool, mode: int,
                     num_threads: int) -> Tuple[np.ndarray, Optional[np.ndarray]]: ...
