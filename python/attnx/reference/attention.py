"""The dense attention oracle: :func:`attention` and :func:`attention_weights`.

Pure-NumPy reference for attnx: the executable definition of attention.

Every kernel in attnx has a twin here with the same signature, and the tests
compare the two.  This module favours clarity over speed: it computes in
float64, builds explicit boolean visibility masks, and never relies on
``-inf`` arithmetic (which turns fully masked rows into NaN).  It depends on
NumPy only (``ml_dtypes`` is used, when installed, to recognise and produce
bfloat16 arrays) and never imports ``attnx._core``.

Definition
----------
Shapes are given in the logical ``"bhsd"`` order: q ``(B, Hq, Sq, Dk)``,
k ``(B, Hkv, Sk, Dk)``, v ``(B, Hkv, Sk, Dv)``, out ``(B, Hq, Sq, Dv)``.
Query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA / MQA).

For batch ``b`` let ``Lk = kv_lens[b]`` (default ``Sk``), ``Lq = q_lens[b]``
(default ``Sq``) and ``off = Lk - Lq``: query row ``i`` sits at key position
``i + off`` (bottom-right alignment).  For every ``(b, h, i, j)``::

    s = scale * dot(q[b, h, i], k[b, h // G, j])       # scale = 1/sqrt(Dk)
    s = softcap * tanh(s / softcap)                    # if softcap
    s = s - alibi_slopes[h] * |i + off - j|            # if alibi_slopes
    s = s + mask[b, h, i, j]                           # if mask is additive

Key ``j`` is *visible* to row ``i`` iff all of these hold::

    i < Lq and j < Lk                                  # padding
    j <= i + off                                       # if causal
    i + off - left <= j <= i + off + right             # if window (None = unbounded)
    mask[b, h, i, j]                                   # if mask is boolean
    mask[b, h, i, j] != -inf                           # if mask is additive

With ``V(i)`` the visible keys and ``z = sinks[h]`` (absent: no term)::

    lse[i]    = log(sum_{j in V(i)} exp(s_j) + exp(z))
    w[i, j]   = exp(s_j - lse[i])  for j in V(i), else 0
    out[i]    = sum_{j in V(i)} w[i, j] * v[j]

A row with no visible key has ``w = 0``, ``out = 0`` and ``lse = -inf``
(``lse = sinks[h]`` when sinks are given).  Padding rows (``i >= Lq``) always
have ``out = 0`` and ``lse = -inf``.  Values of q/k/v outside the valid
lengths are never read (they are zeroed before the matmul), and a key that a
row does not see never contributes to that row, not even a NaN or an inf
(``0 * nan`` is not allowed to leak).  NaN in anything a row does see
propagates to that row.

The float64 result is rounded once to the output dtype (correctly rounded,
also for bfloat16, where a plain ``astype`` would round twice via float32).

:func:`attention`: Parameters
----------
q : array_like, (B, Hq, Sq, Dk) | (Hq, Sq, Dk) | (Sq, Dk)
    Queries. For ``layout="bshd"``: (B, Sq, Hq, Dk) | (Sq, Hq, Dk) | (Sq, Dk).
    float16, bfloat16, float32 or float64; q, k and v share one dtype.
k : array_like, (B, Hkv, Sk, Dk), same rank and layout as q
    Keys. ``Hq % Hkv == 0``; query head h reads kv head ``h // (Hq // Hkv)``.
v : array_like, (B, Hkv, Sk, Dv), same rank and layout as q
    Values. ``Dv`` may differ from ``Dk``.
causal : bool
    Bottom-right aligned: row i sees key j iff ``j <= i + (Lk - Lq)``.
mask : array_like of bool or float, optional
    True = may attend (bool) or added to the scores (float; -inf blocks).
    Broadcastable to (B, Hq, Sq, Sk) for 4-D q, (Hq, Sq, Sk) for 3-D,
    (Sq, Sk) for 2-D, in this logical order whatever the layout.
kv_lens : array_like of int, (B,), optional
    Keys ``j >= kv_lens[b]`` are absent. An int is accepted for ranks 2/3.
q_lens : array_like of int, (B,), optional
    Rows ``i >= q_lens[b]`` are padding: output 0, lse -inf.
scale : float, optional
    Default ``1 / sqrt(Dk)``.
layout : {"bhsd", "bshd"}
return_lse : bool
    Also return the natural-log log-sum-exp of the final scores.
window : (int or None, int or None), optional
    ``(left, right)``: row i sees j iff ``i+off-left <= j <= i+off+right``.
softcap : float > 0, optional
    Scores become ``softcap * tanh(s / softcap)`` (before alibi and mask).
sinks : array_like, (Hq,), optional
    Per-head logit that joins the softmax denominator but has no value.
alibi_slopes : array_like, (Hq,), optional
    Adds ``-slope[h] * |i + off - j|`` to the scores (before the mask).
out_dtype : dtype, optional
    Output dtype; default q's dtype.
bf16_products : bool
    The twin of bf16 products (float32 inputs under ``attnx.set_float32_precision("bf16")``,
    and bf16 prefill, on the paths that have them): q, k and v are rounded to bfloat16 first,
    and each row's unnormalised probabilities ``exp(s - max s)`` are rounded to bfloat16
    before they multiply v (the sums, lse and the rest stay float64). Round to nearest even.

Returns
-------
out : ndarray, (B, Hq, Sq, Dv) in q's rank and layout, dtype ``out_dtype``
lse : ndarray, (B, Hq, Sq) | (Hq, Sq) | (Sq,), only if ``return_lse``
    float32, or float64 when the output dtype is float64. Always in the
    logical bhsd order, also for ``layout="bshd"``.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import numpy.typing as npt

from ..quant import BFLOAT16 as _BFLOAT16
from ..quant import FLOAT_DTYPES as _FLOAT_DTYPES
from ..quant import float_array as _float_array

# Types of the public signatures (a `window` side of None is unbounded).
Array = npt.NDArray[Any]
Window = tuple[int | None, int | None] | None
Result = Array | tuple[Array, Array]  # out, or (out, lse) with return_lse

__all__ = ["attention", "attention_weights"]

LAYOUTS = ("bhsd", "bshd")


def check_layout(layout: object) -> None:
    # (the package's attnx._validate.choice, kept here: the definition imports nothing of attnx
    # and loads without it, tests/reference/test_reference.py)
    if not (isinstance(layout, str) and layout in LAYOUTS):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")


# --------------------------------------------------------------------------
# argument normalisation
# --------------------------------------------------------------------------


def output_dtype(out_dtype, default):
    """The output dtype: ``out_dtype`` if given, else ``default``."""
    if out_dtype is None:
        return np.dtype(default)
    try:
        dt = np.dtype(out_dtype)
    except TypeError as exc:
        raise TypeError(f"out_dtype: {out_dtype!r} is not a dtype") from exc
    if dt not in _FLOAT_DTYPES:
        raise TypeError(
            f"out_dtype: {dt} is not supported; expected float16, bfloat16, float32 or float64"
        )
    return dt


def lse_dtype(out_dt):
    """lse is float32, or float64 when the output is float64."""
    return np.dtype(np.float64) if out_dt == np.float64 else np.dtype(np.float32)


def _to_bhsd(a, name, layout):
    """View a 2-D/3-D/4-D array of the given layout as float64 ``(B, H, S, D)``.

    ``(S, D)`` -> ``(1, 1, S, D)``; ``(H, S, D)`` ("bhsd") or ``(S, H, D)``
    ("bshd") -> ``(1, H, S, D)``; ``(B, S, H, D)`` ("bshd") -> ``(B, H, S, D)``.
    """
    if a.ndim == 2:
        return a[None, None].astype(np.float64)  # same for both layouts
    if a.ndim == 3:
        a = a[None]
    elif a.ndim != 4:
        raise ValueError(f"{name}: rank must be 2, 3 or 4, got shape {a.shape}")
    if layout == "bshd":
        a = a.transpose(0, 2, 1, 3)
    return a.astype(np.float64)


def _from_bhsd(x, layout, rank):
    """Inverse of :func:`_to_bhsd` for an output ``(B, H, S, D)``."""
    if rank == 2:
        return x[0, 0]
    if layout == "bshd":
        x = x.transpose(0, 2, 1, 3)
    return x[0] if rank == 3 else x


def _reduce_rank(x, rank):
    """Drop the implied leading axes of a ``(B, H, ...)`` array (lse, weights)."""
    if rank == 2:
        return x[0, 0]
    if rank == 3:
        return x[0]
    return x


def _lengths(x, name, batch, size, rank):
    """Validate ``kv_lens`` / ``q_lens``; default: every length is ``size``."""
    if x is None:
        return np.full(batch, size, dtype=np.int64)
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: must be integers, got dtype {a.dtype}")
    if a.ndim == 0 and rank < 4:
        a = a.reshape(1)
    if a.shape != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},), got {a.shape}")
    if np.any(a < 0) or np.any(a > size):
        raise ValueError(f"{name}: values must lie in [0, {size}], got {a.tolist()}")
    return a.astype(np.int64)


def _per_head(x, name, heads):
    """Validate ``sinks`` / ``alibi_slopes``: float64 of shape ``(Hq,)`` or None."""
    if x is None:
        return None
    a = np.asarray(x)
    if a.dtype.kind not in "iuf" and a.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: must be real numbers, got dtype {a.dtype}")
    if a.shape != (heads,):
        raise ValueError(f"{name}: expected shape ({heads},) (one per query head), got {a.shape}")
    return a.astype(np.float64)


def _window(window):
    """Validate ``window=(left, right)``; each side a non-negative int or None."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError) as exc:
        raise ValueError(f"window: expected (left, right), got {window!r}") from exc
    for side in (left, right):
        if side is None:
            continue
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window: sides must be ints or None, got {window!r}")
        if side < 0:
            raise ValueError(f"window: sides must be >= 0, got {window!r}")
    # A side wider than any sequence is no bound; treating it so keeps positions in int64.
    return tuple(None if side is None or side >= 2**40 else int(side) for side in (left, right))


def _softcap(softcap):
    if softcap is None:
        return None
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise TypeError(f"softcap: expected a float, got {softcap!r}")
    if not softcap > 0:  # also rejects NaN
        raise ValueError(f"softcap: must be > 0, got {softcap!r}")
    return float(softcap)


def _mask(mask, logical_shape, shape4):
    """Return ``(allowed, additive)`` as 4-D arrays (either may be None).

    ``mask`` is boolean (True = may attend) or additive float (0 keeps,
    -inf blocks), broadcastable to ``logical_shape`` (the bhsd shape at the
    rank of q).  An additive ``-inf`` entry is treated as "not visible", so it
    never enters the softmax arithmetic.
    """
    if mask is None:
        return None, None
    m = np.asarray(mask)
    if m.dtype != np.bool_ and m.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"mask: must be boolean (True = may attend) or additive float, got dtype {m.dtype}"
        )
    try:
        m = np.broadcast_to(m, logical_shape)
    except ValueError as exc:
        raise ValueError(
            f"mask: shape {m.shape} is not broadcastable to {tuple(logical_shape)}"
        ) from exc
    m = m.reshape(shape4)
    if m.dtype == np.bool_:
        return m, None
    m = m.astype(np.float64)
    return m != -np.inf, m


def round_to(x, dtype):
    """Round a float64 array to ``dtype`` once (round to nearest even).

    NumPy/ml_dtypes cast float64 -> bfloat16 through float32, which rounds
    twice.  Rounding to float32 *to odd* first and then to bfloat16 is exact
    single rounding (float32 has more than bfloat16's precision + 2 bits).
    """
    dtype = np.dtype(dtype)
    if dtype != _BFLOAT16:
        return x.astype(dtype)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)
        x32_back = x32.astype(np.float64)
        inexact = np.isfinite(x) & (x32_back != x)
        toward = np.where(x > x32_back, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    lsb_even = (x32.view(np.uint32) & 1) == 0
    x32 = np.where(inexact & lsb_even, np.nextafter(x32, toward), x32).astype(np.float32)
    return x32.astype(dtype)


# --------------------------------------------------------------------------
# the computation (float64, 4-D bhsd)
# --------------------------------------------------------------------------


def _bf16(x):
    """float64 ``x`` rounded to bfloat16 (round to nearest even), as float64."""
    if _BFLOAT16 is None:  # pragma: no cover
        raise ValueError("bf16_products: rounding to bfloat16 needs ml_dtypes")
    return round_to(x, _BFLOAT16).astype(np.float64)


def _bf16_p(weights):
    """``weights`` with each row's unnormalised probabilities ``w / max w = exp(s - max s)``
    rounded to bfloat16 (what bf16 products multiply v by), normalised as before."""
    c = weights.max(axis=-1, keepdims=True)
    c = np.where(c > 0, c, 1.0)
    return _bf16(weights / c) * c


def _compute(
    q,
    k,
    v,
    *,
    scale,
    causal,
    allowed,
    additive,
    kv_lens,
    q_lens,
    window,
    softcap,
    sinks,
    alibi,
    round_p=False,
):
    """Weights, output and lse for float64 ``(B, H, S, D)`` arrays.

    Parameters
    ----------
    q : ndarray, (B, Hq, Sq, Dk) float64
    k : ndarray, (B, Hkv, Sk, Dk) float64
    v : ndarray, (B, Hkv, Sk, Dv) float64, or None (weights and lse only)
    allowed, additive : ndarray, (B, Hq, Sq, Sk), or None
    kv_lens, q_lens : ndarray, (B,) int64
    round_p : bool, P rounded to bfloat16 before ``P V`` (``_bf16_p``; weights, lse unrounded)

    Returns
    -------
    weights : ndarray, (B, Hq, Sq, Sk) float64
    out : ndarray, (B, Hq, Sq, Dv) float64, or None when ``v`` is None
    lse : ndarray, (B, Hq, Sq) float64
    """
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    i = np.arange(Sq)[None, :, None]
    j = np.arange(Sk)[None, None, :]
    q_row_valid = np.arange(Sq)[None, :] < q_lens[:, None]  # (B, Sq)
    key_valid = np.arange(Sk)[None, :] < kv_lens[:, None]  # (B, Sk)
    diag = i + (kv_lens - q_lens)[:, None, None]  # key position of row i
    visible = _visible(q_row_valid, key_valid, diag, j, causal, window, Hq, allowed)

    # --- absent rows/keys are zeroed so that garbage there cannot leak ------
    q = np.where(q_row_valid[:, None, :, None], q, 0.0)
    k = np.where(key_valid[:, None, :, None], k, 0.0)
    k = np.repeat(k, group, axis=1)  # query head h reads kv head h // group

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = _scores(q, k, scale, softcap, alibi, additive, np.abs(diag - j))
        weights, lse = _softmax(s, visible, sinks)
        lse = np.where(q_row_valid[:, None, :], lse, -np.inf)  # padding rows
        if v is None:
            return weights, None, lse
        v = np.where(key_valid[:, None, :, None], v, 0.0)
        v = np.repeat(v, group, axis=1)  # (B, Hq, Sk, Dv)
        p = _bf16_p(weights) if round_p else weights
        return weights, _weighted_values(p, v, visible), lse


def _scores(q, k, scale, softcap, alibi, additive, distance):
    """``(B, Hq, Sq, Sk)`` scores: scaled, soft-capped, ALiBi (``distance`` ``(B, Sq, Sk)``) and
    the additive mask, each where given."""
    s = scale * (q @ k.swapaxes(-1, -2))
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi is not None:
        s = s - alibi[None, :, None, None] * distance[:, None]
    if additive is not None:
        s = s + additive
    return s


def _visible(q_row_valid, key_valid, diag, j, causal, window, Hq, allowed):
    """Which keys each row sees, ``(B, Hq, Sq, Sk)``: padding, causal, window, boolean mask."""
    visible = q_row_valid[:, :, None] & key_valid[:, None, :]
    if causal:
        visible = visible & (j <= diag)
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (j >= diag - left)
        if right is not None:
            visible = visible & (j <= diag + right)
    B, Sq, Sk = visible.shape
    visible = np.broadcast_to(visible[:, None], (B, Hq, Sq, Sk))
    if allowed is not None:
        visible = visible & allowed
    return visible


def _softmax(s, visible, sinks):
    """``(weights, lse)``: the softmax over visible keys (+ sink), with a safe max; a row that
    sees nothing has weights 0 and lse -inf."""
    s_visible = np.where(visible, s, -np.inf)
    m = np.max(s_visible, axis=-1, initial=-np.inf)  # (B, Hq, Sq); NaN propagates
    if sinks is not None:
        sink = np.broadcast_to(sinks[None, :, None], m.shape)
        m = np.maximum(m, sink)
    nonempty = m != -np.inf  # True for NaN rows too
    m_safe = np.where(nonempty, m, 0.0)
    e = np.where(visible, np.exp(s_visible - m_safe[..., None]), 0.0)
    denom = e.sum(axis=-1)
    if sinks is not None:
        denom = denom + np.exp(sink - m_safe)
    denom_safe = np.where(nonempty, denom, 1.0)
    weights = np.where(visible, e / denom_safe[..., None], 0.0)
    lse = np.where(nonempty, m_safe + np.log(denom_safe), -np.inf)
    return weights, lse


def _weighted_values(weights, v, visible):
    """``weights @ v`` over the visible value rows, ``v`` ``(B, Hq, Sk, Dv)``."""
    finite = np.isfinite(v)
    out = weights @ np.where(finite, v, 0.0)
    # Non-finite values (NaN/inf) are added back one key at a time, only
    # to the rows that see that key, so that 0 * nan never leaks.
    for jj in np.flatnonzero(~finite.all(axis=(0, 1, 3))):
        v_bad = np.where(finite[:, :, jj, :], 0.0, v[:, :, jj, :])  # (B, Hq, Dv)
        contrib = weights[:, :, :, jj, None] * v_bad[:, :, None, :]
        out = out + np.where(visible[:, :, :, jj, None], contrib, 0.0)
    return out


def _prepare(
    q, k, v, causal, mask, kv_lens, q_lens, scale, layout, window, softcap, sinks, alibi_slopes
) -> tuple[Array, Array, Array, Array | None, int, dict[str, Any]]:
    """Validate the common arguments of :func:`attention` and :func:`attention_weights`, in their
    order, and bring everything to 4-D float64 bhsd."""
    check_layout(layout)
    q = _float_array(q, "q")
    k = _float_array(k, "k")
    rank = q.ndim
    if rank not in (2, 3, 4):
        raise ValueError(f"q: rank must be 2, 3 or 4, got shape {q.shape}")
    arrays = [("k", k)]
    if v is not None:
        v = _float_array(v, "v")
        arrays.append(("v", v))
    for name, a in arrays:
        if a.ndim != rank:
            raise ValueError(f"{name}: rank {a.ndim} differs from q's rank {rank}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {a.dtype} differs from q's dtype {q.dtype}")

    q4 = _to_bhsd(q, "q", layout)
    k4 = _to_bhsd(k, "k", layout)
    v4 = None if v is None else _to_bhsd(v, "v", layout)
    B, Hq, Sq, Dk = q4.shape
    _, Hkv, Sk, Dk_k = k4.shape
    if k4.shape[0] != B:
        raise ValueError(f"k: batch {k4.shape[0]} differs from q's batch {B}")
    if Dk_k != Dk:
        raise ValueError(f"k: head dim {Dk_k} differs from q's head dim {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k: Hq={Hq} query heads are not a multiple of Hkv={Hkv} kv heads")
    if v4 is not None and v4.shape[:3] != k4.shape[:3]:
        raise ValueError(f"v: (B, Hkv, Sk) = {v4.shape[:3]} differs from k's {k4.shape[:3]}")

    if scale is None:
        if Dk == 0:
            raise ValueError("q: head dim is 0, so the default scale 1/sqrt(Dk) is undefined")
        scale = 1.0 / np.sqrt(Dk)
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a float, got {scale!r}")

    logical = {2: (Sq, Sk), 3: (Hq, Sq, Sk), 4: (B, Hq, Sq, Sk)}[rank]
    allowed, additive = _mask(mask, logical, (B, Hq, Sq, Sk))
    params = dict(
        scale=float(scale),
        causal=bool(causal),
        allowed=allowed,
        additive=additive,
        kv_lens=_lengths(kv_lens, "kv_lens", B, Sk, rank),
        q_lens=_lengths(q_lens, "q_lens", B, Sq, rank),
        window=_window(window),
        softcap=_softcap(softcap),
        sinks=_per_head(sinks, "sinks", Hq),
        alibi=_per_head(alibi_slopes, "alibi_slopes", Hq),
    )
    return q, q4, k4, v4, rank, params


# --------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------


def attention(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    causal: bool = False,
    mask: npt.ArrayLike | None = None,
    kv_lens: npt.ArrayLike | None = None,
    q_lens: npt.ArrayLike | None = None,
    scale: float | None = None,
    layout: str = "bhsd",
    return_lse: bool = False,
    window: Window = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    out_dtype: npt.DTypeLike | None = None,
    bf16_products: bool = False,
) -> Result:
    """Exact scaled dot-product attention, ``softmax(scale * Q Kᵀ + M) V``.
    (Parameters, results and an example: :mod:`attnx.reference.attention`.)"""
    q, q4, k4, v4, rank, params = _prepare(
        q, k, v, causal, mask, kv_lens, q_lens, scale, layout, window, softcap, sinks, alibi_slopes
    )
    out_dt = output_dtype(out_dtype, q.dtype)
    if bf16_products:
        q4, k4, v4 = (_bf16(x) for x in (q4, k4, v4))
    _, out, lse = _compute(q4, k4, v4, round_p=bool(bf16_products), **params)
    out = round_to(_from_bhsd(out, layout, rank), out_dt)
    if not return_lse:
        return out
    return out, _reduce_rank(lse, rank).astype(lse_dtype(out_dt))


def attention_weights(
    q: npt.ArrayLike,
    k: npt.ArrayLike,
    *,
    causal: bool = False,
    mask: npt.ArrayLike | None = None,
    kv_lens: npt.ArrayLike | None = None,
    q_lens: npt.ArrayLike | None = None,
    scale: float | None = None,
    layout: str = "bhsd",
    window: Window = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
) -> Array:
    """The attention matrix ``A`` such that ``attention(q, k, v) == A @ v`` (per head).

    Arguments are those of :func:`attention` (without v).

    Returns
    -------
    A : ndarray, float64, (B, Hq, Sq, Sk) | (Hq, Sq, Sk) | (Sq, Sk)
        Always in the logical bhsd order. Each row sums to 1 over the visible
        keys (to less than 1 with sinks); rows with no visible key and padding
        rows are all 0; invisible entries are exactly 0.
    """
    _, q4, k4, _, rank, params = _prepare(
        q,
        k,
        None,
        causal,
        mask,
        kv_lens,
        q_lens,
        scale,
        layout,
        window,
        softcap,
        sinks,
        alibi_slopes,
    )
    weights, _, _ = _compute(q4, k4, None, **params)
    return _reduce_rank(weights, rank)
