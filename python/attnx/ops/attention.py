""":func:`attention`: exact scaled dot-product attention, ``softmax(q kᵀ · scale + M) v``, without ever forming
the full score matrix.

Parameters
----------
q : ndarray, ``(B, Hq, Sq, Dk)`` (layout ``"bhsd"``) or ``(B, Sq, Hq, Dk)`` (``"bshd"``);
    also ``(Hq, Sq, Dk)`` / ``(Sq, Hq, Dk)`` and ``(Sq, Dk)``. float32, float16 or
    bfloat16 (``ml_dtypes.bfloat16``), computed in float32 (a bfloat16 prefill on a CPU
    with AVX512_BF16: bf16 dot products, P rounded to bf16; README, "bfloat16 compute");
    or float64 (NumPy's default: Python lists convert to it), computed and accumulated in
    float64 by the same tiled kernel (O(S·D) memory), where an additive mask, ``scale``,
    the modifiers and ``lse`` are float64 too.
k : ndarray, ``(B, Hkv, Sk, Dk)`` in the same layout, rank and dtype. ``Hq % Hkv == 0``:
    query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA; MQA is ``Hkv == 1``).
v : ndarray, ``(B, Hkv, Sk, Dv)``; ``Dv`` may differ from ``Dk``.
causal : bool
    Bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)`` with ``Lk``,
    ``Lq`` the valid lengths. With ``Sq == Sk`` this is the usual lower triangle; one new
    query against a cache sees the whole cache. (``torch``'s ``is_causal`` is top-left
    aligned: use :func:`attnx.scaled_dot_product_attention` for that.)
mask : ndarray, optional
    Boolean (True = may attend) or additive float (0 keeps, -inf blocks), broadcastable to
    ``(B, Hq, Sq, Sk)`` (``(Hq, Sq, Sk)``, ``(Sq, Sk)`` at lower ranks), in bhsd order for
    either layout.
kv_lens, q_lens : int array ``(B,)``, optional
    Valid key / query lengths per batch: keys at ``j >= kv_lens[b]`` are ignored, query rows
    at ``i >= q_lens[b]`` are padding (output 0, lse -inf).
scale : float, optional
    Defaults to ``1/sqrt(Dk)``.
layout : ``"bhsd"`` or ``"bshd"``
return_lse : bool
    Also return the natural-log log-sum-exp of the scaled, masked scores, float32
    ``(B, Hq, Sq)`` (float64 for float64 inputs; rank-reduced like the output, bhsd order
    for either layout).
out : ndarray, optional
    Written in place (shape and dtype of the result) and returned.
num_threads : int, optional
    Threads for this call; default :func:`attnx.get_num_threads`. At most 4 per CPU this
    process may run on (and 1024): a larger count is capped, with a RuntimeWarning.
window : (left, right), optional
    Sliding window: row ``i`` sees keys ``i' - left <= j <= i' + right``, ``i' = i + Lk - Lq``;
    ``None`` for an unbounded side.
softcap : float, optional
    Gemma-2 logit soft-capping: ``s = softcap * tanh(s / softcap)`` before bias and mask.
sinks : float array ``(Hq,)``, optional
    Per-head sink logits: they join the softmax denominator but carry no value (gpt-oss).
alibi_slopes : float array ``(Hq,)``, optional
    ALiBi: ``s -= slope[h] * |i' - j|``.

Returns
-------
out : ndarray ``(B, Hq, Sq, Dv)`` in q's layout, rank and dtype; and ``lse`` if asked.
    A row that sees no key is all zeros with lse ``-inf`` (never NaN); NaN in the inputs
    propagates to the rows that see it.

Examples
--------
>>> import numpy as np, attnx
>>> q = k = v = np.eye(3, 4, dtype=np.float32)
>>> attnx.attention(q, k, v, causal=True).shape
(3, 4)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _core
from .._validate import (
    LAYOUTS,
    as_array,
    choice,
    from4,
    kernel_array,
    mask4,
    out4,
    rank_lens,
    real,
    threads,
    to4,
    window_sides,
)
from ..integrations import tensors as _tensors

__all__ = ["attention"]

ArrayLike = Any  # an ndarray, or anything np.asarray takes
IntsLike = int | np.integer | ArrayLike  # one length (ranks 2 and 3) or an int array
Window = tuple[int | None, int | None]
Result = np.ndarray | tuple[np.ndarray, np.ndarray]  # out, or (out, lse)


@_tensors.tensor_io(torch_op="attention")
def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    causal: bool = False,
    mask: ArrayLike | None = None,
    kv_lens: IntsLike | None = None,
    q_lens: IntsLike | None = None,
    scale: float | None = None,
    layout: str = "bhsd",
    return_lse: bool = False,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    window: Window | None = None,
    softcap: float | None = None,
    sinks: ArrayLike | None = None,
    alibi_slopes: ArrayLike | None = None,
) -> Result:
    """Exact scaled dot-product attention, ``softmax(q kᵀ · scale + M) v``, without ever forming
    the full score matrix. Parameters, results and an example: :mod:`attnx.ops.attention`."""
    # (the common case, 4-D "bhsd" NumPy arrays, takes the shortest path: a small call from
    # Python should cost a few microseconds, so defaults pass through without calls)
    rank, plain, q4, k4, v4 = _views(q, k, v, layout)
    if mask is not None:
        mask = mask4(
            mask,
            rank,
            (q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2])[4 - rank :],
            np.float64 if q4.dtype == np.float64 else np.float32,
        )
    res = _core.attention(
        q4,
        k4,
        v4,
        mask=mask,
        causal=causal,
        return_lse=return_lse,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        kv_lens=kv_lens if kv_lens is None else rank_lens(kv_lens, rank),
        q_lens=q_lens if q_lens is None else rank_lens(q_lens, rank),
        scale=scale if scale is None else real(scale, "scale"),
        out=out if out is None else out4(out, rank, layout),
        num_threads=0 if num_threads is None else threads(num_threads),
        window=window if window is None else window_sides(window),
        softcap=softcap if softcap is None else real(softcap, "softcap"),
    )
    return _result(res, out, return_lse, plain, rank, layout)


def _views(q, k, v, layout):
    """``(rank, plain, q4, k4, v4)``: q, k and v viewed as (B, H, S, D) arrays that the kernels
    read; ``plain`` where they already were (4-D, ``"bhsd"``)."""
    q = q if type(q) is np.ndarray else as_array(q, "q")
    k = k if type(k) is np.ndarray else as_array(k, "k")
    v = v if type(v) is np.ndarray else as_array(v, "v")
    rank = q.ndim
    plain = rank == 4 and type(layout) is str and layout == "bhsd" and k.ndim == 4 and v.ndim == 4
    if plain:
        q4, k4, v4 = q, k, v
    else:
        if rank not in (2, 3, 4):
            raise ValueError(
                f"q: expected rank 2 (S, D), 3 (H, S, D) or 4 (B, H, S, D), got shape {q.shape}"
            )
        choice(layout, LAYOUTS, "layout")
        q4, k4, v4 = to4(q, "q", rank, layout), to4(k, "k", rank, layout), to4(v, "v", rank, layout)
    return rank, plain, kernel_array(q4), kernel_array(k4), kernel_array(v4)


def _result(res, out, return_lse, plain, rank, layout):
    """The core's result in q's rank and layout (``out`` itself where one was given)."""
    if not return_lse:
        return out if out is not None else res if plain else from4(res, rank, layout)
    o4, lse = res
    o = out if out is not None else o4 if plain else from4(o4, rank, layout)
    return o, (lse if rank == 4 else lse[0] if rank == 3 else lse[0, 0])
