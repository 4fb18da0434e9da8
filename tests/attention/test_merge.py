"""attnx.merge_attention and its reference twin: merging partial results over disjoint key sets
gives the result over all keys (DESIGN.md, "Merging partial results")."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx import reference as ref

from helpers import BF16, F32_EPS, SEED, from4, lse4, rand, to4

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def split_points(draw, n, parts):
    """Sorted cut points in [0, n], repeats allowed (empty parts)."""
    return sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))


def partials(q, k, v, cuts, *, layout, mask):
    """attnx.attention of q against each slice of the keys between the cuts, the boolean mask
    sliced with it."""
    seq_axis = -2 if layout == "bhsd" or q.ndim == 2 else -3
    bounds = [0] + list(cuts) + [k.shape[seq_axis]]
    res = []
    for a, b in itertools.pairwise(bounds):
        idx = [slice(None)] * k.ndim
        idx[seq_axis] = slice(a, b)
        res.append(
            attnx.attention(
                q, k[tuple(idx)], v[tuple(idx)], mask=mask[..., a:b], layout=layout, return_lse=True
            )
        )
    return res


def merge_tolerance(direct, exact, dtype, scale):
    """A merge of rounded partials may sit a few times the direct call's error from the float64
    result, plus an ulp or two of the storage dtype (each partial was rounded once)."""
    eps = float(ml_dtypes.finfo(dtype).eps)
    fin = np.isfinite(exact)
    err = float(np.max(np.abs(direct[fin] - exact[fin]), initial=0.0))
    return 3 * err + 2 * eps * scale + 8 * F32_EPS


@st.composite
def merge_cases(draw):
    rank = draw(st.sampled_from([2, 3, 4]))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    B = draw(st.integers(1, 2)) if rank == 4 else 1
    hkv = draw(st.integers(1, 2)) if rank > 2 else 1
    hq = hkv * (draw(st.integers(1, 3)) if rank > 2 else 1)
    sq, sk = draw(st.integers(1, 6)), draw(st.integers(0, 24))
    dk, dv = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    parts = draw(st.integers(1, 5))
    cuts = split_points(draw, sk, parts)
    kind = draw(st.sampled_from(["full", "causal", "random", "blank_part"]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31))
    return dict(
        rank=rank,
        layout=layout,
        shape=(B, hq, hkv, sq, sk, dk, dv),
        cuts=cuts,
        kind=kind,
        dtype=dtype,
        seed=seed,
    )


def visibility(kind, B, hq, sq, sk, cuts, rng):
    """A (B, Hq, Sq, Sk) boolean mask: everything, the bottom-right causal triangle, a random
    pattern, or a random pattern with one part blanked for some rows."""
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    if kind == "full":
        return np.ones((B, hq, sq, sk), bool)
    if kind == "causal":
        return np.broadcast_to(j <= i + (sk - sq), (B, hq, sq, sk)).copy()
    m = rng.random((B, hq, sq, sk)) < 0.6
    if kind == "blank_part" and sk:
        bounds = [0] + list(cuts) + [sk]
        p = rng.integers(len(bounds) - 1)
        rows = rng.random(sq) < 0.7
        m[:, :, rows, bounds[p] : bounds[p + 1]] = False
    return m


def mask_for_rank(m, rank):
    return m if rank == 4 else m[0] if rank == 3 else m[0, 0]


def shaped(x4, layout, rank):
    return np.ascontiguousarray(from4(x4, layout, rank))


@given(merge_cases())
def test_merged_splits_equal_attention_over_all_keys(case):
    rng = np.random.default_rng([SEED, case["seed"]])
    B, hq, hkv, sq, sk, dk, dv = case["shape"]
    layout, rank, dtype = case["layout"], case["rank"], case["dtype"]
    q = shaped(rand(rng, (B, hq, sq, dk), dtype), layout, rank)
    k = shaped(rand(rng, (B, hkv, sk, dk), dtype), layout, rank)
    v = shaped(rand(rng, (B, hkv, sk, dv), dtype), layout, rank)
    m = mask_for_rank(visibility(case["kind"], B, hq, sq, sk, case["cuts"], rng), rank)
    parts = partials(q, k, v, case["cuts"], layout=layout, mask=m)
    out, lse = attnx.merge_attention([p[0] for p in parts], [p[1] for p in parts], layout=layout)
    direct, direct_lse = attnx.attention(q, k, v, mask=m, layout=layout, return_lse=True)
    exact, exact_lse = ref.attention(
        q, k, v, mask=m, layout=layout, return_lse=True, out_dtype=np.float64
    )
    assert out.shape == direct.shape and out.dtype == dtype and lse.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(exact_lse))
    assert np.all(to4(out, layout, rank)[np.isneginf(lse4(exact_lse, rank))] == 0)
    scale = float(np.max(np.abs(exact), initial=1.0))
    tol = merge_tolerance(direct.astype(np.float64), exact, dtype, scale)
    err = float(np.max(np.abs(out.astype(np.float64) - exact), initial=0.0))
    assert err <= tol, f"out: {err:.3g} > {tol:.3g}"
    fin = np.isfinite(exact_lse)
    lse_err = float(np.max(np.abs(lse[fin] - exact_lse[fin]), initial=0.0))
    assert lse_err <= 3 * float(
        np.max(np.abs(direct_lse[fin] - exact_lse[fin]), initial=0.0)
    ) + 8 * F32_EPS * max(1.0, float(np.max(np.abs(exact_lse[fin]), initial=0.0)))
    # the reference twin merges the same partials to the same result
    r_out, r_lse = ref.merge_attention([p[0] for p in parts], [p[1] for p in parts], layout=layout)
    assert r_out.dtype == dtype and r_lse.dtype == np.float32
    np.testing.assert_allclose(
        out.astype(np.float64),
        r_out.astype(np.float64),
        atol=2 * float(ml_dtypes.finfo(dtype).eps) * scale,
        rtol=0,
    )
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))


def test_merge_with_causal_splits_of_a_cache():
    """A decode query split as a cache is split (prefix / rest): both parts see everything, so
    causal attention over each part merges to causal attention over the whole."""
    rng = np.random.default_rng(SEED)
    q, k, v = rand(rng, (2, 4, 1, 32)), rand(rng, (2, 2, 40, 32)), rand(rng, (2, 2, 40, 16))
    parts = [
        attnx.attention(q, k[:, :, a:b], v[:, :, a:b], causal=True, return_lse=True)
        for a, b in ((0, 13), (13, 13), (13, 40))
    ]
    out, lse = attnx.merge_attention(*zip(*parts))
    direct, direct_lse = attnx.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, direct, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, direct_lse, atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    "merge", [attnx.merge_attention, ref.merge_attention], ids=["attnx", "ref"]
)
def test_nan_and_empty_rules(merge):
    """Row by row: a part at -inf contributes nothing (not even a NaN it holds); all parts -inf
    give 0 and -inf; a NaN lse or a NaN output of a contributing part makes that row NaN only."""
    o1 = np.array([[1.0, 2.0], [np.nan, np.nan], [1.0, 1.0], [3.0, 3.0], [1.0, 1.0]], np.float32)
    o2 = np.array([[5.0, 6.0], [4.0, 4.0], [np.nan, 0.0], [2.0, 2.0], [0.0, 0.0]], np.float32)
    l1 = np.array([0.0, -np.inf, np.log(3.0), np.nan, -np.inf], np.float32)
    l2 = np.array([-np.inf, 0.5, np.log(1.0), 1.0, -np.inf], np.float32)
    out, lse = merge([o1, o2], [l1, l2])
    np.testing.assert_array_equal(out[0], [1.0, 2.0])  # part 2 saw nothing
    np.testing.assert_array_equal(out[1], [4.0, 4.0])  # part 1 saw nothing, its NaN is ignored
    assert np.isnan(out[2, 0]) and out[2, 1] == pytest.approx(0.75)  # NaN value of part 2
    assert np.isnan(out[3]).all() and np.isnan(lse[3])  # NaN lse
    np.testing.assert_array_equal(out[4], [0.0, 0.0])  # nothing seen anywhere
    assert lse[0] == 0.0 and lse[1] == 0.5 and lse[4] == -np.inf
    assert lse[2] == pytest.approx(np.log(4.0))


@pytest.mark.parametrize(
    "merge", [attnx.merge_attention, ref.merge_attention], ids=["attnx", "ref"]
)
@pytest.mark.parametrize("lse", [1e10, 1e17, 1e30, 3e38, -1e30])
def test_parts_of_large_lse_weigh_by_their_difference(merge, lse):
    """Two parts of equal lse weigh alike whatever its size: the weights are exp(lse_i - max)
    over their sum (the reference took exp(lse_i - logaddexp(...)), and in float64
    logaddexp(x, x) rounds back to x from about 1e17: both weights 1, the merge 4.0)."""
    o1, o2 = np.ones((2, 3), np.float64), np.full((2, 3), 3.0)
    lses = [np.array([lse, lse]), np.array([lse, lse])]
    out, got = merge([o1, o2], lses)
    np.testing.assert_allclose(out, 2.0, rtol=1e-12)
    assert np.isfinite(got).all() and got[0] >= lse


@pytest.mark.parametrize("dtype", DTYPES + [np.dtype(np.float64)], ids=lambda d: d.name)
def test_dtypes_are_kept_and_accumulated_wide(dtype):
    """The output keeps the parts' dtype, the lse is float32 (float64 for float64 parts)."""
    rng = np.random.default_rng(SEED)
    o = [rand(rng, (3, 4, 8), dtype) for _ in range(3)]
    lses = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(3)]
    out, lse = attnx.merge_attention(o, lses)
    r_out, r_lse = ref.merge_attention(o, lses)
    assert out.dtype == dtype == r_out.dtype
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32) == r_lse.dtype
    eps = float(ml_dtypes.finfo(dtype).eps) if dtype != np.float64 else F32_EPS
    np.testing.assert_allclose(
        out.astype(np.float64), r_out.astype(np.float64), atol=4 * eps, rtol=0
    )
    np.testing.assert_allclose(lse, r_lse, atol=1e-6, rtol=0)


def test_one_part_is_itself():
    rng = np.random.default_rng(SEED)
    o, lse = rand(rng, (2, 3, 5, 4)), rng.standard_normal((2, 3, 5)).astype(np.float32)
    out, l2 = attnx.merge_attention([o], [lse])
    np.testing.assert_allclose(out, o, rtol=1e-6)
    np.testing.assert_allclose(l2, lse, rtol=1e-6)
    assert out is not o


def test_paged_partials_merge():
    """paged_attention's (N, Hq, Dv) outputs and (N, Hq) lses merge as 'bhsd' (lse =
    out.shape[:-1]): a cache split in two pools decodes like one."""
    rng = np.random.default_rng(SEED)
    kp, vp = rand(rng, (6, 2, 4, 8)), rand(rng, (6, 2, 4, 8))
    q = rand(rng, (2, 4, 8))
    tables = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
    whole = attnx.paged_attention(q, kp, vp, tables, np.array([11, 9]), return_lse=True)
    first = attnx.paged_attention(q, kp, vp, tables[:, :1], np.array([4, 4]), return_lse=True)
    rest = attnx.paged_attention(q, kp, vp, tables[:, 1:], np.array([7, 5]), return_lse=True)
    out, lse = attnx.merge_attention([first[0], rest[0]], [first[1], rest[1]])
    np.testing.assert_allclose(out, whole[0], atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, whole[1], atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    "merge", [attnx.merge_attention, ref.merge_attention], ids=["attnx", "ref"]
)
def test_bad_arguments_are_refused(merge):
    o, lse = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="outs"):
        merge([], [])
    with pytest.raises(ValueError, match="lses"):
        merge([o, o], [lse])
    with pytest.raises(ValueError, match="lses\\[1\\]|outs\\[1\\]"):
        merge([o, o], [lse, lse[:1]])
    with pytest.raises(ValueError, match="outs\\[1\\]"):
        merge([o, o[:1]], [lse, lse])
    with pytest.raises(TypeError, match="outs\\[0\\]"):
        merge([o.astype(np.int32)], [lse])
    with pytest.raises(ValueError, match="layout"):
        merge([o], [lse], layout="sbhd")
    # bshd: (S, H, D) outputs pair with (H, S) lses
    with pytest.raises(ValueError):
        merge([o], [lse], layout="bshd")
    out, _ = merge([o], [lse.T], layout="bshd")
    assert out.shape == o.shape


def test_mixed_dtypes_and_single_arrays_are_refused():
    o, lse = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="outs\\[1\\]"):
        attnx.merge_attention([o, o.astype(np.float16)], [lse, lse])
    with pytest.raises(TypeError, match="sequences"):
        attnx.merge_attention(np.stack([o, o]), np.stack([lse, lse]))
    with pytest.raises(TypeError, match="outs: expected a sequence"):
        attnx.merge_attention(5, 6)


# ---- tensors in, the same kind out (issue 31) -------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("form", ["list", "tuple", "generator", "keywords"])
def test_torch_parts_give_torch_results(dtype, form):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k, v = (
        torch.from_numpy(rng.standard_normal((1, 2, 5, 8)).astype(np.float32)).to(
            getattr(torch, dtype)
        )
        for _ in range(3)
    )
    parts = [
        attnx.attention(q, k[:, :, s], v[:, :, s], return_lse=True)
        for s in (slice(0, 2), slice(2, 5))
    ]
    assert all(isinstance(o, torch.Tensor) for o, _ in parts)
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    if form == "tuple":
        outs, lses = tuple(outs), tuple(lses)
    if form == "generator":
        outs, lses = (o for o in outs), (x for x in lses)
    out, lse = (
        attnx.merge_attention(outs=outs, lses=lses)
        if form == "keywords"
        else attnx.merge_attention(outs, lses)
    )
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    # the same values as the NumPy merge of the same parts
    to_np = lambda t: t.float().numpy()  # noqa: E731
    want_out, want_lse = attnx.merge_attention(
        [to_np(p[0]) for p in parts], [p[1].numpy() for p in parts]
    )
    np.testing.assert_allclose(
        out.float().numpy(), want_out, atol=1e-2 if dtype != "float32" else 1e-6
    )
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-5)


def test_numpy_parts_still_give_numpy():
    rng = np.random.default_rng(4)
    o = [rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(2)]
    x = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2)]
    out, lse = attnx.merge_attention(o, x)
    assert type(out) is np.ndarray and type(lse) is np.ndarray


def test_a_tensor_part_on_another_device_names_it():
    torch = pytest.importorskip("torch")
    o = torch.zeros(2, 3, 4, device="meta")
    with pytest.raises(ValueError, match=r"^outs\[0\]"):
        attnx.merge_attention([o, o], [torch.zeros(2, 3), torch.zeros(2, 3)])
