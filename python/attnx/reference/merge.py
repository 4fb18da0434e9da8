"""The oracle of :func:`attnx.merge_attention`: the log-sum-exp merge of partial results."""

from __future__ import annotations

import numpy as np

from ..quant import float_array as _float_array
from .attention import check_layout, lse_dtype, output_dtype, round_to

__all__ = ["merge_attention"]


# --------------------------------------------------------------------------
# merging partial results (the twin of attnx.merge_attention)
# --------------------------------------------------------------------------


def merge_attention(outs, lses, *, layout="bhsd", out_dtype=None):
    """Merge partial results over disjoint key sets: the union's ``(out, lse)``.

    ``lse = log(sum_i exp(lses[i]))`` and ``out = sum_i exp(lses[i] - lse) * outs[i]``,
    computed in float64. A part with lse ``-inf`` saw no key and contributes nothing; a row
    where every part is ``-inf`` is 0 with lse ``-inf``; a NaN lse makes its row NaN, and so
    does a NaN output of a part that contributes.

    Parameters
    ----------
    outs : sequence of array_like, one shape and dtype, any attnx output shape (rank >= 1)
    lses : sequence of array_like, the output's leading axes in bhsd order: ``out.shape[:-1]``
        for ``layout="bhsd"``; for ``"bshd"`` outputs ``(B, S, H, D)`` / ``(S, H, D)`` the lse is
        ``(B, H, S)`` / ``(H, S)``.
    layout : {"bhsd", "bshd"}
    out_dtype : dtype, optional
        Output dtype; default the outputs' dtype.

    Returns
    -------
    out : ndarray of the outputs' shape, ``out_dtype``
    lse : ndarray, float32 (float64 when the output is float64)
    """
    check_layout(layout)
    outs = [_float_array(o, f"outs[{i}]") for i, o in enumerate(outs)]
    lses = [_float_array(x, f"lses[{i}]") for i, x in enumerate(lses)]
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"outs, lses: expected one lse per output and at least one part, got "
            f"{len(outs)} outputs and {len(lses)} lses"
        )
    shape = outs[0].shape
    # the output's axes, in the order of the lse's axes
    swap = layout == "bshd" and len(shape) in (3, 4)
    to_lse_order = (lambda o: np.swapaxes(o, -2, -3)) if swap else (lambda o: o)
    parts = []
    for i, (o, x) in enumerate(zip(outs, lses)):
        if o.shape != shape or to_lse_order(o).shape[:-1] != x.shape:
            raise ValueError(
                f"outs[{i}], lses[{i}]: shapes {o.shape} and {x.shape} do not pair "
                f"with outs[0]'s {shape} (layout {layout!r})"
            )
        parts.append((to_lse_order(o.astype(np.float64)), x.astype(np.float64)))
    out = np.zeros(parts[0][0].shape, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        # weights relative to the largest lse (exp(x - lse) after a logaddexp would lose the
        # lse's low bits where |lse| is large: logaddexp(x, x) rounds back to x at 1e17)
        m = np.max([x for _, x in parts], axis=0)  # NaN propagates
        m0 = np.where(m == -np.inf, 0.0, m)
        e = [np.where(x != -np.inf, np.exp(x - m0), 0.0) for _, x in parts]
        total = np.sum(e, axis=0)
        lse = np.where(m == -np.inf, -np.inf, m0 + np.log(total))
        for (o, x), ei in zip(parts, e):
            contributes = x != -np.inf
            w = np.where(contributes, ei / np.where(contributes, total, 1.0), 0.0)
            out = out + np.where(contributes[..., None], w[..., None] * o, 0.0)
    out_dt = output_dtype(out_dtype, outs[0].dtype)
    return round_to(to_lse_order(out), out_dt), lse.astype(lse_dtype(out_dt))
