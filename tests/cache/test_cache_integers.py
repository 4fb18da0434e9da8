"""PagedKVCache's integer arguments (issue 18, defect 2 and its class).

The rule: sequence ids, layers, lengths and token counts are Python ints, NumPy integer scalars of
any width and sign, or 0-d integer arrays (counts also 1-d integer arrays of any dtype); they are
taken as the Python int they hold and range-checked before anything changes. A bool or a float
(even ``1.0``) is not an id, a layer, a length or a count. ``length()`` returns a Python int.

The repros of the issue come first; then each integer argument of each method with every NumPy
integer type, bools, floats, 0-d arrays, huge and negative values; then a hypothesis test that
drives two caches side by side, one with Python ints and one with the same values as NumPy types,
and requires the same outcome (result and state, or the same exception with nothing changed).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from attnx import reference

INT_DTYPES = [
    np.dtype(t)
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
]
NOT_INTS = [
    True,
    False,
    np.bool_(True),
    np.bool_(False),
    1.0,
    0.0,
    np.float64(1.0),
    np.float32(0.0),
    np.array(1.0),
    np.array(True),
    "1",
    None,
    [1],
    1 + 0j,
]
BAD_INT_ERRORS = (ValueError, TypeError, KeyError)


def small_cache(**kw):
    args = dict(num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=16, block_size=4)
    args.update(kw)
    return attnx.PagedKVCache(**args)


def state(cache):
    """Everything a cache operation may change (pages included)."""
    return (
        cache._free_ids(),
        cache._refs.tolist(),
        cache._next_id,
        {
            s: (cache.length(s), cache.block_table(s).tolist(), cache._seqs[s].version)
            for s in cache.sequences
        },
        cache.stats(),
        cache._k.tobytes(),
    )


def lengths_are_ints(cache):
    for s in cache.sequences:
        assert type(cache.length(s)) is int, (s, type(cache.length(s)))


def attend_ones(step, hq=1):
    c = step._cache
    T = step.num_tokens
    x = np.ones((T, c.num_kv_heads, c.head_dim), np.float32)
    return step.attend(0, np.ones((T, hq, c.head_dim), np.float32), x, x)


# ---------------------------------------------------------------------------------------------
# the repros
# ---------------------------------------------------------------------------------------------


def test_uint32_counts_on_an_empty_pool():
    """Was: CacheFullError claiming 4,026,531,841 blocks for 3 tokens."""
    cache = small_cache()
    a = cache.new_sequence()
    step = cache.begin_step([a], np.array([3], np.uint32))
    assert cache.length(a) == 3 and type(cache.length(a)) is int
    assert step.q_lens.tolist() == [3] and step.positions.tolist() == [0, 1, 2]
    assert attend_ones(step).shape == (3, 1, 4)
    assert cache.block_table(a).tolist() == [0]


def test_int8_counts_two_steps_100_then_50():
    """Was: the second step wrapped the stored length (an int8) and corrupted the sequence; every
    later step raised IndexError."""
    rng = np.random.default_rng(18)
    cache = attnx.PagedKVCache(1, 1, 8, num_blocks=64, block_size=16)
    a = cache.new_sequence()
    ks, vs = [], []
    for n in (np.int8(100), np.array([50], np.int8), [np.int8(1)]):
        step = cache.begin_step([a], n if isinstance(n, (list, np.ndarray)) else [n])
        T = step.num_tokens
        q = rng.standard_normal((T, 2, 8)).astype(np.float32)
        k = rng.standard_normal((T, 1, 8)).astype(np.float32)
        v = rng.standard_normal((T, 1, 8)).astype(np.float32)
        o = step.attend(0, q, k, v)
        ks.append(k)
        vs.append(v)
        K, V = np.concatenate(ks), np.concatenate(vs)
        want = reference.attention(q, K, V, causal=True, layout="bshd")
        np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-5)
    assert cache.length(a) == 151 and type(cache.length(a)) is int
    assert len(cache.block_table(a)) == 10 and cache.num_used_blocks == 10


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64])
def test_oversized_count_changes_nothing(dtype):
    """Was (int32): length + count wrapped negative, passed the capacity check and changed the
    sequence before failing."""
    cache = small_cache()
    a = cache.new_sequence()
    attend_ones(cache.begin_step([a], [5]))
    before = state(cache)
    big = np.iinfo(dtype).max
    with pytest.raises(attnx.CacheFullError, match="free blocks"):
        cache.begin_step([a], np.array([big], dtype))
    with pytest.raises(attnx.CacheFullError, match="free blocks"):
        cache.begin_step([a], [dtype(big)])
    assert state(cache) == before
    assert cache.length(a) == 5


@pytest.mark.parametrize("op", ["fork", "free", "truncate", "length", "block_table", "begin_step"])
@pytest.mark.parametrize(
    "bad", [True, 1.0, np.bool_(True), np.float64(1.0), np.array(1.0), np.array(True)], ids=repr
)
def test_bool_or_float_is_no_sequence_id(op, bad):
    """Was: ``fork(True)`` and ``free(1.0)`` acted on sequence 1."""
    cache = small_cache()
    a, b = cache.new_sequence(), cache.new_sequence()
    assert b == 1
    attend_ones(cache.begin_step([a, b], [3, 2]))
    before = state(cache)
    calls = {
        "fork": lambda: cache.fork(bad),
        "free": lambda: cache.free(bad),
        "truncate": lambda: cache.truncate(bad, 0),
        "length": lambda: cache.length(bad),
        "block_table": lambda: cache.block_table(bad),
        "begin_step": lambda: cache.begin_step([bad], [1]),
    }
    with pytest.raises(KeyError, match="seq"):
        calls[op]()
    assert state(cache) == before


def test_length_is_a_python_int():
    cache = small_cache(sliding_window=3)
    a = cache.new_sequence()
    assert type(cache.length(a)) is int
    for dtype in INT_DTYPES:
        cache.begin_step([np.array(a, dtype)], np.array([2], dtype))
        assert type(cache.length(a)) is int
        cache.truncate(dtype.type(a), dtype.type(cache.length(a) - 1))
        assert type(cache.length(a)) is int
    b = cache.fork(np.uint8(a))
    assert type(cache.length(b)) is int and cache.length(b) == cache.length(a) == 8
    assert all(type(v) is int for v in cache.stats().values() if not isinstance(v, float))


# ---------------------------------------------------------------------------------------------
# every integer argument, every kind of integer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_numpy_integers_of_every_type_act_as_python_ints(dtype):
    """ids, counts, lengths and layers given as NumPy scalars, 0-d arrays and arrays of ``dtype``
    do exactly what the same Python ints do."""
    results = []
    for as_np in (False, True):
        conv = dtype.type if as_np else int
        cache = small_cache()
        a, b = cache.new_sequence(), cache.new_sequence()
        step = cache.begin_step([conv(a), conv(b)], np.array([5, 2], dtype) if as_np else [5, 2])
        x = np.arange(7 * 4, dtype=np.float32).reshape(7, 1, 4)
        out = [
            step.attend(conv(0), x, x, x),
            step.attend(np.array(1, dtype) if as_np else 1, x, x, x),
        ]
        c = cache.fork(conv(a))
        cache.truncate(conv(a), conv(3))
        step = cache.begin_step([conv(c), conv(a)], [conv(1), np.array(4, dtype) if as_np else 4])
        out.append(step.attend(conv(1), x[:5], x[:5], x[:5]))
        cache.free(conv(b))
        pages = [cache.k_pages(conv(1)).copy(), cache.v_pages(conv(0)).copy()]
        results.append((state(cache), [o.tobytes() for o in out], [p.tobytes() for p in pages]))
        lengths_are_ints(cache)
    assert results[0] == results[1]


@pytest.mark.parametrize("bad", NOT_INTS, ids=repr)
def test_bools_floats_and_others_are_no_integer_argument(bad):
    cache = small_cache()
    a = cache.new_sequence()
    step = cache.begin_step([a], [6])
    attend_ones(step)
    step = cache.begin_step([a], [1])
    before = state(cache)
    x = np.ones((1, 1, 4), np.float32)
    for call, name in (
        (lambda: cache.begin_step([a], [bad]), "num_new_tokens"),
        (lambda: cache.truncate(a, bad), "length"),
        (lambda: cache.k_pages(bad), "layer"),
        (lambda: cache.v_pages(bad), "layer"),
        (lambda: step.attend(bad, x, x, x), "layer"),
    ):
        with pytest.raises(BAD_INT_ERRORS, match=name):
            call()
        assert state(cache) == before
    assert cache.is_current(step)
    attend_ones(step)


@pytest.mark.parametrize(
    "value",
    [
        -1,
        np.int8(-1),
        np.int64(-(2**63)),
        2**63,
        2**64,
        2**100,
        np.uint64(2**64 - 1),
        np.array(-1, np.int16),
    ],
    ids=repr,
)
def test_out_of_range_lengths_layers_and_counts(value):
    cache = small_cache()
    a = cache.new_sequence()
    attend_ones(cache.begin_step([a], [6]))
    step = cache.begin_step([a], [1])
    before = state(cache)
    x = np.ones((1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="length"):
        cache.truncate(a, value)
    with pytest.raises(ValueError, match="layer"):
        cache.k_pages(value)
    with pytest.raises(ValueError, match="layer"):
        step.attend(value, x, x, x)
    too_many = int(np.asarray(value).item()) >= 0
    with pytest.raises(
        attnx.CacheFullError if too_many else ValueError,
        match="free blocks" if too_many else "num_new_tokens",
    ):
        cache.begin_step([a], [value])
    with pytest.raises(KeyError, match="seq"):
        cache.fork(value)
    assert state(cache) == before
    attend_ones(step)


@pytest.mark.parametrize(
    "counts, exc",
    [
        (np.array([[1]], np.int32), ValueError),  # 2-d
        (np.array([1.0]), ValueError),  # float dtype
        (np.array([True]), ValueError),  # bool dtype
        (np.array(1, np.int64), ValueError),  # 0-d: not a sequence of counts
        (np.int64(1), TypeError),
        (1, TypeError),
        ("1", TypeError),
        ([np.array([1])], ValueError),  # an element that is an array
        (np.array([1, 2], np.uint8), ValueError),  # two counts for one sequence
    ],
    ids=repr,
)
def test_malformed_count_sequences(counts, exc):
    cache = small_cache()
    a = cache.new_sequence()
    before = state(cache)
    with pytest.raises(exc, match="num_new_tokens"):
        cache.begin_step([a], counts)
    assert state(cache) == before


def test_count_sequences_of_every_form():
    cache = small_cache()
    a, b = cache.new_sequence(), cache.new_sequence()
    for counts in (
        [1, 2],
        (np.uint8(1), np.int16(2)),
        np.array([1, 2], np.uint64),
        [np.array(1, np.int8), np.array(2, np.uint32)],
        np.array([1, 2], object),
    ):
        step = cache.begin_step(np.array([a, b], np.uint16), counts)
        assert step.q_lens.tolist() == [1, 2] and step.seq_ids == [a, b]
        assert all(type(i) is int for i in step.seq_ids)
    assert cache.length(a) == 5 and cache.length(b) == 10


def test_seq_ids_must_be_a_sequence_of_distinct_ids():
    cache = small_cache()
    a = cache.new_sequence()
    with pytest.raises(TypeError, match="seq_ids"):
        cache.begin_step(a, [1])
    with pytest.raises(ValueError, match="seq_ids"):
        cache.begin_step([a, np.int8(a)], [1, 1])  # the same sequence, given two ways
    assert cache.length(a) == 0


@pytest.mark.parametrize(
    "kw, exc, name",
    [
        (dict(num_blocks=np.bool_(True)), ValueError, "num_blocks"),
        (dict(block_size=np.float64(4.0)), ValueError, "block_size"),
        (dict(num_layers=np.int8(-1)), ValueError, "num_layers"),
        (dict(head_dim=np.uint64(2**64 - 1)), MemoryError, "PagedKVCache"),
        (dict(num_kv_heads=2**100), MemoryError, "PagedKVCache"),
        (dict(sliding_window=np.uint64(2**63)), ValueError, "sliding_window"),
        (dict(sliding_window=True), ValueError, "sliding_window"),
        (dict(sliding_window=0), ValueError, "sliding_window"),
        (dict(value_dim=np.array(2.0)), ValueError, "value_dim"),
    ],
)
def test_constructor_integers(kw, exc, name):
    with pytest.raises(exc, match=name):
        small_cache(**kw)


def test_constructor_numpy_integers():
    cache = small_cache(
        num_layers=np.uint8(2),
        num_kv_heads=np.array(1, np.int16),
        head_dim=np.int64(4),
        num_blocks=np.uint32(16),
        block_size=np.int8(4),
        value_dim=np.uint16(3),
        sliding_window=np.int32(5),
    )
    for name in (
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "num_blocks",
        "block_size",
        "value_dim",
        "sliding_window",
    ):
        assert type(getattr(cache, name)) is int, name
    assert cache.v_pages(1).shape == (16, 1, 4, 3)


def test_a_sequence_holds_at_most_2_31_minus_1_tokens():
    """Positions and lengths are int32 in a step. Only a sliding window lets a sequence grow that
    long (its blocks are released as it goes); the step past the limit is refused with nothing
    changed. (White-box: 2**31 tokens of real steps would take minutes, so the sequence's record
    is set to what 2047 steps of 2**20 tokens and one of 2**20 - 2 leave behind.)"""
    from attnx.cache.blocks import BlockRow

    bs = 2**20
    cache = attnx.PagedKVCache(1, 1, 1, num_blocks=3, block_size=bs, sliding_window=1)
    a = cache.new_sequence()
    cache.begin_step([a], [1])
    record = cache._seqs[a]
    row = BlockRow()
    row.append(np.full(2047, -1, np.int32))
    row.release_before(2047)
    row.append(record.row.ids)
    record.row, record.length = row, 2**31 - 2
    step = cache.begin_step([a], [np.uint32(1)])
    assert cache.length(a) == 2**31 - 1
    assert step.positions.tolist() == [2**31 - 2] and step.seq_lens.tolist() == [2**31 - 1]
    before = state(cache)
    for n in (1, np.int32(1), np.uint64(2)):
        with pytest.raises(ValueError, match="num_new_tokens"):
            cache.begin_step([a], [n])
        assert state(cache) == before
    cache.begin_step([a], [0])  # a zero-token step is still fine
    cache.free(a)
    assert cache.num_free_blocks == 3


# ---------------------------------------------------------------------------------------------
# Python ints and NumPy integers side by side, under hypothesis
# ---------------------------------------------------------------------------------------------


def numpy_form(data, value, label):
    """``value`` as a NumPy scalar or 0-d array of a drawn integer dtype that holds it (or the
    Python int itself)."""
    fits = [d for d in INT_DTYPES if np.iinfo(d).min <= value <= np.iinfo(d).max]
    form = data.draw(
        st.sampled_from(["int", "scalar", "scalar", "0-d"]) if fits else st.just("int"),
        label=f"{label} form",
    )
    if form == "int":
        return value
    dtype = data.draw(st.sampled_from(fits), label=f"{label} dtype")
    return dtype.type(value) if form == "scalar" else np.array(value, dtype)


def some_int(draw_data, lo, hi, label):
    """An int, mostly in [lo, hi], sometimes at the edges of the integer types."""
    edges = sorted(
        {v for d in INT_DTYPES for v in (np.iinfo(d).min, np.iinfo(d).max)}
        | {-1, 2**31, 2**63, 2**64, 2**70}
    )
    return draw_data.draw(st.integers(lo, hi) | st.sampled_from(edges), label=label)


def outcome(fn):
    try:
        return "ok", fn()
    except (KeyError, ValueError, TypeError, attnx.CacheFullError) as e:
        return type(e).__name__, None


def step_both(data, py, nps, live, x):
    """One drawn begin_step on both caches (ids and counts as Python ints on ``py``, as NumPy
    integers or an integer array on ``nps``); where both succeed, the plans and one layer's
    outputs (q = k = v = ``x``) must be the same. Returns both outcomes."""
    ids = (
        data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3), label="ids")
        if live
        else []
    )
    counts = [some_int(data, 0, 9, "count") for _ in ids]
    np_ids = [numpy_form(data, s, "id") for s in ids]
    fits = [d for d in INT_DTYPES if all(np.iinfo(d).min <= n <= np.iinfo(d).max for n in counts)]
    as_array = fits and data.draw(st.booleans(), label="counts as an array")
    np_counts = (
        np.array(counts, data.draw(st.sampled_from(fits), label="counts dtype"))
        if as_array
        else [numpy_form(data, n, "count") for n in counts]
    )
    r = (
        outcome(lambda: py.begin_step(ids, counts)),
        outcome(lambda: nps.begin_step(np_ids, np_counts)),
    )
    if r[0][0] == "ok" and r[1][0] == "ok":
        T = r[0][1].num_tokens
        assert r[1][1].num_tokens == T
        for name in ("q_lens", "seq_lens", "positions", "block_tables", "slots"):
            np.testing.assert_array_equal(getattr(r[0][1], name), getattr(r[1][1], name))
        o = [s.attend(0, x[:T], x[:T], x[:T]) for s in (r[0][1], r[1][1])]
        assert o[0].tobytes() == o[1].tobytes()
        r = (("ok", None), ("ok", None))
    return r


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_numpy_integers_match_python_ints(data):
    """Two caches, one driven with Python ints and one with the same values as NumPy integers
    of every width and sign (scalars, 0-d and 1-d arrays): every call has the same outcome,
    every state is the same, and a call that raises changes nothing."""
    py, nps = small_cache(), small_cache()
    x = np.linspace(-1, 1, 64 * 4, dtype=np.float32).reshape(64, 1, 4)
    for i in range(data.draw(st.integers(1, 25), label="ops")):
        op = data.draw(
            st.sampled_from(["new", "step", "step", "truncate", "fork", "free", "length", "pages"]),
            label=f"op {i}",
        )
        live = py.sequences
        sid = (
            data.draw(st.sampled_from(live), label="seq")
            if live and data.draw(st.booleans())
            else some_int(data, -2, 30, "seq")
        )
        before = state(nps)
        if op == "new":
            r = (outcome(py.new_sequence), outcome(nps.new_sequence))
        elif op == "step":
            r = step_both(data, py, nps, live, x)
        elif op == "truncate":
            n = some_int(data, 0, 40, "length")
            r = (
                outcome(lambda: py.truncate(int(sid), n)),
                outcome(
                    lambda: nps.truncate(numpy_form(data, sid, "id"), numpy_form(data, n, "length"))
                ),
            )
        elif op in ("fork", "free", "length"):
            r = (
                outcome(lambda: getattr(py, op)(sid)),
                outcome(lambda: getattr(nps, op)(numpy_form(data, sid, "id"))),
            )
            if op == "length" and r[1][0] == "ok":
                assert type(r[1][1]) is int
        else:
            layer = some_int(data, -1, 2, "layer")
            r = (
                outcome(lambda: py.k_pages(layer).shape),
                outcome(lambda: nps.v_pages(numpy_form(data, layer, "layer")).shape),
            )
        assert r[0] == r[1], (op, r)
        if r[1][0] != "ok":
            assert state(nps) == before, f"{op} raised {r[1][0]} but changed the cache"
        assert state(py) == state(nps)
        lengths_are_ints(nps)
