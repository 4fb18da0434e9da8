"""The oracle of :func:`attnx.gated_delta_rule`: the plain token-by-token recurrence in float64."""

from __future__ import annotations

import numpy as np

from .attention import output_dtype, round_to

__all__ = ["gated_delta_rule"]


# --------------------------------------------------------------------------
# gated delta rule (linear attention): the plain recurrence
# --------------------------------------------------------------------------


_L2_EPS = 1e-6  # q / sqrt(sum q^2 + eps), as flash-linear-attention's l2norm


def _delta_recurrence(args, *, qk_l2norm, dtype):
    """Outputs (B, T, Hv, V) and final states (N, Hv, K, V) of the recurrence, computed in
    ``dtype`` (float64 for the definition; the tests also run it in float32 to measure what a
    float32 recurrence's own rounding costs)."""
    q, k, v = (np.asarray(x, dtype=np.float64).astype(dtype) for x in (args.q, args.k, args.v))
    g = np.asarray(args.g, dtype=np.float64).astype(dtype)
    beta = np.asarray(args.beta, dtype=np.float64).astype(dtype)
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    heads = np.arange(Hv) // (Hv // Hk)  # value head h reads key head h // (Hv // Hk)
    out = np.zeros((B, T, Hv, V), dtype)
    states = np.zeros((len(args.sequences), Hv, K, V), dtype)
    # g = -inf is a reset (exp(g) = 0); NaN or inf in g or beta makes the state non-finite from
    # that position on (0 * inf, inf - inf): quietly, as float arithmetic does
    with np.errstate(invalid="ignore", over="ignore"):
        for n, (b, t0, length) in enumerate(args.sequences):
            S = (
                np.zeros((Hv, K, V), dtype)
                if args.initial_state is None
                else np.asarray(args.initial_state[n], dtype=np.float64).astype(dtype)
            )
            for t in range(t0, t0 + length):
                qt, kt = q[b, t, heads], k[b, t, heads]  # (Hv, K)
                if qk_l2norm:
                    qt = qt / np.sqrt((qt * qt).sum(-1, keepdims=True) + dtype(_L2_EPS))
                    kt = kt / np.sqrt((kt * kt).sum(-1, keepdims=True) + dtype(_L2_EPS))
                decay = np.exp(g[b, t])  # (Hv,) or (Hv, K): scales all of S, or its rows
                S = S * (decay[:, :, None] if decay.ndim == 2 else decay[:, None, None])
                u = beta[b, t][:, None] * (v[b, t] - np.einsum("hkv,hk->hv", S, kt))
                S = S + kt[:, :, None] * u[:, None, :]
                out[b, t] = np.einsum("hkv,hk->hv", S, dtype(args.scale) * qt)
            states[n] = S
    return out, states


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
    out_dtype=None,
):
    """Gated delta-rule linear attention, the plain recurrence in float64 (the twin of
    ``attnx.gated_delta_rule``; same arguments, plus ``out_dtype``).

    Per sequence and value head h (key head ``h // (Hv // Hk)``), with a state S of (K, V)::

        S   = exp(g_t) * S            # per head: all of S; per channel (g_t of K): S's rows
        u_t = beta_t * (v_t - Sᵀ k_t)
        S   = S + k_t u_tᵀ
        o_t = Sᵀ (scale * q_t)

    starting from ``initial_state`` (zeros if None); g_t = -inf resets S (or its rows). With
    ``qk_l2norm`` q_t and k_t are first divided by ``sqrt(sum(x**2) + 1e-6)``. Positions outside
    every sequence have o = 0.
    Returns o rounded once to ``out_dtype`` (default: q's dtype), and, if
    ``output_final_state``, the final states (N, Hv, K, V) as float32 (float64 when
    ``out_dtype`` is float64).
    """
    from ..ops.delta_args import delta_args, from_bshd

    args = delta_args(q, k, v, g, beta, scale, initial_state, layout, cu_seqlens, lengths)
    out_dt = output_dtype(out_dtype, args.q.dtype)
    o, states = _delta_recurrence(args, qk_l2norm=bool(qk_l2norm), dtype=np.float64)
    o = from_bshd(round_to(o, out_dt), layout)
    if not output_final_state:
        return o
    return o, states.astype(np.float64 if out_dt == np.float64 else np.float32)
