"""The zig-zag sharding of a sequence over ``W`` ranks: cut into ``2W`` chunks, rank ``r`` holds
chunks ``r`` and ``2W - 1 - r``, so every rank does the same causal work."""

from __future__ import annotations

import numpy as np
import torch

from .._validate import LAYOUTS as _LAYOUTS
from .._validate import choice, positive_int

__all__ = ["zigzag_positions", "zigzag_segments", "zigzag_shard", "zigzag_unshard"]


def _chunk_edges(seq_len, world):
    """Edges of the ``2 * world`` zig-zag chunks of a sequence (``np.array_split``'s sizes)."""
    n = 2 * world
    sizes = np.full(n, seq_len // n) + (np.arange(n) < seq_len % n)
    return np.concatenate([[0], np.cumsum(sizes)])


def zigzag_segments(seq_len, rank, world):
    """The ``(start, length)`` runs of global positions that rank ``rank`` holds, in its order."""
    e = _chunk_edges(seq_len, world)
    return [(int(e[c]), int(e[c + 1] - e[c])) for c in (rank, 2 * world - 1 - rank)]


def zigzag_positions(seq_len, rank, world):
    """Global positions (int64) of the rows that rank ``rank`` of ``world`` holds under the
    zig-zag split, in its local order (for RoPE): chunks ``rank`` and ``2*world - 1 - rank`` of
    the sequence cut into ``2*world`` near-equal chunks."""
    seq_len, world = positive_int(seq_len, "seq_len", 0), positive_int(world, "world")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world ({world}), got {rank!r}")
    return np.concatenate([np.arange(a, a + n) for a, n in zigzag_segments(seq_len, rank, world)])


def _seq_axis(ndim, layout):
    choice(layout, _LAYOUTS, "layout")
    return -3 if layout == "bshd" and ndim >= 3 else -2


def _slice(x, axis, a, b):
    return x[(Ellipsis, slice(a, b)) + (slice(None),) * (-axis - 1)]


def _cat(parts, axis):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


def zigzag_shard(x, rank, world, *, layout="bhsd"):
    """Rank ``rank``'s rows of a whole sequence ``x`` (array or tensor in attnx's layouts) for
    ``ring_attention(..., sharding="zigzag")``: its chunks ``rank`` and ``2*world - 1 - rank``
    of ``2*world`` (``np.array_split`` sizes), concatenated. Apply it to q, k and v alike."""
    axis = _seq_axis(x.ndim, layout)
    (a, n), (c, m) = zigzag_segments(x.shape[axis], rank, world)
    return _cat([_slice(x, axis, a, a + n), _slice(x, axis, c, c + m)], axis)


def zigzag_unshard(shards, *, layout="bhsd"):
    """The whole sequence from every rank's zig-zag shard (a list in rank order): the inverse
    of :func:`zigzag_shard`, e.g. to assemble :func:`ring_attention`'s outputs."""
    shards = list(shards)
    world = len(shards)
    if world == 0:
        raise ValueError("shards: expected one shard per rank, got none")
    axis = _seq_axis(shards[0].ndim, layout)
    total = sum(s.shape[axis] for s in shards)
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        (_, n), (_, m) = zigzag_segments(total, r, world)
        if s.shape[axis] != n + m:
            raise ValueError(
                f"shards[{r}]: expected {n + m} rows for a zig-zag split of {total} "
                f"over {world} ranks, got {s.shape[axis]}"
            )
        chunks[r], chunks[2 * world - 1 - r] = _slice(s, axis, 0, n), _slice(s, axis, n, n + m)
    return _cat(chunks, axis)
