"""bf16 products held to the flash rule: the error against the float64 reference (over the
bf16-rounded inputs) within a small multiple of a same-precision implementation's, the
reference's own twin ``attnx.reference.attention(..., bf16_products=True)`` (q, k, v and P
rounded to bf16). For bf16 inputs on the avx512bf16 and amx paths, and float32 inputs there under
``attnx.set_float32_precision("bf16")``."""

from __future__ import annotations

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

import attnx
from attnx import reference as ref

from helpers.checks import dense_views
from helpers.data import BF16, F32_EPS
from helpers.tolerance import conditioning

# Bounds measured on these paths (Zen 4, random bf16 shapes): the kernel's max error is 1.0x the
# twin's (median; at most 1.05x), its mean error 1.0x; against torch's bf16 SDPA 1.0x max (at most
# 1.33x) and 1.25x mean (at most 1.54x): torch's CPU kernel keeps more of P.
EMUL_MAX_RATIO = 2.0
EMUL_MEAN_RATIO = 1.25
TORCH_RATIO = 2.0
ROWS_PER_ITEM = 64  # plan.h kRowsPerItem: query rows (heads x positions) per work item
DOT_ROWS = 8  # tables.h kDotRows: items of at most this many rows keep float32 products


def all_prefill(hq, hkv, sq):
    """Whether every work item of a dense call has more than DOT_ROWS rows (plan.h's items:
    min(G, 64) heads by chunks of 64 // heads positions), so that every row takes bf16 products."""
    heads = min(hq // hkv, ROWS_PER_ITEM)
    chunk = min(sq, max(1, ROWS_PER_ITEM // heads))
    last = sq - (sq - 1) // chunk * chunk
    return heads * min(chunk, last) > DOT_ROWS


# (B, Hq, Hkv, S, Dk, Dv) prefill shapes (every item > 8 rows): MHA, GQA, odd widths
PREFILL_SHAPES = [(1, 8, 8, 256, 64, 64), (1, 8, 2, 200, 128, 128), (2, 4, 4, 97, 63, 33)]


def prefill_qkv(rng, shape, dtype):
    """Standard normal q, k, v of a (B, Hq, Hkv, S, Dk, Dv) shape, in dtype."""
    B, hq, hkv, s, dk, dv = shape
    return (
        rng.standard_normal((B, hq, s, dk)).astype(dtype),
        rng.standard_normal((B, hkv, s, dk)).astype(dtype),
        rng.standard_normal((B, hkv, s, dv)).astype(dtype),
    )


EXTRAS = ["none", "bool_mask", "add_mask", "lens", "window", "softcap", "sinks", "alibi", "scale"]


def _extra(extra, r, B, H, sq, sk):
    """The keywords of one modifier (EXTRAS), drawn from generator r."""
    if extra == "bool_mask":
        return {"mask": r.random((B, 1, sq, sk)) < 0.8}
    if extra == "add_mask":
        add = r.standard_normal((1, H, sq, sk))
        return {"mask": np.where(r.random(add.shape) < 0.2, -np.inf, add).astype(np.float32)}
    if extra == "lens":
        return {"kv_lens": r.integers(0, sk + 1, B), "q_lens": r.integers(0, sq + 1, B)}
    if extra == "window":
        return {"window": (int(r.integers(0, 40)), int(r.integers(0, 10)))}
    return {
        "softcap": {"softcap": 5.0},
        "sinks": {"sinks": r.standard_normal(H).astype(np.float32)},
        "alibi": {"alibi_slopes": (2.0 ** -np.arange(1, H + 1)).astype(np.float32)},
        "scale": {"scale": float(r.choice([0.3, 1.0, 2.0]))},
    }.get(extra, {})


@st.composite
def prefill_problems(draw, dtype, every_item=False):
    """Prefill problems in ``dtype``: GQA, Dk != Dv, odd widths and key counts, masks, lengths,
    windows, softcap, sinks and ALiBi. Every work item has > 8 rows (the bf16 product path)
    unless Sq is small and the GQA group too; with ``every_item``, always (``all_prefill``)."""
    hkv = draw(st.integers(1, 2))
    g = draw(st.sampled_from([1, 2, 4]))
    B = draw(st.integers(1, 2))
    sq, sk = draw(st.integers(1, 150)), draw(st.integers(1, 260))
    assume(not every_item or all_prefill(hkv * g, hkv, sq))
    dk, dv = draw(st.integers(1, 136)), draw(st.integers(1, 136))
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    qs = draw(st.sampled_from([0.5, 1.0, 3.0]))
    q = (r.standard_normal((B, hkv * g, sq, dk)) * qs).astype(dtype)
    k = r.standard_normal((B, hkv, sk, dk)).astype(dtype)
    v = r.standard_normal((B, hkv, sk, dv)).astype(dtype)
    kw = {"causal": True} if draw(st.booleans()) else {}
    kw.update(_extra(draw(st.sampled_from(EXTRAS)), r, B, hkv * g, sq, sk))
    return q, k, v, kw


def on_isa(name, fn):
    """fn() on kernel path ``name``, the active path restored afterwards."""
    previous = attnx.cpu_features()["isa"]
    attnx._core.set_isa(name)
    try:
        return fn()
    finally:
        attnx._core.set_isa(previous)


def rounded_bf16(x):
    """``x`` rounded to bf16 (round to nearest even), in its own dtype."""
    x = np.asarray(x)
    return x.astype(BF16).astype(x.dtype)


def kernel_query(q, scale=None):
    """The bf16 query a float32 caller's bf16 products use (bf16_dot-inl.h pack_query, as
    docs/numerics.md says): the driver's scaled row times 1/scale in float32, rounded to bf16.
    ``round(q)`` itself but within a float32 ulp or two of a bf16 tie, where it may be the
    neighbour. Queries of other dtypes (bf16 callers) are rounded as they are."""
    q = np.asarray(q)
    if q.dtype != np.float32:
        return rounded_bf16(q)
    s = np.float32(q.shape[-1] ** -0.5 if scale is None else scale)
    with np.errstate(over="ignore", invalid="ignore"):
        return rounded_bf16((q * s) * (np.float32(1) / s))


def bf16_twin(q, k, v, **kw):
    """What a same-precision (bf16 products) implementation computes, as float64: the reference
    with q, k, v and P rounded to bf16, the output rounded to q's dtype."""
    return ref.attention(q, k, v, bf16_products=True, out_dtype=np.asarray(q).dtype, **kw).astype(
        np.float64
    )


def errors(o, r):
    """(max, mean) |o - r| over the reference's finite entries."""
    fin = np.isfinite(r)
    e = np.abs(o.astype(np.float64)[fin] - r[fin])
    return (float(e.max(initial=0.0)), float(e.mean()) if e.size else 0.0)


def _against_rounded(q, k, v, kw):
    """The kernel's output and the float64 reference's over the bf16-rounded inputs, with NaN
    and inf where the reference has them."""
    qb = kernel_query(q, kw.get("scale"))
    r = ref.attention(qb, *(rounded_bf16(x) for x in (k, v)), out_dtype=np.float64, **kw)
    o = attnx.attention(q, k, v, **kw)
    assert o.dtype == q.dtype
    np.testing.assert_array_equal(np.isnan(o), np.isnan(r), err_msg="NaN pattern differs")
    fin = np.isfinite(r)
    np.testing.assert_array_equal(o[~fin].astype(np.float64), r[~fin], err_msg="inf differs")
    return o, r


def assert_flash_rule(q, k, v, **kw):
    """The kernel against the float64 reference over the bf16-rounded inputs, next to
    ``bf16_twin``'s error; NaN and inf where the reference has them. Returns the output.
    (Two roundings of P compared: on a few keys, a float32 output's ratio is noise; see
    ``assert_p_rounding_bound``.)"""
    o, r = _against_rounded(q, k, v, kw)
    (km, ka), (em, ea) = errors(o, r), errors(bf16_twin(q, k, v, **kw), r)
    floor = 4 * F32_EPS * float(np.max(np.abs(v[np.isfinite(v)].astype(np.float64)), initial=0.0))
    assert km <= EMUL_MAX_RATIO * em + floor, (km, em)
    assert ka <= EMUL_MEAN_RATIO * ea + floor, (ka, ea)
    return o


def assert_p_rounding_bound(q, k, v, **kw):
    """Each output element (float32 inputs, 4-D bhsd) within what rounding every p to bf16 can
    cost over the rounded inputs, ``o = sum p~ v / sum p`` with ``|p~ - p| <= 2^-8 p``: at most
    2^-8 (w @ |v|) (w the weights), plus float32's own error (the exp's 2.9e-6, and the scores'
    rounding: ``check_dense``'s conditioning floor). Deterministic, unlike the ratio of two
    roundings, so it holds on a few keys too. The rounded q is the kernel's (``kernel_query``):
    next to a bf16 tie it may be round(q)'s neighbour, a difference this bound does not cover.
    Returns the output."""
    o, r = _against_rounded(q, k, v, kw)
    qb, kb, vb = kernel_query(q, kw.get("scale")), rounded_bf16(k), rounded_bf16(v)
    ro, rl = ref.attention(qb, kb, vb, out_dtype=np.float64, return_lse=True, **kw)
    c = dense_views([qb, kb, vb], o, rl, ro, rl, layout="bhsd", rank=4, kw=kw)
    w = ref.attention_weights(qb, kb, **{n: a for n, a in kw.items() if n != "out_dtype"})
    av = np.abs(np.where(np.isfinite(c.v4), c.v4, 0.0))
    bound = w @ np.repeat(av, q.shape[1] // k.shape[1], axis=1)
    cond = conditioning(c.q4, c.k4, c.visible, c.scale, kw.get("alibi_slopes"), c.pos, c.additive)
    tol = (2.0**-8 + 2.0**-16) * bound + 8 * F32_EPS * cond * c.v_max + 4 * F32_EPS * c.v_max
    fin = np.isfinite(r)
    err = np.abs(o.astype(np.float64) - np.where(fin, r, 0.0))
    assert np.all((err <= tol)[fin]), float(np.max((err - tol)[fin]))
    return o
