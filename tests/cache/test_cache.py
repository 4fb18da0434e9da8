"""attnx.PagedKVCache: steps, forks, truncation, freeing, pool figures, faults and threads.

Every attention output is compared with ``attnx.reference.attention`` on the keys and values the
test itself wrote (kept on the side, rounded to the storage dtype), never on what the cache says
it holds; every page read-back is compared bit for bit with those rows.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import attnx
from attnx import reference

from helpers import BF16, SEED, bits, cache_stepper, finish_client, make_rng

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


def assert_bits_equal(a, b, msg=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (msg, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=msg)


# ---------------------------------------------------------------------------------------------
# a shadow of what was written, and checks against it
# ---------------------------------------------------------------------------------------------


class Shadow:
    """The K and V rows written to each sequence, per layer, in the cache's storage dtype."""

    def __init__(self, cache, hq):
        self.cache = cache
        self.hq = hq
        self.rows = {}  # seq -> {"k": [layer arrays (L, Hkv, Dk)], "v": [...]}

    def empty(self):
        c = self.cache
        return {
            "k": [np.zeros((0, c.num_kv_heads, c.head_dim), c.dtype) for _ in range(c.num_layers)],
            "v": [np.zeros((0, c.num_kv_heads, c.value_dim), c.dtype) for _ in range(c.num_layers)],
        }

    def new(self):
        s = self.cache.new_sequence()
        self.rows[s] = self.empty()
        return s

    def fork(self, seq):
        c = self.cache.fork(seq)
        self.rows[c] = {kv: [a.copy() for a in self.rows[seq][kv]] for kv in ("k", "v")}
        return c

    def truncate(self, seq, length):
        self.cache.truncate(seq, length)
        for kv in ("k", "v"):
            self.rows[seq][kv] = [a[:length] for a in self.rows[seq][kv]]

    def free(self, seq):
        self.cache.free(seq)
        del self.rows[seq]

    def step(self, rng, seqs, counts, layers=None, check=True, **kw):
        """begin_step + attend on ``layers`` (default all) with random q, k, v; every output is
        checked against the reference on the shadow's rows. Returns the outputs per layer."""
        c = self.cache
        step = c.begin_step(seqs, counts)
        T = int(sum(counts))
        outs = {}
        for layer in range(c.num_layers) if layers is None else layers:
            q = rng.standard_normal((T, self.hq, c.head_dim)).astype(np.float32)
            k = rng.standard_normal((T, c.num_kv_heads, c.head_dim)).astype(np.float32)
            v = rng.standard_normal((T, c.num_kv_heads, c.value_dim)).astype(np.float32)
            o = step.attend(layer, q, k, v, **kw)
            at = 0
            for s, n in zip(seqs, counts):
                r = self.rows[s]
                r["k"][layer] = np.concatenate([r["k"][layer], k[at : at + n].astype(c.dtype)])
                r["v"][layer] = np.concatenate([r["v"][layer], v[at : at + n].astype(c.dtype)])
                at += n
            if check:
                self.check_outputs(layer, seqs, counts, q, o, **kw)
            outs[layer] = o
        return step, outs

    def check_outputs(self, layer, seqs, counts, q, o, return_lse=False, num_threads=None, **kw):
        if return_lse:
            o, lse = o
        assert o.shape == (q.shape[0], self.hq, self.cache.value_dim) and o.dtype == q.dtype
        at = 0
        for s, n in zip(seqs, counts):
            if n == 0:
                continue
            K = self.rows[s]["k"][layer].astype(np.float32)
            V = self.rows[s]["v"][layer].astype(np.float32)
            want = reference.attention(
                q[at : at + n], K, V, causal=True, layout="bshd", return_lse=return_lse, **kw
            )
            if return_lse:
                want, want_lse = want
                np.testing.assert_allclose(lse[at : at + n], want_lse.T, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(
                o[at : at + n], want, rtol=2e-5, atol=2e-5, err_msg=f"seq {s} layer {layer}"
            )
            at += n

    def readback(self, seq, layer):
        c = self.cache
        n = c.length(seq)
        bt = c.block_table(seq)
        assert len(bt) == -(-n // c.block_size), (seq, n, bt)
        t = np.arange(n)
        blk, off = bt[t // c.block_size], t % c.block_size
        return c.k_pages(layer)[blk, :, off], c.v_pages(layer)[blk, :, off]

    def check_pages(self, seqs=None):
        for s in self.rows if seqs is None else seqs:
            assert self.cache.length(s) == len(self.rows[s]["k"][0])
            for layer in range(self.cache.num_layers):
                k, v = self.readback(s, layer)
                assert_bits_equal(k, self.rows[s]["k"][layer], f"k of seq {s} layer {layer}")
                assert_bits_equal(v, self.rows[s]["v"][layer], f"v of seq {s} layer {layer}")


def check_pool(cache):
    """No block leaked: free + distinct held == num_blocks; refcounts == holders."""
    held = {}
    for s in cache.sequences:
        bt = cache.block_table(s).tolist()
        assert len(set(bt)) == len(bt)
        for b in bt:
            held[b] = held.get(b, 0) + 1
    free = cache._free_ids()
    assert len(set(free)) == len(free), "a block is free twice"
    assert not set(free) & set(held), "a free block is held"
    assert len(free) + len(held) == cache.num_blocks, "a block leaked"
    refs = np.zeros(cache.num_blocks, np.int64)
    for b, n in held.items():
        refs[b] = n
    np.testing.assert_array_equal(cache._refs, refs)
    assert cache.num_free_blocks == len(free)
    assert cache.num_used_blocks == len(held)


def snapshot(cache):
    return {
        "free": cache._free_ids(),
        "refs": cache._refs.copy(),
        "next_id": cache._next_id,
        "seqs": {
            s: (cache.length(s), cache.block_table(s).tolist(), cache._seqs[s].version)
            for s in cache.sequences
        },
        "k": cache._k.copy(),
        "v": cache._v.copy(),
        "stats": cache.stats(),
        "num_free": cache.num_free_blocks,
        "num_used": cache.num_used_blocks,
    }


def assert_unchanged(cache, snap):
    now = snapshot(cache)
    for key in ("free", "next_id", "seqs", "stats", "num_free", "num_used"):
        assert now[key] == snap[key], key
    np.testing.assert_array_equal(now["refs"], snap["refs"])
    assert_bits_equal(now["k"], snap["k"], "k pages")
    assert_bits_equal(now["v"], snap["v"], "v pages")


def small_cache(**kw):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=32, block_size=4)
    args.update(kw)
    return attnx.PagedKVCache(**args)


# ---------------------------------------------------------------------------------------------
# the issue's loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_issue_loop_prefill_then_decode(isa, dtype):
    rng = make_rng(1, len(dtype))
    cache = attnx.PagedKVCache(
        num_layers=4, num_kv_heads=3, head_dim=64, num_blocks=64, block_size=16, dtype=dtype
    )
    assert cache.dtype == DTYPES[dtype]
    sh = Shadow(cache, hq=6)
    a, b = sh.new(), sh.new()
    assert cache.length(a) == cache.length(b) == 0 and cache.block_table(a).shape == (0,)
    step, _ = sh.step(rng, [a, b], [7, 3])
    np.testing.assert_array_equal(step.q_lens, [7, 3])
    np.testing.assert_array_equal(step.seq_lens, [7, 3])
    np.testing.assert_array_equal(step.positions, [0, 1, 2, 3, 4, 5, 6, 0, 1, 2])
    assert step.positions.dtype == np.int32 and step.num_tokens == 10
    sh.check_pages()
    for _ in range(12):  # decode steps, crossing a block edge for a at 16
        sh.step(rng, [a, b], [1, 1])
    # chunked prefill of b next to a decode token of a, in the other order
    step, _ = sh.step(rng, [b, a], [20, 1])
    np.testing.assert_array_equal(step.positions, list(range(15, 35)) + [19])
    sh.check_pages()
    assert cache.length(a) == 20 and cache.length(b) == 35
    assert cache.num_used_blocks == 2 + 3
    check_pool(cache)


def test_step_attributes_and_slots():
    rng = make_rng(2)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [6, 2])
    step = cache.begin_step([b, a], [3, 0])
    assert step.seq_ids == [b, a]
    np.testing.assert_array_equal(step.seq_lens, [5, 6])
    np.testing.assert_array_equal(step.positions, [2, 3, 4])
    bt = cache.block_table(b)
    np.testing.assert_array_equal(step.block_tables[0, : len(bt)], bt)
    np.testing.assert_array_equal(step.slots, [bt[0] * 4 + 2, bt[0] * 4 + 3, bt[1] * 4 + 0])
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    step.attend(1, rng.standard_normal((3, 2, 8)).astype(np.float32), k, k)
    flat = cache.k_pages(1).transpose(0, 2, 1, 3).reshape(-1, 2, 8)  # (slot, Hkv, D)
    np.testing.assert_array_equal(flat[step.slots], k)


def test_pages_are_zero_copy_views():
    cache = small_cache(value_dim=5)
    kp, vp = cache.k_pages(1), cache.v_pages(1)
    assert kp.shape == (32, 2, 4, 8) and vp.shape == (32, 2, 4, 5)
    assert np.shares_memory(kp, cache._k) and np.shares_memory(vp, cache._v)
    a = cache.new_sequence()
    step = cache.begin_step([a], [1])
    k = np.full((1, 2, 8), 3.0, np.float32)
    step.attend(1, np.ones((1, 2, 8), np.float32), k, np.ones((1, 2, 5), np.float32))
    b = cache.block_table(a)[0]
    assert (kp[b, :, 0] == 3.0).all()  # visible through the view taken before the step
    assert (cache.k_pages(0)[b] == 0).all()  # layer 0 untouched


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_pages_start_on_a_page_boundary(dtype):
    """Every page array (keys, values, scales) starts on 4 KiB, so a block of 64-byte rows never
    straddles cache lines (NumPy's own large arrays start 16 bytes past a boundary)."""
    cache = attnx.PagedKVCache(
        num_layers=3, num_kv_heads=2, head_dim=64, num_blocks=8, block_size=16, dtype=dtype
    )
    arrays = [cache._k, cache._v, cache._k_scales, cache._v_scales]
    arrays += [cache.k_pages(i) for i in range(3)] + [cache.v_pages(i) for i in range(3)]
    for a in arrays:
        if a is not None:
            assert a.ctypes.data % 4096 == 0 and a.flags.c_contiguous and a.flags.writeable
            assert not a.any()


def test_aligned_zeros():
    from attnx.cache.memory import aligned_copy, aligned_zeros

    for shape, dt, align in [
        ((3, 5), np.float16, 64),
        ((0, 7), np.float32, 4096),
        ((9,), BF16, 128),
    ]:
        a = aligned_zeros(shape, dt, align)
        assert a.shape == shape and a.dtype == dt and not a.any()
        assert a.size == 0 or a.ctypes.data % align == 0
    src = make_rng(SEED).standard_normal((4, 3, 5)).astype(np.float32)[:, ::2]
    c = aligned_copy(src)
    assert c.ctypes.data % 4096 == 0 and c.flags.c_contiguous and np.array_equal(c, src)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_value_dim_differs(dtype):
    rng = make_rng(3, len(dtype))
    cache = small_cache(head_dim=16, value_dim=6, dtype=dtype)
    sh = Shadow(cache, hq=4)
    a, b = sh.new(), sh.new()
    _, outs = sh.step(rng, [a, b], [5, 9])
    assert outs[0].shape == (14, 4, 6)
    sh.step(rng, [a, b], [1, 1])
    sh.check_pages()


def test_variants_through_the_cache(isa):
    """window / softcap / sinks / alibi / scale / return_lse reach the kernel unchanged."""
    rng = make_rng(4)
    cache = small_cache(num_blocks=64, dtype="float16")
    sh = Shadow(cache, hq=4)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [13, 6])
    for kw in (
        dict(window=(3, None)),
        dict(window=[np.int64(2), 1]),
        dict(softcap=3.0),
        dict(scale=0.25),
        dict(sinks=rng.standard_normal(4).astype(np.float32)),
        dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32)),
        dict(return_lse=True),
        dict(num_threads=1),
    ):
        sh.step(rng, [a, b], [2, 1], **kw)


def test_dtype_arguments():
    assert small_cache(dtype=np.float16).dtype == np.float16
    assert small_cache(dtype=BF16).dtype == BF16
    assert small_cache(dtype="bfloat16").k_pages(0).dtype == BF16
    with pytest.raises(TypeError, match="dtype"):
        small_cache(dtype="float64")
    with pytest.raises(TypeError, match="dtype"):
        small_cache(dtype=np.int16)  # (int8 is a quantised cache since issue 13: test_quant_kv.py)
    with pytest.raises(TypeError, match="dtype"):
        small_cache(dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# fork and copy-on-write
# ---------------------------------------------------------------------------------------------


def test_fork_copy_on_write_both_diverge():
    rng = make_rng(5)
    cache = small_cache()
    sh = Shadow(cache, hq=4)
    a = sh.new()
    sh.step(rng, [a], [10])  # blocks: 4 + 4 + 2 (last partly filled)
    bt_a = cache.block_table(a)
    assert cache.num_used_blocks == 3
    c = sh.fork(a)
    np.testing.assert_array_equal(cache.block_table(c), bt_a)
    assert cache.num_used_blocks == 3 and cache.length(c) == 10
    np.testing.assert_array_equal(cache._refs[bt_a], [2, 2, 2])
    check_pool(cache)

    # the child writes first: only its partly filled last block is copied
    sh.step(rng, [c], [1])
    bt_c = cache.block_table(c)
    np.testing.assert_array_equal(bt_c[:2], bt_a[:2])
    assert bt_c[2] != bt_a[2]
    np.testing.assert_array_equal(cache.block_table(a), bt_a)
    assert cache.num_used_blocks == 4
    np.testing.assert_array_equal(cache._refs[bt_a], [2, 2, 1])
    assert cache._refs[bt_c[2]] == 1
    sh.check_pages()  # a's data unchanged by c's write

    # now the parent writes into its (no longer shared) last block in place, then grows
    sh.step(rng, [a], [5])
    np.testing.assert_array_equal(cache.block_table(a)[:3], bt_a)
    assert cache.num_used_blocks == 5
    sh.check_pages()  # c's data unchanged by a's writes
    # both diverge further in one batch
    sh.step(rng, [a, c], [3, 7])
    sh.check_pages()
    check_pool(cache)


def test_fork_both_in_one_step_and_exactly_full_pool():
    """Parent and child write in the same step: one copy, the second keeps the block. With
    exactly one free block that step fits."""
    rng = make_rng(6)
    cache = small_cache(num_blocks=3)
    sh = Shadow(cache, hq=2)
    a = sh.new()
    sh.step(rng, [a], [6])
    c = sh.fork(a)
    assert cache.num_free_blocks == 1
    sh.step(rng, [a, c], [1, 1])
    assert cache.num_free_blocks == 0
    bt_a, bt_c = cache.block_table(a), cache.block_table(c)
    assert bt_a[0] == bt_c[0] and bt_a[1] != bt_c[1]
    sh.check_pages()
    check_pool(cache)


def test_fork_at_block_edge_and_forks_of_forks():
    rng = make_rng(7)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    a = sh.new()
    sh.step(rng, [a], [8])  # two full blocks
    c = sh.fork(a)
    d = sh.fork(c)
    np.testing.assert_array_equal(cache._refs[cache.block_table(a)], [3, 3])
    used = cache.num_used_blocks
    sh.step(rng, [c], [1])  # nothing to copy: a fresh block
    np.testing.assert_array_equal(cache.block_table(c)[:2], cache.block_table(a))
    assert cache.num_used_blocks == used + 1
    e = sh.fork(c)  # shares c's partly filled last block
    sh.step(rng, [e, d, a], [2, 3, 1])
    sh.check_pages()
    check_pool(cache)
    for s in (a, c, d, e):
        sh.free(s)
    assert cache.num_free_blocks == cache.num_blocks
    check_pool(cache)


def test_fork_then_free_parent_keeps_child():
    rng = make_rng(8)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    a = sh.new()
    sh.step(rng, [a], [9])
    c = sh.fork(a)
    used = cache.num_used_blocks
    sh.free(a)
    assert cache.num_used_blocks == used  # all still held by c
    sh.check_pages()
    sh.step(rng, [c], [4])  # c's last block is no longer shared: no copy
    assert cache.num_used_blocks == used + 1
    sh.check_pages()
    check_pool(cache)


# ---------------------------------------------------------------------------------------------
# truncate, free, pool figures
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_truncate_then_append(dtype):
    rng = make_rng(9, len(dtype))
    cache = small_cache(dtype=dtype)
    sh = Shadow(cache, hq=4)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [13, 5])
    assert len(cache.block_table(a)) == 4
    free = cache.num_free_blocks
    sh.truncate(a, 6)
    assert cache.length(a) == 6 and len(cache.block_table(a)) == 2
    assert cache.num_free_blocks == free + 2
    sh.check_pages()
    sh.step(rng, [a], [5])  # rewrites slots 6.. (the old tokens 6, 7 of block 1 are replaced)
    sh.check_pages()
    sh.truncate(a, 11)  # no-op
    sh.truncate(a, 8)  # an exact block edge
    assert len(cache.block_table(a)) == 2
    sh.step(rng, [a, b], [1, 2])
    sh.check_pages()
    sh.truncate(a, 0)
    assert cache.length(a) == 0 and cache.block_table(a).shape == (0,)
    sh.step(rng, [a], [3])
    sh.check_pages()
    check_pool(cache)


def test_truncate_inside_a_shared_block_copies_on_next_write():
    rng = make_rng(10)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    a = sh.new()
    sh.step(rng, [a], [12])
    c = sh.fork(a)
    sh.truncate(c, 6)  # c's last block (block 1) is shared with a and now partly filled
    bt = cache.block_table(a)
    np.testing.assert_array_equal(cache._refs[bt], [2, 2, 1])
    sh.step(rng, [c], [3])  # must not overwrite a's tokens 6..8
    assert cache.block_table(c)[1] != bt[1]
    sh.check_pages()
    check_pool(cache)


def test_free_returns_blocks():
    rng = make_rng(11)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    seqs = [sh.new() for _ in range(4)]
    sh.step(rng, seqs, [3, 9, 0, 16])
    assert cache.num_used_blocks == 1 + 3 + 0 + 4
    sh.free(seqs[1])
    assert cache.num_used_blocks == 5
    assert seqs[1] not in cache.sequences
    for s in (seqs[0], seqs[2], seqs[3]):
        sh.free(s)
    assert cache.num_free_blocks == cache.num_blocks and cache.sequences == []
    st = cache.stats()
    assert st["used_blocks"] == 0 and st["bytes_used"] == 0 and st["utilisation"] == 1.0
    check_pool(cache)


def test_utilisation_100_sequences():
    rng = make_rng(12)
    lengths = rng.integers(1, 2001, size=100)
    need = int(np.sum(-(-lengths // 16)))
    cache = attnx.PagedKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        num_blocks=need + 37,
        block_size=16,
        dtype="float16",
    )
    seqs = [cache.new_sequence() for _ in lengths]
    # grow in three batched rounds of random chunks (some 0), in a random order each round
    cuts = np.sort(rng.integers(0, lengths[:, None] + 1, size=(100, 2)), axis=1)
    chunks = np.stack([cuts[:, 0], cuts[:, 1] - cuts[:, 0], lengths - cuts[:, 1]], axis=1)
    for r in range(3):
        order = rng.permutation(100)
        step = cache.begin_step([seqs[i] for i in order], [int(chunks[i, r]) for i in order])
        if r == 0:
            T = step.num_tokens
            x = np.ones((T, 1, 2), np.float32)
            step.attend(0, x, x, x)
    assert [cache.length(s) for s in seqs] == lengths.tolist()
    assert cache.num_used_blocks == need
    st = cache.stats()
    assert st["used_blocks"] == need and st["free_blocks"] == 37
    assert st["tokens_stored"] == st["logical_tokens"] == int(lengths.sum())
    assert st["slots_held"] == need * 16
    assert st["utilisation"] == pytest.approx(lengths.sum() / (need * 16))
    assert st["sequences"] == 100
    assert st["bytes_per_token"] == 1 * 1 * (2 + 2) * 2
    assert st["bytes_used"] == need * cache.bytes_per_block == need * 16 * 8
    assert st["bytes_total"] == (need + 37) * 16 * 8
    check_pool(cache)
    # forks share: physical slots counted once, logical tokens twice
    for s in seqs[:10]:
        cache.fork(s)
    st2 = cache.stats()
    assert st2["used_blocks"] == need and st2["tokens_stored"] == st["tokens_stored"]
    assert st2["logical_tokens"] == st["logical_tokens"] + int(lengths[:10].sum())
    # free half: exactly their unshared blocks come back
    for s in seqs[50:]:
        cache.free(s)
    assert cache.num_used_blocks == int(np.sum(-(-lengths[:50] // 16)))
    check_pool(cache)


# ---------------------------------------------------------------------------------------------
# faults: a full pool, unknown ids, stale steps, bad arguments
# ---------------------------------------------------------------------------------------------


def test_cache_full_changes_nothing():
    rng = make_rng(13)
    cache = small_cache(num_blocks=6)
    sh = Shadow(cache, hq=2)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [10, 8])  # 3 + 2 blocks
    c = sh.fork(a)
    pending = cache.begin_step([b], [0])  # a pending step must survive the failure
    assert cache.num_free_blocks == 1
    for seqs, counts in (
        ([b, a], [1, 3]),  # b fits (1 block), then a needs a copy + 1
        ([a], [3]),  # copy-on-write + 1 new block
        ([c, b], [2, 13]),
        ([b], [5]),
    ):
        snap = snapshot(cache)
        with pytest.raises(attnx.CacheFullError, match="free blocks"):
            cache.begin_step(seqs, counts)
        assert_unchanged(cache, snap)
    pending.attend(
        0,
        np.zeros((0, 2, 8), np.float32),
        np.zeros((0, 2, 8), np.float32),
        np.zeros((0, 2, 8), np.float32),
    )
    sh.step(rng, [b], [4])  # exactly the last block
    assert cache.num_free_blocks == 0
    sh.check_pages()
    check_pool(cache)
    assert issubclass(attnx.CacheFullError, RuntimeError)


def test_unknown_and_freed_ids():
    rng = make_rng(14)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [5, 3])
    sh.free(b)
    new = cache.new_sequence()
    assert new not in (a, b)  # ids are never reused
    cache.free(new)
    for bad in (b, new, 999, -1, "a", None, 1.5, (0,), [0]):
        snap = snapshot(cache)
        for op in (
            lambda: cache.fork(bad),
            lambda: cache.truncate(bad, 0),
            lambda: cache.free(bad),
            lambda: cache.length(bad),
            lambda: cache.block_table(bad),
        ):
            with pytest.raises(KeyError):
                op()
        # an unhashable id cannot even be checked for duplicates: TypeError is fine there
        with pytest.raises(KeyError if not isinstance(bad, list) else (KeyError, TypeError)):
            cache.begin_step([a, bad], [1, 1])
        assert_unchanged(cache, snap)
    sh.check_pages()


def test_stale_steps():
    rng = make_rng(15)
    cache = small_cache()
    sh = Shadow(cache, hq=2)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [5, 6])
    x = np.ones((3, 2, 8), np.float32)

    for spoil in (
        lambda: sh.truncate(a, 4),
        lambda: sh.free(a),
        lambda: cache.begin_step([a], [0]),
    ):
        la, lb = cache.length(a), cache.length(b)
        step = cache.begin_step([b, a], [2, 1])
        spoil()
        snap = snapshot(cache)
        with pytest.raises(attnx.StaleStepError):
            step.attend(0, x, x, x)
        with pytest.raises(attnx.StaleStepError):
            step.attend(1, x, x, x)
        assert_unchanged(cache, snap)  # nothing written
        # roll back the reservations that were never written (the shadow never saw them)
        cache.truncate(b, lb)
        if a in sh.rows:
            cache.truncate(a, min(la, cache.length(a)))
        sh.check_pages()
        if a not in sh.rows:
            a = sh.new()
            sh.step(rng, [a], [5])
    # a step that is current is not stale
    sh.step(rng, [a, b], [1, 1])
    check_pool(cache)


def _pending():
    """A cache with data and a pending step over two sequences (3 + 2 new tokens)."""
    rng = make_rng(16)
    cache = small_cache(value_dim=6)
    sh = Shadow(cache, hq=4)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [5, 7])
    step = cache.begin_step([a, b], [3, 2])
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((5, 2, 6)).astype(np.float32)
    return cache, sh, step, a, b, q, k, v


def _bad_attend(**over):
    def op(cache, step, a, b, q, k, v):
        args = dict(layer=0, q=q, k=k, v=v)
        kw = {key: val for key, val in over.items() if key not in args}
        for key, val in over.items():
            if key in args:
                args[key] = val(args[key]) if callable(val) else val
        step.attend(args["layer"], args["q"], args["k"], args["v"], **kw)

    return op


BAD_OPS = {
    # begin_step
    "negative_count": (
        lambda c, s, a, b, *_: c.begin_step([a], [-1]),
        ValueError,
        "num_new_tokens",
    ),
    "float_count": (lambda c, s, a, b, *_: c.begin_step([a], [1.5]), ValueError, "num_new_tokens"),
    "bool_count": (lambda c, s, a, b, *_: c.begin_step([a], [True]), ValueError, "num_new_tokens"),
    "duplicate_ids": (
        lambda c, s, a, b, *_: c.begin_step([a, b, a], [1, 1, 1]),
        ValueError,
        "seq_ids",
    ),
    "mismatched_lengths": (
        lambda c, s, a, b, *_: c.begin_step([a, b], [1]),
        ValueError,
        "num_new_tokens",
    ),
    "huge_count": (
        lambda c, s, a, b, *_: c.begin_step([a], [2**40]),
        attnx.CacheFullError,
        "free blocks",
    ),
    # truncate
    "truncate_negative": (lambda c, s, a, b, *_: c.truncate(a, -1), ValueError, "length"),
    "truncate_longer": (lambda c, s, a, b, *_: c.truncate(a, 9), ValueError, "length"),
    "truncate_float": (lambda c, s, a, b, *_: c.truncate(a, 2.0), ValueError, "length"),
    # layers
    "k_pages_layer": (lambda c, s, *_: c.k_pages(2), ValueError, "layer"),
    "v_pages_layer": (lambda c, s, *_: c.v_pages(-1), ValueError, "layer"),
    "attend_layer_high": (_bad_attend(layer=2), ValueError, "layer"),
    "attend_layer_negative": (_bad_attend(layer=-1), ValueError, "layer"),
    "attend_layer_bool": (_bad_attend(layer=True), ValueError, "layer"),
    "attend_layer_str": (_bad_attend(layer="0"), ValueError, "layer"),
    # q
    "q_rank": (_bad_attend(q=lambda q: q[:, 0]), ValueError, "q"),
    "q_tokens": (_bad_attend(q=lambda q: q[:4]), ValueError, "q"),
    "q_dim": (_bad_attend(q=lambda q: q[..., :7]), ValueError, "q"),
    "q_heads": (_bad_attend(q=lambda q: q[:, :3]), ValueError, "kv heads"),
    "q_float64": (_bad_attend(q=lambda q: q.astype(np.float64)), TypeError, "q"),
    "q_int": (_bad_attend(q=lambda q: q.astype(np.int64)), TypeError, "q"),
    # k
    "k_tokens": (_bad_attend(k=lambda k: k[:4]), ValueError, "k"),
    "k_heads": (_bad_attend(k=lambda k: k[:, :1]), ValueError, "k"),
    "k_dim": (_bad_attend(k=lambda k: k[..., :6]), ValueError, "k"),
    "k_rank": (_bad_attend(k=lambda k: k[:, 0]), ValueError, "k"),
    "k_float64": (_bad_attend(k=lambda k: k.astype(np.float64)), TypeError, "k"),
    # v: checked before k is written
    "v_tokens": (_bad_attend(v=lambda v: v[:4]), ValueError, "v"),
    "v_dim": (_bad_attend(v=lambda v: v[..., :5]), ValueError, "v"),
    "v_heads": (_bad_attend(v=lambda v: v[:, :1]), ValueError, "v"),
    "v_float64": (_bad_attend(v=lambda v: v.astype(np.float64)), TypeError, "v"),
    "v_list": (_bad_attend(v=lambda v: v.tolist()), TypeError, "v"),
    "v_none": (_bad_attend(v=None), (TypeError, ValueError), "v"),
    # options
    "scale": (_bad_attend(scale=-1.0), ValueError, "scale"),
    "window": (_bad_attend(window=(-2, 0)), ValueError, "window"),
    "window_int": (_bad_attend(window=5), ValueError, "window"),
    "window_float_side": (_bad_attend(window=(1.5, None)), TypeError, "window"),
    "softcap_str": (_bad_attend(softcap="2"), TypeError, "softcap"),
    "softcap_negative": (_bad_attend(softcap=-1.0), ValueError, "softcap"),
    "sinks": (_bad_attend(sinks=np.zeros(3, np.float32)), ValueError, "sinks"),
    "num_threads": (_bad_attend(num_threads=0), ValueError, "num_threads"),
}


@pytest.mark.parametrize("case", list(BAD_OPS))
def test_bad_arguments_change_nothing(case):
    op, exc, name = BAD_OPS[case]
    cache, sh, step, a, b, q, k, v = _pending()
    snap = snapshot(cache)
    with pytest.raises(exc, match=name):
        op(cache, step, a, b, q, k, v)
    assert_unchanged(cache, snap)
    # the pending step is still good and still correct
    o = step.attend(0, q, k, v)
    for s, kk, vv in ((a, k[:3], v[:3]), (b, k[3:], v[3:])):
        for kv, x in (("k", kk), ("v", vv)):
            sh.rows[s][kv][0] = np.concatenate([sh.rows[s][kv][0], x])
    sh.check_outputs(0, [a, b], [3, 2], q, o)
    for s in (a, b):
        kk, vv = sh.readback(s, 0)
        assert_bits_equal(kk, sh.rows[s]["k"][0])
        assert_bits_equal(vv, sh.rows[s]["v"][0])
    check_pool(cache)


@pytest.mark.parametrize(
    "kw, exc, name",
    [
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(num_kv_heads=-1), ValueError, "num_kv_heads"),
        (dict(head_dim=2.0), ValueError, "head_dim"),
        (dict(num_blocks=True), ValueError, "num_blocks"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(value_dim=0), ValueError, "value_dim"),
        (dict(num_blocks=2**27, block_size=16), ValueError, "num_blocks"),
        (dict(dtype="int16"), TypeError, "dtype"),  # (int8: a quantised cache since issue 13)
        (dict(dtype="float8_e4m3fnuz"), TypeError, "dtype"),
    ],
)
def test_constructor_arguments(kw, exc, name):
    with pytest.raises(exc, match=name):
        small_cache(**kw)


def test_zero_token_steps():
    """A step where every sequence adds 0 tokens (and an empty step) is valid."""
    rng = make_rng(17)
    cache = small_cache()
    sh = Shadow(cache, hq=4)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [3, 0])
    snap = snapshot(cache)
    _, outs = sh.step(rng, [a, b], [0, 0])
    assert outs[0].shape == (0, 4, 8)
    o, lse = cache.begin_step([], []).attend(
        1,
        np.zeros((0, 4, 8), np.float32),
        np.zeros((0, 2, 8), np.float32),
        np.zeros((0, 2, 8), np.float32),
        return_lse=True,
    )
    assert o.shape == (0, 4, 8) and lse.shape == (0, 4)
    assert snapshot(cache)["seqs"][a][:2] == snap["seqs"][a][:2]
    assert_bits_equal(cache._k, snap["k"])
    with pytest.raises(ValueError, match="v"):
        cache.begin_step([a], [0]).attend(
            0,
            np.zeros((0, 4, 8), np.float32),
            np.zeros((0, 2, 8), np.float32),
            np.zeros((0, 2, 7), np.float32),
        )
    sh.step(rng, [b, a], [2, 0])
    sh.check_pages()


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------


def _script(cache, seed, barrier=None):
    """One client's work on its own sequences; returns every output, in order."""
    rng = np.random.default_rng([SEED, 18, seed])
    outs = []
    step = cache_stepper(cache, rng, outs)
    if barrier is not None:
        barrier.wait()
    a = cache.new_sequence()
    step([a], [int(rng.integers(20, 200))])
    for _ in range(15):
        step([a], [1])
    c = cache.fork(a)
    step([c, a], [3, 2])
    cache.truncate(a, cache.length(a) - 4)
    step([a], [5])
    for _ in range(10):
        step([a, c], [1, 1])
    return finish_client(cache, outs, a, c)


def test_threads_match_serial():
    def make():
        return attnx.PagedKVCache(
            num_layers=2,
            num_kv_heads=2,
            head_dim=32,
            num_blocks=400,
            block_size=8,
            dtype="float16",
            value_dim=16,
        )

    n = 4
    serial_cache = make()
    serial = [_script(serial_cache, i) for i in range(n)]
    cache = make()
    for _ in range(5):
        results = [None] * n
        errors = []
        barrier = threading.Barrier(n)

        def run(i):
            try:
                results[i] = _script(cache, i, barrier)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i in range(n):
            assert len(results[i]) == len(serial[i])
            for got, want in zip(results[i], serial[i]):
                np.testing.assert_array_equal(got, want)
        assert cache.num_free_blocks == cache.num_blocks
        check_pool(cache)


def test_threads_bookkeeping_no_leak():
    """Threads creating, forking, stepping, truncating and freeing their own sequences at once
    leave a consistent pool; CacheFullError under contention changes nothing it should not."""
    cache = attnx.PagedKVCache(
        num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=40, block_size=2
    )
    errors = []

    def run(i):
        rng = np.random.default_rng([SEED, 19, i])
        mine = []
        try:
            for _ in range(300):
                r = rng.random()
                if r < 0.2 or not mine:
                    mine.append(cache.new_sequence())
                elif r < 0.35:
                    mine.append(cache.fork(mine[rng.integers(len(mine))]))
                elif r < 0.75:
                    s = mine[rng.integers(len(mine))]
                    n = int(rng.integers(0, 6))
                    try:
                        st = cache.begin_step([s], [n])
                    except attnx.CacheFullError:
                        continue
                    x = np.ones((n, 1, 4), np.float32)
                    st.attend(0, x, x, x)
                elif r < 0.85:
                    s = mine[rng.integers(len(mine))]
                    cache.truncate(s, int(rng.integers(0, cache.length(s) + 1)))
                else:
                    cache.free(mine.pop(rng.integers(len(mine))))
            for s in mine:
                cache.free(s)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_pool(cache)
    assert cache.num_free_blocks == cache.num_blocks
