"""Prefix caching, shared-prefix decode and sessions (issue 14), rule by rule.

The state machine in test_cache_stateful.py drives the same features at random; here each rule
has its own small test: hits, the token left to compute, extra keys, digest collisions, LRU
eviction, truncation, copy-on-write and the sliding window against the registry; shared-prefix
attention against the reference on scrambled tables where some blocks are shared and some not;
session files round trip bit for bit, and corrupted, truncated or mismatched files are refused
with the cache unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
import attnx.cache
import attnx.cache.blocks
import attnx.ops.cascade
from attnx import reference

from helpers import BF16, bits, cache_state

BS = 4
# sessions need the optional safetensors package (the ``sessions`` extra)
needs_safetensors = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None,
    reason="safetensors is not installed (pip install safetensors)",
)


def make_cache(num_blocks=16, dtype="float32", **kw):
    kw.setdefault("prefix_caching", True)
    return attnx.PagedKVCache(2, 2, 8, num_blocks=num_blocks, block_size=BS, dtype=dtype, **kw)


def prefill(cache, seq, rng, n=None, tokens=None):
    """Computes ``seq``'s pending tokens (or ``n`` new ones with ``tokens``) in every layer."""
    n = n if n is not None else len(cache._seqs[seq].tokens) - cache.length(seq)
    step = cache.begin_step([seq], [n], tokens=None if tokens is None else [tokens])
    h, d = cache.num_kv_heads, cache.head_dim
    for layer in range(cache.num_layers):
        k = rng.standard_normal((n, h, d)).astype(np.float32)
        step.attend(layer, rng.standard_normal((n, 2 * h, d)).astype(np.float32), k, k + 1)
    return step


def seq_kv(c, seq):
    """``seq``'s keys and values, every layer: (layers, Hkv, length, D) each."""
    return c._gather(c.block_table(seq), c.length(seq))


@pytest.fixture
def split_always(monkeypatch):
    monkeypatch.setattr(attnx.ops.cascade, "MIN_SAVED_KEYS", 0)


# ---- prefix caching --------------------------------------------------------------------------
def test_hit_attaches_cached_blocks_and_leaves_a_token(rng):
    c = make_cache()
    prompt = list(range(100, 112))  # three full blocks
    a = c.new_sequence(tokens=prompt)
    assert c.length(a) == 0
    prefill(c, a, rng)
    b = c.new_sequence(tokens=prompt)  # the same prompt: the last block is left to compute
    assert c.length(b) == 8 and c.block_table(b).tolist() == c.block_table(a)[:2].tolist()
    assert c._refs[c.block_table(a)[:2]].tolist() == [2, 2]
    d = c.new_sequence(tokens=prompt + [7])
    assert c.length(d) == 12
    st_ = c.stats()
    assert (st_["prefix_query_tokens"], st_["prefix_hit_tokens"], st_["prefix_miss_tokens"]) == (
        37,
        20,
        17,
    )
    assert st_["prefix_hit_rate"] == pytest.approx(20 / 37) and st_["cached_blocks"] == 3


def test_extra_key_and_token_values_separate_chains(rng):
    c = make_cache()
    a = c.new_sequence(tokens=range(9), extra_key="lora-1")
    prefill(c, a, rng)
    assert c.length(c.new_sequence(tokens=range(9), extra_key="lora-1")) == 8
    assert c.length(c.new_sequence(tokens=range(9), extra_key="lora-2")) == 0
    assert c.length(c.new_sequence(tokens=range(9))) == 0
    assert c.length(c.new_sequence(tokens=range(9), extra_key=b"lora-1")) == 0  # bytes != str
    assert c.length(c.new_sequence(tokens=[0, 1, 2, 3, 4, 5, 6, 70, 8], extra_key="lora-1")) == 4


def test_digest_collision_never_mixes_sequences(rng, monkeypatch):
    """With a digest that collides for everything, a hit still needs the same token ids."""
    collide = lambda parent, tokens: b"\0" * 32  # noqa: E731
    monkeypatch.setattr(attnx.cache.blocks, "block_digest", collide)
    monkeypatch.setattr(attnx.cache, "block_digest", collide)
    c = make_cache()
    a = c.new_sequence(tokens=range(5))
    prefill(c, a, rng)
    assert c.length(c.new_sequence(tokens=[9, 9, 9, 9, 9])) == 0
    assert c.length(c.new_sequence(tokens=range(5))) == 4


def test_freed_blocks_stay_cached_and_are_evicted_lru_only_when_needed(rng):
    c = make_cache(num_blocks=6)
    a = c.new_sequence(tokens=range(100, 109))  # blocks 0, 1 full, 2 partial
    prefill(c, a, rng)
    b = c.new_sequence(tokens=range(200, 209))
    prefill(c, b, rng)
    c.free(a)
    c.free(b)
    st_ = c.stats()
    assert st_["used_blocks"] == 0 and st_["free_blocks"] == 6 and st_["evictable_blocks"] == 4
    # a's blocks were released first, each chain's tail before its head
    assert c._alloc.evictable_ids() == [1, 0, 4, 3]
    d = c.new_sequence()
    c.begin_step([d], [4 * 4])  # two plain free blocks, then two evictions: a's chain
    assert c.stats()["evictions"] == 2 and c.stats()["cached_blocks"] == 2
    assert c.length(c.new_sequence(tokens=range(100, 109))) == 0
    e = c.new_sequence(tokens=range(200, 209))
    assert c.length(e) == 8


def test_a_referenced_block_is_never_evicted(rng):
    c = make_cache(num_blocks=3)
    a = c.new_sequence(tokens=range(9))
    prefill(c, a, rng)  # holds all three blocks, two of them cached
    before = cache_state(c)
    with pytest.raises(attnx.CacheFullError):
        c.begin_step([c.new_sequence()], [1])
    assert cache_state(c)[:3] == before[:3] and c.stats()["evictions"] == 0


def test_truncate_into_a_block_drops_its_digest(rng):
    c = make_cache()
    a = c.new_sequence(tokens=range(13))
    prefill(c, a, rng)
    c.truncate(a, 8)  # whole blocks: block 2 is released, cached, still findable
    assert c.length(c.new_sequence(tokens=range(13))) == 12
    c.truncate(a, 6)  # into block 1: its contents will change, its digest goes
    assert c.stats()["cached_blocks"] == 2
    assert c.length(c.new_sequence(tokens=range(13))) == 4
    prefill(c, a, rng, 2, [6, 7])  # the same ids again: block 1 is registered anew, and the
    assert c.length(c.new_sequence(tokens=range(13))) == 12  # cached block 2 chains from it again


def test_copy_on_write_keeps_the_cached_block(rng):
    c = make_cache()
    a = c.new_sequence(tokens=range(9))
    prefill(c, a, rng)
    b = c.fork(a)
    c.truncate(b, 6)  # into a shared, cached block: b's next write copies it
    kept = seq_kv(c, a)
    prefill(c, b, rng, 1, [99])
    assert c.block_table(b)[1] != c.block_table(a)[1]
    after = seq_kv(c, a)
    assert all(np.array_equal(bits(kept[n]), bits(after[n])) for n in kept)
    assert c.length(c.new_sequence(tokens=range(9))) == 4  # block 1's digest went with the truncate


def test_sliding_window_releases_into_the_cache(rng):
    c = make_cache(sliding_window=4)
    a = c.new_sequence(tokens=range(30))
    for i in range(0, 28, 4):
        prefill(c, a, rng, 4, list(range(i, i + 4)))
    assert (c.block_table(a) < 0).sum() >= 4
    a_ = c._alloc
    assert sorted(a_.evictable_ids()) == sorted(b for b in a_.cached() if c._refs[b] == 0)
    assert c.length(c.new_sequence(tokens=range(30))) == 28


def test_begin_step_without_tokens_uses_the_prompt_or_stops_registering(rng):
    c = make_cache()
    a = c.new_sequence(tokens=range(6))
    prefill(c, a, rng, 6)  # the prompt's ids
    prefill(c, a, rng, 4)  # unknown ids: nothing past the prompt is registered
    assert c._seqs[a].tokens is None and c.stats()["cached_blocks"] == 1
    assert c.length(c.new_sequence(tokens=list(range(6)) + [0] * 5)) == 4


def test_token_arguments_are_checked_before_anything_changes():
    c = make_cache()
    with pytest.raises(TypeError, match="tokens"):
        c.new_sequence(tokens=[[1, 2]])
    with pytest.raises(TypeError, match="tokens"):
        c.new_sequence(tokens=[1.5, 2.0])
    with pytest.raises(TypeError, match="extra_key"):
        c.new_sequence(tokens=[1], extra_key=1.0)
    a = c.new_sequence(tokens=[1, 2])
    before = cache_state(c)
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        c.begin_step([a], [2], tokens=[[1, 2, 3]])
    with pytest.raises(ValueError, match="tokens"):
        c.begin_step([a], [2], tokens=[[1, 2], [3]])
    assert cache_state(c) == before


# ---- a step that ends early registers nothing (issue 31) --------------------------------------
def _early_cache(layers=2):
    return attnx.PagedKVCache(layers, 1, 8, num_blocks=6, block_size=4, prefix_caching=True)


def test_issue31_reproducer_a_refused_attend_registers_nothing(rng):
    kv = rng.standard_normal((9, 1, 8)).astype(np.float32)
    c = attnx.PagedKVCache(1, 1, 8, num_blocks=3, block_size=4, prefix_caching=True)
    a = c.new_sequence(tokens=[7] * 8)
    c.begin_step([a], [8]).attend(0, -kv[:8], -kv[:8], -kv[:8])
    c.free(a)
    b = c.new_sequence(tokens=range(9))
    step = c.begin_step([b], [9])
    with pytest.raises(ValueError, match="k: expected shape"):
        step.attend(0, kv, kv[:, :, :4], kv)  # refused: nothing written
    assert c.stats()["cached_blocks"] == 0  # (b took a's two cached blocks: evicted)
    c.free(b)
    s = c.new_sequence(tokens=range(9))
    assert c.length(s) == 0  # no hit on blocks never written
    # computed in full, the same prompt registers, and a hit reads what a recomputation writes
    step = c.begin_step([s], [9])
    step.attend(0, kv, kv, kv)
    h = c.new_sequence(tokens=range(9))
    assert c.length(h) == 8
    np.testing.assert_array_equal(seq_kv(c, h)["k"][0], kv[:8].swapaxes(0, 1))


def _prefill_layers(c, seq, n, rng, layers, tokens=None):
    """A step of ``n`` tokens of ``seq`` attended in ``layers`` only; returns it and its keys."""
    step = c.begin_step([seq], [n], tokens=None if tokens is None else [tokens])
    k = rng.standard_normal((n, c.num_kv_heads, c.head_dim)).astype(np.float32)
    for layer in layers:
        step.attend(layer, k, k, k)
    return step, k


@pytest.mark.parametrize(
    "ending", ["abandoned", "refused", "freed", "truncated", "stepped again", "same layer twice"]
)
def test_a_step_that_ends_early_registers_nothing(rng, ending):
    """Layer 0 of 2 attends; the step then ends every other way a step can: its blocks never
    become findable, and the sequence's later steps register nothing past the gap."""
    c = _early_cache()
    a = c.new_sequence(tokens=range(13))
    step, k = _prefill_layers(c, a, 12, rng, [0])
    assert c.stats()["cached_blocks"] == 0  # one layer of two: not yet
    if ending == "refused":
        with pytest.raises(ValueError):
            step.attend(1, k, k[:, :, :4], k)
    elif ending == "freed":
        c.free(a)
        with pytest.raises(attnx.StaleStepError):
            step.attend(1, k, k, k)
    elif ending == "truncated":
        c.truncate(a, 4)
        with pytest.raises(attnx.StaleStepError):
            step.attend(1, k, k, k)
    elif ending == "stepped again":
        later, _ = _prefill_layers(
            c, a, 1, rng, [0, 1]
        )  # every layer of the next step: still a gap
        with pytest.raises(attnx.StaleStepError):
            step.attend(1, k, k, k)
    elif ending == "same layer twice":
        step.attend(np.int64(0), k, k, k)  # layer 0 again (as a NumPy int): still one layer of two
    assert c.stats()["cached_blocks"] == 0
    assert c.length(c.new_sequence(tokens=range(13))) == 0
    if ending != "freed":
        with pytest.raises(ValueError, match="not written in every layer"):
            c.save(a, os.devnull)
        # rolled back to before the gap and stepped again in every layer, it registers again
        c.truncate(a, 0)
        _, k = _prefill_layers(c, a, 12, rng, [0, 1], tokens=list(range(12)))
        assert c.stats()["cached_blocks"] == 3
        h = c.new_sequence(tokens=range(13))
        assert c.length(h) == 12
        np.testing.assert_array_equal(seq_kv(c, h)["k"][1], k.swapaxes(0, 1))


def test_an_exception_in_the_model_between_layers_registers_nothing(rng):
    c = _early_cache(layers=3)
    a = c.new_sequence(tokens=range(9))

    def model(step, k):
        step.attend(0, k, k, k)
        step.attend(1, k, k, k)
        raise RuntimeError("the model failed between layers")

    with pytest.raises(RuntimeError, match="between layers"):
        model(*_prefill_layers(c, a, 9, rng, []))
    c.free(a)
    assert c.stats()["cached_blocks"] == 0 and c.length(c.new_sequence(tokens=range(9))) == 0


def test_blocks_register_when_the_last_layer_returns_in_any_order(rng):
    c = _early_cache(layers=3)
    a = c.new_sequence(tokens=range(9))
    step, k = _prefill_layers(c, a, 9, rng, [2, 0])
    assert c.stats()["cached_blocks"] == 0
    step.attend(1, k, k, k)
    assert c.stats()["cached_blocks"] == 2
    assert c.length(c.new_sequence(tokens=range(9))) == 8


def test_a_fork_made_mid_step_does_not_count_the_step_written(rng, tmp_path):
    """A fork made between a step's layers (which the docs say not to do) copies the sequence
    as it stands: the step's tokens are not written in every layer for the fork, which therefore
    neither saves them nor registers past them; the step itself still ends and registers."""
    c = _early_cache()
    a = c.new_sequence(tokens=range(9))
    step, k = _prefill_layers(c, a, 9, rng, [0])
    f = c.fork(a)
    step.attend(1, k, k, k)
    assert c.stats()["cached_blocks"] == 2
    with pytest.raises(ValueError, match="not written in every layer"):
        c.save(f, tmp_path / "f")
    assert not (tmp_path / "f").exists()


def test_prefix_caching_refuses_linear_layers():
    with pytest.raises(ValueError, match="prefix_caching.*linear_layers"):
        attnx.PagedKVCache(
            1, 1, 8, num_blocks=4, prefix_caching=True, linear_layers=1, state_shape=(1, 8, 8)
        )


# ---- shared-prefix attention -----------------------------------------------------------------
def shared_tables(rng, groups, singles, block_size, num_blocks_spare=3):
    """Block tables in which each group of sequences shares a leading run of scrambled blocks,
    and, given ``(size, blocks, sub_size, sub_blocks)``, its first ``sub_size`` members share
    ``sub_blocks`` more (nested groups); then each has its own tail. Beside them, sequences
    that share nothing. Returns (tables, seq_lens, num_blocks)."""
    lens, owned = [], []
    next_id = 0
    for size, shared_blocks, *sub in groups:
        sub_size, sub_blocks = sub or (0, 0)
        head = list(range(next_id, next_id + shared_blocks))
        inner = list(range(next_id + shared_blocks, next_id + shared_blocks + sub_blocks))
        next_id += shared_blocks + sub_blocks
        for i in range(size):
            mine = head + (inner if i < sub_size else [])
            tail = int(rng.integers(1, 3 * block_size))
            n_tail = -(-tail // block_size)
            owned.append(mine + list(range(next_id, next_id + n_tail)))
            next_id += n_tail
            lens.append(len(mine) * block_size + tail)
    for n in singles:
        owned.append(list(range(next_id, next_id + -(-n // block_size))))
        next_id += len(owned[-1])
        lens.append(n)
    perm = rng.permutation(next_id + num_blocks_spare)
    width = max(len(o) for o in owned) + 1
    tables = np.full((len(owned), width), 1 << 20, np.int32)  # junk past each sequence's end
    for b, ids in enumerate(owned):
        tables[b, : len(ids)] = perm[ids]
    order = rng.permutation(len(owned))  # interleave the groups with the others
    return tables[order], np.array(lens)[order], next_id + num_blocks_spare


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(2, 2), (4, 2), (8, 1)]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    groups=st.lists(
        st.tuples(st.integers(2, 5), st.integers(1, 4), st.integers(0, 5), st.integers(1, 3)),
        min_size=1,
        max_size=3,
    ),
    singles=st.lists(st.integers(1, 20), max_size=3),
    chunked=st.booleans(),
)
def test_shared_prefix_attention_matches_the_reference(
    seed, block_size, heads, dtype, groups, singles, chunked
):
    old = attnx.ops.cascade.MIN_SAVED_KEYS
    attnx.ops.cascade.MIN_SAVED_KEYS = 0
    try:
        rng = np.random.default_rng(seed)
        hq, hkv = heads
        tables, lens, nb = shared_tables(rng, groups, singles, block_size)
        q_lens = (
            np.minimum(lens, rng.integers(0, 2 * block_size + 2, len(lens)))
            if chunked
            else np.ones(len(lens), np.int64)
        )
        dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
        kp = rng.standard_normal((nb, hkv, block_size, 16)).astype(dt)
        vp = rng.standard_normal((nb, hkv, block_size, 12)).astype(dt)
        q = rng.standard_normal((int(q_lens.sum()), hq, 16)).astype(np.float32)
        args = (q, kp, vp, tables, lens)
        assert attnx.ops.cascade.plan_groups(tables, lens, q_lens, block_size) or chunked
        got, lse = attnx.paged_attention(*args, q_lens=q_lens, return_lse=True)
        want, want_lse = reference.paged_attention(*args, q_lens=q_lens, return_lse=True)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)
        plain = attnx.paged_attention(*args, q_lens=q_lens, shared_prefix=False)
        np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    finally:
        attnx.ops.cascade.MIN_SAVED_KEYS = old


def test_shared_prefix_groups_only_blocks_before_every_query(split_always):
    table = np.array([[5, 6, 7, 1], [5, 6, 7, 2], [5, 6, 9, 3], [8, 0, 0, 0]], np.int32)
    lens = np.array([16, 16, 16, 3])
    g = attnx.ops.cascade.plan_groups(table, lens, np.array([1, 1, 1, 1]), 4)
    assert [r.tolist() for r in g.rows] == [[0, 1, 2], [0, 1]]  # nested: 0 and 1 share block 2 too
    assert g.starts == [0, 2] and g.blocks == [2, 3]
    g = attnx.ops.cascade.plan_groups(
        table[:2], lens[:2], np.array([1, 9]), 4
    )  # 9 queries: block 1 is not before them all
    assert g.blocks == [1] and g.tokens[0].tolist() == list(range(10))
    assert not attnx.ops.cascade.plan_groups(table[:2], lens[:2], np.array([0, 0]), 4)


def test_shared_prefix_out_and_half_precision_queries(rng, split_always):
    tables, lens, nb = shared_tables(rng, [(4, 3)], [5], 4)
    kp = rng.standard_normal((nb, 2, 4, 8)).astype(np.float16)
    vp = rng.standard_normal((nb, 2, 4, 8)).astype(np.float16)
    q = rng.standard_normal((5, 4, 8)).astype(np.float16)
    out = np.zeros((5, 4, 8), np.float16)
    got = attnx.paged_attention(q, kp, vp, tables, lens, out=out)
    assert got is out
    want = reference.paged_attention(q.astype(np.float32), kp, vp, tables, lens)
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2e-3, atol=2e-3)


def test_step_attend_over_forks_and_hits_matches_the_unshared_step(rng, split_always):
    c = attnx.PagedKVCache(2, 2, 16, num_blocks=64, block_size=4, prefix_caching=True)
    a = c.new_sequence(tokens=range(23))
    prefill(c, a, rng)
    seqs = [a] + [c.fork(a) for _ in range(3)] + [c.new_sequence(tokens=list(range(21)) + [5, 5])]
    prefill(c, seqs[-1], rng)  # a prefix hit on a's first 5 blocks, its own tail
    other = c.new_sequence(tokens=[9] * 7)
    prefill(c, other, rng)
    seqs.append(other)
    counts = [1, 1, 2, 1, 1, 3]
    for shared in (True, False):
        step = c.begin_step(seqs, counts, tokens=[[1] * n for n in counts])
        assert step.shared_prefix == [(seqs[:5], 0, 5)]  # (the forks copied block 5 on write)
        q = rng.standard_normal((sum(counts), 8, 16)).astype(np.float32)
        k = rng.standard_normal((sum(counts), 2, 16)).astype(np.float32)
        got = step.attend(0, q, k, k, shared_prefix=shared, return_lse=True)
        at = 0
        for s, n in zip(seqs, counts):
            kv = seq_kv(c, s)
            want = reference.attention(
                q[at : at + n],
                kv["k"][0].swapaxes(0, 1),
                kv["v"][0].swapaxes(0, 1),
                causal=True,
                layout="bshd",
                return_lse=True,
            )
            np.testing.assert_allclose(got[0][at : at + n], want[0], rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(got[1][at : at + n], want[1].T, rtol=2e-5, atol=2e-5)
            at += n
        for s, n in zip(seqs, counts):
            c.truncate(s, c.length(s) - n)


def test_shared_prefix_is_off_where_it_cannot_split(rng, split_always):
    tables, lens, nb = shared_tables(rng, [(3, 2)], [], 4)
    kp = rng.standard_normal((nb, 1, 4, 8)).astype(np.float32)
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    for kw in (
        {"window": (5, None)},
        {"alibi_slopes": np.ones(2, np.float32)},
        {"sinks": np.zeros(2, np.float32)},
    ):
        got = attnx.paged_attention(q, kp, kp, tables, lens, **kw)
        want = reference.paged_attention(q, kp, kp, tables, lens, **kw)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# ---- sessions --------------------------------------------------------------------------------
@needs_safetensors
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("value_from_key", [False, True])
def test_session_round_trip_is_bit_exact_across_block_sizes(tmp_path, rng, dtype, value_from_key):
    kw = dict(value_dim=4) if value_from_key else {}
    c = attnx.PagedKVCache(
        2, 2, 8, num_blocks=16, block_size=4, dtype=dtype, value_from_key=value_from_key, **kw
    )
    a = c.new_sequence(tokens=range(11))
    step = c.begin_step([a], [11])
    for layer in range(2):
        k = rng.standard_normal((11, 2, 8)).astype(np.float32)
        step.attend(
            layer,
            rng.standard_normal((11, 2, 8)).astype(np.float32),
            k,
            None if value_from_key else k[..., :8] * 2,
        )
    path = tmp_path / "s.safetensors"
    c.save(a, path, meta={"model": "m", "turn": 3})
    d = attnx.PagedKVCache(
        2,
        2,
        8,
        num_blocks=8,
        block_size=16,
        dtype=dtype,
        value_from_key=value_from_key,
        prefix_caching=True,
        **kw,
    )
    b = d.load(path, expect={"model": "m"})
    assert d.length(b) == 11 and d._seqs[b].tokens.tolist() == list(range(11))
    want, got = seq_kv(c, a), seq_kv(d, b)  # (a quantised cache's scale pages too)
    assert ("k_scales" in want) == (dtype in ("int8", "float8_e4m3fn"))
    assert set(want) == set(got) and all(np.array_equal(bits(want[n]), bits(got[n])) for n in want)
    assert list(os.listdir(tmp_path)) == ["s.safetensors"]  # no temporary file left


@needs_safetensors
def test_loaded_session_feeds_the_prefix_cache(tmp_path, rng):
    c = make_cache()
    a = c.new_sequence(tokens=range(9), extra_key="img-1")
    prefill(c, a, rng)
    c.save(a, tmp_path / "s")
    d = make_cache()
    d.load(tmp_path / "s")
    assert d.length(d.new_sequence(tokens=range(12), extra_key="img-1")) == 8
    assert d.length(d.new_sequence(tokens=range(12))) == 0  # the extra key came with the file


@pytest.fixture
def saved(tmp_path, rng):
    c = make_cache()
    a = c.new_sequence(tokens=range(10))
    prefill(c, a, rng)
    path = tmp_path / "s.safetensors"
    c.save(a, path, meta={"model": "smol"})
    return c, path


def _refused(cache, path, match, exc=attnx.SessionError, **kw):
    before = cache_state(cache)
    with pytest.raises(exc, match=match):
        cache.load(path, **kw)
    assert cache_state(cache) == before


@needs_safetensors
@pytest.mark.parametrize("where", ["tensor", "header", "length"])
def test_corrupted_or_truncated_sessions_are_refused(saved, where):
    c, path = saved
    data = bytearray(path.read_bytes())
    if where == "tensor":
        data[-3] ^= 0x10
        match = "checksum"
    elif where == "header":
        i = data.index(b"smol")
        data[i : i + 4] = b"smoL"
        match = "checksum"
    else:
        data = data[: len(data) - 40]
        match = "truncated or corrupted"
    path.write_bytes(bytes(data))
    _refused(c, path, match)


@needs_safetensors
def test_files_that_are_no_session_are_refused(saved, tmp_path):
    import safetensors.numpy

    c, _ = saved
    (tmp_path / "junk").write_bytes(b"not a safetensors file at all")
    _refused(c, tmp_path / "junk", "not a readable safetensors file")
    safetensors.numpy.save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other"))
    _refused(c, tmp_path / "other", "not an attnx session")


@needs_safetensors
def test_mismatched_sessions_and_small_pools_are_refused(saved, rng):
    c, path = saved
    _refused(
        c, path, "another model.*model: file 'smol', expected 'llama'", expect={"model": "llama"}
    )
    _refused(c, path, "<missing>", expect={"revision": 2})
    for other in (
        make_cache(dtype="float16"),
        attnx.PagedKVCache(2, 2, 16, num_blocks=8, block_size=4),
        attnx.PagedKVCache(3, 2, 8, num_blocks=8, block_size=4),
    ):
        _refused(other, path, "another cache geometry")
    tiny = make_cache(num_blocks=2)
    _refused(tiny, path, "needs 3 free blocks", exc=attnx.CacheFullError)


@needs_safetensors
def test_save_is_atomic_and_checks_its_arguments(saved, rng):
    c, path = saved
    a = c.sequences[0]
    old = path.read_bytes()
    with pytest.raises(TypeError, match="meta"):
        c.save(a, path, meta={"x": object()})
    with pytest.raises(ValueError, match="tokens"):
        c.save(a, path, tokens=[1, 2])
    assert path.read_bytes() == old and os.listdir(path.parent) == [path.name]
    c.save(a, path, meta={"model": "other"})  # replaces the file whole
    assert c.length(c.load(path, expect={"model": "other"})) == 10
    w = make_cache(sliding_window=4)
    s = w.new_sequence()
    for _ in range(4):
        prefill(w, s, rng, 4, [0] * 4)
    with pytest.raises(ValueError, match="sliding window"):
        w.save(s, path)


def test_more_queries_than_shared_keys_and_groups_without_queries(rng, split_always):
    """9 forks of a one-block prefix (the paged kernel takes at most as many queries as keys per
    sequence: the shared part is read in chunks), and a group whose sequences add no query."""
    tables, lens, nb = shared_tables(rng, [(9, 1), (2, 2)], [3], 4)
    kp = rng.standard_normal((nb, 1, 4, 8)).astype(np.float32)
    vp = rng.standard_normal((nb, 1, 4, 8)).astype(np.float32)
    members = (tables[:, 0][:, None] == tables[:, 0][None]).sum(axis=1)  # size of each row's group
    q_lens = np.where(members == 2, 0, 1)
    groups = attnx.ops.cascade.plan_groups(tables, lens, q_lens, 4)
    assert [len(r) for r in groups.rows] == [9] and groups.blocks == [1]
    q = rng.standard_normal((int(q_lens.sum()), 2, 8)).astype(np.float32)
    got = attnx.paged_attention(q, kp, vp, tables, lens, q_lens=q_lens)
    want = reference.paged_attention(q, kp, vp, tables, lens, q_lens=q_lens)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@needs_safetensors
def test_an_empty_sequence_round_trips(tmp_path):
    c = make_cache()
    a = c.new_sequence()
    c.save(a, tmp_path / "empty")
    b = c.load(tmp_path / "empty")
    assert c.length(b) == 0 and c.block_table(b).tolist() == []
    assert attnx.session_info(tmp_path / "empty")["length"] == 0


@pytest.mark.parametrize("kw", [dict(value_from_key=True, value_dim=12), dict(dtype="bfloat16")])
def test_step_attend_shared_with_latent_values_and_bf16(rng, split_always, kw):
    c = attnx.PagedKVCache(1, 1, 16, num_blocks=32, block_size=4, **kw)
    a = c.new_sequence()
    step = c.begin_step([a], [13])
    k = rng.standard_normal((13, 1, 16)).astype(np.float32)
    step.attend(
        0,
        rng.standard_normal((13, 4, 16)).astype(np.float32),
        k,
        None if c.value_from_key else k * 2,
    )
    seqs = [a] + [c.fork(a) for _ in range(3)]
    outs = []
    for shared in (True, False):
        step = c.begin_step(seqs, [1] * 4)
        assert step.shared_prefix == [(seqs, 0, 3)]
        q = (
            np.random.default_rng(1)
            .standard_normal((4, 4, 16))
            .astype(BF16 if "dtype" in kw else np.float32)
        )
        k = np.random.default_rng(2).standard_normal((4, 1, 16)).astype(np.float32)
        outs.append(step.attend(0, q, k, None if c.value_from_key else k * 2, shared_prefix=shared))
        for s in seqs:
            c.truncate(s, 13)
    assert outs[0].dtype == outs[1].dtype
    tol = 1e-2 if "dtype" in kw else 2e-5  # (bf16 queries: bf16 outputs, rounded apart)
    np.testing.assert_allclose(
        outs[0].astype(np.float32), outs[1].astype(np.float32), rtol=tol, atol=tol
    )


# ---- hostile session files (issue 31) -----------------------------------------------------------
def _raw_safetensors(tensors, metadata, header_text=None):
    """safetensors bytes written by hand, so that the metadata may be anything (the library
    writes strings only): ``tensors`` by name, ``metadata`` any JSON value (or the header's
    whole text given as ``header_text``)."""
    header, blobs, at = {}, [], 0
    names = {
        np.dtype(np.float32): "F32",
        np.dtype(np.float16): "F16",
        np.dtype(np.uint16): "U16",
        np.dtype(np.uint8): "U8",
        np.dtype(np.uint32): "U32",
        np.dtype(np.float64): "F64",
    }
    for name, t in tensors.items():
        b = np.ascontiguousarray(t).tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + len(b)],
        }
        blobs.append(b)
        at += len(b)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = (header_text if header_text is not None else json.dumps(header)).encode(
        "utf-8", "surrogatepass"
    )
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def _forge(path, header, tensors, checksum=True):
    """A session file with the attnx ``header`` (a dict, or the JSON text itself) and a
    checksum a forger computes as attnx does (or ``checksum=False``: a wrong one)."""
    import attnx.cache.session as sess

    text = header if isinstance(header, str) else json.dumps(header)
    stored = {n: sess._stored(t) for n, t in tensors.items()}
    digest = sess._checksum(text, stored) if checksum else "0" * 64
    path.write_bytes(_raw_safetensors(stored, {"attnx": text, "attnx.checksum": digest}))
    return path


@pytest.fixture
def parts(saved):
    """A saved session's attnx header (dict) and tensors, to forge variants of."""
    import safetensors.numpy

    c, path = saved
    data = path.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    return c, path, json.loads(meta["attnx"]), safetensors.numpy.load(data)


def _refused_everywhere(cache, path, match=None):
    """load and session_info both raise SessionError (matching ``match``); the cache is unchanged."""
    _refused(cache, path, match)
    with pytest.raises(attnx.SessionError, match=match):
        attnx.session_info(path)


@needs_safetensors
def test_a_forged_file_with_a_valid_checksum_loads(parts, tmp_path):
    """The forging helpers make loadable files: the refusals below are the fields' doing."""
    c, _, header, tensors = parts
    path = _forge(tmp_path / "f", header, tensors)
    assert c.length(c.load(path)) == 10 and attnx.session_info(path)["length"] == 10


@needs_safetensors
@pytest.mark.parametrize(
    "metadata",
    [
        "attnx-not-a-dict",
        ["attnx"],
        {"attnx": {"format": "attnx-kv-session/1"}, "attnx.checksum": "0" * 64},
        {"attnx": ["x"], "attnx.checksum": "0" * 64},
        {"attnx": 1, "attnx.checksum": "0" * 64},
        {"attnx": None, "attnx.checksum": "0" * 64},
        {"attnx": "{}", "attnx.checksum": 7},
        {"attnx": "{}", "attnx.checksum": None},
        {"attnx": "{}"},
        {"attnx.checksum": "0" * 64},
    ],
)
def test_metadata_that_is_not_strings_is_refused(parts, tmp_path, metadata):
    c, _, _, tensors = parts
    path = tmp_path / "f"
    path.write_bytes(_raw_safetensors(tensors, metadata))
    _refused_everywhere(c, path)


@needs_safetensors
@pytest.mark.parametrize("where", ["outer", "attnx", "meta", "meta-expected"])
@pytest.mark.parametrize("depth", [900, 100_000])
def test_deeply_nested_headers_are_refused(parts, tmp_path, where, depth):
    """Nesting past the JSON parser's recursion limit (and just under it, where later steps
    could recurse further) in the safetensors header, in the attnx header and in ``meta``."""
    c, _, header, tensors = parts
    deep = "[" * depth + "]" * depth
    path = tmp_path / "f"
    if where == "outer":
        stored = dict(tensors.items())
        text = (
            json.dumps({"__metadata__": {"attnx": "{}", "attnx.checksum": "0"}})[:-1]
            + ', "x": '
            + deep
            + "}"
        )
        path.write_bytes(_raw_safetensors(stored, None, header_text=text))
    elif where == "attnx":
        _forge(path, deep, tensors)
    else:
        text = json.dumps(dict(header, meta="@"))
        _forge(path, text.replace('"@"', '{"model": ' + deep + "}"), tensors)
    if where == "meta" and depth == 900:  # parses: as meta, it only has to load (or be refused)
        try:
            c.free(c.load(path))
        except attnx.SessionError:
            pass
        return
    if where == "meta-expected" and depth == 900:
        _refused(c, path, None, expect={"model": "smol"})
        return
    _refused_everywhere(c, path, "nested too deeply" if depth > 10_000 else None)


def _wrong_tokens(value):
    """Token lists of the wrong type, length or range for a header whose tokens are ``value``."""
    return [
        1,
        "0 1 2",
        {},
        [[0]] * 10,
        [float(t) for t in value],
        [str(t) for t in value],
        [bool(t % 2) for t in value],
        value[:-1],
        value + [0],
        [2**63] + value[1:],
        [-(2**63) - 1] + value[1:],
        [None] * 10,
    ]


def _wrong_values(field, value):
    """Values of the wrong type (or range) for a header field whose right value is ``value``."""
    others = [None, True, False, 0, 1, -1, 1.0, 2.5, "", "1", [], [1], {}, {"a": 1}]
    if field == "tokens":
        return _wrong_tokens(value)
    if field == "linear_layers":  # (written by hybrid caches only)
        return [True, 1.0, "0", -1, None, [], 2]
    if field == "state_shape":
        return [
            1,
            "x",
            [],
            [1, 2],
            [1, 2, 3.0],
            [True, 1, 1],
            [0, 1, 1],
            [1, 1, 1, 1],
            {},
            [2, 4, 4],
        ]
    if field == "root":
        return [v for v in others if v != ""] + [
            "00" * 31,
            "00" * 33,
            value.upper(),
            "zz" * 32,
            " " + value[1:],
            value[:-2] + "\u00e9\u00e9",
        ]
    if field == "length":
        return [v for v in others if type(v) is not int] + [-1, 10.0]
    if field == "value_from_key":
        return [v for v in others if type(v) is not bool]
    if isinstance(value, int):
        return [v for v in others if type(v) is not int] + [float(value), bool(value), str(value)]
    return [v for v in others if type(v) is not str]


@needs_safetensors
@pytest.mark.parametrize(
    "field",
    [
        "format",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "value_dim",
        "dtype",
        "value_from_key",
        "length",
        "root",
        "tokens",
        "linear_layers",
        "state_shape",
    ],
)
def test_every_header_field_of_a_wrong_type_is_refused(parts, tmp_path, field):
    """A forger's file (valid checksum): every field of a wrong type, out of range or missing is
    refused by load and session_info alike, the cache unchanged; token ids that are floats,
    strings or bools never reach the prefix cache."""
    c, _, header, tensors = parts
    for i, bad in enumerate(_wrong_values(field, header.get(field)) + ["<missing>"]):
        forged = {k: v for k, v in header.items() if k != field}
        if bad != "<missing>":
            forged[field] = bad
        elif field in ("tokens", "linear_layers", "state_shape"):
            continue  # (valid without: no token ids to register, no linear layers)
        path = _forge(tmp_path / f"{field}{i}", forged, tensors)
        if field in ("linear_layers", "state_shape") and bad in (2, [2, 4, 4]):
            _refused(c, path, "another cache geometry")  # (well-formed: only a load compares)
        else:
            _refused_everywhere(c, path)


@needs_safetensors
def test_nan_surrogates_and_wrong_tensor_dtypes_are_refused(parts, tmp_path):
    c, _, header, tensors = parts
    text = json.dumps(dict(header, meta="@")).replace('"@"', '{"model": NaN}')
    _refused_everywhere(c, _forge(tmp_path / "nan", text, tensors), "corrupted")
    text = json.dumps(dict(header, meta="\ud800"))  # a lone surrogate (an escape in JSON)
    path = tmp_path / "surrogate"
    path.write_bytes(_raw_safetensors(tensors, {"attnx": text, "attnx.checksum": "0" * 64}))
    _refused(c, path, "checksum")
    for name, t in [
        ("k", tensors["k"].view(np.int32)),
        ("k", tensors["k"].astype(np.float64)),
        ("v", tensors["v"].astype(np.float16)),
        ("v", tensors["v"][..., :4]),
    ]:
        _refused(c, _forge(tmp_path / "t", header, dict(tensors, **{name: t})), f"tensor '{name}'")


@needs_safetensors
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_fuzzed_session_headers_raise_only_session_error(tmp_path_factory, data):
    """Any JSON in any field (a forger's checksum), or a flipped byte anywhere in the header:
    load gives a correct sequence or SessionError with the cache unchanged; session_info a dict
    or SessionError. Nothing else escapes."""
    rng = np.random.default_rng(0)
    c = make_cache()
    a = c.new_sequence(tokens=range(6))
    prefill(c, a, rng)
    tmp = tmp_path_factory.mktemp("fuzz")
    c.save(a, tmp / "s", meta={"model": "smol"})
    want = seq_kv(c, a)
    raw = (tmp / "s").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["attnx"])
    tensors = dict(__import__("safetensors.numpy").numpy.load(raw).items())
    values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False)
        | st.text(max_size=8),
        lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=3), x, max_size=3),
        max_leaves=8,
    )
    how = data.draw(st.sampled_from(["field", "flip"]))
    path = tmp / "f"
    if how == "field":
        field = data.draw(st.sampled_from(sorted(header) + ["unknown"]))
        near = (
            _wrong_values(field, header[field]) if field in header and field != "meta" else [None]
        )
        forged = dict(header, **{field: data.draw(values | st.sampled_from(near))})
        _forge(path, forged, tensors)
    else:
        at = data.draw(st.integers(0, 8 + n - 1))
        path.write_bytes(
            raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]
        )
    before = cache_state(c)
    try:
        b = c.load(path, expect={"model": "smol"})
    except attnx.SessionError:
        assert cache_state(c) == before
    else:  # a forged field loads only where it is harmless: meta, an unknown field, the same value
        if how == "field":
            assert (
                field in ("meta", "unknown")
                or json.dumps(forged[field]) == json.dumps(header[field])
                or (field == "tokens" and forged[field] is None)
            )  # (a file may hold no token ids)
        got = seq_kv(c, b)
        assert all(np.array_equal(bits(want[k]), bits(got[k])) for k in want)
        assert c._seqs[b].tokens is None or c._seqs[b].tokens.dtype == np.int64
        c.free(b)
    try:
        assert isinstance(attnx.session_info(path), dict)
    except attnx.SessionError:
        pass


@needs_safetensors
def test_save_follows_a_symlink_and_paths_may_be_bytes(saved, tmp_path):
    c, path = saved
    a = c.sequences[0]
    target = tmp_path / "real.safetensors"
    link = tmp_path / "link.safetensors"
    target.write_bytes(b"old")
    link.symlink_to(target)
    c.save(a, link, meta={"model": "via link"})
    assert link.is_symlink() and os.readlink(link) == str(target)  # the link stays
    assert attnx.session_info(target)["meta"] == {"model": "via link"}  # its target was written
    assert sorted(os.listdir(tmp_path)) == ["link.safetensors", "real.safetensors", "s.safetensors"]
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "new.safetensors")
    c.save(a, dangling)  # as open() does: the target is created
    assert dangling.is_symlink() and (tmp_path / "new.safetensors").is_file()
    raw = os.fsencode(tmp_path / "b.safetensors")
    c.save(a, raw, meta={"model": "bytes"})
    assert attnx.session_info(raw)["meta"] == {"model": "bytes"}
    assert c.length(c.load(raw, expect={"model": "bytes"})) == 10
    for bad in (3, 1.5, None, ["x"]):
        with pytest.raises(TypeError, match="path"):
            c.save(a, bad)
        with pytest.raises(TypeError, match="path"):
            c.load(bad)
        with pytest.raises(TypeError, match="path"):
            attnx.session_info(bad)


@needs_safetensors
def test_a_hybrid_session_keeps_its_recurrent_states(tmp_path, rng):
    """A hybrid cache's session holds each linear layer's state beside the K/V: the loaded
    sequence continues exactly as the saved one. A step not run in every layer (attention and
    linear) is not saved, and a file loads only into a cache with the same linear layers."""

    def hybrid(block_size=4):
        return attnx.PagedKVCache(
            2, 1, 8, num_blocks=16, block_size=block_size, linear_layers=2, state_shape=(2, 4, 4)
        )

    def step(c, seqs, n, seed, linear=(0, 1)):
        r = np.random.default_rng(seed)
        st_ = c.begin_step(seqs, [n] * len(seqs))
        T = n * len(seqs)
        x = r.standard_normal((T, 1, 8)).astype(np.float32)
        outs = [
            st_.attend(layer, r.standard_normal((T, 2, 8)).astype(np.float32), x, x)
            for layer in (0, 1)
        ]
        q = r.standard_normal((T, 1, 4)).astype(np.float32)
        g = -r.random((T, 2)).astype(np.float32)
        beta = r.random((T, 2)).astype(np.float32)
        v = r.standard_normal((T, 2, 4)).astype(np.float32)
        outs += [st_.linear(layer, q, q, v, g, beta) for layer in linear]
        return outs

    c = hybrid()
    a = c.new_sequence()
    step(c, [a], 7, 1)
    c.save(a, tmp_path / "h")
    d = hybrid(block_size=8)
    b = d.load(tmp_path / "h")
    np.testing.assert_array_equal(d._seqs[b].state, c._seqs[a].state)
    for got, want in zip(step(d, [b], 3, 2), step(c, [a], 3, 2)):
        np.testing.assert_array_equal(got, want)
    step(c, [a], 2, 3, linear=(0,))  # linear layer 1 never ran: the step did not end
    with pytest.raises(ValueError, match="not written in every layer"):
        c.save(a, tmp_path / "h")
    _refused(make_cache(), tmp_path / "h", "linear_layers: file 2, cache 0")
    plain = attnx.PagedKVCache(2, 1, 8, num_blocks=16, block_size=4)
    p = plain.new_sequence()
    st_ = plain.begin_step([p], [3])
    x = np.ones((3, 1, 8), np.float32)
    for layer in (0, 1):
        st_.attend(layer, x, x, x)
    plain.save(p, tmp_path / "plain")
    assert "linear_layers" not in attnx.session_info(tmp_path / "plain")  # (files as before)
    _refused(hybrid(), tmp_path / "plain", "linear_layers: file 0, cache 2")
