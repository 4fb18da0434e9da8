"""Paged attention: :func:`paged_attention`, attention of packed queries against KV stored in pages of a block pool, read in place.

Parameters
----------
q : ndarray ``(N, Hq, Dk)``
    The new query tokens of all sequences, packed in sequence order: ``N = sum(q_lens)``
    (``N = B`` when ``q_lens`` is None: one decode token per sequence).
k_pages : ndarray ``(num_blocks, Hkv, block_size, Dk)``
v_pages : ndarray ``(num_blocks, Hkv, block_size, Dv)``
    The pools (one layer). float32, float16 or bfloat16; q may have another dtype. Or
    quantised, int8, float8_e4m3fn or float8_e5m2, with their scales.
block_tables : int array ``(B, max_blocks)``
    Sequence ``b``'s kv token ``t`` lives in block ``block_tables[b, t // block_size]`` at
    slot ``t % block_size``. Entries past a sequence's last block are not read.
seq_lens : int array ``(B,)``
    Tokens held by each sequence, including its new ones.
q_lens : int array ``(B,)``, optional
    New query tokens per sequence: they are its last ``q_lens[b]`` positions.
causal : bool
    Bottom-right aligned, as in :func:`attnx.attention` (default True).
scale, return_lse, out, num_threads, window, softcap, sinks, alibi_slopes : optional
    As in :func:`attnx.attention`; lse has shape ``(N, Hq)``.
shared_prefix : bool
    Sequences whose tables start with the same block ids (forks, prefix-cache hits) read
    those blocks once for all their queries, merged with each one's own tail by log-sum-exp
    (default True; used where it saves enough reads, and not with ``window``, ``sinks`` or
    ``alibi_slopes``). False reads every sequence's blocks on their own.
k_scales, v_scales : float32 ndarray ``(num_blocks, Hkv, block_size)``, or float, optional
    With quantised pages, and only then: row ``(block, head, slot)`` reads as its codes
    times its scale (:func:`attnx.reference.dequantize_kv`), converted as the kernel loads
    it (never a dequantised copy of a page). For fp8 pages, one real number is the scale of
    every row (a per-tensor scale, as vLLM's ``fp8`` caches keep; :mod:`attnx.quant`).

Returns
-------
out : ndarray ``(N, Hq, Dv)`` of q's dtype (and lse).

Examples
--------
>>> import numpy as np, attnx
>>> kp = np.zeros((4, 1, 16, 8), np.float32); vp = np.ones((4, 1, 16, 8), np.float32)
>>> q = np.ones((1, 2, 8), np.float32)
>>> attnx.paged_attention(q, kp, vp, np.array([[2, 0]]), np.array([20]))[0, 0, :3]
array([1., 1., 1.], dtype=float32)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _core
from .._validate import as_array, kernel_array, optional_real, threads, window_sides
from ..integrations import tensors as _tensors
from . import cascade as _shared
from .attention import ArrayLike, IntsLike, Result, Window

__all__ = ["paged_attention", "paged_step", "step_call"]


@_tensors.tensor_io(torch_op="paged_attention")
def paged_attention(
    q: ArrayLike,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_tables: IntsLike,
    seq_lens: IntsLike,
    *,
    q_lens: IntsLike | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
    window: Window | None = None,
    softcap: float | None = None,
    sinks: ArrayLike | None = None,
    alibi_slopes: ArrayLike | None = None,
    shared_prefix: bool = True,
    k_scales: np.ndarray | float | None = None,
    v_scales: np.ndarray | float | None = None,
) -> Result:
    """Attention of packed queries against KV stored in pages of a block pool, read in place.
    Parameters, results and an example: :mod:`attnx.ops.paged`."""
    q = kernel_array(as_array(q, "q"))
    if q.ndim != 3:
        raise ValueError(f"q: expected shape (N, Hq, Dk), got {q.shape}")
    k_pages = kernel_array(as_array(k_pages, "k_pages"))
    v_pages = kernel_array(as_array(v_pages, "v_pages"))
    block_tables = as_array(block_tables, "block_tables")
    min_shared = None
    if shared_prefix and window is None and sinks is None and alibi_slopes is None:
        min_shared = _shared.MIN_SAVED_KEYS  # the core plans the groups (attnx.ops.cascade)
    return _core.paged_attention(
        q,
        k_pages,
        v_pages,
        block_tables,
        seq_lens,
        q_lens=q_lens,
        causal=causal,
        scale=optional_real(scale, "scale"),
        out=out,
        return_lse=return_lse,
        num_threads=threads(num_threads),
        window=window_sides(window),
        softcap=optional_real(softcap, "softcap"),
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_scales=_scales(k_scales, "k_scales"),
        v_scales=_scales(v_scales, "v_scales"),
        min_shared_keys=min_shared,
    )


def _scales(x: np.ndarray | float | None, name: str) -> np.ndarray | float | None:
    """Scale pages as an array, one real scale as it is (the binding checks both), or None."""
    return x if x is None or np.ndim(x) == 0 else as_array(x, name)


def paged_step(
    q: object,
    k: object,
    v: object,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    q_lens: np.ndarray,
    slots: np.ndarray,
    *,
    values_from_keys: bool = False,
    max_left: int | None = None,
    scale: float | None = None,
    num_threads: int | None = None,
    return_lse: bool = False,
    window: Any = None,
    softcap: float | None = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    k_scales: np.ndarray | None = None,
    v_scales: np.ndarray | None = None,
) -> Result:
    """One step of a paged KV cache (:meth:`attnx.Step.attend`): writes the new keys and values
    into their slots, then attends causally from the new queries to their whole sequences.

    Parameters
    ----------
    q : ndarray ``(T, Hq, Dk)``, the new queries packed in sequence order
    k : ndarray ``(T, Hkv, Dk)``; v : ndarray ``(T, Hkv, Dv)``, or None with ``values_from_keys``
        The new keys and values, converted to the pages' dtype as they are written.
    k_pages, v_pages, block_tables, seq_lens, q_lens
        As in :func:`paged_attention`; ``seq_lens`` count the new tokens.
    slots : int64 ``(T,)``
        Where each new token goes: ``block * block_size + offset``.
    values_from_keys : bool
        ``v_pages`` is a view of ``k_pages`` (latent attention): only the keys are written, and
        ``v`` must be None.
    max_left : int, optional
        The pages keep only each sequence's last ``max_left + 1`` keys (a sliding window):
        ``window`` defaults to ``(max_left, None)`` and may not reach further left.
    scale, num_threads, return_lse, window, softcap, sinks, alibi_slopes
        As in :func:`attention`.
    k_scales, v_scales : float32 ``(num_blocks, Hkv, block_size)``, optional
        The scale pages of quantised pages: each new row is quantised and its scale stored.

    Returns
    -------
    out : ndarray ``(T, Hq, Dv)`` of q's dtype (and lse ``(T, Hq)``). Every argument is checked
    before the first write.
    """
    pages = [(k_pages, v_pages, k_scales, v_scales)]
    plan = _core.StepPlan(pages, block_tables, seq_lens, q_lens, slots, values_from_keys, max_left)
    # step_call's options in its order; shared_prefix False: this plan groups no sequences
    options = (scale, num_threads, return_lse, window, softcap, sinks, alibi_slopes, False)
    return step_call(plan, 0, q, k, v, *options)


def step_call(
    step_plan,
    layer,
    q,
    k,
    v,
    scale=None,
    num_threads=None,
    return_lse=False,
    window=None,
    softcap=None,
    sinks=None,
    alibi_slopes=None,
    shared_prefix=True,
):
    """One layer of a cache step through its ``_core.StepPlan``: the Python-side conversions
    (window sides, thread counts) where given, then one binding call that checks the rest.
    ``attnx.Step`` calls it once per model layer, so the common case takes no Python step. With
    ``shared_prefix``, the plan's shared-prefix groups (if any) are read once for all their
    sequences (:mod:`attnx.ops.cascade`; the core falls back where the variants do not allow it)."""
    if window is not None:
        window = window_sides(window)
    if num_threads is not None:
        num_threads = threads(num_threads)
    return step_plan.attend(
        layer,
        q,
        k,
        v,
        scale,
        softcap,
        window,
        sinks,
        alibi_slopes,
        num_threads,
        return_lse,
        shared_prefix,
    )
