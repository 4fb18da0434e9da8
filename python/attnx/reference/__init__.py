"""Pure-NumPy reference for attnx: the executable definition of attention.

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
"""

from __future__ import annotations

import numbers
from typing import Any, Union

import numpy as np
import numpy.typing as npt

# the quantised KV format is defined in attnx.quant; its functions are part of the reference too
from ..quant import QUANTISED_DTYPES, dequantize_kv, quantised_dtype, quantised_max as quantised_max, quantize_kv, quantize_query
from ..quant import dequantised_pages as _dequantised_pages
from ..quant import BFLOAT16 as _BFLOAT16, FLOAT_DTYPES as _FLOAT_DTYPES, float_array as _float_array

# Types of the public signatures (a `window` side of None is unbounded).
_Array = npt.NDArray[Any]
_Window = Union[tuple[Union[int, None], Union[int, None]], None]
_Result = Union[_Array, tuple[_Array, _Array]]  # out, or (out, lse) with return_lse

__all__ = ["attention", "attention_weights", "paged_attention", "scaled_dot_product_attention"]

_LAYOUTS = ("bhsd", "bshd")


def _check_layout(layout: object) -> None:
    # (the package's attnx._validate.choice, kept here: the definition imports nothing of attnx
    # and loads without it, tests/test_reference.py)
    if not (isinstance(layout, str) and layout in _LAYOUTS):
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', got {layout!r}")



# --------------------------------------------------------------------------
# argument normalisation
# --------------------------------------------------------------------------


def _out_dtype(out_dtype, default):
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


def _lse_dtype(out_dt):
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


def _round_to(x, dtype):
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


def _compute(q, k, v, *, scale, causal, allowed, additive, kv_lens, q_lens, window,
             softcap, sinks, alibi):
    """Weights, output and lse for float64 ``(B, H, S, D)`` arrays.

    Parameters
    ----------
    q : ndarray, (B, Hq, Sq, Dk) float64
    k : ndarray, (B, Hkv, Sk, Dk) float64
    v : ndarray, (B, Hkv, Sk, Dv) float64, or None (weights and lse only)
    allowed, additive : ndarray, (B, Hq, Sq, Sk), or None
    kv_lens, q_lens : ndarray, (B,) int64

    Returns
    -------
    weights : ndarray, (B, Hq, Sq, Sk) float64
    out : ndarray, (B, Hq, Sq, Dv) float64, or None when ``v`` is None
    lse : ndarray, (B, Hq, Sq) float64
    """
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv

    # --- positions and structural visibility, (B, Sq, Sk) -------------------
    i = np.arange(Sq)[None, :, None]
    j = np.arange(Sk)[None, None, :]
    q_row_valid = np.arange(Sq)[None, :] < q_lens[:, None]  # (B, Sq)
    key_valid = np.arange(Sk)[None, :] < kv_lens[:, None]  # (B, Sk)
    diag = i + (kv_lens - q_lens)[:, None, None]  # key position of row i
    visible = q_row_valid[:, :, None] & key_valid[:, None, :]
    if causal:
        visible = visible & (j <= diag)
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (j >= diag - left)
        if right is not None:
            visible = visible & (j <= diag + right)
    visible = np.broadcast_to(visible[:, None], (B, Hq, Sq, Sk))
    if allowed is not None:
        visible = visible & allowed

    # --- absent rows/keys are zeroed so that garbage there cannot leak ------
    q = np.where(q_row_valid[:, None, :, None], q, 0.0)
    k = np.where(key_valid[:, None, :, None], k, 0.0)
    k = np.repeat(k, group, axis=1)  # query head h reads kv head h // group

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # --- scores -----------------------------------------------------------
        s = scale * (q @ k.swapaxes(-1, -2))  # (B, Hq, Sq, Sk)
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        if alibi is not None:
            distance = np.abs(diag - j)  # (B, Sq, Sk)
            s = s - alibi[None, :, None, None] * distance[:, None]
        if additive is not None:
            s = s + additive

        # --- softmax over visible keys (+ sink), with a safe max -------------
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
        lse = np.where(q_row_valid[:, None, :], lse, -np.inf)  # padding rows

        if v is None:
            return weights, None, lse

        # --- output: weighted sum of the visible value rows -----------------
        v = np.where(key_valid[:, None, :, None], v, 0.0)
        v = np.repeat(v, group, axis=1)  # (B, Hq, Sk, Dv)
        finite = np.isfinite(v)
        out = weights @ np.where(finite, v, 0.0)
        # Non-finite values (NaN/inf) are added back one key at a time, only
        # to the rows that see that key, so that 0 * nan never leaks.
        for jj in np.flatnonzero(~finite.all(axis=(0, 1, 3))):
            v_bad = np.where(finite[:, :, jj, :], 0.0, v[:, :, jj, :])  # (B, Hq, Dv)
            contrib = weights[:, :, :, jj, None] * v_bad[:, :, None, :]
            out = out + np.where(visible[:, :, :, jj, None], contrib, 0.0)
    return weights, out, lse


def _prepare(q, k, v, *, causal, mask, kv_lens, q_lens, scale, layout, window, softcap,
             sinks, alibi_slopes) -> tuple[_Array, _Array, _Array, _Array | None, int, dict[str, Any]]:
    """Validate the common arguments and bring everything to 4-D float64 bhsd."""
    _check_layout(layout)
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
    if v4 is not None:
        if v4.shape[:3] != k4.shape[:3]:
            raise ValueError(
                f"v: (B, Hkv, Sk) = {v4.shape[:3]} differs from k's {k4.shape[:3]}"
            )

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


def attention(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *, causal: bool = False,
              mask: npt.ArrayLike | None = None, kv_lens: npt.ArrayLike | None = None,
              q_lens: npt.ArrayLike | None = None, scale: float | None = None,
              layout: str = "bhsd", return_lse: bool = False, window: _Window = None,
              softcap: float | None = None, sinks: npt.ArrayLike | None = None,
              alibi_slopes: npt.ArrayLike | None = None,
              out_dtype: npt.DTypeLike | None = None) -> _Result:
    """Exact scaled dot-product attention, ``softmax(scale * Q Kᵀ + M) V``.

    Parameters
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

    Returns
    -------
    out : ndarray, (B, Hq, Sq, Dv) in q's rank and layout, dtype ``out_dtype``
    lse : ndarray, (B, Hq, Sq) | (Hq, Sq) | (Sq,), only if ``return_lse``
        float32, or float64 when the output dtype is float64. Always in the
        logical bhsd order, also for ``layout="bshd"``.
    """
    q, q4, k4, v4, rank, params = _prepare(
        q, k, v, causal=causal, mask=mask, kv_lens=kv_lens, q_lens=q_lens, scale=scale,
        layout=layout, window=window, softcap=softcap, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    out_dt = _out_dtype(out_dtype, q.dtype)
    _, out, lse = _compute(q4, k4, v4, **params)
    out = _round_to(_from_bhsd(out, layout, rank), out_dt)
    if not return_lse:
        return out
    return out, _reduce_rank(lse, rank).astype(_lse_dtype(out_dt))


def attention_weights(q: npt.ArrayLike, k: npt.ArrayLike, *, causal: bool = False,
                      mask: npt.ArrayLike | None = None, kv_lens: npt.ArrayLike | None = None,
                      q_lens: npt.ArrayLike | None = None, scale: float | None = None,
                      layout: str = "bhsd", window: _Window = None, softcap: float | None = None,
                      sinks: npt.ArrayLike | None = None,
                      alibi_slopes: npt.ArrayLike | None = None) -> _Array:
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
        q, k, None, causal=causal, mask=mask, kv_lens=kv_lens, q_lens=q_lens, scale=scale,
        layout=layout, window=window, softcap=softcap, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    weights, _, _ = _compute(q4, k4, None, **params)
    return _reduce_rank(weights, rank)


def paged_attention(q: npt.ArrayLike, k_pages: npt.ArrayLike, v_pages: npt.ArrayLike,
                    block_tables: npt.ArrayLike, seq_lens: npt.ArrayLike, *,
                    q_lens: npt.ArrayLike | None = None, causal: bool = True,
                    scale: float | None = None, return_lse: bool = False, window: _Window = None,
                    softcap: float | None = None, sinks: npt.ArrayLike | None = None,
                    alibi_slopes: npt.ArrayLike | None = None,
                    out_dtype: npt.DTypeLike | None = None, k_scales: npt.ArrayLike | None = None,
                    v_scales: npt.ArrayLike | None = None, int8_query: bool = False) -> _Result:
    """Attention over a paged KV cache (decode and chunked prefill).

    Sequence b owns the kv slots ``0 .. seq_lens[b]-1``; slot t lives in block
    ``block_tables[b, t // block_size]`` at offset ``t % block_size``. Its
    ``q_lens[b]`` queries are its last ``q_lens[b]`` positions, packed in
    sequence order into q. Computed by gathering each sequence's pages and
    calling :func:`attention` on it.

    Parameters
    ----------
    q : array_like, (N, Hq, Dk), N = sum(q_lens)
        May have a different dtype from the pages.
    k_pages : array_like, (num_blocks, Hkv, block_size, Dk)
    v_pages : array_like, (num_blocks, Hkv, block_size, Dv), same dtype as k_pages
    block_tables : array_like of int, (B, max_blocks)
        Only the first ``ceil(seq_lens[b] / block_size)`` entries of row b are read.
    seq_lens : array_like of int, (B,)
        Total kv length of each sequence, including its new tokens.
    q_lens : array_like of int, (B,), optional
        Default ``ones(B)`` (one decode token per sequence).
    causal : bool
        Default True, bottom-right aligned (query t of a sequence sees slots
        ``<= seq_lens[b] - q_lens[b] + t``).
    scale, window, softcap, sinks, alibi_slopes, out_dtype
        As in :func:`attention`.
    k_scales, v_scales : float32 array_like, (num_blocks, Hkv, block_size), optional
        With pages of a quantised dtype (int8, float8_e4m3fn, float8_e5m2), and only then:
        each row's scale; attention is over ``dequantize_kv(pages, scales)``.
    int8_query : bool
        With int8 pages: the twin of the kernels' integer queries (``attnx.set_int8_query``).
        Each query row times ``scale`` (a float32 product) is quantised as the keys are
        (:func:`quantize_query`), so each score is ``(q_q · k_q) * s_q * s_k``.

    Returns
    -------
    out : ndarray, (N, Hq, Dv), dtype ``out_dtype`` or q's dtype
    lse : ndarray, (N, Hq), only if ``return_lse``
        float32, or float64 when the output dtype is float64.
    """
    if int8_query and np.asarray(k_pages).dtype == np.int8 and k_scales is not None:
        q, scale = quantize_query(q, scale), 1.0
    k_pages, v_pages = _dequantised_pages(k_pages, v_pages, k_scales, v_scales)
    q = _float_array(q, "q")
    k_pages = _float_array(k_pages, "k_pages")
    v_pages = _float_array(v_pages, "v_pages")
    if q.ndim != 3:
        raise ValueError(f"q: expected (N, Hq, Dk), got shape {q.shape}")
    for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
        if a.ndim != 4:
            raise ValueError(
                f"{name}: expected (num_blocks, Hkv, block_size, D), got shape {a.shape}"
            )
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages: dtype {v_pages.dtype} differs from k_pages' {k_pages.dtype}")
    if v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(
            f"v_pages: (num_blocks, Hkv, block_size) = {v_pages.shape[:3]} differs from "
            f"k_pages' {k_pages.shape[:3]}"
        )
    num_blocks, _, block_size, _ = k_pages.shape
    if block_size == 0:
        raise ValueError("k_pages: block_size is 0")

    block_tables = np.asarray(block_tables)
    if block_tables.dtype.kind not in "iu":
        raise TypeError(f"block_tables: must be integers, got dtype {block_tables.dtype}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables: expected (B, max_blocks), got shape {block_tables.shape}")
    batch = block_tables.shape[0]
    seq_lens = np.asarray(seq_lens)
    if seq_lens.dtype.kind not in "iu":
        raise TypeError(f"seq_lens: must be integers, got dtype {seq_lens.dtype}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens: expected shape ({batch},), got {seq_lens.shape}")
    if np.any(seq_lens < 0):
        raise ValueError(f"seq_lens: must be >= 0, got {seq_lens.tolist()}")
    if q_lens is None:
        q_lens = np.ones(batch, dtype=np.int64)
    q_lens = np.asarray(q_lens)
    if q_lens.dtype.kind not in "iu":
        raise TypeError(f"q_lens: must be integers, got dtype {q_lens.dtype}")
    if q_lens.shape != (batch,):
        raise ValueError(f"q_lens: expected shape ({batch},), got {q_lens.shape}")
    if np.any(q_lens < 0) or np.any(q_lens > seq_lens):
        raise ValueError(
            f"q_lens: must lie in [0, seq_lens[b]], got {q_lens.tolist()} for seq_lens "
            f"{seq_lens.tolist()}"
        )
    if int(q_lens.sum()) != q.shape[0]:
        raise ValueError(f"q: has {q.shape[0]} tokens but sum(q_lens) = {int(q_lens.sum())}")
    n_blocks = -(-seq_lens.astype(np.int64) // block_size)  # ceil
    if np.any(n_blocks > block_tables.shape[1]):
        raise ValueError(
            f"block_tables: {block_tables.shape[1]} columns cannot hold seq_lens "
            f"{seq_lens.tolist()} with block_size {block_size}"
        )
    for b in range(batch):
        ids = block_tables[b, : n_blocks[b]]
        if np.any(ids < 0) or np.any(ids >= num_blocks):
            raise ValueError(
                f"block_tables: row {b} uses block ids {ids.tolist()} outside [0, {num_blocks})"
            )

    out_dt = _out_dtype(out_dtype, q.dtype)
    N, Hq, _ = q.shape
    Dv = v_pages.shape[3]
    out = np.zeros((N, Hq, Dv), dtype=np.float64)
    lse = np.full((N, Hq), -np.inf, dtype=np.float64)
    q64 = q.astype(np.float64)
    start = 0
    for b in range(batch):
        n_q, n_kv = int(q_lens[b]), int(seq_lens[b])
        ids = block_tables[b, : n_blocks[b]]

        def gather(pages):
            # (n, Hkv, bs, D) -> (n, bs, Hkv, D) -> (n * bs, Hkv, D): layout "bshd", 3-D
            g = pages[ids].astype(np.float64).transpose(0, 2, 1, 3)
            return g.reshape(-1, g.shape[2], g.shape[3])[:n_kv]

        out_b, lse_b = attention(
            q64[start : start + n_q], gather(k_pages), gather(v_pages),
            causal=causal, scale=scale, layout="bshd", return_lse=True, window=window,
            softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, out_dtype=np.float64,
        )
        out[start : start + n_q] = out_b
        lse[start : start + n_q] = lse_b.T  # (Hq, n_q) -> (n_q, Hq)
        start += n_q

    out = _round_to(out, out_dt)
    if not return_lse:
        return out
    return out, lse.astype(_lse_dtype(out_dt))


def scaled_dot_product_attention(query: npt.ArrayLike, key: npt.ArrayLike, value: npt.ArrayLike,
                                 attn_mask: npt.ArrayLike | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> _Array:
    """Reference twin of :func:`attnx.scaled_dot_product_attention`: torch's semantics, float64.

    ``softmax(query @ keyᵀ * scale + M) @ value`` over arrays ``(..., L, E)``, ``(..., S, E)``,
    ``(..., S, Ev)`` whose leading axes broadcast (axis -3 is the head axis for
    ``enable_gqa``, where kv head ``h // (Hq // Hkv)`` serves query head ``h``). ``attn_mask``
    is boolean (True = takes part) or additive float, broadcastable to ``(..., L, S)``.
    ``is_causal`` is **top-left** aligned (row i sees j <= i, the torch convention; attnx's
    ``causal`` is bottom-right) and combines with ``attn_mask``. ``dropout_p`` must be 0.

    Computed explicitly: the leading axes are broadcast, k and v repeated per query head, the
    top-left triangle built as a boolean mask, and :func:`attention` called on the result.
    Rows that see no key are 0 (torch 2.x on the CPU). Returns query's dtype.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p: inference only; expected 0.0, got {dropout_p!r}")
    q = _float_array(query, "query")
    k = _float_array(key, "key")
    v = _float_array(value, "value")
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{name}: expected shape (..., S, E) with rank >= 2, got {a.shape}")
    for name, a in (("key", k), ("value", v)):
        if a.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {a.dtype} differs from query's dtype {q.dtype}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key: embedding size {k.shape[-1]} differs from query's {q.shape[-1]}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"value: sequence length {v.shape[-2]} differs from key's {k.shape[-2]}")
    L, E = q.shape[-2:]
    S = k.shape[-2]
    if enable_gqa:
        for name, a in (("query", q), ("key", k), ("value", v)):
            if a.ndim < 3:
                raise ValueError(f"{name}: enable_gqa needs a head axis, got shape {a.shape}")
        hq = q.shape[-3]
        expanded = []
        for name, a in (("key", k), ("value", v)):
            if a.shape[-3] == 0 or hq % a.shape[-3]:
                raise ValueError(f"{name}: enable_gqa needs the query heads ({hq}) to be a "
                                 f"multiple of the {name} heads ({a.shape[-3]})")
            expanded.append(np.repeat(a, hq // a.shape[-3], axis=-3))
        k, v = expanded
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError as exc:
        raise ValueError("key: leading shapes of query, key and value do not broadcast") from exc
    n = int(np.prod(lead, dtype=np.int64))  # every leading index becomes one batch entry
    q = np.broadcast_to(q, lead + (L, E)).reshape(n, 1, L, E)
    k = np.broadcast_to(k, lead + (S, E)).reshape(n, 1, S, E)
    v = np.broadcast_to(v, lead + v.shape[-2:]).reshape(n, 1, S, v.shape[-1])

    visible = np.ones((L, S), dtype=bool)
    if is_causal:
        visible = np.tril(visible)  # top-left: j <= i
    additive = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype != np.bool_ and m.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"attn_mask: must be boolean or float, got dtype {m.dtype}")
        if m.ndim > len(lead) + 2:
            raise ValueError(f"attn_mask: shape {m.shape} does not broadcast to {lead + (L, S)}")
        try:
            m = np.broadcast_to(m, lead + (L, S))
        except ValueError as exc:
            raise ValueError(
                f"attn_mask: shape {m.shape} does not broadcast to {lead + (L, S)}") from exc
        if m.dtype == np.bool_:
            visible = visible & m
        else:
            additive = m
    visible = np.broadcast_to(visible, lead + (L, S)).reshape(n, 1, L, S)
    if additive is not None:
        # blocked pairs become -inf, which attention() treats as not visible
        additive = np.where(visible, additive.reshape(n, 1, L, S).astype(np.float64), -np.inf)
        mask = additive
    else:
        mask = visible
    if scale is None and E == 0:
        scale = 1.0
    out = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                    mask=mask, scale=scale, out_dtype=q.dtype)
    return out.reshape(lead + out.shape[-2:])


# --------------------------------------------------------------------------
# merging partial results (the twin of attnx.merge_attention)
# --------------------------------------------------------------------------

__all__ += ["merge_attention"]


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
    _check_layout(layout)
    outs = [_float_array(o, f"outs[{i}]") for i, o in enumerate(outs)]
    lses = [_float_array(x, f"lses[{i}]") for i, x in enumerate(lses)]
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs, lses: expected one lse per output and at least one part, got "
                         f"{len(outs)} outputs and {len(lses)} lses")
    shape = outs[0].shape
    # the output's axes, in the order of the lse's axes
    swap = layout == "bshd" and len(shape) in (3, 4)
    to_lse_order = (lambda o: np.swapaxes(o, -2, -3)) if swap else (lambda o: o)
    parts = []
    for i, (o, x) in enumerate(zip(outs, lses)):
        if o.shape != shape or to_lse_order(o).shape[:-1] != x.shape:
            raise ValueError(f"outs[{i}], lses[{i}]: shapes {o.shape} and {x.shape} do not pair "
                             f"with outs[0]'s {shape} (layout {layout!r})")
        parts.append((to_lse_order(o.astype(np.float64)), x.astype(np.float64)))
    out = np.zeros(parts[0][0].shape, np.float64)
    with np.errstate(invalid="ignore"):
        lse = parts[0][1]
        for _, x in parts[1:]:
            lse = np.logaddexp(lse, x)  # -inf with -inf stays -inf; NaN propagates
        for o, x in parts:
            contributes = x != -np.inf
            # exp(x - lse) is NaN only where lse or x is NaN (x finite or +inf otherwise)
            w = np.where(contributes, np.exp(x - np.where(lse == -np.inf, 0.0, lse)), 0.0)
            out = out + np.where(contributes[..., None], w[..., None] * o, 0.0)
    out_dt = _out_dtype(out_dtype, outs[0].dtype)
    return _round_to(to_lse_order(out), out_dt), lse.astype(_lse_dtype(out_dt))


# --------------------------------------------------------------------------
# gated delta rule (linear attention): the plain recurrence
# --------------------------------------------------------------------------

__all__ += ["gated_delta_rule"]

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
            S = (np.zeros((Hv, K, V), dtype) if args.initial_state is None
                 else np.asarray(args.initial_state[n], dtype=np.float64).astype(dtype))
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


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     layout="bshd", qk_l2norm=False, cu_seqlens=None, lengths=None, out_dtype=None):
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

    args = delta_args(q, k, v, g, beta, scale=scale, initial_state=initial_state, layout=layout,
                      cu_seqlens=cu_seqlens, lengths=lengths)
    out_dt = _out_dtype(out_dtype, args.q.dtype)
    o, states = _delta_recurrence(args, qk_l2norm=bool(qk_l2norm), dtype=np.float64)
    o = from_bshd(_round_to(o, out_dt), layout)
    if not output_final_state:
        return o
    return o, states.astype(np.float64 if out_dt == np.float64 else np.float32)

__all__ += ["quantize_kv", "dequantize_kv", "quantised_dtype", "QUANTISED_DTYPES"]
