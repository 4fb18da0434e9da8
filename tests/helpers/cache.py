"""A client's conversation with a shared PagedKVCache (the thread tests run several at once and
compare them with the same conversations run one after another)."""

from __future__ import annotations

import numpy as np


def cache_stepper(cache, rng, outs, *, num_heads=4, num_threads=None, return_lse=False):
    """``step(seqs, counts)``: one ``begin_step`` giving each of ``seqs`` its ``counts`` new
    tokens, attended on every layer with standard normal float32 q (``num_heads`` heads), k and v
    drawn from ``rng``; each layer's output (and its lse, with ``return_lse``) goes to ``outs``."""

    def step(seqs, counts):
        st = cache.begin_step(seqs, counts)
        T = int(sum(counts))
        for layer in range(cache.num_layers):
            q = rng.standard_normal((T, num_heads, cache.head_dim)).astype(np.float32)
            k = rng.standard_normal((T, cache.num_kv_heads, cache.head_dim)).astype(np.float32)
            v = rng.standard_normal((T, cache.num_kv_heads, cache.value_dim)).astype(np.float32)
            res = st.attend(layer, q, k, v, num_threads=num_threads, return_lse=return_lse)
            outs.extend(res if return_lse else [res])

    return step


def finish_client(cache, outs, *seqs):
    """The end of a conversation: the final lengths of ``seqs`` go to ``outs``, then they are
    freed in that order. Returns ``outs``."""
    outs.append(np.array([cache.length(s) for s in seqs]))
    for s in seqs:
        cache.free(s)
    return outs


def bits(a):
    """``a``'s bits as unsigned integers of its width: NaN payloads and signed zeros compare as
    they are stored."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def cache_state(c):
    """What a PagedKVCache holds, comparable with ``==``: free list, reference counts, cached
    blocks, next id, stats, each sequence's length and table, then the K and V pages' bits."""
    return (
        c._free_ids(),
        c._refs.tolist(),
        c._alloc.cached(),
        c._next_id,
        c.stats(),
        {s: (c.length(s), c.block_table(s).tolist()) for s in c.sequences},
        bits(c._k).tobytes(),
        None if c._v is None else bits(c._v).tobytes(),
    )
