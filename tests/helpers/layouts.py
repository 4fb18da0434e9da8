"""Layouts and ranks, written independently of attnx's own conversions and of attnx.reference."""

from __future__ import annotations

import numpy as np


def to4(x, layout, rank):
    """A user array of this layout and rank as a (B, H, S, D) view."""
    x = np.asarray(x)
    if rank == 2:
        return x[None, None]
    if rank == 3:
        x = x[None]
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def from4(x4, layout, rank):
    """Inverse of ``to4``: a (B, H, S, D) array as the user's layout and rank."""
    if layout == "bshd":
        x4 = x4.transpose(0, 2, 1, 3)
    if rank == 4:
        return x4
    if rank == 3:
        return x4[0]
    return x4[0, 0] if layout == "bhsd" else x4[0, :, 0]


def lse4(lse, rank):
    return lse[None, None] if rank == 2 else lse[None] if rank == 3 else lse
