"""A cache step's per-layer call (``_core.StepPlan``, behind ``Step.attend``): the model's
``(B, H, S, D)`` layout that ``attnx.hf`` hands over as it is, and the cheap staleness test.

The plan is what every ``Step.attend`` runs, so the cache, fuzz and variant tests cover its packed
``(T, H, D)`` form; here its model-layout form is compared with that one, on twin caches that
receive the same writes, bit for bit (one kernel, the same inputs).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cache import assert_bits_equal, assert_unchanged, small_cache, snapshot

import attnx

from helpers import BF16, make_rng

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}


def model_tensor(rng, b, h, s, d, dtype, memory):
    """A ``(B, H, S, D)`` array as a model holds it: over ``(B, S, H, D)`` memory (what a
    projection writes, then ``.transpose(1, 2)``), or ``(B, H, S, D)`` contiguous."""
    if memory == "bshd":
        return rng.standard_normal((b, s, h, d)).astype(dtype).transpose(0, 2, 1, 3)
    return rng.standard_normal((b, h, s, d)).astype(dtype)


def packed(x):
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(-1, x.shape[1], x.shape[3])


def twins(dtype, **kw):
    """Two caches with the same history: two sequences of 5 and 6 tokens."""
    rng = make_rng(41)
    caches = [small_cache(dtype=dtype, **kw) for _ in range(2)]
    q = rng.standard_normal((11, 4, 8)).astype(np.float32)
    k = rng.standard_normal((11, 2, 8)).astype(np.float32)
    v = rng.standard_normal((11, 2, 8)).astype(np.float32)
    for c in caches:
        a, b = c.new_sequence(), c.new_sequence()
        step = c.begin_step([a, b], [5, 6])
        for layer in range(c.num_layers):
            step.attend(layer, q, k, v)
    return caches, [0, 1]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("memory", ["bshd", "bhsd"])
def test_model_layout_equals_packed(dtype, s, memory):
    rng = make_rng(42, s)
    (c4, c3), seqs = twins(dtype)
    q = model_tensor(rng, 2, 4, s, 8, DTYPES[dtype], memory)
    k = model_tensor(rng, 2, 2, s, 8, DTYPES[dtype], memory)
    v = model_tensor(rng, 2, 2, s, 8, DTYPES[dtype], memory)
    st4, st3 = c4.begin_step(seqs, [s, s]), c3.begin_step(seqs, [s, s])
    for layer in range(2):
        o4, lse4 = st4.attend_arrays(layer, q, k, v, scale=0.3, return_lse=True)
        o3, lse3 = st3.attend(layer, packed(q), packed(k), packed(v), scale=0.3, return_lse=True)
        assert o4.shape == (2, s, 4, 8) and lse4.shape == (2, s, 4)
        assert_bits_equal(o4.reshape(o3.shape), o3)
        assert_bits_equal(lse4.reshape(lse3.shape), lse3)
    assert_bits_equal(c4._k, c3._k, "k pages")
    assert_bits_equal(c4._v, c3._v, "v pages")


def test_model_layout_through_the_shared_prefix_path():
    """Forks share their prompt's blocks: the step takes the shared path, in the model's layout too."""
    rng = make_rng(43)
    caches = [small_cache(num_blocks=256) for _ in range(2)]
    x = rng.standard_normal((600, 2, 8)).astype(np.float32)
    q = rng.standard_normal((600, 4, 8)).astype(np.float32)
    forks = []
    for c in caches:
        root = c.new_sequence()
        step = c.begin_step([root], [600])
        for layer in range(2):
            step.attend(layer, q, x, x)
        forks.append([c.fork(root) for _ in range(3)])
    q4 = model_tensor(rng, 3, 4, 1, 8, np.float32, "bshd")
    k4 = model_tensor(rng, 3, 2, 1, 8, np.float32, "bshd")
    st4, st3 = caches[0].begin_step(forks[0], [1] * 3), caches[1].begin_step(forks[1], [1] * 3)
    assert st4.shared_prefix  # the path under test
    for layer in range(2):
        o4 = st4.attend_arrays(layer, q4, k4, k4)
        o3 = st3.attend(layer, packed(q4), packed(k4), packed(k4))
        assert o4.shape == (3, 1, 4, 8)
        assert_bits_equal(o4.reshape(o3.shape), o3)


@pytest.mark.parametrize("counts, b, s", [([1, 2], 2, 1), ([2, 0], 1, 2), ([2, 0], 2, 1)])
def test_model_layout_needs_one_token_count_per_sequence(counts, b, s):
    """Row b of a (B, H, S, D) array is sequence b: refused unless every sequence has S new
    tokens, even where B * S is the step's token count."""
    (cache, _), seqs = twins("float32")
    step = cache.begin_step(seqs, counts)
    x = np.zeros((b, 4, s, 8), np.float32)
    kv = np.zeros((b, 2, s, 8), np.float32)
    snap = snapshot(cache)
    with pytest.raises(
        ValueError, match=r"q: a \(B, H, S, D\) array needs B = 2 sequences with S new tokens each"
    ):
        step.attend_arrays(0, x, kv, kv)
    assert_unchanged(cache, snap)


def test_a_change_to_another_sequence_keeps_the_step_current():
    """The staleness test's shortcut (nothing changed in the cache) falls back to the per-sequence
    versions when something else changed, so another sequence's step or truncation never makes
    this step stale, and this step's own sequences still do."""
    (cache, _), (a, b) = twins("float32")
    other = cache.new_sequence()
    x = np.ones((1, 4, 8), np.float32)
    kv = np.ones((1, 2, 8), np.float32)
    step = cache.begin_step([a], [1])
    cache.begin_step([other], [3])
    cache.truncate(other, 1)
    assert cache.is_current(step)
    step.attend(0, x, kv, kv)
    cache.truncate(a, 5)
    assert not cache.is_current(step)
    with pytest.raises(attnx.StaleStepError):
        step.attend(1, x, kv, kv)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (dict(scale=True), TypeError, "scale: expected a float, got bool"),
        (dict(softcap=False), TypeError, "softcap: expected a float, got bool"),
        (dict(scale="0.5"), TypeError, "scale: expected a float, got str"),
        (dict(softcap=[1.0]), TypeError, "softcap: expected a float, got list"),
        (dict(layer=True), ValueError, r"layer: expected an int in \[0, 2\)"),
        (dict(layer=2), ValueError, r"layer: expected an int in \[0, 2\)"),
        (dict(layer=-1), ValueError, r"layer: expected an int in \[0, 2\)"),
    ],
)
def test_plan_arguments(bad, exc, match):
    (cache, _), seqs = twins("float32")
    step = cache.begin_step(seqs, [1, 1])
    x = np.ones((2, 4, 8), np.float32)
    kv = np.ones((2, 2, 8), np.float32)
    args = dict(layer=0)
    args.update(bad)
    layer = args.pop("layer")
    snap = snapshot(cache)
    with pytest.raises(exc, match=match):
        step.attend(layer, x, kv, kv, **args)
    assert_unchanged(cache, snap)
