"""Linear attention: the gated delta rule (Gated DeltaNet, Kimi Delta Attention), the layers that
hybrid models (Qwen3-Next, Kimi Linear) interleave with full attention. A sequence's state has a
fixed size, (Hv, K, V) floats, however long the sequence grows.

One call into C++ (``cpp/src/delta_rule.cpp``): prefill runs the chunked WY / UT-transform form,
short calls (decode) the token-by-token recurrence; ``attnx.reference.gated_delta_rule`` is the
definition both are tested against.

:func:`gated_delta_rule`: Per sequence and value head h (it reads key head ``h // (Hv // Hk)``), with a float32 state
S of (K, V)::

    S   = exp(g_t) * S            # g_t per head scales all of S; per channel, S's rows
    u_t = beta_t * (v_t - Sᵀ k_t)
    S   = S + k_t u_tᵀ
    o_t = Sᵀ (scale * q_t)

Parameters
----------
q, k : array_like, (B, T, Hk, K)
    Queries and keys (``layout="bhsd"``: (B, Hk, T, K)). float32, float16 or bfloat16
    (float64 is computed in float32 and returned as float64); q, k, v share one dtype.
v : array_like, (B, T, Hv, V)
    Values; ``Hv % Hk == 0`` (key heads shared by groups of value heads, as Qwen3-Next).
g : array_like of float, (B, T, Hv) or (B, T, Hv, K)
    Log-decay gates (<= 0 for a decay): one per head (Gated DeltaNet) or one per key
    channel (Kimi Delta Attention). Read as float32. ``-inf`` (exp(g) = 0) resets the
    state (or its row); NaN or inf here or in ``beta`` makes the output non-finite from
    that position on, as in the recurrence, and never before it.
beta : array_like of float, (B, T, Hv)
    Write strengths (usually in (0, 1)). Read as float32.
scale : float, optional
    Default ``1 / sqrt(K)``.
initial_state : array_like, (N, Hv, K, V), optional
    The state before each sequence (zeros if None); read as float32.
output_final_state : bool
    Also return the state after each sequence, (N, Hv, K, V) float32.
layout : {"bshd", "bhsd"}
    Axis order of q, k, v, the output, g and beta (heads before or after time).
qk_l2norm : bool
    Divide q_t and k_t by ``sqrt(sum(x**2) + 1e-6)`` first (as the models do).
cu_seqlens : array_like of int, (N + 1,), optional
    Sequences packed along T (B must be 1): sequence n is positions
    ``[cu_seqlens[n], cu_seqlens[n + 1])``.
lengths : array_like of int, (B,), optional
    Padded batch: sequence b is positions ``[0, lengths[b])`` of row b.
    N is ``len(cu_seqlens) - 1``, else B. Positions outside every sequence have o = 0.
num_threads : int, optional
    Threads over (sequence, value head); default ``attnx.get_num_threads()``.

Returns
-------
o : (B, T, Hv, V) in q's dtype (NumPy in, NumPy out; torch tensors in, torch tensors out);
and, if ``output_final_state``, the final states ``(N, Hv, K, V)`` float32.

Examples
--------
>>> import numpy as np, attnx
>>> rng = np.random.default_rng(0)
>>> q, k = rng.standard_normal((2, 1, 5, 2, 16), dtype=np.float32)
>>> v = rng.standard_normal((1, 5, 4, 16), dtype=np.float32)
>>> g = -rng.random((1, 5, 4), dtype=np.float32)
>>> beta = rng.random((1, 5, 4), dtype=np.float32)
>>> o, state = attnx.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
>>> o.shape, state.shape
((1, 5, 4, 16), (1, 4, 16, 16))
"""

from __future__ import annotations

import numpy as np

from .. import _core
from .._validate import choice, flag, threads
from ..integrations.tensors import tensor_io
from .delta_args import delta_args, from_bshd

__all__ = ["gated_delta_rule"]

_MODES = {"auto": 0, "chunked": 1, "recurrent": 2}


def _storage(a, dtype):
    """``a`` as `dtype` with a contiguous last axis (the kernel reads whole rows)."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    if a.ndim == 4 and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    return a


@tensor_io
def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    layout="bshd",
    qk_l2norm=False,
    cu_seqlens=None,
    lengths=None,
    num_threads=None,
    _mode="auto",
):
    """Gated delta-rule linear attention.
    (Parameters, results and an example: :mod:`attnx.ops.delta_rule`.)"""
    choice(_mode, tuple(_MODES), "_mode")
    args = delta_args(q, k, v, g, beta, scale, initial_state, layout, cu_seqlens, lengths)
    n_threads = threads(num_threads)
    in_dtype = args.q.dtype
    dtype = np.dtype(np.float32) if in_dtype == np.float64 else in_dtype
    state = (
        None
        if args.initial_state is None
        else np.ascontiguousarray(args.initial_state, dtype=np.float32)
    )
    o, final = _core.gated_delta_rule(
        _storage(args.q, dtype),
        _storage(args.k, dtype),
        _storage(args.v, dtype),
        _storage(args.g, np.float32),
        _storage(args.beta, np.float32),
        args.sequences,
        state,
        flag(output_final_state, "output_final_state"),
        args.scale,
        flag(qk_l2norm, "qk_l2norm"),
        _MODES[_mode],
        n_threads,
    )
    if in_dtype == np.float64:
        o = o.astype(np.float64)
    o = from_bshd(o, layout)
    return (o, final) if output_final_state else o
