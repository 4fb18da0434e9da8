"""Attention over keys and values spread over the ranks: :func:`attention` (decode: the partials
all-gathered and merged) and :func:`ring_attention` (prefill: K/V shards travel round the ring).

:func:`ring_attention`: K/V shards travel round the ring, ``world - 1`` hops, each sent with ``isend``/``irecv``
while the rank computes on the shard it holds; partials merge by log-sum-exp.

Parameters
----------
q_local, k_local, v_local : this rank's rows, layouts, ranks and dtypes as in
    :func:`attnx.attention` (NumPy arrays or CPU tensors).
sharding : ``"zigzag"`` (default) or ``"contiguous"``
    ``"zigzag"``: the sequence is cut into ``2W`` near-equal chunks (``np.array_split``) and
    rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, concatenated, of q, k and v
    (:func:`zigzag_shard` makes them, :func:`zigzag_positions` gives their positions): each
    rank then has the same causal work, and a (query chunk, key chunk) pair is either fully
    visible, the causal diagonal or skipped. ``"contiguous"``: rank ``r`` holds the ``r``-th
    contiguous run of the queries and of the keys, any sizes (empty too); causal ranks then
    wait on the triangle's long rows.
causal : bool
    Bottom-right aligned over the whole sequences, as :func:`attnx.attention`; with equal
    query and key lengths the usual lower triangle.
kv_lens : int array ``(B,)``, optional: valid lengths of the whole key sequence.
scale, return_lse, group : as in :func:`attention`.

Returns
-------
out (and lse): this rank's rows, in its local order.

Cost: each rank receives every other rank's K and V once (``B·Hkv·Sk·(Dk + Dv)`` elements
in all), overlapped with its compute, plus two all-gathers of a few ints.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from .._validate import choice, optional_real
from ..ops.merge import merge_attention
from .collective import (
    SIGNATURE,
    DistributedError,
    agree,
    comm,
    gather,
    global_key_lens,
    inputs4,
    pack,
    rank_world,
    result4,
    signature,
)
from .segments import segment_attention
from .zigzag import zigzag_segments

__all__ = ["attention", "ring_attention"]

_SHARDINGS = ("zigzag", "contiguous")


def attention(
    q,
    k_local,
    v_local,
    *,
    causal=False,
    kv_lens=None,
    scale=None,
    group=None,
    layout="bhsd",
    return_lse=False,
):
    """Attention of the same queries on every rank against keys sharded over the group.

    Rank ``r`` holds the ``r``-th contiguous shard of the keys and values (any sizes, empty
    ones included); the result, on every rank, is ``attnx.attention(q, K, V, ...)`` with ``K``,
    ``V`` the shards concatenated in rank order.

    Parameters
    ----------
    q : ``(B, Hq, Sq, Dk)`` (or ``"bshd"``, ranks 3 and 2, as :func:`attnx.attention`), the same
        on every rank. float32, float16 or bfloat16; NumPy array or CPU tensor.
    k_local, v_local : this rank's shard ``(B, Hkv, Sk_r, Dk)``, ``(B, Hkv, Sk_r, Dv)``.
    causal : bool
        Bottom-right aligned over the whole: the queries are the last ``Sq`` positions, so row
        ``i`` sees global key ``j`` iff ``j <= i + Lk - Sq``. A shard is masked by its global
        positions (full visibility, ``causal``, or a right window; never an ``(Sq, Sk)`` mask,
        except for causal attention whose ``kv_lens`` end within ``Sq`` keys of a shard's end
        at different distances per batch row).
    kv_lens : int array ``(B,)``, optional
        Valid lengths of the whole (global) key sequence, the same on every rank.
    scale, layout, return_lse : as in :func:`attnx.attention`.
    group : a ``torch.distributed`` process group (default: the world).

    Returns
    -------
    out (and lse): as :func:`attnx.attention` returns them, on every rank; tensors if ``q`` is.

    Cost: per call, one all-gather of a few ints (shard sizes and a check that the ranks agree)
    and one of every rank's partial ``(out, lse)`` in float32: ``B·Hq·Sq·(Dv + 1)·4`` bytes sent
    per rank, ``world`` times that received. The keys and values never move.
    """
    me, world = rank_world(group)
    what = "attnx.distributed.attention"
    as_torch = isinstance(q, torch.Tensor)
    check = partial(_attention_inputs, q, k_local, v_local, layout, causal, kv_lens, scale)
    (q4, k4, v4, rank, scale), table = _agreed(
        what, group, world, ["keys", "queries"], ("keys",), check
    )
    sizes = table[:, 0]
    key_lens = global_key_lens(kv_lens, q4.shape[0], int(sizes.sum()), rank)  # same on every rank
    k_start = int(sizes[:me].sum())
    outs, lses = _gathered_partials(
        what, q4, k4, v4, k_start, key_lens, causal, scale, group, world
    )
    out4, lse4 = merge_attention(outs, lses)
    return result4(out4, lse4, q4.dtype, rank, layout, as_torch, return_lse)


def _agreed(what, group, world, names, local, check):
    """``check()`` on every rank, which returns ``(inputs, values)``; then the ranks agree: a
    rank's failure is raised on every rank, and so is a difference between their values (named
    ``names``) other than in ``local``. Returns ``(inputs, table)``, a row of values per rank."""
    error, inputs, values = None, None, None
    try:
        inputs, values = check()
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    return inputs, agree(what, error, values, names + SIGNATURE, group, world, local=local)


def _attention_inputs(q, k_local, v_local, layout, causal, kv_lens, scale):
    """``attention``'s arguments checked: ``(q4, k4, v4, rank, scale)`` and the values the ranks
    must agree on (the local key count first)."""
    q4, k4, v4, rank = inputs4(q, k_local, v_local, layout)
    scale = optional_real(scale, "scale")
    values = [k4.shape[2], q4.shape[2]] + signature(
        q4, k4, v4, rank, layout, causal, kv_lens, scale
    )
    return (q4, k4, v4, rank, scale), values


def _gathered_partials(what, q4, k4, v4, k_start, key_lens, causal, scale, group, world):
    """Every rank's partial ``(out, lse)`` of the queries against its shard (whose first key is
    global key ``k_start``), all-gathered: two lists, in rank order."""
    B, Hq, Sq, Dv = q4.shape[0], q4.shape[1], q4.shape[2], v4.shape[3]
    n_out, n_lse = B * Hq * Sq * Dv, B * Hq * Sq
    buf = torch.zeros(1 + n_out + n_lse, dtype=torch.float32)
    error = None
    try:
        part = segment_attention(
            q4,
            k4,
            v4,
            q_start=0,
            k_start=k_start,
            q_total=Sq,
            key_lens=key_lens,
            causal=causal,
            scale=scale,
        )
        pack(buf.numpy()[1:], part, n_out)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    table = gather(what, buf, error, group, world)
    outs = [row[1 : 1 + n_out].reshape(B, Hq, Sq, Dv) for row in table]
    lses = [row[1 + n_out :].reshape(B, Hq, Sq) for row in table]
    return outs, lses


def _ring_inputs(q_local, k_local, v_local, layout, sharding, causal, kv_lens, scale):
    """``ring_attention``'s arguments checked: ``(q4, k4, v4, rank, scale)`` and the values the
    ranks must agree on (the local query and key counts first)."""
    choice(sharding, _SHARDINGS, "sharding")
    q4, k4, v4, rank = inputs4(q_local, k_local, v_local, layout)
    scale = optional_real(scale, "scale")
    values = [q4.shape[2], k4.shape[2], _SHARDINGS.index(sharding)] + signature(
        q4, k4, v4, rank, layout, causal, kv_lens, scale
    )
    return (q4, k4, v4, rank, scale), values


def _segments(sizes, sharding, what):
    """Every rank's (start, length) runs of global positions, from the ranks' local sizes."""
    total = int(sizes.sum())
    if sharding == "contiguous":
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return [[(int(starts[r]), int(sizes[r]))] for r in range(len(sizes))]
    segs = [zigzag_segments(total, r, len(sizes)) for r in range(len(sizes))]
    held = [n + m for (_, n), (_, m) in segs]
    if held != sizes.tolist():
        raise ValueError(
            f"{what}: sharding='zigzag' needs rank r to hold chunks r and 2W-1-r of the "
            f"sequence cut into 2W (zigzag_shard): {held} {what} by rank for {total} "
            f"in all, got {sizes.tolist()}"
        )
    return segs


def _kv_block(k4, v4):
    """This rank's keys and values as one contiguous byte buffer (what travels round the ring);
    never empty (gloo is happier with a byte than with nothing)."""
    kb = np.ascontiguousarray(k4).view(np.uint8).reshape(-1)
    vb = np.ascontiguousarray(v4).view(np.uint8).reshape(-1)
    block = np.empty(max(1, kb.size + vb.size), np.uint8)
    block[: kb.size], block[kb.size : kb.size + vb.size] = kb, vb
    return torch.from_numpy(block)


def _kv_views(block, shape_k, shape_v, dtype):
    flat = block.numpy()
    nk = int(np.prod(shape_k)) * dtype.itemsize
    nv = int(np.prod(shape_v)) * dtype.itemsize
    return (flat[:nk].view(dtype).reshape(shape_k), flat[nk : nk + nv].view(dtype).reshape(shape_v))


def ring_attention(
    q_local,
    k_local,
    v_local,
    *,
    causal=False,
    kv_lens=None,
    scale=None,
    group=None,
    layout="bhsd",
    sharding="zigzag",
    return_lse=False,
):
    """Attention with queries, keys and values all sharded over the group (prefill): returns
    this rank's query rows of ``attnx.attention(Q, K, V, ...)`` over the whole sequences.
    (Parameters, results and an example: :mod:`attnx.distributed.ring`.)"""
    me, world = rank_world(group)
    what = "attnx.distributed.ring_attention"
    as_torch = isinstance(q_local, torch.Tensor)
    check = partial(
        _ring_inputs, q_local, k_local, v_local, layout, sharding, causal, kv_lens, scale
    )
    names, local = ["queries", "keys", "sharding"], ("queries", "keys")
    (q4, k4, v4, rank, scale), table = _agreed(what, group, world, names, local, check)
    q_segs = _segments(table[:, 0], sharding, "queries")
    k_segs = _segments(table[:, 1], sharding, "keys")
    key_lens = global_key_lens(kv_lens, q4.shape[0], int(table[:, 1].sum()), rank)
    q_total = int(table[:, 0].sum())
    acc, error = None, None
    try:
        acc = _ring(
            q4,
            k4,
            v4,
            q_segs,
            k_segs,
            table[:, 1],
            dict(q_total=q_total, key_lens=key_lens, causal=causal, scale=scale),
            group,
            me,
            world,
            what,
        )
    except DistributedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a local failure; the ring has completed
        error = exc
    gather(what, torch.zeros(1), error, group, world)
    out4 = np.concatenate([o for o, _ in acc], axis=2)
    lse4 = np.concatenate([l for _, l in acc], axis=2)
    return result4(out4, lse4, q4.dtype, rank, layout, as_torch, return_lse)


def _ring(q4, k4, v4, q_segs, k_segs, key_sizes, where, group, rank, world, what):
    """The ring: ``world`` steps; at step ``s`` this rank computes against the K/V block of rank
    ``rank - s`` while it passes that block on and receives the next. A local failure stops the
    compute, not the passing on, so that the ring completes on every rank."""
    B, Hq, _, _ = q4.shape
    Hkv, Dk, Dv = k4.shape[1], k4.shape[3], v4.shape[3]
    dtype = q4.dtype
    acc = [
        (np.zeros((B, Hq, n, Dv), np.float32), np.full((B, Hq, n), -np.inf, np.float32))
        for _, n in q_segs[rank]
    ]
    nxt_rank = rank + 1 if rank + 1 < world else 0
    prv_rank = rank - 1 if rank > 0 else world - 1
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    block, failure = _kv_block(k4, v4), None
    for step in range(world):
        src = (rank - step) % world
        reqs, incoming = [], None
        if step < world - 1:
            n_in = max(1, int(key_sizes[(src - 1) % world]) * B * Hkv * (Dk + Dv) * dtype.itemsize)
            incoming = torch.empty(n_in, dtype=torch.uint8)
            reqs = [
                comm(what, dist.isend, block, peer(nxt_rank), group=group),
                comm(what, dist.irecv, incoming, peer(prv_rank), group=group),
            ]
        if failure is None:
            try:
                n = int(key_sizes[src])
                ks, vs = _kv_views(block, (B, Hkv, n, Dk), (B, Hkv, n, Dv), dtype)
                _accumulate(acc, q4, ks, vs, q_segs[rank], k_segs[src], where)
            except Exception as exc:  # noqa: BLE001 - reported after the ring
                failure = exc
        for req in reqs:
            comm(what, req.wait)
        block = incoming
    if failure is not None:
        raise failure
    return acc


def _accumulate(acc, q4, k4, v4, q_runs, k_runs, where):
    """Merge the partials of this rank's query runs against one block's key runs into ``acc``."""
    q_off = 0
    for i, (qa, nq) in enumerate(q_runs):
        qs = q4[:, :, q_off : q_off + nq]
        q_off += nq
        k_off = 0
        for ka, nk in k_runs:
            part = segment_attention(
                qs,
                k4[:, :, k_off : k_off + nk],
                v4[:, :, k_off : k_off + nk],
                q_start=qa,
                k_start=ka,
                **where,
            )
            k_off += nk
            if part is not None:
                o, l = acc[i]
                acc[i] = merge_attention([o, part[0].astype(np.float32, copy=False)], [l, part[1]])


# ---- a paged KV cache sharded over the ranks ----------------------------------------------------
