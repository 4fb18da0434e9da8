"""Merging partial attention results over disjoint key sets by their log-sum-exp.

Split-KV, shared-prefix decode and context parallelism are all this one rule (DESIGN.md,
"Merging partial results"): ``l = logaddexp(l1, l2, ...)``, ``o = sum_i exp(l_i - l) o_i``.

:func:`merge_attention`: Part ``i`` is ``(outs[i], lses[i])`` as returned by ``attnx.attention(..., return_lse=True)``
(or ``paged_attention`` / ``Step.attend``) for the same queries against one subset of the
keys. The merge is exact::

    lse = logaddexp(lses[0], lses[1], ...)
    out = sum_i exp(lses[i] - lse) * outs[i]

Parameters
----------
outs : sequence of ndarray, each of one shape and dtype: any output of attnx, e.g.
    ``(B, Hq, Sq, Dv)`` (``"bhsd"``), ``(B, Sq, Hq, Dv)`` (``"bshd"``), rank 3 or 2, or
    ``paged_attention``'s ``(N, Hq, Dv)``. float32, float16, bfloat16 (accumulated in
    float32) or float64.
lses : sequence of ndarray, the matching log-sum-exps: the output's leading axes in bhsd
    order, ``(B, Hq, Sq)`` for either 4-D layout (``(N, Hq)`` for paged outputs).
layout : ``"bhsd"`` or ``"bshd"``, the layout of the outputs.

Returns
-------
out : ndarray of the outputs' shape and dtype, and
lse : ndarray, float32 (float64 for float64 outputs); torch tensors (or the kind of the
    first ``__dlpack__`` part) where the parts are tensors, as every entry point returns.

A part whose lse is ``-inf`` (it saw no key) contributes nothing, whatever its output holds;
where every part is ``-inf`` the row is zeros with lse ``-inf``, as a row that sees no key.
NaN propagates: a part with a NaN lse makes its rows NaN (its scores touched a NaN), and so
does a NaN output of a part that contributes.

Examples
--------
>>> import numpy as np, attnx
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
>>> parts = [attnx.attention(q, k[:, :, s], v[:, :, s], return_lse=True)
...          for s in (slice(0, 2), slice(2, 5))]
>>> out, lse = attnx.merge_attention(*zip(*parts))
>>> bool(np.allclose(out, attnx.attention(q, k, v), atol=1e-6))
True
"""

from __future__ import annotations

import numpy as np

from .._validate import LAYOUTS, as_array, choice
from ..integrations import tensors as _tensors

__all__ = ["merge_attention"]


def _dtype_name(dt):
    return dt.name if dt.name != "void" else str(dt)


def _accumulator(dtype, name):
    """float64 for float64 parts, float32 for float32 / float16 / bfloat16 storage."""
    if dtype == np.float64:
        return np.dtype(np.float64)
    if dtype in (np.float32, np.float16) or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    raise TypeError(
        f"{name}: expected float32, float16, bfloat16 or float64, got dtype {_dtype_name(dtype)}"
    )


def lse_shape(out_shape, layout):
    """The shape of the lse that goes with an output of ``out_shape``: the output's leading
    axes in bhsd order (attnx returns lse as ``(B, Hq, Sq)`` for either layout)."""
    lead = tuple(out_shape[:-1])
    if layout == "bshd" and len(out_shape) in (3, 4):
        return lead[:-2] + (lead[-1], lead[-2])  # (.., S, H) -> (.., H, S)
    return lead


def _as_out_axes(x, out_ndim, layout):
    """An lse-shaped array viewed so that it broadcasts against the output."""
    if layout == "bshd" and out_ndim in (3, 4):
        x = np.swapaxes(x, -1, -2)
    return x[..., None]


def _parts(xs, name):
    try:
        xs = list(xs)
    except TypeError:
        raise TypeError(
            f"{name}: expected a sequence of arrays (one per part), got {type(xs).__name__}"
        ) from None
    return [as_array(x, f"{name}[{i}]") for i, x in enumerate(xs)]


def _check(outs, lses, layout):
    choice(layout, LAYOUTS, "layout")
    if isinstance(outs, np.ndarray) or isinstance(lses, np.ndarray):
        raise TypeError(
            "outs, lses: expected sequences (one array per part), got a single array; "
            "use list(x) to merge along its first axis"
        )
    outs, lses = _parts(outs, "outs"), _parts(lses, "lses")
    if not outs:
        raise ValueError("outs: expected at least one partial result, got none")
    if len(lses) != len(outs):
        raise ValueError(f"lses: expected {len(outs)} arrays (one per output), got {len(lses)}")
    first = outs[0]
    if first.ndim < 1:
        raise ValueError(
            f"outs[0]: expected an output with a feature axis, got shape {first.shape}"
        )
    acc = _accumulator(first.dtype, "outs[0]")
    want = lse_shape(first.shape, layout)
    for i, (o, x) in enumerate(zip(outs, lses)):
        if o.shape != first.shape or o.dtype != first.dtype:
            raise ValueError(
                f"outs[{i}]: expected shape {first.shape} and dtype "
                f"{_dtype_name(first.dtype)} like outs[0], got {o.shape} "
                f"{_dtype_name(o.dtype)}"
            )
        _accumulator(x.dtype, f"lses[{i}]")
        if x.shape != want:
            raise ValueError(
                f"lses[{i}]: expected shape {want} for outputs of shape {first.shape} "
                f"(layout {layout!r}), got {x.shape}"
            )
    return outs, lses, acc


@_tensors.tensor_io(sequences=("outs", "lses"))
def merge_attention(outs, lses, *, layout="bhsd"):
    """Merge partial attention results over disjoint key sets into the result over their union.
    (Parameters, results and an example: :mod:`attnx.ops.merge`.)"""
    outs, lses, acc = _check(outs, lses, layout)
    ndim = outs[0].ndim
    ls = np.stack([x.astype(acc, copy=False) for x in lses])  # (parts, *lse_shape)
    with np.errstate(invalid="ignore", over="ignore"):
        m = ls.max(axis=0)  # NaN propagates
        seen = m != -np.inf  # (NaN rows count as seen: they stay NaN)
        m_safe = np.where(seen, m, acc.type(0))
        e = np.exp(ls - m_safe)  # parts at -inf weigh exactly 0
        total = np.where(seen, e.sum(axis=0), acc.type(1))
        lse = np.where(seen, m_safe + np.log(total), acc.type(-np.inf))
        w = e / total
        out = np.zeros(outs[0].shape, acc)
        for o, wi, li in zip(outs, w, ls):
            part = _as_out_axes(wi, ndim, layout) * o.astype(acc, copy=False)
            dead = li == -np.inf
            if dead.any():  # a part that saw no key contributes nothing, not even 0 * NaN
                part[np.broadcast_to(_as_out_axes(dead, ndim, layout), part.shape)] = 0
            out += part
    return out.astype(outs[0].dtype, copy=False), lse
