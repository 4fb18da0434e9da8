"""The recurrent states of a hybrid cache's linear (gated delta-rule) layers: one float32
``(Hv, K, V)`` state per linear layer and sequence, held beside its blocks (``SeqState.state``)
and advanced by :meth:`attnx.Step.linear`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from .._validate import as_int
from .._validate import int_in as _int_in

__all__ = ["linear_config"]


def linear_config(
    linear_layers: object, state_shape: object
) -> tuple[int, tuple[int, int, int] | None]:
    """``(linear_layers, (Hv, K, V))`` checked: a shape is needed exactly when there are layers."""
    n = _int_in(linear_layers, "linear_layers", 0, 2**31 - 1)
    if n == 0:
        if state_shape is not None:
            raise ValueError("state_shape: given without linear_layers")
        return 0, None
    try:
        dims = [as_int(d) for d in cast(Iterable[Any], state_shape)]
    except TypeError:
        dims = []
    if len(dims) != 3 or any(d is None or d < 1 for d in dims):
        raise ValueError(
            f"state_shape: expected (Hv, K, V), ints >= 1, with linear_layers={n}; "
            f"got {state_shape!r}"
        )
    hv, k, v = (int(d) for d in dims if d is not None)
    return n, (hv, k, v)
