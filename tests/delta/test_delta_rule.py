"""attnx.gated_delta_rule against its float64 reference twin on every instruction set: both
kernel forms (chunked prefill, token-by-token decode), per-head and per-channel gates, GQA-style
key-head sharing, odd lengths and widths, low-precision storage, variable lengths, and the
errors. Tolerance: helpers.delta_tolerance (a multiple of a float32 recurrence's own error)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx import reference as ref

from helpers import BF16, check_delta_rule


def inputs(rng, B, T, Hk, Hv, K, V, *, per_channel=False, dtype=np.float32, decay=1.0):
    """q, k, v in `dtype`; log-gates in (-decay, 0]; beta in (0, 1)."""
    q = rng.standard_normal((B, T, Hk, K)).astype(dtype)
    k = rng.standard_normal((B, T, Hk, K)).astype(dtype)
    v = rng.standard_normal((B, T, Hv, V)).astype(dtype)
    g = -decay * rng.random((B, T, Hv, K) if per_channel else (B, T, Hv)).astype(np.float32)
    beta = rng.random((B, T, Hv)).astype(np.float32)
    return q, k, v, g, beta


def state0(rng, N, Hv, K, V):
    return (0.1 * rng.standard_normal((N, Hv, K, V))).astype(np.float32)


# ---- non-finite gates and betas --------------------------------------------------------------
# NaN and ±inf in g or beta make the recurrence's state non-finite from that position on (its
# output there and after); g = -inf (exp(g) = 0) resets the state, as does any gate whose exp
# is 0 in float32 (-1e30, -200), and everything after it stays finite. Either way the positions
# before a planted value must come out finite and as they were.
GATE_VALUES = [np.nan, np.inf, -np.inf, -1e30, -200.0]
BETA_VALUES = [np.nan, np.inf, -np.inf]
BAD_CASES = [("g", x) for x in GATE_VALUES] + [("beta", x) for x in BETA_VALUES]


def plant(g, beta, planted):
    """Copies of g and beta with each spot (t, "g" or "beta", value, head, channel) written at
    position t of every batch row (head and channel taken modulo their counts); a per-channel
    gate gets the value in one channel, or in all of them where channel is None."""
    g, beta = g.copy(), beta.copy()
    for t, what, value, head, ch in planted:
        head = head % g.shape[2]
        if what == "beta":
            beta[:, t, head] = value
        elif g.ndim == 4 and ch is not None:
            g[:, t, head, ch % g.shape[3]] = value
        else:
            g[:, t, head] = value
    return g, beta


def spots(T, min_size=1):
    """Strategy: min_size to 3 spots for `plant` at positions of a length-T sequence."""
    where = st.integers(0, T - 1)
    spot = st.one_of(
        st.tuples(
            where,
            st.just("g"),
            st.sampled_from(GATE_VALUES),
            st.integers(0, 7),
            st.none() | st.integers(0, 1 << 16),
        ),
        st.tuples(
            where, st.just("beta"), st.sampled_from(BETA_VALUES), st.integers(0, 7), st.none()
        ),
    )
    return st.lists(spot, min_size=min_size, max_size=3)


def first_spot(planted):
    return min(t for t, *_ in planted)


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 200])
def test_matches_reference(isa, rng, mode, gate, T):
    q, k, v, g, beta = inputs(rng, 2, T, 2, 4, 40, 24, per_channel=gate == "channel")
    check_delta_rule(
        q, k, v, g, beta, initial_state=state0(rng, 2, 4, 40, 24), qk_l2norm=True, _mode=mode
    )


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_low_precision_storage(isa, rng, dtype, gate, mode):
    q, k, v, g, beta = inputs(rng, 1, 97, 1, 2, 48, 32, per_channel=gate == "channel", dtype=dtype)
    o, _ = check_delta_rule(
        q, k, v, g, beta, initial_state=state0(rng, 1, 2, 48, 32), qk_l2norm=True, _mode=mode
    )
    assert o.dtype == dtype


@pytest.mark.parametrize("K, V", [(1, 1), (33, 70), (128, 128), (17, 160)])
def test_odd_widths(isa, rng, K, V):
    q, k, v, g, beta = inputs(rng, 1, 70, 1, 3, K, V, per_channel=True)
    check_delta_rule(q, k, v, g, beta, initial_state=state0(rng, 1, 3, K, V), qk_l2norm=True)


def test_without_l2norm_and_with_scale(isa, rng):
    q, k, v, g, beta = inputs(rng, 1, 80, 2, 2, 16, 16)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule is stable for |k| <= 1
    check_delta_rule(q, k, v, g, beta, scale=0.3)


def test_strong_decay_never_overflows(isa, rng):
    """Gates summing far past -88 inside one chunk (exp(-G) alone would overflow float32), and
    channels that do not decay at all beside them."""
    q, k, v, g, beta = inputs(rng, 1, 150, 1, 2, 32, 32, per_channel=True, decay=30.0)
    g[..., ::3] = 0.0
    for mode in ("chunked", "recurrent"):
        o, state = check_delta_rule(q, k, v, g, beta, qk_l2norm=True, _mode=mode)
        assert np.isfinite(o).all() and np.isfinite(state).all()
    gh = np.full((1, 150, 2), -25.0, np.float32)
    check_delta_rule(q, k, v, gh, beta, qk_l2norm=True, _mode="chunked")


def test_prefill_then_decode_equals_one_recurrence(isa, rng):
    """Chunked prefill, then decode one token at a time from its state: one long sequence."""
    T0, steps = 130, 5
    q, k, v, g, beta = inputs(rng, 2, T0 + steps, 2, 4, 32, 48, per_channel=True)
    whole, whole_state = check_delta_rule(q, k, v, g, beta, qk_l2norm=True)
    o, state = attnx.gated_delta_rule(
        q[:, :T0],
        k[:, :T0],
        v[:, :T0],
        g[:, :T0],
        beta[:, :T0],
        qk_l2norm=True,
        output_final_state=True,
        _mode="chunked",
    )
    outs = [o]
    for t in range(T0, T0 + steps):
        sl = slice(t, t + 1)
        o, state = attnx.gated_delta_rule(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g[:, sl],
            beta[:, sl],
            qk_l2norm=True,
            initial_state=state,
            output_final_state=True,
        )
        outs.append(o)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, whole_state, rtol=1e-5, atol=1e-5)


def test_cu_seqlens_packed(isa, rng):
    cu = np.array([0, 1, 65, 65, 130, 200])
    q, k, v, g, beta = inputs(rng, 1, 203, 2, 2, 24, 24, per_channel=True)
    s0 = state0(rng, 5, 2, 24, 24)
    o, state = check_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, qk_l2norm=True)
    assert np.all(o[:, 200:] == 0), "positions after the last sequence must stay zero"
    for n in range(5):  # each sequence alone gives the same
        a, b = cu[n], cu[n + 1]
        one, one_state = attnx.gated_delta_rule(
            q[:, a:b],
            k[:, a:b],
            v[:, a:b],
            g[:, a:b],
            beta[:, a:b],
            initial_state=s0[n : n + 1],
            qk_l2norm=True,
            output_final_state=True,
        )
        np.testing.assert_array_equal(o[:, a:b], one)
        np.testing.assert_array_equal(state[n], one_state[0])


def test_lengths_padded_batch(isa, rng):
    lengths = np.array([70, 0, 1, 64])
    q, k, v, g, beta = inputs(rng, 4, 70, 1, 2, 16, 20)
    o, state = check_delta_rule(q, k, v, g, beta, lengths=lengths, qk_l2norm=True)
    for b, n in enumerate(lengths):
        assert np.all(o[b, n:] == 0)
    assert np.all(state[1] == 0)  # an empty sequence keeps its (zero) initial state


def test_layout_bhsd(isa, rng):
    q, k, v, g, beta = inputs(rng, 2, 66, 2, 4, 16, 8, per_channel=True)
    o, state = attnx.gated_delta_rule(q, k, v, g, beta, output_final_state=True, qk_l2norm=True)
    t = lambda x: np.ascontiguousarray(x.swapaxes(1, 2))  # noqa: E731
    o2, state2 = check_delta_rule(t(q), t(k), t(v), t(g), t(beta), layout="bhsd", qk_l2norm=True)
    np.testing.assert_array_equal(o2, o.swapaxes(1, 2))
    np.testing.assert_array_equal(state2, state)


def test_threads_give_identical_results(rng):
    q, k, v, g, beta = inputs(rng, 2, 100, 2, 4, 32, 32)
    one = attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, num_threads=1)
    two = attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, num_threads=2)
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("threads", [1, 2])
def test_value_heads_sharing_a_key_head_match_each_head_alone(isa, rng, gate, threads):
    """The chunked kernel runs the value heads of one key head together (q, k and their pair
    products shared): bit for bit what each value head gives alone, state included."""
    q, k, v, g, beta = inputs(rng, 2, 75, 1, 4, 32, 48, per_channel=gate == "channel")
    s0 = state0(rng, 2, 4, 32, 48)
    o, state = attnx.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        qk_l2norm=True,
        output_final_state=True,
        num_threads=threads,
        _mode="chunked",
    )
    for h in range(4):
        sl = slice(h, h + 1)
        one, one_state = attnx.gated_delta_rule(
            q,
            k,
            v[:, :, sl],
            g[:, :, sl],
            beta[:, :, sl],
            initial_state=s0[:, sl],
            qk_l2norm=True,
            output_final_state=True,
            _mode="chunked",
        )
        np.testing.assert_array_equal(o[:, :, sl], one)
        np.testing.assert_array_equal(state[:, sl], one_state)


def test_float64_and_inputs_untouched(rng):
    q, k, v, g, beta = inputs(rng, 1, 20, 1, 1, 8, 8, dtype=np.float64)
    before = [x.copy() for x in (q, k, v, g, beta)]
    o = attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True)
    assert o.dtype == np.float64
    np.testing.assert_allclose(
        o, ref.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True), rtol=1e-4, atol=1e-5
    )
    for x, x0 in zip((q, k, v, g, beta), before):
        np.testing.assert_array_equal(x, x0)


def test_reference_worked_example():
    """One token from a zero state with g = 0, beta = 1: S = k vᵀ, so o = scale (q.k) v."""
    q = np.array([[[[1.0, 2.0]]]])
    k = np.array([[[[0.6, 0.8]]]])
    v = np.array([[[[3.0, -1.0, 0.5]]]])
    o, state = ref.gated_delta_rule(
        q, k, v, np.zeros((1, 1, 1)), np.ones((1, 1, 1)), scale=1.0, output_final_state=True
    )
    np.testing.assert_allclose(o[0, 0, 0], (0.6 + 1.6) * v[0, 0, 0])
    np.testing.assert_allclose(state[0, 0], np.outer(k[0, 0, 0], v[0, 0, 0]), rtol=1e-6)
    # A second write of the same key with beta = 1 replaces its value (the delta rule's point).
    v2 = np.array([[[[3.0, -1.0, 0.5]], [[-2.0, 4.0, 1.0]]]])
    kk, qq = np.concatenate([k, k], axis=1), np.concatenate([q, q], axis=1)
    o2 = ref.gated_delta_rule(qq, kk, v2, np.zeros((1, 2, 1)), np.ones((1, 2, 1)), scale=1.0)
    np.testing.assert_allclose(o2[0, 1, 0], (0.6 + 1.6) * v2[0, 1, 0])


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v, g, beta = inputs(rng, 1, 30, 1, 2, 16, 16)
    tq, tk, tv, tg, tb = (torch.from_numpy(x) for x in (q, k, v, g, beta))
    o, state = attnx.gated_delta_rule(tq, tk, tv, tg, tb, output_final_state=True)
    assert isinstance(o, torch.Tensor) and isinstance(state, torch.Tensor)
    np.testing.assert_array_equal(o.numpy(), attnx.gated_delta_rule(q, k, v, g, beta))
    ob = attnx.gated_delta_rule(tq.bfloat16(), tk.bfloat16(), tv.bfloat16(), tg, tb)
    assert ob.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="q: the tensor requires grad"):
        attnx.gated_delta_rule(tq.requires_grad_(), tk, tv, tg, tb)


def _bad(rng):
    return dict(zip(["q", "k", "v", "g", "beta"], inputs(rng, 2, 5, 2, 4, 8, 6)))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: a.update(q=a["q"][0]), ValueError, r"q: expected 4 dims"),
        (lambda a: a.update(k=a["k"][:, :, :, :4]), ValueError, r"k: expected the shape of q"),
        (
            lambda a: a.update(v=a["v"][:, :, :3]),
            ValueError,
            r"v: the value heads \(Hv=3\) must be a multiple",
        ),
        (lambda a: a.update(v=a["v"][:, :4]), ValueError, r"v: expected \(B=2, T=5"),
        (lambda a: a.update(g=a["g"][:, :, :2]), ValueError, r"g: expected shape"),
        (
            lambda a: a.update(g=np.zeros((2, 5, 4, 7), np.float32)),
            ValueError,
            r"g: expected shape",
        ),
        (
            lambda a: a.update(g=np.zeros((2, 5), np.float32)),
            ValueError,
            r"g: expected \(B, T, Hv\)",
        ),
        (lambda a: a.update(beta=a["beta"][..., :1]), ValueError, r"beta: expected shape"),
        (
            lambda a: a.update(k=a["k"].astype(np.float16)),
            TypeError,
            r"q, k, v: expected one dtype",
        ),
        (lambda a: a.update(q=a["q"].astype(np.int32)), TypeError, r"q: expected a float array"),
        (lambda a: a.update(layout="sbhd"), ValueError, r"layout: expected"),
        (lambda a: a.update(cu_seqlens=[0, 2, 5]), ValueError, r"cu_seqlens: .* need B == 1"),
        (
            lambda a: a.update(lengths=[1, 6]),
            ValueError,
            r"lengths: expected \(B=2,\) ints in \[0, T=5\]",
        ),
        (
            lambda a: a.update(lengths=[1, 2], cu_seqlens=[0, 1]),
            ValueError,
            r"cu_seqlens, lengths: give one",
        ),
        (
            lambda a: a.update(initial_state=np.zeros((2, 4, 8, 5), np.float32)),
            ValueError,
            r"initial_state: expected shape",
        ),
        (lambda a: a.update(scale=float("nan")), ValueError, r"scale: expected 0 or a magnitude"),
        (lambda a: a.update(scale=1e39), ValueError, r"scale: .*float32's normal range"),
        (lambda a: a.update(scale=-1e-40), ValueError, r"scale: .*float32's normal range"),
        (lambda a: a.update(scale=True), TypeError, r"scale: expected a float"),
        (lambda a: a.update(num_threads=0), ValueError, r"num_threads: expected a positive int"),
    ],
)
def test_errors_name_the_argument(rng, change, error, match):
    a = _bad(rng)
    change(a)
    with pytest.raises(error, match=match):
        attnx.gated_delta_rule(**a)
    if "num_threads" not in a:  # the reference twin shares every other rule
        with pytest.raises(error, match=match):
            ref.gated_delta_rule(**a)


def test_cu_seqlens_must_increase(rng):
    q, k, v, g, beta = inputs(rng, 1, 10, 1, 1, 4, 4)
    for cu in ([0, 5, 3], [1, 10], [0, 11], [0]):
        with pytest.raises(ValueError, match=r"cu_seqlens: expected 0 = c\[0\]"):
            attnx.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)


@given(
    B=st.integers(1, 2),
    T=st.integers(1, 140),
    Hk=st.integers(1, 2),
    group=st.integers(1, 3),
    K=st.integers(1, 70),
    V=st.integers(1, 70),
    per_channel=st.booleans(),
    l2=st.booleans(),
    with_state=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_hypothesis_shapes(isa, B, T, Hk, group, K, V, per_channel, l2, with_state, data, seed):
    """Shapes, and non-finite gates and betas (NaN, ±inf, resets) planted at random positions."""
    bad = data.draw(spots(T, min_size=0), label="spots")
    rng = np.random.default_rng(seed)
    q, k, v, g, beta = inputs(rng, B, T, Hk, Hk * group, K, V, per_channel=per_channel)
    if not l2:
        k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1.0)
        q /= np.sqrt(K)
    g, beta = plant(g, beta, bad)
    s0 = state0(rng, B, Hk * group, K, V) if with_state else None
    o, _ = check_delta_rule(q, k, v, g, beta, initial_state=s0, qk_l2norm=l2)
    if bad:
        assert np.isfinite(o[:, : first_spot(bad)]).all()


def test_bench_delta_rows_declared_with_their_work():
    from attnx.bench import _cases

    prefill, decode = _cases.delta_cases(tiny=False, quick=False)
    assert prefill.shape.work() == 6.0 * 4096 * 8 * 128 * 128  # Sᵀk, k uᵀ, Sᵀq per token and head
    assert prefill.shape.kind == "flops" and decode.shape.kind == "bytes"
    assert decode.shape.work() == 2.0 * 4 * 8 * 16 * 128 * 128  # the fp32 state read and written
    assert [type(g).__name__ for g in prefill.goals] == ["PctOfLimit", "FasterThan"]
    assert prefill.goals[0].pct == 40 and prefill.goals[1].x == 10


def test_bench_torch_loop_agrees_with_attnx():
    torch = pytest.importorskip("torch")
    from attnx.bench import _cases, _peers

    for gate in ("head", "channel"):
        for T in (1, 70):
            shape = _cases.Delta(2, T, 1, 2, 16, 8, gate=gate)
            data = _peers.delta_inputs(shape, 0)
            mine = _peers.attnx_delta(shape, data, 1).result()
            theirs = _peers.torch_impl((torch, None), shape, data, 1).result()
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_state_read_in_place_of_a_copy(isa, rng, mode):
    """V a multiple of 32: the kernel reads the initial state where it lies and writes the final
    one into the result (no copy first); the initial state is left as it was, an empty sequence
    passes it through."""
    cu = np.array([0, 70, 70, 71])
    q, k, v, g, beta = inputs(rng, 1, 71, 1, 2, 24, 32, per_channel=True)
    s0 = state0(rng, 3, 2, 24, 32)
    before = s0.copy()
    o, state = check_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, qk_l2norm=True, _mode=mode
    )
    np.testing.assert_array_equal(s0, before)
    np.testing.assert_array_equal(state[1], s0[1])


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("what, value", BAD_CASES, ids=[f"{w}={x}" for w, x in BAD_CASES])
def test_nonfinite_gate_or_beta_at_every_position(isa, rng, gate, what, value):
    """One value at each position of three chunks (16 tokens each, the last one partial), in one
    channel of value head 0: both kernel forms hold to the recurrence wherever it is finite
    (everything after a reset), head 0's positions before the value are bit for bit those of the
    clean run and head 1 is untouched."""
    from helpers import assert_delta_matches, delta_expected

    T = 37
    q, k, v, g, beta = inputs(rng, 1, T, 1, 2, 24, 16, per_channel=gate == "channel")
    s0 = state0(rng, 1, 2, 24, 16)
    kw = dict(initial_state=s0, qk_l2norm=True, output_final_state=True)
    clean = {
        m: attnx.gated_delta_rule(q, k, v, g, beta, _mode=m, **kw)[0]
        for m in ("chunked", "recurrent")
    }
    for t in range(T):
        gb, bb = plant(g, beta, [(t, what, value, 0, 5)])
        expected = delta_expected(q, k, v, gb, bb, initial_state=s0, qk_l2norm=True)
        assert np.isfinite(expected[0][:, :t]).all()  # the recurrence itself: nothing before t
        if what == "g" and value < 0:
            assert np.isfinite(expected[0]).all()  # a reset: finite throughout
        for mode in ("chunked", "recurrent"):
            o, state = attnx.gated_delta_rule(q, k, v, gb, bb, _mode=mode, **kw)
            assert_delta_matches(o, state, expected)
            np.testing.assert_array_equal(o[:, :t], clean[mode][:, :t], err_msg=f"{mode}, t={t}")
            np.testing.assert_array_equal(
                o[:, :, 1], clean[mode][:, :, 1], err_msg=f"{mode}, t={t}"
            )


def test_reset_gate_is_a_fresh_start(isa, rng):
    """g = -inf at position t (every head, every channel): the output from t on is that of the
    sequence from t alone, from a zero state, whatever came before."""
    T, t = 50, 21
    for gate in ("head", "channel"):
        q, k, v, g, beta = inputs(rng, 1, T, 1, 2, 16, 16, per_channel=gate == "channel")
        g[:, t] = -np.inf
        g_tail = g[:, t:].copy()
        g_tail[:, 0] = 0.0
        tail = attnx.gated_delta_rule(
            q[:, t:], k[:, t:], v[:, t:], g_tail, beta[:, t:], qk_l2norm=True, _mode="chunked"
        )
        o = attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, _mode="chunked")
        np.testing.assert_allclose(o[:, t:], tail, rtol=1e-5, atol=1e-6)
        check_delta_rule(q, k, v, g, beta, qk_l2norm=True, initial_state=state0(rng, 1, 2, 16, 16))


@given(
    T=st.integers(1, 90),
    per_channel=st.booleans(),
    mode=st.sampled_from(["chunked", "recurrent"]),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_hypothesis_nonfinite_packed_sequences(isa, T, per_channel, mode, data, seed):
    """Sequences packed with cu_seqlens, values planted anywhere: each sequence holds to the
    recurrence wherever it is finite, and a sequence with nothing planted in it is bit for bit
    what it is in the clean run."""
    bad = data.draw(spots(T), label="spots")
    rng = np.random.default_rng(seed)
    cu = np.unique(np.concatenate([[0, T], rng.integers(0, T + 1, 3)]))
    q, k, v, g, beta = inputs(rng, 1, T, 1, 2, 16, 8, per_channel=per_channel)
    gb, bb = plant(g, beta, bad)
    s0 = state0(rng, len(cu) - 1, 2, 16, 8)
    o, state = check_delta_rule(
        q, k, v, gb, bb, cu_seqlens=cu, initial_state=s0, qk_l2norm=True, _mode=mode
    )
    clean, clean_state = attnx.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu,
        initial_state=s0,
        qk_l2norm=True,
        output_final_state=True,
        _mode=mode,
    )
    hit = {t for t, *_ in bad}
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        first = min([t for t in hit if a <= t < b], default=b)
        np.testing.assert_array_equal(o[:, a:first], clean[:, a:first])
        if first == b:
            np.testing.assert_array_equal(state[n], clean_state[n])


@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    per_channel=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**31),
)
def test_hypothesis_nonfinite_through_step_linear(isa, lens, per_channel, data, seed):
    """The cache's linear layers: a prefill step with values planted, then two decode steps, per
    sequence against one recurrence over all of its tokens (finite wherever it is)."""
    from helpers import assert_delta_matches, delta_expected

    rng = np.random.default_rng(seed)
    Hv, K, V = 2, 16, 8
    cache = attnx.PagedKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        num_blocks=64,
        block_size=16,
        linear_layers=1,
        state_shape=(Hv, K, V),
    )
    seqs = [cache.new_sequence() for _ in lens]
    steps = [lens, [1] * len(lens), [1] * len(lens)]
    T = sum(map(sum, steps))
    q, k, v, g, beta = inputs(rng, 1, T, 1, Hv, K, V, per_channel=per_channel)
    g, beta = plant(g, beta, data.draw(spots(T), label="spots"))
    outs, at = [], 0
    for counts in steps:
        n = sum(counts)
        sl = slice(at, at + n)
        outs.append(
            cache.begin_step(seqs, counts).linear(
                0, q[0, sl], k[0, sl], v[0, sl], g[0, sl], beta[0, sl], qk_l2norm=True
            )
        )
        at += n
    # the same tokens regrouped by sequence, as one packed call to the reference
    order = np.concatenate(
        [
            np.arange(sum(lens[:i]), sum(lens[: i + 1])).tolist()
            + [sum(lens) + i, sum(lens) + len(lens) + i]
            for i in range(len(lens))
        ]
    )
    o = np.concatenate(outs)[order][None]
    cu = np.concatenate([[0], np.cumsum([n + 2 for n in lens])])
    expected = delta_expected(
        q[:, order],
        k[:, order],
        v[:, order],
        g[:, order],
        beta[:, order],
        cu_seqlens=cu,
        qk_l2norm=True,
    )
    states = np.stack([cache._seq(s).state[0] for s in seqs])
    assert_delta_matches(o, states, expected)
