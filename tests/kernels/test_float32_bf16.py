"""float32 callers' opt-in to bf16 products: ``attnx.set_float32_precision("bf16")`` (issue 33).

On the paths with bf16 products (avx512bf16, amx, neon-bf16), float32 prefill then runs on them:
q, k, v and P rounded to bf16, held to the flash rule (helpers.bf16: the error against the
float64 reference over the rounded inputs within a small multiple of ``attnx.reference``'s twin,
``bf16_products=True``). Everything else keeps its float32 result bit for bit: the default, the
other paths, decode, float64. The setting is validated, restored by ``with``, and
``cpu_features()["bf16_products"]`` says whether it can take effect.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings

import attnx
from attnx import reference as ref

from helpers import (
    BF16_PRODUCT_ISAS,
    PREFILL_SHAPES,
    all_prefill,
    assert_flash_rule,
    assert_p_rounding_bound,
    bf16_twin,
    errors,
    prefill_problems,
    prefill_qkv,
    rand,
    rounded_bf16,
)


def bf16_on(fn):
    with attnx.set_float32_precision("bf16"):
        return fn()


# ---- the setting -----------------------------------------------------------------------------


def test_default_and_round_trip():
    assert attnx.float32_precision() == "float32"
    before = attnx.set_float32_precision("bf16")
    try:
        assert before == "float32" and attnx.float32_precision() == "bf16"
        assert attnx.set_float32_precision("bf16") == "bf16"
    finally:
        assert attnx.set_float32_precision("float32") == "bf16"
    assert attnx.float32_precision() == "float32"


def test_context_manager_restores_even_on_error():
    with attnx.set_float32_precision("bf16") as previous:
        assert previous == "float32" and attnx.float32_precision() == "bf16"
        with attnx.set_float32_precision("float32"):
            assert attnx.float32_precision() == "float32"
        assert attnx.float32_precision() == "bf16"
    assert attnx.float32_precision() == "float32"
    with pytest.raises(KeyError), attnx.set_float32_precision("bf16"):
        raise KeyError("inside")
    assert attnx.float32_precision() == "float32"


def test_blocks_overlapping_in_threads_restore_the_setting_before_them():
    """A enters, B enters, A leaves, B leaves: each block's own "previous" would leave B's (A's
    "bf16") behind for every later call. The setting is that of the last block entered that is
    still open, and the setting from before the first once all have ended."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with attnx.set_float32_precision("bf16"):
            a_in.set()
            assert b_in.wait(10)
        a_out.set()

    def b():
        assert a_in.wait(10)
        with attnx.set_float32_precision("bf16"):
            b_in.set()
            assert a_out.wait(10)
            seen["b after a left"] = attnx.float32_precision()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"b after a left": "bf16"}
    assert attnx.float32_precision() == "float32"


@pytest.mark.parametrize("bad", ["BF16", "medium", "highest", "", None, 16, True, np.array("bf16")])
def test_bad_values_raise_and_change_nothing(bad):
    for start in ("float32", "bf16"):
        with attnx.set_float32_precision(start):
            with pytest.raises(ValueError, match="precision: expected 'float32' or 'bf16'"):
                attnx.set_float32_precision(bad)
            assert attnx.float32_precision() == start


def test_cpu_features_says_whether_it_applies(isa):
    assert attnx.cpu_features()["bf16_products"] is (isa in BF16_PRODUCT_ISAS)


# ---- what it changes: float32 prefill on the paths with bf16 products --------------------------


@pytest.mark.parametrize(
    "shape", [*PREFILL_SHAPES, (1, 4, 2, 136, 40, 72), (1, 2, 1, 1100, 96, 80)], ids=str
)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_rule_and_not_float32(bf16_isa, rng, shape, causal):
    """The result is the bf16 products': the flash rule over the rounded inputs, and much nearer
    the twin than the float32 result is (which an ignored setting would give)."""
    assert all_prefill(*shape[1:4])
    q, k, v = prefill_qkv(rng, shape, np.float32)
    got = bf16_on(lambda: assert_flash_rule(q, k, v, causal=causal))
    f32 = attnx.attention(q, k, v, causal=causal)
    twin = bf16_twin(q, k, v, causal=causal)
    (_, near), (_, far) = errors(got, twin), errors(f32, twin)
    assert near < 0.5 * far, (near, far)
    exact = ref.attention(q, k, v, causal=causal, out_dtype=np.float64)
    assert errors(got, exact)[0] > 30 * errors(f32, exact)[0]  # measurably not float32


@given(prefill_problems(np.float32, every_item=True))
@settings(max_examples=40)
def test_flash_rule_hypothesis(bf16_isa, problem):
    q, k, v, kw = problem
    bf16_on(lambda: assert_p_rounding_bound(q, k, v, **kw))


def test_all_prefill_matches_the_plan(bf16_isa, rng):
    """all_prefill's rule is the plan's: a last chunk of 8 rows keeps float32 products (its
    rows equal the float32 call's bit for bit), one of 9 does not."""
    k, v = rand(rng, (1, 1, 100, 32)), rand(rng, (1, 1, 100, 32))
    for sq, prefill in ((72, False), (73, True)):
        q = rand(rng, (1, 1, sq, 32))
        assert all_prefill(1, 1, sq) is prefill
        got, f32 = bf16_on(lambda: attnx.attention(q, k, v)), attnx.attention(q, k, v)
        assert np.array_equal(got[..., 64:, :], f32[..., 64:, :]) is not prefill
        assert not np.array_equal(got[..., :64, :], f32[..., :64, :])


def test_lse_and_sums_stay_float32(bf16_isa, rng):
    """The lse is float32 accurate over the rounded scores (the sums of p are not rounded)."""
    q, k, v = rand(rng, (1, 4, 128, 64)), rand(rng, (1, 4, 300, 64)), rand(rng, (1, 4, 300, 64))
    _, lse = bf16_on(lambda: attnx.attention(q, k, v, return_lse=True))
    _, want = ref.attention(
        *(rounded_bf16(x) for x in (q, k, v)), return_lse=True, out_dtype=np.float64
    )
    np.testing.assert_allclose(lse, want, rtol=0, atol=2e-5)


def test_nonfinite_values_as_on_the_bf16_path(bf16_isa, rng):
    """inf and NaN values reach only the rows that see their keys (the float32 fallback of a
    tile some row sees in part), as in the reference over the rounded values; a float32 value
    beyond bf16's largest finite one rounds to inf."""
    q, k, v = rand(rng, (1, 2, 100, 32)), rand(rng, (1, 2, 300, 32)), rand(rng, (1, 2, 300, 32))
    v[0, 0, 70, 3] = np.inf
    v[0, 1, 40, 5] = np.nan
    v[0, 1, 280, 1] = -np.inf
    for kw in ({"causal": True}, {"window": (30, 0)}, {}):
        bf16_on(lambda: assert_flash_rule(q, k, v, **kw))
    v = rand(rng, (1, 2, 300, 32))
    v[0, 0, 250, 0] = 3.4e38  # finite in float32, inf in bf16
    got = bf16_on(lambda: assert_flash_rule(q, k, v, causal=True))
    assert np.isinf(got[0, 0, :, 0]).any() and np.isfinite(got[0, 1]).all()


def test_paged_prefill_chunk_over_float32_pages(bf16_isa, rng):
    """A chunked prefill over float32 pages (and a cache step over them) takes bf16 products
    too: the flash rule against the paged twin."""
    hq, hkv, d, bs, L, Sq = 4, 2, 64, 16, 150, 40
    nblk = -(-L // bs)
    pages_k, pages_v = rand(rng, (12, hkv, bs, d)), rand(rng, (12, hkv, bs, d))
    table = rng.permutation(12)[:nblk].astype(np.int32)[None]
    q = rand(rng, (Sq, hq, d))
    args = (q, pages_k, pages_v, table, np.array([L]))
    got = bf16_on(lambda: attnx.paged_attention(*args, q_lens=np.array([Sq])))
    f32 = attnx.paged_attention(*args, q_lens=np.array([Sq]))
    rounded = [rounded_bf16(x) for x in args[:3]]
    exact = ref.paged_attention(*rounded, *args[3:], q_lens=[Sq], out_dtype=np.float64)
    twin = ref.paged_attention(*args, q_lens=[Sq], bf16_products=True, out_dtype=np.float64)
    (km, ka), (em, ea) = errors(got, exact), errors(twin, exact)
    assert km <= 2.0 * em and ka <= 1.25 * ea, (km, em, ka, ea)
    assert errors(got, twin)[1] < 0.5 * errors(f32, twin)[1]


def test_cache_step_takes_it(bf16_isa, rng):
    """A PagedKVCache step (prefill of 40 tokens) reads the setting too."""
    hq, hkv, d = 4, 2, 64
    q, k, v = rand(rng, (40, hq, d)), rand(rng, (40, hkv, d)), rand(rng, (40, hkv, d))

    def prefill():
        cache = attnx.PagedKVCache(
            num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=8, block_size=16
        )
        step = cache.begin_step([cache.new_sequence()], [40])
        return step.attend(0, q, k, v)

    got, f32 = bf16_on(prefill), prefill()
    qq, kk, vv = (x.transpose(1, 0, 2)[None] for x in (q, k, v))
    assert not np.array_equal(got, f32)
    twin = bf16_twin(qq, kk, vv, causal=True)[0].transpose(1, 0, 2)
    assert errors(got, twin)[1] < 0.5 * errors(f32, twin)[1]


def test_torch_tensors_take_it(bf16_isa, rng):
    torch = pytest.importorskip("torch")
    q, k, v = (rand(rng, (1, 4, 100, 64)) for _ in range(3))
    want = bf16_on(lambda: attnx.attention(q, k, v, causal=True))
    got = bf16_on(lambda: attnx.attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True))
    np.testing.assert_array_equal(got.numpy(), want)


# ---- what it does not change ------------------------------------------------------------------


def test_changes_nothing_without_bf16_products(isa, rng):
    """On a path without bf16 products, float32 calls give the same bits either way."""
    if isa in BF16_PRODUCT_ISAS:
        pytest.skip("this path has bf16 products")
    q, k, v = rand(rng, (1, 4, 130, 48)), rand(rng, (1, 2, 150, 48)), rand(rng, (1, 2, 150, 40))
    want = attnx.attention(q, k, v, causal=True, return_lse=True)
    got = bf16_on(lambda: attnx.attention(q, k, v, causal=True, return_lse=True))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_off_is_float32_bit_for_bit(bf16_isa, rng):
    """Off (the default), float32 prefill gives the float32 result of the path's widening twin
    (avx512, neon) on this path."""
    q, k, v = rand(rng, (1, 4, 130, 48)), rand(rng, (1, 2, 150, 48)), rand(rng, (1, 2, 150, 40))
    from helpers import WIDENING_TWIN, on_isa

    want = on_isa(WIDENING_TWIN[bf16_isa], lambda: attnx.attention(q, k, v, causal=True))
    np.testing.assert_array_equal(attnx.attention(q, k, v, causal=True), want)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_other_dtypes_and_decode_unchanged(bf16_isa, rng, dtype):
    """float64 and float16 prefill, and float32 decode (8 rows an item), ignore the setting."""
    q, k, v = (
        rand(rng, (1, 4, 70, 32), dtype),
        rand(rng, (1, 4, 90, 32), dtype),
        rand(rng, (1, 4, 90, 32), dtype),
    )
    np.testing.assert_array_equal(
        bf16_on(lambda: attnx.attention(q, k, v)), attnx.attention(q, k, v)
    )
    q, k, v = rand(rng, (3, 8, 1, 64)), rand(rng, (3, 2, 300, 64)), rand(rng, (3, 2, 300, 64))
    np.testing.assert_array_equal(
        bf16_on(lambda: attnx.attention(q, k, v)), attnx.attention(q, k, v)
    )
