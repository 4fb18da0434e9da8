"""Concurrency: 8 Python threads at once give bit-for-bit the results of the same work done
serially, for ``attnx.attention``, ``attnx.paged_attention`` and one shared ``PagedKVCache`` whose
sequences the threads step, fork, truncate and free; with ``num_threads=1`` and with
``num_threads=2`` per call (a team of attnx's pool inside each of the 8 Python threads: each
calling thread has its own workers, so the calls run side by side).

What may be shared between threads (what these tests rely on):

* input arrays (q, k, v, masks, pools, block tables): read only, share freely;
* ``out``: one per call in flight (two calls writing one ``out`` race, as with any NumPy ufunc);
* a ``PagedKVCache``: yes, each thread working on its own sequences (every bookkeeping call
  holds the cache's lock; ``Step.attend`` runs without the GIL on blocks its step reserved);
  forking a sequence while a step of it is being attended is not allowed;
* a ``Step``: by one thread at a time;
* ``attnx.set_num_threads`` / ``attnx._core.set_isa``: process-wide settings, not per thread.

``ATTNX_CONCURRENCY_ROUNDS`` (default 3; 30 with ``ATTNX_HYPOTHESIS_PROFILE=soak``) sets how many
rounds each thread runs.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import attnx

from helpers import BF16, SEED, cache_stepper, finish_client

THREADS = 8
SOAK = os.environ.get("ATTNX_HYPOTHESIS_PROFILE", "ci") == "soak"
ROUNDS = int(os.environ.get("ATTNX_CONCURRENCY_ROUNDS", "30" if SOAK else "3"))


def bits(a):
    a = np.ascontiguousarray(a)
    return a.dtype, a.shape, a.view(np.uint8).tobytes()


def run_threads(fns):
    """Runs fns[i]() on thread i, all released at once; returns their results in order."""
    results = [None] * len(fns)
    errors = []
    barrier = threading.Barrier(len(fns))

    def run(i):
        try:
            barrier.wait()
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def assert_same(parallel, serial):
    assert len(parallel) == len(serial)
    for i, (p, s) in enumerate(zip(parallel, serial)):
        assert len(p) == len(s), i
        for j, (a, b) in enumerate(zip(p, s)):
            assert bits(a) == bits(b), f"thread {i}, result {j} differs from the serial run"


# ---------------------------------------------------------------------------------------------
# kernels on shared inputs
# ---------------------------------------------------------------------------------------------


def _dense_inputs():
    rng = np.random.default_rng([SEED, 31])
    shared = []
    for dtype, (B, Hq, Hkv, Sq, Sk, D) in (
        (np.float32, (2, 8, 2, 64, 300, 64)),
        (np.float16, (1, 4, 4, 1, 700, 128)),
        (BF16, (3, 6, 3, 17, 40, 32)),
    ):
        q = rng.standard_normal((B, Hq, Sq, D)).astype(dtype)
        k = rng.standard_normal((B, Hkv, Sk, D)).astype(dtype)
        v = rng.standard_normal((B, Hkv, Sk, D)).astype(dtype)
        shared.append((q, k, v))
    return shared


def _dense_work(shared, i, nt):
    """Thread i's calls: a different mix of the shared inputs and options per thread."""
    outs = []
    for r in range(ROUNDS):
        for j, (q, k, v) in enumerate(shared):
            kw = [
                dict(causal=True),
                dict(window=(16, 0), softcap=20.0),
                dict(sinks=np.linspace(-1, 1, q.shape[1]).astype(np.float32)),
                dict(kv_lens=np.full(q.shape[0], k.shape[2] // 2), causal=True),
            ][(i + j + r) % 4]
            o, lse = attnx.attention(q, k, v, return_lse=True, num_threads=nt, **kw)
            outs += [o, lse]
        out = np.empty(shared[0][0].shape, shared[0][0].dtype)
        attnx.attention(*shared[0], out=out, num_threads=nt, mask=(np.arange(300) % (i + 2)) != 0)
        outs.append(out)
    return outs


@pytest.mark.parametrize(
    "nt", [1, 2, 3], ids=["1-thread-calls", "2-thread-calls", "3-thread-calls"]
)
def test_attention_threads_match_serial(nt):
    shared = _dense_inputs()
    serial = [_dense_work(shared, i, nt) for i in range(THREADS)]
    parallel = run_threads([lambda i=i: _dense_work(shared, i, nt) for i in range(THREADS)])
    assert_same(parallel, serial)


def _paged_inputs():
    rng = np.random.default_rng([SEED, 32])
    bs, nb, Hkv, D = 16, 96, 2, 64
    kp = rng.standard_normal((nb, Hkv, bs, D)).astype(np.float16)
    vp = rng.standard_normal((nb, Hkv, bs, D)).astype(np.float16)
    lens = np.array([1, 100, 700, 33, 256, 17])
    need = -(-lens // bs)
    perm = rng.permutation(nb)
    tables = np.zeros((len(lens), int(need.max())), np.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    return kp, vp, tables, lens, rng.standard_normal((700, 8, D)).astype(np.float32)


def _paged_work(inp, i, nt):
    kp, vp, tables, lens, qbank = inp
    outs = []
    for r in range(ROUNDS):
        q_lens = np.minimum(lens, [1, 1 + i, 3, 1, 8 * r + 1, 1])
        q = qbank[: int(q_lens.sum())]
        o, lse = attnx.paged_attention(
            q,
            kp,
            vp,
            tables,
            lens,
            q_lens=q_lens,
            return_lse=True,
            num_threads=nt,
            window=(None if i % 2 else (64, 0)),
        )
        outs += [o, lse]
        outs.append(
            attnx.paged_attention(
                qbank[:6],
                kp,
                vp,
                tables,
                lens,
                num_threads=nt,
                alibi_slopes=np.full(8, 0.01 * (i + 1), np.float32),
            )
        )
    return outs


@pytest.mark.parametrize("nt", [1, 2], ids=["1-thread-calls", "2-thread-calls"])
def test_paged_attention_threads_match_serial(nt):
    inp = _paged_inputs()
    serial = [_paged_work(inp, i, nt) for i in range(THREADS)]
    parallel = run_threads([lambda i=i: _paged_work(inp, i, nt) for i in range(THREADS)])
    assert_same(parallel, serial)


# ---------------------------------------------------------------------------------------------
# one cache, many clients
# ---------------------------------------------------------------------------------------------


def _client(cache, i, nt):
    """Client i's conversation on its own sequences of a shared cache: prefill, decode, fork,
    diverge, truncate, continue, free. Returns every attention output and final length."""
    rng = np.random.default_rng([SEED, 33, i])
    outs = []
    step = cache_stepper(cache, rng, outs, num_threads=nt, return_lse=True)
    a = cache.new_sequence()
    step([a], [int(rng.integers(10, 120))])
    for _ in range(6):
        step([a], [1])
    b = cache.fork(a)
    c = cache.fork(b)
    step([b, a, c], [2, 1, 3])
    cache.truncate(a, max(0, cache.length(a) - 5))
    step([a, c], [4, 1])
    cache.free(b)
    for _ in range(4):
        step([c, a], [1, 1])
    return finish_client(cache, outs, a, c)


def _make_cache():
    return attnx.PagedKVCache(
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        num_blocks=THREADS * 24,
        block_size=8,
        dtype="bfloat16",
        value_dim=16,
    )


@pytest.mark.parametrize("nt", [1, 2], ids=["1-thread-calls", "2-thread-calls"])
def test_cache_clients_match_serial(nt):
    serial_cache = _make_cache()
    serial = [_client(serial_cache, i, nt) for i in range(THREADS)]
    cache = _make_cache()
    for _ in range(ROUNDS):
        parallel = run_threads([lambda i=i: _client(cache, i, nt) for i in range(THREADS)])
        assert_same(parallel, serial)
        assert cache.num_free_blocks == cache.num_blocks, "blocks leaked"
        assert cache.sequences == []


def test_everything_at_once():
    """Dense, paged and cache work interleaved on 8 threads (4 with 2-thread calls)."""
    shared, inp = _dense_inputs(), _paged_inputs()

    def work(i, cache):
        nt = 1 + i % 2
        return _dense_work(shared, i, nt) + _paged_work(inp, i, nt) + _client(cache, i, nt)

    serial_cache = _make_cache()
    serial = [work(i, serial_cache) for i in range(THREADS)]
    cache = _make_cache()
    parallel = run_threads([lambda i=i: work(i, cache) for i in range(THREADS)])
    assert_same(parallel, serial)
    assert cache.num_free_blocks == cache.num_blocks
