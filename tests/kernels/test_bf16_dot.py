"""The bf16 dot-product paths: prefill over bfloat16 q, k and v on AVX512_BF16's vdpbf16ps
(avx512bf16) or FEAT_BF16's BFDOT (neon-bf16 on aarch64), fp32 accumulation, P rounded to bf16
before P V, cpp/src/kernels/bf16_dot-inl.h.

Numerics follow the flash-attention rule: the error against the float64 reference (on the bf16
values themselves) stays within a small multiple of a same-precision implementation's error, here
``helpers.bf16_twin`` (the reference with P rounded to bf16, output rounded to bf16) and, where
installed, torch's bf16 ``scaled_dot_product_attention``.  The rest of the path's contract:
selected at import where the CPU has AVX512_BF16 (measured faster) or ARM BF16, forced or
refused by ``ATTNX_ISA`` / ``set_isa``, ``avx512`` (``neon``) keeps the exact fp32-widening
results, and every other dtype and decode run the avx512 (neon) kernels unchanged.  On a CPU
without either these tests skip, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from attnx import reference as ref

from helpers import (
    AMX_PATHS,
    BF16,
    BF16_DOT_GAIN,
    BF16_ISAS,
    BF16_PRODUCT_ISAS,
    EMUL_MAX_RATIO,
    PREFILL_SHAPES,
    TORCH_RATIO,
    assert_flash_rule,
    assert_set_isa_refused,
    best_isa,
    bf16_twin,
    check_attention,
    errors,
    has_amx,
    has_avx512bf16,
    has_bf16_products,
    has_neon_bf16,
    on_isa,
    pool_from_sequences,
    prefill_problems,
    prefill_qkv,
    rand,
    widening_path,
)

needs_bf16 = pytest.mark.skipif(
    not has_bf16_products(), reason="CPU lacks AVX512_BF16 and ARM BF16 with DotProd"
)
# the float32-widening path the bf16 product paths must agree with where they do not multiply
# in bf16 (avx512 on x86, neon on aarch64)
WIDENING = widening_path()


# ---- selection -----------------------------------------------------------------------------


def _isa_in_child(env_isa):
    env = {k: v for k, v in os.environ.items() if k != "ATTNX_ISA"}
    if env_isa is not None:
        env["ATTNX_ISA"] = env_isa
    code = "import attnx; print(attnx.cpu_features()['isa'])"
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    return res.returncode, res.stdout.strip(), res.stderr


@needs_bf16
def test_selected_at_import_and_forceable():
    """The default is the measured choice (helpers.best_isa: AMX where granted, else bf16 dot
    products only where they out-run float32 FMAs; on aarch64 neon-bf16 wherever the CPU has
    BF16 and DotProd); every path the CPU has can be forced."""
    assert _isa_in_child(None)[:2] == (0, best_isa())
    for name in BF16_ISAS + [WIDENING]:
        assert _isa_in_child(name)[:2] == (0, name)


def test_bf16_dot_gain_is_measured():
    """The probe behind the choice: multiply-adds per second of vdpbf16ps over 512-bit FMAs (0
    without AVX512_BF16). Every CPU measured sits far from the line (Zen 4 ~2, Sapphire Rapids
    ~0.5), so the default path does not flip between runs."""
    gain = attnx._core.bf16_dot_gain()
    assert attnx._core.BF16_DOT_GAIN_LINE == BF16_DOT_GAIN
    if not has_avx512bf16():
        assert gain == 0
    else:
        assert 0.1 < gain < 10
        assert abs(gain - BF16_DOT_GAIN) > 0.2, gain


@pytest.mark.skipif(has_amx(), reason="this CPU runs the amx path")
def test_set_isa_rejects_missing_amx():
    assert_set_isa_refused("amx", "AMX")


def test_cpu_features_reports_matrix_engines():
    f = attnx.cpu_features()
    for key in (
        "avx512_vnni",
        "avx_vnni",
        "avx512_fp16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
        "amx_permitted",
    ):
        assert isinstance(f[key], bool), key
    assert not f["amx_permitted"] or f["amx_tile"]
    assert f["isa"] != "amx" or has_amx(f)


@pytest.mark.skipif(has_avx512bf16(), reason="this CPU has AVX512_BF16")
def test_set_isa_rejects_missing_avx512bf16():
    assert_set_isa_refused("avx512bf16", "AVX512_BF16")


@pytest.mark.skipif(has_neon_bf16(), reason="this CPU has ARM BF16 and DotProd")
def test_set_isa_rejects_missing_neon_bf16():
    """Refused on an aarch64 CPU without BF16 (a plain NEON core), and in an x86 build."""
    match = "lacks BF16" if attnx.cpu_features()["neon"] else "neon-bf16.*no NEON kernels"
    assert_set_isa_refused("neon-bf16", match)


def test_cpu_features_reports_arm_bf16():
    f = attnx.cpu_features()
    assert f["isa"] != "neon-bf16" or has_neon_bf16(f)
    assert f["bf16_products"] is (f["isa"] in BF16_PRODUCT_ISAS)


def test_cpu_features_reports_bf16():
    f = attnx.cpu_features()
    for key in ("avx512bw", "avx512vl", "avx512bf16"):
        assert isinstance(f[key], bool)
    assert f["isa"] != "avx512bf16" or has_avx512bf16(f)


# ---- the opt-out and the other dtypes are unchanged -----------------------------------------


@needs_bf16
@pytest.mark.parametrize("causal", [False, True])
def test_avx512_keeps_fp32_widening(rng, causal):
    """ATTNX_ISA=avx512 (neon) computes bf16 exactly as float32 inputs of the same values
    (rounded to bf16 at the end); avx512bf16 (neon-bf16) gives a different (bf16 P) result on
    the same call."""
    q, k, v = (rand(rng, (1, 4, 130, 64), BF16) for _ in range(3))
    want = on_isa(
        WIDENING,
        lambda: attnx.attention(
            *(x.astype(np.float32) for x in (q, k, v)), causal=causal, return_lse=True
        ),
    )
    got = on_isa(WIDENING, lambda: attnx.attention(q, k, v, causal=causal, return_lse=True))
    np.testing.assert_array_equal(got[0], want[0].astype(BF16))
    np.testing.assert_array_equal(got[1], want[1])
    for isa in BF16_ISAS:
        fast = on_isa(isa, lambda: attnx.attention(q, k, v, causal=causal))
        assert not np.array_equal(fast, got[0]), f"{isa} did not take its own path"


@needs_bf16
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_other_dtypes_match_avx512(rng, dtype):
    """Only q, k and v all bf16 take the dot products: other dtypes get avx512's result, bit for
    bit (decode and mixed dtypes: test_bf16_decode_matches_avx512, test_paged_prefill_chunk)."""
    q = rand(rng, (1, 4, 70, 48), dtype)
    k = rand(rng, (1, 2, 90, 48), dtype)
    v = rand(rng, (1, 2, 90, 40), dtype)
    a = on_isa(WIDENING, lambda: attnx.attention(q, k, v, causal=True))
    for isa in BF16_ISAS:
        np.testing.assert_array_equal(a, on_isa(isa, lambda: attnx.attention(q, k, v, causal=True)))


@given(
    st.integers(1, 3),
    st.sampled_from([(1, 1), (4, 1), (8, 2), (6, 3)]),
    st.integers(1, 300),
    st.sampled_from([16, 32, 48, 64, 128]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_few_rows_give_float32_bits(isa, sq, heads, lk, d, paged, seed):
    """Few query rows (decode) read bf16 keys and values in place, widened in the vocabulary's
    bf16 order, on every path: the result is what float32 inputs of the same values give, bit for
    bit (the output rounded to bf16 at the end), lse included: the scores are summed in the
    natural order, whatever order the keys were widened in. (On amx an item of 2+ rows takes the
    decode tiles, test_amx_decode.py: there one row.)"""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    if isa in AMX_PATHS:
        hq, sq = hkv, 1
    sq = min(sq, 8 // (hq // hkv), lk)  # an item's rows: at most kDotRows (8), at most lk
    q = rand(rng, (sq, hq, d), BF16)
    k, v = (rand(rng, (lk, hkv, d), BF16) for _ in range(2))
    if paged:
        kp, vp, tables, lens = pool_from_sequences(rng, [k], [v], 16)

        def call(dt):
            return attnx.paged_attention(
                q.astype(dt),
                kp.astype(dt),
                vp.astype(dt),
                tables,
                lens,
                q_lens=np.array([sq]),
                return_lse=True,
            )
    else:

        def call(dt):
            return attnx.attention(
                *(x.astype(dt)[None].transpose(0, 2, 1, 3) for x in (q, k, v)), return_lse=True
            )

    got, want = call(BF16), call(np.float32)
    np.testing.assert_array_equal(got[0], want[0].astype(BF16))
    np.testing.assert_array_equal(got[1], want[1])


@needs_bf16
def test_bf16_decode_matches_avx512(rng):
    """Decode (4 rows per kv head) on the bf16 product paths without decode tiles is the
    widening path's, bit for bit (amx's decode tiles: test_amx_decode.py)."""
    q = rand(rng, (3, 8, 1, 64), BF16)
    k, v = (rand(rng, (3, 2, 300, 64), BF16) for _ in range(2))
    a = on_isa(WIDENING, lambda: attnx.attention(q, k, v))
    for isa in BF16_ISAS:
        if isa not in AMX_PATHS:
            np.testing.assert_array_equal(a, on_isa(isa, lambda: attnx.attention(q, k, v)))


# ---- numerics --------------------------------------------------------------------------------


@given(prefill_problems(BF16))
@settings(max_examples=60)
def test_flash_rule_hypothesis(bf16_isa, problem):
    q, k, v, kw = problem
    assert_flash_rule(q, k, v, **kw)
    check_attention(q, k, v, **kw)  # the tolerance every ISA meets (helpers), lse included


@pytest.mark.parametrize("shape", [*PREFILL_SHAPES, (1, 2, 1, 130, 576, 512)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_rule_shapes(bf16_isa, rng, shape, causal):
    assert_flash_rule(*prefill_qkv(rng, shape, BF16), causal=causal)


def test_against_torch_bf16_sdpa(bf16_isa, rng):
    """Against torch's own bf16 SDPA (same precision), both measured against float64."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    for hq, hkv, s, d, causal in [
        (8, 8, 256, 64, False),
        (8, 2, 200, 128, True),
        (4, 4, 77, 40, False),
    ]:
        q = rand(rng, (1, hq, s, d), BF16)
        k, v = (rand(rng, (1, hkv, s, d), BF16) for _ in range(2))
        r = ref.attention(q, k, v, causal=causal, out_dtype=np.float64)
        tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v))
        t = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=hq != hkv)
        (km, ka), (tm, ta) = (
            errors(attnx.attention(q, k, v, causal=causal), r),
            errors(t.float().numpy(), r),
        )
        assert km <= TORCH_RATIO * tm and ka <= TORCH_RATIO * ta, (km, tm, ka, ta)


def test_common_tolerance_counts_the_rounding_of_p(bf16_isa):
    """helpers' tolerance (3x a same-precision twin's error) on a row whose output cancels:
    0.099 from values up to 2.7 (one visible query row of 18, window, softcap). Rounding P to
    bf16 costs ~2^-10 of sum |p v| there, more than the output's own rounding; the twin rounds P
    too on this path (helpers.bf16_rounds_p). A soak run found it at 1.01x the tolerance of a
    twin that did not."""
    r = np.random.default_rng(1170)  # test_property's draws for that example
    q, k, v = rand(r, (2, 18, 1), BF16), rand(r, (2, 92, 1), BF16), rand(r, (2, 92, 1), BF16)
    q_lens = r.integers(0, 19, size=1)
    assert q_lens[0] == 1
    check_attention(q, k, v, window=(7, 5), softcap=4.0, q_lens=q_lens)


def test_lse_keeps_float32_accuracy_where_returned(bf16_isa, rng):
    """A call that returns no lse may compute p to 2.9e-6 (P is rounded to bf16 anyway); one that
    returns it keeps the float32 exp. Row i scores 0 on key 0 and a_i on 255 keys (the 256 bf16
    values in [-4, 0)), so lse_i = log(1 + 255 e^a_i): the shorter exp would put it ~2e-6 off at
    the a_i where its error peaks, the float32 one ~3e-7."""
    a = np.unique(np.arange(-4, 0, 1 / 64).astype(BF16).astype(np.float64))
    assert a.size == 256
    q = np.zeros((1, 1, 256, 64), BF16)
    q[0, 0, :, 0] = a
    k = np.zeros((1, 1, 256, 64), BF16)
    k[0, 0, 1:, 0] = 1
    v = rand(rng, (1, 1, 256, 64), BF16)
    o, lse = attnx.attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(lse[0, 0], np.log1p(255 * np.exp(a)), rtol=0, atol=1e-6)
    # with or without it, the output keeps the flash rule (and the two differ by a bf16 ulp at most)
    assert_flash_rule(q, k, v, scale=1.0)
    short = attnx.attention(q, k, v, scale=1.0)
    np.testing.assert_allclose(
        o.astype(np.float64), short.astype(np.float64), rtol=2**-7, atol=2**-9
    )


def test_nonfinite_values_stay_in_their_rows(bf16_isa, rng):
    """An infinite value reaches only the rows that see its key (the fp32 fallback of a tile that
    some row sees in part), not the rows before it under causal masking, where 0 * inf would
    be NaN. (NaN inputs: check_attention's input check cannot compare bf16 NaNs.)"""
    q = rand(rng, (1, 2, 100, 32), BF16)
    k = rand(rng, (1, 2, 100, 32), BF16)
    v = rand(rng, (1, 2, 100, 32), BF16)
    v[0, 0, 70, 3] = np.inf
    v[0, 1, 40, 5] = -np.inf
    check_attention(q, k, v, causal=True, expect_nan=True)


def test_paged_prefill_chunk(bf16_isa, rng):
    """A chunked prefill over bf16 pages (many query rows) runs the dot products too; float32
    queries over the same pages keep avx512's result exactly."""
    hq, hkv, d, bs, L, Sq = 4, 2, 64, 16, 150, 40
    nblk = -(-L // bs)
    pages_k = rand(rng, (12, hkv, bs, d), BF16)
    pages_v = rand(rng, (12, hkv, bs, d), BF16)
    table = rng.permutation(12)[:nblk].astype(np.int32)[None]
    q = rand(rng, (Sq, hq, d), BF16)
    args = (pages_k, pages_v, table, np.array([L]))
    got = attnx.paged_attention(q, *args, q_lens=np.array([Sq])).astype(np.float64)
    dense = [
        p[table[0]].transpose(1, 0, 2, 3).reshape(hkv, nblk * bs, d)[None, :, :L]
        for p in (pages_k, pages_v)
    ]
    qq = q.transpose(1, 0, 2)[None]
    want = ref.attention(qq, *dense, causal=True, out_dtype=np.float64)
    (km, _), (em, _) = (
        errors(got.transpose(1, 0, 2)[None], want),
        errors(bf16_twin(qq, *dense, causal=True), want),
    )
    assert km <= EMUL_MAX_RATIO * em + 1e-6, (km, em)
    q32 = q.astype(np.float32)
    a = on_isa(WIDENING, lambda: attnx.paged_attention(q32, *args, q_lens=np.array([Sq])))
    np.testing.assert_array_equal(attnx.paged_attention(q32, *args, q_lens=np.array([Sq])), a)


def test_nonfinite_value_past_an_items_keys_in_a_shared_tile(bf16_isa, rng):
    """64 query heads on one kv head: each item is one position's 64 rows, all seeing the same
    keys, and the kv head's packed V tile (shared by the items) holds keys past an item's last
    one. With an odd key count the last pair holds the next key, whose p is 0: an infinite value
    there must not make 0 * inf = NaN in the rows before it."""
    q = rand(rng, (1, 64, 12, 16), BF16)
    k = rand(rng, (1, 1, 12, 16), BF16)
    v = rand(rng, (1, 1, 12, 16), BF16)
    v[0, 0, 3, 7] = np.inf
    check_attention(q, k, v, causal=True, expect_nan=True)


@pytest.mark.parametrize(
    "shape",
    [
        (1, 4, 1, 80, 900, 64, 64),
        (1, 2, 2, 70, 1100, 128, 96),
        (2, 8, 2, 33, 700, 40, 72),
        (1, 1, 1, 64, 1400, 576, 512),
        (1, 8, 1, 50, 1030, 64, 64),
    ],
    ids=str,
)
@pytest.mark.parametrize("lse", [False, True])
def test_flash_rule_long_keys(bf16_isa, rng, shape, lse):
    """Long key ranges: the amx path takes 256 keys at once where every row sees them (one
    softmax pass, row pairs pipelined against each other's tile products across consecutive
    blocks), with partial row pairs (M not a multiple of 32), items of one row pair (M <= 32:
    a block's P V must land before the next block's softmax rescales the same rows), GQA,
    Dk != Dv and odd widths; with and without the lse."""
    B, hq, hkv, sq, sk, dk, dv = shape
    q = rand(rng, (B, hq, sq, dk), BF16)
    k = rand(rng, (B, hkv, sk, dk), BF16)
    v = rand(rng, (B, hkv, sk, dv), BF16)
    for causal in (False, True):
        assert_flash_rule(q, k, v, causal=causal)
        if lse:
            check_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("sq", [17, 33, 47, 64], ids=lambda n: f"sq{n}")
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"window": (100, 0)},
        {"window": (30, 70)},
        {"kv_lens": np.array([300, 129])},
        {"causal": True, "q_lens": np.array([5, 16])},
        {"causal": True, "sinks": np.array([0.5], np.float32)},
    ],
    ids=str,
)
def test_wide_runs_with_rows_that_see_part(bf16_isa, rng, sq, kw):
    """The amx path takes every tile a row of the item sees (a partial last one too) in blocks of
    up to 256 keys (the last block of a run shorter), from the item's first key on: rows that
    have seen nothing yet, the causal diagonal, windows and lengths (the keys a row cannot see
    score -inf), odd row counts (a row pair of one row), with the lse."""
    q = rand(rng, (2, 1, sq, 40), BF16)
    k = rand(rng, (2, 1, 330, 40), BF16)
    v = rand(rng, (2, 1, 330, 24), BF16)
    assert_flash_rule(q, k, v, **kw)
    check_attention(q, k, v, **kw)


def test_wide_runs_nonfinite_scores_and_values(bf16_isa, rng):
    """A non-finite value in a whole tile that rows see only in part reaches only the rows that see
    it (the run ends before that block: the tile path adds each row's own keys). A row whose first
    keys all score -inf skips them, and one whose first keys score +inf or NaN turns NaN, as in
    the reference (the first block's general update)."""
    q = rand(rng, (1, 2, 40, 32), BF16)
    k = rand(rng, (1, 2, 832, 32), BF16)
    v = rand(rng, (1, 2, 832, 32), BF16)
    v[0, 0, 800, 3] = np.inf  # in tile [768, 832): causal rows 792..831, 800.. see it
    check_attention(q, k, v, causal=True, expect_nan=True)
    q[0, 1, :20] = np.abs(q[0, 1, :20]) + 0.25  # rows with a positive query: -inf scores
    k[0, 1, :300] = -np.inf
    v[0, 1, :300] = 0
    check_attention(q, k, v, causal=True, expect_nan=True)


@pytest.mark.parametrize("sk", [1, 64, 130, 600], ids=lambda n: f"sk{n}")
def test_scores_near_1e10_stay_finite(bf16_isa, rng, sk):
    """The fused and wide exps take their argument as one FMA against the rounded max: off by up
    to half an ulp of m, which overflowed exp (NaN rows) for scores beyond ~1e9. Such rows shift
    the arguments by their own max (softmax-inl.h kFusedExpMax)."""
    q = (rand(rng, (1, 2, 40, 8), np.float32) * 0.1).astype(BF16)
    k = (rand(rng, (1, 1, sk, 8), np.float32) * 0.1).astype(BF16)
    v = rand(rng, (1, 1, sk, 8), BF16)
    for scale in (1e6, 1e11, 1e12):
        check_attention(q, k, v, scale=scale)
        check_attention(q, k, v, scale=scale, causal=True)
        assert np.isfinite(attnx.attention(q, k, v, scale=scale).astype(np.float32)).all()


def test_long_keys_nonfinite_value(bf16_isa, rng):
    """An infinite value inside a 256-key block that every row sees reaches every row (as in the
    reference), and one in a block that rows see in part only the rows that see it."""
    q = rand(rng, (1, 2, 40, 32), BF16)
    k = rand(rng, (1, 2, 800, 32), BF16)
    v = rand(rng, (1, 2, 800, 32), BF16)
    v[0, 0, 500, 3] = np.inf
    v[0, 1, 790, 5] = -np.inf
    check_attention(q, k, v, expect_nan=True)
    check_attention(q, k, v, causal=True, expect_nan=True)


@pytest.mark.skipif(
    not has_amx(), reason="CPU lacks AMX-BF16, or the OS did not grant the tile state"
)
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # 3.12+: fork with threads
def test_amx_in_forked_children_and_threads(rng):
    """The tile state's permission is the process's (asked once, at the first choice of path): a
    fork()ed child and Python threads running at once compute on the tiles too, and agree with
    the parent's result."""
    import threading

    q, k, v = (rand(rng, (1, 4, 300, 64), BF16) for _ in range(3))
    want = on_isa("amx", lambda: attnx.attention(q, k, v, causal=True))
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its own tiles give the same bits
        try:
            attnx._core.set_isa("amx")
            got = attnx.attention(q, k, v, causal=True, num_threads=2)
            os._exit(0 if np.array_equal(got, want) else 3)
        except BaseException:  # noqa: BLE001 (the forked child must exit, whatever it raised)
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    results = [None] * 4

    def work(i):
        results[i] = attnx.attention(q, k, v, causal=True, num_threads=1)

    previous = attnx.cpu_features()["isa"]
    attnx._core.set_isa("amx")
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        attnx._core.set_isa(previous)
    for r in results:
        np.testing.assert_array_equal(r, want)


@pytest.mark.skipif(
    not has_amx(), reason="CPU lacks AMX-BF16, or the OS did not grant the tile state"
)
@pytest.mark.parametrize(
    "shape", [(1, 4, 1, 300, 300, 64, 64), (1, 8, 2, 70, 1100, 128, 96)], ids=str
)
def test_emulated_tiles_match_the_tiles(rng, shape):
    """amx-emulated runs the amx path's tile loop over int8_tiles-inl.h's EmuTiles: on a CPU
    with the tiles the two give the same outputs to the output's bf16 rounding (the hardware
    sums each tile product in its own order; the emulation in the instruction's documented
    one)."""
    B, hq, hkv, sq, sk, dk, dv = shape
    q = rand(rng, (B, hq, sq, dk), BF16)
    k = rand(rng, (B, hkv, sk, dk), BF16)
    v = rand(rng, (B, hkv, sk, dv), BF16)
    hw = on_isa("amx", lambda: attnx.attention(q, k, v, causal=True))
    emu = on_isa("amx-emulated", lambda: attnx.attention(q, k, v, causal=True))
    np.testing.assert_allclose(
        emu.astype(np.float32), hw.astype(np.float32), rtol=2.0**-6, atol=2.0**-8
    )
