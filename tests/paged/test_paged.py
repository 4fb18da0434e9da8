"""attnx.paged_attention (C++) against attnx.reference.paged_attention (NumPy, float64).

Every pool here is scrambled: each sequence's blocks are a random draw from a random permutation
of the pool, every page that no table names is NaN, so are the unused slots at the tail of each
sequence's last block, and the table columns past a sequence's last block hold junk ids (out of
range) that must never be read. A result that stays finite and matches the reference therefore
shows that the kernel read exactly the slots its tables name and nothing else.

Kernel tests run under every instruction set the CPU offers (fixture ``isa`` of conftest.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnx
from attnx import reference

from helpers import BF16, make_rng, scramble_tables

KV_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
JUNK = 1 << 20  # a block id far outside every pool here: table columns past a sequence's end


# ---------------------------------------------------------------------------------------------
# scrambled pools
# ---------------------------------------------------------------------------------------------


class Pool:
    """A K/V pool with scrambled block tables; every slot no sequence owns is NaN."""

    def __init__(
        self,
        rng,
        seq_lens,
        *,
        block_size,
        hkv,
        dk,
        dv,
        dtype="float32",
        spare=3,
        extra_cols=2,
        num_blocks=None,
    ):
        dt = KV_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
        self.seq_lens = np.asarray(seq_lens, dtype=np.int64)
        self.block_size = block_size
        need = -(-self.seq_lens // block_size)
        total = int(need.sum())
        nb = total + spare if num_blocks is None else num_blocks
        assert nb >= total
        self.num_blocks = nb
        k = rng.standard_normal((nb, hkv, block_size, dk))
        v = rng.standard_normal((nb, hkv, block_size, dv))
        self.k_pages = k.astype(dt)
        self.v_pages = v.astype(dt)
        self.block_tables, owned = scramble_tables(
            rng, self.seq_lens, block_size, nb, int(need.max(initial=0)) + extra_cols, JUNK
        )
        # poison everything the kernel must not read
        self.k_pages.transpose(0, 2, 1, 3)[~owned] = np.nan
        self.v_pages.transpose(0, 2, 1, 3)[~owned] = np.nan

    def gather(self, b):
        """Sequence b's keys and values as contiguous float32 ``(L, Hkv, D)`` arrays."""
        n = int(self.seq_lens[b])
        ids = self.block_tables[b, : -(-n // self.block_size)]

        def g(pages):
            x = pages[ids].astype(np.float32).transpose(0, 2, 1, 3)
            return x.reshape(-1, x.shape[2], x.shape[3])[:n]

        return g(self.k_pages), g(self.v_pages)


def tol(dtype):
    dt = np.dtype(dtype)
    if dt == np.float32:
        return dict(rtol=2e-5, atol=2e-5)
    if dt == np.float16:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=1.6e-2, atol=1.6e-2)


def assert_close(actual, expected, dtype=np.float32, **kw):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    t = tol(dtype)
    t.update(kw)
    a = actual.astype(np.float64)
    e = expected.astype(np.float64)
    assert np.isfinite(a[np.isfinite(e)]).all(), "non-finite result where the reference is finite"
    np.testing.assert_allclose(a, e, **t)


def packed_q(rng, q_lens, hq, dk, dtype=np.float32):
    n = int(np.sum(q_lens))
    return rng.standard_normal((n, hq, dk)).astype(dtype)


def run_both(q, pool, q_lens=None, **kw):
    """Kernel and reference on the same arguments; checks lse too when asked."""
    args = (q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens)
    got = attnx.paged_attention(*args, q_lens=q_lens, **kw)
    want = reference.paged_attention(
        *args, q_lens=q_lens, **{k: v for k, v in kw.items() if k not in ("out", "num_threads")}
    )
    return got, want


# ---------------------------------------------------------------------------------------------
# decode, prefill, mixed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_ragged(isa, kv_dtype, block_size):
    rng = make_rng(1, block_size, len(kv_dtype))
    seq_lens = [1, block_size, 2 * block_size, 3 * block_size + 1, 37, 100, 5]
    pool = Pool(rng, seq_lens, block_size=block_size, hkv=2, dk=32, dv=32, dtype=kv_dtype)
    q = packed_q(rng, np.ones(len(seq_lens)), 8, 32)
    (o, lse), (ro, rlse) = run_both(q, pool, return_lse=True)
    assert_close(o, ro)
    assert lse.dtype == np.float32 and lse.shape == (len(seq_lens), 8)
    assert_close(lse, rlse)


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prefill_chunks_and_decode_mixed(isa, kv_dtype, block_size):
    """One call: an empty sequence, decode tokens, a whole prompt, chunks of a longer one."""
    rng = make_rng(2, block_size, len(kv_dtype))
    bs = block_size
    seq_lens = [0, 1, 40, 2 * bs, 57, 3 * bs + 5, 9]
    q_lens = [0, 1, 40, bs, 1, 7, 0]  # prompt (q == kv), chunk ending on a block edge, decode, ...
    pool = Pool(rng, seq_lens, block_size=bs, hkv=2, dk=16, dv=16, dtype=kv_dtype)
    q = packed_q(rng, q_lens, 8, 16)
    (o, lse), (ro, rlse) = run_both(q, pool, q_lens=np.array(q_lens), return_lse=True)
    assert_close(o, ro)
    assert_close(lse, rlse)
    # non-causal chunks too
    o, ro = run_both(q, pool, q_lens=np.array(q_lens), causal=False)
    assert_close(o, ro)


def test_long_sequence_split_kv(isa):
    """B=1 and a 5000-token context: the kernel splits the KV range across threads."""
    rng = make_rng(3)
    pool = Pool(rng, [5000], block_size=16, hkv=2, dk=64, dv=64, dtype="float16")
    q = packed_q(rng, [1], 8, 64)
    results = []
    for threads in (1, 2, 4, None):
        (o, lse), (ro, rlse) = run_both(q, pool, return_lse=True, num_threads=threads)
        assert_close(o, ro, atol=3e-5, rtol=3e-5)
        assert_close(lse, rlse, atol=3e-5, rtol=3e-5)
        results.append(o)
    # a chunk of 3 queries at the end of the same context
    q3 = packed_q(rng, [3], 8, 64)
    o, ro = run_both(q3, pool, q_lens=np.array([3]), num_threads=2)
    assert_close(o, ro, atol=3e-5, rtol=3e-5)
    # a long and a short sequence together
    pool2 = Pool(rng, [4999, 3], block_size=16, hkv=2, dk=32, dv=32)
    q2 = packed_q(rng, [2, 3], 8, 32)
    o, ro = run_both(q2, pool2, q_lens=np.array([2, 3]), num_threads=2)
    assert_close(o, ro, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize(
    "hq,hkv,dk,dv",
    [
        (8, 2, 32, 32),  # GQA
        (4, 1, 32, 32),  # MQA
        (4, 4, 32, 32),  # MHA
        (4, 2, 48, 16),  # Dk != Dv
        (16, 1, 576, 512),  # MLA-like (absorbed): one latent kv head, Dk=576, Dv=512
    ],
)
def test_head_layouts(isa, hq, hkv, dk, dv):
    rng = make_rng(4, hq, hkv, dk, dv)
    seq_lens, q_lens = ([3, 5, 1], [3, 2, 1]) if dk > 100 else ([20, 33, 7, 16], [1, 5, 7, 16])
    pool = Pool(rng, seq_lens, block_size=4 if dk > 100 else 16, hkv=hkv, dk=dk, dv=dv)
    q = packed_q(rng, q_lens, hq, dk)
    (o, lse), (ro, rlse) = run_both(q, pool, q_lens=np.array(q_lens), return_lse=True)
    assert o.shape == (sum(q_lens), hq, dv)
    assert_close(o, ro)
    assert_close(lse, rlse)


@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
def test_low_precision_queries(isa, q_dtype):
    rng = make_rng(5, len(q_dtype))
    pool = Pool(rng, [17, 30], block_size=16, hkv=2, dk=32, dv=32, dtype=q_dtype)
    q = packed_q(rng, [2, 4], 4, 32, KV_DTYPES[q_dtype])
    o, ro = run_both(q, pool, q_lens=np.array([2, 4]))
    assert o.dtype == KV_DTYPES[q_dtype]
    assert_close(o, ro, KV_DTYPES[q_dtype])


VARIANTS = {
    "window": dict(window=(5, None)),
    "window_both": dict(window=(3, 1), causal=False),
    "window_left0": dict(window=(0, 0)),
    "softcap": dict(softcap=2.5),
    "sinks": "sinks",
    "alibi": "alibi",
    "all": "all",
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants(isa, variant):
    rng = make_rng(6, len(variant))
    hq = 8
    kw = VARIANTS[variant]
    if kw == "sinks":
        kw = dict(sinks=rng.standard_normal(hq).astype(np.float32))
    elif kw == "alibi":
        kw = dict(alibi_slopes=(2.0 ** -np.arange(1, hq + 1)).astype(np.float32))
    elif kw == "all":
        kw = dict(
            window=(9, None),
            softcap=4.0,
            sinks=rng.standard_normal(hq).astype(np.float32),
            alibi_slopes=(2.0 ** -np.arange(1, hq + 1)).astype(np.float32),
            scale=0.2,
        )
    seq_lens, q_lens = [0, 1, 23, 40, 64, 300], [0, 1, 23, 6, 1, 2]
    pool = Pool(rng, seq_lens, block_size=16, hkv=2, dk=32, dv=24, dtype="float16")
    q = packed_q(rng, q_lens, hq, 32)
    (o, lse), (ro, rlse) = run_both(q, pool, q_lens=np.array(q_lens), return_lse=True, **kw)
    assert_close(o, ro)
    assert_close(lse, rlse)


# ---------------------------------------------------------------------------------------------
# decode steps run as groups: a sequence's kv heads interleaved tile by tile (flash_group)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hkv,group",
    [(3, 4), (17, 1), (20, 2), (33, 1)],
    ids=["hkv3-g4", "hkv17-g1", "hkv20-g2", "hkv33-g1"],
)
@pytest.mark.parametrize("variant", ["plain", "all"])
def test_decode_groups(isa, hkv, group, variant):
    """Decode calls (<= 8 rows per kv head) run each sequence's kv heads as one interleaved group
    of at most 16; more heads than that make several groups per sequence. Ragged lengths, a
    zero-length sequence, 2-query chunks, every variant, and 1-4 threads (split-KV with groups)."""
    rng = make_rng(11, hkv, group, len(variant))
    hq = hkv * group
    kw = {}
    if variant == "all":
        kw = dict(
            window=(70, None),
            softcap=3.0,
            sinks=rng.standard_normal(hq).astype(np.float32),
            alibi_slopes=(2.0 ** -np.linspace(1, 8, hq)).astype(np.float32),
            scale=0.2,
        )
    seq_lens, q_lens = [1, 700, 0, 65, 130], [1, 2, 0, 1, 2]
    pool = Pool(rng, seq_lens, block_size=16, hkv=hkv, dk=32, dv=48, dtype="float16")
    q = packed_q(rng, q_lens, hq, 32)
    for threads in (1, 2, 3, 4):
        (o, lse), (ro, rlse) = run_both(
            q, pool, q_lens=np.array(q_lens), return_lse=True, num_threads=threads, **kw
        )
        assert_close(o, ro)
        assert_close(lse, rlse)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_mixed_batch_groups_its_decodes(isa, kv_dtype):
    """A batch that prefills chunks of some sequences and decodes others: the decoding sequences'
    kv heads run as interleaved groups, the chunks as single items sharing packed K tiles, in one
    plan; 1-3 threads (split-KV over both kinds of unit), windows and sinks."""
    rng = make_rng(15, len(kv_dtype))
    hkv, group = 8, 4
    seq_lens, q_lens = [700, 300, 65, 130, 1], [1, 37, 2, 1, 1]
    pool = Pool(rng, seq_lens, block_size=32, hkv=hkv, dk=64, dv=64, dtype=kv_dtype)
    q = packed_q(rng, q_lens, hkv * group, 64)
    sinks = rng.standard_normal(hkv * group).astype(np.float32)
    for threads, kw in ((1, {}), (2, dict(window=(90, None), sinks=sinks)), (3, {})):
        (o, lse), (ro, rlse) = run_both(
            q, pool, q_lens=np.array(q_lens), return_lse=True, num_threads=threads, **kw
        )
        assert_close(o, ro)
        assert_close(lse, rlse)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_long_prompt_k_packed_once(isa, kv_dtype):
    """A prompt of 300 tokens read from scrambled pages: each K tile is packed once for the 19
    work items of its kv head, straight from the pages, next to a short chunk and a decode."""
    rng = make_rng(13, len(kv_dtype))
    seq_lens, q_lens = [300, 300, 50], [300, 37, 1]  # 4 heads x 16 rows: 19 items per kv head
    pool = Pool(rng, seq_lens, block_size=16, hkv=2, dk=40, dv=24, dtype=kv_dtype)
    q = packed_q(rng, q_lens, 8, 40)
    (o, lse), (ro, rlse) = run_both(q, pool, q_lens=np.array(q_lens), return_lse=True)
    assert_close(o, ro, KV_DTYPES[kv_dtype] if kv_dtype != "bfloat16" else np.float32)
    assert_close(lse, rlse)


def test_packed_k_slots_pass_between_heads(isa):
    """The shared packed K is a ring of slots (attention/plan.h plan_packed_k), two per thread,
    each the size of the longest packed kv head: 10 kv heads (5 chunks, one onto a longer
    context) on 1, 2 and 4 threads take turns in 2, 4 and 8 slots, the later heads packing over
    tiles an earlier head packed (marked unpacked as the slot passes), or their own where a slot's
    earlier head still runs. bf16 pages; float32 queries (the vector path's K tiles) and the same
    values in bf16 (the bf16 products, on tiles under amx)."""
    rng = make_rng(15)
    seq_lens, q_lens = [300, 300, 1000, 300, 300], [40, 37, 20, 40, 33]  # 2+ items a kv head
    pool = Pool(rng, seq_lens, block_size=32, hkv=2, dk=64, dv=64, dtype="bfloat16")
    qb = packed_q(rng, q_lens, 8, 64, BF16)
    args = (pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens)
    want = reference.paged_attention(qb.astype(np.float32), *args, q_lens=np.array(q_lens))
    for q in (qb.astype(np.float32), qb):
        for threads in (1, 2, 4):
            got = attnx.paged_attention(q, *args, q_lens=np.array(q_lens), num_threads=threads)
            assert_close(got.astype(np.float32), want, np.float32 if q is not qb else BF16)


def test_decode_group_long_split(isa):
    """One sequence, 8 kv heads (one group), 3000 keys: the group's key range is split."""
    rng = make_rng(12)
    pool = Pool(rng, [3000], block_size=16, hkv=8, dk=64, dv=64, dtype="bfloat16")
    q = packed_q(rng, [1], 32, 64)
    for threads in (1, 2, 4):
        (o, lse), (ro, rlse) = run_both(q, pool, return_lse=True, num_threads=threads)
        assert_close(o, ro, atol=3e-5, rtol=3e-5)
        assert_close(lse, rlse, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize(
    "dk,dv", [(40, 40), (48, 48), (72, 136), (96, 96), (136, 72), (144, 160), (128, 128)]
)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_bf16_pages_read_in_order(isa, dk, dv, group):
    """bf16 rows read in place are widened W features at a time in the ISA's bf16 order (AVX2 and
    AVX512BW: the even-indexed features, then the odd ones), the queries and the P V accumulators
    permuted to match: widths read in place and converted on each ISA (W = 8 and 16), GQA groups
    of 1, 4 and 8, odd lengths, 1-3 query tokens (decode's dot products) and a 7-token chunk (the
    packed product; P V in 16- and 6-row blocks)."""
    rng = make_rng(14, dk, dv, group)
    seq_lens, q_lens = [1, 31, 97, 200, 65, 33], [1, 1, 2, 1, 3, 7]
    if group == 8:
        q_lens = [1, 1, 1, 1, 1, 7]  # 8 rows per kv head at most on the decode path
    pool = Pool(rng, seq_lens, block_size=32, hkv=2, dk=dk, dv=dv, dtype="bfloat16")
    q = packed_q(rng, q_lens, 2 * group, dk)
    (o, lse), (ro, rlse) = run_both(q, pool, q_lens=np.array(q_lens), return_lse=True)
    assert_close(o, ro)
    assert_close(lse, rlse)


# ---------------------------------------------------------------------------------------------
# the batch against each sequence alone and against contiguous attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_batch_equals_alone_and_contiguous(isa, kv_dtype):
    rng = make_rng(7, len(kv_dtype))
    seq_lens = np.array([0, 1, 16, 45, 130, 3, 64])
    q_lens = np.array([0, 1, 16, 5, 1, 3, 2])
    hq, hkv, dk, dv = 6, 3, 24, 16
    pool = Pool(rng, seq_lens, block_size=16, hkv=hkv, dk=dk, dv=dv, dtype=kv_dtype)
    q = packed_q(rng, q_lens, hq, dk)
    batched, lse = attnx.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, seq_lens, q_lens=q_lens, return_lse=True
    )
    starts = np.concatenate([[0], np.cumsum(q_lens)])

    # 1. each request alone, with its own one-row table (and its own single-sequence work split)
    for b in range(len(seq_lens)):
        if q_lens[b] == 0:
            continue  # a call with no queries: covered by test_no_query_tokens
        sl = slice(starts[b], starts[b + 1])
        alone, alone_lse = attnx.paged_attention(
            q[sl],
            pool.k_pages,
            pool.v_pages,
            pool.block_tables[b : b + 1],
            seq_lens[b : b + 1],
            q_lens=q_lens[b : b + 1],
            return_lse=True,
        )
        assert_close(batched[sl], alone, atol=1e-6, rtol=1e-6)
        assert_close(lse[sl], alone_lse, atol=1e-6, rtol=1e-6)

    # 2. the pages gathered into padded contiguous (B, H, S, D) arrays: attnx.attention and the
    #    reference's contiguous attention, with kv_lens / q_lens for the ragged lengths
    B, sq, sk = len(seq_lens), int(q_lens.max()), int(seq_lens.max())
    q4 = np.zeros((B, hq, sq, dk), np.float32)
    k4 = np.zeros((B, hkv, sk, dk), np.float32)
    v4 = np.zeros((B, hkv, sk, dv), np.float32)
    for b in range(B):
        kb, vb = pool.gather(b)
        k4[b, :, : len(kb)] = kb.transpose(1, 0, 2)
        v4[b, :, : len(vb)] = vb.transpose(1, 0, 2)
        q4[b, :, : q_lens[b]] = q[starts[b] : starts[b + 1]].transpose(1, 0, 2)
    dense = attnx.attention(q4, k4, v4, causal=True, kv_lens=seq_lens, q_lens=q_lens)
    dense_ref = reference.attention(q4, k4, v4, causal=True, kv_lens=seq_lens, q_lens=q_lens)
    for b in range(B):
        rows = batched[starts[b] : starts[b + 1]].transpose(1, 0, 2)  # (Hq, q_len, Dv)
        assert_close(rows, dense[b, :, : q_lens[b]])
        assert_close(rows, dense_ref[b, :, : q_lens[b]])


def test_out_argument(isa):
    rng = make_rng(8)
    pool = Pool(rng, [5, 40, 17], block_size=16, hkv=2, dk=16, dv=16)
    q = packed_q(rng, [1, 3, 2], 4, 16)
    ql = np.array([1, 3, 2])
    want = reference.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens, q_lens=ql
    )
    out = np.full((6, 4, 16), np.nan, np.float32)
    res = attnx.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens, q_lens=ql, out=out
    )
    assert res is out
    assert_close(out, want)
    # a strided (non-contiguous outer axes) out view
    big = np.full((6, 8, 16), np.nan, np.float32)
    res = attnx.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens, q_lens=ql, out=big[:, ::2]
    )
    assert_close(big[:, ::2], want)
    assert np.isnan(big[:, 1::2]).all()
    # out may be q itself (Dv == Dk): every query is read before its row is written
    qq = q.copy()
    attnx.paged_attention(
        qq, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens, q_lens=ql, out=qq
    )
    assert_close(qq, want)


def test_strided_inputs(isa):
    """Pages and queries that are views with padded strides are read through their strides."""
    rng = make_rng(9)
    pool = Pool(rng, [33, 7, 16], block_size=16, hkv=2, dk=16, dv=8)
    kbig = np.full(pool.k_pages.shape[:3] + (40,), np.nan, np.float32)
    vbig = np.full(pool.v_pages.shape[:3] + (20,), np.nan, np.float32)
    kbig[..., 3:19] = pool.k_pages
    vbig[..., 5:13] = pool.v_pages
    q = rng.standard_normal((3, 8, 16)).astype(np.float32)[:, ::2]  # Hq=4 with a stride of 2
    kp, vp = kbig[..., 3:19], vbig[..., 5:13]
    got = attnx.paged_attention(q, kp, vp, pool.block_tables[:, :3].T.copy().T, pool.seq_lens)
    want = reference.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens
    )
    assert_close(got, want)


@pytest.mark.parametrize("table_dtype", [np.int32, np.int64, np.uint32, np.int16])
def test_table_and_length_dtypes(table_dtype):
    rng = make_rng(10)
    pool = Pool(rng, [5, 20], block_size=8, hkv=1, dk=8, dv=8, extra_cols=0)
    q = packed_q(rng, [1, 1], 2, 8)
    got = attnx.paged_attention(
        q,
        pool.k_pages,
        pool.v_pages,
        pool.block_tables.astype(table_dtype),
        pool.seq_lens.astype(table_dtype),
    )
    want = reference.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens
    )
    assert_close(got, want)


@pytest.mark.parametrize("table_dtype", [np.int32, np.int64])
def test_strided_tables_and_lengths(table_dtype):
    """int32 tables and lengths are read in place when contiguous; strided views (every other
    column of a wider table, every other entry of a longer lengths array) are copied first."""
    rng = make_rng(14)
    pool = Pool(rng, [5, 20, 33], block_size=8, hkv=1, dk=8, dv=8, extra_cols=0)
    wide = np.zeros((3, 2 * pool.block_tables.shape[1]), table_dtype)
    wide[:, ::2] = pool.block_tables
    lens = np.zeros(6, table_dtype)
    lens[::2] = pool.seq_lens
    q = packed_q(rng, [1, 1, 1], 2, 8)
    got = attnx.paged_attention(q, pool.k_pages, pool.v_pages, wide[:, ::2], lens[::2])
    want = reference.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens
    )
    assert_close(got, want)
    bad = wide[:, ::2].copy()
    bad[2, 1] = pool.num_blocks  # out of range, in use: refused, whatever the dtype
    with pytest.raises(ValueError, match=r"block_tables\[2, 1\]"):
        attnx.paged_attention(q, pool.k_pages, pool.v_pages, bad, lens[::2])


def test_zero_length_sequence_in_batch(isa):
    """A sequence with no keys and no queries, next to others, contributes nothing and reads
    nothing (its table row is all junk)."""
    rng = make_rng(11)
    pool = Pool(rng, [0, 9, 0], block_size=4, hkv=1, dk=8, dv=8)
    pool.block_tables[0] = -5
    pool.block_tables[2] = JUNK
    q = packed_q(rng, [0, 2, 0], 2, 8)
    o, ro = run_both(q, pool, q_lens=np.array([0, 2, 0]))
    assert_close(o, ro)


def test_no_query_tokens():
    rng = make_rng(12)
    pool = Pool(rng, [9, 3], block_size=4, hkv=1, dk=8, dv=8)
    q = np.zeros((0, 2, 8), np.float32)
    o = attnx.paged_attention(
        q, pool.k_pages, pool.v_pages, pool.block_tables, pool.seq_lens, q_lens=np.array([0, 0])
    )
    assert o.shape == (0, 2, 8) and o.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# bad input: a clean exception that names the argument, and nothing written
# ---------------------------------------------------------------------------------------------


def _base():
    rng = make_rng(13)
    pool = Pool(rng, [5, 12, 1], block_size=4, hkv=2, dk=8, dv=6, extra_cols=0, spare=2)
    q = packed_q(rng, [2, 3, 1], 4, 8)
    return dict(
        q=q,
        k_pages=pool.k_pages,
        v_pages=pool.v_pages,
        block_tables=pool.block_tables.astype(np.int64),
        seq_lens=pool.seq_lens,
        q_lens=np.array([2, 3, 1]),
        out=np.full((6, 4, 6), 7.0, np.float32),
    )


def _set(name, value):
    def f(a):
        a[name] = value(a) if callable(value) else value

    return f


def _table(row, col, value):
    def f(a):
        bt = a["block_tables"].copy()
        bt[row, col] = value
        a["block_tables"] = bt

    return f


BAD = {
    # block tables
    "table_negative": (_table(1, 1, -1), ValueError, "block_tables"),
    "table_too_large": (_table(0, 0, 8), ValueError, "block_tables"),  # pool has 8 blocks
    "table_huge": (_table(2, 0, 10**12), ValueError, "block_tables"),
    "table_float": (
        _set("block_tables", lambda a: a["block_tables"].astype(np.float32)),
        TypeError,
        "block_tables",
    ),
    "table_1d": (
        _set("block_tables", lambda a: a["block_tables"][:, 0]),
        ValueError,
        "block_tables",
    ),
    "table_rows": (_set("block_tables", lambda a: a["block_tables"][:2]), ValueError, "seq_lens"),
    "table_too_few_cols": (
        _set("block_tables", lambda a: a["block_tables"][:, :2]),
        ValueError,
        "block_tables",
    ),
    "seq_needs_more_blocks": (_set("seq_lens", np.array([5, 13, 1])), ValueError, "seq_lens"),
    # lengths
    "seq_lens_negative": (_set("seq_lens", np.array([5, -12, 1])), ValueError, "seq_lens"),
    "seq_lens_float": (_set("seq_lens", np.array([5.0, 12.0, 1.0])), TypeError, "seq_lens"),
    "seq_lens_shape": (_set("seq_lens", np.array([5, 12])), ValueError, "seq_lens"),
    "q_lens_exceed": (_set("q_lens", np.array([2, 3, 2])), ValueError, "q_lens"),
    "q_lens_negative": (_set("q_lens", np.array([3, 4, -1])), ValueError, "q_lens"),
    "q_lens_shape": (_set("q_lens", np.array([2, 3, 1, 0])), ValueError, "q_lens"),
    "q_lens_float": (_set("q_lens", np.array([2.0, 3.0, 1.0])), TypeError, "q_lens"),
    "sum_q_lens": (_set("q_lens", np.array([2, 2, 1])), ValueError, "q"),
    "decode_needs_n_eq_b": (_set("q_lens", None), ValueError, "q"),
    # queries and pages
    "q_float64": (_set("q", lambda a: a["q"].astype(np.float64)), TypeError, "q"),
    "q_int": (_set("q", lambda a: a["q"].astype(np.int32)), TypeError, "q"),
    "q_rank2": (_set("q", lambda a: a["q"][:, 0]), ValueError, "q"),
    "q_dk": (_set("q", lambda a: a["q"][..., :7].copy()), ValueError, "q"),
    "q_heads_not_multiple": (_set("q", lambda a: a["q"][:, :3].copy()), ValueError, "kv heads"),
    "k_pages_rank": (_set("k_pages", lambda a: a["k_pages"][0]), ValueError, "k_pages"),
    "k_pages_dtype": (
        _set("k_pages", lambda a: a["k_pages"].astype(np.float64)),
        TypeError,
        "k_pages",
    ),
    "v_pages_dtype": (
        _set("v_pages", lambda a: a["v_pages"].astype(np.float16)),
        TypeError,
        "v_pages",
    ),
    "v_pages_blocks": (_set("v_pages", lambda a: a["v_pages"][:7]), ValueError, "v_pages"),
    "v_pages_heads": (_set("v_pages", lambda a: a["v_pages"][:, :1]), ValueError, "v_pages"),
    "v_pages_block_size": (
        _set("v_pages", lambda a: a["v_pages"][:, :, :3]),
        ValueError,
        "v_pages",
    ),
    "k_pages_str": (_set("k_pages", lambda a: "pages"), (TypeError, ValueError), "k_pages"),
    # options
    "scale_zero": (_set("scale", 0.0), ValueError, "scale"),
    "scale_nan": (_set("scale", float("nan")), ValueError, "scale"),
    "scale_str": (_set("scale", "1"), TypeError, "scale"),
    "window_negative": (_set("window", (-1, 0)), ValueError, "window"),
    "window_arity": (_set("window", (1, 2, 3)), ValueError, "window"),
    "softcap_zero": (_set("softcap", 0.0), ValueError, "softcap"),
    "sinks_shape": (_set("sinks", np.zeros(3, np.float32)), ValueError, "sinks"),
    "sinks_nan": (_set("sinks", np.full(4, np.nan, np.float32)), ValueError, "sinks"),
    "alibi_shape": (_set("alibi_slopes", np.zeros((4, 1), np.float32)), ValueError, "alibi_slopes"),
    "num_threads_zero": (_set("num_threads", 0), ValueError, "num_threads"),
    # out
    "out_dtype": (_set("out", lambda a: a["out"].astype(np.float16)), TypeError, "out"),
    "out_shape": (_set("out", lambda a: np.zeros((6, 4, 8), np.float32)), ValueError, "out"),
    "out_list": (_set("out", lambda a: a["out"].tolist()), TypeError, "out"),
    "out_readonly": (
        _set("out", lambda a: np.broadcast_to(a["out"][:1], (6, 4, 6))),
        ValueError,
        "out",
    ),
    "out_strided_last": (
        _set("out", lambda a: np.zeros((6, 4, 12), np.float32)[..., ::2]),
        ValueError,
        "out",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    mutate, exc, name = BAD[case]
    args = _base()
    good_out = args["out"]
    mutate(args)
    q = args.pop("q")
    pages = [args.pop(n) for n in ("k_pages", "v_pages", "block_tables", "seq_lens")]
    before = [np.array(p, copy=True) for p in pages if isinstance(p, np.ndarray)]
    out = args.get("out")
    out_before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
    with pytest.raises(exc, match=name):
        attnx.paged_attention(q, *pages, **args)
    assert np.array_equal(good_out, np.full((6, 4, 6), 7.0, np.float32)), "out was written"
    if out_before is not None:
        assert np.array_equal(out, out_before, equal_nan=True), "out was written"
    for a, b in zip([p for p in pages if isinstance(p, np.ndarray)], before):
        assert np.array_equal(a, b, equal_nan=True)


def test_base_case_is_valid():
    """The unmutated arguments of test_bad_input are accepted (so each case tests one fault)."""
    args = _base()
    q = args.pop("q")
    pages = [args.pop(n) for n in ("k_pages", "v_pages", "block_tables", "seq_lens")]
    o = attnx.paged_attention(q, *pages, **args)
    want = reference.paged_attention(q, *pages, q_lens=args["q_lens"])
    assert_close(o, want)


def test_junk_past_a_sequence_is_not_read():
    """Table entries past a sequence's last block are not checked and not read."""
    a = _base()
    bt = np.concatenate([a["block_tables"], np.array([[-7], [JUNK], [2**31 - 1]])], axis=1)
    bt[2, 1:] = -1  # seq 2 has 1 token: one block
    o = attnx.paged_attention(
        a["q"], a["k_pages"], a["v_pages"], bt, a["seq_lens"], q_lens=a["q_lens"]
    )
    assert np.isfinite(o).all()


@pytest.mark.parametrize("entry", [2**32, 2**32 + 3, -(2**32) + 1])
def test_block_table_entry_wrapping_to_int32(entry):
    a = _base()
    bt = a["block_tables"].copy()
    bt[1, 0] = entry
    with pytest.raises(ValueError, match="block_tables"):
        attnx.paged_attention(
            a["q"], a["k_pages"], a["v_pages"], bt, a["seq_lens"], q_lens=a["q_lens"]
        )


def test_zero_kv_heads_is_an_error_not_a_crash():
    code = textwrap.dedent("""
        import numpy as np, attnx
        kp = np.zeros((4, 0, 4, 1), np.float32)
        q = np.ones((1, 2, 1), np.float32)
        try:
            attnx.paged_attention(q, kp, kp, np.array([[0]]), np.array([3]))
        except ValueError as e:
            assert "k_pages" in str(e), e
            print("clean")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "clean" in r.stdout, (r.returncode, r.stderr[-500:])
