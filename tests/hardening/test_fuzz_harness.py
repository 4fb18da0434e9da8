"""The atheris harness (fuzz/fuzz_entrypoints.py) in CI: its one-input function over a fixed
corpus of 2000 deterministic random byte strings (~4500 calls), in-process (no atheris needed),
then a short real atheris run in a subprocess when atheris is installed. And a repro of every
finding the harness has made (``test_known_*``: strict xfails while open, regression tests once
fixed; an open one is also listed in the harness's ``KNOWN_FINDINGS``).

Soak: ``ATTNX_HYPOTHESIS_PROFILE=soak`` runs 20x the corpus and 3000 atheris inputs; long
campaigns run the harness directly (``python fuzz/fuzz_entrypoints.py --runs N``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import attnx

from helpers.fuzz import HARNESS, fuzz_harness

CORPUS = int(os.environ.get("ATTNX_FUZZ_CORPUS", "2000"))
SOAK = os.environ.get("ATTNX_HYPOTHESIS_PROFILE", "ci") == "soak"


fz = fuzz_harness()


def corpus(n, seed=0x5EED):
    """n inputs, spread evenly over the entry points (the first byte picks one)."""
    rng = np.random.default_rng(seed)
    k = len(fz.ENTRIES)
    return [bytes([i % k]) + rng.bytes(int(rng.integers(0, 300))) for i in range(n)]


def test_corpus_in_process():
    """Every input: a result or a clean exception, inputs untouched, ``out`` untouched on error,
    a cache left exactly as it was by a failed operation and consistent after every one."""
    fz.STATS.clear()
    n = CORPUS * (20 if SOAK else 1)
    with warnings.catch_warnings():
        # NumPy's own warnings on NaN/inf arithmetic (in the reference-free layers code and in
        # the harness's mutations) are not findings; any other warning still is (an error here)
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, data in enumerate(corpus(n)):
            try:
                fz.one_input(data)
            except fz.Finding as e:
                pytest.fail(f"input {i} ({data!r}): {e}")
    entries = {entry for entry, _ in fz.STATS}
    for needed in (
        "attention",
        "paged_attention",
        "PagedKVCache",
        "cache.begin_step",
        "Step.attend",
        "cache.fork",
        "cache.truncate",
        "cache.free",
        "scaled_dot_product_attention",
        "MultiHeadAttention",
        "MultiHeadAttention.__call__",
        "set_num_threads",
    ):
        assert needed in entries, f"the corpus never reached {needed}"
    for entry in ("attention", "paged_attention", "Step.attend", "cache.begin_step"):
        outcomes = {o for e, o in fz.STATS if e == entry}
        assert "result" in outcomes and len(outcomes) > 1, (entry, outcomes)
    total = sum(fz.STATS.values())
    print(
        f"\nharness: {n} inputs, {total} calls: "
        + ", ".join(f"{e}/{o} {c}" for (e, o), c in sorted(fz.STATS.items()))
    )
    assert attnx.cpu_features()["isa"] in fz.ISAS


def test_provider_is_total_and_deterministic():
    p, q = fz.Provider(b"\x07\xff"), fz.Provider(b"\x07\xff")
    assert [p.int(0, 9) for _ in range(5)] == [q.int(0, 9) for _ in range(5)]
    e = fz.Provider(b"")
    assert e.int(3, 7) == 3 and e.pick("abc") == "a" and e.bool() is False


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_atheris_runs(tmp_path):
    """The real fuzzer, briefly, in a subprocess (a crash there must not take pytest down)."""
    runs = 3000 if SOAK else 300
    env = dict(os.environ, ATTNX_FUZZ_UNALIGNED="0" if os.environ.get("ATTNX_SANITIZED") else "1")
    p = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            "--runs",
            str(runs),
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
            "-rss_limit_mb=8192",
            "-timeout=60",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"Done {runs} runs" in p.stderr, p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# the known findings, as repros
# ---------------------------------------------------------------------------------------------

CLEAN = (ValueError, TypeError)


@pytest.mark.parametrize("window", [(2**63, 0), (0, 2**70), (2**100, None)])
def test_known_window_past_int64(window):
    q = np.ones((1, 2, 3, 4), np.float32)
    for call in (
        lambda: attnx.attention(q, q, q, window=window),
        lambda: attnx.paged_attention(
            q[0].transpose(1, 0, 2),
            np.ones((1, 2, 4, 4), np.float32),
            np.ones((1, 2, 4, 4), np.float32),
            np.zeros((3, 1), int),
            np.array([3, 3, 3]),
            window=window,
        ),
    ):
        try:
            call()
        except CLEAN:
            pass


def test_known_sliding_window_past_int64():
    try:
        cache = attnx.PagedKVCache(
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            num_blocks=4,
            block_size=2,
            sliding_window=2**64,
        )
    except CLEAN:
        return  # refused up front: fixed
    a = cache.new_sequence()
    st = cache.begin_step([a], [3])
    x = np.ones((3, 1, 4), np.float32)
    st.attend(0, x, x, x)


@pytest.mark.parametrize("n", [float("inf"), 1.5, "3", True], ids=["inf", "1.5", "str", "bool"])
def test_known_set_num_threads_validation(n):
    try:
        with pytest.raises((ValueError, TypeError)):
            attnx.set_num_threads(n)
    finally:
        attnx.set_num_threads(0)


@pytest.mark.parametrize("k_shape", [(4,), (3, 4)])
def test_known_low_rank_k_with_rank4_q(k_shape):
    q = np.ones((1, 1, 3, 4), np.float32)
    with pytest.raises(ValueError, match="^k"):
        attnx.attention(q, np.ones(k_shape, np.float32), q)


MHA_EMPTY_GIANT = """
import numpy as np, attnx
layer = attnx.MultiHeadAttention(d_model=4, num_heads=2, seed=0)
x = np.broadcast_to(np.ones(4, np.float32), (2**50, 0, 4))  # no element at all
try:
    layer(x)
except (ValueError, MemoryError):
    pass
print("ok")
"""


def test_known_mha_empty_giant_batch():
    try:
        p = subprocess.run(
            [sys.executable, "-c", MHA_EMPTY_GIANT], capture_output=True, text=True, timeout=8
        )
    except subprocess.TimeoutExpired:
        pytest.fail("MultiHeadAttention did not return within 8 s")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]
