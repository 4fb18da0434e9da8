"""The block pool's bookkeeping, apart from the pages it describes: a reference-counting
allocator of block ids (with, optionally, the registry of full blocks by prefix digest and their
least-recently-used eviction), and the growable int32 block-table row each sequence keeps.

Neither holds a lock: their owner (:class:`attnx.PagedKVCache`) serialises every call.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "BlockAllocator",
    "BlockRow",
    "CacheFullError",
    "Cached",
    "block_digest",
    "root_digest",
    "stack_rows",
]

_DIGEST_BYTES = (
    32  # blake2b-256: a collision is not a practical concern, and a hit is checked anyway
)


def root_digest(extra_key: bytes) -> bytes:
    """The digest a sequence's first block chains from: it carries the sequence's extra key (an
    adapter or image id, as bytes), so every block digest depends on it."""
    return hashlib.blake2b(b"attnx-prefix-v1\0" + extra_key, digest_size=_DIGEST_BYTES).digest()


def block_digest(parent: bytes, tokens: np.ndarray) -> bytes:
    """The digest of a full block: its parent's digest and its token ids (as little-endian int64)."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
    h.update(np.ascontiguousarray(tokens, "<i8").tobytes())
    return h.digest()


class Cached(NamedTuple):
    """What a registered block holds: its digest, its parent's digest and its token ids. A hit
    compares the last two with the lookup's, so a digest collision cannot attach a block with
    other contents."""

    digest: bytes
    parent: bytes
    tokens: bytes  # int64 little-endian


class CacheFullError(RuntimeError):
    """The block pool cannot satisfy a reservation; the cache is unchanged."""


class BlockAllocator:
    """Reference counts and a free list over the block ids ``0 .. num_blocks - 1``.

    A block is free at reference count 0 and held at 1 or more (one count per block-table entry
    that names it). :meth:`allocate` hands out free blocks at count 1, :meth:`incref` shares
    held ones, and :meth:`decref` returns a block to the free list when its count reaches 0.
    With ``caching``, a full block may be registered under its prefix digest (:meth:`register`).
    A registered block whose count drops to 0 keeps its contents and stays findable
    (:meth:`match`); it is *evictable*: :meth:`allocate` takes it, dropping its digest, only when
    no plain free block is left, least recently released first. :attr:`num_free` counts
    evictable blocks too: it is what a reservation may count on. A held block is never evicted.

    Free blocks are handed out most recently returned first, then never-used ids in increasing
    order, then evictable ones; the free list costs O(blocks returned) Python memory, whatever
    ``num_blocks`` is.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool.
    caching : bool
        Keep the registry of full blocks by digest (prefix caching).

    Examples
    --------
    >>> a = BlockAllocator(4)
    >>> a.allocate(2).tolist(), a.num_free
    ([0, 1], 2)
    >>> a.incref(np.array([1])); a.decref(np.array([0, 1])); a.refs.tolist(), a.num_free
    ([0, 1, 0, 0], 3)
    >>> a.allocate(1).tolist()
    [0]
    """

    def __init__(self, num_blocks: int, caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self._refs = np.zeros(num_blocks, np.int32)
        self._fresh = 0  # every id >= _fresh has never been handed out
        self._returned: list[int] = []  # a stack of freed ids, popped before fresh ones
        self._by_digest: dict[bytes, int] = {}  # registered blocks (held or evictable)
        self._cached: dict[int, Cached] = {}  # block -> what it was registered with
        self._evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # registered at count 0, oldest first
        self.evictions = 0

    @property
    def refs(self) -> np.ndarray:
        """Read-only view of the reference counts, int32 ``(num_blocks,)``."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out now."""
        return self.num_blocks - self._fresh + len(self._returned) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered blocks, held or evictable."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        """Registered blocks at reference count 0."""
        return len(self._evictable)

    def evictable_ids(self) -> list[int]:
        """The evictable blocks, the next to be evicted first (for checks and tests)."""
        return list(self._evictable)

    def cached(self) -> dict[int, Cached]:
        """Every registered block and what it holds (a copy, for checks and tests)."""
        return dict(self._cached)

    def refcount(self, block: int) -> int:
        """The reference count of ``block``."""
        return int(self._refs[block])

    def free_ids(self) -> list[int]:
        """Every free block id, in the reverse of the order :meth:`allocate` hands them out
        (for checks and tests: O(num_blocks))."""
        return (
            self._returned
            + list(range(self.num_blocks - 1, self._fresh - 1, -1))
            + list(reversed(self._evictable))
        )

    def allocate(self, n: int) -> np.ndarray:
        """``n`` free block ids at reference count 1, int32 ``(n,)``; all or none.

        Raises
        ------
        CacheFullError
            Fewer than ``n`` blocks are free (nothing is allocated).
        """
        if n > self.num_free:
            raise CacheFullError(f"allocate: needs {n} free blocks, the pool has {self.num_free}")
        k = min(n, len(self._returned))
        taken = self._returned[len(self._returned) - k :]
        del self._returned[len(self._returned) - k :]
        taken.reverse()  # the stack's top first
        fresh = min(n - k, self.num_blocks - self._fresh)
        taken.extend(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        for _ in range(n - k - fresh):  # only then evict, least recently released first
            block, _ = self._evictable.popitem(last=False)
            self.forget(block)
            self.evictions += 1
            taken.append(block)
        ids = np.array(taken, np.int32)
        self._refs[ids] = 1
        return ids

    def incref(self, blocks: np.ndarray) -> None:
        """One more reference to each of ``blocks`` (distinct ids, held or evictable: a prefix
        hit takes evictable ones back)."""
        if self._evictable:
            for b in np.asarray(blocks)[self._refs[blocks] == 0].tolist():
                del self._evictable[b]
        self._refs[blocks] += 1

    def decref(self, blocks: np.ndarray) -> None:
        """One reference fewer to each of ``blocks`` (distinct held ids, checked before any
        change). Those left at 0 join the free list in the given order, or, if registered, the
        evictable ones in the reverse order (a sequence's blocks are released in token order, and
        the tail of a chain is the least likely to be hit again)."""
        blocks = np.asarray(blocks)
        if (self._refs[blocks] <= 0).any():
            raise ValueError("decref: a block that is not held")
        self._refs[blocks] -= 1
        zeroed = blocks[self._refs[blocks] == 0].tolist()
        if not self._cached:
            self._returned.extend(zeroed)
            return
        self._returned.extend(b for b in zeroed if b not in self._cached)
        self._evictable.update((b, None) for b in reversed(zeroed) if b in self._cached)

    # ---- the prefix registry -------------------------------------------------------------------
    def register(self, block: int, digest: bytes, parent: bytes, tokens: np.ndarray) -> bool:
        """Registers the held, full ``block`` under ``digest``; False (nothing changes) where the
        digest already names a block (the same contents computed twice: the first one stays)
        or the block is registered already."""
        if digest in self._by_digest or block in self._cached:
            return False
        self._by_digest[digest] = block
        self._cached[block] = Cached(digest, parent, np.ascontiguousarray(tokens, "<i8").tobytes())
        return True

    def forget(self, block: int) -> None:
        """Drops ``block``'s digest, if it has one (its contents are about to change). An
        evictable block becomes a plain free one."""
        entry = self._cached.pop(block, None)
        if entry is None:
            return
        del self._by_digest[entry.digest]
        if block in self._evictable:
            del self._evictable[block]
            self._returned.append(block)

    def match(
        self, root: bytes, tokens: np.ndarray, block_size: int
    ) -> tuple[list[int], list[bytes]]:
        """The longest run of registered blocks that holds ``tokens`` from the start of a
        sequence whose chain starts at ``root``: their ids and digests (takes no reference).
        Only whole blocks of ``tokens`` are looked up."""
        blocks: list[int] = []
        digests: list[bytes] = []
        parent = root
        for i in range(len(tokens) // block_size):
            chunk = np.ascontiguousarray(tokens[i * block_size : (i + 1) * block_size], "<i8")
            digest = block_digest(parent, chunk)
            block = self._by_digest.get(digest)
            if block is None:
                break
            entry = self._cached[block]
            if entry.parent != parent or entry.tokens != chunk.tobytes():
                break  # a digest collision: not the same contents
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return blocks, digests


class BlockRow:
    """One sequence's block table: an int32 row that grows in place (capacity doubles), so a
    step appends blocks in amortised O(1) and never rebuilds the row.

    Entries ``[0, len)`` are block ids in token order, -1 where a block was released (the
    sliding window releases a prefix: entries ``[0, released)``); entries past ``len`` are spare
    capacity, never read.
    """

    __slots__ = ("_data", "len", "released")

    def __init__(self, capacity: int = 4) -> None:
        self._data = np.zeros(max(capacity, 1), np.int32)
        self.len = 0
        self.released = 0

    @property
    def ids(self) -> np.ndarray:
        """The row, int32 ``(len,)``: a view, valid until the row next grows."""
        return self._data[: self.len]

    def held(self) -> np.ndarray:
        """The ids the row holds (its entries that are not -1), int32."""
        return self._data[self.released : self.len]

    @property
    def last(self) -> int:
        """The last block id (the row is not empty)."""
        return int(self._data[self.len - 1])

    def set_last(self, block: int) -> None:
        """Replaces the last block id (copy-on-write)."""
        self._data[self.len - 1] = block

    def append(self, blocks: np.ndarray) -> None:
        """Appends ``blocks`` (int32), doubling the capacity when it runs out."""
        end = self.len + len(blocks)
        if end > len(self._data):
            grown = np.zeros(max(end, 2 * len(self._data)), np.int32)
            grown[: self.len] = self._data[: self.len]
            self._data = grown
        self._data[self.len : end] = blocks
        self.len = end

    def cut(self, keep: int) -> np.ndarray:
        """Keeps the first ``keep <= len`` entries; returns the ids cut off that it held."""
        gone = self._data[max(keep, self.released) : self.len].copy()
        self.len = keep
        self.released = min(self.released, keep)
        return gone

    def release_before(self, first: int) -> np.ndarray:
        """Sets entries ``[0, first)`` to -1; returns the ids that this releases (a copy)."""
        if first <= self.released:
            return self._data[:0]
        gone = self._data[self.released : first].copy()
        self._data[self.released : first] = -1
        self.released = first
        return gone

    def copy(self) -> BlockRow:
        """An independent row with the same entries."""
        row = BlockRow.__new__(BlockRow)
        row._data = self._data[: max(self.len, 1)].copy()
        row.len, row.released = self.len, self.released
        return row


def stack_rows(rows: Sequence[BlockRow]) -> np.ndarray:
    """The rows as one int32 table ``(len(rows), max(len, 1))``, padded with 0; released entries
    (-1) read as 0 too (they lie outside every window, so any valid id will do).

    One slice copy per row (a loop over the rows, never over their blocks): for the few rows of
    a step this is about twice as fast as one masked scatter of their concatenation.
    """
    table = np.zeros((len(rows), max([r.len for r in rows] + [1])), np.int32)
    for out, r in zip(table, rows):
        out[: r.len] = r._data[: r.len]
    np.maximum(table, 0, out=table)
    return table
