"""PagedKVCache: keys and values of many sequences in one pool of fixed-size blocks.

Memory is a pool of ``num_blocks`` pages of ``block_size`` token slots, for every layer at once:
``K[layer]`` has shape ``(num_blocks, num_kv_heads, block_size, head_dim)`` (``V`` likewise with
``value_dim``). A sequence owns a block table (a row of block ids) that serves every layer, so
it only ever wastes the unused tail of its last block. Blocks are reference counted: ``fork``
shares all of a sequence's blocks, and the first write into a shared, partly filled block copies
that one block (copy-on-write). ``truncate`` and ``free`` return blocks to the pool.

Three parts, each small: the pool arrays and the sequences live here (:class:`PagedKVCache`); the
reference counts and the free list are a :class:`attnx.cache.blocks.BlockAllocator`; each sequence's
table is a persistent int32 row that grows in place (:class:`attnx.cache.blocks.BlockRow`), from which
a step's ``(B, max_blocks)`` table is gathered with one slice copy per sequence.

Integers: sequence ids, layers, lengths and token counts are Python ints, NumPy integer scalars
of any width and sign, or 0-d integer arrays (counts also a 1-d integer array of any dtype); they
are converted to Python ints and range-checked before anything changes, so a NumPy count never
wraps. A bool or a float (even ``1.0``) is not an id, a layer or a count. A sequence holds at most
``2**31 - 1`` tokens (positions are int32).

Why this page layout: a decode work item is one (sequence, kv head); with the head axis before
the slot axis, that head's rows in a page are one contiguous run of ``block_size * head_dim``
elements, which the kernel streams at full memory bandwidth with no gather.

Sliding-window models (every layer windowed, as Mistral): with ``sliding_window=W`` each query
sees its last ``W`` keys, and a step releases the blocks that fell wholly out of every window, so
a long conversation holds about ``W / block_size`` blocks. Their entries in ``block_table`` become
-1. Latent attention (DeepSeek MLA): with ``value_from_key=True`` the values are the first
``value_dim`` features of each key (the compressed latent serves as both), stored once.

Prefix caching (``prefix_caching=True``): every full block is registered under a digest chained
over its parent's digest and its token ids (and the sequence's ``extra_key``) once every layer
has written it (when its step's last layer returns: a step that ends early registers nothing),
so that ``new_sequence(tokens=...)`` attaches the cached blocks a prompt starts with (not in a
hybrid cache: a block does not hold the recurrent state a hit would need); blocks no sequence
holds stay cached until an allocation needs them, least recently released first. A step whose
sequences share leading blocks (forks, hits) reads those blocks once for all of them and merges
by log-sum-exp (:mod:`attnx.ops.cascade`). ``save`` / ``load`` write one sequence to a safetensors file
and read it back, in this process or another (:mod:`attnx.cache.session`).

Hybrid models (Qwen3-Next, Kimi Linear: gated delta-rule layers beside full attention): with
``linear_layers=n, state_shape=(Hv, K, V)`` each sequence also carries a float32 recurrent state
per linear layer, ``(n, Hv, K, V)``, beside the paged KV of the ``num_layers`` full-attention
layers; ``Step.linear(layer, q, k, v, g, beta)`` runs such a layer over the step's tokens and
advances the states. A state has a fixed size whatever the sequence's length. ``fork`` copies it,
``free`` releases it. A recurrent state cannot be rolled back: ``truncate`` of a sequence whose
state has been written refuses every length except its current one and 0 (which resets the state
to zeros); keep a fork as a checkpoint where rollback is needed (speculative decoding).

Quantised pages (``dtype="int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``): each (token, kv head)
row of K and of V is stored as 1-byte codes plus one float32 scale, in scale pages
``(num_blocks, num_kv_heads, block_size)`` beside the data (:meth:`PagedKVCache.k_scales`); a
step quantises its new rows as it writes them (:func:`attnx.reference.quantize_kv` defines how)
and the kernels read ``code * scale``. Copy-on-write copies a block's scales with its codes.

Thread safety: every bookkeeping operation holds the cache's lock, so several Python threads may
create, fork, truncate, free and step *different* sequences concurrently. ``Step.attend`` runs
without the lock (and without the GIL): the blocks it writes were reserved for it alone by
``begin_step``, and it refuses to run if one of its sequences changed since (``StaleStepError``).
Fork a sequence between steps, not while one of its steps is being attended.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from .. import quant
from .._validate import FLOAT_DTYPES as _FLOAT_DTYPES
from .._validate import QUANTISED_DTYPES as _QUANTISED_DTYPES
from .._validate import as_int
from .._validate import counts as _counts
from .._validate import flag as _flag
from .._validate import index as _index
from .._validate import int_in as _int_in
from .._validate import positive_int as _positive_int
from .._validate import storage_dtype as _dtype
from . import session as _session
from .blocks import BlockAllocator, BlockRow, CacheFullError, block_digest, root_digest
from .linear_states import linear_config
from .memory import aligned_zeros
from .prefix import extra_bytes, token_ids
from .step import StaleStepError, Step

__all__ = ["CacheFullError", "PagedKVCache", "StaleStepError", "Step"]

_MAX_TOKENS = 2**31 - 1  # a step's lengths and positions are int32, as the kernels read them


class SeqState:
    """One sequence: its block table row, its length (tokens reserved so far) and a version
    that every change bumps (a step made before a change is stale); in a hybrid cache, the
    recurrent states of its linear layers (None until a linear layer first writes them: zeros).

    Token bookkeeping (prefix caching, sessions): ``tokens`` are its token ids where known (None
    once a step came without them), possibly running past ``length`` (a prompt given to
    ``new_sequence`` whose uncached part is still to be computed); ``digests[i]`` is the prefix
    digest of its block ``i``, for its leading full blocks that are written; ``root`` starts the
    chain (it carries the extra key). ``written``: its first tokens whose keys and values every
    layer has written (by steps that ended with every layer attended, a prefix hit or a load);
    only blocks within them are registered or saved."""

    __slots__ = ("digests", "length", "root", "row", "state", "tokens", "version", "written")

    def __init__(self, row: BlockRow, length: int, state: np.ndarray | None = None) -> None:
        self.row = row
        self.length = length
        self.version = 0
        self.tokens: np.ndarray | None = None
        self.digests: list[bytes] = []
        self.root = root_digest(b"")
        self.state = state
        self.written = length

    def copy(self) -> SeqState:
        """A fork: the same blocks (the caller takes the references), token bookkeeping, and a copy
        of the recurrent states."""
        s = SeqState(
            self.row.copy(), self.length, None if self.state is None else self.state.copy()
        )
        s.tokens, s.digests, s.root = self.tokens, list(self.digests), self.root
        s.written = self.written
        return s


class PagedKVCache:
    """A block pool holding the keys and values of many sequences, for all layers of a model.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
    num_blocks : int
        Pages in the pool (per layer; one block id addresses the same page in every layer).
    block_size : int
        Token slots per page (default 16).
    dtype : ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"``
        Storage dtype of keys and values; attention accumulates in float32. The last three are
        quantised: one float32 scale per (token, kv head) row, see :meth:`k_scales`.
    value_dim : int, optional
        Width of the values (default ``head_dim``).
    sliding_window : int, optional
        Each query sees only its last ``sliding_window`` keys (itself included), in every layer;
        blocks wholly before every window are released as the sequence grows.
    value_from_key : bool
        Values are ``keys[..., :value_dim]`` (MLA's shared latent): only keys are stored, and
        ``attend`` takes no ``v``.
    prefix_caching : bool
        Register every full block under a digest of its token ids and those before it, so that
        ``new_sequence(tokens=...)`` attaches the cached blocks of a prompt that starts like an
        earlier one. Blocks no sequence holds stay cached until an allocation needs them (least
        recently released first). The token ids come from ``new_sequence(tokens=...)`` and
        ``begin_step(..., tokens=...)``.
    linear_layers : int
        Gated delta-rule layers of a hybrid model (default 0): each sequence keeps one float32
        state ``state_shape`` per linear layer, advanced by ``Step.linear``.
    state_shape : (Hv, K, V), required with ``linear_layers``
        Value heads, key width and value width of the linear layers.

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

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: Any = "float32",
        value_dim: int | None = None,
        sliding_window: int | None = None,
        value_from_key: bool = False,
        prefix_caching: bool = False,
        linear_layers: int = 0,
        state_shape: Sequence[int] | None = None,
    ) -> None:
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_size = _positive_int(block_size, "block_size")
        self.value_dim = (
            self.head_dim if value_dim is None else _positive_int(value_dim, "value_dim")
        )
        self.dtype = _kv_dtype(dtype)
        self.quantised = quant.quantised_dtype(self.dtype) is not None
        self.sliding_window = (
            None
            if sliding_window is None
            else _int_in(sliding_window, "sliding_window", 1, _MAX_TOKENS)
        )
        self.value_from_key = _flag(value_from_key, "value_from_key")
        if self.value_from_key and self.value_dim > self.head_dim:
            raise ValueError(
                f"value_dim: with value_from_key the values are the first value_dim features "
                f"of the keys, so value_dim ({self.value_dim}) must be <= head_dim ({self.head_dim})"
            )
        if self.num_blocks * self.block_size >= 2**31:
            raise ValueError("num_blocks * block_size: the pool must hold fewer than 2**31 slots")
        self.linear_layers, self.state_shape = linear_config(linear_layers, state_shape)
        self._k, self._v = self._pool_arrays()
        self.prefix_caching = _flag(prefix_caching, "prefix_caching")
        if self.prefix_caching and self.linear_layers:
            raise ValueError(
                "prefix_caching: not with linear_layers: a cached block holds keys and "
                "values, not the recurrent state a hit would need at its end"
            )
        self._k_scales, self._v_scales = self._scale_arrays()
        self._views: list[Any] | None = None  # per-layer page views (_all_layer_pages)
        self._alloc = BlockAllocator(self.num_blocks, caching=self.prefix_caching)
        self._hit_tokens = self._query_tokens = 0
        self._seqs: dict[int, SeqState] = {}
        self._next_id = 0
        self._epoch = 0  # bumped with every sequence's version: unchanged, every step is current
        self._lock = threading.RLock()

    def _pool_arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        shape = (self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size)
        try:
            # mapped lazily: memory is committed as blocks are first written
            k = aligned_zeros(shape + (self.head_dim,), self.dtype)
            v = (
                None
                if self.value_from_key
                else aligned_zeros(shape + (self.value_dim,), self.dtype)
            )
        except (MemoryError, ValueError, OverflowError):  # (the last two: beyond any address space)
            gib = self.num_blocks * self.bytes_per_block / 2**30
            raise MemoryError(f"PagedKVCache: cannot allocate {gib:.1f} GiB for the pool") from None
        return k, v

    def _scale_arrays(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The scale pages of a quantised cache, float32 ``(layers, blocks, heads, block_size)``
        for K and for V (None for V when the values are read from the keys)."""
        if not self.quantised:
            return None, None
        shape = (self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size)
        try:
            return (
                aligned_zeros(shape, np.float32),
                None if self.value_from_key else aligned_zeros(shape, np.float32),
            )
        except (MemoryError, ValueError, OverflowError):
            gib = self.num_blocks * self.bytes_per_block / 2**30
            raise MemoryError(f"PagedKVCache: cannot allocate {gib:.1f} GiB for the pool") from None

    # ---- pages ---------------------------------------------------------------------------------
    def k_pages(self, layer: int) -> np.ndarray:
        """Zero-copy view of layer ``layer``'s keys: ``(num_blocks, num_kv_heads, block_size, head_dim)``."""
        return self._layer_pages(layer)[0]

    def v_pages(self, layer: int) -> np.ndarray:
        """Zero-copy view of layer ``layer``'s values: ``(num_blocks, num_kv_heads, block_size, value_dim)``."""
        return self._layer_pages(layer)[1]

    def k_scales(self, layer: int) -> np.ndarray | None:
        """Zero-copy view of layer ``layer``'s key scales, float32 ``(num_blocks, num_kv_heads,
        block_size)`` (a quantised cache; None for float pages): key row ``(block, head, slot)``
        reads back as ``k_pages(layer)[block, head, slot] * k_scales(layer)[block, head, slot]``."""
        return self._layer_pages(layer)[2]

    def v_scales(self, layer: int) -> np.ndarray | None:
        """Zero-copy view of layer ``layer``'s value scales, as :meth:`k_scales` (with
        ``value_from_key`` the values are the keys' first features: the keys' scales)."""
        return self._layer_pages(layer)[3]

    def _layer_pages(
        self, layer: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Layer ``layer``'s views ``(k_pages, v_pages, k_scales, v_scales)``, made once (a decode
        step asks for them once per layer)."""
        views = self._all_layer_pages()
        if type(layer) is int and 0 <= layer < len(views):  # the usual call, in one test
            return views[layer]
        return views[_index(layer, "layer", self.num_layers)]

    def _all_layer_pages(
        self,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]]:
        """Every layer's ``_layer_pages`` (what a step's ``_core.StepPlan`` indexes by layer)."""
        if self._views is None:
            k, v, ks = self._k, self._v, self._k_scales
            vs = ks if self._v_scales is None else self._v_scales
            self._views = [
                (
                    k[i],
                    k[i][..., : self.value_dim] if v is None else v[i],
                    None if ks is None else ks[i],
                    None if vs is None else vs[i],
                )
                for i in range(self.num_layers)
            ]
        return self._views

    # ---- the allocator's figures, for checks and tests -----------------------------------------
    @property
    def _refs(self) -> np.ndarray:
        """Reference count of every block (read-only view)."""
        return self._alloc.refs

    def _free_ids(self) -> list[int]:
        """Every free block id (O(num_blocks))."""
        return self._alloc.free_ids()

    # ---- sequences -----------------------------------------------------------------------------
    def _lookup(self, seq: object) -> tuple[int, SeqState]:
        """``seq`` as a Python int and its record; KeyError if it is no live sequence."""
        sid = as_int(seq)
        s = None if sid is None else self._seqs.get(sid)
        if sid is None or s is None:
            why = "" if sid is not None else f" (a sequence id is an int, not {type(seq).__name__})"
            raise KeyError(f"seq: no live sequence {seq!r} in this cache{why}")
        return sid, s

    def _seq(self, seq: object) -> SeqState:
        return self._lookup(seq)[1]

    def _add(self, s: SeqState) -> int:
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = s
        return sid

    def new_sequence(self, tokens: Any = None, *, extra_key: Any = None) -> int:
        """Starts a sequence and returns its id.

        Parameters
        ----------
        tokens : 1-d integer array-like, optional
            The prompt's token ids. With ``prefix_caching``, the longest run of cached full
            blocks that holds its first tokens is attached by reference, and :meth:`length`
            says how many tokens are already there; at least one token is always left to
            compute (so the caller gets logits). The rest are the ids the next steps register
            when ``begin_step`` is given no ``tokens``.
        extra_key : str, bytes or int, optional
            Something beside the tokens that the keys and values depend on (an adapter, an
            image): blocks are shared only between sequences with equal extra keys.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> cache = attnx.PagedKVCache(1, 1, 8, num_blocks=8, block_size=4, prefix_caching=True)
        >>> a = cache.new_sequence(tokens=range(10))
        >>> step = cache.begin_step([a], [10])
        >>> x = np.ones((10, 1, 8), np.float32)
        >>> _ = step.attend(0, x, x, x)   # its last layer: blocks 0 and 1 are registered
        >>> cache.free(a)
        >>> b = cache.new_sequence(tokens=list(range(9)) + [42])
        >>> cache.length(b), cache.stats()["prefix_hit_tokens"]
        (8, 8)
        """
        ids = None if tokens is None else token_ids(tokens, "tokens")
        root = root_digest(extra_bytes(extra_key))
        with self._lock:
            s = SeqState(BlockRow(), 0)
            s.tokens, s.root = ids, root
            if ids is not None and self.prefix_caching:
                blocks, s.digests = self._alloc.match(root, ids[: len(ids) - 1], self.block_size)
                hit = np.array(blocks, np.int32)
                self._alloc.incref(hit)
                s.row.append(hit)
                s.length = s.written = len(blocks) * self.block_size
                self._hit_tokens += s.length
                self._query_tokens += len(ids)
            return self._add(s)

    def fork(self, seq: int) -> int:
        """A new sequence that shares every block of ``seq`` (no copy); returns its id.

        Raises
        ------
        KeyError
            ``seq`` is not a live sequence id (a bool or a float never is).
        """
        with self._lock:
            s = self._seq(seq)
            self._alloc.incref(s.row.held())
            return self._add(s.copy())

    def truncate(self, seq: int, length: int) -> None:
        """Rolls ``seq`` back to its first ``length`` tokens, returning whole blocks past them.

        Raises
        ------
        KeyError
            ``seq`` is not a live sequence id.
        ValueError
            ``length`` is not an int in ``[0, length(seq)]``, or (sliding window) the blocks it
            would need again were already released, or ``seq`` has a recurrent state (linear
            layers) and ``length`` is neither its length nor 0. Nothing changes.
        """
        with self._lock:
            s = self._seq(seq)
            n = _int_in(length, "length", 0, s.length)
            if s.state is not None and n not in (0, s.length):
                raise ValueError(
                    f"length: cannot roll back to {n}: sequence {seq} has a recurrent "
                    f"state (linear layers), which cannot be undone; only {s.length} "
                    "(no change) or 0 (a fresh state) are possible. Fork before the "
                    "tokens you may drop and keep the fork as a checkpoint"
                )
            keep = self._blocks_for(n)
            if (
                self.sliding_window is not None
                and (s.row.ids[self._first_in_window(n) : keep] < 0).any()
            ):
                raise ValueError(
                    f"length: cannot roll back to {n}: the sliding window "
                    "already released blocks that the next token would need"
                )
            self._alloc.decref(s.row.cut(keep))
            if n == 0:
                s.state = None
            if n % self.block_size:  # the next write lands in this block: its digest goes
                self._alloc.forget(s.row.last)
            del s.digests[n // self.block_size :]
            s.written = min(s.written, n)
            if s.tokens is not None:
                s.tokens = s.tokens[:n]
            s.length = n
            self._changed(s)

    def free(self, seq: int) -> None:
        """Ends ``seq`` and returns its blocks (those it does not share) to the pool.

        Raises
        ------
        KeyError
            ``seq`` is not a live sequence id (a bool or a float never is).
        """
        with self._lock:
            sid, s = self._lookup(seq)
            self._alloc.decref(s.row.held())
            s.state = None  # its recurrent states go with it
            self._changed(s)
            del self._seqs[sid]

    def length(self, seq: int) -> int:
        """Tokens held by ``seq`` (including those reserved by a pending step), a Python int."""
        with self._lock:
            return self._seq(seq).length

    def block_table(self, seq: int) -> np.ndarray:
        """``seq``'s block ids, int32, in token order (-1: released by the sliding window)."""
        with self._lock:
            return self._seq(seq).row.ids.copy()

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        with self._lock:
            return list(self._seqs)

    # ---- pool figures --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a step can still take."""
        with self._lock:
            return self._alloc.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        with self._lock:
            return self.num_blocks - self._alloc.num_free

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across all layers, keys and values (and their scales)."""
        rows = 1 if self.value_from_key else 2  # K rows, and V rows
        width = self.head_dim + (0 if self.value_from_key else self.value_dim)
        per_slot = width * self.dtype.itemsize + (rows * 4 if self.quantised else 0)
        return self.num_layers * self.num_kv_heads * self.block_size * per_slot

    @property
    def bytes_per_state(self) -> int:
        """Bytes of one sequence's recurrent states (all linear layers; 0 without any): the same
        however long the sequence is."""
        hv, k, v = self.state_shape or (0, 0, 0)
        return self.linear_layers * hv * k * v * 4

    def _tokens_stored(self) -> int:
        """Filled slots, each physical slot once however many sequences share its block."""
        rows = [(s.row.held(), s.row.released, s.length) for s in self._seqs.values()]
        ids = np.concatenate([held for held, _, _ in rows] + [np.zeros(0, np.int32)])
        if not len(ids):
            return 0
        filled = np.concatenate(
            [
                np.minimum(
                    self.block_size, n - self.block_size * np.arange(first, first + len(held))
                )
                for held, first, n in rows
            ]
        )
        order = np.lexsort((filled, ids))  # by block, the fullest holder last
        ids, filled = ids[order], filled[order]
        return int(filled[np.append(ids[1:] != ids[:-1], True)].sum())

    def _prefix_stats(self) -> dict[str, Any]:
        a = self._alloc
        return {
            "prefix_query_tokens": self._query_tokens,
            "prefix_hit_tokens": self._hit_tokens,
            "prefix_miss_tokens": self._query_tokens - self._hit_tokens,
            "prefix_hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            "cached_blocks": a.num_cached,
            "evictable_blocks": a.num_evictable,
            "evictions": a.evictions,
        }

    def stats(self) -> dict[str, Any]:
        """Pool figures: blocks, bytes and slot utilisation (tokens stored / slots held), and
        prefix caching's counts.

        ``tokens_stored`` counts each physical slot once, however many forks share it, so
        utilisation is at most 1; ``logical_tokens`` is the sum of the sequences' lengths.
        ``used_blocks`` are held by a sequence; ``free_blocks`` include the evictable ones
        (cached at reference count 0). ``prefix_query_tokens`` sums the prompts given to
        ``new_sequence``, ``prefix_hit_tokens`` those of them found cached (``prefix_miss_tokens``
        the rest); ``cached_blocks`` are registered (held or evictable), ``evictions`` counts
        cached blocks taken by allocations.
        """
        with self._lock:
            used = self.num_blocks - self._alloc.num_free
            stored = self._tokens_stored()
            return self._prefix_stats() | {
                "num_blocks": self.num_blocks,
                "block_size": self.block_size,
                "used_blocks": used,
                "free_blocks": self._alloc.num_free,
                "sequences": len(self._seqs),
                "logical_tokens": sum(s.length for s in self._seqs.values()),
                "tokens_stored": stored,
                "slots_held": used * self.block_size,
                "utilisation": stored / (used * self.block_size) if used else 1.0,
                "bytes_per_token": self.bytes_per_block // self.block_size,
                "bytes_used": used * self.bytes_per_block,
                "bytes_total": self.num_blocks * self.bytes_per_block,
                "state_bytes": sum(
                    s.state.nbytes for s in self._seqs.values() if s.state is not None
                ),
            }

    # ---- sessions ------------------------------------------------------------------------------
    def save(self, seq: int, path: Any, *, tokens: Any = None, meta: Any = None) -> None:
        """Writes ``seq``'s keys and values, all layers, to the safetensors file ``path``.

        Only the sequence's ``length`` valid slots are written, in token order, so the file does
        not depend on the block size; a hybrid cache's file holds the recurrent states too. The
        write is atomic (a temporary file in the same directory, fsync, rename): a reader sees
        the old file or the whole new one. A symbolic link is followed: its target is replaced
        so (in the target's directory), and the link stays. Save between steps: a sequence with
        tokens that not every layer has written is refused. Needs ``safetensors``.

        Parameters
        ----------
        seq : int
        path : str, bytes or os.PathLike
        tokens : 1-d integer array-like, optional
            The sequence's token ids (default: those the cache knows, if any).
        meta : JSON-serialisable, optional
            Stored as is, e.g. ``{"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}``; ``load``'s
            ``expect`` compares against it.

        Raises
        ------
        KeyError
            ``seq`` is not live.
        ValueError
            The sliding window released some of its blocks, some of its tokens were not written
            by every layer (a step that has not ended, or never did: truncate to before it), or
            ``tokens`` has not ``length`` ids.
        TypeError
            ``meta`` is not JSON-serialisable, or ``path`` is no str, bytes or os.PathLike.
        """
        path = _session.path_str(path)
        with self._lock:
            s = self._seq(seq)
            n = s.length
            ids = None if tokens is None else token_ids(tokens, "tokens", n)
            if ids is None and s.tokens is not None and len(s.tokens) >= n:
                ids = s.tokens[:n]
            if s.row.released:
                raise ValueError(
                    "seq: the sliding window released its first blocks: only a "
                    "whole sequence can be saved"
                )
            if s.written < n:
                raise ValueError(
                    f"seq: tokens {s.written} .. {n - 1} of sequence {seq} are not "
                    "written in every layer (a step that has not ended, or never did: "
                    f"truncate it to {s.written} and step again)"
                )
            tensors = self._gather(s.row.ids[: self._blocks_for(n)], n)
            if self.linear_layers:  # (its recurrent states: zeros until a linear layer ran)
                shape = (self.linear_layers,) + (self.state_shape or ())
                tensors["state"] = (
                    np.zeros(shape, np.float32) if s.state is None else s.state.copy()
                )
        data = _session.encode(_session.geometry(self), tensors, n, ids, s.root, meta)
        _session.save(path, data)

    def load(self, path: Any, *, expect: Any = None) -> int:
        """A new sequence holding the keys and values saved in ``path``; returns its id.

        With ``prefix_caching`` and token ids in the file, its full blocks are registered (a
        later prompt that starts like the session hits them).

        Parameters
        ----------
        path : str, bytes or os.PathLike
        expect : dict, optional
            Entries that the file's ``meta`` must hold with equal values (e.g. a model id).

        Raises
        ------
        attnx.SessionError (a ValueError)
            Not a session file, truncated or corrupted (checksum), made for another cache
            geometry (layers, heads, widths, dtype) or with ``meta`` that does not match
            ``expect``.
        CacheFullError
            The pool cannot hold the sequence. In every case the cache is unchanged.
        TypeError
            ``path`` is no str, bytes or os.PathLike (or ``expect`` no dict).
        """
        path = _session.path_str(path)
        tensors, n, tokens, root = _session.decode(_session.read(path), path, self, expect)
        with self._lock:
            blocks = self._alloc.allocate(self._blocks_for(n))
            self._scatter(blocks, tensors, n)
            state = tensors["state"].copy() if n and "state" in tensors else None
            s = SeqState(BlockRow(len(blocks)), n, state)
            s.row.append(blocks)
            s.tokens, s.root = tokens, root
            if tokens is not None and self.prefix_caching:
                self._register(s)
            return self._add(s)

    def _session_pages(self) -> dict[str, np.ndarray]:
        """The pool arrays a session file holds, by tensor name: K and V, and the scale pages of a
        quantised cache (with ``value_from_key`` V is a view of K: neither V nor its scales)."""
        pages = {"k": self._k}
        if self._v is not None:
            pages["v"] = self._v
        if self._k_scales is not None:
            pages["k_scales"] = self._k_scales
            if self._v is not None and self._v_scales is not None:
                pages["v_scales"] = self._v_scales
        return pages

    def _gather(self, blocks: np.ndarray, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` slots of ``blocks``, every layer, as ``(layers, heads, n[, width])``
        arrays by name (the session file's tensors)."""
        out = {}
        for name, pages in self._session_pages().items():
            x = np.moveaxis(pages[:, blocks], 2, 1)  # (L, H, nb, bs[, D])
            out[name] = x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :n]
        return out

    def _scatter(self, blocks: np.ndarray, tensors: dict[str, np.ndarray], n: int) -> None:
        """Writes ``_gather``'s arrays into the first ``n`` slots of ``blocks``."""
        bs = self.block_size
        for name, pages in self._session_pages().items():
            t = tensors[name]
            padded = np.zeros(t.shape[:2] + (len(blocks) * bs,) + t.shape[3:], pages.dtype)
            padded[:, :, :n] = t
            x = padded.reshape(t.shape[:2] + (len(blocks), bs) + t.shape[3:])
            pages[:, blocks] = np.moveaxis(x, 1, 2)

    # ---- steps ---------------------------------------------------------------------------------
    def begin_step(
        self,
        seq_ids: Iterable[int],
        num_new_tokens: Sequence[int] | np.ndarray,
        *,
        tokens: Sequence[Any] | None = None,
    ) -> Step:
        """Reserves slots for ``num_new_tokens[i]`` new tokens of each ``seq_ids[i]``, all or none.

        A sequence whose partly filled last block is shared with a fork gets its own copy of that
        block here (copy-on-write), so the step writes only to blocks it owns.

        Parameters
        ----------
        seq_ids : sequence of int
            Live sequence ids, each at most once.
        num_new_tokens : sequence of int, or 1-d integer array of any dtype
            New tokens per sequence, ``>= 0``.
        tokens : sequence of (1-d integer array-like or None), optional
            The new tokens' ids, one entry per sequence (``num_new_tokens[i]`` ids, or None).
            With ``prefix_caching`` the blocks a step fills are registered under their digests
            once every layer has written them: when the ``attend`` of the step's last layer not
            yet attended returns. A step that ends any other way (a refused ``attend``, an
            exception in the model, its sequence truncated, freed or stepped again) registers
            nothing, and its sequence registers no later block until it is truncated to before
            that step. Where an entry is None, the ids given to ``new_sequence`` beyond the
            sequence's length are used if there are enough; otherwise its later blocks go
            unregistered.

        Returns
        -------
        Step
            Its ``attend(layer, q, k, v)`` is called once per layer.

        Raises
        ------
        CacheFullError
            The pool cannot hold the new tokens. Nothing changes.
        KeyError, ValueError, TypeError
            An id that is not live, a repeated id, a count that is not an int >= 0, or a
            sequence that would pass ``2**31 - 1`` tokens. Nothing changes.
        """
        given = _id_list(seq_ids)
        counts = _counts(num_new_tokens, "num_new_tokens", len(given))
        new_ids = self._step_tokens(tokens, counts)
        ids = [as_int(i) for i in given]  # None where it is no int: the lookup below refuses it
        known = [i for i in ids if i is not None]
        if len(set(known)) != len(known):
            raise ValueError("seq_ids: a sequence may appear only once in a step")
        with self._lock:
            return self._reserve_step(given, known, counts, new_ids)

    def _reserve_step(
        self,
        given: list[Any],
        known: list[int],
        counts: list[int],
        new_ids: list[np.ndarray | None],
    ) -> Step:
        """begin_step's reservation, under the lock: the sequences looked up and their blocks
        reserved (all or none), then their tokens appended."""
        seqs = [self._seq(i) for i in given]
        reservations = self._block_reservations(known, seqs, counts)
        starts = [s.length for s in seqs]
        for s, n, (copy, grow) in zip(seqs, counts, reservations):  # from here on nothing can fail
            self._append_tokens(s, n, copy, grow)
        for s, n, ids_ in zip(seqs, counts, new_ids):
            self._note_tokens(s, n, ids_)
        return Step(self, known, seqs, starts, counts)

    @staticmethod
    def _step_tokens(tokens: Sequence[Any] | None, counts: list[int]) -> list[np.ndarray | None]:
        """begin_step's ``tokens`` checked against the counts: one int64 array (or None) each."""
        if tokens is None:
            return [None] * len(counts)
        if (isinstance(tokens, np.ndarray) and tokens.ndim != 1) or isinstance(
            tokens, (str, bytes)
        ):
            raise TypeError("tokens: expected one entry (token ids or None) per sequence")
        entries = list(tokens)
        if len(entries) != len(counts):
            raise ValueError(
                f"tokens: expected {len(counts)} entries (one per sequence), got {len(entries)}"
            )
        return [
            None if t is None else token_ids(t, f"tokens[{i}]", n)
            for i, (t, n) in enumerate(zip(entries, counts))
        ]

    def _note_tokens(self, s: SeqState, n: int, ids: np.ndarray | None) -> None:
        """Records the ids of ``s``'s last ``n`` tokens (just reserved); the blocks they fill are
        registered when the step ends with every layer written (:meth:`_step_written`)."""
        start = s.length - n
        if not n:
            return
        if ids is not None:
            known = s.tokens is not None and len(s.tokens) >= start
            s.tokens = (
                ids
                if start == 0
                else None
                if not known
                else np.concatenate([cast(np.ndarray, s.tokens)[:start], ids])
            )
        elif s.tokens is not None and len(s.tokens) < s.length:
            s.tokens = None  # these tokens' ids are unknown: the chain ends here

    def _step_written(self, step: Step) -> None:
        """Every layer of ``step`` has written its rows: each of its sequences unchanged since,
        and with no unwritten tokens before the step's, counts them written and registers the
        blocks they fill (prefix caching). The one place where a step's blocks become findable."""
        with self._lock:
            for s, version, start, n in zip(
                step._seqs, step._versions, step._starts, step.q_lens.tolist()
            ):
                if s.version != version or s.written != start:
                    continue  # changed since, or an earlier step of it never ended: a gap
                s.written = start + n
                if s.tokens is not None and self.prefix_caching:
                    self._register(s)

    def _register(self, s: SeqState) -> None:
        """Registers ``s``'s full, written blocks past those whose digests it knows."""
        assert s.tokens is not None
        bs, ids = self.block_size, s.row.ids
        for i in range(len(s.digests), min(s.written, len(s.tokens)) // bs):
            parent = s.digests[-1] if s.digests else s.root
            chunk = s.tokens[i * bs : (i + 1) * bs]
            s.digests.append(block_digest(parent, chunk))
            if ids[i] >= 0:  # (a block the sliding window released is not registered)
                self._alloc.register(int(ids[i]), s.digests[-1], parent, chunk)

    def _blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def _first_in_window(self, position: int) -> int:
        """The first block that a query at ``position`` reads (sliding window)."""
        assert self.sliding_window is not None
        return max(0, position - self.sliding_window + 1) // self.block_size

    def _block_reservations(
        self, ids: list[int], seqs: list[SeqState], counts: list[int]
    ) -> list[tuple[bool, int]]:
        """Per sequence of a step: whether it copies its last block first (copy-on-write of a
        shared, partly filled block it writes into) and how many new blocks it takes. Raises,
        changing nothing, unless the pool and the int32 positions can take the step."""
        bs, reservations, need = self.block_size, [], 0
        holders: dict[
            int, int
        ] = {}  # shared last block -> holders left once this step's earlier copies are made
        for s, n in zip(seqs, counts):
            copy = False
            if n and s.length % bs:
                last = s.row.last
                left = holders.get(last, self._alloc.refcount(last))
                copy = left > 1  # when every holder is in this step, the last of them keeps it
                if copy:
                    holders[last] = left - 1
            grow = self._blocks_for(s.length + n) - s.row.len
            need += grow + copy
            reservations.append((copy, grow))
        if need > self._alloc.num_free:
            raise CacheFullError(
                f"begin_step: needs {need} free blocks, the pool has {self._alloc.num_free} "
                f"(of {self.num_blocks}); free or truncate sequences, or make the pool larger"
            )
        for sid, s, n in zip(ids, seqs, counts):
            if s.length + n > _MAX_TOKENS:  # (only a sliding window lets a sequence get this long)
                raise ValueError(
                    f"num_new_tokens: sequence {sid} would hold {s.length + n} tokens, "
                    f"more than 2**31 - 1"
                )
        return reservations

    def _append_tokens(self, s: SeqState, n: int, copy: bool, grow: int) -> None:
        """Reserves ``n`` slots at the end of ``s`` as :meth:`_block_reservations` said: a copy of its last block, ``grow``
        new blocks, then the release of blocks that fell out of the sliding window."""
        if copy:
            old, new = s.row.last, int(self._alloc.allocate(1)[0])
            for pool in (self._k, self._v, self._k_scales, self._v_scales):
                if pool is not None:
                    pool[:, new] = pool[:, old]
            self._alloc.decref(np.array([old]))  # held elsewhere too: it stays held
            s.row.set_last(new)
        if grow:
            s.row.append(self._alloc.allocate(grow))
        if self.sliding_window is not None and n:
            # the step's first query (position s.length) sees no key before this block
            self._alloc.decref(s.row.release_before(self._first_in_window(s.length)))
        s.length += n
        self._changed(s)

    def _changed(self, s: SeqState) -> None:
        """``s`` was truncated, freed or stepped: steps made before are stale (is_current)."""
        s.version += 1
        self._epoch += 1

    def is_current(self, step: Step) -> bool:
        """Whether ``step`` may still be attended: it was made by this cache and none of its
        sequences was truncated, freed or stepped again since."""
        if step._cache is self and step._epoch == self._epoch:
            return True  # nothing changed since the step began (asked once per layer: kept cheap)
        with self._lock:
            return step._cache is self and all(
                s.version == v for s, v in zip(step._seqs, step._versions)
            )


def _kv_dtype(dtype: Any) -> np.dtype[Any]:
    """The cache's storage dtype: a float or a quantised one, by any name
    :func:`attnx._validate.dtype_name` takes."""
    return _dtype(dtype, "dtype", _FLOAT_DTYPES + _QUANTISED_DTYPES)


def _id_list(seq_ids: Iterable[int]) -> list[Any]:
    """begin_step's ``seq_ids`` as a list (its entries checked later)."""
    try:
        return list(seq_ids)
    except TypeError:
        raise TypeError(
            f"seq_ids: expected a sequence of ids, got {type(seq_ids).__name__}"
        ) from None
