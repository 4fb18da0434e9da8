"""Recurrent states of a hybrid model's linear layers in PagedKVCache: Step.linear against one
gated_delta_rule call over the whole sequence, fork copies, truncate refused, free releases."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import StaleStepError

HV, K, V = 2, 8, 6


def make_cache(linear_layers=2):
    return attnx.PagedKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        num_blocks=64,
        block_size=4,
        linear_layers=linear_layers,
        state_shape=(HV, K, V),
    )


def tokens(rng, T, per_channel=False):
    """q, k (T, 1, K), v (T, HV, V), g, beta for T packed tokens."""
    return (
        rng.standard_normal((T, 1, K)).astype(np.float32),
        rng.standard_normal((T, 1, K)).astype(np.float32),
        rng.standard_normal((T, HV, V)).astype(np.float32),
        -rng.random((T, HV, K) if per_channel else (T, HV)).astype(np.float32),
        rng.random((T, HV)).astype(np.float32),
    )


def whole(seq_tokens):
    """One gated_delta_rule call over a sequence's tokens (concatenated)."""
    q, k, v, g, beta = (np.concatenate(parts)[None] for parts in zip(*seq_tokens))
    o, state = attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=True, output_final_state=True)
    return o[0], state[0]


@pytest.mark.parametrize("per_channel", [False, True])
def test_steps_equal_one_call(rng, per_channel):
    cache = make_cache()
    a, b = cache.new_sequence(), cache.new_sequence()
    history = {a: [], b: []}
    outs = {a: [], b: []}
    for counts in ([7, 70], [1, 1], [0, 3], [1, 1], [20, 1]):  # prefill, decode, uneven steps
        step = cache.begin_step([a, b], counts)
        toks = tokens(rng, sum(counts), per_channel)
        o = step.linear(1, *toks, qk_l2norm=True)
        for layer in (0,):  # the other linear layer sees other tokens: states are per layer
            step.linear(layer, *tokens(rng, sum(counts), per_channel), qk_l2norm=True)
        start = 0
        for sid, n in zip((a, b), counts):
            history[sid].append(tuple(t[start : start + n] for t in toks))
            outs[sid].append(o[start : start + n])
            start += n
    for sid in (a, b):
        ref_o, ref_state = whole(history[sid])
        np.testing.assert_allclose(np.concatenate(outs[sid]), ref_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cache._seq(sid).state[1], ref_state, rtol=1e-5, atol=1e-5)
    assert cache.stats()["state_bytes"] == 2 * cache.bytes_per_state == 2 * 2 * HV * K * V * 4


def test_fork_copies_the_state(rng):
    cache = make_cache(linear_layers=1)
    a = cache.new_sequence()
    cache.begin_step([a], [10]).linear(0, *tokens(rng, 10))
    f = cache.fork(a)
    assert cache._seq(f).state is not cache._seq(a).state
    np.testing.assert_array_equal(cache._seq(f).state, cache._seq(a).state)
    toks = tokens(rng, 1)
    oa = cache.begin_step([a], [1]).linear(0, *toks)
    before_f = cache._seq(f).state.copy()
    np.testing.assert_array_equal(cache._seq(f).state, before_f)  # a's step left f's state alone
    of = cache.begin_step([f], [1]).linear(0, *toks)
    np.testing.assert_array_equal(of, oa)  # same state, same token: same output
    np.testing.assert_array_equal(cache._seq(f).state, cache._seq(a).state)


def test_truncate_refused_then_free(rng):
    cache = make_cache(linear_layers=1)
    a = cache.new_sequence()
    cache.truncate(a, 0)  # no state yet: nothing to undo
    cache.begin_step([a], [9]).linear(0, *tokens(rng, 9))
    state = cache._seq(a).state.copy()
    with pytest.raises(
        ValueError, match=r"length: cannot roll back to 4: sequence .* recurrent state"
    ):
        cache.truncate(a, 4)
    assert cache.length(a) == 9
    np.testing.assert_array_equal(cache._seq(a).state, state)
    cache.truncate(a, 9)  # its own length: no change
    cache.truncate(a, 0)  # back to the start: a fresh (zero) state
    assert cache.length(a) == 0 and cache.stats()["state_bytes"] == 0
    cache.begin_step([a], [2]).linear(0, *tokens(rng, 2))
    assert cache.stats()["state_bytes"] == cache.bytes_per_state
    cache.free(a)
    assert cache.stats()["state_bytes"] == 0 and cache.num_used_blocks == 0


def test_errors_write_nothing(rng):
    cache = make_cache()
    a = cache.new_sequence()
    cache.begin_step([a], [3]).linear(0, *tokens(rng, 3))
    state = cache._seq(a).state.copy()
    step = cache.begin_step([a], [2])
    q, k, v, g, beta = tokens(rng, 2)
    with pytest.raises(ValueError, match=r"v: expected \(T=2, Hv=2, 6\)"):
        step.linear(0, q, k, v[:, :1], g, beta)
    with pytest.raises(ValueError, match=r"q: expected \(T=2, Hk, 8\)"):
        step.linear(0, q[:1], k, v, g, beta)
    with pytest.raises(ValueError, match=r"layer"):
        step.linear(2, q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"beta: expected shape"):
        step.linear(0, q, k, v, g, beta[:, :1])
    np.testing.assert_array_equal(cache._seq(a).state, state)
    step.linear(0, q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"linear layer 0 already ran in this step"):
        step.linear(0, q, k, v, g, beta)
    stale = cache.begin_step([a], [1])
    cache.truncate(a, 0)
    with pytest.raises(StaleStepError):
        stale.linear(1, *tokens(rng, 1))


def test_cache_arguments():
    with pytest.raises(ValueError, match="state_shape: given without linear_layers"):
        attnx.PagedKVCache(1, 1, 8, 4, state_shape=(1, 2, 3))
    with pytest.raises(ValueError, match=r"state_shape: expected \(Hv, K, V\)"):
        attnx.PagedKVCache(1, 1, 8, 4, linear_layers=2)
    with pytest.raises(ValueError, match=r"state_shape: expected \(Hv, K, V\)"):
        attnx.PagedKVCache(1, 1, 8, 4, linear_layers=2, state_shape=(1, 0, 3))
    with pytest.raises(ValueError, match=r"linear_layers: expected an int"):
        attnx.PagedKVCache(1, 1, 8, 4, linear_layers=-1, state_shape=(1, 2, 3))
    cache = attnx.PagedKVCache(1, 1, 8, 4)
    a = cache.new_sequence()
    with pytest.raises(ValueError, match="layer: this cache has no linear layers"):
        cache.begin_step([a], [1]).linear(0, *tokens(np.random.default_rng(0), 1))
    assert cache.bytes_per_state == 0
