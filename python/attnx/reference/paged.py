"""The paged attention oracle: :func:`paged_attention`, attention over pages of a block pool
(gathered into contiguous K/V per sequence, then :func:`attnx.reference.attention`).

:func:`paged_attention`: Sequence b owns the kv slots ``0 .. seq_lens[b]-1``; slot t lives in block
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
k_scales, v_scales : float32 array_like, (num_blocks, Hkv, block_size), or float, optional
    With pages of a quantised dtype (int8, float8_e4m3fn, float8_e5m2), and only then:
    each row's scale; attention is over ``dequantize_kv(pages, scales)``. For fp8 pages, a
    real number is the scale of every row (:func:`attnx.quant.fixed_scale`).
int8_query : bool
    With int8 pages: the twin of the kernels' integer queries (``attnx.set_int8_query``).
    Each query row times ``scale`` (a float32 product) is quantised as the keys are
    (:func:`quantize_query`), so each score is ``(q_q · k_q) * s_q * s_k``.
bf16_products : bool
    The twin of bf16 products, as in :func:`attention` (float32 q and pages under
    ``attnx.set_float32_precision("bf16")``): q, k, v and P rounded to bfloat16.

Returns
-------
out : ndarray, (N, Hq, Dv), dtype ``out_dtype`` or q's dtype
lse : ndarray, (N, Hq), only if ``return_lse``
    float32, or float64 when the output dtype is float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..quant import dequantised_pages as _dequantised_pages
from ..quant import float_array as _float_array
from ..quant import quantize_query
from .attention import Array, Result, Window, attention, lse_dtype, output_dtype, round_to

__all__ = ["paged_attention"]


def paged_attention(
    q: npt.ArrayLike,
    k_pages: npt.ArrayLike,
    v_pages: npt.ArrayLike,
    block_tables: npt.ArrayLike,
    seq_lens: npt.ArrayLike,
    *,
    q_lens: npt.ArrayLike | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    window: Window = None,
    softcap: float | None = None,
    sinks: npt.ArrayLike | None = None,
    alibi_slopes: npt.ArrayLike | None = None,
    out_dtype: npt.DTypeLike | None = None,
    k_scales: npt.ArrayLike | float | None = None,
    v_scales: npt.ArrayLike | float | None = None,
    int8_query: bool = False,
    bf16_products: bool = False,
) -> Result:
    """Attention over a paged KV cache (decode and chunked prefill).
    (Parameters, results and an example: :mod:`attnx.reference.paged`.)"""
    if int8_query and np.asarray(k_pages).dtype == np.int8 and k_scales is not None:
        q, scale = quantize_query(q, scale), 1.0
    k_pages, v_pages = _dequantised_pages(k_pages, v_pages, k_scales, v_scales)
    q, k_pages, v_pages = _arrays(q, k_pages, v_pages)
    block_tables, seq_lens, q_lens, n_blocks = _tables(
        block_tables, seq_lens, q_lens, q.shape[0], k_pages.shape[0], k_pages.shape[2]
    )
    out_dt = output_dtype(out_dtype, q.dtype)
    N, Hq, _ = q.shape
    Dv = v_pages.shape[3]
    out = np.zeros((N, Hq, Dv), dtype=np.float64)
    lse = np.full((N, Hq), -np.inf, dtype=np.float64)
    q64 = q.astype(np.float64)
    kw = dict(
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        bf16_products=bf16_products,
    )
    _per_sequence(q64, k_pages, v_pages, block_tables, seq_lens, q_lens, n_blocks, out, lse, kw)
    out = round_to(out, out_dt)
    if not return_lse:
        return out
    return out, lse.astype(lse_dtype(out_dt))


def _arrays(q: Any, k_pages: Any, v_pages: Any) -> tuple[Array, Array, Array]:
    """q ``(N, Hq, Dk)`` and the float pages ``(num_blocks, Hkv, block_size, D)``, checked."""
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
    if k_pages.shape[2] == 0:
        raise ValueError("k_pages: block_size is 0")
    return q, k_pages, v_pages


def _tables(
    block_tables: Any, seq_lens: Any, q_lens: Any, n_tokens: int, num_blocks: int, block_size: int
) -> tuple[Array, Array, Array, Array]:
    """``(block_tables, seq_lens, q_lens, n_blocks)`` checked against each other, the pool and
    the ``n_tokens`` queries; ``n_blocks`` the blocks each sequence's keys fill."""
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
    if int(q_lens.sum()) != n_tokens:
        raise ValueError(f"q: has {n_tokens} tokens but sum(q_lens) = {int(q_lens.sum())}")
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
    return block_tables, seq_lens, q_lens, n_blocks


def _per_sequence(q64, k_pages, v_pages, block_tables, seq_lens, q_lens, n_blocks, out, lse, kw):
    """Each sequence's queries against its gathered keys and values, written into ``out`` and
    ``lse`` (float64)."""
    start = 0
    for b in range(len(block_tables)):
        n_q, n_kv = int(q_lens[b]), int(seq_lens[b])
        ids = block_tables[b, : n_blocks[b]]

        def gather(pages):
            # (n, Hkv, bs, D) -> (n, bs, Hkv, D) -> (n * bs, Hkv, D): layout "bshd", 3-D
            g = pages[ids].astype(np.float64).transpose(0, 2, 1, 3)
            return g.reshape(g.shape[0] * g.shape[1], g.shape[2], g.shape[3])[:n_kv]

        out_b, lse_b = attention(
            q64[start : start + n_q],
            gather(k_pages),
            gather(v_pages),
            layout="bshd",
            return_lse=True,
            out_dtype=np.float64,
            **kw,
        )
        out[start : start + n_q] = out_b
        lse[start : start + n_q] = lse_b.T  # (Hq, n_q) -> (n_q, Hq)
        start += n_q
