"""Quantised KV (int8, float8_e4m3fn, float8_e5m2) through the kernels and the cache: the kernels
attend over exactly ``dequantize_kv(pages, scales)`` (to float32 tolerance, on every ISA, with
scrambled pages, GQA, windows, chunked prefill; with integer queries, over the query quantised
as ``attnx.quant.quantize_query`` does), the step quantises exactly as
``attnx.reference.quantize_kv`` does, and the cache keeps scales with their blocks through
fork, copy-on-write, truncate and the sliding window."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx import reference as ref
from attnx.quant import quantize_query

from helpers import INTEGER_PRODUCT_ISAS, make_rng, pool_from_sequences, scramble_tables

QDTYPES = list(ref.QUANTISED_DTYPES)
TOL = dict(rtol=2e-5, atol=2e-5)  # float32: the kernel computes on the dequantised values
NEVER = 1 << 20  # a block id outside every pool: table columns past a sequence's end


class QPool:
    """Quantised K/V pages with scrambled block tables; every slot no sequence owns has a NaN
    scale, so a kernel that reads one poisons its output."""

    def __init__(self, rng, seq_lens, *, dtype, block_size, hkv, dk, dv, spare=3):
        self.seq_lens = np.asarray(seq_lens, np.int64)
        self.block_size = block_size
        need = -(-self.seq_lens // block_size)
        nb = int(need.sum()) + spare
        k = rng.standard_normal((nb, hkv, block_size, dk)) * rng.uniform(
            0.1, 10, (nb, hkv, block_size, 1)
        )
        v = rng.standard_normal((nb, hkv, block_size, dv))
        self.k_float, self.v_float = k.astype(np.float32), v.astype(np.float32)
        self.k_pages, self.k_scales = ref.quantize_kv(self.k_float, dtype)
        self.v_pages, self.v_scales = ref.quantize_kv(self.v_float, dtype)
        self.block_tables, owned = scramble_tables(
            rng, self.seq_lens, block_size, nb, int(need.max(initial=0)) + 2, NEVER
        )
        for s in (self.k_scales, self.v_scales):
            s.transpose(0, 2, 1)[~owned] = np.nan

    def args(self):
        return self.k_pages, self.v_pages, self.block_tables, self.seq_lens

    def scales(self):
        return dict(k_scales=self.k_scales, v_scales=self.v_scales)


def twin(*args, int8_query=None, **kw):
    """``attnx.reference.paged_attention`` over the dequantised pages, quantising the query too
    where ``int8_query`` says (by default: where the kernels do now, ``attnx.int8_query()``)."""
    iq = attnx.int8_query() if int8_query is None else int8_query
    return ref.paged_attention(*args, int8_query=iq, **kw)


def check_against_reference(q, pool, int8_query=None, **kw):
    """The kernel against its twin (``twin``: the float query's, or with integer queries the one
    that quantises the query too)."""
    got = attnx.paged_attention(q, *pool.args(), return_lse=True, **pool.scales(), **kw)
    want = twin(q, *pool.args(), return_lse=True, **pool.scales(), int8_query=int8_query, **kw)
    for g, w in zip(got, want):
        assert np.isfinite(g).all() == np.isfinite(w).all()
        np.testing.assert_allclose(g, w, **TOL)
    return got[0]


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("dk, dv, hq, hkv", [(64, 64, 8, 2), (40, 24, 4, 4), (128, 128, 32, 8)])
def test_decode_matches_reference_over_dequantised_pages(isa, dtype, dk, dv, hq, hkv):
    rng = make_rng(1, dk, hq, len(dtype))
    pool = QPool(rng, [1, 17, 100, 300], dtype=dtype, block_size=16, hkv=hkv, dk=dk, dv=dv)
    q = rng.standard_normal((4, hq, dk)).astype(np.float32)
    check_against_reference(q, pool)
    check_against_reference(q, pool, window=(37, None))


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_chunked_prefill_and_mixed_batches(isa, dtype, block_size):
    rng = make_rng(2, block_size, len(dtype))
    lens, q_lens = (
        np.array([70, 33, 129]),
        np.array([70, 1, 20]),
    )  # > kDotRows rows: the packed path
    pool = QPool(rng, lens, dtype=dtype, block_size=block_size, hkv=2, dk=64, dv=64)
    q = rng.standard_normal((int(q_lens.sum()), 8, 64)).astype(np.float32)
    check_against_reference(q, pool, q_lens=q_lens)
    check_against_reference(q, pool, q_lens=q_lens, window=(16, 0), softcap=30.0)


@pytest.mark.parametrize("q_dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_queries(isa, q_dtype):
    rng = make_rng(3)
    pool = QPool(rng, [50, 9], dtype="int8", block_size=16, hkv=1, dk=32, dv=32)
    q = rng.standard_normal((2, 4, 32)).astype(q_dtype)
    got = attnx.paged_attention(q, *pool.args(), **pool.scales())
    want = twin(q, *pool.args(), **pool.scales())
    assert got.dtype == q.dtype
    np.testing.assert_allclose(
        got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2
    )


def test_non_finite_rows_reach_only_the_queries_that_see_them(isa):
    rng = make_rng(4)
    x = rng.standard_normal((1, 40, 1, 16)).astype(np.float32)  # one sequence of 40 keys
    x[0, 5, 0, 3] = np.nan
    k_pages, k_scales = ref.quantize_kv(x.reshape(10, 4, 1, 16).transpose(0, 2, 1, 3), "int8")
    v_pages, v_scales = ref.quantize_kv(x.reshape(10, 4, 1, 16).transpose(0, 2, 1, 3), "int8")
    assert np.isnan(k_scales[1, 0, 1])
    bt = np.arange(10, dtype=np.int32)[None]
    q = rng.standard_normal((40, 2, 16)).astype(np.float32)
    o = attnx.paged_attention(
        q,
        k_pages,
        v_pages,
        bt,
        np.array([40]),
        q_lens=np.array([40]),
        window=(3, None),
        k_scales=k_scales,
        v_scales=v_scales,
    )
    sees = (np.arange(40) >= 5) & (np.arange(40) <= 8)
    assert np.isnan(o[sees]).all() and np.isfinite(o[~sees]).all()


def yardstick_problem():
    """The error yardsticks' problem: standard normal q (1, 8, 128) over float32 k, v pages
    (128 pages of 16 tokens, 2 kv heads, D = 128) holding 2048 keys through a scrambled table.
    Returns (q, k, v, block_tables, seq_lens, exact output, the output's RMS)."""
    rng = make_rng(5)
    k = rng.standard_normal((128, 2, 16, 128)).astype(np.float32)
    v = rng.standard_normal((128, 2, 16, 128)).astype(np.float32)
    q = rng.standard_normal((1, 8, 128)).astype(np.float32)
    bt, lens = rng.permutation(128).astype(np.int32)[None], np.array([2048])
    exact = ref.paged_attention(q, k, v, bt, lens)
    rms = float(np.sqrt(np.mean(exact.astype(np.float64) ** 2)))
    return q, k, v, bt, lens, exact, rms


def test_error_against_unquantised_attention_on_random_data(isa):
    """Not a definition but a yardstick (reported in the README): the output error of attending
    over quantised K/V instead of their float32 originals. Standard normal q, k, v, D = 128,
    GQA 4, 2048 keys in pages of 16; error relative to the output's RMS."""
    q, k, v, bt, lens, exact, rms = yardstick_problem()
    errs = {}
    for dtype in QDTYPES:
        (kq, ks), (vq, vs) = ref.quantize_kv(k, dtype), ref.quantize_kv(v, dtype)
        got = attnx.paged_attention(q, kq, vq, bt, lens, k_scales=ks, v_scales=vs)
        errs[dtype] = float(np.abs(got - exact).max()) / rms
    print("max |quantised - float32| / rms(float32 output):", errs)
    assert errs["int8"] < 0.06 and errs["float8_e4m3fn"] < 0.3 and errs["float8_e5m2"] < 0.5


# ---------------------------------------------------------------------------------------------
# integer queries (attnx.set_int8_query): the twin that quantises the query too
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def int8_query():
    before = attnx.set_int8_query(True)
    try:
        yield
    finally:
        attnx.set_int8_query(before)


def check_against_twin(q, pool, **kw):
    return check_against_reference(q, pool, int8_query=True, **kw)


@pytest.mark.parametrize(
    "dk, dv, hq, hkv", [(64, 64, 8, 2), (40, 24, 4, 4), (128, 128, 32, 8), (192, 64, 6, 1)]
)
def test_int8_query_decode_matches_its_twin(isa, int8_query, dk, dv, hq, hkv):
    """Decode (few rows: VNNI's integer dot products where the path has them, Dk a multiple of
    64) and every other path, against the reference that quantises the query the same way."""
    rng = make_rng(11, dk, hq)
    pool = QPool(rng, [1, 17, 100, 300], dtype="int8", block_size=16, hkv=hkv, dk=dk, dv=dv)
    q = rng.standard_normal((4, hq, dk)).astype(np.float32)
    check_against_twin(q, pool)
    check_against_twin(q, pool, window=(37, None), scale=0.3)
    check_against_twin(q, pool, alibi_slopes=np.linspace(0.1, 1, hq).astype(np.float32))
    with pytest.raises(AssertionError):  # it is not the float query's result
        check_against_reference(q, pool, int8_query=False)


def test_int8_query_chunked_prefill_matches_its_twin(isa, int8_query):
    """More than kDotRows rows (the packed path, over dequantised tiles) and mixed batches."""
    rng = make_rng(12)
    lens, q_lens = np.array([70, 33, 129]), np.array([70, 1, 20])
    pool = QPool(rng, lens, dtype="int8", block_size=16, hkv=2, dk=64, dv=64)
    q = rng.standard_normal((int(q_lens.sum()), 8, 64)).astype(np.float32)
    check_against_twin(q, pool, q_lens=q_lens)
    check_against_twin(q, pool, q_lens=q_lens, window=(16, 0), softcap=30.0)


@pytest.mark.parametrize("dk", [128, 48])
def test_int8_query_vnni_gives_the_fma_scores(int8_query, dk):
    """The codes' sums are exact in float32 (Dk < 1040), so the integer products (VNNI on the
    avx2vnni, avx512vnni, avx512bf16 and amx paths, SDOT on neon-bf16) give the scores of the
    float32-widening twin's FMAs (avx2, avx512, neon) over the same codes, and the same outputs,
    bit for bit (Dk 48: SDOT's 16 bytes, not VNNI's 32 or 64)."""
    from helpers import ISAS, WIDENING_TWIN, on_isa, runs_here

    pairs = [(n, twin) for n, twin in WIDENING_TWIN.items() if runs_here(n) and twin in ISAS]
    if not pairs:
        pytest.skip("CPU lacks VNNI, or ARM DotProd with BF16")
    rng = make_rng(13)
    pool = QPool(rng, [300, 64], dtype="int8", block_size=16, hkv=2, dk=dk, dv=128)
    q = rng.standard_normal((2, 8, dk)).astype(np.float32)

    def run():
        return attnx.paged_attention(q, *pool.args(), **pool.scales())

    for name, twin in pairs:
        np.testing.assert_array_equal(on_isa(name, run), on_isa(twin, run), err_msg=name)


def test_int8_query_only_for_int8_pages(isa, int8_query):
    """fp8 pages, float pages and float64 keep the float query."""
    rng = make_rng(14)
    pool = QPool(rng, [90], dtype="float8_e4m3fn", block_size=16, hkv=1, dk=64, dv=64)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    check_against_reference(q, pool)


def test_int8_query_error_against_float32_kv(int8_query):
    """The yardstick beside the float query's (README): quantising the query as well roughly
    doubles int8's error on random normal data (D = 128, GQA 4, 2048 keys)."""
    q, k, v, bt, lens, exact, rms = yardstick_problem()
    (kq, ks), (vq, vs) = ref.quantize_kv(k, "int8"), ref.quantize_kv(v, "int8")

    def error():
        out = attnx.paged_attention(q, kq, vq, bt, lens, k_scales=ks, v_scales=vs)
        return float(np.abs(out - exact).max()) / rms

    err_q8 = error()
    attnx.set_int8_query(False)
    err_f = error()
    print(f"max |int8 - float32| / rms: float query {err_f:.4f}, int8 query {err_q8:.4f}")
    assert err_f < err_q8 < 0.1


def test_int8_query_switch_from_the_environment():
    """ATTNX_INT8_QUERY at import: 1 on, 0 off, auto (or unset) the default; anything else is an
    ImportError naming it."""
    import os
    import subprocess
    import sys

    code = "import attnx; print(attnx.int8_query(), attnx.cpu_features()['integer_products'])"
    for value, want in (("1", "True"), ("0", "False"), ("auto", None), (None, None), ("x", "")):
        env = {k: v for k, v in os.environ.items() if k != "ATTNX_INT8_QUERY"}
        if value is not None:
            env["ATTNX_INT8_QUERY"] = value
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        if want == "":
            assert res.returncode != 0 and "ATTNX_INT8_QUERY='x'" in res.stderr, res.stderr
            continue
        on, products = res.stdout.split()
        assert on == (want or products), (value, res.stdout, res.stderr)


def test_int8_query_default_follows_the_path(isa):
    """The default (None) turns integer queries on exactly where the active path has integer dot
    products; True and False force them; each call returns the setting it replaced."""
    before = attnx.set_int8_query(None)  # (ATTNX_INT8_QUERY may have set it)
    try:
        assert attnx.int8_query() is attnx.cpu_features()["integer_products"]
        want = attnx._core.active_isa() in INTEGER_PRODUCT_ISAS
        assert attnx.int8_query() is want
        assert attnx.set_int8_query(True) is None and attnx.int8_query() is True
        assert attnx.set_int8_query(False) is True and attnx.int8_query() is False
        assert attnx.set_int8_query(None) is False and attnx.int8_query() is want
        with pytest.raises(TypeError, match="^on: expected a bool"):
            attnx.set_int8_query(np.ones(3))
        assert attnx.set_int8_query(None) is None  # (the refusal changed nothing)
    finally:
        attnx.set_int8_query(before)


# ---------------------------------------------------------------------------------------------
# the binding's checks
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# one scale for every row (fp8; vLLM's per-layer fp8 caches)
# ---------------------------------------------------------------------------------------------

FP8 = ["float8_e4m3fn", "float8_e5m2"]
NAN_CODE = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}


def test_fixed_scale_definition():
    x = np.array([[1.0, -2.0, 0.1, 1e6, -1e6, np.nan, np.inf, -np.inf, 0.0, 1e-30]], np.float32)
    for dtype in FP8:
        q, s = attnx.quant.quantize_kv(x, dtype, scale=0.5)
        assert s.tolist() == [0.5] and q.dtype == attnx.quant.quantised_dtype(dtype)
        back = attnx.quant.dequantize_kv(q, s)[0]
        fmax = float(ml_dtypes.finfo(q.dtype).max)
        np.testing.assert_allclose(back[:3], [1.0, -2.0, 0.1], rtol=2**-3)
        assert back[3:5].tolist() == [0.5 * fmax, -0.5 * fmax]  # saturated, not NaN
        assert (q.view(np.uint8)[0, 5:8] == NAN_CODE[dtype]).all()  # NaN where x is not finite
        assert back[8:].tolist() == [0.0, 0.0]
    with pytest.raises(TypeError, match="scale: one scale for every row is for float8 pages"):
        attnx.quant.quantize_kv(x, "int8", scale=1.0)
    for bad in (0.0, -1.0, np.nan, np.inf, 1e-40, 1e39):
        with pytest.raises(ValueError, match="normal range"):
            attnx.quant.quantize_kv(x, "float8_e4m3fn", scale=bad)
    for bad in (True, "1", [1.0]):
        with pytest.raises(TypeError, match="scale: expected a real number"):
            attnx.quant.quantize_kv(x, "float8_e4m3fn", scale=bad)


def _fixed_pool(rng, dtype, seq_lens, *, block_size=16, hkv=2, dk=64, dv=64, shared=0):
    """fp8 pages quantised with one scale per side, scrambled tables, every slot no sequence owns
    holding NaN codes; with ``shared``, every sequence's first ``shared`` blocks are the same
    (a shared prefix). Returns (k_pages, v_pages, block_tables, seq_lens, k_scale, v_scale)."""
    seq_lens = np.asarray(seq_lens, np.int64)
    need = -(-seq_lens // block_size)
    nb = int(need.sum()) + 3
    k = (rng.standard_normal((nb, hkv, block_size, dk)) * 3).astype(np.float32)
    v = rng.standard_normal((nb, hkv, block_size, dv)).astype(np.float32)
    ks, vs = 0.02, 0.005
    kp, _ = attnx.quant.quantize_kv(k, dtype, scale=ks)
    vp, _ = attnx.quant.quantize_kv(v, dtype, scale=vs)
    bt, owned = scramble_tables(rng, seq_lens, block_size, nb, int(need.max()) + 1, NEVER)
    if shared:
        bt[:, :shared] = bt[0, :shared]  # sequence 0's blocks, whole (owned)
    for pages in (kp, vp):
        pages.view(np.uint8).transpose(0, 2, 1, 3)[~owned] = NAN_CODE[dtype]
    return kp, vp, bt, seq_lens, ks, vs


@pytest.mark.parametrize("dtype", FP8)
def test_fixed_scale_pages_match_the_reference(isa, dtype):
    """Decode, chunked prefill and a shared prefix (the cascade) over fp8 pages read through one
    scale per side: the reference over the pages read back, and no NaN from unowned slots."""
    rng = make_rng(7, len(dtype))
    kp, vp, bt, lens, ks, vs = _fixed_pool(rng, dtype, [1, 17, 100, 300])
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    cases = [dict(), dict(window=(37, None))]
    ql = np.array([1, 17, 20, 1])
    qp = rng.standard_normal((int(ql.sum()), 8, 64)).astype(np.float32)
    for qq, kw in [(q, c) for c in cases] + [(qp, dict(q_lens=ql, softcap=30.0))]:
        got = attnx.paged_attention(qq, kp, vp, bt, lens, k_scales=ks, v_scales=vs, **kw)
        want = ref.paged_attention(qq, kp, vp, bt, lens, k_scales=ks, v_scales=vs, **kw)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, **TOL)
    # 16 forks of a 1024-token prompt: the shared blocks are read once for all (the cascade)
    lens = np.full(16, 1024 + 5)
    kp, vp, bt, lens, ks, vs = _fixed_pool(rng, dtype, lens, shared=64)
    q = rng.standard_normal((16, 8, 64)).astype(np.float32)
    got = attnx.paged_attention(q, kp, vp, bt, lens, k_scales=ks, v_scales=vs)
    want = ref.paged_attention(q, kp, vp, bt, lens, k_scales=ks, v_scales=vs)
    np.testing.assert_allclose(got, want, **TOL)


SPECIAL = st.sampled_from([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, np.nan, np.inf, -np.inf])


@given(
    dtype=st.sampled_from(FP8),
    scale=st.floats(1e-6, 1e3),
    rows=st.lists(
        st.one_of(st.floats(-1e4, 1e4, width=32), SPECIAL), min_size=3 * 2 * 24, max_size=3 * 2 * 24
    ),
)
def test_fixed_scale_write_is_quantize_kv_bit_for_bit(dtype, scale, rows):
    """The step's write with one scale (vLLM's per-layer fp8): the new rows' codes equal
    attnx.quant.quantize_kv(rows, dtype, scale) bit for bit, special values included, and no other
    byte of the pages changes."""
    x = np.array(rows, np.float32).reshape(3, 2, 24)  # 3 new tokens, 2 kv heads, D 24
    dt = attnx.quant.quantised_dtype(dtype)
    kp = np.full((4, 2, 4, 24), NAN_CODE[dtype], np.uint8).view(dt)
    vp = kp.copy()
    slots = np.array([13, 2, 6])  # blocks 3, 0, 1
    bt = np.array([[0, 1, 2, 3]], np.int32)
    q = np.zeros((3, 2, 24), np.float32)
    want_k, want_v = kp.copy(), vp.copy()
    codes, _ = attnx.quant.quantize_kv(x, dtype, scale=scale)
    for pages in (want_k, want_v):
        pages[slots // 4, :, slots % 4] = codes
    attnx._core.paged_attention(
        q,
        kp,
        vp,
        bt,
        np.array([16]),
        q_lens=np.array([3]),
        k_new=x,
        v_new=x,
        slots=slots,
        k_scales=scale,
        v_scales=np.float32(scale),
    )
    assert np.array_equal(kp.view(np.uint8), want_k.view(np.uint8))
    assert np.array_equal(vp.view(np.uint8), want_v.view(np.uint8))


def test_fixed_scale_step_writes_then_attends(isa):
    """paged_step (the cache's call) with one scale per side: the written pages and the output
    are those of quantising with it, then attending over the pages read back."""
    rng = make_rng(8)
    dtype = "float8_e4m3fn"
    kp, vp, bt, lens, ks, vs = _fixed_pool(rng, dtype, [40, 9], hkv=2, dk=32, dv=32)
    ql = np.array([5, 1])
    slots = np.concatenate(
        [
            bt[b, (p := np.arange(n - m, n)) // 16] * 16 + p % 16
            for b, (n, m) in enumerate(zip(lens, ql))
        ]
    )
    k = rng.standard_normal((6, 2, 32)).astype(np.float32)
    v = rng.standard_normal((6, 2, 32)).astype(np.float32)
    q = rng.standard_normal((6, 4, 32)).astype(np.float32)
    want_k, want_v = kp.copy(), vp.copy()
    want_k[slots // 16, :, slots % 16] = attnx.quant.quantize_kv(k, dtype, scale=ks)[0]
    want_v[slots // 16, :, slots % 16] = attnx.quant.quantize_kv(v, dtype, scale=vs)[0]
    want = ref.paged_attention(q, want_k, want_v, bt, lens, q_lens=ql, k_scales=ks, v_scales=vs)
    got = attnx.ops.paged.paged_step(q, k, v, kp, vp, bt, lens, ql, slots, k_scales=ks, v_scales=vs)
    assert np.array_equal(kp.view(np.uint8), want_k.view(np.uint8))
    assert np.array_equal(vp.view(np.uint8), want_v.view(np.uint8))
    np.testing.assert_allclose(got, want, **TOL)


def test_fixed_scale_refusals_write_nothing():
    rng = make_rng(9)
    kp, vp, bt, lens, ks, vs = _fixed_pool(rng, "float8_e4m3fn", [20], dk=8, dv=8)
    q = np.ones((1, 2, 8), np.float32)
    new = dict(k_new=np.ones((1, 2, 8), np.float32), v_new=np.ones((1, 2, 8), np.float32))
    write = dict(q_lens=np.array([1]), slots=np.array([int(bt[0, 1]) * 16 + 3]), **new)
    before = kp.copy(), vp.copy()
    bad = [
        (dict(k_scales=ks, v_scales=0.0), ValueError, "v_scales: expected a finite positive"),
        (dict(k_scales=-1.0, v_scales=vs), ValueError, "k_scales: expected a finite positive"),
        (dict(k_scales=ks, v_scales=np.nan), ValueError, "v_scales: expected a finite positive"),
        (dict(k_scales=ks, v_scales=1e-40), ValueError, "normal range"),
        (dict(k_scales=True, v_scales=vs), TypeError, "k_scales: expected one real scale"),
        (dict(k_scales="2", v_scales=vs), TypeError, "k_scales: expected one real scale"),
        (
            dict(k_scales=ks, v_scales=None),
            TypeError,
            "v_scales: pages of dtype float8_e4m3fn need",
        ),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            attnx._core.paged_attention(q, kp, vp, bt, lens, **write, **kw)
        with pytest.raises(exc, match=msg):
            attnx.paged_attention(q, kp, vp, bt, lens, **kw)
    assert np.array_equal(kp.view(np.uint8), before[0].view(np.uint8))
    assert np.array_equal(vp.view(np.uint8), before[1].view(np.uint8))
    i8 = attnx.quant.quantize_kv(np.ones((4, 2, 16, 8), np.float32), "int8")[0]
    with pytest.raises(TypeError, match="k_scales: one scale for every row is for float8 pages"):
        attnx.paged_attention(q, i8, i8, bt, lens, k_scales=1.0, v_scales=1.0)
    f32 = np.ones((4, 2, 16, 8), np.float32)
    with pytest.raises(TypeError, match="only quantised pages"):
        attnx.paged_attention(q, f32, f32, bt, lens, k_scales=1.0, v_scales=1.0)


def test_binding_refuses_bad_scales():
    rng = make_rng(6)
    pool = QPool(rng, [20], dtype="int8", block_size=16, hkv=2, dk=8, dv=8)
    q = np.ones((1, 2, 8), np.float32)
    args = (q,) + pool.args()
    ks, vs = pool.k_scales, pool.v_scales
    bad = [
        (dict(v_scales=vs), TypeError, "k_scales: pages of dtype int8 need"),
        (
            dict(k_scales=ks.astype(np.float64), v_scales=vs),
            TypeError,
            "k_scales: expected float32",
        ),
        (dict(k_scales=ks.astype(">f4"), v_scales=vs), TypeError, "native byte order"),
        (dict(k_scales=ks, v_scales=vs[:, :1]), ValueError, "v_scales: expected shape"),
        (dict(k_scales=ks.tolist(), v_scales=vs), TypeError, "k_scales: expected float32"),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            attnx.paged_attention(*args, **kw)
    f32 = (q, pool.k_float, pool.v_float) + pool.args()[2:]
    with pytest.raises(TypeError, match="only quantised pages"):
        attnx.paged_attention(*f32, k_scales=ks, v_scales=vs)
    with pytest.raises(TypeError, match="k_pages: expected dtype float32, float16, bfloat16, int8"):
        attnx.paged_attention(
            q,
            pool.k_pages.view(np.uint8),
            pool.v_pages.view(np.uint8),
            *pool.args()[2:],
            k_scales=ks,
            v_scales=vs,
        )
    with pytest.raises(TypeError, match="v_pages: expected the dtype of k_pages"):
        attnx.paged_attention(
            q,
            pool.k_pages,
            pool.v_pages.view(ml_dtypes.float8_e5m2),
            *pool.args()[2:],
            k_scales=ks,
            v_scales=vs,
        )


def test_step_refuses_read_only_scales_and_writes_nothing():
    cache = attnx.PagedKVCache(1, 1, 8, num_blocks=4, block_size=4, dtype="int8")
    a = cache.new_sequence()
    step = cache.begin_step([a], [2])
    ks = cache.k_scales(0).copy()
    ks.flags.writeable = False
    x = np.ones((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="k_scales: array is not writable"):
        attnx.ops.paged.paged_step(
            x,
            x,
            x,
            cache.k_pages(0),
            cache.v_pages(0),
            step.block_tables,
            step.seq_lens,
            step.q_lens,
            step.slots,
            k_scales=ks,
            v_scales=cache.v_scales(0),
        )
    assert (cache.k_pages(0) == 0).all() and (cache.v_scales(0) == 0).all()


# ---------------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------------


class QShadow:
    """A quantised cache and, beside it, every sequence's float32 rows per layer; each step's
    pages, scales and outputs are checked against the reference on those rows."""

    def __init__(self, cache, hq):
        self.cache, self.hq = cache, hq
        self.rows = {}

    def new(self):
        s = self.cache.new_sequence()
        self.rows[s] = [
            (
                np.zeros((0, self.cache.num_kv_heads, self.cache.head_dim), np.float32),
                np.zeros((0, self.cache.num_kv_heads, self.cache.value_dim), np.float32),
            )
            for _ in range(self.cache.num_layers)
        ]
        return s

    def fork(self, s):
        c = self.cache.fork(s)
        self.rows[c] = list(self.rows[s])
        return c

    def truncate(self, s, n):
        self.cache.truncate(s, n)
        self.rows[s] = [(k[:n], v[:n]) for k, v in self.rows[s]]

    def step(self, rng, seqs, counts, **kw):
        c = self.cache
        step = c.begin_step(seqs, counts)
        T = int(sum(counts))
        for layer in range(c.num_layers):
            q = rng.standard_normal((T, self.hq, c.head_dim)).astype(np.float32)
            k = (rng.standard_normal((T, c.num_kv_heads, c.head_dim)) * 3).astype(np.float32)
            v = rng.standard_normal((T, c.num_kv_heads, c.value_dim)).astype(np.float32)
            if T:
                k[0, 0] = 0.0  # a zero row: scale 0
            o = step.attend(layer, q, k, None if c.value_from_key else v, **kw)
            at = 0
            for s, n in zip(seqs, counts):
                K, V = self.rows[s][layer]
                newv = k[at : at + n, :, : c.value_dim] if c.value_from_key else v[at : at + n]
                self.rows[s][layer] = (
                    np.concatenate([K, k[at : at + n]]),
                    np.concatenate([V, newv]),
                )
                self.check_output(s, layer, q[at : at + n], o[at : at + n], **kw)
                at += n
        self.check_pages()
        return step

    def dequantised(self, s, layer):
        K, V = self.rows[s][layer]
        dt = self.cache.dtype
        kq = ref.dequantize_kv(*ref.quantize_kv(K, dt))
        vq = (
            kq[..., : self.cache.value_dim]
            if self.cache.value_from_key
            else ref.dequantize_kv(*ref.quantize_kv(V, dt))
        )
        return kq, vq

    def check_output(self, s, layer, q, o, **kw):
        if len(q) == 0:
            return
        K, V = self.dequantised(s, layer)
        if self.cache.sliding_window is not None:
            kw.setdefault("window", (self.cache.sliding_window - 1, None))
        if self.cache.k_pages(layer).dtype == np.int8 and attnx.int8_query():
            q, kw = quantize_query(q, kw.get("scale")), {**kw, "scale": 1.0}  # (its twin)
            K, V = K.astype(np.float64), V.astype(np.float64)
        want = ref.attention(q, K, V, causal=True, layout="bshd", **kw)
        np.testing.assert_allclose(o, want, **TOL)

    def check_pages(self):
        c = self.cache
        for s in self.rows:
            n = c.length(s)
            bt = c.block_table(s)
            t = np.arange(n)
            blk, off = bt[t // c.block_size], t % c.block_size
            live = blk >= 0  # the sliding window released the rest
            for layer in range(c.num_layers):
                K, V = self.rows[s][layer]
                kq, ks = ref.quantize_kv(K, c.dtype)
                got_k = c.k_pages(layer)[blk[live], :, off[live]]
                assert np.array_equal(got_k.view(np.uint8), kq[live].view(np.uint8)), (s, layer)
                np.testing.assert_array_equal(c.k_scales(layer)[blk[live], :, off[live]], ks[live])
                if not c.value_from_key:
                    vq, vs = ref.quantize_kv(V, c.dtype)
                    assert np.array_equal(
                        c.v_pages(layer)[blk[live], :, off[live]].view(np.uint8),
                        vq[live].view(np.uint8),
                    )
                    np.testing.assert_array_equal(
                        c.v_scales(layer)[blk[live], :, off[live]], vs[live]
                    )


@pytest.mark.parametrize("dtype", QDTYPES)
def test_cache_prefill_decode_fork_copy_on_write_truncate(isa, dtype):
    rng = make_rng(7, len(dtype))
    cache = attnx.PagedKVCache(
        num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=64, block_size=8, dtype=dtype
    )
    assert cache.quantised and cache.k_pages(0).dtype == ref.quantised_dtype(dtype)
    sh = QShadow(cache, hq=8)
    a, b = sh.new(), sh.new()
    sh.step(rng, [a, b], [21, 5])
    for _ in range(4):
        sh.step(rng, [a, b], [1, 1])
    c = sh.fork(a)  # shares a's partly filled last block
    sh.step(rng, [c], [3])  # copy-on-write: the block's codes and scales are copied
    sh.step(rng, [a, c], [2, 12])
    sh.truncate(a, 10)
    sh.step(rng, [a, b, c], [9, 1, 1])
    assert cache.k_scales(1).base is not None  # views, not copies
    assert np.shares_memory(cache.k_scales(1), cache._k_scales)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_cache_sliding_window_and_latent_values(isa, dtype):
    rng = make_rng(8)
    cache = attnx.PagedKVCache(1, 2, 16, num_blocks=32, block_size=4, dtype=dtype, sliding_window=7)
    sh = QShadow(cache, hq=4)
    a = sh.new()
    for n in (9, 1, 1, 12, 1):
        sh.step(rng, [a], [n])
    assert (cache.block_table(a) == -1).any()
    mla = attnx.PagedKVCache(
        1, 1, 24, num_blocks=16, block_size=4, dtype=dtype, value_dim=16, value_from_key=True
    )
    assert np.shares_memory(mla.v_scales(0), mla.k_scales(0))
    sh = QShadow(mla, hq=4)
    m = sh.new()
    sh.step(rng, [m], [6])
    sh.step(rng, [m], [1])


def test_cache_dtypes_and_bytes_per_token():
    f16 = attnx.PagedKVCache(2, 4, 128, num_blocks=8, block_size=16, dtype="float16")
    i8 = attnx.PagedKVCache(2, 4, 128, num_blocks=8, block_size=16, dtype="int8")
    e4 = attnx.PagedKVCache(2, 4, 128, num_blocks=8, block_size=16, dtype=ml_dtypes.float8_e4m3fn)
    assert f16.k_scales(0) is None and f16.v_scales(1) is None
    assert i8.k_scales(0).shape == (8, 4, 16) and i8.k_scales(0).dtype == np.float32
    # per token: layers * heads * (K and V features * 1 byte + 2 scales * 4 bytes)
    assert i8.stats()["bytes_per_token"] == e4.stats()["bytes_per_token"] == 2 * 4 * (256 + 8)
    assert f16.stats()["bytes_per_token"] == 2 * 4 * 256 * 2
    assert e4.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    for bad in ("int16", "uint8", "float8_e4m3fnuz", np.float64):
        with pytest.raises(TypeError, match="dtype: expected 'float32'.*'float8_e5m2'"):
            attnx.PagedKVCache(1, 1, 8, num_blocks=2, dtype=bad)


@pytest.mark.parametrize("src", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_step_quantises_exactly_as_the_reference(src, dtype):
    rng = make_rng(9, len(dtype))
    cache = attnx.PagedKVCache(1, 3, 40, num_blocks=8, block_size=4, dtype=dtype)
    a = cache.new_sequence()
    step = cache.begin_step([a], [8])
    lim = 3 if src is np.float16 else 30  # row magnitudes 10**-lim .. 10**lim
    k = (rng.standard_normal((8, 3, 40)) * 10.0 ** rng.integers(-lim, lim, (8, 3, 1))).astype(
        np.float32
    )
    k[0, 0], k[1, 1, 5], k[2, 2, 0] = 0.0, np.nan, -np.inf
    k[3, 0] = 1e-44 if src is np.float32 else 0.0
    # ties: the row's largest is 127 * 2^-3, so s = 2^-3 exactly and x / s lands on j + 1/2, which
    # rounds half to even (int8: 0.5 -> 0, -1.5 -> -2, 2.5 -> 2, 38.5 -> 38)
    halves = (np.arange(39) + 0.5) * np.where(np.arange(39) % 2, -1.0, 1.0)
    k[4, 1] = np.concatenate([[127.0], halves]) / 8
    k[5, 2] = np.concatenate([[-127.0], np.linspace(-126.5, 126.5, 39)]) / 8
    k = k.astype(src)
    v = rng.standard_normal((8, 3, 40)).astype(src)
    step.attend(0, rng.standard_normal((8, 3, 40)).astype(np.float32), k, v)
    kq, ks = ref.quantize_kv(k, dtype)
    t = np.arange(8)
    blk, off = cache.block_table(a)[t // 4], t % 4
    assert np.array_equal(cache.k_pages(0)[blk, :, off].view(np.uint8), kq.view(np.uint8))
    np.testing.assert_array_equal(cache.k_scales(0)[blk, :, off], ks)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_every_code_decodes_as_the_reference(isa, dtype):
    """One key, so the output is its value row exactly: a row holding all 256 codes (NaN and inf
    codes of fp8, -128 of int8 included) reads back as dequantize_kv says, on every ISA (vector
    body and scalar tail: D = 256 + 3)."""
    codes = (
        np.concatenate([np.arange(256), [1, 2, 255]])
        .astype(np.uint8)
        .view(ref.quantised_dtype(dtype))
    )
    v_pages = codes.reshape(1, 1, 1, -1)
    k_pages = np.zeros((1, 1, 1, 4), v_pages.dtype)
    for s in (1.0, 0.375, 3e-5):
        v_scales = np.full((1, 1, 1), s, np.float32)
        k_scales = np.zeros((1, 1, 1), np.float32)
        o = attnx.paged_attention(
            np.ones((1, 1, 4), np.float32),
            k_pages,
            v_pages,
            np.zeros((1, 1), np.int32),
            np.array([1]),
            k_scales=k_scales,
            v_scales=v_scales,
        )
        want = ref.dequantize_kv(v_pages, v_scales)[0, 0]
        np.testing.assert_array_equal(o[0], want)


@pytest.mark.parametrize("side", ["k", "v"])
def test_e4m3_tiles_read_in_place_and_the_nan_code(isa, side):
    """At register-block widths e4m3 rows are read in place: widened with the NaN code's test
    (AVX-512, one lane), or without it where each tile is first checked for the code (AVX2, NEON;
    a tile holding one is converted exactly). Every finite code
    decodes as the reference in place, on the decode path and a chunk's many-row path; a NaN code
    in the third of four tiles of K or V makes NaN exactly the outputs that see it (the rows of
    its kv head; for V, their one feature): a window that leaves it out keeps them finite."""
    L, D, hq, hkv = 200, 128, 4, 2
    finite = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    rng = make_rng(12)
    k, v = (rng.choice(finite, (L, hkv, D)).view(ml_dtypes.float8_e4m3fn) for _ in range(2))
    nan_code = np.uint8(0xFF if side == "k" else 0x7F).view(ml_dtypes.float8_e4m3fn)
    (k if side == "k" else v)[150, 1, 5] = nan_code
    ks, vs = rng.uniform([[[[1e-3]]], [[[1e-2]]]], [[[[1e-2]]], [[[2.0]]]], (2, L, hkv, 1)).astype(
        np.float32
    )  # keys small enough for scores float32 resolves
    # the same seed, the same scrambled table for the codes and their scales
    k_pages, v_pages, tables, lens = pool_from_sequences(make_rng(1), [k], [v], 16)
    k_scales, v_scales, _, _ = pool_from_sequences(make_rng(1), [ks], [vs], 16)
    pages = dict(k_scales=k_scales[..., 0], v_scales=v_scales[..., 0])
    rng = make_rng(13)
    for q_len in (1, 24):  # decode (K and V in place) and a chunk (V in place, K packed)
        q = rng.standard_normal((q_len, hq, D)).astype(np.float32)
        for window, nan in ((None, True), ((20, None), False)):
            args = (q, k_pages, v_pages, tables, lens)
            kw = dict(q_lens=np.array([q_len]), window=window, **pages)
            got, want = attnx.paged_attention(*args, **kw), twin(*args, **kw)
            assert_close_to_top(got, want)  # (codes up to 448, times V scales up to 2)
            assert np.isnan(got[:, 2:]).any() == nan and np.isfinite(got[:, :2]).all()


def extreme_scales_pool(rng, dtype, case, dk, L=40, hkv=2):
    """A pool of one L-token sequence whose scales sit at float32's ends (``case``), and the factor
    its queries take: huge: every dequantised value finite, up to FLT_MAX / 1.01 (codes of at
    most 8, so that the scales pass FLT_MAX / 256), queries of ~1e-37 (scores of a few units);
    tiny: V scales below float32's normal range (the cache's own rule for values near 1e-37);
    inf: one key's scale -inf, one of its codes 0."""
    pool = QPool(rng, [L], dtype=dtype, block_size=16, hkv=hkv, dk=dk, dv=dk)
    live = np.isfinite(pool.k_scales)  # (the pool's unowned slots stay NaN)
    if case == "huge":
        for name in ("k_pages", "v_pages"):
            c = getattr(pool, name)
            setattr(pool, name, np.where(np.abs(c.astype(np.float32)) <= 8, c, c.dtype.type(1)))
        codes = [np.abs(p.astype(np.float32)) for p in (pool.k_pages, pool.v_pages)]
        pool.k_scales[live] = pool.v_scales[live] = float(np.finfo(np.float32).max) / 1.01
        pool.k_scales[live] /= np.maximum(codes[0].max(3), 1)[live]
        pool.v_scales[live] /= np.maximum(codes[1].max(3), 1)[live]
    elif case == "tiny":
        pool.v_scales[live] *= np.float32(1e-37)
    else:  # (with a code of 0, every seed gives the row a NaN: 0 * inf)
        pool.k_scales[pool.block_tables[0, 1], 1, 3] = -np.inf
        pool.k_pages[pool.block_tables[0, 1], 1, 3, 0] = 0
    return pool, (1e-37 if case == "huge" else 1.0)


def check_extreme_scales(q, pool, case, int8_query=None, **kw):
    """attnx.paged_attention over an ``extreme_scales_pool`` against its twin: NaN exactly where
    the twin has NaN (only in the inf case), the rest to float32 tolerance of the largest output."""
    kw.update(pool.scales())
    got = attnx.paged_attention(q, *pool.args(), **kw)
    with np.errstate(invalid="ignore"):  # (the inf case's 0 * inf in the twin, on purpose)
        want = twin(q, *pool.args(), int8_query=int8_query, **kw)
    assert (np.isnan(got) == np.isnan(want)).all() and np.isnan(got).any() == (case == "inf")
    assert_close_to_top(got, want)


def assert_close_to_top(got, want):
    """``got`` within float32 tolerance of ``want``, NaN where it has NaN, the absolute part scaled
    to its largest finite magnitude: another order of the same sums errs by ulps of the terms,
    and an output near 0 can sum terms of the row's size."""
    top = np.nanmax(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=TOL["rtol"], atol=TOL["atol"] * top, equal_nan=True)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("case", ["huge", "tiny", "inf"])
def test_scales_at_the_ends_of_float32(isa, dtype, case):
    """Tiles whose scales the in-place products cannot take are read dequantised, so every scale
    a user's pages hold gives the reference's result over ``code * scale``:
    huge: above FLT_MAX / 256, where e4m3's 256 * scale (its codes are widened as code / 256)
    overflowed to inf though each value is finite (the converting path too), and where integer
    queries' codes (up to 127) times the dequantised keys overflowed;
    tiny: V scales below float32's normal range, where p * scale kept a few bits of p (1e-4 of
    the output; the cache's own rule makes them for values near 1e-38);
    inf: a key scale of +-inf turned the key's score into -inf (skipped) where the dequantised
    key row is inf and NaN, so the rows that see it are NaN.
    Decode rows and, at 12 tokens (24 rows of a kv head), the packed prefill path."""
    rng = make_rng(21, len(dtype), len(case))
    hq = 4
    for dk in (16, 17):  # in place (a register block's width) and converted
        pool, q_factor = extreme_scales_pool(rng, dtype, case, dk)
        q = (rng.standard_normal((12, hq, dk)) * q_factor).astype(np.float32)
        for q_len in (1, 3, 12):
            check_extreme_scales(q[:q_len], pool, case, q_lens=np.array([q_len]))


@given(
    st.sampled_from(QDTYPES),
    st.sampled_from([1, 3, 16]),
    st.integers(1, 3),
    st.sampled_from([(1, 1), (4, 2), (6, 3)]),
    st.sampled_from([8, 24, 64]),
    st.integers(0, 2**31 - 1),
)
def test_property_any_pool_matches_reference(isa, dtype, block_size, batch, heads, d, seed):
    """Random pools (lengths, block sizes, GQA, widths with and without a vector tail, a decode
    row or a chunk per sequence): the active ISA attends over exactly the dequantised pages."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 90, batch)
    q_lens = np.minimum(lens, rng.choice([1, 12], batch))
    hq, hkv = heads
    pool = QPool(rng, lens, dtype=dtype, block_size=block_size, hkv=hkv, dk=d, dv=d)
    q = rng.standard_normal((int(q_lens.sum()), hq, d)).astype(np.float32)
    check_against_reference(q, pool, q_lens=q_lens)


def test_strided_scale_pages(isa):
    """Scale pages of any strides (here a transposed copy's view) are read where they are."""
    rng = make_rng(10)
    pool = QPool(rng, [40, 7], dtype="int8", block_size=8, hkv=2, dk=16, dv=16)
    ks = np.ascontiguousarray(pool.k_scales.transpose(2, 1, 0)).transpose(2, 1, 0)
    assert ks.strides[-1] != 4
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    got = attnx.paged_attention(q, *pool.args(), k_scales=ks, v_scales=pool.v_scales)
    want = twin(q, *pool.args(), **pool.scales())
    np.testing.assert_allclose(got, want, **TOL)
