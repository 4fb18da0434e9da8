"""float64 inputs: computed and accumulated in float64 by the tiled kernel (O(S·D) memory).

Held to ``attnx.reference`` (float64 NumPy) at ``1e-12`` (times the largest |v|, or |lse|): float64's
eps is 2.2e-16, so this leaves ~4500 ulps for the kernel's different order of summation over a
few thousand keys, while a float32 computation (eps 1.2e-7) misses it by five orders of magnitude
(test_float32_would_fail shows the bound tells the two apart). Covers every feature of
``attnx.attention`` (masks, lengths, causal, window, softcap, sinks, ALiBi, GQA, Dk != Dv, ranks,
layouts, out=, return_lse, split-KV threads), the entry points built on it, lists, and what still
refuses float64 (mixed dtypes, pages).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx import reference as ref

from helpers import (
    BF16,
    RISES,
    SEED,
    assert_matches,
    climbing_scores,
    from4,
    lse4,
    make_rng,
    script_words,
    to4,
)

TOL = 1e-12  # relative to max(1, the largest |v|) for out, max(1, the largest |lse|) for lse


def bounds(v4, rl4):
    v_max = float(np.max(np.abs(v4[np.isfinite(v4)]), initial=0.0))
    l_max = float(np.max(np.abs(rl4[np.isfinite(rl4)]), initial=0.0))
    return TOL * max(1.0, v_max), TOL * max(1.0, l_max)


def check_f64(q, k, v, *, layout="bhsd", out=None, **kw):
    """attnx.attention on float64 inputs against the reference: float64 out and lse, inputs
    untouched, values within TOL, zero rows and -inf / NaN exactly where the reference has them."""
    rank = q.ndim
    before = [x.copy() for x in (q, k, v)]
    o, lse = attnx.attention(q, k, v, layout=layout, return_lse=True, out=out, **kw)
    if out is not None:
        assert o is out
    for x, x0 in zip((q, k, v), before):
        np.testing.assert_array_equal(x, x0, err_msg="the kernel modified an input")
    kw.pop("num_threads", None)
    r, rl = ref.attention(*before, layout=layout, return_lse=True, **kw)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert o.shape == r.shape and lse.shape == rl.shape
    wkw = {key: kw[key] for key in ("causal", "mask", "kv_lens", "q_lens", "window") if key in kw}
    visible = lse4(ref.attention_weights(before[0], before[1], layout=layout, **wkw), rank) != 0
    o4, r4, v4 = (to4(x, layout, rank) for x in (o, r, before[2]))
    l4, rl4 = lse4(lse, rank), lse4(rl, rank)
    tol_out, tol_lse = bounds(v4, rl4)
    assert_matches(o4, r4, l4, rl4, visible, tol_out, tol_lse)
    return o, lse


# ---------------------------------------------------------------------------------------------
# random problems over every feature
# ---------------------------------------------------------------------------------------------


@st.composite
def problems(draw):
    """(q, k, v, layout, kwargs): float64 inputs in a random rank and layout with a random
    selection of attention's features."""
    rank = draw(st.sampled_from([2, 3, 4, 4]))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    B = draw(st.integers(1, 2)) if rank == 4 else 1
    Hkv = draw(st.integers(1, 2)) if rank > 2 else 1
    Hq = Hkv * (draw(st.integers(1, 3)) if rank > 2 else 1)
    Sq, Sk = draw(st.integers(1, 80)), draw(st.integers(1, 160))
    Dk = draw(st.integers(1, 40))
    Dv = draw(st.sampled_from([Dk, draw(st.integers(1, 40))]))
    rng = make_rng("float64", draw(st.integers(0, 2**32 - 1)))
    mag = draw(st.sampled_from([0.5, 1.0, 3.0]))
    q4, k4, v4 = (
        mag * rng.standard_normal(s) for s in ((B, Hq, Sq, Dk), (B, Hkv, Sk, Dk), (B, Hkv, Sk, Dv))
    )
    q, k, v = (from4(x, layout, rank) for x in (q4, k4, v4))
    kw = {"num_threads": draw(st.sampled_from([1, 2, 4]))}
    logical = (B, Hq, Sq, Sk)[4 - rank :]
    kind = draw(st.sampled_from(["none", "none", "bool", "additive"]))
    if kind != "none":
        shape = tuple(n if draw(st.booleans()) else 1 for n in logical)
        if kind == "bool":
            kw["mask"] = rng.random(shape) < 0.8
        else:
            kw["mask"] = np.where(rng.random(shape) < 0.15, -np.inf, rng.standard_normal(shape))
    if draw(st.booleans()):
        kw["causal"] = True
    if draw(st.booleans()):
        lens = rng.integers(0, Sk + 1, B)
        kw["kv_lens"] = lens if rank == 4 else int(lens[0])
    if draw(st.booleans()):
        lens = rng.integers(0, Sq + 1, B)
        kw["q_lens"] = lens if rank == 4 else int(lens[0])
    if draw(st.booleans()):
        kw["window"] = (
            draw(st.sampled_from([None, 0, 3, 40])),
            draw(st.sampled_from([None, 0, 5])),
        )
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([2.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = rng.standard_normal(Hq)
    if draw(st.booleans()):
        kw["alibi_slopes"] = rng.random(Hq) * 0.5
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.05, 0.3, 1.7]))
    return q, k, v, layout, kw


@given(problems())
def test_matches_reference(problem):
    q, k, v, layout, kw = problem
    check_f64(q, k, v, layout=layout, **kw)


def test_float32_would_fail(rng):
    """The bound is tight enough to tell a float64 computation from a float32 one."""
    q, k, v = (rng.standard_normal((1, 2, 70, 24)) for _ in range(3))
    r, rl = ref.attention(q, k, v, return_lse=True)
    o32, l32 = attnx.attention(*(x.astype(np.float32) for x in (q, k, v)), return_lse=True)
    tol_out, tol_lse = bounds(v, rl)
    assert np.abs(o32 - r).max() > 100 * tol_out and np.abs(l32 - rl).max() > 100 * tol_lse
    check_f64(q, k, v)


@pytest.mark.parametrize("rise", RISES)
def test_running_max_lags_by_at_most_the_slack(rng, rise):
    """The float64 kernels' fused prefill tiles raise the running max lazily too (test_numerics)."""
    q, k, v = climbing_scores(rng, rise, np.float64)
    for kw in (dict(scale=1.0), dict(scale=1.0, causal=True), dict(scale=1.0, num_threads=1)):
        o, lse = check_f64(q, k, v, **kw)
        assert np.isfinite(o).all() and np.isfinite(lse).all()


# ---------------------------------------------------------------------------------------------
# each path of the driver: split-KV, grouped decode, shared packed K, non-finite values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["split_kv", "grouped_decode", "packed_prefill"])
def test_driver_paths(rng, case):
    """Split-KV (a few long rows on 4 threads, merged by log-sum-exp), decode items grouped per
    sequence (bshd: short runs of each head), and K tiles packed once and shared by the items
    of a kv head (a long GQA prefill), each with every modifier on."""
    B, Hkv, G, Sq, Sk, Dk, Dv, layout = {
        "split_kv": (1, 1, 2, 4, 20000, 32, 24, "bhsd"),
        "grouped_decode": (2, 4, 2, 1, 300, 24, 24, "bshd"),
        "packed_prefill": (1, 2, 3, 200, 260, 40, 12, "bhsd"),
    }[case]
    Hq = Hkv * G
    q, k, v = (
        from4(rng.standard_normal(s), layout, 4)
        for s in ((B, Hq, Sq, Dk), (B, Hkv, Sk, Dk), (B, Hkv, Sk, Dv))
    )
    kw = dict(
        causal=True,
        softcap=20.0,
        sinks=rng.standard_normal(Hq),
        alibi_slopes=rng.random(Hq) * 0.01,
        kv_lens=np.full(B, Sk - 3),
        num_threads=4,
    )
    check_f64(q, k, v, layout=layout, **kw)
    check_f64(q, k, v, layout=layout, mask=rng.standard_normal((B, 1, Sq, Sk)), window=(100, 0))


def test_invisible_non_finite_values_do_not_leak(rng):
    """A key a row cannot see never reaches it, not even an inf or NaN value; NaN in a visible
    key poisons exactly the rows that see it."""
    q, k, v = (rng.standard_normal((1, 1, 6, 8)) for _ in range(3))
    v[0, 0, 5, 2] = np.inf
    v[0, 0, 4, 3] = np.nan
    o, _ = check_f64(q, k, v, causal=True)
    assert np.isfinite(o[0, 0, :4]).all() and np.isnan(o[0, 0, 4:]).any()


# ---------------------------------------------------------------------------------------------
# arguments: lists, out=, lse, dtypes that still raise
# ---------------------------------------------------------------------------------------------


def test_lists_and_scalars_convert_as_numpy_does():
    """Python lists of floats are float64 arrays (np.asarray): the float64 path; Python scalars
    (scale, softcap) and lists (sinks, lengths) are accepted too."""
    q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    v = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    o = attnx.attention(q, q, v, causal=True, scale=1, softcap=5, sinks=[0.5])
    assert isinstance(o, np.ndarray) and o.dtype == np.float64
    want = ref.attention(
        np.array(q),
        np.array(q),
        np.array(v),
        causal=True,
        scale=1.0,
        softcap=5.0,
        sinks=np.array([0.5]),
    )
    np.testing.assert_allclose(o, want, rtol=0, atol=TOL * 6)
    # the seed's worked example, typed in as lists
    np.testing.assert_allclose(
        attnx.attention(q, q, v),
        ref.attention(np.array(q), np.array(q), np.array(v)),
        rtol=0,
        atol=TOL * 6,
    )
    with pytest.raises(TypeError, match=r"^q\b.*astype"):  # ints stay ints, as in NumPy
        attnx.attention([[1, 0]], [[1, 0]], [[1, 2]])


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_out_is_written_in_place(rng, strided):
    q, k, v = (rng.standard_normal((2, 5, 3, 8)) for _ in range(3))
    base = np.full((2, 5, 3, 16 if strided else 8), 7.0)
    out = base[..., ::2] if strided else base
    o, lse = check_f64(q, k, v, layout="bshd", out=out, causal=True)
    assert o is out and lse.dtype == np.float64
    if strided:
        assert (base[..., 1::2] == 7.0).all()
    with pytest.raises(TypeError, match=r"^out: expected dtype float64"):
        attnx.attention(q, k, v, out=np.zeros((2, 5, 3, 8), np.float32), layout="bshd")


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"]
)
def test_lse_stays_float32_for_other_dtypes(rng, dtype):
    dt = np.dtype(dtype)
    q = rng.standard_normal((1, 2, 4, 8)).astype(dt)
    o, lse = attnx.attention(q, q, q, return_lse=True)
    assert o.dtype == dt and lse.dtype == np.float32
    _, lse64 = attnx.attention(
        q.astype(np.float64), q.astype(np.float64), q.astype(np.float64), return_lse=True
    )
    assert lse64.dtype == np.float64


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_mixed_with_float32_raises(rng, which):
    """Mixed float64 / float32 is refused, naming the arguments, before anything is written."""
    args = {n: rng.standard_normal((1, 2, 3, 4)) for n in "qkv"}
    args[which] = args[which].astype(np.float32)
    out = np.full((1, 2, 3, 4), 7.0)
    with pytest.raises(TypeError, match=r"q, k, v: expected one dtype") as info:
        attnx.attention(args["q"], args["k"], args["v"], out=out)
    assert "float32" in str(info.value) and "float64" in str(info.value)
    assert (out == 7.0).all()


def test_additive_mask_is_read_in_float64(rng):
    """An additive mask with float64 inputs is float64 (a float32 one is widened exactly): a
    bias that float32 would round changes the result beyond TOL."""
    q, k, v = (rng.standard_normal((1, 1, 4, 8)) for _ in range(3))
    mask = rng.standard_normal((4, 4)) * 1e-3 + 1.0 / 3.0
    check_f64(q[0, 0], k[0, 0], v[0, 0], mask=mask)
    check_f64(q[0, 0], k[0, 0], v[0, 0], mask=mask.astype(np.float32))
    with pytest.raises(TypeError, match=r"mask: expected a boolean or float64"):
        attnx._core.attention(q, k, v, mask=mask.astype(np.float32)[None, None])


def test_pages_refuse_float64(rng):
    """Paged attention reads its pools in place, and has no float64 kernel: float64 pages (or q)
    are refused with a TypeError that says where float64 runs."""
    kp = rng.standard_normal((4, 1, 16, 8))
    q = rng.standard_normal((1, 2, 8))
    table, lens = np.array([[2, 0]]), np.array([20])
    with pytest.raises(TypeError, match=r"^k_pages: .*float64 runs only in dense attention"):
        attnx.paged_attention(q.astype(np.float32), kp, kp.astype(np.float32), table, lens)
    with pytest.raises(TypeError, match=r"^q: .*float64 runs only in dense attention"):
        attnx.paged_attention(q, kp.astype(np.float32), kp.astype(np.float32), table, lens)
    with pytest.raises(TypeError, match="dtype"):
        attnx.PagedKVCache(1, 1, 8, 4, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# the entry points built on attention
# ---------------------------------------------------------------------------------------------


def test_sdpa_float64(rng):
    """torch's semantics in float64 (scale held as a double, as torch does for float64)."""
    q, k, v = (
        rng.standard_normal((2, 4, 5, 8)),
        rng.standard_normal((2, 2, 7, 8)),
        rng.standard_normal((2, 2, 7, 6)),
    )
    mask = rng.standard_normal((5, 7))
    for kw in (
        dict(is_causal=True),
        dict(attn_mask=mask, scale=0.1234567890123),
        dict(scale=-0.3),
        dict(scale=1e-40),
        dict(scale=1e39),
    ):
        got = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        want = ref.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(v).max())


def test_multi_head_attention_float64(rng):
    """A float64 layer stores float64 weights and computes in float64: the seed's formula, with
    the reference doing the attention, agrees to TOL."""
    layer = attnx.MultiHeadAttention(12, 4, num_kv_heads=2, bias=True, dtype=np.float64, seed=3)
    for name in ("b_Q", "b_K", "b_V", "b_O"):
        setattr(layer, name, rng.standard_normal(getattr(layer, name).shape))
    x = rng.standard_normal((2, 5, 12))
    y = layer(x, causal=True, kv_lens=[5, 3])
    assert y.dtype == np.float64 and layer.W_Q.dtype == np.float64
    q = (x @ layer.W_Q + layer.b_Q).reshape(2, 5, 4, 3)
    k = (x @ layer.W_K + layer.b_K).reshape(2, 5, 2, 3)
    v = (x @ layer.W_V + layer.b_V).reshape(2, 5, 2, 3)
    heads = ref.attention(q, k, v, causal=True, kv_lens=np.array([5, 3]), layout="bshd")
    want = heads.reshape(2, 5, 12) @ layer.W_O + layer.b_O
    np.testing.assert_allclose(y, want, rtol=0, atol=TOL * max(1.0, np.abs(want).max()))
    assert attnx.MultiHeadAttention(12, 4, seed=3)(x).dtype == np.float32  # float32 layers stay


def test_torch_float64_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    o, lse = attnx.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float64 and lse.dtype == torch.float64
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (o - want).abs().max().item() <= TOL * max(1.0, v.abs().max().item())
    sdpa = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(sdpa, torch.Tensor) and (sdpa - want).abs().max().item() <= TOL * 10
    out = torch.empty_like(q)
    assert attnx.attention(q, k, v, out=out) is out


# ---------------------------------------------------------------------------------------------
# memory: never a score matrix, in float64 too
# ---------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    import numpy as np, attnx
    Sq, Sk, D = 1024, 65536, 8
    rng = np.random.default_rng(int(sys.argv[1]))
    q = rng.standard_normal((1, 1, Sq, D))
    k, v = (rng.standard_normal((1, 1, Sk, D)) for _ in range(2))
    out = np.empty_like(q)
    attnx.attention(q[:, :, :70], k[:, :, :300], v[:, :, :300])  # warm up: threads, scratch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    attnx.attention(q, k, v, out=out, causal=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = [0, 777, Sq - 1]
    np.savez(sys.argv[2], out=out[0, 0, rows], q=q[0, 0, rows], k=k[0, 0], v=v[0, 0],
             rows=np.array(rows))
    print((after - before) * 1024)
""")


def test_memory_is_linear_in_sequence_length(tmp_path):
    """1024 float64 queries against Sk = 65536 keys (D = 8): a score matrix would be 512 MiB;
    the peak RSS of a fresh process grows by far less (K packed once per call, padded to 32
    features, is 16 MiB; ru_maxrss is a high-water mark, hence the subprocess)."""
    npz = tmp_path / "rows.npz"
    grown = int(script_words(_MEMORY_SCRIPT, SEED, npz)[0])
    assert grown < 128 * 2**20, f"peak RSS grew by {grown / 2**20:.0f} MiB"
    d = np.load(npz)
    Sk, Sq = d["k"].shape[0], 1024
    for row, o, q in zip(d["rows"], d["out"], d["q"]):
        n = int(row) + Sk - Sq + 1  # bottom-right causal: row i sees keys j <= i + Sk - Sq
        exact = ref.attention(q[None], d["k"][:n], d["v"][:n])
        np.testing.assert_allclose(o, exact[0], rtol=0, atol=TOL * np.abs(d["v"]).max())
