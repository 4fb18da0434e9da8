#!/usr/bin/env python3
"""Throws malformed arguments at every public entry point of attnx; every outcome must be a
result or a clean Python exception, never a crash.

Entry points: ``attnx.attention``, ``attnx.paged_attention``, ``attnx.PagedKVCache`` (constructor,
``new_sequence``, ``fork``, ``truncate``, ``free``, ``length``, ``block_table``, ``k_pages``,
``v_pages``, ``stats``, ``begin_step``, ``Step.attend``, stale steps), ``attnx.scaled_dot_product_attention``,
``attnx.MultiHeadAttention`` (constructor and call), ``attnx.set_num_threads``.

Each input (a byte string) is decoded into one call: a valid-looking problem of small shapes,
then 0-4 of its arguments replaced by garbage (``None``, strings, lists, huge and negative ints,
NaN/inf, scalars past float32's range, NumPy scalars of every width, objects of the wrong type)
or by a mutated array (wrong dtype, rank, shape, zero-size, transposed, strided, negative strides,
read-only, misaligned, byte-swapped, a field of a structured array, a zero-stride broadcast of a
logical size of 2**40, NaN/inf values, lists, 0-d). Valid-looking problems draw integer arguments
(lengths, tables) in every integer width and byte order (NumPy scalars where one length will do),
window sides as NumPy integers or wider than any sequence, extreme scale/softcap values, an
``out`` that overlaps q, k, v, the mask or the pages, an ``out`` whose own elements share memory
(a writable zero-stride or overlapping-stride view), and new keys read from the very pool a
step writes. Rules checked on every call:

* the outcome is a result or one of ``ALLOWED`` (ValueError, TypeError, KeyError, IndexError,
  MemoryError, attnx.CacheFullError, attnx.StaleStepError); anything else (SystemError,
  RuntimeError, a segfault, a sanitizer report) is a finding;
* inputs are not modified (except where they share memory with ``out`` or the pool a step
  writes); when the call raises, ``out`` is not modified either; an ``out`` whose elements
  share memory is refused (a result there is a finding: some element would hold another's);
* a cache operation that raises leaves the cache exactly as it was (block tables, lengths,
  reference counts, free list, pages), and after every operation the pool is consistent (no
  leaked or doubly held block, reference counts = holders);
* the cache's integer arguments (ids, counts, lengths, layers) come as Python ints or as NumPy
  integers of random width and sign, 0-d arrays and count arrays, which must act as the same
  ints: a step or truncation leaves exactly the lengths the ints say, and ids and lengths stay
  Python ints.

Usage::

    python fuzz/fuzz_entrypoints.py --runs 100000          # atheris (coverage-guided)
    python fuzz/fuzz_entrypoints.py --runs 2000 --no-atheris [--keep-going] [--seed S]
                                                            # plain random bytes, no atheris
    python fuzz/fuzz_entrypoints.py CORPUS_DIR -max_total_time=600   # any libFuzzer flag

``one_input(data)`` is the harness itself (tests/hardening/test_fuzz_harness.py runs it over a
fixed corpus in-process). ``ATTNX_FUZZ_UNALIGNED=0`` leaves out misaligned arrays (the default
under the sanitizer run, where they hit a known UBSan finding: see tests/hardening/test_fuzz.py).
"""

from __future__ import annotations

import collections
import os
import sys

import ml_dtypes
import numpy as np

import attnx

BF16 = np.dtype(ml_dtypes.bfloat16)
SANITIZED = bool(os.environ.get("ATTNX_SANITIZED"))
UNALIGNED = os.environ.get("ATTNX_FUZZ_UNALIGNED", "0" if SANITIZED else "1") == "1"
ALLOWED = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    MemoryError,
    attnx.CacheFullError,
    attnx.StaleStepError,
)
STATS: collections.Counter = collections.Counter()  # (entry point, outcome) -> count
SNAPSHOT_LIMIT = 1 << 20  # bytes: arrays larger than this (huge broadcasts) are not copied


class Finding(AssertionError):
    """A rule of the harness was broken (atheris reports it as a crash, with the input)."""


# Findings already reported (each has a strict xfail repro in
# tests/hardening/test_fuzz_harness.py): recorded in STATS as "known: <name>" instead of stopping
# the run, unless ATTNX_FUZZ_STRICT=1.
# Delete an entry once its bug is fixed.
KNOWN_FINDINGS = {
    # name: (exception type, text of its message) -- none open. Fixed so far (d771f2e): a window
    # side >= 2**63 (pybind11 cast RuntimeError), set_num_threads(inf) (OverflowError).
}
STRICT = os.environ.get("ATTNX_FUZZ_STRICT", "0") == "1"


def known_finding(e):
    for name, (exc, text) in KNOWN_FINDINGS.items():
        if type(e) is exc and text in str(e):
            return name
    return None


# ---------------------------------------------------------------------------------------------
# decoding bytes into choices
# ---------------------------------------------------------------------------------------------


class Provider:
    """Draws choices from a byte string; past its end every draw is the smallest choice, so
    every input decodes to something (a prefix of a good input is a simpler input)."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def byte(self):
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def int(self, lo, hi):
        n = hi - lo + 1
        if n <= 1:
            return lo
        x, span = 0, 1
        while span < n:
            x = (x << 8) | self.byte()
            span <<= 8
        return lo + x % n

    def bool(self, percent_true=50):
        return self.int(0, 99) >= 100 - percent_true  # exhausted: False (unless certain)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]


ISAS = ["scalar"]
_f = attnx.cpu_features()
if _f["avx2"] and _f["fma"] and _f["f16c"]:
    ISAS.append("avx2")
    if _f["avx512f"] and _f["avx512bw"] and _f["avx512vl"]:
        ISAS.append("avx512")
        if _f["avx512bf16"] and _f.get("avx512_vnni"):
            ISAS.append("avx512bf16")
            if _f.get("amx_bf16") and _f.get("amx_permitted"):
                ISAS.append("amx")
            ISAS.append("amx-emulated")  # (amx's tile loop over emulated tiles: for tests)
if _f.get("neon"):
    ISAS.append("neon")


class Opaque:
    """An object of no useful type."""

    def __repr__(self):
        return "Opaque()"


GARBAGE = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    7,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32 + 1,
    2**63 - 1,
    -(2**63),
    2**64,
    2**100,
    -(2**100),
    0.0,
    -0.0,
    0.5,
    1.5,
    -2.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e300,
    1e-320,
    1j,
    "",
    "a",
    "bhsd",
    "float32",
    b"\x00",
    [],
    [1],
    [0, 1],
    [[1]],
    [1.5],
    ["a"],
    (),
    (1,),
    (1, 2),
    (None, None),
    (-1, 0),
    (1, 2, 3),
    (1.5, None),
    ("a", 1),
    (2**40, 0),
    {},
    {"a": 1},
    {1, 2},
    Opaque(),
    object,
    np.int64(3),
    np.int32(-1),
    np.uint64(2**64 - 1),
    np.float32("nan"),
    np.float16(65504),
    np.bool_(True),
    np.array(3),
    np.array(2.5),
    np.array([]),
    np.array([[1]]),
    np.array([1, 2, 3]),
    np.array([-1, 5]),
    np.array([2**40]),
    np.array(["a"]),
    np.array([None], dtype=object),
    np.zeros((2, 2), np.complex64),
    np.zeros((0, 3), np.float32),
    np.ones((1, 1, 1, 1), np.float32),
    slice(1),
    Ellipsis,
    # scalars at and past the ends of float32's range (scale, softcap), NumPy scalars of every width
    1e-40,
    1e-46,
    1.1754943508222875e-38,
    3.4028234663852886e38,
    3.5e38,
    1e39,
    -1e-40,
    np.float32(1e-40),
    np.float16(6e-8),
    np.float64(1e39),
    np.int8(-3),
    np.uint8(200),
    np.int16(7),
    np.uint16(9),
    np.uint32(2**32 - 1),
    np.int64(2**62),
]
INT_DTYPES = [
    np.dtype(t)
    for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64)
]
INT_DTYPES += [t.newbyteorder(">") for t in INT_DTYPES if t.itemsize > 1]  # byte-swapped too
INT_SCALARS = [
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    int,
]
EXTREME_SCALES = [
    1e-46,
    1e-40,
    1.1754943508222875e-38,
    1e38,
    3.4028234663852886e38,
    1e39,
    np.float32(0.5),
    np.float16(2),
]


def garbage(p):
    return p.pick(GARBAGE)


def misaligned(x):
    buf = np.zeros(x.nbytes + 64, np.uint8)
    y = np.ndarray(x.shape, x.dtype, buffer=buf, offset=(-buf.ctypes.data) % 64 + 1)
    y[...] = x
    return y


def _to_dtype(p, x):
    return x.astype(p.pick(MUTANT_DTYPES))


def _one_more_axis(p, x):
    return x[None] if p.bool() else x[..., None]


def _one_less_axis(p, x):
    return x[0] if x.ndim and x.shape[0] else x.reshape(-1)


def _first_along_an_axis(p, x, stop):
    """``x`` cut to its first ``stop`` (0 or 1) entries along a random axis."""
    if x.ndim == 0:
        return x
    ax = p.int(0, x.ndim - 1)
    idx = [slice(None)] * x.ndim
    idx[ax] = slice(0, stop)
    return x[tuple(idx)]


def _huge_broadcast(p, x, last):
    """A zero-stride view of a logical size far past memory (costs nothing); on the last axis
    (``last``) the API has to copy it to make it contiguous, which must fail cleanly."""
    if x.ndim == 0:
        return x
    shape = list(x.shape)
    if not last and x.ndim < 3:
        return garbage(p)
    # batch or head axes only: a huge sequence axis of keys is a legal (zero-stride)
    # problem that takes days, not a malformed argument
    ax = x.ndim - 1 if last else p.int(0, x.ndim - 3)
    # (sizes that fail to allocate on any machine: a 2**31-long axis would be a real,
    # possibly successful, multi-GiB copy or computation, not a malformed argument)
    shape[ax] = p.pick([2**40, 2**50, 2**62])
    base = (
        np.take(x, [0], axis=ax)
        if x.shape[ax]
        else np.zeros(shape[:ax] + [1] + shape[ax + 1 :], x.dtype)
    )
    return np.broadcast_to(base, shape)


def _with_one_value(p, x, value):
    """A copy of ``x`` with one element set to ``value`` (where ``x`` holds floats)."""
    y = x.astype(np.float32, copy=True).astype(x.dtype) if x.dtype.kind in "fV" else x.copy()
    if y.size and y.dtype.kind in "fV":
        flat = y.reshape(-1)
        flat[p.int(0, flat.size - 1)] = value
    return y


def _readonly_copy(p, x):
    y = x.copy()
    y.flags.writeable = False
    return y


def _structured_field(p, x):
    """A field of a structured array: odd byte strides, misaligned."""
    st = np.zeros(x.shape, dtype=[("pad", f"V{p.int(1, 3)}"), ("x", x.dtype)])
    st["x"] = x
    return st["x"]


MUTANT_DTYPES = [
    np.int8,
    np.int32,
    np.int64,
    np.uint8,
    np.float64,
    np.complex64,
    np.bool_,
    np.float16,
    BF16,
    np.float32,
    "U1",
    object,
]
# kind -> mutate(p, x); a kind not here ("garbage") is replaced by garbage
MUTATIONS = {
    "dtype": _to_dtype,
    "rank+": _one_more_axis,
    "rank-": _one_less_axis,
    "flat": lambda p, x: x.reshape(-1),
    "transpose": lambda p, x: np.swapaxes(x, 0, -1) if x.ndim > 1 else x,
    "zero": lambda p, x: _first_along_an_axis(p, x, 0),
    "one": lambda p, x: _first_along_an_axis(p, x, 1),
    "repeat": lambda p, x: x.repeat(2, axis=p.int(0, x.ndim - 1)) if x.ndim else x,
    "strided": lambda p, x: x.repeat(2, axis=-1)[..., ::2] if x.ndim else x,
    "negative": lambda p, x: x[::-1] if x.ndim else x,
    "fortran": lambda p, x: np.asfortranarray(x),
    "readonly": _readonly_copy,
    "huge": lambda p, x: _huge_broadcast(p, x, last=False),
    "huge_last": lambda p, x: _huge_broadcast(p, x, last=True),
    "nan": lambda p, x: _with_one_value(p, x, np.nan),
    "inf": lambda p, x: _with_one_value(p, x, -np.inf),
    "big": lambda p, x: _with_one_value(p, x, 3e38),
    "list": lambda p, x: x.astype(np.float64).tolist() if x.size < 512 else x,
    "scalar": lambda p, x: x.reshape(-1)[0] if x.size else np.float32(1),
    "unaligned": lambda p, x: misaligned(x) if x.size else x,
    "bool": lambda p, x: x != 0,
    "empty_like": lambda p, x: np.empty((0,) * max(1, x.ndim), x.dtype),
    "swapped": lambda p, x: x.astype(x.dtype.newbyteorder("S")),  # same values, other byte order
    "field": _structured_field,
}
# the draw's order (saved findings replay by it): "dtype" twice as likely as the others
MUTATION_KINDS = [
    "dtype",
    "dtype",
    "rank+",
    "rank-",
    "flat",
    "transpose",
    "zero",
    "one",
    "repeat",
    "strided",
    "negative",
    "fortran",
    "readonly",
    "huge",
    "huge_last",
    "nan",
    "inf",
    "big",
    "list",
    "scalar",
    "garbage",
    "unaligned",
    "bool",
    "empty_like",
    "swapped",
    "field",
]


def mutate_array(p, x):
    """A malformed (or merely unusual) variant of array ``x``."""
    kind = p.pick(MUTATION_KINDS)
    if x.size > 1 << 16:  # already a huge (broadcast) array: leave it
        return x
    if kind in ("unaligned", "field") and not UNALIGNED:
        kind = "strided"
    mutate = MUTATIONS.get(kind)
    if mutate is None:
        return garbage(p)
    try:
        return mutate(p, x)
    except (ValueError, TypeError, OverflowError, MemoryError):
        return x


def maybe_bad(p, value, percent=12):
    """``value``, or (with the given odds) a mutation of it, or garbage."""
    if not p.bool(percent):
        return value
    if isinstance(value, np.ndarray) and p.bool(70):
        return mutate_array(p, value)
    return garbage(p)


def int_arg(p, values, scalar_ok):
    """Integer array ``values`` in any integer dtype and byte order, or (when ``scalar_ok`` and it
    has one element) a NumPy integer scalar of any width."""
    values = np.asarray(values)
    if scalar_ok and values.size == 1 and p.bool(30):
        return p.pick(INT_SCALARS)(values.reshape(-1)[0])
    dt = p.pick(INT_DTYPES)
    return values.astype(dt) if values.size and np.iinfo(dt).max >= values.max() else values


def window_arg(p):
    def side():
        return (
            p.pick([None, 0, 2, 3, 2**40, 2**63 - 1, 2**64])
            if p.bool(70)
            else p.pick(INT_SCALARS)(p.int(0, 5))
        )

    return (side(), side())


def overlapping_out(p, shape, dtype, inputs):
    """An ``out`` of ``shape`` sharing memory with one of ``inputs`` of ``dtype`` (values kept:
    the input is moved into a buffer that ``out`` overlaps), or None. Returns (out, inputs)."""
    inputs = list(inputs)
    same = [i for i, x in enumerate(inputs) if isinstance(x, np.ndarray) and x.dtype == dtype]
    if not same:
        return None, inputs
    i = p.pick(same)
    x = inputs[i]
    size = int(np.prod(shape))
    buf = np.full(x.size + size, 7.0, dtype)
    inputs[i] = buf[: x.size].reshape(x.shape)
    inputs[i][...] = x
    start = p.int(0, x.size)
    return buf[start : start + size].reshape(shape), inputs


def self_overlapping_out(p, shape, dtype):
    """A writable ``out`` of ``shape`` (over a buffer of 7s) whose elements share memory where it
    has an axis of extent > 1: contiguous strides with one shrunk (to 0 at times)."""
    strides, step = [0] * len(shape), 1
    for ax in reversed(range(len(shape))):
        strides[ax] = step
        step *= max(shape[ax], 1)
    axes = [ax for ax, n in enumerate(shape) if n > 1]
    if axes:
        ax = p.pick(axes)
        strides[ax] = p.pick([0, max(0, strides[ax] - 1)] if strides[ax] > 1 else [0])
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if 0 not in shape else 1
    buf = np.full(span, 7.0, dtype)
    return np.lib.stride_tricks.as_strided(
        buf, shape, [s * buf.itemsize for s in strides], writeable=True
    )


def shares_elements(a):
    """Whether two index tuples of ``a`` reach the same offset (brute force)."""
    if not isinstance(a, np.ndarray) or a.size < 2:
        return False
    offsets = np.zeros(a.shape, np.int64)
    for ax, (n, s) in enumerate(zip(a.shape, a.strides)):
        offsets = offsets + (np.arange(n) * s).reshape([n if i == ax else 1 for i in range(a.ndim)])
    return np.unique(offsets).size < a.size


def rand_array(p, shape, dtype):
    r = np.random.default_rng(p.int(0, 2**16))
    return r.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------


def _snap(x):
    if isinstance(x, np.ndarray) and x.nbytes <= SNAPSHOT_LIMIT:
        return x.copy()
    return None


def _same(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.dtype == object:
        return a.shape == b.shape and all(x is y for x, y in zip(a.ravel(), b.ravel()))
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def call(entry, fn, inputs=(), out=None, writes=()):
    """Runs fn(); checks the outcome rules; returns (ok, result). An input that shares memory with
    ``out`` or with one of ``writes`` (arrays the call writes) may change."""
    before = [(x, _snap(x)) for x in inputs]
    out_before = _snap(out)
    try:
        result = fn()
    except ALLOWED as e:
        STATS[(entry, type(e).__name__)] += 1
        if out_before is not None and not _same(out, out_before):
            raise Finding(f"{entry}: raised {type(e).__name__} ({e}) after writing into out") from e
        ok, result = False, None
    except Finding:
        raise
    except BaseException as e:
        known = known_finding(e)
        if known is None or STRICT:
            raise Finding(f"{entry}: {type(e).__name__} is not a clean exception: {e}") from e
        STATS[(entry, f"known: {known}")] += 1
        ok, result = False, None
    else:
        STATS[(entry, "result")] += 1
        ok = True
        if out is not None and shares_elements(out):
            raise Finding(f"{entry}: accepted an out whose elements share memory")
    written = [w for w in (out, *writes) if isinstance(w, np.ndarray)]
    for x, x0 in before:
        if (
            x0 is not None
            and not any(np.may_share_memory(x, w) for w in written)
            and not _same(x, x0)
        ):
            raise Finding(f"{entry}: an input was modified")
    return ok, result


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def _layout_user(x4, layout, rank):
    if layout == "bshd":
        x4 = x4.transpose(0, 2, 1, 3)
    return (
        x4 if rank == 4 else x4[0] if rank == 3 else (x4[0, 0] if layout == "bhsd" else x4[0, :, 0])
    )


def _dense_problem(p):
    """q, k, v of a random rank, layout, dtype and small shape, and the sizes drawn."""
    rank, layout = p.pick([2, 3, 4]), p.pick(["bhsd", "bshd"])
    B = p.int(0, 3) if rank == 4 else 1
    Hkv = p.int(1, 3) if rank > 2 else 1
    Hq = Hkv * p.int(1, 3) if rank > 2 else 1
    Sq, Sk, Dk, Dv = p.int(0, 9), p.int(0, 12), p.int(1, 9), p.int(1, 9)
    dtype = p.pick([np.float32, np.float16, BF16])
    q = _layout_user(rand_array(p, (B, Hq, Sq, Dk), dtype), layout, rank)
    k = _layout_user(rand_array(p, (B, Hkv, Sk, Dk), dtype), layout, rank)
    v = _layout_user(rand_array(p, (B, Hkv, Sk, Dv), dtype), layout, rank)
    dims = dict(rank=rank, layout=layout, B=B, Hq=Hq, Sq=Sq, Sk=Sk, Dv=Dv, dtype=np.dtype(dtype))
    return {"q": q, "k": k, "v": v}, dims


def _dense_mask(p, dims):
    """A boolean or additive (0/-inf) mask broadcastable to the logical (B, Hq, Sq, Sk)."""
    rank = dims["rank"]
    logical = (dims["B"], dims["Hq"], dims["Sq"], dims["Sk"])[4 - rank :]
    shape = tuple(d if p.bool() else 1 for d in logical)[p.int(0, rank - 1) :]
    if p.bool():
        return np.random.default_rng(1).random(shape) < 0.7
    additive = np.where(np.random.default_rng(2).random(shape) < 0.7, 0.0, -np.inf)
    return additive.astype(p.pick([np.float32, np.float16, np.float64]))


def _options(p, args, table, dims, percent, always=()):
    """Each option of ``table`` ((name, make(p, dims)), in order) set in ``args`` with the given
    odds (those named in ``always`` without a draw)."""
    for name, make in table:
        if name in always or p.bool(percent):
            args[name] = make(p, dims)


def _out_arg(p, args, shape, dtype, overlap):
    """Maybe an ``out`` of ``shape`` in ``args``: a fresh one (of 7s), one overlapping an array
    of ``args`` named in ``overlap`` (that array is moved into the buffer out shares, values
    kept), or one whose own elements share memory."""
    if not p.bool(30):
        return
    args["out"] = np.full(shape, 7.0, dtype)
    if p.bool(40):
        out, moved = overlapping_out(p, shape, dtype, [args.get(n) for n in overlap])
        if out is not None:
            args["out"] = out
            args.update({n: x for n, x in zip(overlap, moved) if x is not None})
    elif p.bool(25):
        args["out"] = self_overlapping_out(p, shape, dtype)


def _corrupt(p, args, names, default, bad=None):
    """0-4 draws of a name from ``names`` whose argument (``default()`` where not given) becomes
    ``bad(p, name, value)`` (by default a mutation or garbage); then ``bogus_kwarg``, if drawn,
    is usually dropped again."""
    for _ in range(p.int(0, 4)):
        name = p.pick(names)
        value = args.get(name, default())
        args[name] = maybe_bad(p, value, percent=100) if bad is None else bad(p, name, value)
    if "bogus_kwarg" in args and p.bool(80):
        del args["bogus_kwarg"]


DENSE_OPTIONS = (
    ("causal", lambda p, d: p.bool()),
    ("scale", lambda p, d: p.pick([0.1, 1.0, 3.0] + EXTREME_SCALES)),
    ("layout", lambda p, d: d["layout"]),
    ("return_lse", lambda p, d: p.bool()),
    ("num_threads", lambda p, d: p.pick([None, 1, 2, 3])),
    ("window", lambda p, d: window_arg(p)),
    ("softcap", lambda p, d: p.pick([0.5, 30.0] + EXTREME_SCALES)),
    ("sinks", lambda p, d: np.zeros(d["Hq"], np.float32)),
    ("alibi_slopes", lambda p, d: np.ones(d["Hq"], np.float32)),
)


def fuzz_attention(p):
    args, dims = _dense_problem(p)
    rank, B, Sq, Sk = dims["rank"], dims["B"], dims["Sq"], dims["Sk"]
    if p.bool(30):
        args["mask"] = _dense_mask(p, dims)
    if p.bool(25):
        args["kv_lens"] = int_arg(p, np.full(B, min(Sk, p.int(0, Sk))), rank < 4)
    if p.bool(25):
        args["q_lens"] = int_arg(p, np.full(B, min(Sq, p.int(0, Sq))), rank < 4)
    _options(p, args, DENSE_OPTIONS, dims, 25, always=("layout",))
    out_shape = _layout_user(np.empty((B, dims["Hq"], Sq, dims["Dv"])), dims["layout"], rank)
    _out_arg(p, args, out_shape.shape, dims["dtype"], overlap=("q", "k", "v", "mask"))
    names = list(args) + ["mask", "kv_lens", "q_lens", "out", "scale", "window", "bogus_kwarg"]
    _corrupt(p, args, names, default=lambda: np.ones(3, np.float32))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    call(
        "attention",
        lambda: attnx.attention(q, k, v, **args),
        inputs=[q, k, v] + list(args.values()),
        out=args.get("out"),
    )


def _pool(p, B, Hkv, Dk, Dv, dtype, bs):
    lens = np.array([p.int(0, 20) for _ in range(B)])
    need = -(-lens // bs)
    nb = int(need.sum()) + p.int(0, 3) or 1
    r = np.random.default_rng(p.int(0, 999))
    kp = r.standard_normal((nb, Hkv, bs, Dk)).astype(dtype)
    vp = r.standard_normal((nb, Hkv, bs, Dv)).astype(dtype)
    perm = r.permutation(nb)
    tables = np.zeros((B, max(1, int(need.max(initial=0)) + p.int(0, 2))), np.int64)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    return kp, vp, int_arg(p, tables, False), lens


def _paged_problem(p):
    """The positional arguments of a paged call (a pool, its tables and lengths, and queries:
    one per sequence when decoding, else ``q_lens`` of them), and the sizes drawn."""
    B, Hkv = p.int(0, 4), p.int(1, 3)
    Hq, Dk, Dv, bs = Hkv * p.int(1, 3), p.int(1, 9), p.int(1, 9), p.pick([1, 2, 4, 16])
    dtype = p.pick([np.float32, np.float16, BF16])
    kp, vp, tables, lens = _pool(p, B, Hkv, Dk, Dv, dtype, bs)
    decode = p.bool(40)
    q_lens = np.minimum(lens, 1) if decode else np.array([p.int(0, int(n)) for n in lens], np.int64)
    if decode and not np.all(q_lens == 1):
        decode = False
    q = rand_array(p, (int(q_lens.sum()), Hq, Dk), p.pick([np.float32, np.float16, BF16]))
    args = {
        "q": q,
        "k_pages": kp,
        "v_pages": vp,
        "block_tables": tables,
        "seq_lens": int_arg(p, lens, False),
    }
    if not decode:
        args["q_lens"] = int_arg(p, q_lens, False)
    return args, dict(Hq=Hq, Dv=Dv)


PAGED_OPTIONS = (
    ("causal", lambda p, d: p.bool(80)),
    ("scale", lambda p, d: p.pick([0.1, 1.0] + EXTREME_SCALES)),
    ("return_lse", lambda p, d: p.bool()),
    ("num_threads", lambda p, d: p.pick([None, 1, 2])),
    ("window", lambda p, d: window_arg(p)),
    ("softcap", lambda p, d: p.pick([5.0] + EXTREME_SCALES)),
    ("sinks", lambda p, d: np.zeros(d["Hq"], np.float32)),
    ("alibi_slopes", lambda p, d: np.ones(d["Hq"], np.float32)),
)


def _bad_paged_arg(p, name, value):
    """A malformed argument of a paged call; the pages are never mutated into a huge logical
    block (a long sequence there is a long computation, not a bug)."""
    if name not in ("k_pages", "v_pages") or not p.bool(50):
        return maybe_bad(p, value, percent=100)
    value = mutate_array(p, value) if isinstance(value, np.ndarray) else value
    if isinstance(value, np.ndarray) and value.ndim == 4 and value.shape[2] > 64:
        value = garbage(p)
    return value


def fuzz_paged(p):
    args, dims = _paged_problem(p)
    _options(p, args, PAGED_OPTIONS, dims, 20)
    q = args["q"]
    out_shape = (q.shape[0], dims["Hq"], dims["Dv"])
    _out_arg(p, args, out_shape, q.dtype, overlap=("q", "k_pages", "v_pages"))
    names = list(args) + ["q_lens", "out", "bogus_kwarg"]
    _corrupt(p, args, names, default=lambda: np.ones(2, np.int64), bad=_bad_paged_arg)
    pos = [args.pop(n) for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens")]
    call(
        "paged_attention",
        lambda: attnx.paged_attention(*pos, **args),
        inputs=pos + list(args.values()),
        out=args.get("out"),
    )


# ---- the cache ----------------------------------------------------------------------------------


INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def int_form(p, value):
    """The int ``value`` as it is, or as a NumPy scalar or 0-d array of a random integer type that
    holds it: the cache must treat them alike (issue 18)."""
    kinds = [t for t in INT_TYPES if np.iinfo(t).min <= value <= np.iinfo(t).max]
    if not kinds or not p.bool(40):
        return value
    t = p.pick(kinds)
    return t(value) if p.bool(70) else np.array(value, t)


def counts_form(p, counts):
    """A list of counts as it is, as NumPy integers, or as one integer array of a random type."""
    if counts and p.bool(25):
        kinds = [t for t in INT_TYPES if max(counts) <= np.iinfo(t).max]
        return np.array(counts, p.pick(kinds))
    return [int_form(p, n) for n in counts]


def cache_state(c):
    return (
        c._free_ids(),
        c._refs.copy(),
        c._next_id,
        {s: (c.length(s), c.block_table(s).tolist(), c._seqs[s].version) for s in c.sequences},
        c._k.copy(),
        None if c._v is None else c._v.copy(),
    )


def same_state(a, b):
    return (
        a[0] == b[0]
        and np.array_equal(a[1], b[1])
        and a[2] == b[2]
        and a[3] == b[3]
        and _same(a[4], b[4])
        and (a[5] is None) == (b[5] is None)
        and (a[5] is None or _same(a[5], b[5]))
    )


def check_pool(c):
    held = collections.Counter()
    for s in c.sequences:
        if type(s) is not int or type(c.length(s)) is not int:
            raise Finding(
                f"cache: sequence {s!r} or its length {c.length(s)!r} is not a Python int"
            )
        bt = [b for b in c.block_table(s).tolist() if b >= 0]
        if len(set(bt)) != len(bt):
            raise Finding("cache: a sequence holds a block twice")
        held.update(bt)
    free = c._free_ids()
    if (
        len(set(free)) != len(free)
        or set(free) & set(held)
        or len(free) + len(held) != c.num_blocks
    ):
        raise Finding("cache: a block leaked, or is both free and held")
    for b in range(c.num_blocks):
        if int(c._refs[b]) != held.get(b, 0):
            raise Finding(
                f"cache: block {b} has refcount {int(c._refs[b])}, {held.get(b, 0)} holders"
            )


def _cache_kwargs(p):
    """PagedKVCache's keyword arguments: valid ones, and sometimes one or two made garbage."""
    ok_kw = dict(
        num_layers=p.int(1, 2),
        num_kv_heads=p.int(1, 2),
        head_dim=p.pick([1, 4, 8]),
        num_blocks=p.int(1, 12),
        block_size=p.pick([1, 2, 4]),
        dtype=p.pick(["float32", "float16", "bfloat16"]),
    )
    if p.bool(20):
        ok_kw["value_dim"] = p.pick([1, 3, 8])
    if p.bool(15):
        ok_kw["sliding_window"] = p.pick([1, 3, 8])
    if p.bool(15):
        ok_kw["value_from_key"] = True
    kw = dict(ok_kw)
    for _ in range(p.int(0, 2) if p.bool(30) else 0):
        name = p.pick(list(ok_kw) + ["value_dim", "sliding_window", "value_from_key"])
        kw[name] = garbage(p)
    return kw


STEP_OPTIONS = ["scale", "num_threads", "return_lse", "window", "softcap", "sinks", "alibi_slopes"]


class CacheSession:
    """A sequence of operations on one cache: a method per operation of ``CACHE_OPS``, each
    returning whether its call succeeded (None where nothing was called)."""

    def __init__(self, p, cache):
        self.p, self.cache = p, cache
        self.H = cache.num_kv_heads * p.int(1, 2)
        self.steps = []  # the steps begun (the latest one pending, the others stale)
        self.state = None  # the cache as it was before the current operation

    def run(self, op):
        """One operation; a failed one must leave the cache as it was, and the pool must stay
        consistent."""
        self.state = cache_state(self.cache)
        ok = CACHE_OP_METHODS[op](self)
        if ok is None:
            return
        if not ok and not same_state(self.state, cache_state(self.cache)):
            raise Finding(f"cache: {op} raised but changed the cache")
        check_pool(self.cache)

    def seq_id(self):
        live = self.cache.sequences
        return int_form(self.p, self.p.pick(live)) if live and self.p.bool(85) else garbage(self.p)

    def expect_length(self, s, n, what):
        if self.cache.length(s) != n:
            raise Finding(f"cache: {what} left length {self.cache.length(s)}, expected {n}")

    def new(self):
        return call("cache.new_sequence", self.cache.new_sequence)[0]

    def fork(self):
        return call("cache.fork", lambda: self.cache.fork(self.seq_id()))[0]

    def free(self):
        return call("cache.free", lambda: self.cache.free(self.seq_id()))[0]

    def length(self):
        return call("cache.length", lambda: self.cache.length(self.seq_id()))[0]

    def block_table(self):
        return call("cache.block_table", lambda: self.cache.block_table(self.seq_id()))[0]

    def pages(self):
        p, cache = self.p, self.cache
        layer = int_form(p, p.int(0, 2)) if p.bool(80) else garbage(p)
        return call("cache.k_pages", lambda: (cache.k_pages(layer), cache.v_pages(layer)))[0]

    def stats(self):
        cache = self.cache
        return call(
            "cache.stats",
            lambda: (
                cache.stats(),
                cache.num_free_blocks,
                cache.num_used_blocks,
                cache.bytes_per_block,
            ),
        )[0]

    def props(self):
        return True

    def truncate(self):
        """A live sequence (or garbage) cut to a length it has (or to any, or garbage)."""
        p, cache = self.p, self.cache
        live = cache.sequences
        sid = p.pick(live) if live and p.bool(85) else None
        s = garbage(p) if sid is None else int_form(p, sid)
        live = sid is not None or (type(s) is int and s in live)
        n = (
            int_form(p, p.int(0, cache.length(s)))
            if live and p.bool(80)
            else (int_form(p, p.int(0, 20)) if p.bool(50) else garbage(p))
        )
        ok, _ = call("cache.truncate", lambda: cache.truncate(s, n))
        if ok:
            self.expect_length(s, int(n), "truncate")
        return ok

    def step(self):
        """A step over some live sequences with 0-6 new tokens each (or malformed ids and
        counts); a step begun must leave every length grown by its count."""
        p, cache = self.p, self.cache
        ids = [s for s in cache.sequences if p.bool(60)]
        plain = [p.int(0, 6) for _ in ids]
        ids, counts = [int_form(p, s) for s in ids], counts_form(p, plain)
        if p.bool(20):
            ids, counts = maybe_bad(p, ids, 100), maybe_bad(p, counts, 100)
        ok, st = call("cache.begin_step", lambda: cache.begin_step(ids, counts))
        if ok:
            self.steps.append(st)
            for s, n in zip(ids, counts):
                self.expect_length(s, self.state[3][int(s)][0] + int(n), "begin_step")
        return ok

    def attend_arrays(self, T):
        """A layer and q, k, v for ``T`` new tokens; at times the new keys are a view of the
        pool the step writes (they must be read before they are written)."""
        p, cache = self.p, self.cache
        r = np.random.default_rng(p.int(0, 99))
        layer = int_form(p, p.int(0, cache.num_layers - 1))
        q = r.standard_normal((T, self.H, cache.head_dim)).astype(p.pick([np.float32, np.float16]))
        k = r.standard_normal((T, cache.num_kv_heads, cache.head_dim)).astype(np.float32)
        v = (
            None
            if cache.value_from_key
            else r.standard_normal((T, cache.num_kv_heads, cache.value_dim)).astype(np.float32)
        )
        if p.bool(10) and cache.block_size >= T and cache.dtype == np.float32:
            k = cache.k_pages(layer)[p.int(0, cache.num_blocks - 1)].transpose(1, 0, 2)[:T]
        return {"layer": layer, "q": q, "k": k, "v": v}

    def attend_options(self):
        """Maybe one option of Step.attend, with a value of any of its kinds."""
        p = self.p
        if not p.bool(30):
            return {}
        value = p.pick([None, 1, 0.5, True, (2, None), 1.5, np.zeros(self.H, np.float32)])
        return {p.pick(STEP_OPTIONS): value}

    def attend(self, stale):
        """Step.attend on the pending step (or, ``stale``, on any step begun) with valid or
        malformed arrays."""
        p, cache = self.p, self.cache
        if not self.steps:
            return None
        st = p.pick(self.steps) if stale else self.steps[-1]
        args = self.attend_arrays(st.num_tokens)
        opt = self.attend_options()
        for _ in range(p.int(0, 2)):
            name = p.pick(list(args) + list(opt) or ["q"])
            if name in args:
                args[name] = maybe_bad(p, args[name], 100)
            else:
                opt[name] = garbage(p)
        ok, _ = call(
            "Step.attend",
            lambda: st.attend(args["layer"], args["q"], args["k"], args["v"], **opt),
            inputs=[args["q"], args["k"], args["v"]],
            writes=[cache._k, cache._v],
        )
        if ok:
            self.state = cache_state(cache)  # the pages changed: that was the point
        return ok


# the operations drawn (steps and attends more often than the rest); saved findings replay by
# this order
CACHE_OPS = [
    "new",
    "new",
    "fork",
    "truncate",
    "free",
    "length",
    "block_table",
    "pages",
    "stats",
    "step",
    "step",
    "step",
    "attend",
    "attend",
    "attend",
    "stale_attend",
    "props",
]
CACHE_OP_METHODS = {
    "new": CacheSession.new,
    "fork": CacheSession.fork,
    "truncate": CacheSession.truncate,
    "free": CacheSession.free,
    "length": CacheSession.length,
    "block_table": CacheSession.block_table,
    "pages": CacheSession.pages,
    "stats": CacheSession.stats,
    "step": CacheSession.step,
    "attend": lambda s: s.attend(stale=False),
    "stale_attend": lambda s: s.attend(stale=True),
    "props": CacheSession.props,
}


def fuzz_cache(p):
    kw = _cache_kwargs(p)
    made, cache = call("PagedKVCache", lambda: attnx.PagedKVCache(**kw))
    if not made:
        return
    if cache.num_blocks * cache.bytes_per_block > 1 << 24:
        return  # a valid but large pool (a garbage size that happens to be legal)
    session = CacheSession(p, cache)
    for _ in range(p.int(1, 14)):
        session.run(p.pick(CACHE_OPS))


# ---- torch-compatible API, layers, global settings --------------------------------------------


def fuzz_sdpa(p):
    lead = tuple(p.int(0, 3) for _ in range(p.int(0, 2)))
    L, S, E, Ev = p.int(0, 8), p.int(0, 8), p.int(1, 8), p.int(1, 8)
    Hq = Hk = 1
    if lead and p.bool(30):
        Hk = max(1, lead[-1])
        Hq = Hk * p.int(1, 3)
    dtype = p.pick([np.float32, np.float16, BF16, np.float64])
    q = rand_array(p, lead[:-1] + (Hq,) + (L, E) if lead else (L, E), dtype)
    k = rand_array(p, lead[:-1] + (Hk,) + (S, E) if lead else (S, E), dtype)
    v = rand_array(p, lead[:-1] + (Hk,) + (S, Ev) if lead else (S, Ev), dtype)
    args = {"query": q, "key": k, "value": v}
    if p.bool(30):
        args["attn_mask"] = np.ones((L, S), bool) if p.bool() else np.zeros((L, S), np.float32)
    for name, vals in (
        ("dropout_p", [0.0, 0.1]),
        ("is_causal", [True, False]),
        ("scale", [None, 0.5, 0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-46]),
        ("enable_gqa", [True, False]),
    ):
        if p.bool(25):
            args[name] = p.pick(vals)
    for _ in range(p.int(0, 3)):
        name = p.pick(list(args) + ["attn_mask"])
        args[name] = maybe_bad(p, args.get(name, np.ones(2, bool)), 100)
    call(
        "scaled_dot_product_attention",
        lambda: attnx.scaled_dot_product_attention(**args),
        inputs=list(args.values()),
    )


def fuzz_mha(p):
    H = p.int(1, 4)
    Hkv = p.pick([None, 1, H])
    hd = p.pick([None, 2, 4])
    d_model = H * (hd or 2) if hd is None else p.pick([4, 8, 6])
    kw = dict(
        d_model=d_model,
        num_heads=H,
        num_kv_heads=Hkv,
        head_dim=hd,
        bias=p.bool(),
        dtype=p.pick([np.float32, np.float16, BF16]),
        seed=p.int(0, 9),
    )
    if p.bool(20):
        kw["context_dim"] = p.pick([3, 8])
    for _ in range(p.int(0, 2) if p.bool(30) else 0):
        kw[p.pick(list(kw))] = garbage(p)
    made, layer = call("MultiHeadAttention", lambda: attnx.MultiHeadAttention(**kw))
    if not made:
        return
    batch = p.bool()
    S, Sk = p.int(0, 6), p.int(0, 6)
    x = rand_array(p, ((2,) if batch else ()) + (S, layer.d_model), np.float32)
    args = {"x": x}
    if layer.context_dim != layer.d_model or p.bool(30):
        args["context"] = rand_array(
            p, ((2,) if batch else ()) + (Sk, layer.context_dim), np.float32
        )
    for name, make in (
        ("causal", lambda: p.bool()),
        ("return_weights", lambda: p.bool()),
        ("mask", lambda: np.ones((S, Sk if "context" in args else S), bool)),
        ("kv_lens", lambda: np.array([1, 0]) if batch else 1),
        ("q_lens", lambda: np.array([1, 1]) if batch else 0),
    ):
        if p.bool(20):
            args[name] = make()
    for _ in range(p.int(0, 3)):
        name = p.pick(list(args) + ["mask", "context"])
        args[name] = maybe_bad(p, args.get(name, np.ones(2, np.float32)), 100)
    x = args.pop("x")
    call("MultiHeadAttention.__call__", lambda: layer(x, **args), inputs=[x] + list(args.values()))
    if p.bool(20):  # assign a malformed weight
        name = p.pick(["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_O"])
        val = garbage(p) if p.bool() else mutate_array(p, np.ones((layer.d_model, 2), np.float32))
        call("MultiHeadAttention.set", lambda: setattr(layer, name, val))
        call("MultiHeadAttention.__call__", lambda: layer(x), inputs=[x])


def fuzz_settings(p):
    before = attnx.get_num_threads()
    n = garbage(p) if p.bool(70) else p.int(0, 4)
    ok, _ = call("set_num_threads", lambda: attnx.set_num_threads(n))
    if not ok and attnx.get_num_threads() != before:
        raise Finding("set_num_threads raised but changed the setting")
    q = np.ones((1, 2, 3, 4), np.float32)
    call("attention", lambda: attnx.attention(q, q, q))


ENTRIES = [
    fuzz_attention,
    fuzz_attention,
    fuzz_paged,
    fuzz_paged,
    fuzz_cache,
    fuzz_cache,
    fuzz_sdpa,
    fuzz_mha,
    fuzz_settings,
]


def one_input(data: bytes) -> None:
    """The harness: decode ``data`` into one malformed call (or cache session) and check it."""
    p = Provider(data)
    entry = p.pick(ENTRIES)
    isa = p.pick(ISAS)
    prev_isa = attnx.cpu_features()["isa"]
    attnx._core.set_isa(isa)
    try:
        entry(p)
    finally:
        attnx._core.set_isa(prev_isa)
        attnx.set_num_threads(0)  # (only fuzz_settings changes it)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


FINDINGS: collections.Counter = collections.Counter()  # --keep-going: message -> count
EXAMPLES: dict = {}  # message -> the first input that produced it


def _plain_runs(n, seed=0, keep_going=False):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        data = rng.bytes(int(rng.integers(0, 400)))
        try:
            one_input(data)
        except Finding as e:
            if not keep_going:
                raise
            key = str(e)[:160]
            FINDINGS[key] += 1
            EXAMPLES.setdefault(key, data)


def main(argv):
    runs, rest, use_atheris, keep_going, seed = None, [], True, False, 0
    it = iter(argv[1:])
    for a in it:
        if a == "--runs":
            runs = int(next(it))
        elif a.startswith("--runs="):
            runs = int(a.split("=", 1)[1])
        elif a == "--no-atheris":
            use_atheris = False
        elif a == "--keep-going":  # plain mode: count distinct findings instead of stopping
            keep_going = True
        elif a == "--seed":
            seed = int(next(it))
        else:
            rest.append(a)
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is None or not use_atheris:
        n = 1000 if runs is None else runs
        print(
            f"fuzz_entrypoints: {'atheris not installed; ' if atheris is None else ''}"
            f"{n} random inputs",
            file=sys.stderr,
        )
        _plain_runs(n, seed, keep_going)
        print_stats()
        for key, count in FINDINGS.most_common():
            print(f"FINDING x{count}: {key}\n  input: {EXAMPLES[key]!r}", file=sys.stderr)
        return 1 if FINDINGS else 0
    if runs is not None:
        rest.append(f"-runs={runs}")
    # (libFuzzer leaves with _exit: its own final line "Done N runs" is the count)
    atheris.instrument_all()
    atheris.Setup([argv[0]] + rest, one_input)
    atheris.Fuzz()
    return 0


def print_stats():
    by_entry = collections.defaultdict(dict)
    for (entry, outcome), n in sorted(STATS.items()):
        by_entry[entry][outcome] = n
    total = sum(STATS.values())
    print(f"fuzz_entrypoints: {total} calls", file=sys.stderr)
    for entry, outcomes in by_entry.items():
        print(f"  {entry}: " + ", ".join(f"{k} {v}" for k, v in outcomes.items()), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
