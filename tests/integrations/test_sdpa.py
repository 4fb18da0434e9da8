"""attnx.scaled_dot_product_attention: torch's semantics on NumPy arrays.

Held to its float64 twin ``attnx.reference.scaled_dot_product_attention`` and, when torch is
installed, to ``torch.nn.functional.scaled_dot_product_attention`` itself, over random shapes
(ranks 2-5, broadcast leading axes), boolean and float masks, ``is_causal`` with L < S, L == S and
L > S, ``enable_gqa`` and ``scale``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import attnx
from attnx import reference as ref

from helpers import BF16, make_rng


def close(got, want, v, tol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin]).max(initial=0.0)
    bound = tol * max(1.0, float(np.abs(np.asarray(v, np.float64)).max(initial=0.0)))
    assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# random problems
# ---------------------------------------------------------------------------------------------


def random_case(rng):
    """(query, key, value, kwargs) with torch-style shapes and broadcasting."""
    rank = int(rng.choice([2, 3, 4, 4, 5]))
    gqa = rank >= 3 and rng.random() < 0.4
    L = int(rng.integers(1, 10))
    S = int(rng.choice([L, int(rng.integers(1, 10))]))
    E = int(rng.choice([1, 4, 8, 16]))
    Ev = int(rng.choice([E, 3, 8]))
    lead = [int(rng.integers(1, 4)) for _ in range(rank - 2)]
    q_lead, k_lead, v_lead = list(lead), list(lead), list(lead)
    if gqa:
        hkv = int(rng.choice([1, 2]))
        q_lead[-1] = hkv * int(rng.integers(1, 4))
        k_lead[-1] = v_lead[-1] = hkv
    for i in range(rank - 2):
        if i == rank - 3 and gqa:
            continue
        r = rng.random()
        if r < 0.2:
            k_lead[i] = v_lead[i] = 1  # k/v broadcast (shared across this axis)
        elif r < 0.3:
            q_lead[i] = 1  # q broadcast
    if rank >= 4 and rng.random() < 0.2:  # k/v of lower rank broadcast too
        k_lead, v_lead = k_lead[1:], v_lead[1:]
    q = rng.standard_normal(q_lead + [L, E]).astype(np.float32)
    k = rng.standard_normal(k_lead + [S, E]).astype(np.float32)
    v = rng.standard_normal(v_lead + [S, Ev]).astype(np.float32)
    out_lead = list(
        np.broadcast_shapes(
            tuple(q_lead), tuple(k_lead[:-1] + [q_lead[-1]]) if gqa else tuple(k_lead)
        )
    )
    kw = dict(is_causal=bool(rng.random() < 0.5), enable_gqa=gqa)
    if rng.random() < 0.3:
        kw["scale"] = float(rng.uniform(0.05, 1.0))
    kind = rng.choice(["none", "bool", "float"])
    if kind != "none":
        shape = out_lead + [L, S]
        shape = [d if rng.random() < 0.6 else 1 for d in shape]
        shape = shape[int(rng.integers(0, len(shape) - 1)) :]  # maybe fewer leading axes
        if kind == "bool":
            kw["attn_mask"] = rng.random(shape) < 0.7
        else:
            m = rng.standard_normal(shape).astype(np.float32)
            m[rng.random(shape) < 0.2] = -np.inf
            kw["attn_mask"] = m
    return q, k, v, kw


CASES = 150


@pytest.mark.parametrize("i", range(CASES))
def test_random_against_reference(i):
    q, k, v, kw = random_case(make_rng("ref", i))
    got = attnx.scaled_dot_product_attention(q, k, v, **kw)
    want = ref.scaled_dot_product_attention(q, k, v, **kw)
    assert got.dtype == np.float32
    close(got, want, v)


def _torch_sdpa(torch, q, k, v, **kw):
    t = {
        name: torch.from_numpy(np.ascontiguousarray(a))
        for name, a in (("query", q), ("key", k), ("value", v))
    }
    mask = kw.pop("attn_mask", None)
    if mask is not None:
        kw["attn_mask"] = torch.from_numpy(np.ascontiguousarray(mask))
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(**t, **kw).numpy()


def _torch_sdpa_combined(torch, q, k, v, **kw):
    """torch's SDPA, with attn_mask and is_causal together spelled out as one mask where torch
    refuses the pair: its fallback path always has, and from torch 2.14 every path does (attnx,
    like torch's CPU flash path before 2.14, combines them)."""
    try:
        return _torch_sdpa(torch, q, k, v, **kw)
    except RuntimeError as exc:
        assert "is_causal" in str(exc) and "attn_mask" in kw and kw["is_causal"]
        L, S = q.shape[-2], k.shape[-2]
        tri = np.tril(np.ones((L, S), bool))
        m = kw["attn_mask"]
        kw = dict(
            kw,
            is_causal=False,
            attn_mask=(m & tri) if m.dtype == bool else np.where(tri, m, -np.inf),
        )
        return _torch_sdpa(torch, q, k, v, **kw)


@pytest.mark.parametrize("i", range(CASES))
def test_random_against_torch(i):
    torch = pytest.importorskip("torch")
    q, k, v, kw = random_case(make_rng("ref", i))
    got = attnx.scaled_dot_product_attention(q, k, v, **kw)
    close(got, _torch_sdpa_combined(torch, q, k, v, **kw), v)


# ---------------------------------------------------------------------------------------------
# causal alignment, masks, fully masked rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L, S", [(3, 7), (5, 5), (7, 3), (1, 6), (6, 1)])
def test_top_left_causal(L, S):
    rng = make_rng("causal", L, S)
    q, k, v = (rng.standard_normal((2, 3, n, 8)).astype(np.float32) for n in (L, S, S))
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    explicit = attnx.attention(q, k, v, mask=np.tril(np.ones((L, S), bool)))  # j <= i
    close(got, explicit, v, 1e-6)
    bottom_right = attnx.attention(q, k, v, causal=True)
    if L == S:
        close(got, bottom_right, v, 1e-6)
    else:
        assert not np.allclose(got, bottom_right)  # the documented difference


def test_top_left_causal_keys_beyond_L_are_never_read():
    rng = make_rng("unread")
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    k[..., 3:, :] = np.nan
    v[..., 3:, :] = np.inf
    out = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert np.isfinite(out).all()
    close(
        out,
        ref.scaled_dot_product_attention(q, k[..., :3, :], v[..., :3, :], is_causal=True),
        v[..., :3, :],
    )


def test_fully_masked_rows_are_zero_like_torch():
    rng = make_rng("fully masked")
    q, k, v = (rng.standard_normal((1, 2, n, 4)).astype(np.float32) for n in (4, 5, 5))
    mask = np.ones((4, 5), bool)
    mask[1] = False
    fmask = np.where(mask, 0.0, -np.inf).astype(np.float32)
    for m in (mask, fmask):
        out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m)
        assert np.all(out[..., 1, :] == 0) and np.isfinite(out).all()
        close(out, ref.scaled_dot_product_attention(q, k, v, attn_mask=m), v)
    torch = pytest.importorskip("torch")
    for m in (mask, fmask):
        close(
            attnx.scaled_dot_product_attention(q, k, v, attn_mask=m),
            _torch_sdpa(torch, q, k, v, attn_mask=m),
            v,
        )


def test_plus_inf_in_float_mask_gives_nan_like_torch():
    rng = make_rng("plus inf")
    q, k, v = (rng.standard_normal((1, 1, n, 4)).astype(np.float32) for n in (3, 4, 4))
    m = np.zeros((3, 4), np.float32)
    m[0, 2] = np.inf
    out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert np.isnan(out[0, 0, 0]).all() and np.isfinite(out[0, 0, 1:]).all()
    torch = pytest.importorskip("torch")
    close(out, _torch_sdpa(torch, q, k, v, attn_mask=m), v)


@pytest.mark.parametrize("L, S", [(4, 6), (6, 4)])
def test_mask_and_causal_combine(L, S):
    rng = make_rng("combine", L, S)
    q, k, v = (rng.standard_normal((2, 2, n, 8)).astype(np.float32) for n in (L, S, S))
    m = rng.random((L, S)) < 0.6
    got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    close(got, attnx.attention(q, k, v, mask=m & np.tril(np.ones((L, S), bool))), v, 1e-6)
    torch = pytest.importorskip("torch")
    close(got, _torch_sdpa_combined(torch, q, k, v, attn_mask=m, is_causal=True), v)


def test_gqa_reads_the_right_kv_head():
    rng = make_rng("gqa")
    q = rng.standard_normal((2, 6, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 7, 4)).astype(np.float32)
    got = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    rep = attnx.scaled_dot_product_attention(
        q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), is_causal=True
    )  # torch's repeat_interleave
    close(got, rep, v, 1e-6)


def test_gqa_with_different_k_and_v_heads():
    rng = make_rng("gqa kv")
    q = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 1, 6, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 6, 4)).astype(np.float32)
    got = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    close(got, ref.scaled_dot_product_attention(q, k, v, enable_gqa=True), v)
    torch = pytest.importorskip("torch")
    close(got, _torch_sdpa(torch, q, k, v, enable_gqa=True), v)


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------


def test_float64_is_accepted_and_returned():
    rng = make_rng("f64")
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (5, 6, 6))
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == np.float64
    want = ref.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert want.dtype == np.float64
    close(got, want, v, 1e-12)  # computed in float64 (tests/kernels/test_float64.py), as torch does
    torch = pytest.importorskip("torch")
    np.testing.assert_allclose(want, _torch_sdpa(torch, q, k, v, is_causal=True), atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
def test_low_precision(dtype):
    rng = make_rng("lowp", str(dtype))
    q, k, v = (rng.standard_normal((2, 3, n, 8)).astype(dtype) for n in (5, 6, 6))
    m = np.zeros((5, 6), np.float32)
    m[:, 0] = -1.5
    got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    assert got.dtype == np.dtype(dtype)
    want = ref.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    assert want.dtype == np.dtype(dtype)
    eps = float(ml_dtypes.finfo(dtype).eps)
    close(got.astype(np.float32), want.astype(np.float32), v.astype(np.float32), 2 * eps)


# ---------------------------------------------------------------------------------------------
# shapes at the edges
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L, S, causal", [(0, 5, True), (0, 5, False), (4, 0, True), (4, 0, False)])
def test_empty(L, S, causal):
    q = np.ones((2, 3, L, 4), np.float32)
    k = np.ones((2, 3, S, 4), np.float32)
    v = np.ones((2, 3, S, 5), np.float32)
    out = attnx.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.shape == (2, 3, L, 5) and np.all(out == 0)
    assert ref.scaled_dot_product_attention(q, k, v, is_causal=causal).shape == (2, 3, L, 5)


def test_default_scale_and_explicit_scale():
    rng = make_rng("scale")
    q, k, v = (rng.standard_normal((4, n, 16)).astype(np.float32) for n in (3, 5, 5))
    close(attnx.scaled_dot_product_attention(q, k, v), attnx.attention(q, k, v), v, 1e-6)
    close(
        attnx.scaled_dot_product_attention(q, k, v, scale=0.3),
        attnx.attention(q, k, v, scale=0.3),
        v,
        1e-6,
    )


def test_exported():
    assert attnx.scaled_dot_product_attention is attnx.torch_compat.scaled_dot_product_attention
    assert "scaled_dot_product_attention" in attnx.__all__
    assert "scaled_dot_product_attention" in ref.__all__
    doc = attnx.scaled_dot_product_attention.__doc__
    assert "top-left" in doc.lower() and "bottom-right" in doc.lower()


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [attnx.scaled_dot_product_attention, ref.scaled_dot_product_attention],
    ids=["attnx", "reference"],
)
@pytest.mark.parametrize("p", [0.1, 1.0, float("nan")])
def test_dropout_raises(fn, p):
    q = np.ones((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="dropout_p"):
        fn(q, q, q, dropout_p=p)


def _bad_cases():
    f = np.float32
    q = np.ones((2, 4, 5, 8), f)
    k = np.ones((2, 2, 6, 8), f)
    v = np.ones((2, 2, 6, 4), f)
    return [
        ("E mismatch", (q, np.ones((2, 2, 6, 7), f), v, {}), ValueError, "key"),
        ("S mismatch", (q, k, np.ones((2, 2, 7, 4), f), {}), ValueError, "value"),
        ("heads without gqa", (q, k, v, {}), ValueError, "broadcast"),
        (
            "gqa heads",
            (q, np.ones((2, 3, 6, 8), f), np.ones((2, 3, 6, 4), f), {"enable_gqa": True}),
            ValueError,
            "enable_gqa",
        ),
        ("gqa 2-D", (q[0, 0], k[0, 0], v[0, 0], {"enable_gqa": True}), ValueError, "enable_gqa"),
        ("rank 1", (np.ones(8, f), k, v, {}), ValueError, "query"),
        ("dtype mix", (q, k.astype(np.float16), v, {"enable_gqa": True}), TypeError, "key"),
        (
            "int dtype",
            (q.astype(np.int32), k.astype(np.int32), v.astype(np.int32), {"enable_gqa": True}),
            TypeError,
            "query",
        ),
        (
            "mask shape",
            (q, k, v, {"enable_gqa": True, "attn_mask": np.ones((5, 7), bool)}),
            ValueError,
            "attn_mask",
        ),
        (
            "mask rank",
            (q, k, v, {"enable_gqa": True, "attn_mask": np.ones((1, 2, 4, 5, 6), bool)}),
            ValueError,
            "attn_mask",
        ),
        (
            "int mask",
            (q, k, v, {"enable_gqa": True, "attn_mask": np.ones((5, 6), np.int64)}),
            TypeError,
            "attn_mask",
        ),
        ("dropout type", (q, k, v, {"enable_gqa": True, "dropout_p": "0"}), TypeError, "dropout_p"),
    ]


@pytest.mark.parametrize(
    "fn",
    [attnx.scaled_dot_product_attention, ref.scaled_dot_product_attention],
    ids=["attnx", "reference"],
)
@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(fn, case):
    _, (q, k, v, kw), exc, match = case
    with pytest.raises(exc, match=match):
        fn(q, k, v, **kw)
