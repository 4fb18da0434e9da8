"""Bad arguments to attnx.attention: a ValueError or TypeError that names the argument, raised
before anything is written (``out`` and the inputs keep their contents)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import attnx

from helpers import BF16, assert_set_isa_refused, has_avx512

SENTINEL = 1536.0
B, HQ, HKV, SQ, SK, D = 1, 2, 2, 3, 5, 4


def f32(*shape, dtype=np.float32):
    return np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype(dtype)


def good():
    """A valid call: q, k, v and a sentinel-filled out of the right shape."""
    return (
        f32(B, HQ, SQ, D),
        f32(B, HKV, SK, D),
        f32(B, HKV, SK, D),
        {"out": np.full((B, HQ, SQ, D), SENTINEL, np.float32)},
    )


def case(**changes):
    """A valid call with some arguments replaced (q/k/v by name, the rest as keywords)."""

    def build():
        q, k, v, kw = good()
        arrays = {"q": q, "k": k, "v": v}
        for name, val in changes.items():
            val = val() if callable(val) else val
            if name in arrays:
                arrays[name] = val
            else:
                kw[name] = val
        return arrays["q"], arrays["k"], arrays["v"], kw

    return build


def read_only(a):
    a.flags.writeable = False
    return a


CASES = {
    # ranks
    "q_rank_5": (
        case(q=f32(1, B, HQ, SQ, D), k=f32(1, B, HKV, SK, D), v=f32(1, B, HKV, SK, D)),
        ValueError,
        r"^q\b",
    ),
    "q_rank_1": (case(q=f32(D), k=f32(D), v=f32(D)), ValueError, r"^q\b"),
    "k_rank_differs": (case(k=f32(HKV, SK, D)), ValueError, r"^k\b"),
    "v_rank_differs": (case(v=f32(HKV, SK, D)), ValueError, r"^v\b"),
    # shapes
    "k_batch": (case(k=f32(2, HKV, SK, D)), ValueError, r"^k\b"),
    "v_batch": (case(v=f32(2, HKV, SK, D)), ValueError, r"^v\b"),
    "v_sk": (case(v=f32(B, HKV, SK + 1, D)), ValueError, r"^v\b"),
    "k_dk": (case(k=f32(B, HKV, SK, D + 1)), ValueError, r"^k\b"),
    "v_heads": (case(v=f32(B, 1, SK, D)), ValueError, r"^v\b"),
    "hq_not_multiple_of_hkv": (
        case(q=f32(B, 3, SQ, D), out=np.zeros((B, 3, SQ, D), np.float32)),
        ValueError,
        r"^k\b",
    ),
    "hkv_zero": (case(k=f32(B, 0, SK, D), v=f32(B, 0, SK, D)), ValueError, r"^k\b"),
    # masks
    "mask_not_broadcastable": (case(mask=np.ones((SQ + 1, SK), bool)), ValueError, "mask"),
    "mask_heads_mismatch": (case(mask=np.ones((3, SQ, SK), bool)), ValueError, "mask"),
    "mask_rank_5": (case(mask=np.ones((1, 1, 1, SQ, SK), bool)), ValueError, "mask"),
    "mask_int": (case(mask=np.ones((SQ, SK), np.int64)), TypeError, "mask"),
    "mask_uint8": (case(mask=np.ones((SQ, SK), np.uint8)), TypeError, "mask"),
    "mask_str": (case(mask="causal"), TypeError, "mask"),
    # lengths
    "kv_lens_length": (case(kv_lens=np.array([5, 5])), ValueError, "kv_lens"),
    "kv_lens_2d": (case(kv_lens=np.array([[5]])), ValueError, "kv_lens"),
    "kv_lens_negative": (case(kv_lens=np.array([-1])), ValueError, "kv_lens"),
    "kv_lens_too_big": (case(kv_lens=np.array([SK + 1])), ValueError, "kv_lens"),
    "kv_lens_float": (case(kv_lens=np.array([3.0])), TypeError, "kv_lens"),
    "kv_lens_rank3_length": (
        case(
            q=f32(HQ, SQ, D),
            k=f32(HKV, SK, D),
            v=f32(HKV, SK, D),
            out=np.zeros((HQ, SQ, D), np.float32),
            kv_lens=[2, 2],
        ),
        ValueError,
        "kv_lens",
    ),
    "q_lens_length": (case(q_lens=[1, 2]), ValueError, "q_lens"),
    "q_lens_negative": (case(q_lens=[-2]), ValueError, "q_lens"),
    "q_lens_too_big": (case(q_lens=[SQ + 1]), ValueError, "q_lens"),
    "q_lens_float": (case(q_lens=np.array([1.5])), TypeError, "q_lens"),
    # dtypes
    "k_float16": (case(k=f32(B, HKV, SK, D, dtype=np.float16)), TypeError, r"\bk\b.*float16"),
    "v_bfloat16": (case(v=f32(B, HKV, SK, D, dtype=BF16)), TypeError, r"\bv\b.*bfloat16"),
    "int_inputs": (
        case(
            q=np.ones((B, HQ, SQ, D), np.int32),
            k=np.ones((B, HKV, SK, D), np.int32),
            v=np.ones((B, HKV, SK, D), np.int32),
        ),
        TypeError,
        r"^q\b.*astype",
    ),
    # (float64 inputs are computed in float64: tests/kernels/test_float64.py; a wider float has no path)
    "longdouble_inputs": (
        case(
            q=f32(B, HQ, SQ, D, dtype=np.longdouble),
            k=f32(B, HKV, SK, D, dtype=np.longdouble),
            v=f32(B, HKV, SK, D, dtype=np.longdouble),
        ),
        TypeError,
        r"^q\b.*astype",
    ),
    "float64_v": (case(v=f32(B, HKV, SK, D, dtype=np.float64)), TypeError, r"\bv\b"),
    "complex_q": (case(q=np.ones((B, HQ, SQ, D), np.complex64)), TypeError, r"^q\b"),
    # out
    "out_shape": (case(out=np.zeros((B, HQ, SQ, D + 1), np.float32)), ValueError, "out"),
    "out_rank": (case(out=np.zeros((HQ, SQ, D), np.float32)), ValueError, "out"),
    "out_layout": (
        case(layout="bshd", q=f32(B, SQ, HQ, D), k=f32(B, SK, HKV, D), v=f32(B, SK, HKV, D)),
        ValueError,
        "out",
    ),  # out is in bhsd order
    "out_dtype": (case(out=np.zeros((B, HQ, SQ, D), np.float16)), TypeError, "out"),
    "out_float64": (case(out=np.zeros((B, HQ, SQ, D), np.float64)), TypeError, "out"),
    "out_read_only": (
        case(out=lambda: read_only(np.full((B, HQ, SQ, D), SENTINEL, np.float32))),
        ValueError,
        "out",
    ),
    "out_list": (case(out=[[0.0]]), TypeError, "out"),
    "out_strided_shape": (
        case(out=np.full((B, HQ, SQ, 2 * D + 2), SENTINEL, np.float32)[..., ::2]),
        ValueError,
        "out",
    ),
    "out_strided_dtype": (
        case(out=np.full((B, HQ, SQ, 2 * D), SENTINEL, np.float16)[..., ::2]),
        TypeError,
        "out",
    ),
    "out_strided_read_only": (
        case(out=lambda: read_only(np.full((B, HQ, SQ, 2 * D), SENTINEL, np.float32))[..., ::2]),
        ValueError,
        "out",
    ),
    # scale
    "scale_zero": (case(scale=0.0), ValueError, "scale"),
    "scale_negative": (case(scale=-0.5), ValueError, "scale"),
    "scale_nan": (case(scale=float("nan")), ValueError, "scale"),
    "scale_inf": (case(scale=float("inf")), ValueError, "scale"),
    "scale_str": (case(scale="0.5"), TypeError, "scale"),
    "scale_list": (case(scale=[0.5]), TypeError, "scale"),
    "scale_bool": (case(scale=True), TypeError, "scale"),
    "scale_complex": (case(scale=0.5j), TypeError, "scale"),
    # layout
    "layout_unknown": (case(layout="bsdh"), ValueError, "layout"),
    "layout_upper": (case(layout="BHSD"), ValueError, "layout"),
    "layout_none": (case(layout=None), ValueError, "layout"),
    # (an array is compared element by element by `in`: refused before that, whatever it holds)
    "layout_empty_array": (case(layout=lambda: np.array([])), ValueError, "layout"),
    "layout_array_of_it": (case(layout=lambda: np.array(["bhsd"])), ValueError, "layout"),
    "layout_list": (case(layout=["bhsd"]), ValueError, "layout"),
    "layout_bytes": (case(layout=b"bhsd"), ValueError, "layout"),
    # window
    "window_left_negative": (case(window=(-1, None)), ValueError, "window"),
    "window_right_negative": (case(window=(None, -2)), ValueError, "window"),
    "window_float": (case(window=(1.5, None)), TypeError, "window"),
    "window_bool": (case(window=(True, None)), TypeError, "window"),
    "window_three": (case(window=(1, 2, 3)), ValueError, "window"),
    "window_int": (case(window=3), ValueError, "window"),
    # softcap
    "softcap_zero": (case(softcap=0.0), ValueError, "softcap"),
    "softcap_negative": (case(softcap=-1.0), ValueError, "softcap"),
    "softcap_nan": (case(softcap=float("nan")), ValueError, "softcap"),
    "softcap_inf": (case(softcap=float("inf")), ValueError, "softcap"),
    "softcap_str": (case(softcap="1"), TypeError, "softcap"),
    "softcap_bool": (case(softcap=True), TypeError, "softcap"),
    # per-head parameters
    "sinks_length": (case(sinks=np.zeros(HQ + 1, np.float32)), ValueError, "sinks"),
    "sinks_kv_heads_2d": (case(sinks=np.zeros((1, HQ), np.float32)), ValueError, "sinks"),
    "sinks_nan": (case(sinks=np.array([0.0, np.nan], np.float32)), ValueError, "sinks"),
    "sinks_str": (case(sinks="none"), TypeError, "sinks"),
    "alibi_length": (case(alibi_slopes=np.ones(1, np.float32)), ValueError, "alibi_slopes"),
    "alibi_inf": (
        case(alibi_slopes=np.array([1.0, np.inf], np.float32)),
        ValueError,
        "alibi_slopes",
    ),
    # threads
    "num_threads_zero": (case(num_threads=0), ValueError, "num_threads"),
    "num_threads_negative": (case(num_threads=-1), ValueError, "num_threads"),
    "num_threads_float": (case(num_threads=1.5), ValueError, "num_threads"),
    "num_threads_str": (case(num_threads="2"), ValueError, "num_threads"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_argument(name):
    build, exc, match = CASES[name]
    q, k, v, kw = build()
    saved = [
        np.array(x, copy=True) if isinstance(x, np.ndarray) else None
        for x in (q, k, v, kw.get("out"))
    ]
    with pytest.raises(exc, match=match):
        attnx.attention(q, k, v, **kw)
    for x, x0 in zip((q, k, v, kw.get("out")), saved):
        if x0 is not None:
            np.testing.assert_array_equal(x, x0, err_msg="a failed call wrote into an array")


@pytest.mark.parametrize(
    "bad",
    [
        dict(scale=0.0),
        dict(num_threads=-1),
        dict(window=(-1, 0)),
        dict(kv_lens=[9]),
        dict(mask=np.ones((2, 2), bool)),
    ],
)
def test_failed_call_with_out_aliasing_q_writes_nothing(bad):
    q, k, v, _ = good()
    q0 = q.copy()
    with pytest.raises((ValueError, TypeError)):
        attnx.attention(q, k, v, out=q, **bad)
    np.testing.assert_array_equal(q, q0)


def test_set_num_threads_rejects_negative():
    before = attnx.get_num_threads()
    with pytest.raises(ValueError):
        attnx.set_num_threads(-1)
    assert attnx.get_num_threads() == before


def test_set_isa_rejects_unknown():
    assert_set_isa_refused("bogus", "bogus")


@pytest.mark.skipif(has_avx512(), reason="this CPU has AVX-512F/BW/VL")
def test_set_isa_rejects_missing_avx512():
    assert_set_isa_refused("avx512", "avx512")


ARM_FLAGS = ("neon", "dotprod", "bf16", "i8mm", "sve")
X86_FLAGS = ("sse2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16")


def test_cpu_features_reports_one_architecture():
    """Every flag of both architectures is reported; those of the other one read false, and the
    default path is the architecture's own (neon on aarch64)."""
    f = attnx.cpu_features()
    assert all(isinstance(f[k], bool) for k in ARM_FLAGS + X86_FLAGS)
    if f["neon"]:
        assert not any(f[k] for k in X86_FLAGS)
    else:
        assert not any(f[k] for k in ARM_FLAGS)
    assert f["isa"].startswith("neon") == f["neon"] or os.environ.get("ATTNX_ISA", "") not in (
        "",
        "auto",
    )


@pytest.mark.skipif(attnx.cpu_features()["neon"], reason="an aarch64 build: neon is its path")
def test_set_isa_rejects_neon_off_arm():
    assert_set_isa_refused("neon", "neon.*no NEON kernels")


def small_problem():
    """A valid (1, 2, 3, 4) q, k, v and the gated delta rule's g, beta for them read as
    (B, T, H, D): the calls below fail only by the argument under test."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    g = np.zeros((1, 2, 3), np.float32)
    beta = np.full((1, 2, 3), 0.5, np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize(
    "bad",
    [np.array([]), np.array(["bhsd"]), ["bshd"], b"bhsd", 0],
    ids=["empty_array", "array_of_it", "list", "bytes", "int"],
)
def test_every_string_choice_refuses_what_is_not_one_of_its_strings(bad):
    """One rule (``_validate.choice``) for every argument that picks among strings: a value that
    is not one of them, arrays included (which ``in`` would compare element by element), is a
    ValueError naming the argument, on every entry point that takes one."""
    q, k, v, g, beta = small_problem()
    lse = np.zeros((1, 2, 3), np.float32)
    calls = {
        "layout": [
            lambda: attnx.attention(q, k, v, layout=bad),
            lambda: attnx.reference.attention(q, k, v, layout=bad),
            lambda: attnx.merge_attention([q], [lse], layout=bad),
            lambda: attnx.reference.merge_attention([q], [lse], layout=bad),
            lambda: attnx.gated_delta_rule(q, k, v, g, beta, layout=bad),
        ],
        "_mode": [lambda: attnx.gated_delta_rule(q, k, v, g, beta, _mode=bad)],
    }
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=f"^{name}: expected '"):
                fn()


@pytest.mark.parametrize("bad", [np.array([]), np.array([1.0, 0.0])], ids=["empty", "two"])
def test_every_flag_refuses_what_has_no_truth_value(bad):
    """A bool argument takes any truth value (the binding's rule, ``_validate.flag`` in Python);
    an array without one (NumPy: ambiguous; an error in NumPy 2, a warning and False in NumPy 1)
    is a TypeError naming the argument, on every entry point, before anything is written."""
    q, k, v, g, beta = small_problem()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    calls = {
        "causal": lambda: attnx.attention(q, k, v, causal=bad),
        "return_lse": lambda: attnx.attention(q, k, v, return_lse=bad),
        "is_causal": lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=bad),
        "enable_gqa": lambda: attnx.scaled_dot_product_attention(q, k, v, enable_gqa=bad),
        "return_weights": lambda: attnx.MultiHeadAttention(8, 2)(x, return_weights=bad),
        "bias": lambda: attnx.MultiHeadAttention(8, 2, bias=bad),
        "value_from_key": lambda: attnx.PagedKVCache(
            num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=4, value_from_key=bad
        ),
        "prefix_caching": lambda: attnx.PagedKVCache(
            num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2, block_size=4, prefix_caching=bad
        ),
        "output_final_state": lambda: attnx.gated_delta_rule(
            q, k, v, g, beta, output_final_state=bad
        ),
        "qk_l2norm": lambda: attnx.gated_delta_rule(q, k, v, g, beta, qk_l2norm=bad),
    }
    for name, fn in calls.items():
        with pytest.raises(TypeError, match=f"^{name}: expected a bool"):
            fn()
