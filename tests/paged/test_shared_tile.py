"""The many-query tile over float16 keys (what a shared prefix's stacked queries run, and fp16
prefill): K rows are widened inside the transpose that packs them, 8 rows at a time, and the next
tile's K and V are prefetched while the current one is computed. These check the edges of that
path against the float64 reference: feature widths that are multiples of 8 but not of a register
block (40, 136), tiles that end mid-way through 8 rows, and pages scrambled through the table.
Then the paged call's prior parts (prior_out, prior_lse), which merge a shared prefix's part into
the tails' call: equal to attnx.merge_attention of the two, and checked arguments."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
import attnx.ops.cascade
from attnx import reference

from helpers import make_rng

# Keys stored as float16 are exact in float32, so the kernel matches the reference to float32
# rounding, as the shared-prefix tests ask.
TOL = dict(rtol=2e-5, atol=2e-5)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dk=st.sampled_from([8, 40, 64, 136]),
    sq=st.integers(9, 40),
    sk=st.integers(1, 203),
    causal=st.booleans(),
    heads=st.sampled_from([(1, 1), (4, 2)]),
)
def test_many_query_fp16_tile_matches_the_reference(seed, dk, sq, sk, causal, heads):
    rng = make_rng(seed)
    hq, hkv = heads
    sq = min(sq, sk) if causal else sq
    q = rng.standard_normal((1, hq, sq, dk)).astype(np.float16)
    k = rng.standard_normal((1, hkv, sk, dk)).astype(np.float16)
    v = rng.standard_normal((1, hkv, sk, 24)).astype(np.float16)
    got, lse = attnx.attention(q, k, v, causal=causal, return_lse=True)
    want, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    # the lse is float32 from exact inputs; the output is rounded to float16 once
    np.testing.assert_allclose(lse, want_lse, **TOL)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dk=st.sampled_from([40, 128, 136]),
    forks=st.integers(9, 20),
    blocks=st.integers(1, 9),
    block_size=st.sampled_from([4, 16]),
    tails=st.lists(st.integers(1, 20), min_size=20, max_size=20),
)
def test_forks_over_fp16_pages_match_the_unshared_step(seed, dk, forks, blocks, block_size, tails):
    """Many forks of one prompt (more stacked queries than the dot path takes) with tails of
    different lengths, on scrambled fp16 pages: the shared step equals the plain one and the
    reference."""
    rng = make_rng(seed)
    shared = blocks * block_size
    lens = shared + np.array(tails[:forks])
    own = -(-(lens - shared) // block_size)
    nb = blocks + int(own.sum()) + 3
    perm = rng.permutation(nb).astype(np.int32)
    width = blocks + int(own.max())
    tables = np.full((forks, width), nb + 7, np.int32)  # junk past each sequence's end
    nxt = blocks
    for b in range(forks):
        tables[b, :blocks] = perm[:blocks]
        tables[b, blocks : blocks + own[b]] = perm[nxt : nxt + own[b]]
        nxt += own[b]
    kp = rng.standard_normal((nb, 2, block_size, dk)).astype(np.float16)
    vp = rng.standard_normal((nb, 2, block_size, 32)).astype(np.float16)
    q = rng.standard_normal((forks, 2, dk)).astype(np.float32)
    old = attnx.ops.cascade.MIN_SAVED_KEYS
    attnx.ops.cascade.MIN_SAVED_KEYS = 0
    try:
        assert attnx.ops.cascade.plan_groups(tables, lens, np.ones(forks, np.int64), block_size)
        got, lse = attnx.paged_attention(q, kp, vp, tables, lens, return_lse=True)
    finally:
        attnx.ops.cascade.MIN_SAVED_KEYS = old
    plain = attnx.paged_attention(q, kp, vp, tables, lens, shared_prefix=False)
    want, want_lse = reference.paged_attention(q, kp, vp, tables, lens, return_lse=True)
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)


def _prior(rng, n, hq, dv, dead, poison):
    """A finished part per query row: some rows saw no key (lse -inf, output junk that must not
    leak), some saw a NaN (lse NaN)."""
    out = rng.standard_normal((n, hq, dv)).astype(np.float32)
    lse = rng.standard_normal((n, hq)).astype(np.float32) * 3
    lse[dead] = -np.inf
    out[dead] = np.inf
    lse[poison] = np.nan
    return out, lse


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lens=st.lists(st.integers(0, 700), min_size=1, max_size=4),
    dtype=st.sampled_from(["float32", "float16"]),
    threads=st.sampled_from([1, 2]),
    heads=st.sampled_from([(2, 2), (4, 1)]),
)
def test_prior_parts_merge_in_the_call_as_merge_attention_does(seed, lens, dtype, threads, heads):
    """The tails' call with each row's shared part (prior_out, prior_lse) equals the call without
    it merged with that part by attnx.merge_attention: rows that see no key, parts that saw none
    (-inf) or a NaN, padding rows, half-precision queries, split-KV (long rows, 2 threads)."""
    rng = make_rng(seed)
    hq, hkv = heads
    bs, dv = 16, 24
    lens = np.array(lens, np.int32)
    q_lens = np.minimum(lens, rng.integers(0, 3, len(lens))).astype(np.int32)
    n = int(q_lens.sum())
    width = max(1, int(-(-lens.max() // bs)))
    nb = len(lens) * width
    tables = rng.permutation(nb).astype(np.int32).reshape(len(lens), width)
    kp = rng.standard_normal((nb, hkv, bs, 32)).astype(dtype)
    vp = rng.standard_normal((nb, hkv, bs, dv)).astype(dtype)
    q = rng.standard_normal((n, hq, 32)).astype(dtype)
    dead = rng.random((n, hq)) < 0.2
    poison = rng.random((n, hq)) < 0.1
    po, pl = _prior(rng, n, hq, dv, dead, poison)
    kw = dict(q_lens=q_lens, return_lse=True, num_threads=threads)
    got, lse = attnx._core.paged_attention(
        q, kp, vp, tables, lens, prior_out=po, prior_lse=pl, **kw
    )
    o, ol = attnx._core.paged_attention(q, kp, vp, tables, lens, **kw)
    want, want_lse = attnx.merge_attention([o.astype(np.float32), po], [ol, pl])
    tol = TOL if dtype == "float32" else dict(rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    np.testing.assert_allclose(got.astype(np.float32), want, **tol)


def test_prior_arguments_are_checked():
    q = np.zeros((2, 2, 8), np.float32)
    kp = np.zeros((2, 1, 4, 8), np.float32)
    args = (q, kp, kp, np.array([[0], [1]], np.int32), np.array([3, 3], np.int32))
    good_out, good_lse = np.zeros((2, 2, 8), np.float32), np.zeros((2, 2), np.float32)
    core = attnx._core.paged_attention
    with pytest.raises(ValueError, match="both or neither"):
        core(*args, prior_out=good_out)
    with pytest.raises(ValueError, match="prior_out"):
        core(*args, prior_out=good_out[:1], prior_lse=good_lse)
    with pytest.raises(ValueError, match="prior_lse"):
        core(*args, prior_out=good_out, prior_lse=good_lse[:, :1])
    with pytest.raises(TypeError, match="prior_out: expected a float32"):
        core(*args, prior_out=good_out.astype(np.float64), prior_lse=good_lse)
    with pytest.raises(TypeError, match="prior_lse: expected a float32"):
        core(*args, prior_out=good_out, prior_lse=good_lse.astype(np.float16))
