"""The oracle of torch's ``scaled_dot_product_attention`` (top-left causal mask, its own
broadcasting): :func:`scaled_dot_product_attention`."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..ops.sdpa_args import check_dropout, check_qkv
from ..quant import FLOAT_DTYPES as _FLOAT_DTYPES
from ..quant import float_array as _float_array
from .attention import Array, attention

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: npt.ArrayLike,
    key: npt.ArrayLike,
    value: npt.ArrayLike,
    attn_mask: npt.ArrayLike | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Array:
    """Reference twin of :func:`attnx.scaled_dot_product_attention`: torch's semantics, float64.

    ``softmax(query @ keyᵀ * scale + M) @ value`` over arrays ``(..., L, E)``, ``(..., S, E)``,
    ``(..., S, Ev)`` whose leading axes broadcast (axis -3 is the head axis for
    ``enable_gqa``, where kv head ``h // (Hq // Hkv)`` serves query head ``h``). ``attn_mask``
    is boolean (True = takes part) or additive float, broadcastable to ``(..., L, S)``.
    ``is_causal`` is **top-left** aligned (row i sees j <= i, the torch convention; attnx's
    ``causal`` is bottom-right) and combines with ``attn_mask``. ``dropout_p`` must be 0.

    Computed explicitly: the leading axes are broadcast, k and v repeated per query head, the
    top-left triangle built as a boolean mask, and :func:`attention` called on the result.
    Rows that see no key are 0 (torch 2.x on the CPU). Returns query's dtype.
    """
    check_dropout(dropout_p)
    q, k, v = _inputs(query, key, value, enable_gqa)
    L, E = q.shape[-2:]
    S = k.shape[-2]
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError as exc:
        raise ValueError("key: leading shapes of query, key and value do not broadcast") from exc
    n = int(np.prod(lead, dtype=np.int64))  # every leading index becomes one batch entry
    q4 = np.broadcast_to(q, lead + (L, E)).reshape(n, 1, L, E)
    k4 = np.broadcast_to(k, lead + (S, E)).reshape(n, 1, S, E)
    v4 = np.broadcast_to(v, lead + v.shape[-2:]).reshape(n, 1, S, v.shape[-1])
    mask = _mask(attn_mask, is_causal, lead, L, S, n)
    if scale is None and E == 0:
        scale = 1.0
    out: Any = attention(
        q4.astype(np.float64),
        k4.astype(np.float64),
        v4.astype(np.float64),
        mask=mask,
        scale=scale,
        out_dtype=q.dtype,
    )
    return out.reshape(lead + out.shape[-2:])


def _inputs(
    query: npt.ArrayLike, key: npt.ArrayLike, value: npt.ArrayLike, enable_gqa: bool
) -> tuple[Array, Array, Array]:
    """q, k and v checked, with k and v repeated to the query heads for ``enable_gqa``."""
    q = _float_array(query, "query")
    k = _float_array(key, "key")
    v = _float_array(value, "value")
    check_qkv(q, k, v, enable_gqa)
    if enable_gqa:
        hq = q.shape[-3]
        k, v = (np.repeat(a, hq // a.shape[-3], axis=-3) for a in (k, v))
    return q, k, v


def _mask(attn_mask: Any, is_causal: bool, lead: tuple[int, ...], L: int, S: int, n: int) -> Any:
    """The ``(n, 1, L, S)`` mask :func:`attention` reads: boolean, or additive float64 with
    ``-inf`` where the top-left causal triangle or a boolean mask blocks."""
    visible: Any = np.ones((L, S), dtype=bool)
    if is_causal:
        visible = np.tril(visible)  # top-left: j <= i
    additive = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype != np.bool_ and m.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"attn_mask: must be boolean or float, got dtype {m.dtype}")
        if m.ndim > len(lead) + 2:
            raise ValueError(f"attn_mask: shape {m.shape} does not broadcast to {lead + (L, S)}")
        try:
            m = np.broadcast_to(m, lead + (L, S))
        except ValueError as exc:
            raise ValueError(
                f"attn_mask: shape {m.shape} does not broadcast to {lead + (L, S)}"
            ) from exc
        if m.dtype == np.bool_:
            visible = visible & m
        else:
            additive = m
    visible = np.broadcast_to(visible, lead + (L, S)).reshape(n, 1, L, S)
    if additive is not None:
        # blocked pairs become -inf, which attention() treats as not visible
        additive = np.where(visible, additive.reshape(n, 1, L, S).astype(np.float64), -np.inf)
        return additive
    return visible
