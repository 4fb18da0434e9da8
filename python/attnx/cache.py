"""PagedKVCache: keys and values of many sequences in one pool of fixed-size blocks.

Memory is a pool of ``num_blocks`` pages of ``block_size`` token slots, for every layer at once:
``K[layer]`` has shape ``(num_blocks, num_kv_heads, block_size, head_dim)`` (``V`` likewise with
``value_dim``). A sequence owns a block table (a list of block ids) that serves every layer, so
it only ever wastes the unused tail of its last block. Blocks are reference counted: ``fork``
shares all of a sequence's blocks, and the first write into a shared, partly filled block copies
that one block (copy-on-write). ``truncate`` and ``free`` return blocks to the pool.

Why this page layout: a decode work item is one (sequence, kv head); with the head axis before
the slot axis, that head's rows in a page are one contiguous run of ``block_size * head_dim``
elements, which the kernel streams at full memory bandwidth with no gather.

Sliding-window models (every layer windowed, as Mistral): with ``sliding_window=W`` each query
sees its last ``W`` keys, and a step releases the blocks that fell wholly out of every window, so
a long conversation holds about ``W / block_size`` blocks. Their entries in ``block_table`` become
-1. Latent attention (DeepSeek MLA): with ``value_from_key=True`` the values are the first
``value_dim`` features of each key (the compressed latent serves as both), stored once.

Thread safety: every bookkeeping operation holds the cache's lock, so several Python threads may
create, fork, truncate, free and step *different* sequences concurrently. ``Step.attend`` runs
without the lock (and without the GIL): the blocks it writes were reserved for it alone by
``begin_step``, and it refuses to run if one of its sequences changed since (``StaleStepError``).
Fork a sequence between steps, not while one of its steps is being attended.
"""

from __future__ import annotations

import threading

import numpy as np

from . import _api, _core, _tensors
from ._validate import positive_int as _positive_int, storage_dtype as _dtype

__all__ = ["PagedKVCache", "Step", "CacheFullError", "StaleStepError"]


class CacheFullError(RuntimeError):
    """The block pool cannot satisfy a reservation; the cache is unchanged."""


class StaleStepError(RuntimeError):
    """A step's sequence was truncated, freed or stepped again after ``begin_step``."""




class _Seq:
    __slots__ = ("blocks", "length", "version")

    def __init__(self, blocks, length):
        self.blocks = blocks
        self.length = length
        self.version = 0


class PagedKVCache:
    """A block pool holding the keys and values of many sequences, for all layers of a model.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
    num_blocks : int
        Pages in the pool (per layer; one block id addresses the same page in every layer).
    block_size : int
        Token slots per page (default 16).
    dtype : ``"float32"``, ``"float16"`` or ``"bfloat16"``
        Storage dtype of keys and values; attention accumulates in float32.
    value_dim : int, optional
        Width of the values (default ``head_dim``).
    sliding_window : int, optional
        Each query sees only its last ``sliding_window`` keys (itself included), in every layer;
        blocks wholly before every window are released as the sequence grows.
    value_from_key : bool
        Values are ``keys[..., :value_dim]`` (MLA's shared latent): only keys are stored, and
        ``attend`` takes no ``v``.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> cache = attnx.PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=8, num_blocks=8, block_size=4)
    >>> a = cache.new_sequence()
    >>> step = cache.begin_step([a], [5])
    >>> x = np.ones((5, 1, 8), np.float32)
    >>> step.attend(0, np.ones((5, 2, 8), np.float32), x, x).shape
    (5, 2, 8)
    >>> cache.length(a), cache.block_table(a).tolist()
    (5, [0, 1])
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size=16,
                 dtype="float32", value_dim=None, sliding_window=None, value_from_key=False):
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_size = _positive_int(block_size, "block_size")
        self.value_dim = self.head_dim if value_dim is None else _positive_int(value_dim, "value_dim")
        self.dtype = _dtype(dtype)
        self.sliding_window = None if sliding_window is None else _positive_int(sliding_window, "sliding_window")
        if self.sliding_window is not None and self.sliding_window >= 2**31:
            raise ValueError(f"sliding_window: expected fewer than 2**31 tokens, got {sliding_window!r}")
        self.value_from_key = bool(value_from_key)
        if self.value_from_key and self.value_dim > self.head_dim:
            raise ValueError(f"value_dim: with value_from_key the values are the first value_dim features "
                             f"of the keys, so value_dim ({self.value_dim}) must be <= head_dim ({self.head_dim})")
        if self.num_blocks * self.block_size >= 2**31:
            raise ValueError("num_blocks * block_size: the pool must hold fewer than 2**31 slots")
        shape = (self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size)
        nbytes = self.num_blocks * self.bytes_per_block
        try:
            # np.zeros maps fresh pages lazily: memory is committed as blocks are first written
            self._k = np.zeros(shape + (self.head_dim,), self.dtype)
            self._v = None if self.value_from_key else np.zeros(shape + (self.value_dim,), self.dtype)
        except MemoryError:
            raise MemoryError(f"PagedKVCache: cannot allocate {nbytes / 2**30:.1f} GiB for the pool") from None
        self._refs = np.zeros(self.num_blocks, np.int32)
        # Free blocks: every id >= self._fresh (never used yet) plus the stack of returned ids;
        # O(blocks in use) Python memory, whatever num_blocks is.
        self._fresh = 0
        self._returned = []
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._lock = threading.RLock()

    # ---- pages ---------------------------------------------------------------------------------
    def k_pages(self, layer):
        """Zero-copy view of layer ``layer``'s keys: ``(num_blocks, num_kv_heads, block_size, head_dim)``."""
        return self._k[self._layer(layer)]

    def v_pages(self, layer):
        """Zero-copy view of layer ``layer``'s values: ``(num_blocks, num_kv_heads, block_size, value_dim)``."""
        if self.value_from_key:
            return self._k[self._layer(layer)][..., :self.value_dim]
        return self._v[self._layer(layer)]

    def _layer(self, layer):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    # ---- sequences -----------------------------------------------------------------------------
    def _seq(self, seq):
        try:
            return self._seqs[seq]
        except (KeyError, TypeError):
            raise KeyError(f"seq: no live sequence {seq!r} in this cache") from None

    def new_sequence(self):
        """Starts an empty sequence (no blocks yet) and returns its id."""
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            self._seqs[sid] = _Seq([], 0)
            return sid

    def fork(self, seq):
        """A new sequence that shares every block of ``seq`` (no copy); returns its id."""
        with self._lock:
            s = self._seq(seq)
            for b in s.blocks:
                if b >= 0:
                    self._refs[b] += 1
            sid = self._next_id
            self._next_id += 1
            self._seqs[sid] = _Seq(list(s.blocks), s.length)
            return sid

    def _num_free(self):
        return self.num_blocks - self._fresh + len(self._returned)

    def _free_ids(self):
        """Every free block id (for checks and tests; O(num_blocks))."""
        return self._returned + list(range(self.num_blocks - 1, self._fresh - 1, -1))

    def _pop_free(self):
        if self._returned:
            return self._returned.pop()
        self._fresh += 1
        return self._fresh - 1

    def _release(self, blocks):
        for b in blocks:
            if b < 0:  # already released by the sliding window
                continue
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._returned.append(b)

    def truncate(self, seq, length):
        """Rolls ``seq`` back to its first ``length`` tokens, returning whole blocks past them."""
        with self._lock:
            s = self._seq(seq)
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= s.length:
                raise ValueError(f"length: expected an int in [0, {s.length}], got {length!r}")
            keep = -(-int(length) // self.block_size)
            if self.sliding_window is not None:
                first = max(0, int(length) - self.sliding_window + 1) // self.block_size
                if any(b < 0 for b in s.blocks[first:keep]):
                    raise ValueError(f"length: cannot roll back to {length}: the sliding window "
                                     "already released blocks that the next token would need")
            self._release(s.blocks[keep:])
            del s.blocks[keep:]
            s.length = int(length)
            s.version += 1

    def free(self, seq):
        """Ends ``seq`` and returns its blocks (those it does not share) to the pool."""
        with self._lock:
            s = self._seq(seq)
            self._release(s.blocks)
            s.version += 1
            del self._seqs[seq]

    def length(self, seq):
        """Tokens held by ``seq`` (including those reserved by a pending step)."""
        with self._lock:
            return self._seq(seq).length

    def block_table(self, seq):
        """``seq``'s block ids, int32, in token order (-1: released by the sliding window)."""
        with self._lock:
            return np.array(self._seq(seq).blocks, dtype=np.int32)

    @property
    def sequences(self):
        """Ids of the live sequences."""
        with self._lock:
            return list(self._seqs)

    # ---- pool figures --------------------------------------------------------------------------
    @property
    def num_free_blocks(self):
        with self._lock:
            return self._num_free()

    @property
    def num_used_blocks(self):
        with self._lock:
            return self.num_blocks - self._num_free()

    @property
    def bytes_per_block(self):
        """Bytes of one block id across all layers, keys and values."""
        width = self.head_dim + (0 if self.value_from_key else self.value_dim)
        return self.num_layers * self.num_kv_heads * self.block_size * width * self.dtype.itemsize

    def stats(self):
        """Pool figures: blocks, bytes and slot utilisation (tokens stored / slots held).

        ``tokens_stored`` counts each physical slot once, however many forks share it, so
        utilisation is at most 1; ``logical_tokens`` is the sum of the sequences' lengths.
        """
        with self._lock:
            filled = {}
            for s in self._seqs.values():
                for i, b in enumerate(s.blocks):
                    if b < 0:
                        continue
                    n = min(self.block_size, s.length - i * self.block_size)
                    filled[b] = max(filled.get(b, 0), n)
            used = self.num_blocks - self._num_free()
            stored = sum(filled.values())
            return {
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "used_blocks": used,
                "free_blocks": self._num_free(),
                "sequences": len(self._seqs),
                "logical_tokens": sum(s.length for s in self._seqs.values()),
                "tokens_stored": stored,
                "slots_held": used * self.block_size,
                "utilisation": stored / (used * self.block_size) if used else 1.0,
                "bytes_per_token": self.bytes_per_block // self.block_size,
                "bytes_used": used * self.bytes_per_block,
                "bytes_total": self.num_blocks * self.bytes_per_block,
            }

    # ---- steps ---------------------------------------------------------------------------------
    def begin_step(self, seq_ids, num_new_tokens):
        """Reserves slots for ``num_new_tokens[i]`` new tokens of each ``seq_ids[i]``, all or none.

        Raises :class:`CacheFullError` (and changes nothing) if the pool cannot hold them. A
        sequence whose partly filled last block is shared with a fork gets its own copy of that
        block here (copy-on-write), so the step writes only to blocks it owns.

        Returns a :class:`Step`, whose ``attend(layer, q, k, v)`` is called once per layer.
        """
        ids = list(seq_ids)
        counts = list(num_new_tokens)
        if len(ids) != len(counts):
            raise ValueError(f"num_new_tokens: expected {len(ids)} counts (one per sequence), got {len(counts)}")
        for n in counts:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"num_new_tokens: expected ints >= 0, got {counts!r}")
        if len(set(ids)) != len(ids):
            raise ValueError("seq_ids: a sequence may appear only once in a step")
        bs = self.block_size
        with self._lock:
            seqs = [self._seq(i) for i in ids]
            need = 0
            holders = {}  # shared last block -> holders left once this step's earlier copies are made
            for s, n in zip(seqs, counts):
                need += -(-(s.length + n) // bs) - len(s.blocks)
                if n and s.length % bs:
                    last = s.blocks[-1]
                    left = holders.get(last, int(self._refs[last]))
                    if left > 1:
                        # copy-on-write of the shared, partly filled last block; when every holder
                        # of a block is in this step, the last of them keeps it (as below)
                        need += 1
                        holders[last] = left - 1
            if need > self._num_free():
                raise CacheFullError(
                    f"begin_step: needs {need} free blocks, the pool has {self._num_free()} "
                    f"(of {self.num_blocks}); free or truncate sequences, or make the pool larger")
            # from here on nothing can fail
            starts = []
            for s, n in zip(seqs, counts):
                if n and s.length % bs and self._refs[s.blocks[-1]] > 1:
                    old, new = s.blocks[-1], self._pop_free()
                    self._k[:, new] = self._k[:, old]
                    if self._v is not None:
                        self._v[:, new] = self._v[:, old]
                    self._refs[old] -= 1
                    self._refs[new] = 1
                    s.blocks[-1] = new
                for _ in range(-(-(s.length + n) // bs) - len(s.blocks)):
                    b = self._pop_free()
                    self._refs[b] = 1
                    s.blocks.append(b)
                starts.append(s.length)
                if self.sliding_window is not None and n:
                    # the step's first query (position s.length) sees keys from here on
                    first = max(0, s.length - self.sliding_window + 1) // bs
                    self._release(s.blocks[:first])
                    s.blocks[:first] = [-1] * first
                s.length += n
                s.version += 1
            return Step(self, ids, seqs, starts, counts)


class Step:
    """One forward step of a batch of sequences: their new tokens, packed in sequence order.

    Attributes
    ----------
    seq_ids : list of int
    q_lens : int32 ``(B,)``, new tokens per sequence
    seq_lens : int32 ``(B,)``, tokens per sequence after the step
    positions : int32 ``(T,)``, absolute position of every new token (for RoPE)
    block_tables : int32 ``(B, max_blocks)``
    slots : int64 ``(T,)``, where each new token is written (``block * block_size + offset``)
    """

    def __init__(self, cache, ids, seqs, starts, counts):
        bs = cache.block_size
        self._cache = cache
        self._seqs = seqs
        self._versions = [s.version for s in seqs]
        self.seq_ids = ids
        self.q_lens = np.asarray(counts, dtype=np.int32)
        self.seq_lens = np.asarray([s.length for s in seqs], dtype=np.int32)
        width = max([len(s.blocks) for s in seqs] + [1])
        self.block_tables = np.zeros((len(seqs), width), dtype=np.int32)
        for row, s in zip(self.block_tables, seqs):
            row[:len(s.blocks)] = s.blocks
        # released entries (-1) are never read (they lie outside every window): any valid id will do
        np.maximum(self.block_tables, 0, out=self.block_tables)
        starts = np.asarray(starts, dtype=np.int64)
        seq_index = np.repeat(np.arange(len(seqs)), self.q_lens)
        pos = np.arange(int(self.q_lens.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(self.q_lens) - self.q_lens, self.q_lens) + starts[seq_index]
        self.positions = pos.astype(np.int32)
        self.slots = self.block_tables[seq_index, pos // bs].astype(np.int64) * bs + pos % bs
        self.num_tokens = int(self.q_lens.sum())

    @_tensors.tensor_io
    def attend(self, layer, q, k, v=None, *, scale=None, num_threads=None, return_lse=False, window=None,
               softcap=None, sinks=None, alibi_slopes=None):
        """Writes this step's new keys and values into layer ``layer`` and attends.

        Parameters
        ----------
        layer : int
        q : ndarray ``(T, Hq, head_dim)``, the new queries packed in sequence order
        k : ndarray ``(T, num_kv_heads, head_dim)``; v : ``(T, num_kv_heads, value_dim)``
            Converted to the cache's dtype as they are stored. ``v`` must be None when the cache
            has ``value_from_key`` (the values are read from the keys).
        window, softcap, sinks, alibi_slopes
            As in :func:`attnx.attention`. A cache with ``sliding_window=W`` uses
            ``window=(W - 1, None)`` by default and refuses a wider left side.

        Returns
        -------
        ndarray ``(T, Hq, value_dim)`` of q's dtype: each new query attends causally
        (bottom-right) to everything its sequence holds, its own new tokens included.
        """
        cache = self._cache
        li = cache._layer(layer)
        with cache._lock:
            if any(s.version != ver for s, ver in zip(self._seqs, self._versions)):
                raise StaleStepError("attend: a sequence of this step was truncated, freed or "
                                     "stepped again since begin_step")
        q = _api._unit_last(_api._as_array(q, "q"))
        if q.ndim != 3:
            raise ValueError(f"q: expected shape (T, Hq, D), got {q.shape}")
        if cache.value_from_key:
            if v is not None:
                raise ValueError("v: this cache reads values from the keys (value_from_key=True): pass v=None")
        elif v is None:
            raise ValueError("v: expected the new values (T, num_kv_heads, value_dim)")
        else:
            v = _api._unit_last(_api._as_array(v, "v"))
        # as attnx.paged_attention does: numpy ints and lists accepted, clean errors naming them
        window, softcap = _api._window(window), _api._softcap(softcap)
        if cache.sliding_window is not None:
            w = cache.sliding_window - 1
            if window is None:
                window = (w, None)
            elif not isinstance(window, tuple) or len(window) != 2 or window[0] is None or (
                    isinstance(window[0], int) and window[0] > w):
                raise ValueError(f"window: this cache keeps a sliding window of {cache.sliding_window} "
                                 f"tokens, so the left side must be <= {w}, got {window!r}")
        return _core.paged_attention(
            q, cache._k[li], cache.v_pages(li), self.block_tables, self.seq_lens, self.q_lens, True,
            _api._scale(scale, q.shape[2]), None, bool(return_lse), _api._threads(num_threads),
            window, softcap, sinks, alibi_slopes, k_new=_api._unit_last(_api._as_array(k, "k")),
            v_new=v, slots=self.slots)
