"""Dense and paged calls held to attnx.reference: ``check_attention`` (the kernel tests' check),
``check_dense`` and ``check_paged`` (the same rules with a conditioning floor, for the fuzz and
the numerics at the edges, and any memory layout or byte order)."""

from __future__ import annotations

import types

import numpy as np

import attnx
from attnx import reference as ref

from helpers.data import F32_EPS
from helpers.layouts import lse4, to4
from helpers.tolerance import (
    assert_matches,
    attention_tolerance,
    bf16_rounds_p,
    conditioning,
    lowp_attention,
)


def _structure4(q4, k4, *, mask, kv_lens, q_lens, rank):
    """Lengths, row positions and the additive mask as 4-D float64, for lowp_attention."""
    B, Hq, Sq, _ = q4.shape
    Sk = k4.shape[2]
    kvl = np.full(B, Sk) if kv_lens is None else np.reshape(np.asarray(kv_lens), (B,))
    ql = np.full(B, Sq) if q_lens is None else np.reshape(np.asarray(q_lens), (B,))
    pos = np.arange(Sq)[None, :] + (kvl - ql)[:, None]  # (B, Sq)
    additive = None
    if mask is not None and np.asarray(mask).dtype != np.bool_:
        logical = (B, Hq, Sq, Sk)[4 - rank :]
        additive = np.broadcast_to(np.asarray(mask).astype(np.float64), logical)
        additive = additive.reshape((B, Hq, Sq, Sk))
    return pos, additive


def dense_views(before, o, lse, ref_out, ref_lse, *, layout, rank, kw):
    """What a dense comparison needs, as float64 (B, H, S, D) arrays: the inputs (q4, k4, v4),
    kernel and reference outputs (o4, r4) and lse (l4, rl4), the visible (row, key) pairs, the
    scale, positions and additive mask, the same-precision twin (lp_out, lp_lse), and the largest
    finite |v| (v_max)."""
    wkw = {
        key: kw[key]
        for key in (
            "causal",
            "mask",
            "kv_lens",
            "q_lens",
            "scale",
            "window",
            "softcap",
            "sinks",
            "alibi_slopes",
        )
        if key in kw
    }
    weights = ref.attention_weights(before[0], before[1], layout=layout, **wkw)
    q4, k4, v4 = (to4(x, layout, rank).astype(np.float64) for x in before)
    visible = lse4(weights, rank) != 0
    scale = kw.get("scale") or 1.0 / np.sqrt(q4.shape[3])
    pos, additive = _structure4(
        q4, k4, mask=kw.get("mask"), kv_lens=kw.get("kv_lens"), q_lens=kw.get("q_lens"), rank=rank
    )
    lp_out, lp_lse = lowp_attention(
        q4,
        k4,
        v4,
        visible,
        scale=scale,
        softcap=kw.get("softcap"),
        alibi=kw.get("alibi_slopes"),
        additive=additive,
        sinks=kw.get("sinks"),
        pos=pos,
        storage=before[0].dtype,
        round_p=bf16_rounds_p(*before),
    )
    return types.SimpleNamespace(
        q4=q4,
        k4=k4,
        v4=v4,
        o4=to4(o, layout, rank).astype(np.float64),
        r4=to4(ref_out, layout, rank),
        l4=lse4(lse, rank).astype(np.float64),
        rl4=lse4(ref_lse, rank).astype(np.float64),
        visible=visible,
        scale=scale,
        pos=pos,
        additive=additive,
        lp_out=lp_out,
        lp_lse=lp_lse,
        v_max=float(np.max(np.abs(v4[np.isfinite(v4)]), initial=0.0)),
    )


def check_attention(q, k, v, *, layout="bhsd", out=None, expect_nan=False, **kw):
    """Runs ``attnx.attention`` (with return_lse) and holds it to ``attnx.reference``.

    Checks: shapes and dtypes; inputs left untouched; output within ``attention_tolerance``;
    lse likewise, with -inf exactly where the reference has -inf; rows that see no key exactly
    zero; NaN exactly where the reference has NaN.  Returns (out, lse) of the kernel.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    rank = q.ndim
    before = [x.copy() for x in (q, k, v)]
    num_threads = kw.pop("num_threads", None)  # kernel only
    res = attnx.attention(
        q, k, v, layout=layout, return_lse=True, out=out, num_threads=num_threads, **kw
    )
    assert isinstance(res, tuple) and len(res) == 2
    o, lse = res
    if out is not None:
        assert o is out
    for x, x0 in zip((q, k, v), before):
        if not (out is not None and np.may_share_memory(out, x)):
            np.testing.assert_array_equal(x, x0, err_msg="the kernel modified an input")

    ref_out, ref_lse = ref.attention(
        *before, layout=layout, return_lse=True, out_dtype=np.float64, **kw
    )
    assert o.shape == ref_out.shape, (o.shape, ref_out.shape)
    assert o.dtype == q.dtype
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape, (lse.dtype, lse.shape)

    c = dense_views(before, o, lse, ref_out, ref_lse, layout=layout, rank=rank, kw=kw)
    o4, r4, l4, rl4, visible = c.o4, c.r4, c.l4, c.rl4, c.visible
    lp_out, lp_lse, v_max = c.lp_out, c.lp_lse, c.v_max
    tol_out, tol_lse = attention_tolerance(r4, lp_out, rl4, lp_lse, storage=q.dtype, v_max=v_max)

    if not expect_nan:
        assert not np.isnan(r4).any()
    assert_matches(o4, r4, l4, rl4, visible, tol_out, tol_lse)
    return o, lse


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    )


def native(x):
    """A copy of ``x`` in native byte order (the reference refuses byte-swapped dtypes)."""
    return np.array(x, dtype=x.dtype.newbyteorder("="), copy=True)


def check_dense(q, k, v, *, layout, out=None, **kw):
    """``check_attention`` with the conditioning floor: runs ``attnx.attention`` with
    return_lse and holds it to ``attnx.reference.attention``."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    rank = q.ndim
    before = [x.copy() for x in (q, k, v)]
    num_threads = kw.pop("num_threads", None)
    call_kw = kw  # (the reference gets copies in native byte order, taken before the call)
    kw = {n: native(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    o, lse = attnx.attention(
        q, k, v, layout=layout, return_lse=True, out=out, num_threads=num_threads, **call_kw
    )
    if out is not None:
        assert o is out
    for x, x0 in zip((q, k, v), before):
        if not (out is not None and np.may_share_memory(out, x)):
            assert same_bits(x, x0), "the kernel modified an input"
    before = [native(x) for x in before]
    ref_out, ref_lse = ref.attention(
        *before, layout=layout, return_lse=True, out_dtype=np.float64, **kw
    )
    assert o.shape == ref_out.shape and o.dtype == q.dtype.newbyteorder("=")  # (native order)
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape
    c = dense_views(before, o, lse, ref_out, ref_lse, layout=layout, rank=rank, kw=kw)
    cond = conditioning(c.q4, c.k4, c.visible, c.scale, kw.get("alibi_slopes"), c.pos, c.additive)
    compare(
        c.o4,
        c.r4,
        c.l4,
        c.rl4,
        c.lp_out,
        c.lp_lse,
        c.visible,
        storage=before[0].dtype,
        v_max=c.v_max,
        cond=cond,
    )
    return o, lse


def compare(o, r, lse, rlse, lp_out, lp_lse, visible, *, storage, v_max, cond):
    """The assertions of check_attention (float64 arrays of one shape)."""
    tol_out, tol_lse = attention_tolerance(r, lp_out, rlse, lp_lse, storage=storage, v_max=v_max)
    tol_lse += 4 * F32_EPS * cond
    tol_out += 8 * F32_EPS * cond * v_max
    assert_matches(o, r, lse, rlse, visible, tol_out, tol_lse)


def _dense_twin(q, k_pages, v_pages, tables, seq_lens, q_lens, bs):
    """The paged problem as a padded dense one, float64 (B, H, S, D), for the tolerance."""
    B = len(seq_lens)
    Hq, Dk = q.shape[1], q.shape[2]
    Hkv, Dv = k_pages.shape[1], v_pages.shape[3]
    Sq, Sk = max(1, int(q_lens.max(initial=0))), max(1, int(seq_lens.max(initial=0)))
    q4 = np.zeros((B, Hq, Sq, Dk))
    k4 = np.zeros((B, Hkv, Sk, Dk))
    v4 = np.zeros((B, Hkv, Sk, Dv))
    start = np.concatenate([[0], np.cumsum(q_lens)])
    for b in range(B):
        n, L = int(q_lens[b]), int(seq_lens[b])
        q4[b, :, :n] = q[start[b] : start[b] + n].astype(np.float64).transpose(1, 0, 2)
        ids = np.asarray(tables[b, : -(-L // bs)], np.int64)
        for kv4, pages in ((k4, k_pages), (v4, v_pages)):
            rows = (
                pages[ids].astype(np.float64).transpose(1, 0, 2, 3).reshape(Hkv, -1, pages.shape[3])
            )
            kv4[b, :, :L] = rows[:, :L]
    return q4, k4, v4, start


def _run_paged(q, kp, vp, tables, call_lens, *, out, num_threads, kw):
    """Calls ``attnx.paged_attention`` with return_lse and the lengths as the caller gave them;
    checks that it returned ``out`` when given one and left its inputs' bits alone (except an
    input ``out`` overlaps). Returns (out, lse, copies of the inputs as the call read them)."""
    before = [x.copy() for x in (q, kp, vp, tables)]
    o, lse = attnx.paged_attention(
        q,
        kp,
        vp,
        tables,
        call_lens[0],
        out=out,
        return_lse=True,
        num_threads=num_threads,
        **call_lens[1],
        **kw,
    )
    if out is not None:
        assert o is out
    for x, x0 in zip((q, kp, vp, tables), before):
        if not (out is not None and np.may_share_memory(out, x)):
            assert same_bits(x, x0), "paged_attention modified an input"
    return o, lse, before


def _paged_lowp_twin(q, kp, vp, tables, seq_lens, q_lens, kw):
    """The paged problem written densely (padded, ``_dense_twin``) with what the tolerance of
    ``check_dense`` needs: the visible pairs (B, Hq, Sq, Sk), row positions, the scale, and
    ``lowp_attention``'s out and lse on it (padded 4-D)."""
    q4, k4, v4, _ = _dense_twin(q, kp, vp, tables, seq_lens, q_lens, kp.shape[2])
    scale = kw["scale"] or 1.0 / np.sqrt(q.shape[2])
    wkw = {key: kw[key] for key in ("causal", "window", "softcap", "sinks") if key in kw}
    w = ref.attention_weights(
        q4,
        k4,
        kv_lens=seq_lens,
        q_lens=q_lens,
        scale=scale,
        alibi_slopes=kw.get("alibi_slopes"),
        **wkw,
    )
    visible4 = w != 0
    pos = np.arange(q4.shape[2])[None, :] + (seq_lens - q_lens)[:, None]
    lp_o4, lp_l4 = lowp_attention(
        q4,
        k4,
        v4,
        visible4,
        scale=scale,
        softcap=kw["softcap"],
        alibi=kw.get("alibi_slopes"),
        sinks=kw.get("sinks"),
        pos=pos,
        storage=q.dtype,
        round_p=bf16_rounds_p(q, kp, vp),
    )
    return types.SimpleNamespace(
        q4=q4, k4=k4, v4=v4, visible4=visible4, pos=pos, scale=scale, lp_o4=lp_o4, lp_l4=lp_l4
    )


def _packed(x4, q_lens, n_seqs):
    """(B, H, Sq, ...) padded -> (N, H, ...) packed: sequence b's first q_lens[b] rows."""
    return np.concatenate(
        [np.moveaxis(x4[b, :, : int(q_lens[b])], 1, 0) for b in range(n_seqs)] or [x4[:0, :, :0]]
    )


def check_paged(
    q,
    kp,
    vp,
    tables,
    seq_lens,
    q_lens,
    *,
    out=None,
    num_threads=None,
    poisoned=True,
    decode=False,
    **kw,
):
    """Runs ``attnx.paged_attention`` (with return_lse) and holds it to
    ``attnx.reference.paged_attention`` by the rules of ``check_dense``. ``poisoned``: the pool's
    NaNs are all in slots no sequence owns, so the reference must come out NaN-free.
    ``decode``: call without q_lens (one token per sequence). Returns (out, lse)."""
    call_lens = (seq_lens, {} if decode else {"q_lens": q_lens})  # as given: any integer dtype
    q_lens = np.asarray(q_lens, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    lens_kw = {} if decode else {"q_lens": q_lens}
    N, Hq, Dk = q.shape
    Dv = vp.shape[3]
    kw.setdefault("causal", True)
    kw.setdefault("scale", None)
    kw.setdefault("softcap", None)
    o, lse, before = _run_paged(
        q, kp, vp, tables, call_lens, out=out, num_threads=num_threads, kw=kw
    )
    q, kp, vp, tables = (native(x) for x in before)  # what the call read, for the reference
    assert o.shape == (N, Hq, Dv) and o.dtype == q.dtype
    assert lse.shape == (N, Hq) and lse.dtype == np.float32
    ro, rl = ref.paged_attention(
        q, kp, vp, tables, seq_lens, return_lse=True, out_dtype=np.float64, **lens_kw, **kw
    )
    if poisoned:
        assert not np.isnan(ro).any(), "the reference read a poisoned slot"
    # the tolerance of check_dense, on the same problem written densely (padded)
    tw = _paged_lowp_twin(q, kp, vp, tables, seq_lens, q_lens, kw)
    B = len(seq_lens)
    visible = _packed(tw.visible4, q_lens, B) if N else np.zeros((0, Hq, 1), bool)
    cond = conditioning(tw.q4, tw.k4, tw.visible4, tw.scale, kw.get("alibi_slopes"), tw.pos)
    v_max = float(np.max(np.abs(tw.v4[np.isfinite(tw.v4)]), initial=0.0))
    compare(
        o.astype(np.float64),
        ro,
        lse.astype(np.float64),
        rl.astype(np.float64),
        _packed(tw.lp_o4, q_lens, B) if N else np.zeros_like(ro),
        _packed(tw.lp_l4, q_lens, B) if N else np.zeros_like(rl),
        visible,
        storage=q.dtype,
        v_max=v_max,
        cond=cond,
    )
    return o, lse
