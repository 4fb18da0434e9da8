"""Argument checks shared by the Python entry points: one rule, one place.

Every check names the argument and says what it expected; none of them changes its argument
(a conversion returns a new object). Ranges that depend on the kernels (float32 scalars, lengths,
shapes) are checked once, in the binding (``cpp/bind/``); these helpers only bring Python
values to the types it reads.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any, cast

import numpy as np

from .quant import QUANTISED_DTYPES

__all__ = [
    "DTYPE_ALIASES",
    "FLOAT_DTYPES",
    "LAYOUTS",
    "QUANTISED_DTYPES",
    "SHORT_NAMES",
    "as_array",
    "as_int",
    "check_broadcast",
    "choice",
    "counts",
    "dtype_name",
    "flag",
    "from4",
    "index",
    "int_in",
    "kernel_array",
    "mask4",
    "native_order",
    "optional_array",
    "optional_real",
    "out4",
    "positive_int",
    "rank_lens",
    "real",
    "storage_dtype",
    "thread_count",
    "threads",
    "to4",
    "window_sides",
]

_KIND_FLOAT = "f"


LAYOUTS = ("bhsd", "bshd")  # the layouts of 4-D (B, H, S, D) / (B, S, H, D) arrays


def choice(x: object, choices: tuple[str, ...], name: str) -> str:
    """``x`` if it is one of the strings ``choices``. Anything else, an array included (``in``
    would compare it element by element), is a ValueError naming the argument."""
    if isinstance(x, str) and x in choices:
        return x
    listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
    raise ValueError(f"{name}: expected {listed}, got {x!r}")


def flag(x: object, name: str) -> bool:
    """``x``'s truth value, the binding's rule for bool arguments (``Args::flag`` in
    cpp/bind/args.cpp). An object without one, such as an empty or a many-element array (whose
    truth value NumPy calls ambiguous: an error in NumPy 2, a deprecation warning and False in
    NumPy 1), is a TypeError naming the argument."""
    if x is True or x is False:
        return x
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            return bool(x)
    except Exception:  # noqa: BLE001 (a user type's __bool__ may raise anything)
        raise TypeError(f"{name}: expected a bool, got {x!r}") from None


# ---- dtypes by name ----------------------------------------------------------------------------
# One table: the storage dtypes attnx names (NumPy's and ml_dtypes' names, as the cache takes them)
# and the short names the bench prints, accepted as aliases wherever a dtype is named.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
SHORT_NAMES = {full: short for short, full in DTYPE_ALIASES.items()}


def dtype_name(dtype: Any, name: str = "dtype", allowed: tuple[str, ...] = FLOAT_DTYPES) -> str:
    """The name in ``allowed`` of a dtype given by name (an alias of ``DTYPE_ALIASES`` too), NumPy
    dtype or type, or torch dtype; anything else is a TypeError naming the argument and the
    names it takes."""
    if isinstance(dtype, str):
        label: str | None = DTYPE_ALIASES.get(dtype, dtype)
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        label = str(dtype).rpartition(".")[2]  # torch.float16 -> "float16"
    else:
        try:
            label = np.dtype(dtype).name
        except TypeError:
            label = None
    if label in allowed:
        return label
    listed = ", ".join(f"{n!r}" for n in allowed[:-1]) + f" or {allowed[-1]!r}"
    aliases = ", ".join(f"{a!r}" for a, n in DTYPE_ALIASES.items() if n in allowed)
    raise TypeError(
        f"{name}: expected {listed}" + (f" (or {aliases})" if aliases else "") + f", got {dtype!r}"
    )


def storage_dtype(
    dtype: Any, name: str = "dtype", allowed: tuple[str, ...] = FLOAT_DTYPES
) -> np.dtype[Any]:
    """The NumPy dtype of a storage dtype named as :func:`dtype_name` takes it: float32, float16
    or bfloat16 by default; ``allowed`` adds the quantised ones where pages hold them."""
    label = dtype_name(dtype, name, allowed)
    if label in ("float32", "float16", "int8"):
        return np.dtype(label)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, label))


def positive_int(x: object, name: str, minimum: int = 1) -> int:
    """``x`` as a Python int >= minimum; bools, floats and other non-integers are refused."""
    value = as_int(x)
    if value is None or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x!r}")
    return value


# ---- integers: lengths, counts, ids, positions, indices ------------------------------------------
# The rule: an integer argument is a Python int, a NumPy integer scalar of any width and sign, or a
# 0-d integer array, and it is converted to a Python int (unbounded, so it never wraps) and checked
# for range before anything is written. A bool (Python or NumPy), a float (even 1.0) or anything
# else is not an integer. Arrays of counts may have any NumPy integer dtype.


def as_int(x: object) -> int | None:
    """``x`` as a Python int if it is an integer by the rule above, else None."""
    if type(x) is int:  # the common case, without the slower abstract-class checks below
        return x
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        return int(x)
    return None


def int_in(x: object, name: str, lo: int, hi: int) -> int:
    """``x`` as a Python int in ``[lo, hi]`` (both included); ValueError naming ``name`` if not."""
    value = as_int(x)
    if value is None or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {x!r}")
    return value


def index(x: object, name: str, size: int) -> int:
    """``x`` as a Python int in ``[0, size)``: an index into ``size`` things (no negative
    indexing from the end); ValueError naming ``name`` if not."""
    value = as_int(x)
    if value is None or not 0 <= value < size:
        raise ValueError(f"{name}: expected an int in [0, {size}), got {x!r}")
    return value


def counts(x: object, name: str, size: int) -> list[int]:
    """``x``, a sequence of ``size`` integers >= 0 (a list, a tuple or a 1-d array of any NumPy
    integer dtype), as a list of Python ints; ValueError (TypeError if ``x`` is not a sequence)
    naming ``name`` if not."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1:
            raise ValueError(f"{name}: expected a 1-d sequence of counts, got shape {x.shape}")
        items = x.tolist()  # Python ints, exact for every width and sign (floats stay floats)
    else:
        try:
            if isinstance(x, (str, bytes)):
                raise TypeError
            items = list(x)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(
                f"{name}: expected a sequence of ints, got {type(x).__name__}"
            ) from None
    values = [as_int(n) for n in items]
    if len(values) != size:
        raise ValueError(f"{name}: expected {size} counts (one per sequence), got {len(values)}")
    ints = cast("list[int]", values)  # once None is ruled out
    if None in values or min(ints, default=0) < 0:
        raise ValueError(f"{name}: expected ints >= 0, got {x!r}")
    return ints


def as_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a NumPy array (itself when it is one); anything unconvertible is a TypeError."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}") from exc


def native_order(a: np.ndarray) -> np.ndarray:
    """``a`` in the machine's byte order (a byte-swapped ``'>f4'`` array is converted)."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def kernel_array(a: np.ndarray) -> np.ndarray:
    """``a``, or a contiguous copy when the kernels could not read it through element strides:
    its last axis strided, or its data or strides misaligned (a field of a structured array has
    byte strides that are no multiple of its item size). Byte order is left to the binding, which
    converts inputs and refuses what it writes in place."""
    flags = a.flags
    if flags.c_contiguous and flags.aligned:  # the common case, in one look at the flags
        return a
    if (a.ndim and a.strides[-1] != a.itemsize and a.shape[-1] > 1) or not flags.aligned:
        return np.array(
            a, order="C"
        )  # (ascontiguousarray would keep a contiguous misaligned array)
    return a


def real(x: Any, name: str) -> float:
    """``x`` as a Python float: ints and NumPy scalars of any width; bools and non-numbers are a
    TypeError. The range is the binding's to check."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__}")
    return float(x)


def window_sides(window: Any) -> tuple[int | None, int | None] | None:
    """``(left, right)`` as a tuple of Python ints or None (NumPy ints of any width and lists
    accepted); the binding checks the signs."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window: expected (left, right), got {window!r}") from None
    sides = []
    for side in (left, right):
        if side is not None and (isinstance(side, bool) or not isinstance(side, numbers.Integral)):
            raise TypeError(f"window: sides must be ints or None, got {window!r}")
        sides.append(None if side is None else int(side))
    return sides[0], sides[1]


# ---- ranks and layouts: every entry point views its arrays as (B, H, S, D) for the core ----
def to4(a, name, rank, layout):
    """View a rank-2/3/4 tensor of `layout` as (B, H, S, D)."""
    if a.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} like q, got shape {a.shape}")
    if rank == 4:
        return a.transpose(0, 2, 1, 3) if layout == "bshd" else a
    if rank == 3:
        return (a.transpose(1, 0, 2) if layout == "bshd" else a)[None]
    return a[None, None]


def from4(x, rank, layout):
    if rank == 4:
        return x.transpose(0, 2, 1, 3) if layout == "bshd" else x
    if rank == 3:
        return x[0].transpose(1, 0, 2) if layout == "bshd" else x[0]
    return x[0, 0]


def rank_lens(x, rank):
    if x is None or rank == 4:
        return x
    if isinstance(x, numbers.Integral) or (isinstance(x, np.ndarray) and x.ndim == 0):
        return np.reshape(x, (1,))  # ranks 2/3 have B == 1: one length may be a scalar
    return x


def check_broadcast(m, name, rank, logical):
    """Raises unless mask ``m`` (at most ``rank`` dims) broadcasts to the shape ``logical``."""
    if m.ndim > rank:
        raise ValueError(f"{name}: shape {m.shape} does not broadcast to {logical}")
    try:
        np.broadcast_shapes(m.shape, logical)
    except ValueError:
        raise ValueError(f"{name}: shape {m.shape} does not broadcast to {logical}") from None


def mask4(mask, rank, logical, additive=np.float32):
    """``mask`` as a 4-D boolean or native additive array that the kernels can read: float32, or
    float64 (``additive``) for float64 inputs, whose kernels compute in float64."""
    m = as_array(mask, "mask")
    if m.dtype != np.bool_:
        if m.dtype.kind != _KIND_FLOAT and m.dtype.name != "bfloat16":
            raise TypeError(
                f"mask: expected boolean (True = may attend) or additive float, got dtype {m.dtype}"
            )
        if m.dtype != additive:  # (a byte-swapped one too)
            m = m.astype(additive)  # additive masks are read in the compute type
    check_broadcast(m, "mask", rank, logical)
    if not m.flags.aligned:  # e.g. a field of a structured array: element strides cannot reach it
        m = np.array(m)
    return m.reshape((1,) * (4 - m.ndim) + m.shape)


def optional_real(x, name):
    """``x`` as a float (:func:`real`), or None (the binding's default) for None."""
    return None if x is None else real(x, name)


def optional_array(x: object, name: str) -> np.ndarray | None:
    """An optional array argument as an array (the binding checks it), or None."""
    return None if x is None else as_array(x, name)


def out4(out, rank, layout):
    """``out`` viewed as (B, Hq, Sq, Dv) like q; the binding checks its shape and dtype, and
    writes a temporary that it copies in when ``out`` overlaps an input."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy array, got {type(out).__name__}")
    if out.ndim != rank:
        raise ValueError(f"out: expected rank {rank} like q, got shape {out.shape}")
    return to4(out, "out", rank, layout)


def thread_count(n, name, minimum, expected, stacklevel):
    """``n`` as a thread count for the core: a Python int in [minimum, 2**31), at most
    ``_core._max_threads()`` (4 per CPU this process may run on, at most 1024); a larger count is
    capped with a RuntimeWarning. ``stacklevel`` is the user's frame, counted from here."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < minimum:
        raise ValueError(f"{name}: expected {expected}, got {n!r}")
    if n >= 2**31:
        raise ValueError(f"{name}: expected at most 2**31 - 1, got {n!r}")
    n = int(n)
    if n > 4:  # the cap is never below 4: the usual counts skip its affinity system call
        from . import _core  # (here: the reference shares these checks and never loads the core)

        cap = _core._max_threads()
        if n > cap:
            warnings.warn(
                f"{name}={n} capped at {cap} threads (attnx starts at most 4 per CPU this "
                f"process may run on, and at most 1024)",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            n = cap
    return n


def threads(num_threads):
    """A call's ``num_threads``: 0 (the default) for None."""
    if num_threads is None:
        return 0
    return thread_count(num_threads, "num_threads", 1, "a positive int or None", stacklevel=4)
