"""Argument rules of ``scaled_dot_product_attention``, shared by attnx's (``attnx.integrations.sdpa``)
and its float64 twin (``attnx.reference.sdpa``): NumPy only, so the reference loads without the
C++ core (as ``ops/delta_args.py`` for the delta rule). Every error names the argument."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["check_dropout", "check_qkv"]


def check_dropout(dropout_p: Any) -> None:
    """``dropout_p`` must be a real 0: attnx is inference only."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:  # also NaN
        raise ValueError(
            f"dropout_p: attnx is inference only and does not apply dropout; expected 0.0, got "
            f"{dropout_p!r}"
        )


def check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, enable_gqa: bool) -> None:
    """query ``(..., L, E)``, key ``(..., S, E)``, value ``(..., S, Ev)`` of one dtype; with
    ``enable_gqa``, a head axis (-3) whose query heads are a multiple of key's and value's."""
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{name}: expected shape (..., S, E) with rank >= 2, got {a.shape}")
    for name, a in (("key", k), ("value", v)):
        if a.dtype != q.dtype:
            raise TypeError(
                f"{name}: dtype {a.dtype} differs from query's dtype {q.dtype} "
                "(query, key and value must share one dtype, as in torch)"
            )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key: embedding size {k.shape[-1]} differs from query's {q.shape[-1]}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"value: sequence length {v.shape[-2]} differs from key's {k.shape[-2]}")
    if not enable_gqa:
        return
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 3:
            raise ValueError(
                f"{name}: enable_gqa needs a head axis (..., H, S, E), got shape {a.shape}"
            )
    hq = q.shape[-3]
    for name, a in (("key", k), ("value", v)):
        if a.shape[-3] == 0 or hq % a.shape[-3]:
            raise ValueError(
                f"{name}: enable_gqa needs the query heads ({hq}) to be a multiple "
                f"of the {name} heads ({a.shape[-3]})"
            )
