"""The block pool's bookkeeping, apart from the pages it describes: a reference-counting
allocator of block ids, and the growable int32 block-table row each sequence keeps.

Neither holds a lock: their owner (:class:`attnx.PagedKVCache`) serialises every call.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["BlockAllocator", "BlockRow", "CacheFullError", "stack_rows"]


class CacheFullError(RuntimeError):
    """The block pool cannot satisfy a reservation; the cache is unchanged."""


class BlockAllocator:
    """Reference counts and a free list over the block ids ``0 .. num_blocks - 1``.

    A block is free at reference count 0 and held at 1 or more (one count per block-table entry
    that names it). :meth:`allocate` hands out free blocks at count 1, :meth:`incref` shares
    held ones, and :meth:`decref` returns a block to the free list when its count reaches 0.
    (Prefix caching will keep hashed blocks at count 0 out of the free list here, evictable least
    recently used first; :attr:`num_free` is what a reservation may count on.)

    Free blocks are handed out most recently returned first, then never-used ids in increasing
    order; the free list costs O(blocks returned) Python memory, whatever ``num_blocks`` is.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool.

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

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs = np.zeros(num_blocks, np.int32)
        self._fresh = 0  # every id >= _fresh has never been handed out
        self._returned: list[int] = []  # a stack of freed ids, popped before fresh ones

    @property
    def refs(self) -> np.ndarray:
        """Read-only view of the reference counts, int32 ``(num_blocks,)``."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out now."""
        return self.num_blocks - self._fresh + len(self._returned)

    def refcount(self, block: int) -> int:
        """The reference count of ``block``."""
        return int(self._refs[block])

    def free_ids(self) -> list[int]:
        """Every free block id, in the reverse of the order :meth:`allocate` hands them out
        (for checks and tests: O(num_blocks))."""
        return self._returned + list(range(self.num_blocks - 1, self._fresh - 1, -1))

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
        taken = self._returned[len(self._returned) - k:]
        del self._returned[len(self._returned) - k:]
        taken.reverse()  # the stack's top first
        taken.extend(range(self._fresh, self._fresh + n - k))
        self._fresh += n - k
        ids = np.array(taken, np.int32)
        self._refs[ids] = 1
        return ids

    def incref(self, blocks: np.ndarray) -> None:
        """One more reference to each of ``blocks`` (distinct held ids)."""
        self._refs[blocks] += 1

    def decref(self, blocks: np.ndarray) -> None:
        """One reference fewer to each of ``blocks`` (distinct held ids, checked before any
        change); those left at 0 join the free list in the given order."""
        blocks = np.asarray(blocks)
        if (self._refs[blocks] <= 0).any():
            raise ValueError("decref: a block that is not held")
        self._refs[blocks] -= 1
        self._returned.extend(blocks[self._refs[blocks] == 0].tolist())


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
        return self._data[:self.len]

    def held(self) -> np.ndarray:
        """The ids the row holds (its entries that are not -1), int32."""
        return self._data[self.released:self.len]

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
            grown[:self.len] = self._data[:self.len]
            self._data = grown
        self._data[self.len:end] = blocks
        self.len = end

    def cut(self, keep: int) -> np.ndarray:
        """Keeps the first ``keep <= len`` entries; returns the ids cut off that it held."""
        gone = self._data[max(keep, self.released):self.len].copy()
        self.len = keep
        self.released = min(self.released, keep)
        return gone

    def release_before(self, first: int) -> np.ndarray:
        """Sets entries ``[0, first)`` to -1; returns the ids that this releases (a copy)."""
        if first <= self.released:
            return self._data[:0]
        gone = self._data[self.released:first].copy()
        self._data[self.released:first] = -1
        self.released = first
        return gone

    def copy(self) -> BlockRow:
        """An independent row with the same entries."""
        row = BlockRow.__new__(BlockRow)
        row._data = self._data[:max(self.len, 1)].copy()
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
        out[:r.len] = r._data[:r.len]
    np.maximum(table, 0, out=table)
    return table
