"""The cascade (shared-prefix) step against the unshared one: random fork trees (a prompt, forks of
it, forks of forks, each grown by its own tokens), every kv dtype, GQA ratios, one or several
queries per sequence and several threads. The shared step (groups planned once per step by the
core, every layer reusing them) must equal the plain step within float32 rounding, layer by layer.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
import attnx.ops.cascade
from attnx import _core

from helpers import threads_here

KV_DTYPES = ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"]


@pytest.fixture(autouse=True)
def split_always(monkeypatch):
    monkeypatch.setattr(attnx.ops.cascade, "MIN_SAVED_KEYS", 0)


def grow(cache, seqs, counts, rng, hkv, d, layers):
    """One step appending counts[i] random tokens to seqs[i] in every layer."""
    step = cache.begin_step(seqs, counts)
    kv = rng.standard_normal((step.num_tokens, hkv, d)).astype(np.float32)
    for layer in range(layers):
        step.attend(
            layer, np.zeros((step.num_tokens, hkv, d), np.float32), kv, kv, shared_prefix=False
        )


def fork_tree(cache, rng, shape, hkv, d, layers):
    """A prompt, then for each (forks, extra) of `shape` in turn: every current leaf forked
    `forks` times, each child grown by 1..extra tokens. Returns the leaves."""
    root = cache.new_sequence()
    grow(cache, [root], [int(rng.integers(1, 40))], rng, hkv, d, layers)
    leaves = [root]
    for forks, extra in shape:
        leaves = [s if i == 0 else cache.fork(s) for s in leaves for i in range(forks)]
        grow(cache, leaves, [int(rng.integers(1, extra + 1)) for _ in leaves], rng, hkv, d, layers)
    return leaves


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(KV_DTYPES),
    heads=st.sampled_from([(2, 2), (4, 2), (8, 1), (6, 3)]),
    block_size=st.sampled_from([1, 4, 16]),
    shape=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 20)), min_size=1, max_size=3),
    max_new=st.integers(1, 3),
    threads=st.sampled_from([1, 3]),
    q_dtype=st.sampled_from(["float32", "float16"]),
)
def test_shared_step_matches_the_unshared_step(
    seed, dtype, heads, block_size, shape, max_new, threads, q_dtype
):
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    d, layers = 16, 2
    cache = attnx.PagedKVCache(layers, hkv, d, num_blocks=512, block_size=block_size, dtype=dtype)
    leaves = fork_tree(cache, rng, shape, hkv, d, layers)
    counts = [int(rng.integers(1, max_new + 1)) for _ in leaves]
    step = cache.begin_step(leaves, counts)
    groups = step.shared_prefix
    # the core plans the groups the step reads: the Python view is the same plan
    assert groups == [
        ([step.seq_ids[i] for i in rows], a, b)
        for rows, a, b in _core.plan_cascade(
            step.block_tables, step.seq_lens, step.q_lens, block_size, 0
        )
    ]
    for layer in range(layers):
        q = rng.standard_normal((step.num_tokens, hq, d)).astype(q_dtype)
        kv = rng.standard_normal((step.num_tokens, hkv, d)).astype(np.float32)
        got, lse = step.attend(layer, q, kv, kv, return_lse=True, num_threads=threads)
        want, want_lse = step.attend(
            layer, q, kv, kv, return_lse=True, num_threads=threads, shared_prefix=False
        )
        assert got.dtype == want.dtype == np.dtype(q_dtype)
        tol = 2e-5 if q_dtype == "float32" else 2e-3  # float16 outputs: one rounding each
        np.testing.assert_allclose(
            got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol
        )
        np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_a_deep_fork_tree_is_planned_level_by_level():
    """A prompt forked into 2 conversations, each forked 3 times: the groups nest, and the
    step reads them (its result equals the plain step's)."""
    rng = np.random.default_rng(7)
    cache = attnx.PagedKVCache(1, 2, 16, num_blocks=256, block_size=4, dtype="float16")
    leaves = fork_tree(cache, rng, [(2, 12), (3, 12)], 2, 16, 1)
    step = cache.begin_step(leaves, [1] * len(leaves))
    groups = step.shared_prefix
    assert len(groups[0][0]) == 6 and groups[0][1] == 0
    assert sorted(len(g[0]) for g in groups[1:]) == [3, 3] and all(
        g[1] == groups[0][2] for g in groups[1:]
    )
    q = rng.standard_normal((6, 4, 16)).astype(np.float32)
    kv = rng.standard_normal((6, 2, 16)).astype(np.float32)
    got = step.attend(0, q, kv, kv)
    want = step.attend(0, q, kv, kv, shared_prefix=False)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_levels_and_tails_share_one_team(threads, dtype):
    """Big enough that the shared levels run on a team (a prompt of ~600 tokens, forked twice and
    each fork again four times, one or two new tokens each): the core runs the two levels and the
    tails as stages of one region, the tails' short rows shared out over the team the levels woke.
    The result equals the plain step's at every thread count."""
    threads = threads_here(threads)
    rng = np.random.default_rng(11)
    cache = attnx.PagedKVCache(1, 2, 64, num_blocks=1024, block_size=16, dtype=dtype)
    root = cache.new_sequence()
    grow(cache, [root], [600], rng, 2, 64, 1)
    mids = [root, cache.fork(root)]
    grow(cache, mids, [40, 56], rng, 2, 64, 1)
    leaves = [s if i == 0 else cache.fork(s) for s in mids for i in range(4)]
    counts = [1 + i % 2 for i in range(len(leaves))]
    step = cache.begin_step(leaves, counts)
    assert max(len(g[0]) for g in step.shared_prefix) == 8 and len(step.shared_prefix) == 3
    q = rng.standard_normal((step.num_tokens, 8, 64)).astype(np.float32)
    kv = rng.standard_normal((step.num_tokens, 2, 64)).astype(np.float32)
    got, lse = step.attend(0, q, kv, kv, return_lse=True, num_threads=threads)
    want, want_lse = step.attend(
        0, q, kv, kv, return_lse=True, num_threads=threads, shared_prefix=False
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)


def test_a_step_plans_its_groups_once(monkeypatch):
    """The groups are planned when the step first attends and reused by every layer: a later
    change of the policy does not change this step's plan (but does the next step's)."""
    rng = np.random.default_rng(3)
    cache = attnx.PagedKVCache(2, 1, 16, num_blocks=64, block_size=4)
    leaves = fork_tree(cache, rng, [(4, 3)], 1, 16, 2)
    step = cache.begin_step(leaves, [1] * 4)
    q = rng.standard_normal((4, 1, 16)).astype(np.float32)
    step.attend(0, q, q, q)
    plan = step._step_plan
    monkeypatch.setattr(attnx.ops.cascade, "MIN_SAVED_KEYS", 10**9)
    step.attend(1, q, q, q)
    assert step._step_plan is plan


def test_plan_cascade_checks_its_arguments():
    with pytest.raises(ValueError, match="block_tables"):
        _core.plan_cascade(np.zeros(4, np.int32), np.ones(4, np.int32), np.ones(4, np.int32), 4, 0)
    with pytest.raises(ValueError, match="seq_lens"):
        _core.plan_cascade(
            np.zeros((4, 2), np.int32), np.ones(3, np.int32), np.ones(4, np.int32), 4, 0
        )
    with pytest.raises(ValueError, match="block_size"):
        _core.plan_cascade(
            np.zeros((4, 2), np.int32), np.ones(4, np.int32), np.ones(4, np.int32), 0, 0
        )
    with pytest.raises(ValueError, match="q_lens"):
        _core.plan_cascade(
            np.zeros((2, 2), np.int32), np.ones(2, np.int32), -np.ones(2, np.int32), 4, 0
        )


@pytest.mark.parametrize("nested", [False, True])
def test_values_near_the_largest_float_merge_without_overflow(isa, nested):
    """Every value 3e38 and two keys of each row weighing alike (one shared, one its own): the
    mean is 3e38. The shared part is merged into each row by its share of the row's sum
    (row::merge_shares), where adding the two unnormalised sums gave inf; as the plain path and
    the reference. Nested: a group within a group, each merged the same way."""
    bs, d, shared = 4, 8, 8  # blocks of the shared prompt
    own = 2 if nested else 0  # blocks shared by the inner group only
    nb = shared + own + 3
    kp = np.zeros((nb, 1, bs, d), np.float32)
    kp[..., 0] = -1e4  # negligible weight for all but the keys below
    kp[0, 0, 0, 0] = 0.0  # the shared prompt's first key
    kp[shared + own :, 0, 0, 0] = 0.0  # each sequence's own key
    vp = np.full((nb, 1, bs, d), 3e38, np.float32)
    prompt = list(range(shared))
    inner = list(range(shared, shared + own))
    tables = [prompt + inner + [shared + own], prompt + inner + [shared + own + 1]]
    tables.append(prompt + [shared + own + 2] + [0] * own)
    seq = np.array([(shared + own) * bs + 1] * 2 + [shared * bs + 1], np.int32)
    bt = np.array(tables, np.int32)
    q = np.zeros((3, 1, d), np.float32)
    q[..., 0] = 1.0
    got, lse = attnx.paged_attention(q, kp, vp, bt, seq, return_lse=True)
    plain = attnx.paged_attention(q, kp, vp, bt, seq, shared_prefix=False)
    want, want_lse = attnx.reference.paged_attention(q, kp, vp, bt, seq, return_lse=True)
    assert np.isfinite(got).all() and np.isfinite(plain).all()
    np.testing.assert_allclose(got, want, rtol=2e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6, atol=2e-6)
