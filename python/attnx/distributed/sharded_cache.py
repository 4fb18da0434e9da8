"""Context parallelism for the paged KV cache: :class:`ShardedPagedKVCache`, one
:class:`attnx.PagedKVCache` per rank with blocks dealt round-robin, and its decode step."""

from __future__ import annotations

import numbers

import numpy as np
import torch

from ..cache import CacheFullError, PagedKVCache, StaleStepError
from ..ops.merge import merge_attention
from ..ops.paged import paged_attention
from .collective import (
    DistributedError,
    agree,
    as_numpy,
    check_dtype,
    digest,
    gather,
    like,
    pack,
    rank_world,
)

__all__ = ["ShardedPagedKVCache", "ShardedStep"]


class ShardedPagedKVCache:
    """A paged KV cache whose sequences are spread over the ranks of a process group: one
    :class:`attnx.PagedKVCache` per rank (``local``), and a decode step that merges the ranks'
    partial results, so a context may be as long as all the ranks' pools together.

    Placement: blocks are dealt round-robin. Token ``t`` of a sequence lives on rank
    ``(t // block_size) % world``: each rank's local copy of the sequence holds its blocks in
    order (its local token ``i`` is the ``i``-th of its global positions), every rank's pages fill
    evenly, and each rank reads ``1/world`` of the context per step. A rank holds at most one
    partly filled block per sequence.

    Every rank makes the same calls in the same order with the same arguments (the new tokens'
    q, k and v included: a replicated model); each stores only its own tokens. Arguments are
    those of :class:`attnx.PagedKVCache` (no sliding window or ``value_from_key``) plus ``group``.

    Examples
    --------
    ::

        cache = ShardedPagedKVCache(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=4096)
        seq = cache.new_sequence()
        step = cache.begin_step([seq], [len(prompt)])    # then one token per step
        for layer in range(30):
            q, k, v = project(x, layer, step.positions)  # the same on every rank
            o = step.attend(layer, q, k, v)              # the exact result, on every rank
    """

    def __init__(
        self,
        num_layers,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size=16,
        dtype="float32",
        value_dim=None,
        *,
        group=None,
    ):
        self.rank, self.world = rank_world(group)
        self.group = group
        self.local = PagedKVCache(
            num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, value_dim
        )
        self.block_size = self.local.block_size
        self._lengths = {}  # sequence -> global length
        self._versions = {}  # sequence -> changes, to refuse a stale step
        self._num_q_heads = None  # agreed by the ranks at the first attend

    def owner(self, positions):
        """The rank that stores each global token position."""
        return (np.asarray(positions, np.int64) // self.block_size) % self.world

    def local_length(self, length, rank=None):
        """How many of a sequence's first ``length`` tokens rank ``rank`` (default this one) holds."""
        rank = self.rank if rank is None else rank
        bs, lap = self.block_size, self.block_size * self.world
        length = np.asarray(length, np.int64)
        return length // lap * bs + np.clip(length % lap - rank * bs, 0, bs)

    def new_sequence(self):
        seq = self.local.new_sequence()
        self._lengths[seq], self._versions[seq] = 0, 0
        return seq

    def fork(self, seq):
        """A new sequence sharing ``seq``'s blocks on every rank (copy-on-write, as
        :meth:`attnx.PagedKVCache.fork`)."""
        child = self.local.fork(seq)
        self._lengths[child], self._versions[child] = self._lengths[seq], 0
        return child

    def truncate(self, seq, length):
        """Keep the first ``length`` tokens (global) of ``seq``."""
        n = self.length(seq)
        if (
            isinstance(length, bool)
            or not isinstance(length, numbers.Integral)
            or not 0 <= length <= n
        ):
            raise ValueError(f"length: expected an int in [0, {n}], got {length!r}")
        self.local.truncate(seq, int(self.local_length(length)))
        self._lengths[seq] = int(length)
        self._versions[seq] += 1

    def free(self, seq):
        self.local.free(seq)
        del self._lengths[seq], self._versions[seq]

    def length(self, seq):
        """Tokens in ``seq`` over all ranks."""
        self.local.length(seq)  # the local cache's error for an unknown id
        return self._lengths[seq]

    def stats(self):
        """This rank's pool figures (:meth:`attnx.PagedKVCache.stats`), with ``rank`` and ``world``."""
        return dict(self.local.stats(), rank=self.rank, world=self.world)

    def begin_step(self, seq_ids, num_new_tokens):
        """Reserve the new tokens' slots on the ranks that store them, all or none on every rank.

        Raises :class:`attnx.CacheFullError` on every rank (and changes nothing) if any rank's
        pool cannot hold its share. Returns a :class:`ShardedStep`.
        """
        what = "ShardedPagedKVCache.begin_step"
        ids, counts = list(seq_ids), list(num_new_tokens)
        error, step, starts = None, None, None
        try:
            if len(ids) != len(counts):
                raise ValueError(
                    f"num_new_tokens: expected {len(ids)} counts (one per sequence), got {len(counts)}"
                )
            for n in counts:
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                    raise ValueError(f"num_new_tokens: expected ints >= 0, got {counts!r}")
            starts = np.array([self.length(s) for s in ids], np.int64)
            ends = starts + np.asarray(counts, np.int64)
            step = self.local.begin_step(
                ids, (self.local_length(ends) - self.local_length(starts)).tolist()
            )
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
        try:
            agree(
                what,
                error,
                [digest(np.array(ids + counts, np.int64))],
                ["sequences and counts"],
                self.group,
                self.world,
            )
        except DistributedError as exc:
            if step is not None:  # another rank failed: undo this rank's reservation
                for s, a in zip(ids, starts):
                    self.local.truncate(s, int(self.local_length(a)))
            if exc.failures and all(t == "CacheFullError" for t, _ in exc.failures.values()):
                raise CacheFullError(str(exc)) from exc
            raise
        for s, n in zip(ids, counts):
            self._lengths[s] += int(n)
            self._versions[s] += 1
        return ShardedStep(self, ids, starts, np.asarray(counts, np.int64), step)


class ShardedStep:
    """One step of a :class:`ShardedPagedKVCache`: the new tokens, packed in sequence order.

    Attributes (global, the same on every rank): ``seq_ids``, ``q_lens``, ``seq_lens``,
    ``positions`` (of every new token, for RoPE), ``num_tokens``.
    """

    def __init__(self, cache, ids, starts, counts, local_step):
        self._cache, self._local = cache, local_step
        self.seq_ids = ids
        self.q_lens = counts.astype(np.int32)
        self.seq_lens = (starts + counts).astype(np.int32)
        self.num_tokens = int(counts.sum())
        seq_index = np.repeat(np.arange(len(ids)), counts)
        self.positions = (
            np.arange(self.num_tokens)
            - np.repeat(np.cumsum(counts) - counts, counts)
            + starts[seq_index]
        ).astype(np.int32)
        self._versions = [cache._versions[s] for s in ids]
        self._mine = cache.owner(self.positions) == cache.rank
        # a token stored elsewhere sees this rank's tokens before it: a prefix of the local copy
        self._seen = cache.local_length(self.positions).astype(np.int32)
        self._seq_index = seq_index
        tables = [cache.local.block_table(s) for s in ids]
        self._tables = np.zeros((len(ids), max([len(t) for t in tables] + [1])), np.int32)
        for row, t in zip(self._tables, tables):
            row[: len(t)] = t

    def attend(self, layer, q, k, v, *, scale=None, return_lse=False):
        """Store this rank's share of the new keys and values of layer ``layer`` and return the
        exact attention of every new query over its whole sequence, on every rank.

        ``q (T, Hq, head_dim)``, ``k (T, num_kv_heads, head_dim)``, ``v (T, num_kv_heads,
        value_dim)``: all the step's new tokens, the same on every rank. Each new query sees
        its sequence's tokens up to itself (causal). Returns ``(T, Hq, value_dim)`` of q's dtype
        (and lse ``(T, Hq)``); tensors if ``q`` is.

        Cost: one all-gather of every rank's partial, ``T·Hq·(value_dim + 1)·4`` bytes sent per
        rank; the pages never move.
        """
        cache = self._cache
        what = "ShardedStep.attend"
        as_torch = isinstance(q, torch.Tensor)
        hq = self._agree_heads(q)
        T, Dv = self.num_tokens, cache.local.value_dim
        n_out = T * hq * Dv
        buf = torch.zeros(1 + n_out + T * hq, dtype=torch.float32)
        error, dtype = None, None
        try:
            q, k, v = as_numpy(q, "q"), as_numpy(k, "k"), as_numpy(v, "v")
            self._check(q, k, v, hq)
            dtype = q.dtype
            pack(buf.numpy()[1:], self._partial(layer, q, k, v, scale), n_out)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
        table = gather(what, buf, error, cache.group, cache.world)
        out, lse = merge_attention(
            [row[1 : 1 + n_out].reshape(T, hq, Dv) for row in table],
            [row[1 + n_out :].reshape(T, hq) for row in table],
        )
        out = like(out.astype(dtype, copy=False), as_torch)
        return (out, like(lse, as_torch)) if return_lse else out

    def _agree_heads(self, q):
        """The query heads, agreed by all ranks once per cache: every later exchange's size
        follows from it (a size mismatch would abort gloo, not raise)."""
        cache = self._cache
        if cache._num_q_heads is None:
            error, hq = None, None
            try:
                shape = as_numpy(q, "q").shape
                if len(shape) != 3:
                    raise ValueError(f"q: expected shape (T, Hq, head_dim), got {shape}")
                hq = shape[1]
            except Exception as exc:  # noqa: BLE001
                error = exc
            table = agree(
                "ShardedStep.attend", error, [hq], ["query heads"], cache.group, cache.world
            )
            cache._num_q_heads = int(table[0, 0])
        return cache._num_q_heads

    def _check(self, q, k, v, hq):
        cache, T = self._cache.local, self.num_tokens
        for name, x, want in (
            ("q", q, (T, hq, cache.head_dim)),
            ("k", k, (T, cache.num_kv_heads, cache.head_dim)),
            ("v", v, (T, cache.num_kv_heads, cache.value_dim)),
        ):
            if x.shape != want:
                raise ValueError(
                    f"{name}: expected shape {want} (this step's tokens), got {x.shape}"
                )
        check_dtype(q, "q")
        if any(self._cache._versions.get(s) != ver for s, ver in zip(self.seq_ids, self._versions)):
            raise StaleStepError(
                "attend: a sequence of this step was truncated, freed or stepped "
                "again since begin_step"
            )

    def _partial(self, layer, q, k, v, scale):
        """This rank's float32 partial over its own tokens: the queries of the tokens it stores
        through its local step (which writes their k and v first), the others through
        ``paged_attention`` over the prefix of its tokens that precede them."""

        cache = self._cache.local
        T, hq = q.shape[:2]
        q32 = q.astype(np.float32, copy=False)  # partials in float32; rounded once, after the merge
        out = np.zeros((T, hq, cache.value_dim), np.float32)
        lse = np.full((T, hq), -np.inf, np.float32)
        mine = self._mine
        if mine.any():
            out[mine], lse[mine] = self._local.attend(
                layer, q32[mine], k[mine], v[mine], scale=scale, return_lse=True
            )
        rest = ~mine & (self._seen > 0)
        if rest.any():
            out[rest], lse[rest] = paged_attention(
                q32[rest],
                cache.k_pages(layer),
                cache.v_pages(layer),
                self._tables[self._seq_index[rest]],
                self._seen[rest],
                q_lens=np.ones(int(rest.sum()), np.int32),
                causal=True,
                scale=scale,
                return_lse=True,
            )
        return out, lse
