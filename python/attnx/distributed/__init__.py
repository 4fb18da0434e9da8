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

import numbers
import zlib

import numpy as np

try:
    import torch
    import torch.distributed as dist
except ImportError as _exc:  # pragma: no cover - the tests skip without torch
    raise ImportError("attnx.distributed needs PyTorch, whose torch.distributed is its transport: "
                      "pip install torch") from _exc

from .segments import segment_attention
from .._validate import LAYOUTS as _LAYOUTS, as_array, choice, flag, from4, optional_real, positive_int, rank_lens
from .._validate import storage_dtype, to4
from ..cache import CacheFullError, PagedKVCache, StaleStepError
from ..ops.merge import merge_attention

__all__ = ["attention", "ring_attention", "zigzag_shard", "zigzag_unshard", "zigzag_positions",
           "ShardedPagedKVCache", "ShardedStep", "DistributedError"]

_BF16 = storage_dtype("bfloat16")
_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), _BF16)
_SHARDINGS = ("zigzag", "contiguous")


class DistributedError(RuntimeError):
    """Another rank of the group failed, exited, or did not arrive within the process group's
    timeout. ``failures`` maps each failed rank to ``(exception type name, message)``."""

    def __init__(self, message, failures=None):
        super().__init__(message)
        self.failures = dict(failures or {})


# ---- the group and its exchanges ---------------------------------------------------------------

def _rank_world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attnx.distributed: torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(backend='gloo', timeout=datetime.timedelta("
            "seconds=60)) in every process first (torchrun provides the rendezvous)")
    return dist.get_rank(group), dist.get_world_size(group)


def _comm(what, fn, *args, **kw):
    """Run a torch.distributed call, turning its failures into one clear error."""
    try:
        return fn(*args, **kw)
    except RuntimeError as exc:  # (DistBackendError is a RuntimeError)
        raise DistributedError(
            f"{what}: communication failed: another rank raised, exited or did not arrive within "
            f"the process group's timeout (set by init_process_group(timeout=...)). "
            f"torch.distributed says: {exc}") from exc


def _gather(what, buf, error, group, world):
    """All-gather one flat tensor per rank, whose element 0 carries this rank's status, as a
    ``(world, n)`` array. If any rank failed, every rank raises: the failed rank its own error,
    the others :class:`DistributedError` naming each failed rank and its message.

    Every rank must pass a tensor of the same size and dtype (gloo aborts the process on a
    mismatch): sizes come only from what the ranks already agreed on.
    """
    buf[0] = 0 if error is None else 1
    parts = [torch.empty_like(buf) for _ in range(world)]
    _comm(what, dist.all_gather, parts, buf, group=group)
    table = torch.stack(parts).numpy()
    failed = np.flatnonzero(table[:, 0] != 0)
    if failed.size == 0:
        return table
    mine = None if error is None else (type(error).__name__, str(error))
    found = [None] * world
    _comm(what, dist.all_gather_object, found, mine, group=group)
    if error is not None:
        raise error
    failures = {int(r): found[r] for r in failed}
    raise DistributedError(
        f"{what}: " + "; ".join(f"rank {r} raised {t}: {m}" for r, (t, m) in failures.items()),
        failures)


def _agree(what, error, values, names, group, world, *, local=()):
    """All-gather a few ints per rank (``values``, named ``names``) and check that the ranks
    agree on all of them except those in ``local``. Returns the ``(world, len(values))`` table."""
    buf = torch.zeros(1 + len(names), dtype=torch.int64)
    if error is None:
        buf[1:] = torch.tensor([int(x) for x in values], dtype=torch.int64)
    table = _gather(what, buf, error, group, world)[:, 1:]
    for c, name in enumerate(names):
        if name not in local and (table[:, c] != table[0, c]).any():
            raise DistributedError(f"{what}: the ranks disagree on {name} (every rank must pass the "
                                   f"same): by rank {table[:, c].tolist()}")
    return table


def _digest(x):
    """A stable 31-bit digest of an optional argument, to check that the ranks agree on it."""
    if x is None:
        return -1
    return zlib.crc32(np.ascontiguousarray(x).tobytes()) & 0x7FFFFFFF


# ---- arrays and tensors --------------------------------------------------------------------------

def _numpy(x, name):
    """A NumPy view of a NumPy array, a CPU tensor (bfloat16 through an int16 view) or anything
    array-like."""
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            raise TypeError(f"{name}: attnx computes no gradients; pass {name}.detach()")
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(_BF16)
        return x.numpy()
    return as_array(x, name)


def _like(a, as_torch):
    """``a`` as a tensor when the caller passed tensors (zero-copy), else as it is."""
    if not as_torch or a is None:
        return a
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _check_dtype(x, name, like=None):
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got dtype {x.dtype}")
    if like is not None and x.dtype != like.dtype:
        raise TypeError(f"{name}: dtype {x.dtype} differs from q's {like.dtype}")


def _inputs4(q, k, v, layout):
    """q, k, v as (B, H, S, D) views with the attention's shape rules checked, and q's rank."""
    choice(layout, _LAYOUTS, "layout")
    q, k, v = _numpy(q, "q"), _numpy(k, "k"), _numpy(v, "v")
    rank = q.ndim
    if rank not in (2, 3, 4):
        raise ValueError(f"q: expected rank 2 (S, D), 3 (H, S, D) or 4 (B, H, S, D), got shape {q.shape}")
    _check_dtype(q, "q")
    _check_dtype(k, "k", q)
    _check_dtype(v, "v", q)
    q4, k4, v4 = (to4(x, n, rank, layout) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    B, Hq, _, Dk = q4.shape
    if k4.shape[0] != B or k4.shape[3] != Dk:
        raise ValueError(f"k: expected batch {B} and Dk {Dk} like q, got shape {k.shape}")
    if v4.shape[:3] != k4.shape[:3]:
        raise ValueError(f"v: expected the batch, heads and length of k {k4.shape[:3]}, got shape {v.shape}")
    if k4.shape[1] == 0 or Hq % k4.shape[1]:
        raise ValueError(f"k: the query heads ({Hq}) must be a multiple of the kv heads ({k4.shape[1]})")
    return q4, k4, v4, rank


def _key_lens(kv_lens, batch, total, rank):
    """The global valid key lengths ``(B,)`` as int64 (all ``total`` when None)."""
    a = _lens_array(kv_lens, batch, rank)
    if a is None:
        return np.full(batch, total, np.int64)
    if (a < 0).any() or (a > total).any():
        raise ValueError(f"kv_lens: values must lie in [0, {total}] (the keys of all ranks), got {a.tolist()}")
    return a


def _signature(q4, k4, v4, rank, layout, causal, kv_lens, scale):
    """What every rank must agree on, as ints (names in _SIGNATURE)."""
    B, Hq, _, Dk = q4.shape
    return [B, Hq, Dk, k4.shape[1], v4.shape[3], _DTYPES.index(q4.dtype), rank,
            _LAYOUTS.index(layout), flag(causal, "causal"), _digest(_lens_array(kv_lens, B, rank)),
            _digest(np.float64(scale))]


def _lens_array(kv_lens, batch, rank):
    """kv_lens as int64 ``(B,)`` (None stays None); the range is checked once the total is known."""
    if kv_lens is None:
        return None
    a = np.asarray(rank_lens(kv_lens, rank))
    if a.dtype.kind not in "iu" or a.shape != (batch,):
        raise ValueError(f"kv_lens: expected {batch} ints (one per batch row), got {kv_lens!r}")
    return a.astype(np.int64)


_SIGNATURE = ["batch", "query heads", "Dk", "kv heads", "Dv", "dtype", "rank", "layout", "causal",
              "kv_lens", "scale"]


def _result(out4, lse4, dtype, rank, layout, as_torch, return_lse):
    """The merged float32 (B, Hq, S, Dv) result in the caller's dtype, layout, rank and kind."""
    out = from4(out4.astype(dtype, copy=False), rank, layout)
    out = np.ascontiguousarray(out) if as_torch else out
    if not return_lse:
        return _like(out, as_torch)
    lse = lse4 if rank == 4 else lse4[0] if rank == 3 else lse4[0, 0]
    return _like(out, as_torch), _like(np.ascontiguousarray(lse), as_torch)


# ---- decode: every rank has the queries ----------------------------------------------------------

def attention(q, k_local, v_local, *, causal=False, kv_lens=None, scale=None, group=None,
              layout="bhsd", return_lse=False):
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
    me, world = _rank_world(group)
    what = "attnx.distributed.attention"
    as_torch = isinstance(q, torch.Tensor)
    error, values = None, None
    try:
        q4, k4, v4, rank = _inputs4(q, k_local, v_local, layout)
        scale = optional_real(scale, "scale")
        values = [k4.shape[2], q4.shape[2]] + _signature(q4, k4, v4, rank, layout, causal, kv_lens, scale)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    table = _agree(what, error, values, ["keys", "queries"] + _SIGNATURE, group, world, local=("keys",))
    sizes = table[:, 0]
    B, Hq, Sq, Dv = q4.shape[0], q4.shape[1], q4.shape[2], v4.shape[3]
    key_lens = _key_lens(kv_lens, B, int(sizes.sum()), rank)  # the same on every rank
    n_out, n_lse = B * Hq * Sq * Dv, B * Hq * Sq
    buf = torch.zeros(1 + n_out + n_lse, dtype=torch.float32)
    error = None
    try:
        part = segment_attention(q4, k4, v4, q_start=0, k_start=int(sizes[:me].sum()), q_total=Sq,
                                 key_lens=key_lens, causal=causal, scale=scale)
        _pack(buf.numpy()[1:], part, n_out)
    except Exception as exc:  # noqa: BLE001
        error = exc
    table = _gather(what, buf, error, group, world)
    outs = [row[1:1 + n_out].reshape(B, Hq, Sq, Dv) for row in table]
    lses = [row[1 + n_out:].reshape(B, Hq, Sq) for row in table]
    out4, lse4 = merge_attention(outs, lses)
    return _result(out4, lse4, q4.dtype, rank, layout, as_torch, return_lse)


def _pack(flat, part, n_out):
    """Write a partial ``(out, lse)`` (or None: no row saw a key) into a flat float32 buffer."""
    if part is None:
        flat[:n_out] = 0
        flat[n_out:] = -np.inf
    else:
        flat[:n_out].reshape(part[0].shape)[...] = part[0]
        flat[n_out:].reshape(part[1].shape)[...] = part[1]


# ---- prefill: ring attention ---------------------------------------------------------------------

def _chunk_edges(seq_len, world):
    """Edges of the ``2 * world`` zig-zag chunks of a sequence (``np.array_split``'s sizes)."""
    n = 2 * world
    sizes = np.full(n, seq_len // n) + (np.arange(n) < seq_len % n)
    return np.concatenate([[0], np.cumsum(sizes)])


def _zigzag_segments(seq_len, rank, world):
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
    return np.concatenate([np.arange(a, a + n) for a, n in _zigzag_segments(seq_len, rank, world)])


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
    (a, n), (c, m) = _zigzag_segments(x.shape[axis], rank, world)
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
        (_, n), (_, m) = _zigzag_segments(total, r, world)
        if s.shape[axis] != n + m:
            raise ValueError(f"shards[{r}]: expected {n + m} rows for a zig-zag split of {total} "
                             f"over {world} ranks, got {s.shape[axis]}")
        chunks[r], chunks[2 * world - 1 - r] = _slice(s, axis, 0, n), _slice(s, axis, n, n + m)
    return _cat(chunks, axis)


def _segments(sizes, sharding, what):
    """Every rank's (start, length) runs of global positions, from the ranks' local sizes."""
    total = int(sizes.sum())
    if sharding == "contiguous":
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return [[(int(starts[r]), int(sizes[r]))] for r in range(len(sizes))]
    segs = [_zigzag_segments(total, r, len(sizes)) for r in range(len(sizes))]
    held = [n + m for (_, n), (_, m) in segs]
    if held != sizes.tolist():
        raise ValueError(f"{what}: sharding='zigzag' needs rank r to hold chunks r and 2W-1-r of the "
                         f"sequence cut into 2W (zigzag_shard): {held} {what} by rank for {total} "
                         f"in all, got {sizes.tolist()}")
    return segs


def _kv_block(k4, v4):
    """This rank's keys and values as one contiguous byte buffer (what travels round the ring);
    never empty (gloo is happier with a byte than with nothing)."""
    kb = np.ascontiguousarray(k4).view(np.uint8).reshape(-1)
    vb = np.ascontiguousarray(v4).view(np.uint8).reshape(-1)
    block = np.empty(max(1, kb.size + vb.size), np.uint8)
    block[:kb.size], block[kb.size:kb.size + vb.size] = kb, vb
    return torch.from_numpy(block)


def _kv_views(block, shape_k, shape_v, dtype):
    flat = block.numpy()
    nk = int(np.prod(shape_k)) * dtype.itemsize
    nv = int(np.prod(shape_v)) * dtype.itemsize
    return (flat[:nk].view(dtype).reshape(shape_k), flat[nk:nk + nv].view(dtype).reshape(shape_v))


def ring_attention(q_local, k_local, v_local, *, causal=False, kv_lens=None, scale=None, group=None,
                   layout="bhsd", sharding="zigzag", return_lse=False):
    """Attention with queries, keys and values all sharded over the group (prefill): returns
    this rank's query rows of ``attnx.attention(Q, K, V, ...)`` over the whole sequences.

    K/V shards travel round the ring, ``world - 1`` hops, each sent with ``isend``/``irecv``
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
    me, world = _rank_world(group)
    what = "attnx.distributed.ring_attention"
    as_torch = isinstance(q_local, torch.Tensor)
    error, values = None, None
    try:
        choice(sharding, _SHARDINGS, "sharding")
        q4, k4, v4, rank = _inputs4(q_local, k_local, v_local, layout)
        scale = optional_real(scale, "scale")
        values = [q4.shape[2], k4.shape[2], _SHARDINGS.index(sharding)] + _signature(
            q4, k4, v4, rank, layout, causal, kv_lens, scale)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    table = _agree(what, error, values, ["queries", "keys", "sharding"] + _SIGNATURE, group, world,
                   local=("queries", "keys"))
    q_segs = _segments(table[:, 0], sharding, "queries")
    k_segs = _segments(table[:, 1], sharding, "keys")
    key_lens = _key_lens(kv_lens, q4.shape[0], int(table[:, 1].sum()), rank)
    q_total = int(table[:, 0].sum())
    acc, error = None, None
    try:
        acc = _ring(q4, k4, v4, q_segs, k_segs, table[:, 1], dict(
            q_total=q_total, key_lens=key_lens, causal=causal, scale=scale), group, me, world, what)
    except DistributedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a local failure; the ring has completed
        error = exc
    _gather(what, torch.zeros(1), error, group, world)
    out4 = np.concatenate([o for o, _ in acc], axis=2)
    lse4 = np.concatenate([l for _, l in acc], axis=2)
    return _result(out4, lse4, q4.dtype, rank, layout, as_torch, return_lse)


def _ring(q4, k4, v4, q_segs, k_segs, key_sizes, where, group, rank, world, what):
    """The ring: ``world`` steps; at step ``s`` this rank computes against the K/V block of rank
    ``rank - s`` while it passes that block on and receives the next. A local failure stops the
    compute, not the passing on, so that the ring completes on every rank."""
    B, Hq, _, _ = q4.shape
    Hkv, Dk, Dv = k4.shape[1], k4.shape[3], v4.shape[3]
    dtype = q4.dtype
    acc = [(np.zeros((B, Hq, n, Dv), np.float32), np.full((B, Hq, n), -np.inf, np.float32))
           for _, n in q_segs[rank]]
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
            reqs = [_comm(what, dist.isend, block, peer(nxt_rank), group=group),
                    _comm(what, dist.irecv, incoming, peer(prv_rank), group=group)]
        if failure is None:
            try:
                n = int(key_sizes[src])
                ks, vs = _kv_views(block, (B, Hkv, n, Dk), (B, Hkv, n, Dv), dtype)
                _accumulate(acc, q4, ks, vs, q_segs[rank], k_segs[src], where)
            except Exception as exc:  # noqa: BLE001 - reported after the ring
                failure = exc
        for req in reqs:
            _comm(what, req.wait)
        block = incoming
    if failure is not None:
        raise failure
    return acc


def _accumulate(acc, q4, k4, v4, q_runs, k_runs, where):
    """Merge the partials of this rank's query runs against one block's key runs into ``acc``."""
    q_off = 0
    for i, (qa, nq) in enumerate(q_runs):
        qs = q4[:, :, q_off:q_off + nq]
        q_off += nq
        k_off = 0
        for ka, nk in k_runs:
            part = segment_attention(qs, k4[:, :, k_off:k_off + nk], v4[:, :, k_off:k_off + nk],
                                     q_start=qa, k_start=ka, **where)
            k_off += nk
            if part is not None:
                o, l = acc[i]
                acc[i] = merge_attention([o, part[0].astype(np.float32, copy=False)], [l, part[1]])


# ---- a paged KV cache sharded over the ranks ----------------------------------------------------

class ShardedPagedKVCache:
    """A paged KV cache whose sequences are spread over the ranks of a process group: one
    :class:`attnx.PagedKVCache` per rank (``local``), and a decode step that merges the ranks'
    partial results, so a context may be as long as all the ranks' pools together.

    Placement: blocks are dealt round-robin. Token ``t`` of a sequence lives on rank
    ``(t // block_size) % world``: each rank's local copy of the sequence holds its blocks in
    order (its local token ``i`` is the ``i``-th of its global positions), every rank's pages fill
    evenly, and each rank reads ``1/world`` of the context per step. A rank holds at most one
    partly filled block per sequence.

    Every rank makes the same calls in the same order with the same arguments (the new tokens'
    q, k and v included: a replicated model); each stores only its own tokens. Arguments are
    those of :class:`attnx.PagedKVCache` (no sliding window or ``value_from_key``) plus ``group``.

    Examples
    --------
    ::

        cache = ShardedPagedKVCache(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=4096)
        seq = cache.new_sequence()
        step = cache.begin_step([seq], [len(prompt)])    # then one token per step
        for layer in range(30):
            q, k, v = project(x, layer, step.positions)  # the same on every rank
            o = step.attend(layer, q, k, v)              # the exact result, on every rank
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size=16,
                 dtype="float32", value_dim=None, *, group=None):
        self.rank, self.world = _rank_world(group)
        self.group = group
        self.local = PagedKVCache(num_layers, num_kv_heads, head_dim, num_blocks, block_size,
                                  dtype, value_dim)
        self.block_size = self.local.block_size
        self._lengths = {}  # sequence -> global length
        self._versions = {}  # sequence -> changes, to refuse a stale step
        self._num_q_heads = None  # agreed by the ranks at the first attend

    def owner(self, positions):
        """The rank that stores each global token position."""
        return (np.asarray(positions, np.int64) // self.block_size) % self.world

    def local_length(self, length, rank=None):
        """How many of a sequence's first ``length`` tokens rank ``rank`` (default this one) holds."""
        rank = self.rank if rank is None else rank
        bs, lap = self.block_size, self.block_size * self.world
        length = np.asarray(length, np.int64)
        return length // lap * bs + np.clip(length % lap - rank * bs, 0, bs)

    def new_sequence(self):
        seq = self.local.new_sequence()
        self._lengths[seq], self._versions[seq] = 0, 0
        return seq

    def fork(self, seq):
        """A new sequence sharing ``seq``'s blocks on every rank (copy-on-write, as
        :meth:`attnx.PagedKVCache.fork`)."""
        child = self.local.fork(seq)
        self._lengths[child], self._versions[child] = self._lengths[seq], 0
        return child

    def truncate(self, seq, length):
        """Keep the first ``length`` tokens (global) of ``seq``."""
        n = self.length(seq)
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or not 0 <= length <= n:
            raise ValueError(f"length: expected an int in [0, {n}], got {length!r}")
        self.local.truncate(seq, int(self.local_length(length)))
        self._lengths[seq] = int(length)
        self._versions[seq] += 1

    def free(self, seq):
        self.local.free(seq)
        del self._lengths[seq], self._versions[seq]

    def length(self, seq):
        """Tokens in ``seq`` over all ranks."""
        self.local.length(seq)  # the local cache's error for an unknown id
        return self._lengths[seq]

    def stats(self):
        """This rank's pool figures (:meth:`attnx.PagedKVCache.stats`), with ``rank`` and ``world``."""
        return dict(self.local.stats(), rank=self.rank, world=self.world)

    def begin_step(self, seq_ids, num_new_tokens):
        """Reserve the new tokens' slots on the ranks that store them, all or none on every rank.

        Raises :class:`attnx.CacheFullError` on every rank (and changes nothing) if any rank's
        pool cannot hold its share. Returns a :class:`ShardedStep`.
        """
        what = "ShardedPagedKVCache.begin_step"
        ids, counts = list(seq_ids), list(num_new_tokens)
        error, step, starts = None, None, None
        try:
            if len(ids) != len(counts):
                raise ValueError(f"num_new_tokens: expected {len(ids)} counts (one per sequence), got {len(counts)}")
            for n in counts:
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                    raise ValueError(f"num_new_tokens: expected ints >= 0, got {counts!r}")
            starts = np.array([self.length(s) for s in ids], np.int64)
            ends = starts + np.asarray(counts, np.int64)
            step = self.local.begin_step(ids, (self.local_length(ends) - self.local_length(starts)).tolist())
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
        try:
            _agree(what, error, [_digest(np.array(ids + counts, np.int64))], ["sequences and counts"],
                   self.group, self.world)
        except DistributedError as exc:
            if step is not None:  # another rank failed: undo this rank's reservation
                for s, a in zip(ids, starts):
                    self.local.truncate(s, int(self.local_length(a)))
            if exc.failures and all(t == "CacheFullError" for t, _ in exc.failures.values()):
                raise CacheFullError(str(exc)) from exc
            raise
        for s, n in zip(ids, counts):
            self._lengths[s] += int(n)
            self._versions[s] += 1
        return ShardedStep(self, ids, starts, np.asarray(counts, np.int64), step)


class ShardedStep:
    """One step of a :class:`ShardedPagedKVCache`: the new tokens, packed in sequence order.

    Attributes (global, the same on every rank): ``seq_ids``, ``q_lens``, ``seq_lens``,
    ``positions`` (of every new token, for RoPE), ``num_tokens``.
    """

    def __init__(self, cache, ids, starts, counts, local_step):
        self._cache, self._local = cache, local_step
        self.seq_ids = ids
        self.q_lens = counts.astype(np.int32)
        self.seq_lens = (starts + counts).astype(np.int32)
        self.num_tokens = int(counts.sum())
        seq_index = np.repeat(np.arange(len(ids)), counts)
        self.positions = (np.arange(self.num_tokens) - np.repeat(np.cumsum(counts) - counts, counts)
                          + starts[seq_index]).astype(np.int32)
        self._versions = [cache._versions[s] for s in ids]
        self._mine = cache.owner(self.positions) == cache.rank
        # a token stored elsewhere sees this rank's tokens before it: a prefix of the local copy
        self._seen = cache.local_length(self.positions).astype(np.int32)
        self._seq_index = seq_index
        tables = [cache.local.block_table(s) for s in ids]
        self._tables = np.zeros((len(ids), max([len(t) for t in tables] + [1])), np.int32)
        for row, t in zip(self._tables, tables):
            row[:len(t)] = t

    def attend(self, layer, q, k, v, *, scale=None, return_lse=False):
        """Store this rank's share of the new keys and values of layer ``layer`` and return the
        exact attention of every new query over its whole sequence, on every rank.

        ``q (T, Hq, head_dim)``, ``k (T, num_kv_heads, head_dim)``, ``v (T, num_kv_heads,
        value_dim)``: all the step's new tokens, the same on every rank. Each new query sees
        its sequence's tokens up to itself (causal). Returns ``(T, Hq, value_dim)`` of q's dtype
        (and lse ``(T, Hq)``); tensors if ``q`` is.

        Cost: one all-gather of every rank's partial, ``T·Hq·(value_dim + 1)·4`` bytes sent per
        rank; the pages never move.
        """
        cache = self._cache
        what = "ShardedStep.attend"
        as_torch = isinstance(q, torch.Tensor)
        hq = self._agree_heads(q)
        T, Dv = self.num_tokens, cache.local.value_dim
        n_out = T * hq * Dv
        buf = torch.zeros(1 + n_out + T * hq, dtype=torch.float32)
        error, dtype = None, None
        try:
            q, k, v = _numpy(q, "q"), _numpy(k, "k"), _numpy(v, "v")
            self._check(q, k, v, hq)
            dtype = q.dtype
            _pack(buf.numpy()[1:], self._partial(layer, q, k, v, scale), n_out)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
        table = _gather(what, buf, error, cache.group, cache.world)
        out, lse = merge_attention([row[1:1 + n_out].reshape(T, hq, Dv) for row in table],
                                   [row[1 + n_out:].reshape(T, hq) for row in table])
        out = _like(out.astype(dtype, copy=False), as_torch)
        return (out, _like(lse, as_torch)) if return_lse else out

    def _agree_heads(self, q):
        """The query heads, agreed by all ranks once per cache: every later exchange's size
        follows from it (a size mismatch would abort gloo, not raise)."""
        cache = self._cache
        if cache._num_q_heads is None:
            error, hq = None, None
            try:
                shape = _numpy(q, "q").shape
                if len(shape) != 3:
                    raise ValueError(f"q: expected shape (T, Hq, head_dim), got {shape}")
                hq = shape[1]
            except Exception as exc:  # noqa: BLE001
                error = exc
            table = _agree("ShardedStep.attend", error, [hq], ["query heads"], cache.group, cache.world)
            cache._num_q_heads = int(table[0, 0])
        return cache._num_q_heads

    def _check(self, q, k, v, hq):
        cache, T = self._cache.local, self.num_tokens
        for name, x, want in (("q", q, (T, hq, cache.head_dim)),
                              ("k", k, (T, cache.num_kv_heads, cache.head_dim)),
                              ("v", v, (T, cache.num_kv_heads, cache.value_dim))):
            if x.shape != want:
                raise ValueError(f"{name}: expected shape {want} (this step's tokens), got {x.shape}")
        _check_dtype(q, "q")
        if any(self._cache._versions.get(s) != ver for s, ver in zip(self.seq_ids, self._versions)):
            raise StaleStepError("attend: a sequence of this step was truncated, freed or stepped "
                                 "again since begin_step")

    def _partial(self, layer, q, k, v, scale):
        """This rank's float32 partial over its own tokens: the queries of the tokens it stores
        through its local step (which writes their k and v first), the others through
        ``paged_attention`` over the prefix of its tokens that precede them."""
        from ..ops.paged import paged_attention

        cache = self._cache.local
        T, hq = q.shape[:2]
        q32 = q.astype(np.float32, copy=False)  # partials in float32; rounded once, after the merge
        out = np.zeros((T, hq, cache.value_dim), np.float32)
        lse = np.full((T, hq), -np.inf, np.float32)
        mine = self._mine
        if mine.any():
            out[mine], lse[mine] = self._local.attend(layer, q32[mine], k[mine], v[mine], scale=scale,
                                                      return_lse=True)
        rest = ~mine & (self._seen > 0)
        if rest.any():
            out[rest], lse[rest] = paged_attention(
                q32[rest], cache.k_pages(layer), cache.v_pages(layer),
                self._tables[self._seq_index[rest]], self._seen[rest],
                q_lens=np.ones(int(rest.sum()), np.int32), causal=True, scale=scale, return_lse=True)
        return out, lse
