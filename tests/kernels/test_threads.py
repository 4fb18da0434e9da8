"""Thread counts and attnx's thread pool.

* Counts: ``num_threads`` (every entry point) and ``attnx.set_num_threads`` are ints below 2**31
  (a ValueError naming the argument otherwise, also for bools and floats); a count above
  ``_core._max_threads()`` (4 per CPU this process may run on, at most 1024) is capped with a
  RuntimeWarning instead of starting that many threads (issue 18's smaller deviations).
* The default: ``ATTNX_NUM_THREADS`` at call time if set (attnx's own knob: a value that is not
  a positive integer is a ValueError naming it at the call, before anything is written), else
  ``OMP_NUM_THREADS``, else the CPUs of the affinity mask; ``set_num_threads`` and ``num_threads=``
  come before all of them (issue 31).
* The pool: each calling thread's workers are made once and reused, and joined when that thread
  exits (no thread leaks per call or per caller); ``ATTNX_SPIN_US=0`` (sleep at once) gives the
  same bits as the default spin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import attnx
from attnx import _core

from helpers import cpus_here, threads_here

TOO_BIG = [2**31, 2**40, np.int64(2**31), np.uint64(2**63)]


def os_threads():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def threads_settle_at(n, timeout=30.0):
    """Whether the process's thread count comes down to n: Thread.join returns when the thread's
    Python code is done, a moment before the OS thread ends (its thread_local destructors, which
    join its workers, run last)."""
    deadline = time.monotonic() + timeout
    while os_threads() != n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _calls():
    """Every entry point that takes num_threads, as f(num_threads) -> result."""
    q = np.ones((1, 2, 300, 64), np.float32)
    kp = np.ones((4, 1, 16, 64), np.float32)
    bt = np.arange(4, dtype=np.int32).reshape(1, 4)
    cache = attnx.PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4, dtype="float32"
    )

    def attend(nt):
        st = cache.begin_step([cache.new_sequence()], [2])
        x = np.ones((2, 1, 8), np.float32)
        return st.attend(0, x, x, x, num_threads=nt)

    return {
        "attention": lambda nt: attnx.attention(q, q, q, num_threads=nt),
        "paged_attention": lambda nt: attnx.paged_attention(
            q[0, :, :1].transpose(1, 0, 2), kp, kp, bt, np.array([64]), num_threads=nt
        ),
        "Step.attend": attend,
    }


@pytest.mark.parametrize("entry", ["attention", "paged_attention", "Step.attend"])
@pytest.mark.parametrize("n", TOO_BIG + [True, False, 2.0, 0, -1], ids=repr)
def test_num_threads_out_of_range_names_the_argument(entry, n):
    with pytest.raises(ValueError, match="^num_threads: expected"):
        _calls()[entry](n)


@pytest.mark.parametrize("n", TOO_BIG + [True, 2.0, -1], ids=repr)
def test_set_num_threads_out_of_range_names_the_argument(n):
    before = attnx.get_num_threads()
    with pytest.raises(ValueError, match="^n: expected"):
        attnx.set_num_threads(n)
    assert attnx.get_num_threads() == before


def test_the_cap():
    cap = _core._max_threads()
    assert cap == min(4 * cpus_here(), 1024)


@pytest.mark.parametrize("entry", ["attention", "paged_attention", "Step.attend"])
def test_a_huge_num_threads_is_capped_with_a_warning(entry):
    cap = _core._max_threads()
    call = _calls()[entry]
    expected = call(cap)
    before = os_threads()
    with pytest.warns(RuntimeWarning, match=f"num_threads=4096 capped at {cap} threads"):
        got = call(4096)
    assert os_threads() <= before + cap, "more threads than the cap were started"
    assert np.array_equal(got, expected)


def test_set_num_threads_caps_with_a_warning():
    cap = _core._max_threads()
    try:
        with pytest.warns(RuntimeWarning, match=f"n=4096 capped at {cap} threads"):
            attnx.set_num_threads(np.int32(4096))
        assert attnx.get_num_threads() == cap
        attnx.set_num_threads(np.uint8(3))
        assert attnx.get_num_threads() == 3
    finally:
        attnx.set_num_threads(0)


@pytest.mark.parametrize(
    "env, expected",
    [
        ("3", 3),
        ("3,2", 3),
        (" 5 ", None),
        ("abc", None),
        ("0", None),
        ("-2", None),
        ("100000", "cap"),
    ],
)
def test_default_follows_omp_num_threads_at_call_time(clean_env, env, expected):
    monkeypatch = clean_env  # (ATTNX_NUM_THREADS, which comes first, unset)
    cpus = threads_here(cpus_here())
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    want = {None: cpus, "cap": _core._max_threads()}.get(expected, expected)
    if env == " 5 ":
        want = min(5, _core._max_threads())  # leading and trailing blanks, as OpenMP allows
    assert attnx.get_num_threads() == want
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert attnx.get_num_threads() == cpus
    attnx.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert attnx.get_num_threads() == 2, "an explicit setting wins over the environment"
    finally:
        attnx.set_num_threads(0)


def test_default_follows_the_affinity_mask():
    code = (
        "import os, attnx; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "print(attnx.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "ATTNX_NUM_THREADS")}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


@pytest.fixture
def own_pool():
    """attnx's own pool, not torch's team (an earlier test's tensor may have switched that on)."""
    attnx.share_torch_threads(False)
    yield
    if "attnx.integrations.torch_ops" in sys.modules:  # what importing it had turned on
        attnx.share_torch_threads(True)


def test_workers_are_reused_and_released_with_their_thread(own_pool):
    q = np.ones((1, 2, 300, 64), np.float32)
    attnx.attention(q, q, q, num_threads=3)
    base = os_threads()
    seen = []

    def caller():
        # a fresh thread: its own two workers, made by its first call and reused by the rest
        for _ in range(20):
            attnx.attention(q, q, q, num_threads=3)
        seen.append((_core._pool_threads(), os_threads()))

    for _ in range(10):  # ... and joined when it exits
        t = threading.Thread(target=caller)
        t.start()
        t.join()
    assert seen == [(2, base + 3)] * 10
    assert threads_settle_at(base)
    for _ in range(20):  # calls of this thread keep reusing its workers
        attnx.attention(q, q, q, num_threads=3)
    assert os_threads() == base


@pytest.mark.parametrize("num_threads", [3, 6])
def test_a_team_is_no_larger_than_its_pieces_of_work(own_pool, num_threads):
    """One item over 512 keys (64 query rows, one head) is big enough for a team, and split-KV cuts
    it into 2 parts (parts of at least 256 keys): the call wakes 2 threads however many it may
    use, and the result is the same."""
    num_threads = threads_here(num_threads)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 64, 64)).astype(np.float32)
    k = rng.standard_normal((1, 1, 512, 64)).astype(np.float32)
    one = attnx.attention(q, k, k, num_threads=1)
    seen = []

    def caller():  # a fresh thread: its pool holds the workers its calls' teams needed
        seen.append((attnx.attention(q, k, k, num_threads=num_threads), _core._pool_threads()))

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    out, workers = seen[0]
    assert workers == 1
    np.testing.assert_allclose(out, one, rtol=1e-6, atol=1e-6)


def test_sleeping_workers_give_the_same_bits():
    """ATTNX_SPIN_US=0: every wait sleeps on its futex at once (the path the default's waits take
    after their spin), through many back-to-back regions and barriers."""
    code = r"""
import hashlib, numpy as np, attnx
rng = np.random.default_rng(5)
q = rng.standard_normal((1, 4, 256, 64)).astype(np.float32)
h = hashlib.sha256()
for i in range(200):
    h.update(attnx.attention(q, q, q, causal=bool(i % 2), num_threads=2 + i % 3).tobytes())
print(h.hexdigest())
"""
    digests = set()
    for spin in ("0", "100", ""):
        env = dict(os.environ, ATTNX_SPIN_US=spin)
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert r.returncode == 0, r.stderr
        digests.add(r.stdout.strip())
    assert len(digests) == 1


# ---- ATTNX_NUM_THREADS (issue 31) --------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("ATTNX_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    attnx.set_num_threads(0)
    yield monkeypatch
    attnx.set_num_threads(0)


@pytest.mark.parametrize(
    "env, expected", [("3", 3), (" 2 ", 2), ("+3", 3), ("", None), ("   ", None), ("100000", "cap")]
)
def test_attnx_num_threads_sets_the_default(clean_env, env, expected):
    cpus = threads_here(cpus_here())
    clean_env.setenv("ATTNX_NUM_THREADS", env)
    assert attnx.get_num_threads() == {None: cpus, "cap": _core._max_threads()}.get(
        expected, expected
    )


def test_attnx_num_threads_precedence(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "3")
    assert attnx.get_num_threads() == 3
    clean_env.setenv("ATTNX_NUM_THREADS", "2")
    assert attnx.get_num_threads() == 2, "ATTNX_NUM_THREADS comes before OMP_NUM_THREADS"
    attnx.set_num_threads(1)
    assert attnx.get_num_threads() == 1, "set_num_threads comes before ATTNX_NUM_THREADS"
    attnx.set_num_threads(0)
    clean_env.setenv("ATTNX_NUM_THREADS", "bad")
    for call in _calls().values():  # num_threads= comes first: the variable is not read
        call(2)


BAD = ["abc", "0", "-1", "2.5", "3,2", "1e3", "4 threads", "0x4"]


@pytest.mark.parametrize("env", BAD)
def test_bad_attnx_num_threads_is_a_value_error_at_the_call(clean_env, env):
    clean_env.setenv("ATTNX_NUM_THREADS", env)
    with pytest.raises(
        ValueError, match=f"^ATTNX_NUM_THREADS: expected a positive integer.*{env!r}"
    ):
        attnx.get_num_threads()
    for call in _calls().values():
        with pytest.raises(ValueError, match="^ATTNX_NUM_THREADS"):
            call(None)
    q = np.ones((1, 4, 1, 8), np.float32)  # (B, T, H, K)
    with pytest.raises(ValueError, match="^ATTNX_NUM_THREADS"):
        attnx.gated_delta_rule(
            q, q, q, np.zeros((1, 4, 1), np.float32), np.ones((1, 4, 1), np.float32)
        )
    clean_env.setenv("OMP_NUM_THREADS", "2")  # OpenMP's variable does not excuse attnx's
    with pytest.raises(ValueError, match="^ATTNX_NUM_THREADS"):
        attnx.get_num_threads()


def test_a_refused_call_writes_nothing(clean_env):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(3))
    out = np.full_like(q, 7.0)
    cache = attnx.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
    st = cache.begin_step([cache.new_sequence()], [3])
    x = rng.standard_normal((3, 1, 8)).astype(np.float32)
    pages = cache.k_pages(0).copy(), cache.v_pages(0).copy()
    clean_env.setenv("ATTNX_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="^ATTNX_NUM_THREADS"):
        attnx.attention(q, k, v, out=out)
    with pytest.raises(ValueError, match="^ATTNX_NUM_THREADS"):
        st.attend(0, x, x, x)
    assert (out == 7.0).all()
    assert np.array_equal(cache.k_pages(0), pages[0]) and np.array_equal(cache.v_pages(0), pages[1])
    clean_env.delenv("ATTNX_NUM_THREADS")
    np.testing.assert_array_equal(attnx.attention(q, k, v, out=out), attnx.attention(q, k, v))


def test_attnx_num_threads_changes_no_other_librarys_threads(tmp_path):
    """torch reads OMP_NUM_THREADS, not ATTNX_NUM_THREADS; NumPy's BLAS likewise."""
    code = (
        "import attnx, numpy, sys; n = attnx.get_num_threads(); import torch; "
        "print(n, torch.get_num_threads())"
    )
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("ATTNX_NUM_THREADS", "OMP_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = "2"
    runs = []
    for extra in ({}, {"ATTNX_NUM_THREADS": "1"}):
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.split())
    assert runs == [["2", "2"], ["1", "2"]]
