"""Attention of one block of query rows against one block of keys, masked as the blocks' rows
and keys see each other in attention over the whole sequence.

Context parallelism (``attnx.distributed``) computes a partial result per (query block, key
block) pair and merges them by log-sum-exp; this module turns a pair's global positions into
``attnx.attention``'s own arguments (``causal``, ``window``, ``kv_lens``) so that no
``(Sq, Sk)`` mask is built, except in the one case those cannot express (noted below). NumPy
only: it needs no process group, so it is tested on its own.
"""

from __future__ import annotations

import numpy as np

from ..ops import attention as _api

__all__ = ["segment_attention", "segment_visibility"]


def segment_visibility(*, nq, nk, q_start, k_start, q_total, key_lens, causal):
    """How the pair's rows see its keys, per batch row ``b``: ``(K, r)`` such that local row ``i``
    sees local key ``j`` iff ``j < K[b]`` and ``j <= i + K[b] - nq + r[b]``, with ``0 <= r <=
    nq - 1`` (``r = nq - 1``: all ``K[b]`` keys; ``r = 0``: attnx's bottom-right causal).

    In the whole (``q_total`` query rows, ``key_lens[b]`` valid keys, bottom-right causal), row
    ``q_start + i`` sees key ``k_start + j`` iff ``k_start + j < key_lens[b]`` and, if causal,
    ``k_start + j <= q_start + i + key_lens[b] - q_total``.
    """
    key_lens = np.asarray(key_lens, np.int64)
    valid = np.clip(key_lens - k_start, 0, nk)  # L: the block's keys below key_lens
    if not causal or nq == 0:
        return valid, np.full_like(valid, max(nq - 1, 0))
    # local row i sees local key j <= i + reach - nq (and j < valid)
    reach = q_start - k_start + key_lens - q_total + nq
    # reach < L: the causal limit cuts below the valid keys: K = reach keys under plain causal
    # (j <= i + K - nq already keeps j < K). Otherwise all L keys with a right window reach - L.
    cut = reach < valid
    K = np.where(cut, np.maximum(reach, 0), valid)
    r = np.where(cut, 0, np.minimum(reach - valid, nq - 1))
    return K, r


def segment_attention(q4, k4, v4, *, q_start, k_start, q_total, key_lens, causal, scale):
    """``(out, lse)`` of query rows ``q_start .. q_start + nq`` of a ``q_total``-row query
    against keys at positions ``k_start .. k_start + nk``, as ``attnx.attention`` over the whole
    would mask them (see :func:`segment_visibility`); ``None`` when no row sees any key.

    ``q4 (B, Hq, nq, Dk)``, ``k4 (B, Hkv, nk, Dk)``, ``v4 (B, Hkv, nk, Dv)`` in bhsd order;
    ``key_lens (B,)`` the valid key lengths of the whole.
    """
    B, _, nq, _ = q4.shape
    nk = k4.shape[2]
    K, r = segment_visibility(
        nq=nq,
        nk=nk,
        q_start=q_start,
        k_start=k_start,
        q_total=q_total,
        key_lens=key_lens,
        causal=causal,
    )
    if nq == 0 or not K.any():
        return None
    kw = {"kv_lens": K.astype(np.int64)}
    if (r == r[0]).all():
        # one window for the batch: full (r = nq-1), causal (r = 0) or a right window
        r0 = int(r[0])
        if r0 == 0 and nq > 1:
            kw["causal"] = True
        elif r0 < nq - 1:
            kw["window"] = (None, r0)
    else:
        # Rows of the batch need different right windows (causal attention with per-batch
        # kv_lens, where a block ends within nq keys of some batch's valid end): the one case
        # that takes a boolean (B, 1, nq, nk) mask.
        i = np.arange(nq)[None, :, None]
        j = np.arange(nk)[None, None, :]
        kw["mask"] = (j <= i + (K - nq + r)[:, None, None])[:, None]
    return _api.attention(q4, k4, v4, scale=scale, return_lse=True, **kw)
