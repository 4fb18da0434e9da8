"""Hardening, round two (issue 18): arrays and scalars that used to be misread in silence.

Each class of defect is tried on every entry point it can reach: byte-swapped arrays (read as
garbage before), strides that are no multiple of the item size (a field of a structured array),
an ``out`` that overlaps what the call reads, scalars beyond float32's range (``softcap`` of
1e-40 gave NaN, 1e-46 switched capping off), and ``scale`` in
:func:`attnx.scaled_dot_product_attention`, which follows torch (0, negative, NaN, inf).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import reference as ref

from helpers import SEED

F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
F32_MAX = float(np.finfo(np.float32).max)
B, HQ, HKV, SQ, SK, D = 2, 4, 2, 5, 9, 8


def rnd(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture
def qkv():
    rng = np.random.default_rng(SEED)
    return rnd(rng, B, HQ, SQ, D), rnd(rng, B, HKV, SK, D), rnd(rng, B, HKV, SK, D)


def close(a, b, tol=2e-6):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0, atol=tol
    )


def swapped(a):
    """``a`` with the same values in the other byte order."""
    return a.astype(a.dtype.newbyteorder("S"))


def field_view(a, pad=1):
    """``a`` with the same values as a field of a structured array: byte strides that are no
    multiple of the item size (and a misaligned start)."""
    st = np.zeros(a.shape, dtype=[("pad", f"V{pad}"), ("x", a.dtype)])
    st["x"] = a
    view = st["x"]
    assert any(s % a.itemsize for s in view.strides) or a.size <= 1
    return view


def paged_setup(rng, dtype=np.float32):
    kp = rnd(rng, 6, HKV, 4, D, dtype=dtype)
    vp = rnd(rng, 6, HKV, 4, D, dtype=dtype)
    bt = np.array([[0, 3, 5], [2, 1, 4]], np.int32)
    sl = np.array([11, 7], np.int32)
    q = rnd(rng, 2, HQ, D)
    return q, kp, vp, bt, sl


# ---- byte order (defect 3) ------------------------------------------------------------------
@pytest.mark.parametrize("which", ["q", "k", "v", "all"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dense_byteswapped_inputs_are_converted(qkv, which, dtype):
    q, k, v = (x.astype(dtype) for x in qkv)
    want = attnx.attention(q, k, v, causal=True)
    args = {"q": q, "k": k, "v": v}
    for name in args:
        if which in (name, "all"):
            args[name] = swapped(args[name])
    got = attnx.attention(args["q"], args["k"], args["v"], causal=True)
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dt", [">f4", ">f8", ">f2"])
def test_dense_byteswapped_additive_mask(qkv, dt):
    q, k, v = qkv
    m = np.random.default_rng(SEED).standard_normal((SQ, SK))
    close(
        attnx.attention(q, k, v, mask=m.astype(dt)),
        attnx.attention(q, k, v, mask=m.astype(dt).astype(np.float32)),
    )


@pytest.mark.parametrize("dt", [">i4", ">i8", ">u2", ">u8", "<i2"])
def test_dense_byteswapped_lengths(qkv, dt):
    q, k, v = qkv
    kv_lens, q_lens = np.array([4, 9]), np.array([5, 2])
    want = attnx.attention(q, k, v, kv_lens=kv_lens, q_lens=q_lens)
    close(attnx.attention(q, k, v, kv_lens=kv_lens.astype(dt), q_lens=q_lens.astype(dt)), want, 0)


@pytest.mark.parametrize("dt", [">f4", ">f8"])
def test_byteswapped_sinks_and_alibi(qkv, dt):
    q, k, v = qkv
    sinks, slopes = np.linspace(-1, 1, HQ), 2.0 ** -np.arange(1, HQ + 1)
    want = attnx.attention(q, k, v, sinks=sinks, alibi_slopes=slopes)
    close(attnx.attention(q, k, v, sinks=sinks.astype(dt), alibi_slopes=slopes.astype(dt)), want, 0)


def test_dense_byteswapped_out_is_refused(qkv):
    q, k, v = qkv
    out = swapped(np.full(q.shape, 7.0, np.float32))
    with pytest.raises(TypeError, match=r"^out\b.*byte order"):
        attnx.attention(q, k, v, out=out)
    assert (out == 7.0).all()


def test_paged_byteswapped_pages_are_refused_and_q_converted():
    rng = np.random.default_rng(SEED)
    q, kp, vp, bt, sl = paged_setup(rng)
    want = attnx.paged_attention(q, kp, vp, bt, sl)
    np.testing.assert_array_equal(attnx.paged_attention(swapped(q), kp, vp, bt, sl), want)
    for name in ("k_pages", "v_pages"):
        pages = {"k_pages": kp, "v_pages": vp}
        pages[name] = swapped(pages[name])
        with pytest.raises(TypeError, match=rf"^{name}\b.*byte order"):
            attnx.paged_attention(q, pages["k_pages"], pages["v_pages"], bt, sl)
    out = swapped(np.zeros((2, HQ, D), np.float32))
    with pytest.raises(TypeError, match=r"^out\b.*byte order"):
        attnx.paged_attention(q, kp, vp, bt, sl, out=out)


@pytest.mark.parametrize("dt", [">i4", ">i8", ">u4", "<i2"])
def test_paged_byteswapped_tables_and_lengths(dt):
    rng = np.random.default_rng(SEED)
    q, kp, vp, bt, sl = paged_setup(rng)
    q2 = rnd(rng, 5, HQ, D)
    ql = np.array([3, 2], np.int32)
    want = attnx.paged_attention(q2, kp, vp, bt, sl, q_lens=ql)
    got = attnx.paged_attention(q2, kp, vp, bt.astype(dt), sl.astype(dt), q_lens=ql.astype(dt))
    np.testing.assert_array_equal(got, want)


def _step_cache():
    return attnx.PagedKVCache(
        num_layers=1, num_kv_heads=HKV, head_dim=D, num_blocks=8, block_size=4
    )


def test_step_byteswapped_keys_and_values_are_stored_right():
    rng = np.random.default_rng(SEED)
    q, k, v = rnd(rng, 6, HQ, D), rnd(rng, 6, HKV, D), rnd(rng, 6, HKV, D)
    results = []
    for conv in (lambda a: a, swapped):
        cache = _step_cache()
        s = cache.new_sequence()
        out = cache.begin_step([s], [6]).attend(0, conv(q), conv(k), conv(v))
        results.append((out, cache.k_pages(0).copy(), cache.v_pages(0).copy()))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


# ---- strides that are no multiple of the item size (defect 5) -------------------------------
def test_additive_mask_field_view(qkv):
    q, k, v = qkv
    m = np.random.default_rng(SEED).standard_normal((SQ, SK)).astype(np.float32)
    fm = field_view(m, pad=1)
    assert fm.strides == (5 * SK, 5)
    close(attnx.attention(q, k, v, mask=fm), attnx.attention(q, k, v, mask=m), 0)


def test_dense_field_views_everywhere(qkv):
    q, k, v = qkv
    kv_lens = np.array([3, 9], np.int32)
    sinks = np.linspace(-1, 1, HQ).astype(np.float32)
    want = attnx.attention(q, k, v, kv_lens=kv_lens, sinks=sinks)
    out = field_view(np.zeros_like(q), pad=3)
    got = attnx.attention(
        field_view(q),
        field_view(k, 2),
        field_view(v, 3),
        out=out,
        kv_lens=field_view(kv_lens),
        sinks=field_view(sinks),
    )
    assert got is out
    np.testing.assert_array_equal(out, want)


def test_paged_field_views():
    rng = np.random.default_rng(SEED)
    q, kp, vp, bt, sl = paged_setup(rng)
    want = attnx.paged_attention(q, kp, vp, bt, sl)
    got = attnx.paged_attention(
        field_view(q), field_view(kp), field_view(vp), field_view(bt), field_view(sl)
    )
    np.testing.assert_array_equal(got, want)
    # an out the kernel cannot address is refused by paged_attention (its contract), not misread
    with pytest.raises(ValueError, match=r"^out\b"):
        attnx.paged_attention(q, kp, vp, bt, sl, out=field_view(np.zeros_like(q)))


def test_odd_stride_on_an_axis_of_extent_one_is_harmless(qkv):
    q, k, v = qkv
    q1 = q[:1]
    buf = np.zeros(q1.nbytes + 3, np.uint8)
    odd = np.lib.stride_tricks.as_strided(
        buf[: q1.nbytes].view(np.float32).reshape(q1.shape), strides=(3,) + q1.strides[1:]
    )
    odd[...] = q1
    np.testing.assert_array_equal(
        attnx.attention(odd, k[:1], v[:1]), attnx.attention(q1, k[:1], v[:1])
    )


def test_binding_refuses_what_it_cannot_address(qkv):
    q, k, v = qkv
    m = field_view(np.zeros((1, 1, SQ, SK), np.float32))
    with pytest.raises(ValueError, match=r"^mask\b.*(aligned|multiples)"):
        attnx._core.attention(q, k, v, mask=m)
    with pytest.raises(ValueError, match=r"^q\b.*(aligned|multiples)"):
        attnx._core.attention(field_view(q), k, v)


# ---- out overlapping what the call reads (defect 4) -----------------------------------------
def test_paged_out_overlapping_q():
    rng = np.random.default_rng(SEED)
    q, kp, vp, bt, sl = paged_setup(rng)
    want = attnx.paged_attention(q.copy(), kp, vp, bt, sl)
    out = q[::-1]
    got = attnx.paged_attention(q, kp, vp, bt, sl, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("which", ["k_pages", "v_pages"])
def test_paged_out_overlapping_pages(which):
    rng = np.random.default_rng(SEED)
    q, kp, vp, bt, sl = paged_setup(rng)
    want = attnx.paged_attention(q, kp.copy(), vp.copy(), bt, sl)
    pages = kp if which == "k_pages" else vp
    out = pages.reshape(-1)[7 : 7 + q.size].reshape(q.shape)  # the rows the call reads
    got = attnx.paged_attention(q, kp, vp, bt, sl, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("which", ["q", "k", "v", "mask", "sinks", "kv_lens"])
def test_dense_out_overlapping_any_input(qkv, which):
    q, k, v = qkv
    rng = np.random.default_rng(SEED + 1)
    buf = rnd(rng, q.size + 64)
    out = buf[: q.size].reshape(q.shape)
    args = dict(
        q=q.copy(),
        k=k.copy(),
        v=v.copy(),
        mask=rnd(rng, SQ, SK),
        sinks=rnd(rng, HQ),
        kv_lens=np.array([4, 9], np.int32),
    )
    if which == "kv_lens":
        args[which] = buf[-2:].view(np.int32)[:2]
        args[which][:] = [4, 9]
    else:
        shape = args[which].shape
        args[which] = buf[5 : 5 + args[which].size].reshape(shape)
    want = attnx.attention(**{n: np.array(a, copy=True) for n, a in args.items()})
    got = attnx.attention(**args, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)


def test_step_keys_read_from_the_pool_itself():
    """New keys given as a view of the very block the step writes: read before any is written."""
    rng = np.random.default_rng(SEED)
    cache = _step_cache()
    s = cache.new_sequence()
    cache.begin_step([s], [4]).attend(
        0, rnd(rng, 4, HQ, D), rnd(rng, 4, HKV, D), rnd(rng, 4, HKV, D)
    )
    cache.free(s)  # its block goes back to the pool with its contents, and is reused below
    # tokens 3, 2, 1, 0 of the freed sequence, as (T, Hkv, D) views into the pool
    k_view, v_view = (
        pages[0].transpose(1, 0, 2)[::-1] for pages in (cache.k_pages(0), cache.v_pages(0))
    )
    assert np.shares_memory(k_view, cache.k_pages(0))
    k_copy, v_copy = k_view.copy(), v_view.copy()
    q = rnd(rng, 4, HQ, D)
    t = cache.new_sequence()
    got = cache.begin_step([t], [4]).attend(0, q, k_view, v_view)
    assert cache.block_table(t) == [0]  # the step wrote where it read
    twin = _step_cache()
    u = twin.new_sequence()
    want = twin.begin_step([u], [4]).attend(0, q, k_copy, v_copy)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cache.k_pages(0)[0], twin.k_pages(0)[0])
    np.testing.assert_array_equal(cache.v_pages(0)[0], twin.v_pages(0)[0])


# ---- scalars beyond float32's range (defect 6) ----------------------------------------------
@pytest.mark.parametrize("softcap", [1e-40, 1e-46, 5e-324, 1e39, 1e300])
def test_softcap_outside_float32_range_is_refused(qkv, softcap):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"^softcap\b.*float32"):
        attnx.attention(np.zeros_like(q), k, v, softcap=softcap)
    rng = np.random.default_rng(SEED)
    with pytest.raises(ValueError, match=r"^softcap\b.*float32"):
        attnx.paged_attention(*paged_setup(rng), softcap=softcap)


@pytest.mark.parametrize("softcap", [F32_TINY, 1e-30, 1e30, F32_MAX])
def test_softcap_at_the_ends_of_the_range_is_right(qkv, softcap):
    q, k, v = qkv
    for qq in (q, np.zeros_like(q)):
        got = attnx.attention(qq, k, v, softcap=softcap)
        assert not np.isnan(got).any()
        close(got, ref.attention(qq, k, v, softcap=softcap), 1e-6)


@pytest.mark.parametrize("scale", [1e-46, 1e-40, 1e39, 1e300])
def test_scale_outside_float32_range_is_refused(qkv, scale):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"^scale\b.*float32"):
        attnx.attention(q, k, v, scale=scale)
    rng = np.random.default_rng(SEED)
    with pytest.raises(ValueError, match=r"^scale\b.*float32"):
        attnx.paged_attention(*paged_setup(rng), scale=scale)


@pytest.mark.parametrize("name", ["sinks", "alibi_slopes"])
def test_per_head_values_beyond_float32_are_refused(qkv, name):
    q, k, v = qkv
    bad = np.zeros(HQ)
    bad[1] = 1e39
    with pytest.raises(ValueError, match=rf"^{name}\b.*float32"):
        attnx.attention(q, k, v, **{name: bad})


def test_alibi_whose_bias_would_overflow_is_refused(qkv):
    """The bias -slope * distance is formed in float32: a finite slope whose bias overflows would
    hide every key a row sees (zeros where the reference weighs them). Refused, naming the
    argument; a slope just below the bound still computes the reference's result."""
    q, k, v = qkv
    reach = max(SQ, SK)
    bad = np.zeros(HQ)
    bad[2] = F32_MAX / reach * 1.01
    with pytest.raises(ValueError, match=r"^alibi_slopes\b.*distance"):
        attnx.attention(q, k, v, alibi_slopes=bad)
    rng = np.random.default_rng(SEED)
    pq, kp, vp, bt, sl = paged_setup(rng)
    with pytest.raises(ValueError, match=r"^alibi_slopes\b.*distance"):
        attnx.paged_attention(pq, kp, vp, bt, sl, alibi_slopes=np.full(HQ, F32_MAX / 11 * 1.01))
    ok = np.full(HQ, 1e36)
    close(attnx.attention(q, k, v, alibi_slopes=ok), ref.attention(q, k, v, alibi_slopes=ok))
    close(
        attnx.paged_attention(pq, kp, vp, bt, sl, alibi_slopes=ok),
        ref.paged_attention(pq, kp, vp, bt, sl, alibi_slopes=ok),
    )


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.float64])
def test_empty_feature_axis(isa, rows, dtype):
    """Dk = 0 (torch accepts it): every score is 0, so each row is the mean of the values it sees
    (with an explicit scale). Rows past kDotRows take the packed path, whose line prefetch and
    packed K divided by the row's width (SIGFPE)."""
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(SEED)
    q = np.zeros((1, 4, rows, 0), dtype)
    k = np.zeros((1, 2, 70, 0), dtype)
    v = rnd(rng, 1, 2, 70, 3, dtype=dtype)
    for causal in (False, True):
        got = attnx.attention(q, k, v, causal=causal, scale=1.0, num_threads=2)
        close(got, ref.attention(q, k, v, causal=causal, scale=1.0), tol=1e-2)
    vv = v[0].repeat(2, 0)  # (Hq, Sk, 3)
    got = attnx.scaled_dot_product_attention(q[0], k[0].repeat(2, 0), vv)  # (torch's scale: 1)
    close(got, np.broadcast_to(vv.astype(np.float64).mean(1, keepdims=True), got.shape), 1e-2)
    if dtype is not np.float64:  # (pages hold 16- and 32-bit floats)
        kp, vp = np.zeros((5, 2, 16, 0), dtype), rnd(rng, 5, 2, 16, 3, dtype=dtype)
        pq = np.zeros((rows, 4, 0), dtype)
        bt, sl, ql = np.array([[4, 0, 3, 1, 2]]), np.array([70]), np.array([min(rows, 70)])
        got = attnx.paged_attention(pq, kp, vp, bt, sl, q_lens=ql, scale=1.0)
        close(got, ref.paged_attention(pq, kp, vp, bt, sl, q_lens=ql, scale=1.0), tol=1e-2)
    with pytest.raises(ValueError, match=r"^scale\b.*Dk"):
        attnx.attention(q, k, v)


@pytest.mark.parametrize(
    "t", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
)
def test_numpy_integer_scalars_of_every_width(qkv, t):
    q, k, v = qkv
    want = attnx.attention(q[0], k[0], v[0], window=(2, 1), kv_lens=7, q_lens=4)
    got = attnx.attention(q[0], k[0], v[0], window=(t(2), t(1)), kv_lens=t(7), q_lens=t(4))
    np.testing.assert_array_equal(got, want)
    rng = np.random.default_rng(SEED)
    pq, kp, vp, bt, sl = paged_setup(rng)
    want = attnx.paged_attention(pq, kp, vp, bt, sl, window=(3, None))
    got = attnx.paged_attention(pq, kp, vp, bt.astype(t), sl.astype(t), window=(t(3), None))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("t", [np.float16, np.float32, np.float64, int])
def test_numpy_float_scalars_for_scale_and_softcap(qkv, t):
    q, k, v = qkv
    np.testing.assert_array_equal(
        attnx.attention(q, k, v, scale=t(2), softcap=t(8)),
        attnx.attention(q, k, v, scale=2.0, softcap=8.0),
    )


# ---- scaled_dot_product_attention's scale follows torch -------------------------------------
@pytest.mark.parametrize(
    "scale",
    [0.0, -0.0, -0.4, -3.0, 1e-46, -1e-40, 1e39, -1e39, float("nan"), float("inf"), -float("inf")],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sdpa_scale_like_torch(qkv, scale, dtype):
    q, k, v = (x.astype(dtype) for x in qkv)
    mask = np.tril(np.ones((SQ, SK), bool), 3)
    got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # torch's CPU kernels hold the scale in float32, as the kernels here do
    with np.errstate(over="ignore"):
        s32 = float(np.float32(scale))
    want = ref.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s32, enable_gqa=True)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    close(np.nan_to_num(got), np.nan_to_num(want), 2e-3 if dtype == np.float16 else 2e-6)


def test_sdpa_scale_zero_is_uniform_attention(qkv):
    q, k, v = qkv
    got = attnx.scaled_dot_product_attention(q, k, v, scale=0.0, enable_gqa=True)
    want = np.repeat(v.mean(axis=2, keepdims=True), HQ // HKV, axis=1)
    close(got, np.broadcast_to(want, got.shape), 1e-6)


def test_sdpa_nan_scale_propagates(qkv):
    q, k, v = qkv
    assert np.isnan(
        attnx.scaled_dot_product_attention(q, k, v, scale=float("nan"), enable_gqa=True)
    ).all()


# ---- the keyword interface of the binding (issue 11 item 5) ---------------------------------
def test_errors_come_from_the_one_call(qkv, monkeypatch):
    q, k, v = qkv
    calls = []
    core = attnx.ops.attention._core

    class Counting:
        def __getattr__(self, name):
            f = getattr(core, name)
            return lambda *a, **kw: (calls.append(name), f(*a, **kw))[1]

    monkeypatch.setattr(attnx.ops.attention, "_core", Counting())
    out = np.full((B, HQ, SQ, 2 * D + 2), 3.0, np.float32)[..., ::2]  # strided and the wrong shape
    with pytest.raises(ValueError, match=r"^out\b.*shape"):
        attnx.attention(q, k, v, out=out)
    assert calls == ["attention"]
    assert (out == 3.0).all()


def test_core_takes_keywords_and_names_bad_ones(qkv):
    q, k, v = qkv
    want = attnx.attention(q, k, v, causal=True, scale=0.3)
    np.testing.assert_array_equal(attnx._core.attention(q, k, v, causal=True, scale=0.3), want)
    np.testing.assert_array_equal(
        attnx._core.attention(q, k, v, None, None, None, True, 0.3), want
    )  # positional too
    with pytest.raises(TypeError, match="unexpected keyword argument 'scal'"):
        attnx._core.attention(q, k, v, scal=0.3)
    with pytest.raises(TypeError, match="multiple values for argument 'mask'"):
        attnx._core.attention(q, k, v, None, mask=None)
    with pytest.raises(TypeError, match="missing required argument 'v'"):
        attnx._core.attention(q, k)
    with pytest.raises(TypeError, match=r"^scale\b"):
        attnx._core.attention(q, k, v, scale="0.3")
    with pytest.raises(TypeError, match=r"^causal\b"):
        attnx._core.attention(q, k, v, causal=np.ones(2, bool))
