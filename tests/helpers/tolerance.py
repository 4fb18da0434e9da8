"""How far a kernel may sit from the float64 reference: a same-precision twin (float32
arithmetic, output rounded to the kernel's dtype) sets the bound (``attention_tolerance``), and
``assert_matches`` applies it."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import attnx

from helpers.data import BF16, F32_EPS
from helpers.isa import BF16_PRODUCT_ISAS


def _lowp_scores(q, k, *, scale, softcap, alibi, pos):
    """float32 scores (B, Hq, Sq, Sk) for ``lowp_attention``: q . k summed one term of d at a
    time, scaled, soft-capped and ALiBi-biased as the kernel does; ``k`` already repeated over
    the query heads of its group.  Called under the caller's ``np.errstate``."""
    f = np.float32
    s = np.zeros(q.shape[:3] + (k.shape[2],), f)
    for d in range(q.shape[3]):
        s += q[:, :, :, d, None] * k[:, :, None, :, d]
    s *= f(scale)
    if softcap is not None:
        s = f(softcap) * np.tanh(s / f(softcap))
    if alibi is not None:
        dist = np.abs(pos[:, None, :, None] - np.arange(k.shape[2])[None, None, None, :])
        s = s - np.asarray(alibi, f)[None, :, None, None] * dist.astype(f)
    return s


def lowp_attention(
    q4,
    k4,
    v4,
    visible,
    *,
    scale,
    softcap=None,
    alibi=None,
    additive=None,
    sinks=None,
    pos=None,
    storage=np.float32,
    round_p=False,
):
    """Textbook attention in float32 (no tiling, no online softmax), rounded to ``storage``.
    With ``round_p``, the probabilities exp(s - max) are rounded to bfloat16 before P V (their
    sum is not): what the avx512bf16 path does on bf16 inputs (``bf16_rounds_p``).

    It is what a straightforward same-precision implementation gets, so its distance to the
    float64 reference measures the error that float32 compute and ``storage`` output cost on
    *these* inputs.  Both products are summed one term at a time (multiply, round, add, round),
    the least accurate order a legitimate kernel may use (a scalar loop over d, or over the
    keys of a tile); a BLAS GEMM sums in blocks and would set the bar too high for a plain
    scalar path.  ``visible`` (B, Hq, Sq, Sk) comes from the reference: this function only
    redoes the arithmetic.  Non-finite values are zeroed (NaN handling is checked elsewhere,
    against the reference itself).
    """
    f = np.float32
    B, Hq, Sq, _ = q4.shape
    G = Hq // k4.shape[1]
    fin = lambda a: np.where(np.isfinite(a), a, 0).astype(f)  # noqa: E731
    q, k, v = fin(q4), np.repeat(fin(k4), G, axis=1), np.repeat(fin(v4), G, axis=1)
    with np.errstate(all="ignore"):
        s = _lowp_scores(q, k, scale=scale, softcap=softcap, alibi=alibi, pos=pos)
        if additive is not None:
            s = s + additive.astype(f)
        s = np.where(visible, s, f(-np.inf))
        m = s.max(axis=-1, initial=-np.inf)
        if sinks is not None:
            m = np.maximum(m, np.asarray(sinks, f)[None, :, None])
        m = np.where(np.isfinite(m), m, f(0))
        e = np.where(visible, np.exp(s - m[..., None]), f(0))
        l = e.sum(axis=-1, dtype=f)
        if sinks is not None:
            l = l + np.exp(np.asarray(sinks, f)[None, :, None] - m)
        pe = e.astype(BF16).astype(f) if round_p else e
        out = np.zeros(e.shape[:3] + (v.shape[3],), f)
        for j in range(v.shape[2]):
            out += pe[:, :, :, j, None] * v[:, :, None, j, :]
        out /= np.where(l > 0, l, f(1))[..., None]
        lse = np.where(l > 0, m + np.log(l), f(-np.inf))
    return out.astype(storage).astype(np.float64), lse.astype(np.float64)


def attention_tolerance(ref_out, lp_out, ref_lse, lp_lse, *, storage, v_max):
    """(tol_out, tol_lse): how far the kernel may sit from the float64 reference.

    flash-attention's rule, adapted: the kernel must be within 3x the error of a
    same-precision implementation (``lowp_attention``: float32 compute, output stored in the
    kernel's dtype) on the same inputs, both measured against float64.  That makes the bound
    follow the dtype and the problem instead of being guessed:

    * float32: the same-precision error is float32 rounding in the QK dot products (grows with
      Dk and |q||k|), in exp, and in the sum over Sk keys (grows with Sk), each summed in the
      least accurate legitimate order (see ``lowp_attention``).  A tiled kernel with
      an online softmax rescales its running sum once per tile, which costs a few more ulps:
      3x covers that with room, while a real bug (a dropped key, a wrong scale, an off-by-one
      mask) costs orders of magnitude more (``test_tolerance_is_tight`` checks that).
    * float16 / bfloat16: inputs are exact in float32, so the reference is evaluated on the
      SAME low-precision inputs and input rounding is not measured.  The same-precision error
      is then dominated by the final rounding to storage (<= 1/2 ulp); the kernel may land on
      the other side of a rounding boundary (1 ulp), which 3 x 1/2 ulp covers.
    * the avx512bf16 path on bf16 inputs rounds P to bf16 before P V (at most 2^-8 relative
      per weight): its twin rounds P too (``bf16_rounds_p``). Where the output cancels (weights on
      values of both signs) that error exceeds the output's own rounding: a soak run found a
      row at 0.099 from values up to 2.7 whose P rounding cost 1.01x the tolerance without it.
      tests/kernels/test_bf16_dot.py holds that path to the stricter flash rule besides.
    * floors, for the lucky cases where the same-precision error is ~0 (one key, where the
      output is a copy of v): one ulp of the storage dtype at the largest output, plus one
      float32 ulp of the largest |v|.  Both are far below any structural error.

    lse is float32 in every dtype: same rule, floor 4 float32 ulps of max(1, |lse|).
    """
    eps = float(ml_dtypes.finfo(storage).eps)  # ulp at 1.0: 2^-23, 2^-10 (f16), 2^-7 (bf16)
    fo = np.isfinite(ref_out)
    out_scale = float(np.max(np.abs(ref_out[fo]), initial=0.0))
    both = fo & np.isfinite(lp_out)
    lp_err = float(np.max(np.abs(lp_out[both] - ref_out[both]), initial=0.0))
    tol_out = 3 * lp_err + eps * out_scale + F32_EPS * v_max
    fl = np.isfinite(ref_lse) & np.isfinite(lp_lse)
    lp_lse_err = float(np.max(np.abs(lp_lse[fl] - ref_lse[fl]), initial=0.0))
    lse_scale = max(1.0, float(np.max(np.abs(ref_lse[fl]), initial=0.0)))
    tol_lse = 3 * lp_lse_err + 4 * F32_EPS * lse_scale
    return tol_out, tol_lse


def bf16_rounds_p(q, k, v):
    """Whether the active path may round P to bf16 before P V on these inputs: avx512bf16 or amx
    with q, k and v all bf16 (their prefill-shaped calls do, as FlashAttention and torch's bf16
    SDPA do; README "dtypes"). Its same-precision twin then rounds P too."""
    return attnx.cpu_features()["isa"] in BF16_PRODUCT_ISAS and all(
        np.asarray(x).dtype == BF16 for x in (q, k, v)
    )


def conditioning(q4, k4, visible, scale, alibi=None, pos=None, additive=None):
    """max over visible (row, key) of the magnitude the score is summed from: float32 rounds the
    score with an absolute error of a few ulps of this, whatever the final score is."""
    if q4.size == 0 or k4.size == 0 or not visible.any():
        return 0.0
    G = q4.shape[1] // k4.shape[1]
    aq = np.where(np.isfinite(q4), np.abs(q4), 0.0)
    ak = np.repeat(np.where(np.isfinite(k4), np.abs(k4), 0.0), G, axis=1)
    c = scale * (aq @ ak.swapaxes(-1, -2))
    if alibi is not None:
        dist = np.abs(pos[:, None, :, None] - np.arange(k4.shape[2])[None, None, None, :])
        c = c + np.abs(np.asarray(alibi, np.float64))[None, :, None, None] * dist
    if additive is not None:
        c = c + np.where(np.isfinite(additive), np.abs(additive), 0.0)
    return float(np.max(np.where(visible, c, 0.0), initial=0.0))


def assert_matches(o, r, lse, rlse, visible, tol_out, tol_lse):
    """The kernel's (out, lse) against the reference's, as float64 arrays of one shape: NaN and
    inf exactly where the reference has them (NaN reaches only the rows that see it), finite
    values within the tolerances, rows that see nothing exactly 0 with lse exactly -inf."""
    np.testing.assert_array_equal(np.isnan(o), np.isnan(r), err_msg="NaN pattern differs")
    fin = np.isfinite(r)
    np.testing.assert_array_equal(o[~fin], r[~fin], err_msg="inf/NaN values differ")
    err = float(np.max(np.abs(o[fin] - r[fin]), initial=0.0))
    assert err <= tol_out, f"out: max error {err:.3g} > tolerance {tol_out:.3g}"
    empty = ~visible.any(axis=-1)
    assert np.all(o[empty] == 0), "a row that sees no key is not exactly zero"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse), err_msg="lse -inf pattern")
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(rlse), err_msg="lse NaN pattern")
    fl = np.isfinite(rlse)
    err_lse = float(np.max(np.abs(lse[fl] - rlse[fl]), initial=0.0))
    assert err_lse <= tol_lse, f"lse: max error {err_lse:.3g} > tolerance {tol_lse:.3g}"
