"""Differential fuzz: ``attnx.attention`` and ``attnx.paged_attention`` (C++) against
``attnx.reference`` (NumPy, float64) on problems hypothesis draws.

Each dense case draws: rank (2/3/4) and layout; B, GQA ratio, Sq, Sk (0 and 1 included), Dk, Dv;
dtype; the memory layout of q, k, v and mask (contiguous, Fortran order, axis-permuted buffers,
sliced with a step, negative strides, offset rows, byte-swapped, a field of a structured array,
zero-stride broadcasts); a boolean or additive mask (float16/bfloat16/float32/float64, -inf
entries) of a broadcast shape; kv_lens / q_lens padding (lists, NumPy scalars and arrays of every
integer width and byte order); causal; window (sides as NumPy integers of any width, or wider than
any sequence), softcap and scale (at the ends of float32's normal range, as NumPy scalars), sinks,
ALiBi; num_threads; an ``out`` array (fresh, strided, a structured field, aliasing q,
overlapping q, k, v or the mask, or with drawn strides whose elements may share memory, which
must be refused untouched); and the instruction set. Non-finite keys and values are planted where
some rows do not look (past kv_lens), and non-finite keys where rows do: NaN and inf must reach
exactly the rows the reference says.
The result is held to the reference with helpers' dtype-aware tolerance (``attention_tolerance``:
3x the error of a same-precision implementation) plus a floor for ill-conditioned scores (a few
float32 ulps of ``scale * sum_d |q_d k_d|``, which the same-precision twin can be lucky on when
its own rounding errors cancel), by ``check_dense``, an extension of ``helpers.check_attention``.

Each paged case draws a scrambled pool (block ids a random permutation, every slot no sequence
owns NaN, junk ids past each sequence's last block), block size, kv and q dtypes (independent),
page layouts (head-major, slot-major, sliced, reversed or structured-field pool), tables and
lengths of every integer width and byte order, a mix of q_lens (0, decode 1, chunks, whole
prefill), zero-length sequences, causal, variants (extreme scalars too), threads, ``out`` (fresh,
strided, aliasing q, inside the pool it reads, drawn strides that may overlap) and ISA, and holds the
result to ``attnx.reference.paged_attention`` with the same tolerance rule.

How much: ``FUZZ_EXAMPLES`` (3000) dense and ``FUZZ_EXAMPLES // 2`` (1500) paged cases per run,
4500 in all, ~40 s on 2 cores; ``ATTNX_FUZZ_EXAMPLES=N`` sets the dense count (.ci/sanitize.sh
uses 1000). Soak mode, for long runs, multiplies both by 40 (120k dense + 60k paged cases, about
30 min)::

    ATTNX_HYPOTHESIS_PROFILE=soak python -m pytest tests/hardening/test_fuzz.py -q

(``ATTNX_TEST_SEED`` changes the data of every case; a failure prints its falsifying example.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import attnx

from helpers import BF16, ISAS, SEED, check_dense, check_paged, from4, scramble_tables
from helpers.fuzz import fuzz_harness

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
SOAK = os.environ.get("ATTNX_HYPOTHESIS_PROFILE", "ci") == "soak"
FUZZ_EXAMPLES = int(os.environ.get("ATTNX_FUZZ_EXAMPLES", "3000")) * (40 if SOAK else 1)
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
PAGED_FUZZ = settings(FUZZ, max_examples=max(1, FUZZ_EXAMPLES // 2))


class on_isa:
    """Runs a block on one kernel path and restores the previous one."""

    def __init__(self, isa):
        self.isa = isa

    def __enter__(self):
        self.prev = attnx.cpu_features()["isa"]
        attnx._core.set_isa(self.isa)

    def __exit__(self, *exc):
        attnx._core.set_isa(self.prev)


# ---------------------------------------------------------------------------------------------
# memory layouts: the same values, stored differently
# ---------------------------------------------------------------------------------------------

VIEWS = [
    "c",
    "c",
    "fortran",
    "permuted",
    "step",
    "negative",
    "offset",
    "swapped",
    "field",
    "broadcast",
]
INT_DTYPES, INT_SCALARS = fuzz_harness().INT_DTYPES, fuzz_harness().INT_SCALARS
F32_TINY = float(np.finfo(np.float32).tiny)


def structured_field(x, pad):
    """``x``'s values as a field of a structured array: byte strides that are no multiple of the
    item size, and a misaligned start."""
    st_ = np.zeros(x.shape, dtype=[("pad", f"V{pad}"), ("x", x.dtype)])
    st_["x"] = x
    return st_["x"]


def every_other(x, rng, last):
    """``x`` as every other element of a larger buffer along one drawn axis (not the last one
    unless ``last``); the buffer's other elements are NaN (zeros for integers)."""
    ax = int(rng.integers(x.ndim if last else max(1, x.ndim - 1)))
    shape = list(x.shape)
    shape[ax] *= 2
    buf = (
        np.full(shape, np.nan, x.dtype)
        if x.dtype.kind == "f" or x.dtype == BF16
        else np.zeros(shape, x.dtype)
    )
    idx = [slice(None)] * x.ndim
    idx[ax] = slice(None, None, 2)
    buf[tuple(idx)] = x
    return buf[tuple(idx)]


def broadcast_view(x):
    """``x`` as a zero-stride view along the first axis where it is constant (a copy where
    there is none)."""
    for ax in range(x.ndim):
        if x.shape[ax] > 1 and np.array_equal(
            x, np.take(x, [0], axis=ax).repeat(x.shape[ax], ax), equal_nan=True
        ):
            return np.broadcast_to(np.take(x, [0], axis=ax), x.shape)
    return np.ascontiguousarray(x)


def present(x, how, rng, last=True):
    """An array equal to ``x`` whose memory layout is ``how`` (views only, never a different
    value). ``broadcast`` needs an axis where ``x`` is constant; it falls back to ``c``.
    ``last=False``: the last axis stays contiguous (``step``/``negative`` pick another axis)."""
    x = np.asarray(x)
    if x.ndim == 0 or x.size == 0 or how == "c":
        return np.ascontiguousarray(x)
    if how == "fortran":
        return np.asfortranarray(x)
    if how == "permuted":  # stored in another axis order, viewed back: strides out of order
        perm = rng.permutation(x.ndim)
        buf = np.ascontiguousarray(x.transpose(perm))
        return buf.transpose(np.argsort(perm))
    if how == "step":  # every other element of a larger buffer along one axis
        return every_other(x, rng, last)
    if how == "negative":  # a reversed view of a reversed copy: negative stride on one axis
        ax = int(rng.integers(x.ndim if last else max(1, x.ndim - 1)))
        return np.ascontiguousarray(np.flip(x, ax)).__getitem__(
            tuple(slice(None, None, -1) if a == ax else slice(None) for a in range(x.ndim))
        )
    if how == "offset":  # rows of a wider buffer: unit last axis, padded row stride, offset start
        shape = list(x.shape)
        shape[-1] += 3
        buf = np.zeros(shape, x.dtype)
        buf[..., 1 : 1 + x.shape[-1]] = x
        return buf[..., 1 : 1 + x.shape[-1]]
    if how == "swapped":  # the same values in the other byte order (converted: never misread)
        return x.astype(x.dtype.newbyteorder("S")) if x.dtype.itemsize > 1 else x
    if how == "field":  # (misaligned: not handed to a sanitized build, see test_misaligned_arrays)
        return (
            np.ascontiguousarray(x) if SANITIZED else structured_field(x, int(rng.integers(1, 4)))
        )
    if how == "broadcast":
        return broadcast_view(x)
    raise AssertionError(how)


def any_strides(shape, dtype, r, unit_last=False):
    """An ``out`` of ``shape`` over a buffer of 7s with drawn element strides: a contiguous
    layout in a random axis order with one stride shrunk (to 0 at times), so that its elements
    may share memory, interleave without meeting, or neither. ``unit_last``: the last axis keeps
    stride 1 (paged_attention's rule). Returns (out, buffer)."""
    nd = len(shape)
    order = list(r.permutation(nd - 1 if unit_last else nd)) + ([nd - 1] if unit_last else [])
    strides, step = [0] * nd, 1
    for ax in reversed(order):
        strides[ax] = step
        step *= max(shape[ax], 1)
    movable = [ax for ax in range(nd) if shape[ax] > 1 and not (unit_last and ax == nd - 1)]
    if movable:
        ax = int(r.choice(movable))
        strides[ax] = int(r.choice([0, r.integers(1, strides[ax] + 1)]))
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if 0 not in shape else 1
    buf = np.full(span, 7.0, dtype)
    out = np.lib.stride_tricks.as_strided(
        buf, shape, [s * buf.itemsize for s in strides], writeable=True
    )
    return out, buf


def shares_elements(a):
    """The oracle for ``out`` refusals: whether two index tuples of ``a`` reach the same offset
    (brute force; the strides are whole elements)."""
    offsets = np.zeros(a.shape, np.int64)
    for ax, (n, s) in enumerate(zip(a.shape, a.strides)):
        offsets = offsets + (np.arange(n) * s).reshape([n if i == ax else 1 for i in range(a.ndim)])
    return np.unique(offsets).size < a.size


def refused_untouched(call, out, buf):
    """Where ``out`` shares elements, ``call()`` is a ValueError naming it and the buffer stays
    7s; returns True then (the case is over), False where ``out`` is a valid target."""
    if out is None or not shares_elements(out):
        return False
    with pytest.raises(ValueError, match=r"^out: elements of the array overlap"):
        call()
    assert (buf.astype(np.float64) == 7.0).all(), "a refused out was written"
    return True


# ---------------------------------------------------------------------------------------------
# dense attention
# ---------------------------------------------------------------------------------------------


def window_sides():
    """A window side: None, a small int or one wider than any sequence (2**40 and past int64's
    range count as unbounded), as a Python int or a NumPy integer of any width."""
    small = st.tuples(st.integers(0, 10), st.sampled_from(INT_SCALARS)).map(lambda t: t[1](t[0]))
    huge = st.sampled_from([2**31, 2**40, 2**63 - 1, 2**64 + 5, np.uint64(2**63), np.int64(2**62)])
    return st.one_of(st.none(), small, small, huge)


@st.composite
def dense_problems(draw):
    rank = draw(st.sampled_from([2, 3, 4, 4]))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    B = draw(st.sampled_from([0, 1, 1, 2, 3])) if rank == 4 else 1
    Hkv = draw(st.integers(1, 3)) if rank > 2 else 1
    Hq = Hkv * draw(st.sampled_from([1, 1, 2, 3, 4])) if rank > 2 else 1
    small = st.sampled_from([0, 1, 1, 2, 3, 5, 8, 13])
    Sq = draw(st.one_of(small, st.integers(0, 40)))
    Sk = draw(st.one_of(small, st.integers(0, 80)))
    Dk = draw(st.sampled_from([1, 2, 3, 4, 7, 8, 16, 17, 33]))
    Dv = draw(st.sampled_from([Dk, 1, 5, 8, 16, 19]))
    spec = dict(
        rank=rank,
        layout=layout,
        shape=(B, Hq, Hkv, Sq, Sk, Dk, Dv),
        dtype=draw(st.sampled_from(DTYPES)),
        views=[draw(st.sampled_from(VIEWS)) for _ in range(3)],
        bcast_kv=draw(st.sampled_from([None, None, None, 0, 1, 2])),  # kv constant along an axis
        magnitude=draw(st.sampled_from([0.1, 1.0, 1.0, 3.0])),
        planted=draw(st.sampled_from(["none", "none", "unseen", "seen"])),
        mask=draw(st.sampled_from([None, None, "bool", "additive"])),
        mask_dtype=draw(st.sampled_from([np.float32, np.float32, np.float16, BF16, np.float64])),
        mask_dims=draw(st.lists(st.booleans(), min_size=4, max_size=4)),  # True: full size
        mask_ndim=draw(st.integers(1, rank)),
        mask_view=draw(st.sampled_from(VIEWS[:-1])),
        causal=draw(st.booleans()),
        kv_lens=draw(st.booleans()),
        q_lens=draw(st.booleans()),
        lens_form=draw(st.sampled_from(["array", "list", "scalar"] + INT_DTYPES)),
        window=draw(st.one_of(st.none(), st.tuples(window_sides(), window_sides()))),
        softcap=draw(st.sampled_from([None, None, 0.3, 2.0, 50.0, F32_TINY, 1e-30, 1e30])),
        sinks=draw(st.booleans()),
        alibi=draw(st.booleans()),
        scale=draw(st.sampled_from([None, None, 0.05, 1.0, 2.5, F32_TINY, 1e-30, 1e12])),
        scalar_type=draw(st.sampled_from([float, np.float64, np.float32])),
        num_threads=draw(st.sampled_from([None, 1, 2, 3])),
        out=draw(
            st.sampled_from(
                [None, None, "fresh", "strided", "field", "alias_q", "overlap", "any_strides"]
            )
        ),
        overlap_with=draw(st.sampled_from(["q", "k", "v", "mask"])),
        isa=draw(st.sampled_from(ISAS)),
        data_seed=draw(st.integers(0, 2**32 - 1)),
    )
    return spec


def _mask(r, spec, logical):
    rank = spec["rank"]
    dims = [s if full else 1 for s, full in zip(logical, spec["mask_dims"][4 - rank :])]
    dims = dims[rank - spec["mask_ndim"] :]  # fewer leading axes broadcast too
    if spec["mask"] == "bool":
        m = r.random(dims) < 0.75
    else:
        m = r.standard_normal(dims) * 2.0
        m[r.random(dims) < 0.25] = -np.inf
        m = m.astype(spec["mask_dtype"])
    return present(m, spec["mask_view"], r)


def _lens(r, spec, n, B):
    x = r.integers(0, n + 1, size=B)
    form = spec["lens_form"]
    if form == "list" and B:  # ([] would be a float array, for the reference too)
        return x.tolist()
    if form == "scalar":  # one length: a NumPy scalar of any width (ranks 2 and 3 have B == 1)
        return INT_SCALARS[int(r.integers(len(INT_SCALARS)))](x[0]) if spec["rank"] < 4 else x
    if isinstance(form, np.dtype):
        if form.itemsize == 1 and n > 127:
            return x
        return x.astype(form) if r.random() < 0.7 else present(x.astype(form), "field", r)
    return x


def _overlapping(x, out_shape, dtype, r):
    """``x``'s values stored in a buffer that an ``out`` of ``out_shape`` overlaps: (x', out)."""
    size = int(np.prod(out_shape))
    buf = np.full(x.size + size, 7.0, dtype)
    x2 = buf[: x.size].reshape(x.shape)
    x2[...] = x
    start = int(r.integers(0, x.size + 1))
    return x2, buf[start : start + size].reshape(out_shape)


def _plant(r, spec, k4, v4, kw):
    """Plants a non-finite key or value (in place) as ``spec["planted"]`` says: "unseen" past
    kv_lens (never read), "seen" anywhere. Returns whether the output may hold NaN."""
    B, Hkv, Sk, _ = k4.shape
    if spec["planted"] == "none" or Sk == 0 or B == 0:
        return False
    bad = r.choice([np.nan, np.inf, -np.inf])
    # "seen" plants go into keys only: a non-finite value at a visible key whose weight
    # underflows to 0 is dropped by the kernel on partly visible tiles (a known bug, see
    # test_numerics.py::test_nan_value_with_underflowed_weight), and whether the weight
    # underflows at all differs between float32 and the float64 reference for inf
    target = k4 if spec["planted"] == "seen" or r.random() < 0.5 else v4
    b, h = int(r.integers(B)), int(r.integers(Hkv))
    if spec["planted"] == "unseen":
        kvl = (
            np.full(B, Sk)
            if "kv_lens" not in kw
            else np.asarray(kw["kv_lens"], np.int64).reshape(-1)
        )
        if kvl[b] < Sk:
            target[b, h, int(r.integers(kvl[b], Sk)), int(r.integers(target.shape[3]))] = bad
        return False
    target[b, h, int(r.integers(Sk)), int(r.integers(target.shape[3]))] = bad
    return True


def _dense_out(r, spec, q, k, v, kw, out_shape, dtype):
    """The ``out`` that ``spec["out"]`` draws (fresh, strided, a misaligned field, q itself, or
    overlapping an input it must not change; None where that cannot be built). Returns (q, k, v,
    out): an overlapped input is replaced by the buffer ``out`` overlaps (a mask in ``kw``)."""
    out = None
    if spec["out"] == "fresh":
        out = np.full(out_shape, 7.0, dtype)
    elif spec["out"] == "strided":
        out = present(np.full(out_shape, 7.0, dtype), r.choice(["step", "negative", "permuted"]), r)
    elif spec["out"] == "field":
        out = present(np.full(out_shape, 7.0, dtype), "field", r)
    elif spec["out"] == "alias_q" and q.shape[-1] == v.shape[-1]:
        out = q if q.flags.writeable and q.dtype.isnative else None
    elif spec["out"] == "overlap":  # out shares memory with an input it must not change
        name = spec["overlap_with"]
        x = {"q": q, "k": k, "v": v, "mask": kw.get("mask")}[name]
        if x is not None and np.asarray(x).dtype == np.dtype(dtype):
            x, out = _overlapping(np.asarray(x), out_shape, dtype, r)
            if name == "mask":
                kw["mask"] = x
            else:
                q, k, v = (x if n == name else a for n, a in (("q", q), ("k", k), ("v", v)))
    return q, k, v, out


@seed(SEED)
@FUZZ
@given(dense_problems())
def test_dense_fuzz(spec):
    B, Hq, Hkv, Sq, Sk, Dk, Dv = spec["shape"]
    rank, layout, dtype = spec["rank"], spec["layout"], spec["dtype"]
    r = np.random.default_rng(spec["data_seed"])
    mag = spec["magnitude"]
    q4 = r.standard_normal((B, Hq, Sq, Dk)) * mag
    kshape = [B, Hkv, Sk, Dk]
    vshape = [B, Hkv, Sk, Dv]
    ax = spec["bcast_kv"]
    if ax is not None:  # keys and values constant along one axis: may become a zero stride
        kshape[ax] = vshape[ax] = 1
    k4 = np.broadcast_to(r.standard_normal(kshape) * mag, (B, Hkv, Sk, Dk)).copy()
    v4 = np.broadcast_to(r.standard_normal(vshape), (B, Hkv, Sk, Dv)).copy()
    as_type = spec["scalar_type"]  # (a NumPy float scalar: the same value, another type)
    kw = dict(
        causal=spec["causal"],
        window=spec["window"],
        num_threads=spec["num_threads"],
        scale=None if spec["scale"] is None else as_type(spec["scale"]),
        softcap=None if spec["softcap"] is None else as_type(spec["softcap"]),
    )
    logical = (B, Hq, Sq, Sk)[4 - rank :]
    if spec["kv_lens"]:
        kw["kv_lens"] = _lens(r, spec, Sk, B)
    if spec["q_lens"]:
        kw["q_lens"] = _lens(r, spec, Sq, B)
    if spec["sinks"]:
        kw["sinks"] = (r.standard_normal(Hq) * 2).astype(np.float32)
    if spec["alibi"]:
        kw["alibi_slopes"] = r.random(Hq).astype(np.float32)
    expect_nan = _plant(r, spec, k4, v4, kw)
    if spec["mask"] is not None:
        kw["mask"] = _mask(r, spec, logical)
    q = present(from4(q4.astype(dtype), layout, rank), spec["views"][0], r)
    k = present(from4(k4.astype(dtype), layout, rank), spec["views"][1], r)
    v = present(from4(v4.astype(dtype), layout, rank), spec["views"][2], r)
    out_shape = from4(np.empty((B, Hq, Sq, Dv)), layout, rank).shape
    out = None
    if spec["out"] in ("fresh", "strided", "field", "alias_q", "overlap"):
        q, k, v, out = _dense_out(r, spec, q, k, v, kw, out_shape, dtype)
    elif spec["out"] == "any_strides":
        out, buf = any_strides(out_shape, dtype, r)
        with on_isa(spec["isa"]):
            if refused_untouched(
                lambda: attnx.attention(q, k, v, layout=layout, out=out, **kw), out, buf
            ):
                return
    with on_isa(spec["isa"]):
        o, _ = check_dense(q, k, v, layout=layout, out=out, **kw)
    if (
        not expect_nan
        and spec["planted"] != "seen"
        and not (spec["mask"] == "additive" and np.isnan(np.asarray(kw["mask"], np.float64)).any())
    ):
        assert not np.isnan(o.astype(np.float64)).any(), "NaN from finite inputs"


# ---------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------


@st.composite
def paged_problems(draw):
    B = draw(st.integers(1, 5))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    seq_lens = draw(
        st.lists(
            st.one_of(st.sampled_from([0, 1, 2, block_size, block_size + 1]), st.integers(0, 60)),
            min_size=B,
            max_size=B,
        )
    )
    q_mode = draw(
        st.lists(st.sampled_from(["zero", "one", "one", "chunk", "all"]), min_size=B, max_size=B)
    )
    Hkv = draw(st.integers(1, 3))
    return dict(
        B=B,
        block_size=block_size,
        seq_lens=seq_lens,
        q_mode=q_mode,
        decode_only=draw(st.booleans()),
        Hkv=Hkv,
        Hq=Hkv * draw(st.sampled_from([1, 2, 3, 4])),
        Dk=draw(st.sampled_from([1, 3, 4, 8, 16, 17, 32])),
        Dv=draw(st.sampled_from([None, 1, 6, 16])),
        kv_dtype=draw(st.sampled_from(DTYPES)),
        q_dtype=draw(st.sampled_from(DTYPES)),
        page_view=draw(st.sampled_from(["c", "c", "slot_major", "step", "reversed", "field"])),
        q_view=draw(st.sampled_from(VIEWS[:-1])),
        spare=draw(st.integers(0, 4)),
        extra_cols=draw(st.integers(0, 3)),
        junk=draw(st.sampled_from(["big", "negative", "zero"])),
        table_dtype=draw(st.sampled_from([np.int32, np.int64, np.uint32] + INT_DTYPES[2:])),
        lens_dtype=draw(st.sampled_from(INT_DTYPES)),
        causal=draw(st.sampled_from([True, True, False])),
        window=draw(st.one_of(st.none(), st.tuples(window_sides(), window_sides()))),
        softcap=draw(st.sampled_from([None, None, 1.0, 30.0, F32_TINY, 1e30])),
        sinks=draw(st.booleans()),
        alibi=draw(st.booleans()),
        scale=draw(st.sampled_from([None, None, 0.1, 1.5, 1e-30, np.float32(0.3)])),
        num_threads=draw(st.sampled_from([None, 1, 2, 3])),
        out=draw(
            st.sampled_from(
                [None, None, "fresh", "strided", "alias_q", "overlap_pages", "any_strides"]
            )
        ),
        planted=draw(st.booleans()),
        isa=draw(st.sampled_from(ISAS)),
        data_seed=draw(st.integers(0, 2**32 - 1)),
    )


def _pages(r, spec):
    """A scrambled, NaN-poisoned pool; returns (k_pages, v_pages, block_tables, seq_lens, q_lens)."""
    bs, Hkv, Dk = spec["block_size"], spec["Hkv"], spec["Dk"]
    Dv = Dk if spec["Dv"] is None else spec["Dv"]
    seq_lens = np.asarray(spec["seq_lens"], np.int64)
    need = -(-seq_lens // bs)
    nb = max(1, int(need.sum()) + spec["spare"])
    k = r.standard_normal((nb, Hkv, bs, Dk))
    v = r.standard_normal((nb, Hkv, bs, Dv))
    width = max(1, int(need.max(initial=0)) + spec["extra_cols"])
    junk = {"big": 1 << 30, "negative": -1, "zero": 0}[spec["junk"]]
    if np.dtype(spec["table_dtype"]).kind == "u" and junk < 0:
        junk = 1 << 31
    tables, owned = scramble_tables(r, seq_lens, bs, nb, width, junk, dtype=np.int64)
    k.transpose(0, 2, 1, 3)[~owned] = np.nan
    v.transpose(0, 2, 1, 3)[~owned] = np.nan
    if spec["planted"] and owned.any():
        # a non-finite value in an owned slot: NaN reaches exactly the rows that see it
        blk, slot = np.argwhere(owned)[int(r.integers(owned.sum()))]
        (k if r.random() < 0.5 else v)[blk, int(r.integers(Hkv)), slot, 0] = r.choice(
            [np.nan, np.inf, -np.inf]
        )
    kd = spec["kv_dtype"]
    k, v = k.astype(kd), v.astype(kd)
    view = spec["page_view"]
    if view == "slot_major":  # pages stored (nb, bs, Hkv, D), viewed (nb, Hkv, bs, D)
        k = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        v = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif view == "step":
        k, v = present(k, "step", r), present(v, "step", r)
    elif view == "reversed":  # the pool seen through a negative block stride
        k, v = np.ascontiguousarray(k[::-1])[::-1], np.ascontiguousarray(v[::-1])[::-1]
    elif view == "field":  # fields of a structured array: read through a copy, never misread
        k, v = present(k, "field", r), present(v, "field", r)
    q_lens = []
    for n, mode in zip(seq_lens, spec["q_mode"]):
        n = int(n)
        if spec["decode_only"]:
            q_lens.append(min(1, n))
        elif mode == "zero" or n == 0:
            q_lens.append(0)
        elif mode == "one":
            q_lens.append(1)
        elif mode == "chunk":
            q_lens.append(int(r.integers(1, n + 1)))
        else:
            q_lens.append(n)
    ld = spec["lens_dtype"]
    return (
        k,
        v,
        tables.astype(spec["table_dtype"]),
        seq_lens.astype(ld),
        np.asarray(q_lens, np.int64).astype(ld),
    )


def _paged_out(r, spec, q, kp, out_shape):
    """The ``out`` that ``spec["out"]`` draws (fresh, strided, q itself, or inside the pool it
    reads; None where that cannot be built; out is never byte-swapped). Returns (k_pages,
    out): for an overlapping out, k_pages is replaced by the buffer ``out`` lies in."""
    out = None
    out_dtype = q.dtype.newbyteorder("=")
    if spec["out"] == "fresh":
        out = np.full(out_shape, 7.0, out_dtype)
    elif spec["out"] == "strided":
        # (paged_attention refuses an out whose last axis is strided: tests/paged/test_paged.py)
        out = present(
            np.full(out_shape, 7.0, out_dtype), r.choice(["step", "negative"]), r, last=False
        )
    elif (
        spec["out"] == "alias_q"
        and out_shape[-1] == q.shape[-1]
        and q.dtype.isnative
        and q.flags.writeable
        and q.flags.aligned
        and (q.strides[-1] == q.itemsize or q.shape[-1] == 1)
    ):
        out = q
    elif spec["out"] == "overlap_pages" and q.dtype == kp.dtype:  # out inside the pool it reads
        kp, out = _overlapping(kp, out_shape, q.dtype, r)
    return kp, out


@seed(SEED)
@PAGED_FUZZ
@given(paged_problems())
def test_paged_fuzz(spec):
    r = np.random.default_rng(spec["data_seed"])
    kp, vp, tables, seq_lens, q_lens = _pages(r, spec)
    Hq, Dk = spec["Hq"], spec["Dk"]
    N = int(q_lens.sum())
    q = present(r.standard_normal((N, Hq, Dk)).astype(spec["q_dtype"]), spec["q_view"], r)
    kw = dict(
        causal=spec["causal"], scale=spec["scale"], window=spec["window"], softcap=spec["softcap"]
    )
    if spec["sinks"]:
        kw["sinks"] = (r.standard_normal(Hq) * 2).astype(np.float32)
    if spec["alibi"]:
        kw["alibi_slopes"] = r.random(Hq).astype(np.float32)
    lens_kw = {} if spec["decode_only"] and np.all(q_lens == 1) else {"q_lens": q_lens}
    Dv = vp.shape[3]
    out = None
    if spec["out"] in ("fresh", "strided", "alias_q", "overlap_pages"):
        kp, out = _paged_out(r, spec, q, kp, (N, Hq, Dv))
    elif spec["out"] == "any_strides":
        out, buf = any_strides((N, Hq, Dv), q.dtype.newbyteorder("="), r, unit_last=True)
        with on_isa(spec["isa"]):
            if refused_untouched(
                lambda: attnx.paged_attention(
                    q, kp, vp, tables, seq_lens, out=out, **lens_kw, **kw
                ),
                out,
                buf,
            ):
                return
    with on_isa(spec["isa"]):
        check_paged(
            q,
            kp,
            vp,
            tables,
            seq_lens,
            q_lens,
            out=out,
            num_threads=spec["num_threads"],
            poisoned=not spec["planted"],
            decode=not lens_kw,
            **kw,
        )


# ---------------------------------------------------------------------------------------------
# a view the fuzz does not hand to a sanitized build: misaligned data (in a subprocess)
# ---------------------------------------------------------------------------------------------

SANITIZED = bool(os.environ.get("ATTNX_SANITIZED"))  # set by .ci/sanitize.sh

MISALIGNED = """
import sys
import numpy as np, ml_dtypes, attnx
from attnx import reference as ref

def misaligned(x, offset=1):
    buf = np.zeros(x.nbytes + 64, np.uint8)
    y = np.ndarray(x.shape, x.dtype, buffer=buf, offset=(-buf.ctypes.data) % 64 + offset)
    y[...] = x
    return y

dtype = np.dtype(ml_dtypes.bfloat16) if sys.argv[1] == "bfloat16" else np.dtype(sys.argv[1])
r = np.random.default_rng(77)
q = r.standard_normal((2, 3, 5, 8)).astype(dtype)
k = r.standard_normal((2, 3, 7, 8)).astype(dtype)
v = r.standard_normal((2, 3, 7, 8)).astype(dtype)
m = np.where(r.random((5, 7)) < 0.8, 0.0, -np.inf).astype(np.float32)
want = ref.attention(q, k, v, mask=m, causal=True, out_dtype=np.float64)
qp = q[0, :, :2].transpose(1, 0, 2).copy()
kp = r.standard_normal((3, 3, 4, 8)).astype(dtype)
pw = ref.paged_attention(qp, kp, kp, np.array([[2, 0]]), np.array([6]), q_lens=np.array([2]),
                         out_dtype=np.float64)
for isa in sys.argv[2:]:
    attnx._core.set_isa(isa)
    o = attnx.attention(misaligned(q), misaligned(k), misaligned(v), mask=misaligned(m, 2),
                        causal=True, out=misaligned(np.zeros_like(q)))
    np.testing.assert_allclose(o.astype(np.float64), want, rtol=2e-2, atol=2e-2)
    po = attnx.paged_attention(misaligned(qp), misaligned(kp), misaligned(kp), np.array([[2, 0]]),
                               np.array([6]), q_lens=np.array([2]))
    np.testing.assert_allclose(po.astype(np.float64), pw, rtol=2e-2, atol=2e-2)
print("ok")
"""


def run_isolated(code, args, tmp_path, timeout=300):
    """Runs ``code`` in a fresh interpreter (under the sanitizer too, when this run has one,
    with its reports kept in ``tmp_path``): returns (returncode, stdout, stderr + reports)."""
    import subprocess
    import sys

    env = dict(os.environ)
    if SANITIZED:  # a known finding stays with this test instead of failing the whole run
        for var, name in (("ASAN_OPTIONS", "asan"), ("UBSAN_OPTIONS", "ubsan")):
            opts = [o for o in env.get(var, "").split(":") if o and not o.startswith("log_path=")]
            env[var] = ":".join(opts + [f"log_path={tmp_path / name}"])
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    reports = "".join(f.read_text() for f in sorted(tmp_path.glob("*san*")))
    return p.returncode, p.stdout, p.stderr + reports


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_misaligned_arrays(dtype, tmp_path):
    rc, out, err = run_isolated(MISALIGNED, [dtype, *ISAS], tmp_path)
    assert rc == 0 and "ok" in out, err[-3000:]


# ---------------------------------------------------------------------------------------------
# windows wider than any index (in a subprocess: under UBSan the overflow stops the process)
# ---------------------------------------------------------------------------------------------

EXTREME_WINDOWS = """
import sys
import numpy as np, attnx
from attnx import reference as ref
r = np.random.default_rng(0)
q = r.standard_normal((1, 2, 6, 4)).astype(np.float32)  # Sq > Sk: the row offset is negative
k = r.standard_normal((1, 2, 3, 4)).astype(np.float32)
M = 2**63 - 1
bad = []
for isa in sys.argv[1:]:
    attnx._core.set_isa(isa)
    for causal in (False, True):
        for w in [(M, None), (None, M), (M, M), (M, 0), (0, M)]:
            err = float(np.abs(attnx.attention(q, k, k, window=w, causal=causal)
                               - ref.attention(q, k, k, window=w, causal=causal)).max())
            if not err < 1e-5:
                bad.append((isa, causal, w, err))
    kp = r.standard_normal((2, 2, 4, 4)).astype(np.float32)
    qp = q[0, :, :2].transpose(1, 0, 2).copy()
    for w in [(M, M), (None, M)]:
        args = (qp, kp, kp, np.array([[1, 0]]), np.array([6]))
        err = float(np.abs(attnx.paged_attention(*args, q_lens=[2], causal=False, window=w)
                           - ref.paged_attention(*args, q_lens=[2], causal=False, window=w)).max())
        if not err < 1e-5:
            bad.append((isa, "paged", w, err))
print("bad:", bad)
print("ok" if not bad else "wrong")
"""


def test_windows_near_int64_max(tmp_path):
    rc, out, err = run_isolated(EXTREME_WINDOWS, ISAS, tmp_path)
    assert rc == 0 and out.strip().endswith("ok"), (out[-2000:], err[-2000:])
