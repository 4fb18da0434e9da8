"""Shared fixtures for the kernel tests: the instruction sets to run on, a seeded random
generator, hypothesis profiles, and ``check_attention``, which holds a kernel to the float64
reference with a tolerance that follows the dtype (see ``attention_tolerance``).

Environment:
  ATTNX_TEST_SEED           seed of every random test (default 0); printed in the header
  ATTNX_ISA                 scalar | avx2 | avx512 | avx512bf16 | amx | neon | auto: run the kernel
                            tests on that path only
  ATTNX_HYPOTHESIS_PROFILE  "ci" (default) or "soak" (many more examples)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import attnx
from attnx import reference as ref

SEED = int(os.environ.get("ATTNX_TEST_SEED", "0"))
BF16 = np.dtype(ml_dtypes.bfloat16)
F32_EPS = float(np.finfo(np.float32).eps)

settings.register_profile("ci", deadline=None, max_examples=40, database=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("soak", deadline=None, max_examples=2000, database=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow])
HYPOTHESIS_PROFILE = os.environ.get("ATTNX_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


# ---------------------------------------------------------------------------
# instruction sets
# ---------------------------------------------------------------------------


def supported_isas():
    """The kernel paths this CPU can run, from its flags (not from the dispatcher's opinion).

    With ``ATTNX_ISA`` set, only that path (``auto``: the one it selected): a run forced to a
    path tests that path alone.
    """
    forced = os.environ.get("ATTNX_ISA", "").strip()
    if forced:
        return [attnx.cpu_features()["isa"] if forced == "auto" else forced]
    f = attnx.cpu_features()
    isas = ["scalar"]
    if f.get("neon"):  # aarch64: Advanced SIMD, the baseline there
        isas.append("neon")
    if f["avx2"] and f["fma"] and f["f16c"]:
        isas.append("avx2")
        if f["avx512f"]:
            isas.append("avx512")
            if has_avx512bf16(f):
                isas.append("avx512bf16")
                if has_amx(f):
                    isas.append("amx")
    return isas


def has_avx512bf16(f=None):
    """Whether the CPU can run the avx512bf16 path (AVX512_BF16, with AVX-512F/BW/VL/VNNI)."""
    f = attnx.cpu_features() if f is None else f
    return all(f.get(k) for k in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                  "avx512bf16", "avx512_vnni"))


def has_amx(f=None):
    """Whether the CPU can run the amx path (AMX-BF16 granted by the OS, and AVX512_BF16)."""
    f = attnx.cpu_features() if f is None else f
    return has_avx512bf16(f) and bool(f.get("amx_bf16")) and bool(f.get("amx_permitted"))


# The paths that compute bf16 prefill with bf16 products (and round P to bf16 before P V).
BF16_PRODUCT_ISAS = ("avx512bf16", "amx")
# dispatch.cpp's kBf16DotGain: the avx512bf16 path is the default only where vdpbf16ps gives
# more multiply-adds per second than float32 FMAs by this factor.
BF16_DOT_GAIN = 1.25

ISAS = supported_isas()


def best_isa():
    """The fastest path this CPU has, whatever ATTNX_ISA says: AMX where granted, else the bf16
    dot products where they measure faster than float32 FMAs, else the widest vectors."""
    f = attnx.cpu_features()
    if f.get("neon"):
        return "neon"
    if f["avx2"] and f["fma"] and f["f16c"]:
        if has_amx(f):
            return "amx"
        if has_avx512bf16(f) and attnx._core.bf16_dot_gain() > BF16_DOT_GAIN:
            return "avx512bf16"
        return "avx512" if f["avx512f"] else "avx2"
    return "scalar"


@pytest.fixture(params=ISAS, ids=ISAS)
def isa(request):
    """Runs the test on one kernel path, restoring the active one afterwards."""
    previous = attnx.cpu_features()["isa"]
    attnx._core.set_isa(request.param)
    assert attnx.cpu_features()["isa"] == request.param
    try:
        yield request.param
    finally:
        attnx._core.set_isa(previous)


def make_rng(*salt):
    """A generator seeded by ATTNX_TEST_SEED and ``salt`` (any repr-able values): for data drawn
    outside a test function (module constants, helpers, hypothesis-driven draws)."""
    return np.random.default_rng([SEED, zlib.crc32(repr(salt).encode())])


# Per-16-key climbs of the scores for the lazy running max (kernel-inl.h kLazyMax = 4): below,
# near and above the slack, and far above it.
RISES = [0.05, 2.0, 3.9, 4.1, 60.0]


def climbing_scores(rng, rise, dtype):
    """q, k, v (1, 2, 20, 256, 8) whose scores at scale 1 climb about `rise` every 16 keys, with
    noise: prefill rows whose running max must follow them across fused tiles."""
    B, H, Sq, Sk, D = 1, 2, 20, 256, 8
    q = 1 + 0.1 * rng.standard_normal((B, H, Sq, D))
    k = (rise / 16 / D) * np.arange(Sk)[:, None] + 0.05 * rng.standard_normal((B, H, Sk, D))
    v = rng.standard_normal((B, H, Sk, D))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@pytest.fixture
def rng(request):
    """A generator seeded by ATTNX_TEST_SEED and the test's id: reproducible, and different
    tests (and parameters) draw different data."""
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


def pytest_report_header(config):
    return [f"attnx: ATTNX_TEST_SEED={SEED}, ISAs under test={ISAS} "
            f"(active {attnx.cpu_features()['isa']}), threads={attnx.get_num_threads()}, "
            f"hypothesis profile={HYPOTHESIS_PROFILE}"]


# ---------------------------------------------------------------------------
# layouts and ranks, written independently of attnx._api and attnx.reference
# ---------------------------------------------------------------------------


def to4(x, layout, rank):
    """A user array of this layout and rank as a (B, H, S, D) view."""
    x = np.asarray(x)
    if rank == 2:
        return x[None, None]
    if rank == 3:
        x = x[None]
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def from4(x4, layout, rank):
    """Inverse of ``to4``: a (B, H, S, D) array as the user's layout and rank."""
    if layout == "bshd":
        x4 = x4.transpose(0, 2, 1, 3)
    if rank == 4:
        return x4
    if rank == 3:
        return x4[0]
    return x4[0, 0] if layout == "bhsd" else x4[0, :, 0]


def lse4(lse, rank):
    return lse[None, None] if rank == 2 else lse[None] if rank == 3 else lse


def rand(rng, shape, dtype=np.float32):
    """Standard normal values stored in ``dtype``."""
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------
# the same-precision reference and the tolerance
# ---------------------------------------------------------------------------


def lowp_attention(q4, k4, v4, visible, *, scale, softcap=None, alibi=None, additive=None,
                   sinks=None, pos=None, storage=np.float32, round_p=False):
    """Textbook attention in float32 (no tiling, no online softmax), rounded to ``storage``.
    With ``round_p``, the probabilities exp(s - max) are rounded to bfloat16 before P V (their
    sum is not): what the avx512bf16 path does on bf16 inputs (``bf16_rounds_p``).

    It is what a straightforward same-precision implementation gets, so its distance to the
    float64 reference measures the error that float32 compute and ``storage`` output cost on
    *these* inputs.  Both products are summed one term at a time (multiply, round, add, round),
    the least accurate order a legitimate kernel may use (a scalar loop over d, or over the
    keys of a tile); a BLAS GEMM sums in blocks and would set the bar too high for a plain
    scalar path.  ``visible`` (B, Hq, Sq, Sk) comes from the reference: this function only
    redoes the arithmetic.  Non-finite values are zeroed (NaN handling is checked elsewhere,
    against the reference itself).
    """
    f = np.float32
    B, Hq, Sq, _ = q4.shape
    G = Hq // k4.shape[1]
    fin = lambda a: np.where(np.isfinite(a), a, 0).astype(f)  # noqa: E731
    q, k, v = fin(q4), np.repeat(fin(k4), G, axis=1), np.repeat(fin(v4), G, axis=1)
    with np.errstate(all="ignore"):
        s = np.zeros(q.shape[:3] + (k.shape[2],), f)
        for d in range(q.shape[3]):
            s += q[:, :, :, d, None] * k[:, :, None, :, d]
        s *= f(scale)
        if softcap is not None:
            s = f(softcap) * np.tanh(s / f(softcap))
        if alibi is not None:
            dist = np.abs(pos[:, None, :, None] - np.arange(k4.shape[2])[None, None, None, :])
            s = s - np.asarray(alibi, f)[None, :, None, None] * dist.astype(f)
        if additive is not None:
            s = s + additive.astype(f)
        s = np.where(visible, s, f(-np.inf))
        m = s.max(axis=-1, initial=-np.inf)
        if sinks is not None:
            m = np.maximum(m, np.asarray(sinks, f)[None, :, None])
        m = np.where(np.isfinite(m), m, f(0))
        e = np.where(visible, np.exp(s - m[..., None]), f(0))
        l = e.sum(axis=-1, dtype=f)
        if sinks is not None:
            l = l + np.exp(np.asarray(sinks, f)[None, :, None] - m)
        pe = e.astype(BF16).astype(f) if round_p else e
        out = np.zeros(e.shape[:3] + (v.shape[3],), f)
        for j in range(v.shape[2]):
            out += pe[:, :, :, j, None] * v[:, :, None, j, :]
        out /= np.where(l > 0, l, f(1))[..., None]
        lse = np.where(l > 0, m + np.log(l), f(-np.inf))
    return out.astype(storage).astype(np.float64), lse.astype(np.float64)


def attention_tolerance(ref_out, lp_out, ref_lse, lp_lse, *, storage, v_max):
    """(tol_out, tol_lse): how far the kernel may sit from the float64 reference.

    flash-attention's rule, adapted: the kernel must be within 3x the error of a
    same-precision implementation (``lowp_attention``: float32 compute, output stored in the
    kernel's dtype) on the same inputs, both measured against float64.  That makes the bound
    follow the dtype and the problem instead of being guessed:

    * float32: the same-precision error is float32 rounding in the QK dot products (grows with
      Dk and |q||k|), in exp, and in the sum over Sk keys (grows with Sk), each summed in the
      least accurate legitimate order (see ``lowp_attention``).  A tiled kernel with
      an online softmax rescales its running sum once per tile, which costs a few more ulps:
      3x covers that with room, while a real bug (a dropped key, a wrong scale, an off-by-one
      mask) costs orders of magnitude more (``test_tolerance_is_tight`` checks that).
    * float16 / bfloat16: inputs are exact in float32, so the reference is evaluated on the
      SAME low-precision inputs and input rounding is not measured.  The same-precision error
      is then dominated by the final rounding to storage (<= 1/2 ulp); the kernel may land on
      the other side of a rounding boundary (1 ulp), which 3 x 1/2 ulp covers.
    * the avx512bf16 path on bf16 inputs rounds P to bf16 before P V (a relative 2^-9 per
      weight): its twin rounds P too (``bf16_rounds_p``). Where the output cancels (weights on
      values of both signs) that error exceeds the output's own rounding: a soak run found a
      row at 0.099 from values up to 2.7 whose P rounding cost 1.01x the tolerance without it.
      tests/kernels/test_bf16_dot.py holds that path to the stricter flash rule besides.
    * floors, for the lucky cases where the same-precision error is ~0 (one key, where the
      output is a copy of v): one ulp of the storage dtype at the largest output, plus one
      float32 ulp of the largest |v|.  Both are far below any structural error.

    lse is float32 in every dtype: same rule, floor 4 float32 ulps of max(1, |lse|).
    """
    eps = float(ml_dtypes.finfo(storage).eps)  # ulp at 1.0: 2^-23, 2^-10 (f16), 2^-7 (bf16)
    fo = np.isfinite(ref_out)
    out_scale = float(np.max(np.abs(ref_out[fo]), initial=0.0))
    both = fo & np.isfinite(lp_out)
    lp_err = float(np.max(np.abs(lp_out[both] - ref_out[both]), initial=0.0))
    tol_out = 3 * lp_err + eps * out_scale + F32_EPS * v_max
    fl = np.isfinite(ref_lse) & np.isfinite(lp_lse)
    lp_lse_err = float(np.max(np.abs(lp_lse[fl] - ref_lse[fl]), initial=0.0))
    lse_scale = max(1.0, float(np.max(np.abs(ref_lse[fl]), initial=0.0)))
    tol_lse = 3 * lp_lse_err + 4 * F32_EPS * lse_scale
    return tol_out, tol_lse


def _structure4(q4, k4, *, mask, kv_lens, q_lens, rank):
    """Lengths, row positions and the additive mask as 4-D float64, for lowp_attention."""
    B, Hq, Sq, _ = q4.shape
    Sk = k4.shape[2]
    kvl = np.full(B, Sk) if kv_lens is None else np.reshape(np.asarray(kv_lens), (B,))
    ql = np.full(B, Sq) if q_lens is None else np.reshape(np.asarray(q_lens), (B,))
    pos = np.arange(Sq)[None, :] + (kvl - ql)[:, None]  # (B, Sq)
    additive = None
    if mask is not None and np.asarray(mask).dtype != np.bool_:
        logical = (B, Hq, Sq, Sk)[4 - rank:]
        additive = np.broadcast_to(np.asarray(mask).astype(np.float64), logical)
        additive = additive.reshape((B, Hq, Sq, Sk))
    return pos, additive


def bf16_rounds_p(q, k, v):
    """Whether the active path may round P to bf16 before P V on these inputs: avx512bf16 or amx
    with q, k and v all bf16 (their prefill-shaped calls do, as FlashAttention and torch's bf16
    SDPA do; README "dtypes"). Its same-precision twin then rounds P too."""
    return (attnx.cpu_features()["isa"] in BF16_PRODUCT_ISAS
            and all(np.asarray(x).dtype == BF16 for x in (q, k, v)))


def dense_views(before, o, lse, ref_out, ref_lse, *, layout, rank, kw):
    """What a dense comparison needs, as float64 (B, H, S, D) arrays: the inputs (q4, k4, v4),
    kernel and reference outputs (o4, r4) and lse (l4, rl4), the visible (row, key) pairs, the
    scale, positions and additive mask, the same-precision twin (lp_out, lp_lse), and the largest
    finite |v| (v_max)."""
    wkw = {key: kw[key] for key in ("causal", "mask", "kv_lens", "q_lens", "scale", "window",
                                    "softcap", "sinks", "alibi_slopes") if key in kw}
    weights = ref.attention_weights(before[0], before[1], layout=layout, **wkw)
    q4, k4, v4 = (to4(x, layout, rank).astype(np.float64) for x in before)
    visible = lse4(weights, rank) != 0
    scale = kw.get("scale") or 1.0 / np.sqrt(q4.shape[3])
    pos, additive = _structure4(q4, k4, mask=kw.get("mask"), kv_lens=kw.get("kv_lens"),
                                q_lens=kw.get("q_lens"), rank=rank)
    lp_out, lp_lse = lowp_attention(q4, k4, v4, visible, scale=scale, softcap=kw.get("softcap"),
                                    alibi=kw.get("alibi_slopes"), additive=additive,
                                    sinks=kw.get("sinks"), pos=pos, storage=before[0].dtype,
                                    round_p=bf16_rounds_p(*before))
    return types.SimpleNamespace(
        q4=q4, k4=k4, v4=v4, o4=to4(o, layout, rank).astype(np.float64),
        r4=to4(ref_out, layout, rank), l4=lse4(lse, rank).astype(np.float64),
        rl4=lse4(ref_lse, rank).astype(np.float64), visible=visible, scale=scale, pos=pos,
        additive=additive, lp_out=lp_out, lp_lse=lp_lse,
        v_max=float(np.max(np.abs(v4[np.isfinite(v4)]), initial=0.0)))


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
    res = attnx.attention(q, k, v, layout=layout, return_lse=True, out=out,
                          num_threads=num_threads, **kw)
    assert isinstance(res, tuple) and len(res) == 2
    o, lse = res
    if out is not None:
        assert o is out
    for x, x0 in zip((q, k, v), before):
        if not (out is not None and np.may_share_memory(out, x)):
            np.testing.assert_array_equal(x, x0, err_msg="the kernel modified an input")

    ref_out, ref_lse = ref.attention(*before, layout=layout, return_lse=True,
                                     out_dtype=np.float64, **kw)
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


def scramble_tables(rng, seq_lens, block_size, num_blocks, width, fill, dtype=np.int32):
    """Block tables ``(B, width)`` (int32 unless ``dtype``) that give each sequence its blocks from a random
    permutation of the pool (FlashInfer's and flash-attention's scrambled pages; columns past a
    sequence's blocks hold ``fill``), and ``owned (num_blocks, block_size)``: the slots some
    sequence holds, so a test can poison every other slot."""
    need = -(-np.asarray(seq_lens, np.int64) // block_size)
    owned = np.zeros((num_blocks, block_size), dtype=bool)
    perm = rng.permutation(num_blocks)
    tables = np.full((len(need), max(width, 1)), fill, dtype=dtype)
    at = 0
    for b, (n, length) in enumerate(zip(need, seq_lens)):
        ids = perm[at:at + n]
        at += n
        tables[b, :n] = ids
        for j, blk in enumerate(ids):
            owned[blk, :min(block_size, length - j * block_size)] = True
    return tables, owned


def assert_matches(o, r, lse, rlse, visible, tol_out, tol_lse):
    """The kernel's (out, lse) against the reference's, as float64 arrays of one shape: NaN and
    inf exactly where the reference has them (NaN reaches only the rows that see it), finite
    values within the tolerances, rows that see nothing exactly 0 with lse exactly -inf."""
    np.testing.assert_array_equal(np.isnan(o), np.isnan(r), err_msg="NaN pattern differs")
    fin = np.isfinite(r)
    np.testing.assert_array_equal(o[~fin], r[~fin], err_msg="inf/NaN values differ")
    err = float(np.max(np.abs(o[fin] - r[fin]), initial=0.0))
    assert err <= tol_out, f"out: max error {err:.3g} > tolerance {tol_out:.3g}"
    empty = ~visible.any(axis=-1)
    assert np.all(o[empty] == 0), "a row that sees no key is not exactly zero"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse), err_msg="lse -inf pattern")
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(rlse), err_msg="lse NaN pattern")
    fl = np.isfinite(rlse)
    err_lse = float(np.max(np.abs(lse[fl] - rlse[fl]), initial=0.0))
    assert err_lse <= tol_lse, f"lse: max error {err_lse:.3g} > tolerance {tol_lse:.3g}"


# ---------------------------------------------------------------------------
# gated delta rule: the float32 recurrence as yardstick, and the tolerance rule
# ---------------------------------------------------------------------------

DELTA_ERR_FACTOR = 4.0  # x the float32 recurrence's own error
DELTA_ULPS_STATE = 16.0  # float32 ulps of the largest state value: the floor of an output's error
DELTA_ULPS = 64.0  # float32 ulps of the largest reference value, one per token of a chunk: the
#                    chunked form reassociates sums over up to 64 tokens (a triangular solve)


def delta_tolerance(ref64, low32):
    """Tolerance for a delta-rule result (output or state) whose float64 reference is ``ref64``
    and whose plain float32 recurrence (rounded to the output dtype) is ``low32``: DELTA_ERR_FACTOR
    times the float32 recurrence's own error, plus DELTA_ULPS float32 ulps of the largest value.
    So the bound follows the dtype (bf16 outputs: their rounding) instead of being guessed."""
    scale = float(np.max(np.abs(ref64), initial=0.0))
    own = float(np.max(np.abs(low32 - ref64), initial=0.0))
    return DELTA_ERR_FACTOR * own + DELTA_ULPS * F32_EPS * scale


def delta_expected(q, k, v, g, beta, **kw):
    """What a gated_delta_rule call with these arguments (``_mode`` and ``num_threads`` aside)
    is held to: the float64 recurrence's output and final state, and the float32 recurrence's
    (the output rounded to q's dtype), which sets the tolerance. Four float64 arrays."""
    from attnx._delta_args import delta_args, from_bshd

    kw = {key: x for key, x in kw.items() if key not in ("_mode", "num_threads")}
    ro, rs = ref.gated_delta_rule(q, k, v, g, beta, output_final_state=True, out_dtype=np.float64, **kw)
    args = delta_args(q, k, v, g, beta, scale=kw.get("scale"), initial_state=kw.get("initial_state"),
                      layout=kw.get("layout", "bshd"), cu_seqlens=kw.get("cu_seqlens"),
                      lengths=kw.get("lengths"))
    lo, ls = ref._delta_recurrence(args, qk_l2norm=kw.get("qk_l2norm", False), dtype=np.float32)
    lo = from_bshd(ref._round_to(lo.astype(np.float64), q.dtype).astype(np.float64), kw.get("layout", "bshd"))
    return ro, rs.astype(np.float64), lo, ls.astype(np.float64)


def assert_delta_matches(o, state, expected):
    """o and state against ``delta_expected``: inf/NaN exactly where the float64 recurrence has
    them (a non-finite gate or beta reaches its own position and the later ones, nothing
    before), the finite entries within ``delta_tolerance``."""
    ro, rs, lo, ls = expected
    # An output is a dot product of a state row with q: where its terms cancel (a tiny output
    # from a state of ordinary size), float32 rounding is relative to the terms, not to the
    # output, and another summation order than the float32 twin's may land DELTA_ULPS_STATE ulps
    # of the state away (hypothesis found 1e-9 on an output of 2.8e-5 from a state of 0.12).
    state_scale = float(np.max(np.abs(rs[np.isfinite(rs)]), initial=0.0))
    for name, x, r, low in (("out", o, ro, lo), ("state", state, rs, ls)):
        x = np.asarray(x, dtype=np.float64)
        fin = np.isfinite(r)
        np.testing.assert_array_equal(np.isfinite(x), fin, err_msg=f"{name}: inf/NaN pattern")
        err = float(np.max(np.abs(x[fin] - r[fin]), initial=0.0))
        both = fin & np.isfinite(low)
        tol = delta_tolerance(r[both], low[both])
        if name == "out":
            tol = max(tol, DELTA_ULPS_STATE * F32_EPS * state_scale)
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"


def check_delta_rule(q, k, v, g, beta, **kw):
    """attnx.gated_delta_rule against the float64 recurrence (output and final state; see
    ``assert_delta_matches``); returns the kernel's (o, state)."""
    o, state = attnx.gated_delta_rule(q, k, v, g, beta, output_final_state=True, **kw)
    expected = delta_expected(q, k, v, g, beta, **kw)
    assert o.dtype == q.dtype and o.shape == expected[0].shape, (o.dtype, o.shape, expected[0].shape)
    assert state.dtype == np.float32 and state.shape == expected[1].shape
    assert_delta_matches(o, state, expected)
    return o, state


def run_isolated(code, *, env=None, timeout=120):
    """Runs ``code`` in a fresh interpreter (its own session) and returns the JSON it prints last.
    A hang kills the whole process group, forked children included, and fails the test."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"hung: no result within {timeout} s")
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])
