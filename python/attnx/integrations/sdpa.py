"""A PyTorch-compatible entry point: ``scaled_dot_product_attention`` on NumPy arrays.

Code ported from ``torch.nn.functional.scaled_dot_product_attention`` runs unchanged (with
NumPy arrays in place of tensors) and gets the same numbers from attnx's kernels. The one thing to
keep in mind when mixing it with :func:`attnx.attention`: the two ``causal`` flags are aligned
differently when the query and key lengths differ (see the docstring below).

:func:`scaled_dot_product_attention`: Same arguments, shapes and results as PyTorch's function (inference only)::

    out = softmax(query @ key.T * scale + M) @ value

Parameters
----------
query : ndarray ``(..., L, E)``
key : ndarray ``(..., S, E)``
value : ndarray ``(..., S, Ev)``
    Leading dimensions broadcast against each other as in torch; with ``enable_gqa`` the
    third-from-last axis is the head axis. float32, float16 or bfloat16 (computed in float32,
    returned in the input dtype); float64 is computed and accumulated in float64, as torch
    does.
attn_mask : ndarray, optional
    Broadcastable to ``(..., L, S)``. Boolean: **True = takes part in attention** (torch's
    convention for this function; note ``torch.nn.MultiheadAttention`` uses the opposite).
    Floating: added to the scores (``-inf`` blocks).
dropout_p : float
    Must be 0.0: anything else raises ``ValueError`` (attnx is inference only).
is_causal : bool
    **Top-left aligned, as in torch**: query row ``i`` sees key ``j`` iff ``j <= i``,
    whatever ``L`` and ``S``. When ``attn_mask`` is given too, the two are combined (AND
    for a boolean mask, ``-inf`` above the diagonal for a float one): that is what torch
    2.13's CPU kernel returns for 4-D inputs, while torch's documentation, its fallback
    path for other ranks and, from torch 2.14, every path raise an error for this
    combination.
scale : float, optional
    Defaults to ``1/sqrt(E)``. Any float, as in torch: 0 gives uniform attention over the
    visible keys, a negative scale flips the scores, NaN propagates. Held in float32 like
    torch's CPU kernels (so ``1e39`` is inf and ``1e-46`` is 0; float64 for float64
    inputs); an infinite scale, whose
    scores are all ``±inf``, is computed by :func:`attnx.reference.scaled_dot_product_attention`
    (float64, slow).
enable_gqa : bool
    Grouped-query attention: ``key``/``value`` may have fewer heads (axis ``-3``) than
    ``query``; query head ``h`` reads kv head ``h // (Hq // Hkv)`` (torch's
    ``repeat_interleave``), without any copy of the keys and values here.

Returns
-------
ndarray ``(..., L, Ev)`` of query's dtype.

Notes
-----
**Difference from** :func:`attnx.attention`: attnx's ``causal=True`` is aligned
bottom-right (row ``i`` sees ``j <= i + S - L``, so one new query against a cache sees all
of it), while torch's ``is_causal`` is aligned top-left (``j <= i``). The two agree when
``L == S``. Here the top-left mask is mapped onto the kernel without building it: for
``L <= S`` no query ever sees a key at ``j >= L``, so the keys are sliced to the first ``L``
(a view) and the square causal kernel runs; for ``L > S`` the kernel's window
``(None, L - S)`` gives exactly ``j <= i``.

A query row that sees no key (fully masked by ``attn_mask``) returns zeros, which is what
torch 2.x returns on the CPU for such rows (older versions returned NaN). A ``+inf`` in a
float mask yields NaN in that row, as in torch.

Examples
--------
>>> import numpy as np, attnx
>>> q = np.ones((1, 2, 3, 4), np.float32); k = v = np.ones((1, 2, 5, 4), np.float32)
>>> attnx.scaled_dot_product_attention(q, k, v, is_causal=True).shape
(1, 2, 3, 4)
"""

from __future__ import annotations

import numbers
from typing import Any, cast

import numpy as np

from .._validate import as_array as _as_array
from .._validate import check_broadcast as _check_broadcast
from .._validate import flag as _flag
from .._validate import native_order as _native_order
from ..ops import attention as _api
from ..ops.sdpa_args import check_dropout, check_qkv
from . import tensors as _tensors

__all__ = ["scaled_dot_product_attention"]

try:  # bfloat16 storage is optional in the same way as in attnx.reference
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a declared dependency
    _BF16 = None

_KERNEL_DTYPES = tuple(
    d for d in (np.dtype(np.float32), np.dtype(np.float16), _BF16) if d is not None
)
_F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
_F32_MAX = float(np.finfo(np.float32).max)  # the binding takes scales in [_F32_TINY, _F32_MAX]


def _check_inputs(query, key, value, enable_gqa):
    """query, key and value as native-order arrays, checked by the rules the reference shares."""
    q, k, v = (
        _native_order(_as_array(x, name))  # dtypes compare equal whatever the byte order
        for name, x in (("query", query), ("key", key), ("value", value))
    )
    check_qkv(q, k, v, enable_gqa)
    if q.dtype not in _KERNEL_DTYPES and q.dtype != np.float64:
        raise TypeError(
            f"query: dtype {q.dtype} is not supported; expected float32, float16, "
            "bfloat16 or float64"
        )
    return q, k, v


def _lead_shapes(q, k, v, enable_gqa):
    """Leading (batch..., heads) shapes of q, k, v padded to one rank, and the output's."""
    n = max(q.ndim, k.ndim, v.ndim) - 2
    leads = [(1,) * (n - (a.ndim - 2)) + a.shape[:-2] for a in (q, k, v)]
    if n == 0:
        return leads, ()
    kv_like = []
    for lead in leads[1:]:
        # with enable_gqa, torch repeats k and v along the head axis up to the query heads
        kv_like.append(lead[:-1] + (leads[0][-1],) if enable_gqa else lead)
    try:
        out_lead = np.broadcast_shapes(leads[0], *kv_like)
    except ValueError:
        raise ValueError(
            f"key: leading shapes of query {q.shape[:-2]}, key {k.shape[:-2]} and value "
            f"{v.shape[:-2]} do not broadcast"
        ) from None
    return leads, out_lead


def _to_bhsd(a, lead, out_batch, heads):
    """``a`` (lead + (S, D)) as a 4-D (B, heads, S, D) array; a view unless it must broadcast."""
    a = a.reshape(lead + a.shape[-2:])
    batch = lead[:-1]
    if a.shape[-3] != heads:
        a = np.broadcast_to(a, batch + (heads,) + a.shape[-2:])
    if batch != out_batch:
        a = np.broadcast_to(a, out_batch + a.shape[-3:])
    b = int(np.prod(out_batch, dtype=np.int64))
    return a.reshape((b,) + a.shape[-3:])


def _scale_type(q: np.ndarray) -> type:
    """What torch's CPU kernels hold the scale in: float32, or float64 for float64 inputs (which
    attnx, like torch, computes in float64)."""
    return np.float64 if q.dtype == np.float64 else np.float32


def _torch_scale(q: np.ndarray, scale: float | None) -> tuple[np.ndarray, float | None] | None:
    """``(q, scale)`` for the kernels, which take a positive scale within float32's normal range
    (or None for ``1/sqrt(E)``), giving what torch gives for any ``scale``; None when only the
    float64 reference can (an infinite scale).

    The scale is held in float32 like torch's CPU kernels (float64 for float64 inputs). A
    negative scale flips the scores: ``-q`` (exact) with ``|scale|``. Zero, subnormal, NaN or (in
    float64) beyond float32's range is folded into q as the kernels themselves fold the scale
    (``q * scale`` in the scale's type): zero gives uniform attention, NaN propagates. An
    infinite scale makes every score ``±inf`` (or NaN where ``q·k`` is 0), which a scaled q
    cannot represent (``inf * q_d`` terms of both signs would sum to NaN).
    """
    if scale is None:
        return q, (None if q.shape[-1] else 1.0)  # torch's 1/sqrt(0) is inf; nothing to scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    kind = _scale_type(q)
    with np.errstate(over="ignore"):
        s = kind(scale)
    if np.isinf(s):
        return None
    if _F32_TINY <= abs(s) <= _F32_MAX:
        return (q, float(s)) if s > 0 else (np.negative(q), float(-s))
    with np.errstate(all="ignore"):
        return (q.astype(kind) * s).astype(q.dtype), 1.0


@_tensors.tensor_io
def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> np.ndarray:
    """``torch.nn.functional.scaled_dot_product_attention`` on NumPy arrays, on attnx's kernels:
    ``is_causal`` is top-left aligned, as torch's, where :func:`attnx.attention`'s ``causal`` is
    bottom-right. (Parameters, results and an example: :mod:`attnx.integrations.sdpa`.)"""
    check_dropout(dropout_p)
    is_causal, enable_gqa = _flag(is_causal, "is_causal"), _flag(enable_gqa, "enable_gqa")
    q, k, v = _check_inputs(query, key, value, enable_gqa)
    out_dtype = q.dtype
    L, E = q.shape[-2:]
    S = k.shape[-2]
    scaled = _torch_scale(q, scale)
    if scaled is None:  # an infinite scale: only the float64 definition can carry its scores
        return _infinite_scale(query, key, value, attn_mask, is_causal, scale, enable_gqa, q)
    q, scale = scaled

    (q_lead, k_lead, v_lead), out_lead = _lead_shapes(q, k, v, enable_gqa)
    rank = len(out_lead) + 2

    mask = None if attn_mask is None else _sdpa_mask(attn_mask, rank, out_lead + (L, S))

    if L == 0 or S == 0 or 0 in out_lead:
        # nothing to attend to (torch returns zeros); attnx's binding also rejects freshly
        # allocated empty arrays, whose strides NumPy reports as 0
        return np.zeros(out_lead + (L, v.shape[-1]), dtype=out_dtype)

    causal, window = False, None
    if is_causal:
        k, v, mask, causal, window = _top_left_causal(k, v, mask, L, S)

    if rank == 2:
        out = cast(
            np.ndarray,
            _api.attention(q, k, v, causal=causal, mask=mask, scale=scale, window=window),
        )
        return out.astype(out_dtype, copy=False)
    out = _attend_heads(
        q,
        k,
        v,
        mask,
        (q_lead, k_lead, v_lead),
        out_lead,
        enable_gqa,
        causal=causal,
        scale=scale,
        window=window,
    )
    return out.astype(out_dtype, copy=False)


def _infinite_scale(query, key, value, attn_mask, is_causal, scale, enable_gqa, q):
    """The result for an infinite ``scale``, in the dtype of ``q`` (the checked query), from the
    float64 definition: a scaled q cannot carry its ``±inf`` scores."""
    from .. import reference as _reference

    with np.errstate(over="ignore"):
        s_held = float(_scale_type(q)(scale))
    return _reference.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=s_held,
        enable_gqa=enable_gqa,
    ).astype(q.dtype, copy=False)


def _sdpa_mask(attn_mask, rank, logical):
    """``attn_mask`` checked (boolean or float, broadcastable to ``logical``) and given rank
    ``rank``."""
    m = _as_array(attn_mask, "attn_mask")
    if m.dtype != np.bool_ and m.dtype.kind != "f" and m.dtype != _BF16:
        raise TypeError(
            f"attn_mask: expected a boolean (True = takes part) or float mask, got dtype {m.dtype}"
        )
    _check_broadcast(m, "attn_mask", rank, logical)
    return m.reshape((1,) * (rank - m.ndim) + m.shape)


def _top_left_causal(k, v, mask, L, S):
    """torch's top-left causal mask as attnx's arguments: ``(k, v, mask, causal, window)``."""
    if L <= S:
        # no row of a top-left causal mask sees keys at j >= L: drop them (views), then the
        # square (bottom-right == top-left) causal kernel is exact
        if mask is not None and mask.shape[-1] != 1:
            mask = mask[..., :L]
        return k[..., :L, :], v[..., :L, :], mask, True, None
    # bottom-right offset is S - L < 0; the window's right side cancels it: j <= i
    return k, v, mask, False, (None, int(L - S))


def _attend_heads(q, k, v, mask, leads, out_lead, enable_gqa, *, causal, scale, window):
    """Attention over arrays with leading (batch..., heads) axes, viewed as 4-D bhsd."""
    q_lead, k_lead, v_lead = leads
    hq = out_lead[-1]
    out_batch = out_lead[:-1]
    hk, hv = k_lead[-1], v_lead[-1]
    if hk != hv:
        # k and v expand to the query heads separately in torch; attnx reads one kv head for
        # both, so give them the query's heads (a copy, only in this unusual case)
        if enable_gqa:
            k = np.repeat(k.reshape(k_lead + k.shape[-2:]), hq // hk, axis=-3)
            v = np.repeat(v.reshape(v_lead + v.shape[-2:]), hq // hv, axis=-3)
            k_lead, v_lead = k.shape[:-2], v.shape[:-2]
        hk = hv = hq
    # without enable_gqa a kv head axis of 1 broadcasts: that is attnx's MQA (Hkv = 1), no copy
    q4 = _to_bhsd(q, q_lead, out_batch, hq)
    k4 = _to_bhsd(k, k_lead, out_batch, hk)
    v4 = _to_bhsd(v, v_lead, out_batch, hv)
    m4 = None
    if mask is not None:
        mb = mask.shape[:-3]
        if all(d == 1 for d in mb):
            m4 = mask.reshape((1,) + mask.shape[-3:])
        else:
            m4 = _to_bhsd(mask, mask.shape[:-2], out_batch, mask.shape[-3])
    out = cast(
        np.ndarray, _api.attention(q4, k4, v4, causal=causal, mask=m4, scale=scale, window=window)
    )
    return out.reshape(out_lead + out.shape[-2:])
