"""Types of attnx._core, the pybind11 module built from cpp/bind/.

Written by hand from the module's definitions: keep the two in step (the names are the keyword
names the binding accepts; the two entry points take every argument by keyword, or positionally
in this order). ``py::array`` parameters take NumPy arrays only; the
``py::object`` ones (masks, lengths, per-head vectors, new K/V) take anything NumPy converts.
"""

from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

_Array = npt.NDArray[Any]
_Lse = npt.NDArray[np.float32]
_DenseLse = npt.NDArray[np.float32] | npt.NDArray[np.float64]  # float64 for float64 q, k, v
_Window = tuple[int | None, int | None]
_In = npt.ArrayLike  # what NumPy converts (masks, lengths, per-head vectors, pages, new K/V)
_Opt = npt.ArrayLike | None

class InvalidArgument(ValueError): ...

# Each entry point has three signatures that differ only in return_lse: omitted or False returns
# out, True returns (out, lse), a bool not known until run time returns either.
@overload
def attention(
    q: _In,
    k: _In,
    v: _In,
    mask: _Opt = None,
    kv_lens: _Opt = None,
    q_lens: _Opt = None,
    causal: bool = False,
    scale: float | None = None,
    out: _Array | None = None,
    return_lse: Literal[False] = ...,
    num_threads: int = 0,
    window: _Window | None = None,
    softcap: float | None = None,
    sinks: _Opt = None,
    alibi_slopes: _Opt = None,
) -> _Array: ...
@overload
def attention(
    q: _In,
    k: _In,
    v: _In,
    mask: _Opt = None,
    kv_lens: _Opt = None,
    q_lens: _Opt = None,
    causal: bool = False,
    scale: float | None = None,
    out: _Array | None = None,
    *,
    return_lse: Literal[True],
    num_threads: int = 0,
    window: _Window | None = None,
    softcap: float | None = None,
    sinks: _Opt = None,
    alibi_slopes: _Opt = None,
) -> tuple[_Array, _DenseLse]: ...
@overload
def attention(
    q: _In,
    k: _In,
    v: _In,
    mask: _Opt = None,
    kv_lens: _Opt = None,
    q_lens: _Opt = None,
    causal: bool = False,
    scale: float | None = None,
    out: _Array | None = None,
    return_lse: bool = ...,
    num_threads: int = 0,
    window: _Window | None = None,
    softcap: float | None = None,
    sinks: _Opt = None,
    alibi_slopes: _Opt = None,
) -> _Array | tuple[_Array, _DenseLse]: ...
@overload
def paged_attention(
    q: _In,
    k_pages: _In,
    v_pages: _In,
    block_tables: _In,
    seq_lens: _In,
    q_lens: _Opt = None,
    causal: bool = True,
    scale: float | None = None,
    out: _Array | None = None,
    return_lse: Literal[False] = ...,
    num_threads: int = 0,
    window: _Window | None = None,
    softcap: float | None = None,
    sinks: _Opt = None,
    alibi_slopes: _Opt = None,
    k_new: _Opt = None,
    v_new: _Opt = None,
    slots: _Opt = None,
    k_scales: _Opt = None,
    v_scales: _Opt = None,
    prior_out: _Opt = None,
    prior_lse: _Opt = None,
    min_shared_keys: int | None = None,
) -> _Array: ...
@overload
def paged_attention(
    q: _In,
    k_pages: _In,
    v_pages: _In,
    block_tables: _In,
    seq_lens: _In,
    q_lens: _Opt = None,
    causal: bool = True,
    scale: float | None = None,
    out: _Array | None = None,
    *,
    return_lse: Literal[True],
    num_threads: int = 0,
    window: _Window | None = None,
    softcap: float | None = None,
    sinks: _Opt = None,
    alibi_slopes: _Opt = None,
    k_new: _Opt = None,
    v_new: _Opt = None,
    slots: _Opt = None,
    k_scales: _Opt = None,
    v_scales: _Opt = None,
    prior_out: _Opt = None,
    prior_lse: _Opt = None,
    min_shared_keys: int | None = None,
) -> tuple[_Array, _Lse]: ...
@overload
def paged_attention(
    q: _In,
    k_pages: _In,
    v_pages: _In,
    block_tables: _In,
    seq_lens: _In,
    q_lens: _Opt = None,
    causal: bool = True,
    scale: float | None = None,
    out: _Array | None = None,
    return_lse: bool = ...,
    num_threads: int = 0,
    window: _Window | None = None,
    softcap: float | None = None,
    sinks: _Opt = None,
    alibi_slopes: _Opt = None,
    k_new: _Opt = None,
    v_new: _Opt = None,
    slots: _Opt = None,
    k_scales: _Opt = None,
    v_scales: _Opt = None,
    prior_out: _Opt = None,
    prior_lse: _Opt = None,
    min_shared_keys: int | None = None,
) -> _Array | tuple[_Array, _Lse]: ...

class StepPlan:
    """A cache step's tables and slots, checked once, and its shared-prefix groups, planned once
    (with ``min_shared_keys``); ``attend`` runs one layer (cpp/bind/step.cpp)."""
    def __init__(
        self,
        layers: Sequence[tuple[_Array, _Array, _Array | None, _Array | None]],
        block_tables: _In,
        seq_lens: _In,
        q_lens: _In,
        slots: _In,
        values_from_keys: bool,
        max_left: int | None,
        min_shared_keys: int | None = None,
    ) -> None: ...
    def attend(
        self,
        layer: int,
        q: _In,
        k: _In,
        v: _Opt,
        scale: float | None,
        softcap: float | None,
        window: _Window | None,
        sinks: _Opt,
        alibi: _Opt,
        threads: int | None,
        return_lse: bool,
        shared_prefix: bool,
    ) -> _Array | tuple[_Array, _Lse]: ...

def plan_cascade(
    block_tables: _In, seq_lens: _In, q_lens: _In, block_size: int, min_saved_keys: int
) -> list[tuple[list[int], int, int]]:
    """The shared-prefix groups of a step's tables, ``(rows, first, end)`` each (cpp/bind/cascade.cpp)."""

def cpu_features() -> dict[str, bool]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...
def bf16_dot_gain() -> float: ...

BF16_DOT_GAIN_LINE: float  # avx512bf16 is the default only above this gain

def set_int8_query(setting: int) -> None: ...
def int8_query_setting() -> int: ...
def int8_query() -> bool: ...
def active_integer_products() -> bool: ...
def set_float32_bf16_products(on: bool) -> None: ...
def float32_bf16_products() -> bool: ...
def active_bf16_products() -> bool: ...
def set_int8_tiles(mode: str, min_rows: int) -> None: ...
def int8_tiles() -> tuple[str, int]: ...
def set_num_threads(n: int) -> None: ...
def share_blas_threads(on: bool) -> int: ...
def share_omp_threads(on: bool) -> bool: ...
def get_num_threads() -> int: ...
def _max_threads() -> int: ...
def _pool_threads() -> int: ...
def probe_fma_gflops(num_threads: int, seconds: float = 0.3) -> float: ...
def probe_read_gbps(num_threads: int, bytes: int = 1 << 30, seconds: float = 0.5) -> float: ...
def gated_delta_rule(
    q: _Array,
    k: _Array,
    v: _Array,
    g: _Array,
    beta: _Array,
    sequences: _In,
    initial_state: _Array | None,
    output_final_state: bool,
    scale: float,
    qk_l2norm: bool,
    mode: int,
    num_threads: int,
) -> tuple[_Array, npt.NDArray[np.float32] | None]: ...
