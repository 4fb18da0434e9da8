"""attnx's kernels as PyTorch custom ops: ``torch.ops.attnx.attention`` and ``torch.ops.attnx.paged_attention``.

Importing this module registers both with ``torch.library.custom_op`` (a CPU kernel) and
``register_fake`` (shapes and dtypes only), so ``torch.compile(fullgraph=True)`` treats a call as
one opaque node: a function that calls :func:`attnx.attention` on tensors compiles, and
gives the eager result. attnx imports this module itself the first time it sees a tensor;
``import attnx`` alone never imports torch.

The ops always return ``(out, lse)``; ``lse`` is an empty float32 tensor unless
``return_lse`` was asked. ``window=(left, right)`` travels as two optional ints.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .. import _core
from .. import _validate as _v
from ..ops import attention as _attention
from ..ops import paged as _paged
from . import tensors as _tensors

__all__ = ["attention", "paged_attention"]

_EMPTY = (0,)

# One set of threads with torch from here on: attnx's regions run on torch's OpenMP team
# (attnx.share_torch_threads says why).
if os.environ.get("ATTNX_SHARE_TORCH", "1").strip() != "0":
    _core.share_omp_threads(True)


def _np(x, name):
    # (inside the op autograd is already handled: detach so the no-grad check does not fire)
    return None if x is None else _tensors.to_numpy(x.detach(), name)


def _variants(return_lse, window_left, window_right, softcap, sinks, alibi_slopes, num_threads):
    """The arguments both ops end with, as the keywords of attnx's entry points."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return dict(
        return_lse=return_lse,
        window=window,
        softcap=softcap,
        sinks=_np(sinks, "sinks"),
        alibi_slopes=_np(alibi_slopes, "alibi_slopes"),
        num_threads=num_threads,
    )


def _result(res, return_lse, template):
    out, lse = res if return_lse else (res, None)
    out = _tensors.like(out, template)
    lse = torch.empty(_EMPTY, dtype=torch.float32) if lse is None else _tensors.like(lse, template)
    return out, lse


@torch.library.custom_op("attnx::attention", mutates_args=(), device_types="cpu")
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    kv_lens: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    layout: str,
    return_lse: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    num_threads: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    res = _attention.attention(
        _np(q, "q"),
        _np(k, "k"),
        _np(v, "v"),
        mask=_np(mask, "mask"),
        kv_lens=_np(kv_lens, "kv_lens"),
        q_lens=_np(q_lens, "q_lens"),
        causal=causal,
        scale=scale,
        layout=layout,
        **_variants(
            return_lse, window_left, window_right, softcap, sinks, alibi_slopes, num_threads
        ),
    )
    out, lse = _result(res, return_lse, q)
    # a fresh array of the expected layout: the op owns it, so it may be handed out as is
    return out, lse


def _dense_out_like(q, v, layout):
    """An empty tensor with the shape and strides attnx.attention returns for q's rank and layout."""
    rank = q.dim()
    dv = v.shape[-1]
    if layout == "bshd" and rank == 4:
        b, s, h = q.shape[:3]
        return q.new_empty((b, h, s, dv)).transpose(1, 2)
    if layout == "bshd" and rank == 3:
        s, h = q.shape[:2]
        return q.new_empty((h, s, dv)).transpose(0, 1)
    return q.new_empty((*q.shape[:-1], dv))


def _lse_dtype(q):
    """attention's lse: float32, float64 for float64 q (computed in float64)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lse_shape(q, layout):
    shape = tuple(q.shape[:-1])
    if layout == "bshd" and len(shape) >= 2:
        shape = shape[:-2] + (shape[-1], shape[-2])  # (..., S, H) -> (..., H, S)
    return shape


@_attention_op.register_fake
def _(q, k, v, mask, kv_lens, q_lens, causal, scale, layout, return_lse, *variants):
    # (the shapes and dtypes follow q, v, layout and return_lse alone)
    out = _dense_out_like(q, v, layout)
    shape, dtype = (_lse_shape(q, layout), _lse_dtype(q)) if return_lse else (_EMPTY, torch.float32)
    lse = q.new_empty(shape, dtype=dtype)
    return out, lse


@torch.library.custom_op("attnx::paged_attention", mutates_args=(), device_types="cpu")
def _paged_attention_op(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    return_lse: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    num_threads: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    res = _paged.paged_attention(
        _np(q, "q"),
        _np(k_pages, "k_pages"),
        _np(v_pages, "v_pages"),
        _np(block_tables, "block_tables"),
        _np(seq_lens, "seq_lens"),
        q_lens=_np(q_lens, "q_lens"),
        causal=causal,
        scale=scale,
        **_variants(
            return_lse, window_left, window_right, softcap, sinks, alibi_slopes, num_threads
        ),
    )
    return _result(res, return_lse, q)


@_paged_attention_op.register_fake
def _(q, k_pages, v_pages, block_tables, seq_lens, q_lens, causal, scale, return_lse, *variants):
    out = q.new_empty((*q.shape[:-1], v_pages.shape[-1]))
    lse = q.new_empty(tuple(q.shape[:-1]) if return_lse else _EMPTY, dtype=torch.float32)
    return out, lse


# ---- the Python-signature front ends (what attnx.attention calls while torch.compile traces) ----


def _tensor(x):
    """Array-like arguments as tensors (the op schema takes Tensor?); None stays None."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


def _op_variants(return_lse, window, softcap, sinks, alibi_slopes, num_threads):
    """The arguments both ops end with, from the keywords of attnx's entry points (``window``
    as its two sides). Window sides and floats pass the eager entry points' type rules
    (attnx._validate: a bool or a float is no window side, a bool no float) before the op schema
    would coerce them."""
    left, right = _v.window_sides(window) or (None, None)
    head = (bool(return_lse), left, right, _v.optional_real(softcap, "softcap"))
    return (*head, _tensor(sinks), _tensor(alibi_slopes), num_threads)


def _finish(out_t, lse, out, return_lse):
    """The op's result, copied into ``out`` where one was given: a tensor of the result's dtype
    and shape, as the eager call requires (cpp/bind/out.cpp), where ``copy_`` would cast and
    broadcast."""
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a tensor like q, got {type(out).__name__}")
        if out.dtype != out_t.dtype:
            want, got = (str(d).removeprefix("torch.") for d in (out_t.dtype, out.dtype))
            raise TypeError(f"out: expected dtype {want} (the dtype of q), got {got}")
        if out.shape != out_t.shape:
            raise ValueError(f"out: expected shape {tuple(out_t.shape)}, got {tuple(out.shape)}")
        out.copy_(out_t)
        out_t = out
    return (out_t, lse) if return_lse else out_t


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    mask=None,
    kv_lens=None,
    q_lens=None,
    scale=None,
    layout="bhsd",
    return_lse=False,
    out=None,
    num_threads=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
):
    """:func:`attnx.attention` through ``torch.ops.attnx.attention`` (same arguments and results)."""
    lens = (_tensor(mask), _tensor(kv_lens), _tensor(q_lens))
    variants = _op_variants(return_lse, window, softcap, sinks, alibi_slopes, num_threads)
    o, lse = torch.ops.attnx.attention(
        q,
        k,
        v,
        *lens,
        bool(causal),
        _v.optional_real(scale, "scale"),
        layout,
        *variants,
    )
    return _finish(o, lse, out, return_lse)


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    seq_lens,
    *,
    q_lens=None,
    causal=True,
    scale=None,
    return_lse=False,
    out=None,
    num_threads=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    shared_prefix=True,
):
    """:func:`attnx.paged_attention` through ``torch.ops.attnx.paged_attention``. (The op always
    reads shared prefixes once where that pays, as the default does: ``shared_prefix`` is
    accepted for the same signature; the result is the same within fp32 tolerance.)"""
    pool = (_tensor(k_pages), _tensor(v_pages), _tensor(block_tables), _tensor(seq_lens))
    variants = _op_variants(return_lse, window, softcap, sinks, alibi_slopes, num_threads)
    o, lse = torch.ops.attnx.paged_attention(
        q,
        *pool,
        _tensor(q_lens),
        bool(causal),
        _v.optional_real(scale, "scale"),
        *variants,
    )
    return _finish(o, lse, out, return_lse)


# what attnx's entry points call while torch.compile traces (integrations.tensors.tensor_io)
_tensors.TORCH_OPS.update(attention=attention, paged_attention=paged_attention)
