"""The quantised KV format: int8 / fp8 pages and their per-row scales (the one definition: the
cache stores it, the kernels read it, :mod:`attnx.reference` re-exports it).

Each (token, kv head) row x of K and of V (its last axis, D features) is stored as D 1-byte
codes x_q and one float32 scale s, so that it reads back as x_q * s. Everything is computed in
float32 (x is first rounded to float32, as the cache's step does):

  int8:  s = max|x| / 127,       x_q = clip(round_half_even(x / s), -127, 127)
  fp8:   s = max|x| / finfo.max, x_q = cast_rne(clip(x / s, -finfo.max, finfo.max))

with float32 division. Edge cases, decided here once:
  - s == 0 (an all-zero row, or one so small that max|x| / qmax underflows to 0): x_q = 0 and
    s = 0, so the row reads back as zeros.
  - a row holding NaN or +-inf: s = NaN and x_q = 0, so the whole row reads back as NaN and
    attention propagates it to the query rows that see the key (as a NaN key or value would).
    An infinite input has no finite symmetric scale, hence NaN rather than inf.
  - fp8: x / s is clipped to +-finfo.max before the cast. With a normal s it never exceeds it
    by more than an ulp, which rounds back to finfo.max; the clip matters only when s is
    subnormal and inexact, where a plain cast would overflow to NaN (e4m3fn has no inf).
Reading back, x_q * s is a float32 product (exact for int8 codes and fp8 values times a
float32 scale up to one rounding), which is what the kernels compute.

One scale for every row (a per-tensor scale, as vLLM's ``fp8`` caches keep one per layer): fp8
pages only, with a given positive finite float32 s, and nothing stored per row:

  fp8, fixed s:  x_q = cast_rne(clip(x / s, -finfo.max, finfo.max)) where x is finite,
                 NaN (the code 0x7f for e4m3fn, 0x7e for e5m2) where it is not,

so values beyond s * finfo.max saturate (the scale's choice is the caller's), and a NaN or
infinite input reads back as NaN where it was, as a NaN key or value would. int8 has no NaN
code, so it takes no fixed scale.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

_BFLOAT16: np.dtype[Any] | None
try:  # bfloat16 and fp8 need ml_dtypes (a declared dependency); the rest works without it
    import ml_dtypes as _ml_dtypes

    _BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BFLOAT16 = None

__all__ = [
    "BFLOAT16",
    "FLOAT_DTYPES",
    "QUANTISED_DTYPES",
    "dequantised_pages",
    "dequantize_kv",
    "fixed_scale",
    "float_array",
    "quantised_dtype",
    "quantised_max",
    "quantize_kv",
    "quantize_query",
]

BFLOAT16 = _BFLOAT16  # ml_dtypes' bfloat16, or None without ml_dtypes
FLOAT_DTYPES = tuple(  # the float dtypes attnx and its reference read
    d
    for d in (np.dtype(np.float16), _BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
    if d is not None
)


def float_array(x: npt.ArrayLike, name: str) -> npt.NDArray[Any]:
    """Return ``x`` as an ndarray of a supported floating dtype, else TypeError."""
    a = np.asarray(x)
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: dtype {a.dtype} is not supported; expected float16, bfloat16, "
            "float32 or float64"
        )
    return a


QUANTISED_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")


def quantised_dtype(dtype):
    """The NumPy dtype of a quantised KV storage type given by name or dtype
    (``"int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``), or None if ``dtype`` is not one."""
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        return None
    if name == "int8":
        return np.dtype(np.int8)
    if name in QUANTISED_DTYPES and _ml_dtypes is not None:
        return np.dtype(getattr(_ml_dtypes, name))
    return None


def _quantised_or_raise(dtype):
    dt = quantised_dtype(dtype)
    if dt is None:
        raise TypeError(f"dtype: expected one of {QUANTISED_DTYPES}, got {dtype!r}")
    return dt


def quantised_max(dtype):
    """The largest code magnitude of a quantised dtype, float32: 127 for int8, finfo.max for fp8."""
    dt = _quantised_or_raise(dtype)
    return np.float32(127.0 if dt == np.int8 else float(_ml_dtypes.finfo(dt).max))


def quantize_query(q, scale=None):
    """The integer query of int8 KV: each row of ``q`` (..., Dk) times ``scale`` (default
    1/sqrt(Dk)), a float32 product, quantised as the keys are (:func:`quantize_kv`, int8), and
    read back as ``q_q * s_q`` in float64: attention over it with scale 1 gives the scores
    ``(q_q · k_q) * s_q * s_k``."""
    q32 = float_array(q, "q").astype(np.float32)
    sc = np.float32(1.0 / np.sqrt(q32.shape[-1]) if scale is None else scale)
    with np.errstate(over="ignore", invalid="ignore"):
        q_q, s_q = quantize_kv(q32 * sc, "int8")
    return q_q.astype(np.float64) * s_q.astype(np.float64)[..., None]


def quantize_kv(x, dtype, scale=None):
    """Quantises each row (last axis) of ``x`` to ``dtype`` with its own float32 scale, or with
    one given ``scale`` for every row (fp8 only).

    Parameters
    ----------
    x : array_like of float, ``(..., D)``
    dtype : ``"int8"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``
    scale : float, optional
        One scale for every row (:func:`fixed_scale` checks it); default: each row's own.

    Returns
    -------
    x_q : ndarray ``(..., D)`` of ``dtype``
    scales : float32 ndarray ``(...)``
        See the definition above: ``dequantize_kv(x_q, scales)`` reads the rows back. With
        ``scale``, every entry is it.

    Examples
    --------
    >>> x_q, s = quantize_kv([[1.0, -2.0, 0.5]], "int8")
    >>> x_q.tolist(), s.tolist()
    ([[64, -127, 32]], [0.015748031437397003])
    """
    dt = _quantised_or_raise(dtype)
    qmax = quantised_max(dt)
    x32 = float_array(x, "x").astype(np.float32)
    if x32.ndim == 0:
        raise ValueError("x: expected at least one axis (the row's features)")
    if scale is not None:
        s1 = fixed_scale(scale, dt, "scale")
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.clip(x32 / s1, -qmax, qmax)
        x_q = np.where(np.isfinite(x32), r, np.float32(np.nan)).astype(dt)
        return x_q, np.full(x32.shape[:-1], s1, np.float32)
    finite = np.isfinite(x32).all(axis=-1)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        s = (np.max(np.abs(x32), axis=-1, initial=np.float32(0)) / qmax).astype(np.float32)
        use = finite & (s > 0)
        r = np.where(
            use[..., None], x32 / np.where(use, s, np.float32(1))[..., None], np.float32(0)
        )
    r = np.clip(r, -qmax, qmax)
    x_q = np.rint(r).astype(np.int8) if dt == np.int8 else r.astype(dt)
    s = np.where(finite, np.where(use, s, np.float32(0)), np.float32(np.nan)).astype(np.float32)
    return x_q, s


def fixed_scale(scale, dtype, name):
    """``scale`` as the one float32 scale of every row of ``dtype`` pages, else TypeError (not a
    real number, or pages that are not fp8) or ValueError (outside float32's normal range)."""
    dt = _quantised_or_raise(dtype)
    if dt == np.int8:
        raise TypeError(
            f"{name}: one scale for every row is for float8 pages (int8 codes have no NaN for "
            "an input that is not finite); pass float32 scale pages (num_blocks, Hkv, block_size)"
        )
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
        raise TypeError(f"{name}: expected a real number, got {type(scale).__name__}")
    f32 = np.finfo(np.float32)
    if not float(f32.tiny) <= float(scale) <= float(f32.max):  # the binding's rule for scales
        raise ValueError(
            f"{name}: expected a finite positive number within float32's normal range "
            f"[{float(f32.tiny)}, {float(f32.max)}], got {scale!r}"
        )
    return np.float32(scale)


def dequantize_kv(x_q, scales):
    """Rows of codes ``x_q (..., D)`` times their scales ``(...)``, as float32 (``x_q * s``)."""
    x_q = np.asarray(x_q)
    _quantised_or_raise(x_q.dtype)
    s = np.asarray(scales)
    if s.dtype != np.float32:
        raise TypeError(f"scales: expected float32, got dtype {s.dtype}")
    if s.shape != x_q.shape[:-1]:
        raise ValueError(
            f"scales: expected shape {x_q.shape[:-1]} (one per row of x_q), got {s.shape}"
        )
    return x_q.astype(np.float32) * s[..., None]


def dequantised_pages(k_pages, v_pages, k_scales, v_scales):
    """The pages :func:`paged_attention` attends over: quantised pages with their scales read
    back as float32, float pages as they are. Scales go with quantised pages and only with them;
    a real number is one scale for every row (:func:`fixed_scale`)."""
    pages = []
    for name, p, s in (("k", k_pages, k_scales), ("v", v_pages, v_scales)):
        p = np.asarray(p)
        quantised = quantised_dtype(p.dtype) is not None
        if quantised != (s is not None):
            raise TypeError(
                f"{name}_scales: expected with {name}_pages of a quantised dtype "
                f"{QUANTISED_DTYPES} and only with them (pages are {p.dtype})"
            )
        if quantised and np.ndim(s) == 0:
            s = np.full(p.shape[:-1], fixed_scale(s, p.dtype, f"{name}_scales"), np.float32)
        pages.append(dequantize_kv(p, s) if quantised else p)
    return pages
