"""Shared-prefix (cascade) attention over a paged cache: sequences of one step whose block tables
start with the same blocks (forks, prefix-cache hits) read those blocks once for all of them.

For each group of sequences sharing a leading run of ``P`` blocks, the group's queries are
stacked and attend to the shared blocks in one call, as one sequence of many queries (a prefill
tile: every key is read once per kv head, whatever the number of queries); every sequence then
attends to its own tail (its table shifted by ``P`` blocks) in one batched call, and the two
parts merge by their log-sum-exp (DESIGN.md, "Merging partial results").

A block is shared only if it lies wholly before every query of each sequence of the group, so it
is fully visible to all of them and the bottom-right causal alignment of the tail is unchanged.
Positional variants that depend on where the query is (windows, ALiBi) and sinks (to be counted
once) are not split: the callers use the plain path for them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .merge import merge_attention

__all__ = ["plan_groups", "attend"]

# A group is split off only when it saves at least this many key reads per kv head (shared
# tokens times the sharing sequences but one): below it, the extra calls and the merge cost more
# than the reads they save. Tests set it to 0 to split every group.
MIN_SAVED_KEYS = 512


class Groups:
    """Sequences that share leading blocks: ``rows[g]`` (int64 sequence indices) share their
    first ``blocks[g]`` block ids; ``tokens[g]`` are their queries' indices in the packed batch."""

    __slots__ = ("rows", "blocks", "tokens")

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.blocks: list[int] = []
        self.tokens: list[np.ndarray] = []

    def __bool__(self) -> bool:
        return bool(self.rows)


def plan_groups(block_tables: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray,
                block_size: int) -> Groups:
    """The groups worth splitting: sequences with the same first block, and as many leading
    blocks as all of them hold equal and wholly before their queries. (One level: sequences that
    share more than their group's common run read the rest in their tails.)"""
    table = np.asarray(block_tables)
    groups = Groups()
    if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] == 0:
        return groups
    seq_lens = np.asarray(seq_lens, np.int64)
    q_lens = np.asarray(q_lens, np.int64)
    shareable = np.minimum((seq_lens - q_lens) // block_size, table.shape[1])
    cand = np.flatnonzero((shareable > 0) & (q_lens > 0))
    if len(cand) < 2:
        return groups
    firsts, inverse, sizes = np.unique(table[cand, 0], return_inverse=True, return_counts=True)
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    for g in np.flatnonzero(sizes >= 2):
        rows = cand[inverse == g]
        width = int(shareable[rows].min())
        same = (table[rows, :width] == table[rows[0], :width]).all(axis=0)
        p = int(width if same.all() else np.argmin(same))
        if p * block_size * (len(rows) - 1) < MIN_SAVED_KEYS or p == 0:
            continue
        groups.rows.append(rows)
        groups.blocks.append(p)
        groups.tokens.append(_token_indices(q_start, rows))
    return groups


def _token_indices(q_start: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The packed indices of the queries of ``rows`` (no loop over rows)."""
    lens = q_start[rows + 1] - q_start[rows]
    offsets = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(q_start[rows], lens) + offsets


def tails(block_tables: np.ndarray, seq_lens: np.ndarray, groups: Groups, block_size: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's table and length past its group's shared blocks (others unchanged)."""
    table = np.array(block_tables, np.int32, copy=True)
    lens = np.array(seq_lens, np.int32, copy=True)
    for rows, p in zip(groups.rows, groups.blocks):
        table[rows, :table.shape[1] - p] = table[rows, p:]
        lens[rows] -= p * block_size
    return table, lens


# run_tail(table, lens) and run_shared(q, table, lens, q_lens) attend and return (out, lse)
TailFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
SharedFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def attend(q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray, groups: Groups,
           block_size: int, run_tail: TailFn, run_shared: SharedFn) -> tuple[np.ndarray, np.ndarray]:
    """The attention of the packed queries ``q`` ``(N, Hq, D)`` (float32 or float64, so the
    parts merge at full precision) over their whole sequences: the tails in one call, each
    group's shared blocks in one call, merged. Returns ``(out, lse)``."""
    table, lens = tails(block_tables, seq_lens, groups, block_size)
    out, lse = run_tail(table, lens)
    bt = np.asarray(block_tables)
    for rows, p, tok in zip(groups.rows, groups.blocks, groups.tokens):
        shared = bt[rows[0], :p][None].astype(np.int32)
        keys = p * block_size
        # the paged kernel takes at most as many queries as keys in one sequence: a group with
        # more queries than shared keys (many samples of a short prefix) reads it once per chunk
        for chunk in np.array_split(tok, -(-len(tok) // keys)):
            o_s, l_s = run_shared(q[chunk], shared, np.array([keys], np.int32),
                                  np.array([len(chunk)], np.int32))
            out[chunk], lse[chunk] = merge_attention([out[chunk], o_s], [lse[chunk], l_s])
    return out, lse
