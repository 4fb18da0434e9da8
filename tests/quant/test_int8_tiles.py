"""Integer queries over int8 pages with Q K^T on int8 tiles (AMX-INT8's tdpbssd, and the tiles'
portable emulation, ``_core.set_int8_tiles``): against the reference twin that quantises the
query (float32 tolerance) over causal, window, softcap, sinks, ALiBi, GQA groups, odd Dk,
kv_lens/q_lens, chunked prefill and scrambled block tables; the hardware tiles give the
emulation's results bit for bit, and the tiles give the vector kernels' exact scores (the same
outputs bit for bit where both run the same softmax and P V)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_quant_kv import TOL, QPool, check_extreme_scales, extreme_scales_pool

import attnx
from attnx import reference as ref

from helpers import ISAS, make_rng


def amx_int8_runs():
    f = attnx.cpu_features()
    return f["amx_int8"] and f["amx_permitted"] and f["amx_bf16"] and f["avx512bf16"]


@pytest.fixture(autouse=True)
def integer_queries():
    """Integer queries on; the query switch and the tiles' setting restored after."""
    query, tiles = attnx.set_int8_query(True), attnx._core.int8_tiles()
    yield
    attnx.set_int8_query(query)
    attnx._core.set_int8_tiles(*tiles)


TILES = [("emulate", name) for name in ISAS] + [("auto", "amx")] * ("amx" in ISAS)


@pytest.fixture(params=TILES, ids=[f"{m}-{i}" for m, i in TILES])
def tiles(request):
    """The tiles on one path: the emulation on every path, and AMX-INT8's (mode "auto") on the
    amx path where the CPU and OS grant it."""
    mode, name = request.param
    if mode == "auto" and not amx_int8_runs():
        pytest.skip("this CPU or OS does not grant AMX-INT8")
    previous = attnx._core.active_isa()
    attnx._core.set_isa(name)
    try:
        yield mode
    finally:
        attnx._core.set_isa(previous)


def run(q, pool, mode, min_rows=9, **kw):
    attnx._core.set_int8_tiles(mode, min_rows)
    return attnx.paged_attention(q, *pool.args(), return_lse=True, **pool.scales(), **kw)


def check_twin(q, pool, mode, min_rows=9, num_threads=None, **kw):
    got = run(q, pool, mode, min_rows, num_threads=num_threads, **kw)
    want = ref.paged_attention(
        q, *pool.args(), return_lse=True, **pool.scales(), int8_query=True, **kw
    )
    for g, w in zip(got, want):
        assert np.isfinite(g).all() == np.isfinite(w).all()
        np.testing.assert_allclose(g, w, **TOL)
    return got


@pytest.mark.parametrize("case", ["huge", "tiny", "inf"])
def test_key_scales_the_sums_cannot_take(tiles, case):
    """A tile whose key scales lie outside the in-place range (above FLT_MAX / 256, or +-inf)
    leaves the tiles for the keys read dequantised, times the query's values (its codes times
    their factor), as the twin computes: the codes' sums times such a scale overflowed, or turned
    a key whose dequantised row is NaN into one the row skips. (tiny: V scales, no change.)"""
    rng = make_rng(45, len(case))
    pool, q_factor = extreme_scales_pool(rng, "int8", case, 64)
    q = (rng.standard_normal((12, 4, 64)) * q_factor).astype(np.float32)
    attnx._core.set_int8_tiles(tiles, 1)
    check_extreme_scales(q, pool, case, int8_query=True, q_lens=np.array([12]))


@pytest.mark.parametrize(
    "dk, dv, hq, hkv",
    [(64, 64, 8, 2), (128, 128, 32, 8), (40, 24, 4, 4), (200, 72, 6, 1), (37, 5, 2, 1)],
)
def test_chunked_prefill_matches_the_twin(tiles, dk, dv, hq, hkv):
    """Many rows per kv head (chunks of new tokens, mixed with decode rows): odd Dk (features
    padded to 64 in the tiles, never read past a row), GQA groups, scrambled tables."""
    rng = make_rng(41, dk, hq)
    lens, q_lens = np.array([70, 33, 129, 300]), np.array([70, 1, 20, 45])
    pool = QPool(rng, lens, dtype="int8", block_size=16, hkv=hkv, dk=dk, dv=dv)
    q = rng.standard_normal((int(q_lens.sum()), hq, dk)).astype(np.float32)
    check_twin(q, pool, tiles, q_lens=q_lens)
    check_twin(q, pool, tiles, q_lens=q_lens, window=(16, 0), softcap=30.0)
    check_twin(q, pool, tiles, q_lens=q_lens, causal=False, scale=0.2)


def test_modifiers_match_the_twin(tiles):
    rng = make_rng(42)
    hq, hkv = 8, 2
    lens, q_lens = np.array([129, 64, 200]), np.array([40, 64, 17])
    pool = QPool(rng, lens, dtype="int8", block_size=16, hkv=hkv, dk=64, dv=64)
    q = rng.standard_normal((int(q_lens.sum()), hq, 64)).astype(np.float32)
    slopes = np.linspace(0.05, 1, hq).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    check_twin(q, pool, tiles, q_lens=q_lens, alibi_slopes=slopes)
    check_twin(q, pool, tiles, q_lens=q_lens, sinks=sinks, window=(50, None))
    check_twin(q, pool, tiles, q_lens=q_lens, softcap=5.0, sinks=sinks, alibi_slopes=slopes)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_groups_forced_onto_tiles(tiles, block_size):
    """GQA decode groups (4 rows per kv head) and a chunk, with the tiles forced down to one row:
    the lone 16-row block (block_1x4) and row counts that are not a multiple of 16."""
    rng = make_rng(43, block_size)
    lens = np.array([1, 17, 100, 300, 64])
    pool = QPool(rng, lens, dtype="int8", block_size=block_size, hkv=2, dk=128, dv=64)
    q = rng.standard_normal((5, 8, 128)).astype(np.float32)
    check_twin(q, pool, tiles, min_rows=1)
    check_twin(q, pool, tiles, min_rows=1, window=(37, None), scale=0.3)
    q_lens = np.array([1, 3, 5, 7, 2])
    qc = rng.standard_normal((int(q_lens.sum()), 8, 128)).astype(np.float32)
    check_twin(qc, pool, tiles, min_rows=1, q_lens=q_lens)


def test_shared_prefix_and_split_keys(tiles):
    """Sequences that share leading blocks (the cascade's stacked queries) and one long sequence
    whose keys are split across threads."""
    rng = make_rng(44)
    pool = QPool(rng, [512, 256], dtype="int8", block_size=16, hkv=2, dk=64, dv=64)
    tables = pool.block_tables.copy()
    tables[1, :8] = tables[0, :8]  # the second sequence's first 128 keys are the first's
    pool.block_tables = tables
    q_lens = np.array([30, 20])
    q = rng.standard_normal((50, 8, 64)).astype(np.float32)
    check_twin(q, pool, tiles, q_lens=q_lens)
    check_twin(q, pool, tiles, q_lens=q_lens, num_threads=2)
    q1 = rng.standard_normal((2, 8, 64)).astype(np.float32)
    check_twin(q1, pool, tiles, min_rows=1, num_threads=2)


def test_hardware_tiles_give_the_emulations_results():
    """The same layouts and integer sums: AMX-INT8 and the emulation agree bit for bit."""
    if attnx._core.active_isa() != "amx" or not amx_int8_runs():
        pytest.skip("AMX-INT8 is not the active path here")
    rng = make_rng(45)
    lens, q_lens = np.array([300, 77, 129]), np.array([64, 9, 33])
    for dk in (64, 128, 72, 37):
        pool = QPool(rng, lens, dtype="int8", block_size=16, hkv=2, dk=dk, dv=64)
        q = rng.standard_normal((int(q_lens.sum()), 8, dk)).astype(np.float32)
        for rows in (9, 1):
            hw = run(q, pool, "auto", rows, q_lens=q_lens)
            emu = run(q, pool, "emulate", rows, q_lens=q_lens)
            for a, b in zip(hw, emu):
                np.testing.assert_array_equal(a, b, err_msg=f"dk {dk}, rows {rows}")


def test_tiles_give_the_vector_kernels_scores(isa):
    """Few rows per kv head run the same softmax and P V on either, so the exact integer scores
    make the outputs equal bit for bit (Dk a multiple of 64: VNNI's kernel where the path has it;
    else FMAs over the codes, also exact)."""
    rng = make_rng(46)
    pool = QPool(rng, [300, 64, 5], dtype="int8", block_size=16, hkv=2, dk=128, dv=128)
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)
    vec = run(q, pool, "off")
    emu = run(q, pool, "emulate", 1)
    for a, b in zip(vec, emu):
        np.testing.assert_array_equal(a, b)


def test_float_query_unchanged_by_the_tiles(isa):
    """With set_int8_query(False) the tiles' setting changes nothing: the float query's results."""
    rng = make_rng(47)
    pool = QPool(rng, [200, 90], dtype="int8", block_size=16, hkv=2, dk=64, dv=64)
    q_lens = np.array([40, 3])
    q = rng.standard_normal((43, 8, 64)).astype(np.float32)
    attnx.set_int8_query(False)
    base = run(q, pool, "off", q_lens=q_lens)
    for mode, rows in (("auto", 9), ("emulate", 1)):
        for a, b in zip(base, run(q, pool, mode, rows, q_lens=q_lens)):
            np.testing.assert_array_equal(a, b)
    want = ref.paged_attention(q, *pool.args(), return_lse=True, **pool.scales(), q_lens=q_lens)
    np.testing.assert_allclose(base[0], want[0], **TOL)


@given(
    dk=st.integers(1, 160),
    hkv=st.integers(1, 3),
    group=st.integers(1, 5),
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    new=st.integers(1, 70),
    rows=st.integers(1, 9),
)
def test_random_shapes_on_emulated_tiles(dk, hkv, group, lens, new, rows):
    rng = make_rng(48, dk, hkv, group, *lens, new, rows)
    lens = np.array(lens)
    q_lens = np.minimum(lens, new)
    pool = QPool(rng, lens, dtype="int8", block_size=16, hkv=hkv, dk=dk, dv=dk % 50 + 1)
    q = rng.standard_normal((int(q_lens.sum()), hkv * group, dk)).astype(np.float32)
    check_twin(q, pool, "emulate", rows, q_lens=q_lens)


@pytest.mark.parametrize("block_size", [1, 16, 24, 64])
@pytest.mark.parametrize("dk", [64, 128, 256])
def test_few_rows_read_keys_in_place(tiles, block_size, dk):
    """Items of up to 16 rows whose features fill whole tile rows take S^T = K Q^T with the keys'
    rows as they lie in the pages (kern::unpacked_codes; the tiles' default from
    kern::kInt8TileRows rows): a chunk of 16 keys inside one page read in place, one that
    crosses a page (blocks of 1 and 24) or ends the keys staged with zero rows, and 4, 9 and 16
    rows per kv head (decode groups and short chunks)."""
    rng = make_rng(49, block_size, dk)
    lens = np.array([1, 16, 47, 64, 300])
    pool = QPool(rng, lens, dtype="int8", block_size=block_size, hkv=2, dk=dk, dv=72)
    for hq, new in ((8, 1), (8, 4), (18, 1), (32, 1)):
        q_lens = np.minimum(lens, new)
        q = rng.standard_normal((int(q_lens.sum()), hq, dk)).astype(np.float32)
        check_twin(q, pool, tiles, min_rows=4, q_lens=q_lens)
        check_twin(q, pool, tiles, min_rows=4, q_lens=q_lens, window=(40, None), softcap=20.0)


def test_few_rows_on_hardware_tiles_give_the_emulations_results():
    """K read in place: AMX-INT8 and the emulation agree bit for bit, and up to 8 rows per kv
    head with the vector kernels (the same exact scores, the same softmax and P V; above 8 rows
    the vector path packs K and fuses its softmax)."""
    if attnx._core.active_isa() != "amx" or not amx_int8_runs():
        pytest.skip("AMX-INT8 is not the active path here")
    rng = make_rng(50)
    lens = np.array([300, 77, 16, 129])
    for dk, block_size in ((64, 16), (128, 24), (256, 1)):
        pool = QPool(rng, lens, dtype="int8", block_size=block_size, hkv=2, dk=dk, dv=64)
        for hq, new in ((8, 1), (8, 3), (32, 1)):
            q_lens = np.minimum(lens, new)
            q = rng.standard_normal((int(q_lens.sum()), hq, dk)).astype(np.float32)
            hw = run(q, pool, "auto", 1, q_lens=q_lens)
            emu = run(q, pool, "emulate", 1, q_lens=q_lens)
            vec = run(q, pool, "off", q_lens=q_lens)
            for a, b, c in zip(hw, emu, vec):
                np.testing.assert_array_equal(a, b, err_msg=f"dk {dk}, hq {hq}, new {new}")
                if hq // 2 * new <= 8:
                    np.testing.assert_array_equal(a, c, err_msg=f"dk {dk}, hq {hq}, new {new}")


@given(
    dk=st.sampled_from([64, 128, 192]),
    block_size=st.sampled_from([1, 5, 16, 24, 32, 128]),
    group=st.integers(1, 8),
    lens=st.lists(st.integers(1, 260), min_size=1, max_size=3),
    new=st.integers(1, 16),
)
def test_random_few_row_items_on_tiles(dk, block_size, group, lens, new):
    rng = make_rng(51, dk, block_size, group, *lens, new)
    lens = np.array(lens)
    q_lens = np.minimum(lens, max(1, new // group))
    pool = QPool(rng, lens, dtype="int8", block_size=block_size, hkv=2, dk=dk, dv=dk // 2 + 3)
    q = rng.standard_normal((int(q_lens.sum()), 2 * group, dk)).astype(np.float32)
    for mode, name in TILES:
        if mode == "auto" and not amx_int8_runs():
            continue
        previous = attnx._core.active_isa()
        attnx._core.set_isa(name)
        try:
            check_twin(q, pool, mode, 1, q_lens=q_lens)
        finally:
            attnx._core.set_isa(previous)


def test_the_switch_refuses_bad_arguments():
    before = attnx._core.int8_tiles()
    with pytest.raises(ValueError, match="mode: expected 'auto', 'off' or 'emulate', got 'on'"):
        attnx._core.set_int8_tiles("on", 9)
    for bad in (0, 10, -1):
        with pytest.raises(ValueError, match=f"min_rows: expected 1 .. 9, got {bad}"):
            attnx._core.set_int8_tiles("auto", bad)
    assert attnx._core.int8_tiles() == before
    attnx._core.set_int8_tiles("emulate", 3)
    assert attnx._core.int8_tiles() == ("emulate", 3)
