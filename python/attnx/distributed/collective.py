"""The collective steps that attnx.distributed's calls share: every exchange carries a status, so
one rank's failure makes every rank raise (never hang), and the ranks check that they agree on
the arguments before they compute."""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

from .._validate import LAYOUTS as _LAYOUTS
from .._validate import as_array, choice, flag, from4, rank_lens, storage_dtype, to4

__all__ = [
    "BF16",
    "DTYPES",
    "SIGNATURE",
    "DistributedError",
    "agree",
    "as_numpy",
    "check_dtype",
    "comm",
    "digest",
    "gather",
    "global_key_lens",
    "inputs4",
    "lens_array",
    "like",
    "pack",
    "rank_world",
    "result4",
    "signature",
]

BF16 = storage_dtype("bfloat16")
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)


class DistributedError(RuntimeError):
    """Another rank of the group failed, exited, or did not arrive within the process group's
    timeout. ``failures`` maps each failed rank to ``(exception type name, message)``."""

    def __init__(self, message, failures=None):
        super().__init__(message)
        self.failures = dict(failures or {})


# ---- the group and its exchanges ---------------------------------------------------------------


def rank_world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attnx.distributed: torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(backend='gloo', timeout=datetime.timedelta("
            "seconds=60)) in every process first (torchrun provides the rendezvous)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def comm(what, fn, *args, **kw):
    """Run a torch.distributed call, turning its failures into one clear error."""
    try:
        return fn(*args, **kw)
    except RuntimeError as exc:  # (DistBackendError is a RuntimeError)
        raise DistributedError(
            f"{what}: communication failed: another rank raised, exited or did not arrive within "
            f"the process group's timeout (set by init_process_group(timeout=...)). "
            f"torch.distributed says: {exc}"
        ) from exc


def gather(what, buf, error, group, world):
    """All-gather one flat tensor per rank, whose element 0 carries this rank's status, as a
    ``(world, n)`` array. If any rank failed, every rank raises: the failed rank its own error,
    the others :class:`DistributedError` naming each failed rank and its message.

    Every rank must pass a tensor of the same size and dtype (gloo aborts the process on a
    mismatch): sizes come only from what the ranks already agreed on.
    """
    buf[0] = 0 if error is None else 1
    parts = [torch.empty_like(buf) for _ in range(world)]
    comm(what, dist.all_gather, parts, buf, group=group)
    table = torch.stack(parts).numpy()
    failed = np.flatnonzero(table[:, 0] != 0)
    if failed.size == 0:
        return table
    mine = None if error is None else (type(error).__name__, str(error))
    found = [None] * world
    comm(what, dist.all_gather_object, found, mine, group=group)
    if error is not None:
        raise error
    failures = {int(r): found[r] for r in failed}
    raise DistributedError(
        f"{what}: " + "; ".join(f"rank {r} raised {t}: {m}" for r, (t, m) in failures.items()),
        failures,
    )


def agree(what, error, values, names, group, world, *, local=()):
    """All-gather a few ints per rank (``values``, named ``names``) and check that the ranks
    agree on all of them except those in ``local``. Returns the ``(world, len(values))`` table."""
    buf = torch.zeros(1 + len(names), dtype=torch.int64)
    if error is None:
        buf[1:] = torch.tensor([int(x) for x in values], dtype=torch.int64)
    table = gather(what, buf, error, group, world)[:, 1:]
    for c, name in enumerate(names):
        if name not in local and (table[:, c] != table[0, c]).any():
            raise DistributedError(
                f"{what}: the ranks disagree on {name} (every rank must pass the "
                f"same): by rank {table[:, c].tolist()}"
            )
    return table


def digest(x):
    """A stable 31-bit digest of an optional argument, to check that the ranks agree on it."""
    if x is None:
        return -1
    return zlib.crc32(np.ascontiguousarray(x).tobytes()) & 0x7FFFFFFF


# ---- arrays and tensors --------------------------------------------------------------------------


def as_numpy(x, name):
    """A NumPy view of a NumPy array, a CPU tensor (bfloat16 through an int16 view) or anything
    array-like."""
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            raise TypeError(f"{name}: attnx computes no gradients; pass {name}.detach()")
        if x.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got one on {x.device}")
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BF16)
        return x.numpy()
    return as_array(x, name)


def like(a, as_torch):
    """``a`` as a tensor when the caller passed tensors (zero-copy), else as it is."""
    if not as_torch or a is None:
        return a
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def check_dtype(x, name, like=None):
    if x.dtype not in DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got dtype {x.dtype}")
    if like is not None and x.dtype != like.dtype:
        raise TypeError(f"{name}: dtype {x.dtype} differs from q's {like.dtype}")


def inputs4(q, k, v, layout):
    """q, k, v as (B, H, S, D) views with the attention's shape rules checked, and q's rank."""
    choice(layout, _LAYOUTS, "layout")
    q, k, v = as_numpy(q, "q"), as_numpy(k, "k"), as_numpy(v, "v")
    rank = q.ndim
    if rank not in (2, 3, 4):
        raise ValueError(
            f"q: expected rank 2 (S, D), 3 (H, S, D) or 4 (B, H, S, D), got shape {q.shape}"
        )
    check_dtype(q, "q")
    check_dtype(k, "k", q)
    check_dtype(v, "v", q)
    q4, k4, v4 = (to4(x, n, rank, layout) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    B, Hq, _, Dk = q4.shape
    if k4.shape[0] != B or k4.shape[3] != Dk:
        raise ValueError(f"k: expected batch {B} and Dk {Dk} like q, got shape {k.shape}")
    if v4.shape[:3] != k4.shape[:3]:
        raise ValueError(
            f"v: expected the batch, heads and length of k {k4.shape[:3]}, got shape {v.shape}"
        )
    if k4.shape[1] == 0 or Hq % k4.shape[1]:
        raise ValueError(
            f"k: the query heads ({Hq}) must be a multiple of the kv heads ({k4.shape[1]})"
        )
    return q4, k4, v4, rank


def global_key_lens(kv_lens, batch, total, rank):
    """The global valid key lengths ``(B,)`` as int64 (all ``total`` when None)."""
    a = lens_array(kv_lens, batch, rank)
    if a is None:
        return np.full(batch, total, np.int64)
    if (a < 0).any() or (a > total).any():
        raise ValueError(
            f"kv_lens: values must lie in [0, {total}] (the keys of all ranks), got {a.tolist()}"
        )
    return a


def signature(q4, k4, v4, rank, layout, causal, kv_lens, scale):
    """What every rank must agree on, as ints (names in SIGNATURE)."""
    B, Hq, _, Dk = q4.shape
    return [
        B,
        Hq,
        Dk,
        k4.shape[1],
        v4.shape[3],
        DTYPES.index(q4.dtype),
        rank,
        _LAYOUTS.index(layout),
        flag(causal, "causal"),
        digest(lens_array(kv_lens, B, rank)),
        digest(np.float64(scale)),
    ]


def lens_array(kv_lens, batch, rank):
    """kv_lens as int64 ``(B,)`` (None stays None); the range is checked once the total is known."""
    if kv_lens is None:
        return None
    a = np.asarray(rank_lens(kv_lens, rank))
    if a.dtype.kind not in "iu" or a.shape != (batch,):
        raise ValueError(f"kv_lens: expected {batch} ints (one per batch row), got {kv_lens!r}")
    return a.astype(np.int64)


SIGNATURE = [
    "batch",
    "query heads",
    "Dk",
    "kv heads",
    "Dv",
    "dtype",
    "rank",
    "layout",
    "causal",
    "kv_lens",
    "scale",
]


def result4(out4, lse4, dtype, rank, layout, as_torch, return_lse):
    """The merged float32 (B, Hq, S, Dv) result in the caller's dtype, layout, rank and kind."""
    out = from4(out4.astype(dtype, copy=False), rank, layout)
    out = np.ascontiguousarray(out) if as_torch else out
    if not return_lse:
        return like(out, as_torch)
    lse = lse4 if rank == 4 else lse4[0] if rank == 3 else lse4[0, 0]
    return like(out, as_torch), like(np.ascontiguousarray(lse), as_torch)


# ---- decode: every rank has the queries ----------------------------------------------------------


def pack(flat, part, n_out):
    """Write a partial ``(out, lse)`` (or None: no row saw a key) into a flat float32 buffer."""
    if part is None:
        flat[:n_out] = 0
        flat[n_out:] = -np.inf
    else:
        flat[:n_out].reshape(part[0].shape)[...] = part[0]
        flat[n_out:].reshape(part[1].shape)[...] = part[1]


# ---- prefill: ring attention ---------------------------------------------------------------------
