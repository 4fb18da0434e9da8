"""Shared-prefix (cascade) attention over a paged cache: sequences of one step whose block tables
start with the same blocks (forks, prefix-cache hits) read those blocks once for all of them.

The C++ core does the work (``cpp/src/cascade.h``): for each group of sequences sharing a run of
blocks, the group's queries are stacked and attend to the shared run as one sequence of many
queries (a prefill tile: every key is read once per kv head, whatever the number of queries);
groups nest (a shared system prompt, then each conversation's forks). Every sequence then attends
to its own tail (its table shifted past its deepest group's run), and each row's parts merge by
log-sum-exp (``cpp/src/attention/state.h``; docs/numerics.md, "The online-softmax state") before it is written. A
cache step plans its groups once (``_core.StepPlan``) and every layer's call reuses them;
:func:`attnx.paged_attention` plans them per call (``min_shared_keys``).

A block is shared only if it lies wholly before every query of each sequence of the group, so it
is fully visible to all of them and the bottom-right causal alignment of the tail is unchanged.
Positional variants that depend on where the query is (windows, ALiBi) and sinks (to be counted
once) are not split: the core runs the plain path for them.

This module holds the policy (``MIN_SAVED_KEYS``) and :func:`plan_groups`, the groups as the
core finds them (for ``Step.shared_prefix`` and the tests).
"""

from __future__ import annotations

import numpy as np

from .. import _core

__all__ = ["MIN_SAVED_KEYS", "plan_groups"]

# A group is split off only when it saves at least this many key reads per kv head (shared
# tokens times the sharing sequences but one): below it, the extra pass and the merge cost more
# than the reads they save. Tests set it to 0 to split every group (before a step's first attend).
MIN_SAVED_KEYS = 512


class Groups:
    """Sequences that share blocks, level by level: ``rows[g]`` (int64 sequence indices) share
    block ids ``[starts[g], blocks[g])`` (and every block before, in the enclosing groups);
    ``tokens[g]`` are their queries' indices in the packed batch."""

    __slots__ = ("blocks", "rows", "starts", "tokens")

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.starts: list[int] = []
        self.blocks: list[int] = []
        self.tokens: list[np.ndarray] = []

    def __bool__(self) -> bool:
        return bool(self.rows)


def plan_groups(
    block_tables: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray, block_size: int
) -> Groups:
    """The groups worth splitting, as the core plans them: sequences with the same first block
    share as many leading blocks as all of them hold equal and wholly before their queries;
    within a group, those with the same next block share a further run, and so on (a tree of
    shared prefixes: two conversations on one system prompt, each sampled several times)."""
    table = np.asarray(block_tables)
    groups = Groups()
    if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] == 0:
        return groups
    q_lens = np.asarray(q_lens, np.int64)
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    for rows, start, end in _core.plan_cascade(table, seq_lens, q_lens, block_size, MIN_SAVED_KEYS):
        members = np.asarray(rows, np.int64)
        groups.rows.append(members)
        groups.starts.append(start)
        groups.blocks.append(end)
        groups.tokens.append(_token_indices(q_start, members))
    return groups


def _token_indices(q_start: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The packed indices of the queries of ``rows`` (no loop over rows)."""
    lens = q_start[rows + 1] - q_start[rows]
    offsets = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(q_start[rows], lens) + offsets
