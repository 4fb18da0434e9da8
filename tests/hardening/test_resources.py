"""Resources: sizes that overflow an index or exhaust memory, memory that must stay flat, and
error paths that must leave outputs and caches as they were.

* Impossible sizes (a PagedKVCache of 2**40 blocks, an output of hundreds of TiB built from
  zero-stride ``np.broadcast_to`` inputs that cost nothing) raise MemoryError/ValueError at
  once, without allocating; under an address-space limit (subprocess, RLIMIT_AS) every entry
  point answers a size it cannot hold with MemoryError, never a crash.
* 64-bit indexing: keys past 2**31 (dense) and pages past 2**32 elements (paged) are addressed
  correctly (sparse memory-mapped files: a window reads only a few rows of them); lengths past
  int32 are refused or honoured, never wrapped.
* No leak: long loops of attention, paged attention and cache steps / forks / truncations /
  frees (errors included) keep RSS flat (skipped under ASan, whose allocator quarantines freed
  memory); input reference counts are unchanged; short-lived threads leave no scratch behind.
* Error paths: a MemoryError in the middle of a call leaves ``out`` unchanged.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import attnx
from attnx import reference as ref

from helpers import cpus_here

SANITIZED = bool(os.environ.get("ATTNX_SANITIZED"))  # set by .ci/sanitize.sh
LINUX = sys.platform.startswith("linux")


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def run_py(code, timeout=300, env=None):
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return p.returncode, p.stdout, p.stderr


# ---------------------------------------------------------------------------------------------
# impossible sizes are refused at once
# ---------------------------------------------------------------------------------------------

CACHE_SIZES = {
    "blocks_2_40": dict(num_blocks=2**40),
    "block_size_2_40": dict(block_size=2**40),
    "slots_overflow_int32": dict(num_blocks=2**16, block_size=2**15),
    "head_dim_2_40": dict(head_dim=2**40),
    "layers_2_40": dict(num_layers=2**40),
    "heads_2_62": dict(num_kv_heads=2**62),
    "value_dim_2_50": dict(value_dim=2**50),
    "all_large": dict(num_layers=2**20, num_kv_heads=2**10, head_dim=2**12, num_blocks=2**12),
}


@pytest.mark.parametrize("case", list(CACHE_SIZES))
def test_cache_of_impossible_size_is_refused_quickly(case):
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=8, block_size=16)
    kw.update(CACHE_SIZES[case])
    r0, t0 = rss_mb() if LINUX else 0, time.perf_counter()
    with pytest.raises((MemoryError, ValueError)):
        attnx.PagedKVCache(**kw)
    assert time.perf_counter() - t0 < 2.0
    if LINUX and not SANITIZED:
        assert rss_mb() - r0 < 16, "memory was committed before the refusal"


def huge(shape, dtype=np.float32, last=4):
    """A zero-stride array of a huge logical shape whose last axis is real (the kernels need a
    contiguous last axis): it costs ``last`` elements."""
    return np.broadcast_to(np.ones(shape[-1] if last is None else last, dtype), shape)


# outputs of 2**46..2**52 bytes: more than any machine's memory and than a 47-bit address space
HUGE_CALLS = {
    "dense_out_256TiB": lambda: attnx.attention(
        huge((2**24, 2**10, 2**10, 4)), huge((2**24, 1, 1, 4)), huge((2**24, 1, 1, 4))
    ),
    "dense_huge_dv": lambda: attnx.attention(
        huge((1, 1, 2, 4)), huge((1, 1, 2, 4)), huge((1, 1, 2, 2**50), last=1)
    ),
    "dense_lse_huge": lambda: attnx.attention(
        huge((2**20, 2**20, 2**10, 1), last=1),
        huge((2**20, 1, 1, 1), last=1),
        huge((2**20, 1, 1, 1), last=1),
        return_lse=True,
    ),
    "dense_bshd_rank3": lambda: attnx.attention(
        huge((2**40, 2**10, 4)), huge((1, 1, 4)), huge((1, 1, 4)), layout="bshd"
    ),
    "paged_out": lambda: attnx.paged_attention(
        huge((2**40, 2**8, 4)),
        np.ones((2, 1, 4, 4), np.float32),
        np.ones((2, 1, 4, 4), np.float32),
        np.zeros((1, 1), np.int64),
        np.array([1]),
        q_lens=np.array([2**40]),
    ),
    "sdpa_out": lambda: attnx.scaled_dot_product_attention(
        huge((2**24, 2**10, 2**10, 4)), huge((2**24, 2**10, 1, 4)), huge((2**24, 2**10, 1, 4))
    ),
}


@pytest.mark.parametrize("case", list(HUGE_CALLS))
def test_output_larger_than_memory_is_refused(case):
    r0, t0 = rss_mb() if LINUX else 0, time.perf_counter()
    with pytest.raises((MemoryError, ValueError)):
        HUGE_CALLS[case]()
    assert time.perf_counter() - t0 < 5.0
    if LINUX and not SANITIZED:
        assert rss_mb() - r0 < 64


# the start of the subprocess scripts below: vm() is the process's address-space size in bytes
VM_PRELUDE = r"""
import resource, sys, numpy as np, attnx

def vm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
"""

ADDRESS_LIMITED = (
    VM_PRELUDE
    + r"""
GiB = 2**30
attnx.attention(np.ones((1, 2, 300, 64), np.float32), np.ones((1, 2, 300, 64), np.float32),
                np.ones((1, 2, 300, 64), np.float32), num_threads=2)  # the team's threads exist
q_wide = np.ones((1, 1, 1, 2**22), np.float32)  # 16 MiB, its kernel scratch ~3 GiB
v_small = np.ones((1, 1, 1, 4), np.float32)
limit = vm() + GiB
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

def b(shape, dtype=np.float32):
    return np.broadcast_to(np.ones(shape[-1], dtype), shape)

calls = {
    "dense 4 GiB out": lambda: attnx.attention(b((2**18, 1, 2**10, 4)), b((2**18, 1, 3, 4)),
                                               b((2**18, 1, 3, 4))),
    "dense 2 GiB out, float16": lambda: attnx.attention(b((2**18, 1, 2**10, 4), np.float16),
                                                        b((2**18, 1, 2, 4), np.float16),
                                                        b((2**18, 1, 2, 4), np.float16)),
    "dense 4 GiB lse": lambda: attnx.attention(b((2**20, 2**4, 2**6, 1)), b((2**20, 1, 2, 1)),
                                               b((2**20, 1, 2, 1)), return_lse=True),
    "dense scratch of 3 GiB (Dk = 2**22)": lambda: attnx.attention(q_wide, q_wide, v_small),
    "paged 4 GiB out": lambda: attnx.paged_attention(
        b((2**28, 1, 4)), b((1, 1, 2**28, 4)), b((1, 1, 2**28, 4)), np.zeros((1, 1), np.int64),
        np.array([2**28]), q_lens=np.array([2**28])),
    "paged, 2**33 sequences (zero-stride tables)": lambda: attnx.paged_attention(
        np.zeros((0, 1, 4), np.float32), b((1, 1, 4, 4)), b((1, 1, 4, 4)),
        np.broadcast_to(np.zeros(1, np.int64), (2**33, 1)), np.broadcast_to(np.zeros(1, np.int64), (2**33,)),
        q_lens=np.broadcast_to(np.zeros(1, np.int64), (2**33,))),
    "cache 2 GiB pool": lambda: attnx.PagedKVCache(num_layers=4, num_kv_heads=8, head_dim=128,
                                                   num_blocks=2**11, block_size=16),
    "cache bookkeeping of 2**27 blocks": lambda: attnx.PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=2**27, block_size=1, dtype="float16"),
}
for name, call in calls.items():
    try:
        call()
        print(name, "-> result")
    except MemoryError:
        print(name, "-> MemoryError")
    except ValueError as e:
        print(name, "-> ValueError", e)
print("done")
"""
)


@pytest.mark.skipif(
    not LINUX or SANITIZED, reason="RLIMIT_AS (ASan needs terabytes of shadow address space)"
)
def test_every_entry_point_under_an_address_space_limit():
    """1 GiB of address space above what the interpreter holds: each call either completes or
    raises MemoryError/ValueError; the process never dies."""
    rc, out, err = run_py(ADDRESS_LIMITED, timeout=600)
    assert rc == 0 and "done" in out, (rc, out, err[-3000:])
    for line in out.splitlines()[:-1]:
        assert "->" in line, line


# ---------------------------------------------------------------------------------------------
# 64-bit indexing on sparse memory maps
# ---------------------------------------------------------------------------------------------


def sparse_memmap(tmp_path, name, shape, dtype=np.float32):
    """A zero-filled memmap of ``shape`` backed by a sparse file: costs nothing until written."""
    path = tmp_path / name
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    try:
        with open(path, "wb") as f:
            f.truncate(nbytes)
        if os.stat(path).st_blocks * 512 > 2**20:
            pytest.skip("the temporary directory's filesystem has no sparse files")
        return np.memmap(path, dtype=dtype, mode="r+", shape=shape)
    except (OSError, OverflowError, ValueError) as e:
        pytest.skip(f"cannot map a sparse {nbytes / 2**30:.0f} GiB file here: {e}")


def softmax_rows(q, ks, vs, scale):
    s = np.array([float(q @ k) * scale for k in ks])
    w = np.exp(s - s.max())
    return (w[:, None] * vs).sum(0) / w.sum(), s.max() + np.log(w.sum())


@pytest.mark.skipif(not LINUX, reason="sparse files")
def test_dense_keys_past_2_31(isa, tmp_path):
    """Sk = 2**31 + 64 keys (a 32 GiB sparse map, k and v share it); causal + window (2, 0)
    makes the one query read only the last 3 keys. (Refusing Sk >= 2**31 with a ValueError would
    pass too.)"""
    Sk = 2**31 + 64
    kv = sparse_memmap(tmp_path, "kv.bin", (1, 1, Sk, 4))
    rows = np.array(
        [[1.0, 2.0, 0.5, -1.0], [0.0, -1.0, 2.0, 1.0], [3.0, 0.0, -2.0, 0.5]], np.float32
    )
    kv[0, 0, Sk - 3 :] = rows
    q = np.array([[[[0.3, -0.2, 0.5, 0.1]]]], np.float32)
    try:
        o, lse = attnx.attention(q, kv, kv, causal=True, window=(2, 0), return_lse=True)
    except ValueError as e:  # lengths past int32 refused outright: a consistent contract too
        assert "2147483" in str(e) or "int32" in str(e), e
        return
    want, want_lse = softmax_rows(
        q[0, 0, 0].astype(np.float64), rows.astype(np.float64), rows.astype(np.float64), 0.5
    )
    np.testing.assert_allclose(o[0, 0, 0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[0, 0, 0], want_lse, rtol=1e-5)
    # two threads: split-KV across a range that starts past 2**31
    o2 = attnx.attention(q, kv, kv, causal=True, window=(2, 0), num_threads=2)
    np.testing.assert_allclose(o2[0, 0, 0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not LINUX, reason="sparse files")
def test_paged_pages_past_2_32_elements(isa, tmp_path):
    """Blocks of 2**20 slots (4 Mi elements each): a sequence of 2**31 - 1 tokens over 2048
    scrambled blocks, and one whose only block is the pool's last (offset > 2**33 elements)."""
    bs, nb = 2**20, 2100
    pages = sparse_memmap(tmp_path, "pages.bin", (nb, 1, bs, 4))
    rng = np.random.default_rng(3)
    L0 = 2**31 - 1
    n0 = -(-L0 // bs)
    ids0 = rng.permutation(nb - 1)[:n0]
    tables = np.zeros((2, n0), np.int64)
    tables[0] = ids0
    tables[1, 0] = nb - 1
    rows0 = rng.standard_normal((3, 4)).astype(np.float32)
    for i, t in enumerate(range(L0 - 3, L0)):
        pages[ids0[t // bs], 0, t % bs] = rows0[i]
    rows1 = rng.standard_normal((5, 4)).astype(np.float32)
    pages[nb - 1, 0, :5] = rows1
    q = rng.standard_normal((2, 2, 4)).astype(np.float32)  # one decode query each, Hq = 2
    seq_lens = np.array([L0, 5])
    o, lse = attnx.paged_attention(
        q, pages, pages, tables, seq_lens, window=(2, 0), return_lse=True
    )
    for h in range(2):
        w0, l0 = softmax_rows(
            q[0, h].astype(np.float64), rows0.astype(np.float64), rows0.astype(np.float64), 0.5
        )
        w1, l1 = softmax_rows(
            q[1, h].astype(np.float64),
            rows1[2:].astype(np.float64),
            rows1[2:].astype(np.float64),
            0.5,
        )
        np.testing.assert_allclose(o[0, h], w0, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(o[1, h], w1, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[:, h], [l0, l1], rtol=1e-5)
    # the same through the reference on the second sequence (small): whole-sequence attention
    o_full = attnx.paged_attention(q[1:], pages, pages, tables[1:, :1], seq_lens[1:])
    want = ref.attention(q[1][:, None], rows1[None], rows1[None], kv_lens=None)
    np.testing.assert_allclose(o_full[0], want[:, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not LINUX, reason="sparse files")
def test_kv_lens_past_int32_are_not_wrapped(tmp_path):
    Sk = 2**32 + 8
    kv = sparse_memmap(tmp_path, "kv.bin", (1, 1, Sk, 4))
    rows = np.array([[1.0, 2.0, 0.5, -1.0], [3.0, 0.0, -2.0, 0.5]], np.float32)
    n = 2**32 + 3
    kv[0, 0, n - 2 : n] = rows
    q = np.array([[[[0.3, -0.2, 0.5, 0.1]]]], np.float32)
    try:
        o = attnx.attention(q, kv, kv, causal=True, window=(1, 0), kv_lens=np.array([n]))
    except ValueError:
        return  # refused: fine
    want, _ = softmax_rows(
        q[0, 0, 0].astype(np.float64), rows.astype(np.float64), rows.astype(np.float64), 0.5
    )
    np.testing.assert_allclose(o[0, 0, 0], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# memory stays flat
# ---------------------------------------------------------------------------------------------


def _dense_calls(rng):
    """Good dense calls, float32 then float16: masks, lengths, windows, sinks, ALiBi, out= and
    its copy-back path. Returns the float16 (q, k) for the bad calls."""
    for dtype in (np.float32, np.float16):
        q = rng.standard_normal((2, 4, 33, 64)).astype(dtype)
        k = rng.standard_normal((2, 2, 70, 64)).astype(dtype)
        attnx.attention(q, k, k, causal=True)
        attnx.attention(q, k, k, mask=rng.random((33, 70)) < 0.7, return_lse=True, num_threads=2)
        attnx.attention(
            q.transpose(0, 2, 1, 3),
            k.transpose(0, 2, 1, 3),
            k.transpose(0, 2, 1, 3),
            layout="bshd",
            kv_lens=[70, 12],
            q_lens=[33, 3],
            window=(8, None),
            sinks=np.zeros(4, np.float32),
            alibi_slopes=np.ones(4, np.float32),
        )
        out = np.empty((2, 4, 33, 64), dtype)
        attnx.attention(q, k, k, out=out, softcap=5.0)
        attnx.attention(q, k, k, out=out[..., ::-1])  # copy-back path
    return q, k


def _bad_calls(q, k, pool):
    """Calls refused with ValueError or TypeError: their error paths must not leak either."""
    bad = [
        lambda: attnx.attention(q, k, k, scale=-1.0),
        lambda: attnx.attention(q, k[:, :, :, :3], k),
        lambda: attnx.attention(q, k, k, kv_lens=[80, 1]),
        lambda: attnx.attention(q, k, k, out=np.empty((2, 4, 33, 64), np.float32)),
        lambda: attnx.attention(q, k, k, mask=np.ones((5, 5), bool)),
        lambda: attnx.paged_attention(pool[0][:1], pool[1], pool[2], pool[3] + 999, pool[4]),
        lambda: attnx.paged_attention(pool[0], pool[1], pool[2], pool[3], pool[4], sinks=[1.0]),
    ]
    for call in bad:
        try:
            call()
        except (ValueError, TypeError):
            pass


def _decode_steps(rng, cache, seqs):
    """30 decode steps of ``seqs`` through every layer; one truncation at step 10, and at step
    20 a step made stale by a truncation (its attend refused)."""
    for step in range(30):
        st = cache.begin_step(seqs, [1] * len(seqs))
        x = rng.standard_normal((len(seqs), 2, 32)).astype(np.float32)
        for layer in range(cache.num_layers):
            st.attend(layer, rng.standard_normal((len(seqs), 4, 32)).astype(np.float32), x, x)
        if step == 10:
            cache.truncate(seqs[1], 20)
        if step == 20:
            stale = cache.begin_step([seqs[2]], [2])
            cache.truncate(seqs[2], 30)
            try:
                stale.attend(0, np.zeros((2, 4, 32), np.float32), x[:2], x[:2])
            except attnx.StaleStepError:
                pass


def _cache_calls(rng, cache):
    """A prefill, two forks, decode steps, a refused oversized step; then everything freed."""
    a = cache.new_sequence()
    st = cache.begin_step([a], [40])
    x = rng.standard_normal((40, 2, 32)).astype(np.float32)
    for layer in range(cache.num_layers):
        st.attend(layer, rng.standard_normal((40, 4, 32)).astype(np.float32), x, x)
    seqs = [a, cache.fork(a), cache.fork(a)]
    _decode_steps(rng, cache, seqs)
    try:
        cache.begin_step([seqs[0]], [10**6])
    except attnx.CacheFullError:
        pass
    for s in seqs:
        cache.free(s)
    assert cache.num_free_blocks == cache.num_blocks


def _workload(rng, cache, pool):
    """One round: ~130 calls through every entry point, good and bad."""
    q, k = _dense_calls(rng)
    _bad_calls(q, k, pool)
    for _ in range(20):
        attnx.paged_attention(*pool, q_lens=np.ones(len(pool[4]), np.int64))
    _cache_calls(rng, cache)


def _pool(rng):
    bs, nb = 8, 40
    kp = rng.standard_normal((nb, 2, bs, 32)).astype(np.float16)
    vp = rng.standard_normal((nb, 2, bs, 32)).astype(np.float16)
    lens = np.array([5, 40, 77, 1, 64])
    tables = np.stack([rng.permutation(nb)[:10] for _ in range(5)])  # shared blocks: fine here
    q = rng.standard_normal((5, 4, 32)).astype(np.float32)
    return q, kp, vp, tables, lens


@pytest.mark.skipif(not LINUX or SANITIZED, reason="VmRSS (ASan quarantines freed memory)")
def test_long_loop_keeps_memory_flat():
    rng = np.random.default_rng(20)
    cache = attnx.PagedKVCache(
        num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=64, block_size=8
    )
    pool = _pool(rng)
    for _ in range(3):  # warm-up: thread scratch, allocator arenas, lazily touched pool pages
        _workload(rng, cache, pool)
    gc.collect()
    samples = [rss_mb()]
    for _ in range(8):
        _workload(rng, cache, pool)
        gc.collect()
        samples.append(rss_mb())
    growth = samples[-1] - samples[0]
    assert growth < 12, f"RSS grew {growth:.1f} MB over 8 rounds of ~130 calls: {samples}"
    # and no steady climb: the second half grows no more than noise
    assert samples[-1] - samples[len(samples) // 2] < 6, samples


@pytest.mark.skipif(not LINUX or SANITIZED, reason="VmRSS (ASan quarantines freed memory)")
def test_short_lived_threads_leave_no_scratch():
    """Each Python thread gets its own kernel scratch (thread_local); it must go with the
    thread. 60 threads, each with ~4 MB of scratch (Dk = 4096)."""
    rng = np.random.default_rng(21)
    q = rng.standard_normal((1, 1, 64, 4096)).astype(np.float32)
    k = rng.standard_normal((1, 1, 64, 4096)).astype(np.float32)

    def one():
        attnx.attention(q, k, k, num_threads=1)

    def burst(n):
        for _ in range(n):
            t = threading.Thread(target=one)
            t.start()
            t.join()

    burst(5)
    gc.collect()
    r0 = rss_mb()
    burst(60)
    gc.collect()
    assert rss_mb() - r0 < 24, f"{rss_mb() - r0:.1f} MB kept by 60 finished threads"


@pytest.mark.skipif(not LINUX or SANITIZED, reason="getrusage(RUSAGE_THREAD); ASan allocates")
def test_repeated_chunked_prefill_faults_in_no_pages():
    """A batch of 128-token chunks onto 2048-token contexts (B4 Hkv8 D128): 32 kv heads of
    shared packed K, 1 MB each, twice what a call keeps. The kv heads take turns in a ring of
    slots the calling thread keeps (attention/plan.h plan_packed_k), so a repeated call faults in
    no new pages (a fresh 32 MB buffer each call faulted 8193 pages: a quarter of the call's
    time)."""
    import resource

    from helpers import BF16

    rng = np.random.default_rng(34)
    B, Hq, Hkv, L, D, n, bs = 4, 32, 8, 2048, 128, 128, 32
    nb = B * L // bs
    kp, vp = (rng.standard_normal((nb, Hkv, bs, D), dtype=np.float32).astype(BF16) for _ in "kv")
    tables = rng.permutation(nb).astype(np.int32).reshape(B, L // bs)
    q = rng.standard_normal((B * n, Hq, D), dtype=np.float32).astype(BF16)
    lens, q_lens, out = np.full(B, L, np.int32), np.full(B, n, np.int32), np.empty_like(q)
    faults = []
    for _ in range(3):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        attnx.paged_attention(q, kp, vp, tables, lens, q_lens=q_lens, out=out, num_threads=1)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
    assert max(faults[1:]) < 256, faults


def test_reference_counts_are_unchanged():
    """A leaked reference in the binding (on success or on an error path) keeps arrays alive."""
    rng = np.random.default_rng(22)
    q = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 11, 16)).astype(np.float32)
    out = np.empty_like(q)
    mask = rng.random((9, 11)) < 0.5
    lens = np.array([11])
    sinks = np.zeros(2, np.float32)
    pq, kp, vp, tables, sl = _pool(rng)
    objs = (q, k, out, mask, lens, sinks, pq, kp, vp, tables, sl)
    calls = [
        lambda: attnx.attention(
            q, k, k, out=out, mask=mask, kv_lens=lens, sinks=sinks, return_lse=True
        ),
        lambda: attnx.attention(q, k, k, out=out, mask=mask, kv_lens=lens, scale=-1.0),
        lambda: attnx.attention(q, k, k, out=out, mask=mask, kv_lens=lens + 5),
        lambda: attnx.attention(q, k, k, out=out.astype(np.float16), sinks=sinks[:1]),
        lambda: attnx.paged_attention(pq, kp, vp, tables, sl, sinks=sinks, return_lse=True),
        lambda: attnx.paged_attention(pq, kp, vp, tables + 1000, sl),
        lambda: attnx.paged_attention(pq, kp, vp, tables, sl, out=out),
    ]
    for call in calls:  # warm-up: caches inside numpy / pybind11
        try:
            call()
        except (ValueError, TypeError):
            pass
    before = [sys.getrefcount(x) for x in objs]
    for _ in range(50):
        for call in calls:
            try:
                call()
            except (ValueError, TypeError):
                pass
    gc.collect()
    assert [sys.getrefcount(x) for x in objs] == before


@pytest.mark.skipif(not LINUX or SANITIZED, reason="VmRSS (ASan quarantines freed memory)")
def test_cache_bookkeeping_is_proportionate():
    gc.collect()
    r0 = rss_mb()
    cache = attnx.PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=2**22, block_size=1, dtype="float16"
    )
    grown = rss_mb() - r0
    assert cache.num_free_blocks == 2**22
    assert grown < 2**22 * 8 / 2**20 + 8, f"{grown:.0f} MB committed for an untouched 8 MB pool"


# ---------------------------------------------------------------------------------------------
# error paths leave outputs unchanged
# ---------------------------------------------------------------------------------------------

PARTIAL_WRITE = (
    VM_PRELUDE
    + r"""
Dk, NB = 2**21, 2_000_000
# a thread's scratch is ~1 GiB (the row of Dk, two K tiles of 64 x Dk): room for one thread only
q = np.broadcast_to(np.full((1, 1, 1, Dk), 1e-4, np.float32), (NB, 1, 1, Dk))
v = np.ones((NB, 1, 1, 4), np.float32)
out = np.full((NB, 1, 1, 4), 7.0, np.float32)
attnx.attention(np.ones((1, 2, 300, 64), np.float32), np.ones((1, 2, 300, 64), np.float32),
                np.ones((1, 2, 300, 64), np.float32), num_threads=2)  # the team's threads exist
limit = vm() + 1600 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
try:
    attnx.attention(q, q, v, out=out, num_threads=2)
    print("result", bool(np.all(out == 1.0)))
except MemoryError:
    print("MemoryError, rows written:", int(np.sum(out[:, 0, 0, 0] != 7.0)))
"""
)


@pytest.mark.skipif(
    not LINUX or SANITIZED or cpus_here() < 2,
    reason="RLIMIT_AS; needs two cores for the race",
)
def test_memory_error_mid_call_leaves_out_unchanged():
    for _ in range(6):  # a race: the thread without scratch usually skips all items first
        rc, out, err = run_py(PARTIAL_WRITE, timeout=300)
        assert rc == 0, err[-2000:]
        assert out.startswith("result True") or out.strip() == "MemoryError, rows written: 0", out
