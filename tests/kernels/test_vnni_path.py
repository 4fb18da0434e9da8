"""The avx512vnni path: the avx512 kernels with AVX512-VNNI's integer dot products for integer
queries over int8 KV, and no bf16 products (cpp/src/kernels/isa_avx512vnni.cpp). The default on
AVX-512 CPUs with VNNI whose bf16 dot products are not faster than float32 FMAs (Cascade Lake, Ice
Lake, Sapphire Rapids where the OS refuses AMX); forced anywhere the CPU has VNNI.

Its contract: every call computes what ``avx512`` does, bit for bit (bf16 included: it widens to
float32), and so do integer queries, whose code sums are exact (test_quant_kv's
test_int8_query_vnni_gives_the_fma_scores); integer queries are its default.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import reference as ref

from helpers import BF16, ISAS, assert_set_isa_refused, make_rng, on_isa, rand

runs = pytest.mark.skipif("avx512vnni" not in ISAS, reason="CPU lacks AVX512-VNNI (or BW/VL)")


@pytest.mark.skipif("avx512vnni" in ISAS, reason="this CPU runs the avx512vnni path")
def test_set_isa_rejects_missing_vnni():
    f = attnx.cpu_features()
    if not f["avx512_vnni"] and not f["neon"]:
        assert_set_isa_refused("avx512vnni", "AVX512-VNNI")


@runs
def test_reports_integer_products_only():
    f = on_isa("avx512vnni", attnx.cpu_features)
    assert f["isa"] == "avx512vnni"
    assert f["integer_products"] is True and f["bf16_products"] is False
    before = attnx.set_int8_query(None)
    try:
        assert on_isa("avx512vnni", attnx.int8_query) is True
    finally:
        attnx.set_int8_query(before)


def _calls(rng):
    """A prefill, a decode and a paged int8 decode of each float dtype, with the variants whose
    code differs (causal, window, softcap, GQA, Dk != Dv, odd sizes)."""
    calls = []
    for dtype in (np.float32, np.float16, BF16):
        q = rand(rng, (1, 4, 70, 48), dtype)
        k = rand(rng, (1, 2, 90, 48), dtype)
        v = rand(rng, (1, 2, 90, 40), dtype)
        calls.append(lambda q=q, k=k, v=v: attnx.attention(q, k, v, causal=True, return_lse=True))
        calls.append(lambda q=q, k=k, v=v: attnx.attention(q[:, :, :1], k, v, softcap=20.0))
        calls.append(lambda q=q, k=k, v=v: attnx.attention(q, k, v, window=(17, 0)))
    k = rng.standard_normal((6, 2, 16, 128)).astype(np.float32)
    (kq, ks), (vq, vs) = ref.quantize_kv(k, "int8"), ref.quantize_kv(k[..., ::-1].copy(), "int8")
    bt = np.array([[3, 0, 5], [1, 4, 2]], np.int32)
    lens = np.array([40, 33])
    q = rng.standard_normal((2, 8, 128)).astype(np.float32)
    calls.append(lambda: attnx.paged_attention(q, kq, vq, bt, lens, k_scales=ks, v_scales=vs))
    return calls


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


@runs
@pytest.mark.parametrize("int8_query", [False, True], ids=["float_query", "integer_query"])
def test_every_call_is_avx512s_bit_for_bit(int8_query):
    before = attnx.set_int8_query(int8_query)
    try:
        for i, call in enumerate(_calls(make_rng(41))):
            want, got = (_outputs(on_isa(path, call)) for path in ("avx512", "avx512vnni"))
            assert len(want) == len(got)
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w, err_msg=f"call {i}")
    finally:
        attnx.set_int8_query(before)
