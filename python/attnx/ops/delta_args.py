"""Argument rules of the gated delta rule, shared by ``attnx.gated_delta_rule`` and its reference
twin (NumPy only: the reference must not import the C++ core).

Everything is checked here before anything is computed, and every error names the argument.
The result is a :class:`DeltaArgs`: the arrays viewed in ``(B, T, H, D)`` order (never copied
here) and the sequences as ``(batch row, start, length)`` rows.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .._validate import LAYOUTS, choice

__all__ = ["DeltaArgs", "delta_args", "from_bshd"]


@dataclass
class DeltaArgs:
    q: np.ndarray  # (B, T, Hk, K)
    k: np.ndarray  # (B, T, Hk, K)
    v: np.ndarray  # (B, T, Hv, V)
    g: np.ndarray  # (B, T, Hv) or (B, T, Hv, K)
    beta: np.ndarray  # (B, T, Hv)
    sequences: np.ndarray  # (N, 3) int64: batch row, first position, length
    initial_state: np.ndarray | None  # (N, Hv, K, V)
    scale: float


def _float(x, name):
    a = np.asarray(x)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected a float array, got dtype {a.dtype}")
    return a


def _time_major(a, name, rank, layout):
    """``a`` (rank 3 or 4, in `layout`) as a (B, T, H[, D]) view."""
    if a.ndim != rank:
        order = "(B, T, H" if layout == "bshd" else "(B, H, T"
        want = order + (", D)" if rank == 4 else ")")
        raise ValueError(
            f"{name}: expected {rank} dims {want} for layout={layout!r}, got shape {a.shape}"
        )
    return a if layout == "bshd" else a.swapaxes(1, 2)


def from_bshd(x, layout):
    """The inverse of the layout view for an output (B, T, H, D)."""
    return x if layout == "bshd" else x.swapaxes(1, 2)


def _int_vector(x, name):
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TypeError(f"{name}: expected a 1-D integer array, got {a.dtype} of shape {a.shape}")
    return a.astype(np.int64)


def _sequences(B, T, cu_seqlens, lengths):
    """(N, 3) rows (batch row, start, length) from cu_seqlens, lengths or neither."""
    if cu_seqlens is not None and lengths is not None:
        raise ValueError("cu_seqlens, lengths: give one of them, not both")
    if cu_seqlens is not None:
        cu = _int_vector(cu_seqlens, "cu_seqlens")
        if B != 1:
            raise ValueError(f"cu_seqlens: sequences packed along T need B == 1, got B={B}")
        if cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > T:
            raise ValueError(
                f"cu_seqlens: expected 0 = c[0] <= c[1] <= ... <= c[N] <= T={T}, got {cu.tolist()}"
            )
        n = cu.size - 1
        return np.stack([np.zeros(n, np.int64), cu[:-1], np.diff(cu)], axis=1)
    if lengths is not None:
        lens = _int_vector(lengths, "lengths")
        if lens.shape != (B,) or np.any(lens < 0) or np.any(lens > T):
            raise ValueError(f"lengths: expected (B={B},) ints in [0, T={T}], got {lens.tolist()}")
        return np.stack([np.arange(B, dtype=np.int64), np.zeros(B, np.int64), lens], axis=1)
    return np.stack(
        [np.arange(B, dtype=np.int64), np.zeros(B, np.int64), np.full(B, T, np.int64)], axis=1
    )


def _scale(scale, K):
    """The query's factor: 0, or a magnitude within float32's normal range (where the kernels
    hold it), as attention's scale but of either sign."""
    if scale is None:
        return 1.0 / math.sqrt(K)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float, got {scale!r}")
    x = float(scale)
    lo, hi = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if not (x == 0.0 or lo <= abs(x) <= hi):
        raise ValueError(
            f"scale: expected 0 or a magnitude within float32's normal range [{lo:g}, {hi:g}], "
            f"got {scale!r}"
        )
    return x


def _gates(g, beta, B, T, Hv, K, layout):
    g = _float(g, "g")
    if g.ndim not in (3, 4):
        raise ValueError(
            f"g: expected (B, T, Hv) or per channel (B, T, Hv, K) for layout='bshd', got shape {g.shape}"
        )
    g = _time_major(g, "g", g.ndim, layout)
    if g.shape[:3] != (B, T, Hv) or (g.ndim == 4 and g.shape[3] != K):
        want = f"(B={B}, T={T}, Hv={Hv})" + ("" if g.ndim == 3 else f" + (K={K},)")
        raise ValueError(f"g: expected shape {want} (in (B, T, H) order), got {g.shape}")
    beta = _time_major(_float(beta, "beta"), "beta", 3, layout)
    if beta.shape != (B, T, Hv):
        raise ValueError(
            f"beta: expected shape (B={B}, T={T}, Hv={Hv}) (in (B, T, H) order), got {beta.shape}"
        )
    return g, beta


def delta_args(q, k, v, g, beta, scale, initial_state, layout, cu_seqlens, lengths):
    """Checks every argument of the gated delta rule; see ``attnx.gated_delta_rule``."""
    choice(layout, LAYOUTS, "layout")
    q = _time_major(_float(q, "q"), "q", 4, layout)
    k = _time_major(_float(k, "k"), "k", 4, layout)
    v = _time_major(_float(v, "v"), "v", 4, layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, Hk, K = q.shape
    if k.shape != q.shape:
        raise ValueError(
            f"k: expected the shape of q (B={B}, T={T}, Hk={Hk}, K={K}), got {k.shape}"
        )
    if v.shape[:2] != (B, T):
        raise ValueError(f"v: expected (B={B}, T={T}, Hv, V), got {v.shape}")
    Hv, V = v.shape[2], v.shape[3]
    if Hk < 1 or Hv % Hk != 0:
        raise ValueError(
            f"v: the value heads (Hv={Hv}) must be a multiple of the key heads (Hk={Hk})"
        )
    if K < 1 or V < 1:
        raise ValueError(f"q, v: feature widths must be >= 1, got K={K}, V={V}")
    g, beta = _gates(g, beta, B, T, Hv, K, layout)
    seqs = _sequences(B, T, cu_seqlens, lengths)
    state = None
    if initial_state is not None:
        state = _float(initial_state, "initial_state")
        want = (seqs.shape[0], Hv, K, V)
        if state.shape != want:
            raise ValueError(
                f"initial_state: expected shape (N={want[0]}, Hv={Hv}, K={K}, V={V}), got {state.shape}"
            )
    return DeltaArgs(q, k, v, g, beta, seqs, state, _scale(scale, K))
