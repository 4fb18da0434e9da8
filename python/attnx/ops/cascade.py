"""Shared-prefix (cascade) attention over a paged cache: sequences of one step whose block tables
start with the same blocks (forks, prefix-cache hits) read those blocks once for all of them.

For each group of sequences sharing a run of blocks, the group's queries are stacked and attend
to the shared run in one call, as one sequence of many queries (a prefill tile: every key is
read once per kv head, whatever the number of queries); groups nest (a shared system prompt,
then each conversation's forks). Every sequence then attends to its own tail (its table shifted
past its deepest group's run) in one batched call, which merges each row's shared part in by
log-sum-exp before it writes the row (the kernel's ``prior_out``/``prior_lse``, the rule of
``row_state.h``; DESIGN.md, "Merging partial results"): no merge pass over the outputs in Python.

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
    """Sequences that share blocks, level by level: ``rows[g]`` (int64 sequence indices) share
    block ids ``[starts[g], blocks[g])`` (and every block before, in the enclosing groups);
    ``tokens[g]`` are their queries' indices in the packed batch."""

    __slots__ = ("rows", "starts", "blocks", "tokens")

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.starts: list[int] = []
        self.blocks: list[int] = []
        self.tokens: list[np.ndarray] = []

    def __bool__(self) -> bool:
        return bool(self.rows)


def plan_groups(block_tables: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray,
                block_size: int) -> Groups:
    """The groups worth splitting: sequences with the same first block share as many leading
    blocks as all of them hold equal and wholly before their queries; within a group, those with
    the same next block share a further run, and so on (a tree of shared prefixes: two
    conversations on one system prompt, each sampled several times)."""
    table = np.asarray(block_tables)
    groups = Groups()
    if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] == 0:
        return groups
    seq_lens = np.asarray(seq_lens, np.int64)
    q_lens = np.asarray(q_lens, np.int64)
    shareable = np.minimum((seq_lens - q_lens) // block_size, table.shape[1])
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    _split(table, shareable, np.flatnonzero(q_lens > 0), 0, block_size, q_start, groups)
    return groups


def _split(table: np.ndarray, shareable: np.ndarray, rows: np.ndarray, b0: int, block_size: int,
           q_start: np.ndarray, groups: Groups) -> None:
    """Adds the groups among ``rows`` (which share blocks ``[0, b0)``) that share blocks from
    ``b0`` on, then theirs. A loop over groups, never over blocks or tokens; a run too short to
    pay for its call ends that branch (its blocks stay in the members' tails)."""
    rows = rows[shareable[rows] > b0]
    if len(rows) < 2:
        return
    _, inverse, sizes = np.unique(table[rows, b0], return_inverse=True, return_counts=True)
    for g in np.flatnonzero(sizes >= 2):
        members = rows[inverse == g]
        width = int(shareable[members].min())
        same = (table[members, b0:width] == table[members[0], b0:width]).all(axis=0)
        b1 = b0 + int(len(same) if same.all() else np.argmin(same))
        if (b1 - b0) * block_size * (len(members) - 1) < max(MIN_SAVED_KEYS, 1):
            continue
        groups.rows.append(members)
        groups.starts.append(b0)
        groups.blocks.append(b1)
        groups.tokens.append(_token_indices(q_start, members))
        _split(table, shareable, members, b1, block_size, q_start, groups)


def _token_indices(q_start: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The packed indices of the queries of ``rows`` (no loop over rows)."""
    lens = q_start[rows + 1] - q_start[rows]
    offsets = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(q_start[rows], lens) + offsets


def tails(block_tables: np.ndarray, seq_lens: np.ndarray, groups: Groups, block_size: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's table and length past the blocks its groups share (others unchanged)."""
    table = np.asarray(block_tables)
    depth = np.zeros(table.shape[0], np.int64)
    for rows, p in zip(groups.rows, groups.blocks):
        depth[rows] = np.maximum(depth[rows], p)
    cols = np.minimum(np.arange(table.shape[1])[None] + depth[:, None], table.shape[1] - 1)
    return (np.take_along_axis(table, cols, axis=1).astype(np.int32),
            (np.asarray(seq_lens) - depth * block_size).astype(np.int32))


# run_tail(table, lens, prior) attends with each row's shared part (prior_out, prior_lse) merged
# in and returns (out, lse); run_shared(q, table, lens, q_lens) attends and returns (out, lse)
Prior = tuple[np.ndarray, np.ndarray]
TailFn = Callable[[np.ndarray, np.ndarray, Prior], tuple[np.ndarray, np.ndarray]]
SharedFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def attend(q: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray, groups: Groups,
           block_size: int, run_tail: TailFn, run_shared: SharedFn) -> tuple[np.ndarray, np.ndarray]:
    """The attention of the packed queries ``q`` ``(N, Hq, D)`` (float32, so the shared parts
    are kept at full precision) over their whole sequences: each group's shared run in one call,
    then the tails in one call that merges the shared parts in. Returns ``(out, lse)``."""
    prior = shared_parts(q, block_tables, groups, block_size, run_shared)
    table, lens = tails(block_tables, seq_lens, groups, block_size)
    return run_tail(table, lens, prior)


def shared_parts(q: np.ndarray, block_tables: np.ndarray, groups: Groups, block_size: int,
                 run_shared: SharedFn) -> Prior:
    """Each query's attention over the blocks its groups share, float32 ``(out, lse)``: lse
    ``-inf`` (and out 0) for a query in no group. A nested group's part merges into its
    enclosing group's (the merge is associative); a top-level group's tokens have none yet."""
    bt = np.asarray(block_tables)
    parts: list[np.ndarray] = []  # [out, lse], once the first call gives Dv
    for rows, p0, p, tok in zip(groups.rows, groups.starts, groups.blocks, groups.tokens):
        shared = bt[rows[0], p0:p][None].astype(np.int32)
        keys = (p - p0) * block_size
        # the paged kernel takes at most as many queries as keys in one sequence: a group with
        # more queries than shared keys (many samples of a short prefix) reads it once per chunk
        for chunk in np.array_split(tok, -(-len(tok) // keys)):
            o_s, l_s = run_shared(q[chunk], shared, np.array([keys], np.int32),
                                  np.array([len(chunk)], np.int32))
            if not parts:
                parts = [np.zeros((len(q),) + o_s.shape[1:], np.float32),
                         np.full((len(q), o_s.shape[1]), -np.inf, np.float32)]
            out, lse = parts
            if p0 > 0:
                o_s, l_s = merge_attention([out[chunk], o_s], [lse[chunk], l_s])
            out[chunk], lse[chunk] = o_s, l_s
    assert parts, "attend needs at least one group"
    return parts[0], parts[1]
