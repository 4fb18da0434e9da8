"""Argument checks shared by the Python entry points: one rule, one place.

Every check names the argument and says what it expected; none of them changes anything.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["storage_dtype", "positive_int"]


def storage_dtype(dtype, name="dtype"):
    """The NumPy dtype for a storage dtype given by name or type: float32, float16 or bfloat16."""
    label = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if label == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if label in ("float32", "float16"):
        return np.dtype(label)
    raise TypeError(f"{name}: expected 'float32', 'float16' or 'bfloat16', got {dtype!r}")


def positive_int(x, name, minimum=1):
    """``x`` as a Python int >= minimum; bools, floats and other non-integers are refused."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x!r}")
    return int(x)
