"""An ``out`` whose elements share memory (issue 31, defect 3): a broadcast NumPy view or an
``expand``ed tensor used to be accepted, and the batch written last silently replaced the others.
Every entry point with ``out=`` refuses it before writing anything (the binding's ``out_target``);
``out`` arrays whose strides are merely unusual (transposed, reversed, sliced, interleaved) still
work. The hypothesis strategies in tests/hardening/test_fuzz.py draw such outputs too.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import attnx

from helpers import SEED

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 5, 9, 8
OVERLAP = r"^out: elements of the array overlap"


def rnd(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture
def qkv():
    rng = np.random.default_rng(SEED)
    return rnd(rng, B, HQ, SQ, D), rnd(rng, B, HKV, SK, D), rnd(rng, B, HKV, SK, D)


def strided(shape, elem_strides, fill=7.0, dtype=np.float32):
    """A writable view of ``shape`` with ``elem_strides`` (in elements, >= 0) over a buffer of
    ``fill``; returns (view, buffer)."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, elem_strides))
    buf = np.full(span, fill, dtype)
    itemsize = buf.itemsize
    return as_strided(buf, shape, [s * itemsize for s in elem_strides], writeable=True), buf


def shares_elements(a):
    """The oracle: whether two index tuples of ``a`` reach the same byte offset (brute force)."""
    offsets = np.zeros(a.shape, np.int64)
    for ax, (n, s) in enumerate(zip(a.shape, a.strides)):
        shape = [1] * a.ndim
        shape[ax] = n
        offsets = offsets + (np.arange(n) * s).reshape(shape)
    return np.unique(offsets).size < a.size


def contiguous_strides(shape):
    return [int(np.prod(shape[i + 1 :])) for i in range(len(shape))]


# ---- broadcast and expanded views: the examples --------------------------------------
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_dense_broadcast_out_is_refused_and_untouched(qkv, axis):
    q, k, v = qkv
    s = contiguous_strides(q.shape)
    s[axis] = 0
    out, buf = strided(q.shape, s)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.attention(q, k, v, out=out)
    assert (buf == 7.0).all()


def test_dense_broadcast_to_view_made_writable(qkv):
    q, k, v = qkv
    base = np.zeros((1,) + q.shape[1:], np.float32)
    out = np.broadcast_to(base, q.shape)
    out.flags.writeable = False  # (broadcast_to is read-only: refused as before, for that reason)
    with pytest.raises(ValueError, match="^out: array is not writable"):
        attnx.attention(q, k, v, out=out)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_dense_overlapping_out_every_rank_and_layout(qkv, layout, rank):
    q, k, v = (x[(0,) * (4 - rank)] for x in qkv)
    if layout == "bshd" and rank > 2:
        q, k, v = (np.ascontiguousarray(np.swapaxes(x, -3, -2)) for x in (q, k, v))
    s = contiguous_strides(q.shape)
    s[0] = 0
    out, buf = strided(q.shape, s)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.attention(q, k, v, out=out, layout=layout)
    assert (buf == 7.0).all()


def test_torch_expanded_out_is_refused_and_untouched(qkv):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in qkv)
    base = torch.full((1, HQ, SQ, D), 7.0)
    out = base.expand(B, HQ, SQ, D)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.attention(q, k, v, out=out)
    assert (base == 7.0).all()


def paged_setup(rng):
    kp, vp = rnd(rng, 6, HKV, 4, D), rnd(rng, 6, HKV, 4, D)
    bt = np.array([[0, 3, 5], [2, 1, 4]], np.int32)
    sl = np.array([11, 7], np.int32)
    return rnd(rng, 2, HQ, D), kp, vp, bt, sl


@pytest.mark.parametrize("axis", [0, 1])
def test_paged_broadcast_out_is_refused_and_untouched(axis):
    q, kp, vp, bt, sl = paged_setup(np.random.default_rng(SEED))
    s = contiguous_strides(q.shape)
    s[axis] = 0
    out, buf = strided(q.shape, s)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.paged_attention(q, kp, vp, bt, sl, out=out)
    assert (buf == 7.0).all()


def test_paged_shared_prefix_path_refuses_it_too():
    rng = np.random.default_rng(SEED)
    q, kp, vp, _, _ = paged_setup(rng)
    bt = np.array([[0, 3, 5], [0, 3, 4]], np.int32)  # a shared first two blocks
    sl = np.array([11, 10], np.int32)
    out, buf = strided(q.shape, [0, D, 1])
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.paged_attention(q, kp, vp, bt, sl, out=out, shared_prefix=True)
    assert (buf == 7.0).all()


def test_paged_torch_expanded_out():
    torch = pytest.importorskip("torch")
    q, kp, vp, bt, sl = paged_setup(np.random.default_rng(SEED))
    base = torch.full((1, HQ, D), 7.0)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.paged_attention(
            torch.from_numpy(q),
            torch.from_numpy(kp),
            torch.from_numpy(vp),
            torch.from_numpy(bt),
            torch.from_numpy(sl),
            out=base.expand(2, HQ, D),
        )
    assert (base == 7.0).all()


def test_partial_overlap_is_refused(qkv):
    """No zero stride: rows that start inside the previous row (a sliding-window view)."""
    q, k, v = qkv
    s = contiguous_strides(q.shape)
    s[2] = D - 3
    out, buf = strided(q.shape, s)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.attention(q, k, v, out=out)
    assert (buf == 7.0).all()


def test_byte_overlap_with_odd_byte_strides_is_refused(qkv):
    """Elements at different addresses that share bytes: float32 elements 2 bytes apart (dense
    attention accepts odd byte strides in ``out`` and copies its result in)."""
    q, k, v = qkv
    raw = np.zeros(q.size * 4 + 64, np.uint8)
    strides = list(np.empty(q.shape, np.float32).strides)
    strides[-1] = 2
    out = np.ndarray(q.shape, np.float32, raw.data, 0, strides)
    with pytest.raises(ValueError, match=OVERLAP):
        attnx.attention(q, k, v, out=out)
    assert (raw == 0).all()


# ---- what must keep working: strides that never share an element ------------------------------
def test_interleaved_strides_that_do_not_overlap_work(qkv):
    """Axes whose strides interleave (the smaller axis spans past the larger one's step) yet never
    meet: offsets 2i + 3j for i < 3, j < 2 are 0 3 2 5 4 7. The check is exact, not only the
    nested-strides rule, so this out is written in place."""
    q, k, v = qkv
    q = np.ascontiguousarray(q[:, :, :3])
    v = np.ascontiguousarray(v[..., :2])
    out, buf = strided((B, HQ, 3, 2), [64, 8, 2, 3])
    got = attnx.attention(q, k, v, out=out)
    assert got is out
    np.testing.assert_array_equal(out, attnx.attention(q, k, v))


@pytest.mark.parametrize(
    "shape,strides,overlaps",
    [
        ((3, 2), (2, 3), False),  # offsets 0 3 2 5 4 7: interleaved, distinct
        ((2, 3), (3, 2), False),
        ((3, 3), (2, 3), False),  # offsets 2i + 3j: 0 3 6 2 5 8 4 7 10
        ((4, 3), (2, 3), True),  # 2*3 + 3*0 == 2*0 + 3*2
        ((4, 2), (2, 5), False),
        ((2, 2), (1, 1), True),
        ((5, 1), (1, 0), False),  # a zero stride on an axis of extent 1 never repeats an element
        ((0, 4), (0, 0), False),  # nothing written
        ((1, 1), (0, 0), False),
        ((3, 2), (0, 1), True),
    ],
)
def test_exactness_against_brute_force(shape, strides, overlaps):
    """The binding's rule on two-axis outs, held to the brute-force oracle (dense attention with
    Sq, Dv being the out's axes; Dv strides are allowed there: the result is copied in)."""
    rng = np.random.default_rng(SEED)
    Sq, Dv = shape
    q, k, v = rnd(rng, Sq, 4), rnd(rng, 6, 4), rnd(rng, 6, Dv)
    out, buf = strided(shape, list(strides))
    assert shares_elements(out) == overlaps
    if overlaps:
        with pytest.raises(ValueError, match=OVERLAP):
            attnx.attention(q, k, v, out=out)
        assert (buf == 7.0).all()
    else:
        got = attnx.attention(q, k, v, out=out)
        assert got is out
        np.testing.assert_array_equal(out, attnx.attention(q, k, v))


@pytest.mark.parametrize("view", ["transposed", "reversed", "sliced"])
def test_ordinary_strided_outs_still_work(qkv, view):
    q, k, v = qkv
    want = attnx.attention(q, k, v)
    if view == "transposed":
        out = np.zeros((B, SQ, HQ, D), np.float32).transpose(0, 2, 1, 3)
    elif view == "reversed":
        out = np.zeros(q.shape, np.float32)[:, ::-1]
    else:
        out = np.zeros((B, HQ * 2, SQ, D), np.float32)[:, ::2]
    got = attnx.attention(q, k, v, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)


def test_out_aliasing_an_input_is_still_right(qkv):
    """``out`` sharing memory with q (not with itself) stays what it was: computed into a
    temporary and copied in (tests/hardening/test_hardening.py covers every input)."""
    q, k, v = qkv
    want = attnx.attention(q, k, v)
    qq = q.copy()
    got = attnx.attention(qq, k, v, out=qq)
    assert got is qq
    np.testing.assert_array_equal(qq, want)
