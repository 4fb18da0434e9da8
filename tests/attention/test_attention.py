"""attnx.attention against attnx.reference on every instruction set this CPU has.

Every kernel test takes the ``isa`` fixture (conftest.py) and goes through ``check_attention``,
which compares output and lse with a dtype-aware tolerance and checks exact zeros / -inf for
rows that see no key.  Sizes are odd on purpose (d = 1, 59; s = 17, 97, 1025) to hit the tails
of the 64-key tiles, the 32-float padding of feature rows, and both QK paths (<= 8 rows as dot
products, more rows through a packed K panel).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, seed
from hypothesis import strategies as st

import attnx
from attnx import reference as ref

from helpers import BF16, SEED, best_isa, check_attention, from4, rand, script_words

DTYPES = [np.float32, np.float16, BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]


def qkv(rng, B, Hq, Hkv, Sq, Sk, Dk, Dv=None, dtype=np.float32):
    Dv = Dk if Dv is None else Dv
    return (
        rand(rng, (B, Hq, Sq, Dk), dtype),
        rand(rng, (B, Hkv, Sk, Dk), dtype),
        rand(rng, (B, Hkv, Sk, Dv), dtype),
    )


# ---------------------------------------------------------------------------
# the size grid: a Latin square over (Sq, Sk, D), so every pair of values meets once
# ---------------------------------------------------------------------------

S_LEVELS = [1, 2, 17, 97, 128, 1025]
D_LEVELS = [1, 8, 59, 64, 128, 256]
GRID = [(S_LEVELS[a], S_LEVELS[b], D_LEVELS[(a + b) % 6]) for a in range(6) for b in range(6)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("Sq", "Sk", "D"), GRID, ids=[f"sq{a}-sk{b}-d{c}" for a, b, c in GRID])
def test_grid(isa, rng, Sq, Sk, D, causal):
    B = 2 if Sq * Sk <= 128 * 128 else 1
    check_attention(*qkv(rng, B, 2, 1, Sq, Sk, D), causal=causal)


# ---------------------------------------------------------------------------
# heads: MHA, GQA, MQA; the number of rows per work item crosses the 8-row dot-product limit
# ---------------------------------------------------------------------------

HEADS = [  # (Hq, Hkv, Sq): rows per work item = heads per group x query rows
    (4, 4, 1),  # MHA decode: 1 row
    (8, 2, 1),  # GQA decode: 4 rows
    (8, 1, 1),  # MQA decode: 8 rows, the last dot-product size
    (16, 1, 1),  # MQA decode: 16 rows, packed panel
    (4, 4, 9),  # 9 rows of one head
    (8, 2, 17),  # GQA prefill
    (8, 1, 97),  # MQA prefill, several row chunks
    (80, 1, 3),  # more heads per group than one work item holds (64)
]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("Hq", "Hkv", "Sq"), HEADS, ids=[f"hq{a}-hkv{b}-sq{c}" for a, b, c in HEADS]
)
def test_heads(isa, rng, Hq, Hkv, Sq, causal, layout):
    q, k, v = qkv(rng, 2, Hq, Hkv, Sq, 97, 64, 40)
    if layout == "bshd":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    check_attention(q, k, v, causal=causal, layout=layout)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_k_with_split_kv(isa, rng, causal, threads):
    """Few work items (2 query chunks) against a long key range: the key range is split across
    threads, and the split parts read K tiles that the chunks share and pack once."""
    q, k, v = qkv(rng, 1, 1, 1, 100, 3000, 48)
    check_attention(q, k, v, causal=causal, window=(1500, None), num_threads=threads)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_k_beside_a_sequence_without_keys(isa, rng, causal):
    """A sequence with no keys (kv_lens 0) whose many query rows would share its kv heads'
    packed K, beside ones that have keys: it takes no packed slot (its rows are zeros), and the
    others' slots are sized by their own keys."""
    q, k, v = qkv(rng, 3, 4, 2, 100, 150, 48)
    for lens in ([0, 150, 77], [0, 0, 0]):
        check_attention(q, k, v, causal=causal, kv_lens=np.array(lens), num_threads=2)


@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
@pytest.mark.parametrize(
    ("Hq", "Hkv", "Sq"),
    [(17, 17, 1), (40, 20, 2), (12, 3, 1)],
    ids=["hq17-hkv17-sq1", "hq40-hkv20-sq2", "hq12-hkv3-sq1"],
)
def test_bshd_decode_groups(isa, rng, Hq, Hkv, Sq, kind):
    """(B, S, H, D) keys are short runs per head, so decode runs a sequence's kv heads as
    interleaved groups (at most 16 heads each): with masks, padding, and split-KV."""
    B, Sk = 3, 300
    q, k, v = qkv(rng, B, Hq, Hkv, Sq, Sk, 24, 40)
    q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    kw = dict(kv_lens=[300, 1, 171])
    if kind == "bool":
        kw["mask"] = rng.random((B, Hq, Sq, Sk)) < 0.7
    elif kind == "additive":
        kw["mask"] = rng.standard_normal((B, 1, Sq, Sk)).astype(np.float32)
    for threads in (1, 3):
        check_attention(q, k, v, layout="bshd", causal=True, num_threads=threads, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", ["causal_lens", "window", "mask", "alibi_softcap"])
def test_prefill_k_packed_once(isa, rng, variant, dtype):
    """Prefills pack each K tile once for all the work items of its kv head (the first item to
    reach it packs, the others read; here 17 items race on 2 threads): odd widths, fp16/bf16 K
    converted while packing, windows whose first key is not on a tile edge, padding, masks, ALiBi,
    and causal items that need only part of a tile the next item needs whole."""
    B, Hq, Hkv, S = 2, 4, 2, 530  # 2 heads per item, 32-row chunks: 17 items share a kv head
    q, k, v = qkv(rng, B, Hq, Hkv, S, S, 59, 40, dtype)
    kw = {
        "causal_lens": dict(causal=True, kv_lens=[530, 377]),
        "window": dict(causal=True, window=(99, None)),
        "mask": dict(mask=rng.random((B, 1, S, S)) < 0.9),
        "alibi_softcap": dict(
            alibi_slopes=np.array([0.5, 0.25, 0.1, 0.01], np.float32), softcap=5.0
        ),
    }[variant]
    check_attention(q, k, v, **kw)


@pytest.mark.parametrize(("Dk", "Dv"), [(64, 32), (7, 130), (576, 512), (1, 3), (33, 1)])
def test_dk_ne_dv(isa, rng, Dk, Dv):
    check_attention(*qkv(rng, 1, 4, 2, 5, 70, Dk, Dv), causal=True)


# ---------------------------------------------------------------------------
# dtypes x layouts x ranks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dtype_layout_rank(isa, rng, dtype, layout, rank):
    B, Hq, Hkv = {2: (1, 1, 1), 3: (1, 4, 2), 4: (2, 6, 3)}[rank]
    q4, k4, v4 = qkv(rng, B, Hq, Hkv, 33, 70, 40, 24, dtype)
    q, k, v = (np.ascontiguousarray(from4(x, layout, rank)) for x in (q4, k4, v4))
    o, lse = check_attention(q, k, v, layout=layout, causal=True)
    # the user's layout and rank come back, lse in bhsd order
    assert o.shape == from4(np.empty((B, Hq, 33, 24)), layout, rank).shape
    assert lse.shape == ((B, Hq, 33), (Hq, 33), (33,))[4 - rank]


def test_return_lse_false_returns_the_array(isa, rng):
    q, k, v = qkv(rng, 1, 2, 1, 5, 9, 8)
    o = attnx.attention(q, k, v)
    assert isinstance(o, np.ndarray)
    o2, _ = attnx.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(o, o2)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_values(isa, rng, dtype):
    # large scores (the running max and the rescaling matter) and large values
    q, k, v = qkv(rng, 1, 2, 2, 20, 150, 16, dtype=dtype)
    q = (q.astype(np.float32) * 6).astype(dtype)
    v = (v.astype(np.float32) * (1e3 if dtype == np.float16 else 1e6)).astype(dtype)
    check_attention(q, k, v, causal=True)


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------

B_, HQ_, HKV_, SQ_, SK_ = 2, 4, 2, 13, 37
MASK_SHAPES = [
    (SQ_, SK_),
    (1, 1, SQ_, SK_),
    (B_, 1, 1, SK_),
    (B_, HQ_, SQ_, SK_),
    (HQ_, 1, SK_),
    (SK_,),
    (B_, 1, SQ_, 1),
]


def make_mask(rng, kind, shape):
    """70 % visible, one fully blocked row where the shape has rows, -inf as the blocker."""
    if kind == "bool":
        m = rng.random(shape) < 0.7
    else:
        m = rng.standard_normal(shape).astype(np.float32)
        m[rng.random(shape) < 0.3] = -np.inf
    if len(shape) >= 2 and shape[-2] > 3:
        m[..., 3, :] = False if kind == "bool" else -np.inf
    return m


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=["x".join(map(str, s)) for s in MASK_SHAPES])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masks(isa, rng, kind, shape, causal):
    q, k, v = qkv(rng, B_, HQ_, HKV_, SQ_, SK_, 24)
    check_attention(q, k, v, mask=make_mask(rng, kind, shape), causal=causal)


@pytest.mark.parametrize("mask_dtype", [np.float16, BF16, np.float64], ids=["f16", "bf16", "f64"])
def test_additive_mask_dtypes(isa, rng, mask_dtype):
    q, k, v = qkv(rng, B_, HQ_, HKV_, SQ_, SK_, 24)
    m = make_mask(rng, "additive", (B_, 1, SQ_, SK_)).astype(mask_dtype)
    check_attention(q, k, v, mask=m)


def test_mask_views(isa, rng):
    q, k, v = qkv(rng, B_, HQ_, HKV_, SQ_, SK_, 24)
    mt = make_mask(rng, "bool", (SK_, SQ_)).T  # transposed view
    check_attention(q, k, v, mask=mt, causal=True)
    big = make_mask(rng, "additive", (B_, 1, 2 * SQ_, SK_ + 5))
    check_attention(q, k, v, mask=big[:, :, ::2, 5:])  # row step, column offset
    check_attention(q, k, v, mask=big[:, :, :SQ_, ::-1][..., :SK_])  # negative key stride
    check_attention(q, k, v, mask=np.broadcast_to(make_mask(rng, "bool", (SK_,)), (SQ_, SK_)))
    check_attention(q, k, v, mask=make_mask(rng, "bool", (SQ_, SK_)).tolist())  # a list


@pytest.mark.parametrize("rank", [2, 3])
def test_mask_lower_rank(isa, rng, rank):
    Hq, Hkv = (1, 1) if rank == 2 else (4, 2)
    q, k, v = (x[0, 0] if rank == 2 else x[0] for x in qkv(rng, 1, Hq, Hkv, SQ_, SK_, 16))
    check_attention(q, k, v, mask=make_mask(rng, "bool", (SQ_, SK_)))
    check_attention(q, k, v, mask=make_mask(rng, "additive", (SK_,)), causal=True)
    if rank == 3:
        check_attention(q, k, v, mask=make_mask(rng, "additive", (Hq, 1, SK_)))
        qb, kb, vb = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (q, k, v))
        check_attention(qb, kb, vb, layout="bshd", mask=make_mask(rng, "bool", (Hq, SQ_, 1)))


# ---------------------------------------------------------------------------
# padding: keys past kv_lens and query rows past q_lens are never read
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    ("Sq", "Sk", "kv_lens", "q_lens"),
    [
        (5, 70, [70, 3, 0], None),
        (20, 20, None, [20, 1, 0]),
        (16, 150, [150, 65, 64], [16, 7, 1]),
        (30, 10, [10, 4, 9], [30, 2, 25]),  # Sq > Sk: bottom-right causal hides the first rows
        (1, 300, [1, 299, 200], [1, 0, 1]),
    ],
)
def test_padding(isa, rng, Sq, Sk, kv_lens, q_lens, causal):
    q, k, v = qkv(rng, 3, 4, 2, Sq, Sk, 20, 12)
    kw = {}
    if kv_lens is not None:
        kw["kv_lens"] = np.array(kv_lens, dtype=np.int64)
        for b, L in enumerate(kv_lens):  # garbage past the valid length must not leak
            k[b, :, L:] = np.nan
            v[b, :, L:] = np.inf
    if q_lens is not None:
        kw["q_lens"] = np.array(q_lens, dtype=np.int32)
        for b, L in enumerate(q_lens):
            q[b, :, L:] = np.nan
    o, lse = check_attention(q, k, v, causal=causal, **kw)
    if q_lens is not None:
        for b, L in enumerate(q_lens):
            assert np.all(o[b, :, L:] == 0) and np.all(lse[b, :, L:] == -np.inf)


@pytest.mark.parametrize("lens_type", ["list", "uint8", "int", "0d"])
def test_lens_forms(isa, rng, lens_type):
    q, k, v = qkv(rng, 1, 2, 1, 6, 30, 8)
    as_ = {
        "list": lambda x: [x],
        "uint8": lambda x: np.array([x], np.uint8),
        "int": int,
        "0d": np.array,
    }[lens_type]
    if lens_type in ("int", "0d"):  # a scalar length is for ranks 2 and 3 (B == 1)
        q, k, v = q[0], k[0], v[0]
    check_attention(q, k, v, kv_lens=as_(17), q_lens=as_(4), causal=True)


# ---------------------------------------------------------------------------
# rows that see nothing, lengths 0 and 1, NaN propagation
# ---------------------------------------------------------------------------


def test_fully_masked_rows(isa, rng):
    q, k, v = qkv(rng, 2, 4, 2, 6, 40, 16)
    m = np.ones((2, 4, 6, 40), bool)
    m[0, 1, 2] = False
    m[1, :, 5] = False
    o, lse = check_attention(q, k, v, mask=m)
    assert np.all(o[0, 1, 2] == 0) and lse[0, 1, 2] == -np.inf
    add = np.zeros((6, 40), np.float32)
    add[4] = -np.inf
    o, lse = check_attention(q, k, v, mask=add, causal=True)
    assert np.all(o[:, :, 4] == 0) and np.all(lse[:, :, 4] == -np.inf)
    # causal with Sq > Sk: the first Sq - Sk rows see nothing (bottom-right alignment)
    q2 = rand(rng, (2, 4, 45, 16))
    o, lse = check_attention(q2, k, v, causal=True)
    assert np.all(o[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)
    assert np.all(lse[:, :, 5:] > -np.inf)
    # a window that leaves some rows empty, and kv_lens = 0
    check_attention(q2, k, v, causal=True, window=(0, None))
    o, lse = check_attention(q, k, v, kv_lens=np.array([0, 0]))
    assert np.all(o == 0) and np.all(lse == -np.inf)


def test_sk_zero(isa, rng):
    q, k, v = qkv(rng, 2, 4, 2, 3, 5, 8)
    o, lse = check_attention(q, k[:, :, :0], v[:, :, :0])
    assert np.all(o == 0) and np.all(lse == -np.inf)
    o, lse = check_attention(q, k[:, :, :0], v[:, :, :0], sinks=np.ones(4, np.float32))
    assert np.all(o == 0) and np.all(lse == 1)


def test_sk_zero_fresh_arrays(isa):
    # NumPy gives zero-size arrays all-zero strides: the binding must not reject them
    q = np.ones((1, 2, 3, 4), np.float32)
    k = np.zeros((1, 2, 0, 4), np.float32)  # an empty KV cache
    o, lse = attnx.attention(q, k, k, return_lse=True)
    assert np.all(o == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("axis", ["Sq", "B", "Hq"])
def test_empty_output(isa, rng, axis):
    B, Hq, Hkv, Sq = {"Sq": (1, 2, 1, 0), "B": (0, 2, 1, 3), "Hq": (1, 0, 1, 3)}[axis]
    q, k, v = qkv(rng, B, Hq, Hkv, Sq, 5, 4)
    o, lse = attnx.attention(q, k, v, return_lse=True)
    assert o.shape == (B, Hq, Sq, 4) and lse.shape == (B, Hq, Sq)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    out = np.empty((B, Hq, Sq, 4), np.float32)
    assert attnx.attention(q, k, v, out=out) is out
    check_attention(q, k, v)  # the reference agrees


def test_dv_zero_lse(isa, rng):
    q, k, v = qkv(rng, 1, 2, 2, 3, 5, 4, 0)
    check_attention(q, k, v)


def test_dk_zero(isa, rng):
    q, k, v = qkv(rng, 1, 2, 2, 3, 5, 0, 4)  # every score is 0: the mean of the values
    check_attention(q, k, v, scale=1.0)


def test_length_one(isa, rng):
    for Sq, Sk in [(1, 1), (1, 7), (7, 1)]:
        check_attention(*qkv(rng, 2, 2, 1, Sq, Sk, 5), causal=True)
        check_attention(*qkv(rng, 2, 2, 1, Sq, Sk, 5))
    q, k, v = qkv(rng, 1, 1, 1, 1, 1, 3)
    np.testing.assert_allclose(attnx.attention(q, k, v), v, rtol=1e-6)  # one key: out = v


def test_nan_propagates_to_rows_that_see_it(isa, rng):
    # causal, Sq = 6, Sk = 80: row i sees keys j <= i + 74
    q, k, v = qkv(rng, 1, 2, 2, 6, 80, 8)
    k[0, 0, 77, 1] = np.nan  # rows 3.. of head 0
    v[0, 1, 5, 0] = np.nan  # every row of head 1, feature 0 only
    q[0, 1, 2, 5] = np.nan  # row 2 of head 1
    o, _ = check_attention(q, k, v, causal=True, expect_nan=True)
    assert np.isnan(o[0, 0, 3:]).all() and not np.isnan(o[0, 0, :3]).any()
    assert np.isnan(o[0, 1, 2]).all() and np.isnan(o[0, 1, :, 0]).all()
    assert not np.isnan(o[0, 1, [0, 1, 3, 4, 5], 1:]).any()
    v[0, 1, 5, 0] = 1.0
    v[0, 0, 79, 2] = np.inf  # only row 5 sees key 79: the other rows of its tile stay finite
    o, _ = check_attention(q, k, v, causal=True, expect_nan=True)
    assert np.isinf(o[0, 0, 5, 2]) or np.isnan(o[0, 0, 5, 2])
    assert np.isfinite(o[0, 0, :3]).all() and np.isfinite(o[0, 1, [0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("how", ["bool_mask", "additive_mask", "causal", "window", "kv_lens"])
@pytest.mark.parametrize("bad", ["k_nan", "k_inf", "v_nan", "v_inf"])
def test_nonfinite_in_keys_a_row_does_not_see(isa, rng, bad, how):
    """Keys 150.. hold NaN or inf; rows that cannot see them stay finite, although those keys
    share a 64-key tile with keys they do see (0 * nan is nan: a kernel must not multiply its
    way past a hidden key).  For causal and the window, the rows that do see them are NaN/inf
    exactly as in the reference."""
    q, k, v = qkv(rng, 1, 2, 2, 200, 200, 8)
    (k if bad[0] == "k" else v)[0, :, 150:] = np.nan if bad.endswith("nan") else np.inf
    kw = {
        "bool_mask": dict(mask=np.arange(200) < 150),
        "additive_mask": dict(mask=np.where(np.arange(200) < 150, 0, -np.inf).astype(np.float32)),
        "causal": dict(causal=True),
        "window": dict(window=(3, 0)),
        "kv_lens": dict(kv_lens=np.array([150])),
    }[how]
    o, _ = check_attention(q, k, v, expect_nan=how in ("causal", "window"), **kw)
    assert np.isfinite(o[:, :, :150]).all()


# ---------------------------------------------------------------------------
# strided and broadcast inputs
# ---------------------------------------------------------------------------


def test_noncontiguous_inputs(isa, rng):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 11, 45, 24
    # transposed views: bshd memory read through a bhsd view
    qt = rand(rng, (B, Sq, Hq, D)).transpose(0, 2, 1, 3)
    kt = rand(rng, (B, Sk, Hkv, D)).transpose(0, 2, 1, 3)
    vt = rand(rng, (B, Sk, Hkv, D)).transpose(0, 2, 1, 3)
    check_attention(qt, kt, vt, causal=True)
    # slices with steps and offsets; q a view into a bigger array
    bigq = rand(rng, (B + 1, Hq + 2, 3 * Sq, D + 9))
    bigk = rand(rng, (B, 2 * Hkv, 2 * Sk + 1, D + 3))
    q = bigq[1:, 1 : Hq + 1, ::3, 4 : 4 + D]
    k = bigk[:, ::2, 1::2, 3:]
    v = bigk[:, 1::2, :Sk, :D]
    check_attention(q, k, v, causal=True)
    # negative strides on every axis but the last
    check_attention(q[::-1, ::-1, ::-1], k[::-1, ::-1, ::-1], v[::-1, ::-1, ::-1])
    # a last-axis-strided (and reversed) view: the Python layer copies it
    q2 = rand(rng, (B, Hq, Sq, 2 * D))[..., ::2]
    check_attention(q2, k[..., ::-1], v[..., ::-1], causal=True)
    # bshd layout through non-contiguous views
    check_attention(
        bigq[1:, :Hq, :Sq, :D].transpose(0, 2, 1, 3),
        kt.transpose(0, 2, 1, 3),
        vt.transpose(0, 2, 1, 3),
        layout="bshd",
        causal=True,
    )


def test_broadcast_kv(isa, rng):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 70, 16
    q = rand(rng, (B, Hq, Sq, D))
    k1, v1 = rand(rng, (1, 1, Sk, D)), rand(rng, (1, 1, Sk, D))
    # stride 0 over batch and heads
    k, v = (np.broadcast_to(x, (B, Hkv, Sk, D)) for x in (k1, v1))
    check_attention(q, k, v, causal=True)
    # stride 0 over keys (all keys equal) and over features (the Python layer copies that)
    krow = np.broadcast_to(rand(rng, (B, Hkv, 1, D)), (B, Hkv, Sk, D))
    vfeat = np.broadcast_to(rand(rng, (B, Hkv, Sk, 1)), (B, Hkv, Sk, D))
    check_attention(q, krow, vfeat)
    # a broadcast q (every row the same query)
    qb = np.broadcast_to(rand(rng, (B, Hq, 1, D)), (B, Hq, Sq, D))
    check_attention(qb, k, v, causal=True)


# ---------------------------------------------------------------------------
# out=
# ---------------------------------------------------------------------------

SENTINEL = 1536.0  # exact in float16 and bfloat16


def test_out_in_place(isa, rng):
    q, k, v = qkv(rng, 2, 4, 2, 9, 33, 16, 24)
    out = np.full((2, 4, 9, 24), SENTINEL, np.float32)
    o, lse = check_attention(q, k, v, out=out, causal=True)
    assert o is out
    assert attnx.attention(q, k, v, out=out, causal=True) is out
    # rank 2 and bshd
    out2 = np.full((9, 24), SENTINEL, np.float32)
    assert attnx.attention(q[0, 0], k[0, 0], v[0, 0], out=out2) is out2
    check_attention(q[0, 0], k[0, 0], v[0, 0], out=out2)
    qb, kb, vb = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    outb = np.full((2, 9, 4, 24), SENTINEL, np.float32)
    check_attention(qb, kb, vb, layout="bshd", out=outb, causal=True)
    np.testing.assert_array_equal(outb.transpose(0, 2, 1, 3), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_out_views(isa, rng, dtype):
    q, k, v = qkv(rng, 2, 4, 2, 9, 33, 16, 24, dtype)
    # a row-offset view with a contiguous last axis: written in place, nothing else touched
    big = np.full((3, 6, 12, 24), SENTINEL, dtype)
    out = big[1:, 2:, 3:]
    check_attention(q, k, v, out=out, causal=True)
    rest = big.copy()
    rest[1:, 2:, 3:] = SENTINEL
    assert np.all(rest.astype(np.float64) == SENTINEL), "wrote outside out"
    # a last-axis-strided view (the result is copied into it) and negative strides
    big = np.full((2, 4, 9, 48), SENTINEL, dtype)
    check_attention(q, k, v, out=big[..., ::2])
    assert np.all(big[..., 1::2].astype(np.float64) == SENTINEL)
    big = np.full((2, 4, 9, 24), SENTINEL, dtype)
    check_attention(q, k, v, out=big[::-1, :, ::-1])
    check_attention(q, k, v, out=big.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3))


def test_out_aliases_inputs(isa, rng):
    q, k, v = qkv(rng, 2, 4, 4, 17, 17, 16)
    expect = attnx.attention(q, k, v, causal=True)
    q2 = q.copy()
    assert attnx.attention(q2, k, v, causal=True, out=q2) is q2  # out is q
    np.testing.assert_array_equal(q2, expect)
    v2 = v.copy()
    assert attnx.attention(q, k, v2, causal=True, out=v2) is v2  # out is v (Hq == Hkv, Sq == Sk)
    np.testing.assert_array_equal(v2, expect)
    k2 = k.copy()
    check_attention(q, k2, v, causal=True, out=k2)  # out is k
    # partial overlap: out is a shifted window of the buffer q lives in
    buf = rand(rng, (2, 4, 20, 16))
    qv, ov = buf[:, :, :17], buf[:, :, 3:]
    expect = attnx.attention(qv.copy(), k, v, causal=True)
    attnx.attention(qv, k, v, causal=True, out=ov)
    np.testing.assert_array_equal(buf[:, :, 3:], expect)


# ---------------------------------------------------------------------------
# variants: window, softcap, sinks, ALiBi, alone and together
# ---------------------------------------------------------------------------

VARIANTS = {
    "window_left": dict(window=(8, 0)),
    "window_right_only": dict(window=(None, 3)),
    "window_both": dict(window=(5, 7)),
    "window_zero": dict(window=(0, 0)),
    "window_none_none": dict(window=(None, None)),
    "window_list_npint": dict(window=[np.int64(6), None]),
    "window_causal": dict(window=(20, None), causal=True),
    "softcap": dict(softcap=1.5),
    "softcap_causal_np": dict(softcap=np.float32(30.0), causal=True),
    "sinks": dict(sinks="sinks"),
    "sinks_causal": dict(sinks="sinks", causal=True),
    "alibi": dict(alibi_slopes="alibi"),
    "alibi_causal": dict(alibi_slopes="alibi", causal=True),
    "all_causal": dict(
        window=(30, None), softcap=2.0, sinks="sinks", alibi_slopes="alibi", causal=True
    ),
    "all_mask_lens": dict(
        window=(10, 4),
        softcap=5.0,
        sinks="sinks",
        alibi_slopes="alibi",
        mask="mask",
        kv_lens="kv_lens",
        q_lens="q_lens",
        causal=True,
    ),
    "window_mask_lens": dict(window=(3, 3), mask="bool", kv_lens="kv_lens", q_lens="q_lens"),
    "sinks_alibi_mask": dict(sinks="sinks", alibi_slopes="alibi", mask="mask"),
}


def materialise(rng, spec, B, Hq, Sq, Sk):
    kw = {}
    for key, val in spec.items():
        if not isinstance(val, str):
            pass
        elif val == "sinks":
            val = rng.standard_normal(Hq).astype(np.float32) * 2
        elif val == "alibi":
            val = (2.0 ** -np.arange(1, Hq + 1)).astype(np.float32)
        elif val == "mask":
            val = make_mask(rng, "additive", (B, 1, Sq, Sk))
        elif val == "bool":
            val = make_mask(rng, "bool", (Sq, Sk))
        elif val == "kv_lens":
            val = rng.integers(Sk // 2, Sk + 1, size=B)
        elif val == "q_lens":
            val = rng.integers(1, Sq + 1, size=B)
        kw[key] = val
    return kw


@pytest.mark.parametrize(("Sq", "Sk"), [(1, 300), (40, 40), (70, 140), (30, 10)])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants(isa, rng, name, Sq, Sk):
    B, Hq, Hkv = 2, 4, 2
    q, k, v = qkv(rng, B, Hq, Hkv, Sq, Sk, 32, 20)
    check_attention(q, k, v, **materialise(rng, VARIANTS[name], B, Hq, Sq, Sk))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["f16", "bf16"])
def test_variants_low_precision(isa, rng, dtype):
    B, Hq, Hkv, Sq, Sk = 2, 8, 2, 20, 90
    q, k, v = qkv(rng, B, Hq, Hkv, Sq, Sk, 64, 64, dtype)
    check_attention(q, k, v, **materialise(rng, VARIANTS["all_mask_lens"], B, Hq, Sq, Sk))


# ---------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------


def test_num_threads_same_result(isa, rng):
    q, k, v = qkv(rng, 2, 8, 2, 100, 300, 64)  # many work items: no split-KV
    o1 = attnx.attention(q, k, v, causal=True, num_threads=1)
    o2 = attnx.attention(q, k, v, causal=True, num_threads=2)
    o3 = attnx.attention(q, k, v, causal=True, num_threads=3)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(o1, o3)


def test_set_num_threads_round_trip():
    before = attnx.get_num_threads()
    try:
        attnx.set_num_threads(3)
        assert attnx.get_num_threads() == 3
        attnx.set_num_threads(1)
        assert attnx.get_num_threads() == 1
        attnx.set_num_threads(0)  # back to the default (OMP_NUM_THREADS or the CPUs)
        assert attnx.get_num_threads() >= 1
    finally:
        attnx.set_num_threads(0)
        if attnx.get_num_threads() != before:
            attnx.set_num_threads(before)
    assert attnx.get_num_threads() == before


def test_global_threads_used(isa, rng):
    q, k, v = qkv(rng, 1, 1, 1, 1, 5000, 64)
    before = attnx.get_num_threads()
    try:
        attnx.set_num_threads(1)
        o1 = attnx.attention(q, k, v)
        attnx.set_num_threads(2)
        o2 = attnx.attention(q, k, v)
    finally:
        attnx.set_num_threads(0)
        if attnx.get_num_threads() != before:
            attnx.set_num_threads(before)
    np.testing.assert_array_equal(o1, attnx.attention(q, k, v, num_threads=1))
    np.testing.assert_array_equal(o2, attnx.attention(q, k, v, num_threads=2))


SPLIT_CASES = {
    "plain": dict(),
    "causal_rows": dict(Sq=3, causal=True),
    "kv_lens": dict(B=2, kv_lens=np.array([5000, 1300])),
    "window": dict(Sq=2, window=(700, 0), causal=True),
    "fully_masked_row": dict(Sq=2, mask="row0"),
    "sinks_alibi_softcap": dict(Hq=4, Hkv=1, sinks="sinks", alibi_slopes="alibi", softcap=3.0),
    "gqa_decode": dict(Hq=8, Hkv=2),
    "nan_padding": dict(B=2, kv_lens=np.array([4000, 700]), nan=True),
}


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv(isa, rng, name, threads):
    """Few work items and a long key range: the keys are split across threads and the parts
    merged by log-sum-exp."""
    spec = dict(SPLIT_CASES[name])
    B, Hq, Hkv, Sq = (spec.pop(n, d) for n, d in (("B", 1), ("Hq", 1), ("Hkv", 1), ("Sq", 1)))
    nan = spec.pop("nan", False)
    Sk = 5000
    q, k, v = qkv(rng, B, Hq, Hkv, Sq, Sk, 64)
    if spec.get("mask") == "row0":
        m = rng.random((Sq, Sk)) < 0.5
        m[0] = False
        spec["mask"] = m
    if nan:
        for b, L in enumerate(spec["kv_lens"]):
            k[b, :, L:] = np.nan
            v[b, :, L:] = np.nan
    kw = materialise(rng, spec, B, Hq, Sq, Sk)
    o, _ = check_attention(q, k, v, num_threads=threads, **kw)
    o1 = attnx.attention(q, k, v, num_threads=1, **kw)
    np.testing.assert_allclose(o, o1, rtol=1e-5, atol=1e-6)


def test_concurrent_python_threads(isa, rng):
    problems = []
    for i in range(8):
        q, k, v = qkv(rng, 2, 4, 2, 40 + i, 200 + 7 * i, 32)
        problems.append((q, k, v, dict(causal=bool(i % 2), window=(50, None) if i % 3 else None)))
    serial = [attnx.attention(q, k, v, **kw) for q, k, v, kw in problems]
    for q, k, v, kw in problems[:2]:
        check_attention(q, k, v, **kw)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            results = list(pool.map(lambda p: attnx.attention(p[0], p[1], p[2], **p[3]), problems))
            for r, s in zip(results, serial):
                np.testing.assert_array_equal(r, s)


def test_gil_released(rng):
    """While one Python thread runs a long kernel, another keeps running Python code."""
    S = 1024
    while True:
        q, k, v = qkv(rng, 1, 2, 2, S, S, 64)
        t0 = time.perf_counter()
        attnx.attention(q, k, v, num_threads=1)
        call = time.perf_counter() - t0
        if call >= 0.15 or S >= 16384:
            break
        S *= 2
    done = threading.Event()

    def work():
        attnx.attention(q, k, v, num_threads=1)
        done.set()

    worker = threading.Thread(target=work)
    ticks = [time.perf_counter()]
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
    worker.join()
    gap = float(np.max(np.diff(ticks))) if len(ticks) > 1 else float("inf")
    assert gap < call / 2, f"the main thread stalled {gap:.3f} s during a {call:.3f} s call"


# ---------------------------------------------------------------------------
# property test
# ---------------------------------------------------------------------------


@st.composite
def problems(draw):
    rank = draw(st.sampled_from([2, 3, 4, 4]))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    B = draw(st.integers(1, 3)) if rank == 4 else 1
    Hkv = draw(st.integers(1, 3)) if rank > 2 else 1
    Hq = Hkv * draw(st.sampled_from([1, 2, 3, 4])) if rank > 2 else 1
    Sq, Sk = draw(st.integers(1, 24)), draw(st.integers(1, 150))
    Dk, Dv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([np.float32, np.float16, BF16]))
    spec = dict(
        causal=draw(st.booleans()),
        mask=draw(st.sampled_from([None, "bool", "additive"])),
        mask_shape=draw(st.sampled_from(["full", "rows", "keys"])),
        kv_lens=draw(st.booleans()),
        q_lens=draw(st.booleans()),
        window=draw(st.sampled_from([None, (0, 0), (3, None), (None, 2), (7, 5)])),
        softcap=draw(st.sampled_from([None, 0.5, 4.0])),
        sinks=draw(st.booleans()),
        alibi=draw(st.booleans()),
    )
    data_seed = draw(st.integers(0, 2**32 - 1))
    return rank, layout, (B, Hq, Hkv, Sq, Sk, Dk, Dv), dtype, spec, data_seed


@seed(SEED)
@given(problems())
def test_property(isa, problem):
    rank, layout, (B, Hq, Hkv, Sq, Sk, Dk, Dv), dtype, spec, data_seed = problem
    r = np.random.default_rng(data_seed)
    q4, k4, v4 = qkv(r, B, Hq, Hkv, Sq, Sk, Dk, Dv, dtype)
    q, k, v = (from4(x, layout, rank) for x in (q4, k4, v4))
    kw = dict(causal=spec["causal"], window=spec["window"], softcap=spec["softcap"])
    logical = (B, Hq, Sq, Sk)[4 - rank :]
    if spec["mask"] is not None:
        shape = {"full": logical, "rows": logical[:-1] + (1,), "keys": (Sk,)}[spec["mask_shape"]]
        kw["mask"] = make_mask(r, spec["mask"], shape)
    if spec["kv_lens"]:
        kw["kv_lens"] = r.integers(0, Sk + 1, size=B)
    if spec["q_lens"]:
        kw["q_lens"] = r.integers(0, Sq + 1, size=B)
    if spec["sinks"]:
        kw["sinks"] = r.standard_normal(Hq).astype(np.float32)
    if spec["alibi"]:
        kw["alibi_slopes"] = r.random(Hq).astype(np.float32)
    check_attention(q, k, v, layout=layout, **kw)


# ---------------------------------------------------------------------------
# the seed's worked example, and the tolerance itself
# ---------------------------------------------------------------------------

X_BANK = np.array(
    [
        [1, 0, 1, 0],  # river
        [0, 1, 0, 1],  # bank
        [1, 1, 0, 0.0],
    ]
)  # flooded


def test_seed_two_head_river_bank_flooded(isa):
    """The seed's two-head example (see tests/reference/test_reference.py for the reading): Q = K = V =
    the two 2-feature halves of X, scale 1/sqrt(2); river's concatenated output is
    [0.802, 0.599, 0.503, 0.248]."""
    heads = np.stack([X_BANK[:, :2], X_BANK[:, 2:]]).astype(np.float32)  # (H=2, S=3, D=2)
    out = attnx.attention(heads, heads, heads).astype(np.float64)
    np.testing.assert_array_equal(np.round(out[0, 0], 3), [0.802, 0.599])
    np.testing.assert_array_equal(np.round(out[1, 0], 3), [0.503, 0.248])
    xs = X_BANK.reshape(3, 2, 2)  # (S, H, D): the projection reshaped without a transpose
    concat = (
        attnx.attention(
            xs.astype(np.float32), xs.astype(np.float32), xs.astype(np.float32), layout="bshd"
        )
        .reshape(3, 4)
        .astype(np.float64)
    )
    np.testing.assert_array_equal(np.round(concat[0], 3), [0.802, 0.599, 0.503, 0.248])
    exact = ref.attention(xs, xs, xs, layout="bshd").reshape(3, 4)
    np.testing.assert_allclose(concat, exact, rtol=1e-6)
    for dtype in (np.float16, BF16):
        x = xs.astype(dtype)
        low = attnx.attention(x, x, x, layout="bshd")
        assert low.dtype == dtype
        np.testing.assert_allclose(low.reshape(3, 4).astype(np.float64), exact, atol=5e-3)
        check_attention(x, x, x, layout="bshd")


def _fake_kernel(monkeypatch, wrong):
    """Makes attnx.attention return `wrong` (and the true lse): a kernel with a bug."""
    real = attnx.attention
    monkeypatch.setattr(attnx, "attention", lambda *a, **kw: (wrong.copy(), real(*a, **kw)[1]))


@pytest.mark.parametrize(
    ("dtype", "bug"),
    [
        pytest.param(dt, bug, id=f"{name}-{bug}")
        for dt, name in zip(DTYPES, DTYPE_IDS)
        for bug in ("scale", "masked key", "diagonal")
        + (("bf16 output",) if dt == np.float32 else ())
    ],
)
def test_tolerance_is_tight(monkeypatch, rng, dtype, bug):
    """check_attention's tolerance catches small real bugs: a slightly wrong scale (0.1 % in
    float32, 2 % in 16-bit dtypes), one key that should be masked, an off-by-one causal
    diagonal, a float32 result that went through bfloat16."""
    q, k, v = qkv(rng, 1, 2, 2, 64, 300, 64, dtype=dtype)
    mask = np.ones(300, bool)
    mask[100] = False
    if bug == "scale":
        wrong = ref.attention(
            q, k, v, mask=mask, scale=(1.001 if dtype == np.float32 else 1.02) / 8
        )
    elif bug == "masked key":
        wrong = ref.attention(q, k, v)
    elif bug == "diagonal":
        # causal with 299 keys: row i sees j <= i + 235 instead of i + 236
        wrong = ref.attention(q, k[:, :, :299], v[:, :, :299], causal=True)
    else:
        wrong = ref.attention(q, k, v, mask=mask).astype(BF16).astype(np.float32)
    kw = dict(causal=True) if bug == "diagonal" else dict(mask=mask)
    check_attention(q, k, v, **kw)  # the real kernel passes
    _fake_kernel(monkeypatch, wrong)
    with pytest.raises(AssertionError, match="out: max error"):
        check_attention(q, k, v, **kw)


# ---------------------------------------------------------------------------
# memory: never a score matrix
# ---------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys, time
    import numpy as np, attnx
    S, D = 32768, 64
    rng = np.random.default_rng(int(sys.argv[1]))
    q, k, v = (rng.standard_normal((1, 1, S, D)).astype(np.float32) for _ in range(3))
    out = np.empty_like(q)
    attnx.attention(q[:, :, :8], k[:, :, :64], v[:, :, :64])  # warm up: threads, scratch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    attnx.attention(q, k, v, out=out)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = [0, 12345, S - 1]
    np.savez(sys.argv[2], out=out[0, 0, rows], q=q[0, 0, rows], k=k[0, 0], v=v[0, 0])
    print((after - before) * 1024, seconds)
""")


@(pytest.mark.slow if best_isa() == "scalar" else lambda f: f)  # ~3 s with SIMD, a minute without
def test_memory_is_linear_in_sequence_length(tmp_path):
    """S = 32768 full attention: a score matrix would need 4 GiB; the peak RSS of a fresh
    process may grow by far less (ru_maxrss is a high-water mark, hence the subprocess).
    Memory does not depend on the instruction set, so this runs on the fastest one."""
    npz = tmp_path / "rows.npz"
    env = {key: val for key, val in os.environ.items() if key != "ATTNX_ISA"}
    grown, seconds = script_words(_MEMORY_SCRIPT, SEED, npz, env=env)
    assert int(grown) < 512 * 2**20, f"peak RSS grew by {int(grown) / 2**20:.0f} MiB"
    d = np.load(npz)
    exact = ref.attention(d["q"], d["k"], d["v"], out_dtype=np.float64)
    np.testing.assert_allclose(d["out"], exact, rtol=1e-4, atol=2e-5)
    print(f"S=32768 full attention: {float(seconds):.2f} s, RSS +{int(grown) / 2**20:.1f} MiB")


# a single place that lists what the grid covers, so a reader can check it at a glance
def test_grid_is_pairwise_covering():
    pairs = lambda i, j: {(g[i], g[j]) for g in GRID}  # noqa: E731
    assert pairs(0, 1) == set(itertools.product(S_LEVELS, S_LEVELS))
    assert pairs(0, 2) == set(itertools.product(S_LEVELS, D_LEVELS))
    assert pairs(1, 2) == set(itertools.product(S_LEVELS, D_LEVELS))
