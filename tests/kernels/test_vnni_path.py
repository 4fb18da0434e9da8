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
    BF16,
    WIDENING_TWIN,
    assert_set_isa_refused,
    on_isa,
    prefill_problems,
    runs_here,
    scramble_tables,
)

VNNI_PATHS = ("avx512vnni", "avx2vnni", "avx2vnni-evex")


def _needs(path):
    if not runs_here(path):
        pytest.skip(f"this run does not test {path} (CPU lacks it, or ATTNX_ISA narrows the run)")


@pytest.mark.parametrize(
    "path, flag, lacks",
    [
        ("avx512vnni", "avx512_vnni", "AVX512-VNNI"),
        ("avx2vnni", "avx_vnni", "AVX-VNNI"),
        ("avx2vnni-evex", "avx512_vnni", "AVX512-VNNI"),
    ],
)
def test_set_isa_refuses_a_cpu_without_it(path, flag, lacks):
    f = attnx.cpu_features()
    if f["neon"] or f[flag]:
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


@st.composite
def paged_int8_problems(draw):
    """Paged calls over int8 pages: GQA groups of 1 to 8 rows (every register block of the
    integer products), widths a multiple of VNNI's 32 or 64 bytes or not, decode and chunks,
    windows, softcap, ALiBi and sinks, key scales over four decades."""
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 8))
    dk = draw(st.sampled_from([32, 64, 96, 128, 160, 48, 100]))
    dv = draw(st.sampled_from([dk, 40]))
    bs = draw(st.sampled_from([16, 32]))
    lens = r.integers(1, 150, draw(st.integers(1, 3)))
    q_lens = np.minimum(lens, draw(st.sampled_from([1, 1, 3, 20])))
    nb = int((-(-lens // bs)).sum()) + 2
    k = r.standard_normal((nb, hkv, bs, dk)) * 10.0 ** r.uniform(-2, 2, (nb, hkv, bs, 1))
    v = r.standard_normal((nb, hkv, bs, dv))
    (kq, ks), (vq, vs) = (ref.quantize_kv(x.astype(np.float32), "int8") for x in (k, v))
    bt, _ = scramble_tables(r, lens, bs, nb, int(-(-lens.max() // bs)), 0)
    q = r.standard_normal((int(q_lens.sum()), hkv * g, dk)).astype(np.float32)
    kw = dict(k_scales=ks, v_scales=vs, return_lse=True)
    if int(q_lens.max()) > 1:
        kw["q_lens"] = q_lens
    extra = draw(st.sampled_from(["none", "window", "softcap", "alibi", "sinks"]))
    if extra == "window":
        kw["window"] = (int(r.integers(1, 40)), 0)
    elif extra == "softcap":
        kw["softcap"] = 20.0
    elif extra == "alibi":
        kw["alibi_slopes"] = r.uniform(0.01, 1, hkv * g).astype(np.float32)
    elif extra == "sinks":
        kw["sinks"] = r.standard_normal(hkv * g).astype(np.float32)
    return (q, kq, vq, bt, lens), kw


@pytest.mark.parametrize("path", VNNI_PATHS)
def test_forced_at_import(path):
    """ATTNX_ISA=<path> selects it at import, integer queries on by default."""
    _needs(path)
    env = {**os.environ, "ATTNX_ISA": path}
    env.pop("ATTNX_INT8_QUERY", None)
    code = "import attnx; print(attnx.cpu_features()['isa'], attnx.int8_query())"
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert (res.returncode, res.stdout.split()) == (0, [path, "True"]), res.stderr


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _same_on(path, call):
    want, got = (_outputs(on_isa(p, call)) for p in (WIDENING_TWIN[path], path))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("int8_query", [False, True], ids=["float_query", "integer_query"])
@pytest.mark.parametrize("path", VNNI_PATHS)
@given(problem=paged_int8_problems())
@settings(max_examples=25)
def test_paged_int8_is_the_twins_bit_for_bit(path, int8_query, problem):
    _needs(path)
    args, kw = problem
    before = attnx.set_int8_query(int8_query)
    try:
        _same_on(path, lambda: attnx.paged_attention(*args, **kw))
    finally:
        attnx.set_int8_query(before)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("path", VNNI_PATHS)
@given(data=st.data())
@settings(max_examples=15)
def test_dense_is_the_twins_bit_for_bit(path, dtype, data):
    """Prefill and decode of the float dtypes (bf16 too: no bf16 products on these paths) with
    GQA, odd widths and key counts, masks, lengths, windows, softcap, sinks and ALiBi."""
    _needs(path)
    q, k, v, kw = data.draw(prefill_problems(dtype))
    _same_on(path, lambda: attnx.attention(q, k, v, return_lse=True, **kw))
