"""The prefix registry's side of a sequence: its token ids and the extra key that the block
digests chain from (:mod:`attnx.cache.blocks` keeps the digests and the cached blocks)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["extra_bytes", "token_ids"]


def token_ids(tokens: Any, name: str, n: int | None = None) -> np.ndarray:
    """``tokens`` as an int64 array ``(len,)`` (of length ``n`` when given)."""
    a = np.asarray(tokens)
    if a.ndim != 1 or not (a.dtype.kind in "iu" or (a.size == 0 and a.dtype.kind == "f")):
        raise TypeError(
            f"{name}: expected a 1-d sequence of integer token ids, got "
            f"{'shape ' + str(a.shape) if a.ndim != 1 else 'dtype ' + a.dtype.name}"
        )
    if n is not None and len(a) != n:
        raise ValueError(f"{name}: expected {n} token ids, got {len(a)}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: token ids must fit in int64")
    return a.astype(np.int64)


def extra_bytes(extra_key: Any) -> bytes:
    """The extra key (None, str, bytes or int) as bytes, tagged by type so that 1 != "1"."""
    if extra_key is None:
        return b""
    if isinstance(extra_key, bytes):
        return b"b" + extra_key
    if isinstance(extra_key, str):
        return b"s" + extra_key.encode()
    if isinstance(extra_key, (int, np.integer)) and not isinstance(extra_key, bool):
        return b"i" + str(int(extra_key)).encode()
    raise TypeError(f"extra_key: expected None, str, bytes or int, got {type(extra_key).__name__}")
