"""Context parallelism over ``torch.distributed``: attention whose keys and values are spread
over the ranks of a process group, merged exactly by log-sum-exp.

* :func:`attention` (decode, few queries): every rank holds the same queries and one contiguous
  shard of the keys, in rank order; each computes its partial ``(out, lse)``, the partials are
  all-gathered and merged, and every rank gets the exact result over all keys.
* :func:`ring_attention` (prefill, long queries): queries are sharded too; K/V shards travel
  round the ring (``isend``/``irecv`` overlapped with compute). With ``sharding="zigzag"`` (the
  default) rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` of the sequence cut into ``2W``
  (:func:`zigzag_shard`), so every rank does the same causal work.
* :class:`ShardedPagedKVCache`: one :class:`attnx.PagedKVCache` per rank, blocks dealt
  round-robin over the ranks, with a decode step that merges the ranks' partials.

Every call is collective: all ranks of the group make the same calls in the same order (SPMD).
Failures never hang: every exchange carries a status, so an error on one rank (bad input, a
full pool) makes every rank raise at once (the failing rank its own exception, the others
:class:`DistributedError` with its message); a rank that exits breaks its connections and the
others raise at once; a rank that is alive but never arrives makes the others raise
:class:`DistributedError` after the process group's timeout: pass
``timeout=datetime.timedelta(seconds=...)`` to ``torch.distributed.init_process_group``.

NumPy arrays and CPU tensors are accepted; results are of the kind the queries were. attnx
computes no gradients.
"""

from __future__ import annotations

try:
    import torch
    import torch.distributed  # noqa: F401
except ImportError as _exc:
    _NO_TORCH: ImportError | None = _exc
else:
    _NO_TORCH = None

if _NO_TORCH is None:
    from .collective import DistributedError
    from .ring import attention, ring_attention
    from .sharded_cache import ShardedPagedKVCache, ShardedStep
    from .zigzag import zigzag_positions, zigzag_shard, zigzag_unshard
else:
    # Without torch the package still imports, so that its pure-NumPy block planner
    # (attnx.distributed.segments) does; everything that communicates says what is missing.

    def __getattr__(name: str) -> object:
        if name in __all__:
            raise ImportError(
                "attnx.distributed needs PyTorch, whose torch.distributed is its transport: "
                "pip install torch"
            ) from _NO_TORCH
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DistributedError",
    "ShardedPagedKVCache",
    "ShardedStep",
    "attention",
    "ring_attention",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
]
