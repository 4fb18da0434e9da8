"""The gated delta rule: the float32 recurrence as yardstick, and the tolerance rule."""

from __future__ import annotations

import numpy as np

import attnx
from attnx import reference as ref

from helpers.data import BF16, F32_EPS

DELTA_ERR_FACTOR = 4.0  # x the float32 recurrence's own error
DELTA_ULPS_STATE = 16.0  # float32 ulps of the largest state value: the floor of an output's error
DELTA_ULPS = 64.0  # float32 ulps of the largest reference value, one per token of a chunk: the
#                    chunked form reassociates sums over up to 64 tokens (a triangular solve)
# The amx path's chunked kernel over bf16 inputs rounds the operands of its products against the
# state (K and Q rows, S0, the gated keys, U) to bf16 (docs/numerics.md): each a relative error
# of at most 2^-8, so output and state are held to DELTA_TILE_ERR x 2^-8 of their largest
# reference value (measured: 0.7-1.2 x 2^-8 at the maximum, 0.6 x 2^-8 on average, whatever T).
DELTA_TILE_ERR = 4.0
BF16_UNIT = 2.0**-8  # bf16's unit roundoff (half its ulp at 1)


def delta_tiles_active(q, mode=None):
    """Whether a gated_delta_rule call over these q (and ``_mode``) runs the amx path's tile
    products (or their emulation), whose tolerance is DELTA_TILE_ERR bf16 unit roundoffs (the
    chunked form over bf16 inputs; in automatic mode a sequence of up to 16 tokens runs the
    recurrence instead, which is only held more loosely than it need be)."""
    return (
        attnx.cpu_features()["isa"] in ("amx", "amx-emulated")
        and np.asarray(q).dtype == BF16
        and mode != "recurrent"
    )


def delta_tolerance(ref64, low32):
    """Tolerance for a delta-rule result (output or state) whose float64 reference is ``ref64``
    and whose plain float32 recurrence (rounded to the output dtype) is ``low32``: DELTA_ERR_FACTOR
    times the float32 recurrence's own error, plus DELTA_ULPS float32 ulps of the largest value.
    So the bound follows the dtype (bf16 outputs: their rounding) instead of being guessed."""
    scale = float(np.max(np.abs(ref64), initial=0.0))
    own = float(np.max(np.abs(low32 - ref64), initial=0.0))
    return DELTA_ERR_FACTOR * own + DELTA_ULPS * F32_EPS * scale


def delta_expected(q, k, v, g, beta, **kw):
    """What a gated_delta_rule call with these arguments (``_mode`` and ``num_threads`` aside)
    is held to: the float64 recurrence's output and final state, and the float32 recurrence's
    (the output rounded to q's dtype), which sets the tolerance. Four float64 arrays."""
    from attnx.ops.delta_args import delta_args, from_bshd
    from attnx.reference.attention import round_to
    from attnx.reference.delta_rule import _delta_recurrence

    kw = {key: x for key, x in kw.items() if key not in ("_mode", "num_threads")}
    ro, rs = ref.gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, out_dtype=np.float64, **kw
    )
    args = delta_args(
        q,
        k,
        v,
        g,
        beta,
        scale=kw.get("scale"),
        initial_state=kw.get("initial_state"),
        layout=kw.get("layout", "bshd"),
        cu_seqlens=kw.get("cu_seqlens"),
        lengths=kw.get("lengths"),
    )
    lo, ls = _delta_recurrence(args, qk_l2norm=kw.get("qk_l2norm", False), dtype=np.float32)
    lo = from_bshd(
        round_to(lo.astype(np.float64), q.dtype).astype(np.float64), kw.get("layout", "bshd")
    )
    return ro, rs.astype(np.float64), lo, ls.astype(np.float64)


def assert_delta_matches(o, state, expected, tiles=False):
    """o and state against ``delta_expected``: inf/NaN exactly where the float64 recurrence has
    them (a non-finite gate or beta reaches its own position and the later ones, nothing
    before), the finite entries within ``delta_tolerance`` (``tiles``: or DELTA_TILE_ERR bf16
    unit roundoffs of the largest reference value, see ``delta_tiles_active``)."""
    ro, rs, lo, ls = expected
    # An output is a dot product of a state row with q: where its terms cancel (a tiny output
    # from a state of ordinary size), float32 rounding is relative to the terms, not to the
    # output, and another summation order than the float32 twin's may land DELTA_ULPS_STATE ulps
    # of the state away (hypothesis found 1e-9 on an output of 2.8e-5 from a state of 0.12).
    state_scale = float(np.max(np.abs(rs[np.isfinite(rs)]), initial=0.0))
    for name, x, r, low in (("out", o, ro, lo), ("state", state, rs, ls)):
        x = np.asarray(x, dtype=np.float64)
        fin = np.isfinite(r)
        np.testing.assert_array_equal(np.isfinite(x), fin, err_msg=f"{name}: inf/NaN pattern")
        err = float(np.max(np.abs(x[fin] - r[fin]), initial=0.0))
        both = fin & np.isfinite(low)
        tol = delta_tolerance(r[both], low[both])
        if name == "out":
            tol = max(tol, DELTA_ULPS_STATE * F32_EPS * state_scale)
        if tiles:
            tol = max(tol, DELTA_TILE_ERR * BF16_UNIT * float(np.max(np.abs(r[fin]), initial=0.0)))
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


def check_delta_rule(q, k, v, g, beta, **kw):
    """attnx.gated_delta_rule against the float64 recurrence (output and final state; see
    ``assert_delta_matches``); returns the kernel's (o, state)."""
    o, state = attnx.gated_delta_rule(q, k, v, g, beta, output_final_state=True, **kw)
    expected = delta_expected(q, k, v, g, beta, **kw)
    assert o.dtype == q.dtype and o.shape == expected[0].shape, (
        o.dtype,
        o.shape,
        expected[0].shape,
    )
    assert state.dtype == np.float32 and state.shape == expected[1].shape
    assert_delta_matches(o, state, expected, tiles=delta_tiles_active(q, kw.get("_mode")))
    return o, state
