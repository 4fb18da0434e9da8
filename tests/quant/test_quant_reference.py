"""The quantised-KV definition in attnx.reference, checked exactly: per (token, head) row a
float32 scale s = max|x| / qmax, int8 codes clip(round_half_even(x / s), -127, 127), fp8 codes
cast_rne(clip(x / s, +-max)); zero rows read back zeros, non-finite rows read back NaN."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attnx import reference as ref

from helpers import make_rng

QDTYPES = ["int8", "float8_e4m3fn", "float8_e5m2"]
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def row_by_hand(x, name):
    """One row quantised with float32 scalars, element by element (an independent twin)."""
    x = [np.float32(v) for v in x]
    if not all(math.isfinite(v) for v in x):
        return [0] * len(x), np.float32("nan")
    qmax = np.float32(127) if name == "int8" else np.float32(ml_dtypes.finfo(FP8[name]).max)
    s = np.float32(max(abs(v) for v in x) / qmax)
    if s == 0:
        return [0] * len(x), np.float32(0)
    codes = []
    for v in x:
        r = min(max(np.float32(v / s), -qmax), qmax)
        codes.append(
            int(np.rint(r)) if name == "int8" else float(np.array(r, np.float32).astype(FP8[name]))
        )
    return codes, s


def test_int8_rounds_half_to_even_and_hits_127():
    x_q, s = ref.quantize_kv(
        np.array([[127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5]], np.float32), "int8"
    )
    assert s.tolist() == [1.0]
    assert x_q.tolist() == [[127, 2, 4, -2, 0, 0, 2]]


def test_int8_never_uses_minus_128_and_max_maps_to_127():
    rng = make_rng(0)
    x = rng.standard_normal((2000, 64)).astype(np.float32) * rng.uniform(
        1e-3, 1e3, (2000, 1)
    ).astype(np.float32)
    x_q, s = ref.quantize_kv(x, "int8")
    assert x_q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (2000,)
    assert x_q.min() >= -127
    assert (np.abs(x_q).max(axis=1) == 127).all()


@pytest.mark.parametrize("name", QDTYPES)
def test_matches_the_row_by_row_twin(name):
    rng = make_rng(1)
    x = (rng.standard_normal((40, 16)) * rng.uniform(1e-6, 1e4, (40, 1))).astype(np.float32)
    x[3] = 0.0
    x[5, 2] = np.nan
    x[6, 0] = -np.inf
    x[7] = np.float32(1e-44)  # subnormal: max|x| / qmax underflows to 0
    x_q, s = ref.quantize_kv(x, name)
    for i, row in enumerate(x):
        codes, si = row_by_hand(row, name)
        assert np.array_equal(s[i], si, equal_nan=True), i
        assert x_q[i].astype(np.float64).tolist() == [float(c) for c in codes], i


@pytest.mark.parametrize("name", QDTYPES)
def test_zero_and_underflowing_rows_read_back_zeros(name):
    x_q, s = ref.quantize_kv(np.array([[0.0, -0.0, 0.0], [1e-45, 0.0, -1e-45]], np.float32), name)
    assert s.tolist() == [0.0, 0.0]
    assert (ref.dequantize_kv(x_q, s) == 0).all()


@pytest.mark.parametrize("name", QDTYPES)
def test_non_finite_rows_read_back_nan(name):
    x = np.array([[1.0, np.nan, 2.0], [np.inf, 1.0, 0.0], [1.0, 2.0, 3.0]], np.float32)
    x_q, s = ref.quantize_kv(x, name)
    assert np.isnan(s[:2]).all() and np.isfinite(s[2])
    assert (x_q[:2].astype(np.float32) == 0).all()  # codes are 0: never a NaN code
    back = ref.dequantize_kv(x_q, s)
    assert np.isnan(back[:2]).all() and np.isfinite(back[2]).all()


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_saturates_at_finfo_max_never_nan(name):
    qmax = float(ml_dtypes.finfo(FP8[name]).max)
    rng = make_rng(2)
    x = rng.standard_normal((500, 32)).astype(np.float32) * np.float32(1e-38)  # subnormal scales
    x = np.concatenate([x, rng.standard_normal((500, 32)).astype(np.float32)])
    x_q, s = ref.quantize_kv(x, name)
    codes = x_q.astype(np.float32)
    assert np.isfinite(codes).all()
    assert np.abs(codes).max() <= qmax
    assert (np.abs(codes[500:]).max(axis=1) == qmax).all()


@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.integers(1, 40)),
        elements=st.floats(-(2.0**100), 2.0**100, width=32),
    ),
    st.sampled_from(QDTYPES),
)
def test_reads_back_within_half_a_step(x, name):
    x_q, s = ref.quantize_kv(x, name)
    back = ref.dequantize_kv(x_q, s).astype(np.float64)
    m = np.abs(x.astype(np.float64)).max(axis=1, keepdims=True)
    if name == "int8":
        bound = s[:, None].astype(np.float64) * 0.5 + m * 1e-6
    else:  # relative half-ulp of the format, or half its smallest subnormal step
        fi = ml_dtypes.finfo(FP8[name])
        bound = (
            np.maximum(np.abs(x) * float(fi.eps) / 2, s[:, None] * float(fi.smallest_subnormal) / 2)
            * (1 + 1e-5)
            + m * 1e-6
        )
    tiny = m[:, 0] < 1e-30  # rows whose scale underflows read back zeros
    assert (np.abs(back - x)[~tiny] <= bound[~tiny]).all()


def test_dequantize_checks_its_arguments():
    x_q, s = ref.quantize_kv(np.ones((2, 3), np.float32), "int8")
    with pytest.raises(TypeError, match="scales"):
        ref.dequantize_kv(x_q, s.astype(np.float64))
    with pytest.raises(ValueError, match="scales"):
        ref.dequantize_kv(x_q, s[:1])
    with pytest.raises(TypeError, match="dtype"):
        ref.quantize_kv(np.ones(3), "uint8")


@pytest.mark.parametrize("name", QDTYPES)
def test_paged_reference_attends_over_dequantised_pages(name):
    rng = make_rng(3)
    nb, hkv, bs, d = 6, 2, 4, 8
    k = rng.standard_normal((nb, hkv, bs, d)).astype(np.float32)
    v = rng.standard_normal((nb, hkv, bs, d)).astype(np.float32)
    kq, ks = ref.quantize_kv(k, name)
    vq, vs = ref.quantize_kv(v, name)
    q = rng.standard_normal((2, 4, d)).astype(np.float32)
    bt = np.array([[4, 1, 0], [2, 5, 3]])
    lens = np.array([9, 12])
    got = ref.paged_attention(q, kq, vq, bt, lens, k_scales=ks, v_scales=vs)
    want = ref.paged_attention(q, ref.dequantize_kv(kq, ks), ref.dequantize_kv(vq, vs), bt, lens)
    assert np.array_equal(got, want)
    with pytest.raises(TypeError, match="k_scales"):
        ref.paged_attention(q, kq, vq, bt, lens, v_scales=vs)
    with pytest.raises(TypeError, match="k_scales"):
        ref.paged_attention(q, k, v, bt, lens, k_scales=ks, v_scales=vs)
