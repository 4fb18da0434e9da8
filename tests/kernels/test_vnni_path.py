"""The VNNI paths: a float32-widening path's kernels with integer dot products for integer
queries over int8 KV, and no bf16 products. ``avx512vnni`` (cpp/src/kernels/isa_avx512vnni.cpp):
the default on AVX-512 CPUs with VNNI whose bf16 dot products are not faster than float32 FMAs
(Cascade Lake, Ice Lake, Sapphire Rapids where the OS refuses AMX). ``avx2vnni``
(isa_avx2vnni.cpp): the default on CPUs with AVX-VNNI and no AVX-512 (Alder Lake and later client
cores, Sierra Forest); ``avx2vnni-evex`` runs its kernels over AVX512-VNNI's form of the same
instruction, so that they are tested on CPUs without AVX-VNNI.

Their contract: every call computes what the widening twin (``avx512``, ``avx2``) does, bit for
bit (bf16 included: it widens to float32), and so do integer queries, whose code sums are exact;
integer queries are their default.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import reference as ref

from helpers import BF16, WIDENING_TWIN, assert_set_isa_refused, make_rng, on_isa, rand, runs_here

VNNI_PATHS = ("avx512vnni", "avx2vnni", "avx2vnni-evex")


def _needs(path):
    if not runs_here(path):
        pytest.skip(f"this run does not test {path} (CPU lacks it, or ATTNX_ISA narrows the run)")


@pytest.mark.parametrize(
    "path, lacks",
    [("avx512vnni", "AVX512-VNNI"), ("avx2vnni", "AVX-VNNI"), ("avx2vnni-evex", "AVX512-VNNI")],
)
def test_set_isa_refuses_a_cpu_without_it(path, lacks):
    f = attnx.cpu_features()
    if f["neon"] or f["avx512_vnni" if "512" in path or "evex" in path else "avx_vnni"]:
        pytest.skip(f"this CPU has {lacks} (or is not x86)")
    assert_set_isa_refused(path, lacks)


@pytest.mark.parametrize("path", VNNI_PATHS)
def test_reports_integer_products_only(path):
    _needs(path)
    f = on_isa(path, attnx.cpu_features)
    assert f["isa"] == path
    assert f["integer_products"] is True and f["bf16_products"] is False
    before = attnx.set_int8_query(None)
    try:
        assert on_isa(path, attnx.int8_query) is True
    finally:
        attnx.set_int8_query(before)


def _calls(rng):
    """Dense prefill and decode of each float dtype with the variants whose code differs (causal,
    window, softcap, GQA, Dk != Dv, odd sizes), and paged decode over int8 pages: GQA groups of 1
    to 8 rows (every register block) and widths a multiple of VNNI's 32 or 64 bytes or not."""
    calls = []
    for dtype in (np.float32, np.float16, BF16):
        q = rand(rng, (1, 4, 70, 48), dtype)
        k = rand(rng, (1, 2, 90, 48), dtype)
        v = rand(rng, (1, 2, 90, 40), dtype)
        calls.append(lambda q=q, k=k, v=v: attnx.attention(q, k, v, causal=True, return_lse=True))
        calls.append(lambda q=q, k=k, v=v: attnx.attention(q[:, :, :1], k, v, softcap=20.0))
        calls.append(lambda q=q, k=k, v=v: attnx.attention(q, k, v, window=(17, 0)))
    bt = np.array([[3, 0, 5], [1, 4, 2]], np.int32)
    lens = np.array([40, 33])
    for dk, group in ((128, 4), (64, 3), (96, 8), (32, 1), (48, 2), (160, 7)):
        k = rng.standard_normal((6, 2, 16, dk)).astype(np.float32) * rng.uniform(
            0.1, 5, (6, 2, 16, 1)
        )
        (kq, ks), (vq, vs) = (
            ref.quantize_kv(k, "int8"),
            ref.quantize_kv(k[..., ::-1].copy(), "int8"),
        )
        q = rng.standard_normal((2, 2 * group, dk)).astype(np.float32)
        calls.append(
            lambda q=q, kq=kq, vq=vq, ks=ks, vs=vs: attnx.paged_attention(
                q, kq, vq, bt, lens, k_scales=ks, v_scales=vs, return_lse=True
            )
        )
    return calls


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("int8_query", [False, True], ids=["float_query", "integer_query"])
@pytest.mark.parametrize("path", VNNI_PATHS)
def test_every_call_is_the_twins_bit_for_bit(path, int8_query):
    _needs(path)
    twin = WIDENING_TWIN[path]
    before = attnx.set_int8_query(int8_query)
    try:
        for i, call in enumerate(_calls(make_rng(41))):
            want, got = (_outputs(on_isa(p, call)) for p in (twin, path))
            assert len(want) == len(got)
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w, err_msg=f"call {i}")
    finally:
        attnx.set_int8_query(before)
