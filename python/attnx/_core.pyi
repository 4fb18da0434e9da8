# Type stub of the C++ core (cpp/bindings.cpp). The attnx package documents the behaviour; the two
# entry points take their arguments by keyword (positional in this order works too).
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

_Result = Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]

class InvalidArgument(ValueError): ...

has_openmp: bool

def attention(q: Any, k: Any, v: Any, mask: Any = None, kv_lens: Any = None, q_lens: Any = None,
              causal: bool = False, scale: Optional[float] = None, out: Optional[np.ndarray] = None,
              return_lse: bool = False, num_threads: int = 0,
              window: Optional[Tuple[Optional[int], Optional[int]]] = None,
              softcap: Optional[float] = None, sinks: Any = None,
              alibi_slopes: Any = None) -> _Result: ...
def paged_attention(q: Any, k_pages: Any, v_pages: Any, block_tables: Any, seq_lens: Any,
                    q_lens: Any = None, causal: bool = True, scale: Optional[float] = None,
                    out: Optional[np.ndarray] = None, return_lse: bool = False,
                    num_threads: int = 0,
                    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                    softcap: Optional[float] = None, sinks: Any = None, alibi_slopes: Any = None,
                    k_new: Any = None, v_new: Any = None, slots: Any = None,
                    k_scales: Optional[np.ndarray] = None,
                    v_scales: Optional[np.ndarray] = None) -> _Result: ...
def cpu_features() -> Dict[str, bool]: ...
def active_isa() -> str: ...
def set_isa(name: str) -> None: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def probe_fma_gflops(num_threads: int, seconds: float = ...) -> float: ...
def probe_read_gbps(num_threads: int, bytes: int = ..., seconds: float = ...) -> float: ...
