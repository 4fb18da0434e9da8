"""The decode tiles (cpp/src/kernels/amx_decode-inl.h): work items of 2 to 16 query rows (decode's
query heads of one kv head, a short chunk's rows) over bf16 keys and values, on AMX tiles that
read K and V where they lie: S^T = K Q^T, then P V with each p in one half of its 32 bits, so
that the value rows need no packing. Run on ``amx`` (the hardware tiles) and ``amx-emulated``
(the same code over emulated tiles, on any AVX512_BF16 CPU).

Numerics are the bf16 product paths' (P rounded to bf16, scores summed in the tiles' order):
``check_paged`` and ``check_attention`` hold them to the same-precision twin. One row (MHA decode)
stays on the vector path, bit for bit float32's. An item whose output ends non-finite (a value of
inf or NaN among its keys, which the zero half of a p turns into NaN in its neighbour) is
computed again on the vector path: bit for bit ``avx512``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx

from helpers import (
    BF16,
    check_attention,
    check_paged,
    has_amx,
    on_isa,
    pool_from_sequences,
    rand,
)


def _pool(rng, lens, hkv, dk, dv, bs, dtype=BF16):
    ks = [rand(rng, (n, hkv, dk), dtype) for n in lens]
    vs = [rand(rng, (n, hkv, dv), dtype) for n in lens]
    return pool_from_sequences(rng, ks, vs, bs)


@given(
    st.sampled_from([(2, 1), (6, 2), (12, 4), (32, 8), (9, 3), (16, 1), (24, 3)]),
    st.lists(st.integers(1, 400), min_size=1, max_size=3),
    st.sampled_from([(32, 32), (64, 64), (128, 128), (64, 96), (96, 32)]),
    st.sampled_from([16, 24, 32, 64, 128]),
    st.integers(1, 2),
    st.sampled_from(["plain", "window", "softcap", "sinks", "alibi"]),
    st.integers(0, 2**31 - 1),
)
@settings(max_examples=120, deadline=None)
def test_decode_tiles_against_the_reference(amx_isa, heads, lens, dims, bs, sq, mod, seed):
    """Paged decode (sq = 1) and short chunks (sq = 2: causal rows of one item) over pools of
    every page size (24: 16-key blocks that cross pages, copied), lengths that end inside a
    16-key block, GQA groups giving 2..16 rows, Dk != Dv, and each modifier."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    dk, dv = dims
    if (hq // hkv) * sq > 16:
        sq = 1
    lens = np.maximum(np.array(lens), sq)
    kp, vp, tables, seq_lens = _pool(rng, lens, hkv, dk, dv, bs)
    q_lens = np.full(len(lens), sq, np.int64)
    q = rand(rng, (int(q_lens.sum()), hq, dk), BF16)
    kw = {
        "plain": {},
        "window": {"window": (int(rng.integers(0, 200)), 0)},
        "softcap": {"softcap": 3.0},
        "sinks": {"sinks": rng.standard_normal(hq).astype(np.float32)},
        "alibi": {"alibi_slopes": np.geomspace(0.5, 2**-6, hq).astype(np.float32)},
    }[mod]
    check_paged(q, kp, vp, tables, seq_lens, q_lens, **kw)


@pytest.mark.parametrize("rows", [(4, 1), (8, 1), (12, 1), (16, 1), (4, 3), (8, 2)], ids=str)
def test_decode_tiles_dense(amx_isa, rng, rows):
    """Dense calls with few query rows per kv head (GQA decode, a short causal chunk, kv_lens)
    take the tiles too."""
    g, sq = rows
    q = rand(rng, (2, 2 * g, sq, 64), BF16)
    k, v = (rand(rng, (2, 2, 333, 64), BF16) for _ in range(2))
    check_attention(q, k, v)
    check_attention(q, k, v, causal=True)
    check_attention(q, k, v, kv_lens=np.array([1, 250]))


def test_decode_tiles_are_taken(amx_isa, rng):
    """Items of 2+ rows take the tiles (P rounded: not float32's bits); one row stays on the
    vector path, float32's bits (the output rounded to bf16)."""
    k, v = (rand(rng, (1, 2, 300, 64), BF16) for _ in range(2))
    for hq, same in ((2, True), (8, False)):
        q = rand(rng, (1, hq, 1, 64), BF16)
        got = attnx.attention(q, k, v)
        want = attnx.attention(*(x.astype(np.float32) for x in (q, k, v))).astype(BF16)
        assert np.array_equal(got, want) == same, hq


@pytest.mark.parametrize("where", ["seen", "seen_by_some", "both_heads"])
def test_decode_tiles_nonfinite_values(amx_isa, rng, where):
    """A value of inf or NaN reaches the rows that see its key (the reference's inf or NaN) and no
    other: with a 2-row causal chunk, the last key is the second row's alone. On the tiles the
    item ends non-finite (a zero half times inf), so it runs again on the vector path: bit for
    bit avx512's result, the rows that do not see the key finite."""
    kp, vp, tables, seq_lens = _pool(rng, [300, 200], 2, 64, 64, 32)
    sq = 2 if where == "seen_by_some" else 1
    q_lens = np.array([sq, 1])
    q = rand(rng, (sq + 1, 8, 64), BF16)
    at = 299 if where == "seen_by_some" else 150
    blk, off = tables[0, at // 32], at % 32
    vp[blk, 0, off, 7] = np.inf
    if where == "both_heads":
        vp[blk, 1, off + 1, 3] = np.nan

    def call():
        return attnx.paged_attention(q, kp, vp, tables, seq_lens, q_lens=q_lens, return_lse=True)

    out, want = call(), on_isa("avx512", call)
    # sequence 0's kv head 0 (query heads 0-3) ran again on the vector path: avx512's bits
    np.testing.assert_array_equal(out[0][:sq, :4], want[0][:sq, :4])
    np.testing.assert_array_equal(out[1][:sq, :4], want[1][:sq, :4])
    last = out[0][sq - 1, :4].astype(np.float32)
    assert not np.isfinite(last).all()
    if where == "seen_by_some":
        assert np.isfinite(out[0][0].astype(np.float32)).all()  # the first row does not see it
    check_paged(q, kp, vp, tables, seq_lens, q_lens, poisoned=False)  # inf/NaN where expected
    assert np.isfinite(out[0][sq].astype(np.float32)).all()  # the other sequence: untouched


@pytest.mark.skipif(
    not has_amx(), reason="CPU lacks AMX-BF16, or the OS did not grant the tile state"
)
def test_emulated_decode_tiles_match_the_tiles(rng):
    """amx-emulated's decode tiles against the hardware's, to the output's bf16 rounding."""
    kp, vp, tables, seq_lens = _pool(rng, [700, 65, 1], 4, 128, 128, 16)
    q = rand(rng, (3, 32, 128), BF16)
    hw = on_isa("amx", lambda: attnx.paged_attention(q, kp, vp, tables, seq_lens))
    emu = on_isa("amx-emulated", lambda: attnx.paged_attention(q, kp, vp, tables, seq_lens))
    np.testing.assert_allclose(
        emu.astype(np.float32), hw.astype(np.float32), rtol=2.0**-6, atol=2.0**-8
    )


def test_decode_tiles_threads_agree(amx_isa, rng):
    """Each thread keeps its own tile configuration and buffers: Python threads decoding at once
    (one and two worker threads each) give the one-thread result's bits."""
    import threading

    kp, vp, tables, seq_lens = _pool(rng, [500, 300, 511, 17], 4, 128, 128, 32)
    q = rand(rng, (4, 16, 128), BF16)
    want = attnx.paged_attention(q, kp, vp, tables, seq_lens, num_threads=1)
    results = [None] * 4

    def work(i):
        results[i] = attnx.paged_attention(q, kp, vp, tables, seq_lens, num_threads=1 + i % 2)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, want)
