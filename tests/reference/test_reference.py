"""Tests of attnx.reference, the executable definition of attention.

The reference is checked against ``naive``, an independent and deliberately
obvious scalar loop (pure Python floats and the ``math`` module), and against
the seed's worked examples.  The module is loaded by file path so these tests
run without the compiled core (``attnx._core``) being built.
"""

import importlib
import math
import pathlib
import sys
import types

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from helpers import BF16, SEED
from helpers import make_rng as rng  # rng(*salt): this file's name for it

# the reference package under a parent of its own whose __init__ never runs (so the core is not loaded)
_PKG = pathlib.Path(__file__).resolve().parents[2] / "python" / "attnx"
_parent = types.ModuleType("attnx_under_test")
_parent.__path__ = [str(_PKG)]
sys.modules["attnx_under_test"] = _parent
ref = importlib.import_module("attnx_under_test.reference")

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# the independent definition: a scalar loop
# ---------------------------------------------------------------------------


def _nested(shape, fill):
    """Nested lists of ``shape`` holding ``fill``."""
    if len(shape) == 1:
        return [fill] * shape[0]
    return [_nested(shape[1:], fill) for _ in range(shape[0])]


def _sees(pos, j, *, causal, window, mask_row, is_bool):
    """Whether the query at position ``pos`` sees key ``j``: causality, the window
    (left, right), then the mask row (a False or a -inf entry hides the key)."""
    if causal and j > pos:
        return False
    if window is not None:
        left, right = window
        if left is not None and j < pos - left:
            return False
        if right is not None and j > pos + right:
            return False
    if mask_row is not None:
        if is_bool and not mask_row[j]:
            return False
        if not is_bool and mask_row[j] == NEG_INF:
            return False
    return True


def _score(qrow, krow, *, scale, softcap, slope, dist, additive):
    """One logit: scale * (q . k), softcapped, less the ALiBi slope times the distance, plus the
    additive mask entry."""
    s = 0.0
    for d in range(len(qrow)):
        s += qrow[d] * krow[d]
    s = scale * s
    if softcap is not None:
        s = softcap * math.tanh(s / softcap)
    if slope is not None:
        s += -slope * dist
    if additive is not None:
        s += additive
    return s


def _softmax(scores, sink):
    """(lse, {key: weight}) over the logits ``scores`` ({key: logit}) and the sink's logit (a term
    of the sum that weighs no value); None where there is no logit at all."""
    logits = list(scores.values())
    if sink is not None:
        logits.append(sink)
    if not logits:
        return None
    top = max(logits)
    total = sum(math.exp(x - top) for x in logits)
    return top + math.log(total), {j: math.exp(s - top) / total for j, s in scores.items()}


def naive(
    q,
    k,
    v,
    *,
    causal=False,
    mask=None,
    kv_lens=None,
    q_lens=None,
    scale=None,
    window=None,
    softcap=None,
    sinks=None,
    alibi=None,
):
    """Scalar attention on 4-D bhsd float64 arrays.

    ``mask`` is None or already broadcast to (B, Hq, Sq, Sk), bool or additive.
    Returns (out (B,Hq,Sq,Dv), lse (B,Hq,Sq), weights (B,Hq,Sq,Sk)) as float64.
    """
    B, Hq, Sq, Dk = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(Dk)
    Q, K, V = q.tolist(), k.tolist(), v.tolist()
    M = None if mask is None else np.asarray(mask).tolist()
    is_bool = mask is not None and np.asarray(mask).dtype == bool
    out, lse = _nested((B, Hq, Sq, Dv), 0.0), _nested((B, Hq, Sq), NEG_INF)
    wts = _nested((B, Hq, Sq, Sk), 0.0)
    for b in range(B):
        Lk = Sk if kv_lens is None else int(kv_lens[b])
        Lq = Sq if q_lens is None else int(q_lens[b])
        off = Lk - Lq
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(Lq):  # rows >= Lq stay 0 / -inf
                mrow = None if M is None else M[b][h][i]
                scores = {}
                for j in range(Lk):
                    if _sees(
                        i + off, j, causal=causal, window=window, mask_row=mrow, is_bool=is_bool
                    ):
                        scores[j] = _score(
                            Q[b][h][i],
                            K[b][g][j],
                            scale=scale,
                            softcap=softcap,
                            slope=None if alibi is None else alibi[h],
                            dist=abs(i + off - j),
                            additive=None if M is None or is_bool else mrow[j],
                        )
                row = _softmax(scores, None if sinks is None else float(sinks[h]))
                if row is None:
                    continue
                lse[b][h][i], weights = row
                for j, w in weights.items():
                    wts[b][h][i][j] = w
                    for d in range(Dv):
                        out[b][h][i][d] += w * V[b][g][j][d]
    return np.array(out), np.array(lse), np.array(wts)


# ---------------------------------------------------------------------------
# layout / rank helpers (written independently of the reference)
# ---------------------------------------------------------------------------


def to_user(x4, layout, rank):
    """(B, H, S, D) -> the user's array for this layout and rank."""
    if layout == "bshd":
        x4 = np.transpose(x4, (0, 2, 1, 3))
    if rank == 4:
        return x4
    assert x4.shape[0] == 1
    if rank == 3:
        return x4[0]
    if layout == "bshd":  # (1, S, 1, D)
        assert x4.shape[2] == 1
        return x4[0, :, 0]
    assert x4.shape[1] == 1
    return x4[0, 0]


def from_user(x, layout, rank):
    """Inverse of to_user for outputs."""
    if rank == 2:
        return x[None, None]
    if rank == 3:
        x = x[None]
    return np.transpose(x, (0, 2, 1, 3)) if layout == "bshd" else x


def lead(x, rank):
    """Add back the implied leading axes of lse / weights."""
    if rank == 2:
        return x[None, None]
    if rank == 3:
        return x[None]
    return x


def mask_for_rank(m, rank):
    """Drop leading unit axes so a (..)-shaped mask fits the rank's logical shape."""
    while m.ndim > rank:
        assert m.shape[0] == 1
        m = m[0]
    return m


# ---------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------

# (id, B, Hq, Hkv, Sq, Sk, Dk, Dv, options); options build masks etc. from an rng
CASES = [
    ("plain", 2, 2, 2, 3, 5, 4, 4, {}),
    ("gqa", 1, 4, 2, 3, 3, 4, 4, {}),
    ("mqa", 2, 4, 1, 2, 6, 3, 3, {}),
    ("dk_ne_dv", 1, 2, 2, 4, 4, 5, 3, {}),
    ("single_head", 1, 1, 1, 4, 6, 3, 2, {"causal": True}),
    ("causal_sq_lt_sk", 1, 2, 2, 2, 5, 4, 4, {"causal": True}),
    ("causal_sq_eq_sk", 2, 2, 1, 4, 4, 4, 4, {"causal": True}),
    ("causal_sq_gt_sk", 1, 2, 2, 5, 3, 4, 4, {"causal": True}),
    ("bool_mask_2d", 2, 2, 2, 3, 4, 4, 4, {"mask": ("bool", (3, 4))}),
    ("bool_mask_heads_keys", 1, 4, 2, 3, 5, 4, 4, {"mask": ("bool", (1, 4, 1, 5))}),
    ("bool_mask_batch_rows", 2, 2, 2, 3, 4, 4, 4, {"mask": ("bool", (2, 1, 3, 1))}),
    ("add_mask_full", 2, 2, 2, 3, 4, 4, 4, {"mask": ("add", (2, 2, 3, 4))}),
    ("add_mask_keys", 1, 2, 1, 3, 6, 4, 2, {"mask": ("add", (6,))}),
    ("kv_lens", 2, 2, 2, 3, 5, 4, 4, {"kv_lens": [5, 2]}),
    ("kv_lens_zero", 2, 2, 2, 3, 5, 4, 4, {"kv_lens": [0, 3]}),
    ("q_lens", 2, 2, 2, 4, 5, 4, 4, {"q_lens": [4, 1]}),
    ("lens_causal", 2, 4, 2, 4, 6, 4, 3, {"kv_lens": [6, 3], "q_lens": [2, 4], "causal": True}),
    ("lens_causal_b1", 1, 2, 2, 4, 6, 4, 3, {"kv_lens": [5], "q_lens": [3], "causal": True}),
    ("window_left", 1, 2, 2, 5, 5, 4, 4, {"window": (1, 0)}),
    ("window_right", 1, 2, 2, 3, 6, 4, 4, {"window": (None, 1)}),
    ("window_causal", 2, 2, 2, 4, 6, 4, 4, {"window": (2, None), "causal": True}),
    ("window_both", 1, 1, 1, 5, 7, 3, 3, {"window": (1, 2)}),
    ("softcap", 1, 2, 2, 3, 4, 4, 4, {"softcap": 0.7}),
    ("sinks", 2, 2, 2, 3, 4, 4, 4, {"sinks": True}),
    ("sinks_fully_masked", 1, 2, 2, 4, 3, 4, 4, {"sinks": True, "causal": True}),
    ("alibi", 1, 2, 2, 3, 5, 4, 4, {"alibi": True, "causal": True}),
    ("scale", 1, 2, 2, 3, 4, 4, 4, {"scale": 0.3}),
    (
        "everything",
        2,
        4,
        2,
        4,
        6,
        4,
        3,
        {
            "causal": True,
            "mask": ("add", (2, 1, 4, 6)),
            "kv_lens": [6, 4],
            "q_lens": [3, 4],
            "window": (3, None),
            "softcap": 1.5,
            "sinks": True,
            "alibi": True,
        },
    ),
    (
        "everything_bool",
        1,
        2,
        1,
        5,
        5,
        3,
        2,
        {
            "causal": True,
            "mask": ("bool", (5, 5)),
            "kv_lens": [4],
            "q_lens": [4],
            "window": (2, 0),
            "softcap": 3.0,
            "sinks": True,
            "alibi": True,
            "scale": 0.8,
        },
    ),
]


def build(case, dtype=np.float64):
    """Random inputs for a case: 4-D bhsd arrays plus reference kwargs and the 4-D mask."""
    name, B, Hq, Hkv, Sq, Sk, Dk, Dv, opt = case
    r = rng(sum(map(ord, name)))
    q = r.standard_normal((B, Hq, Sq, Dk)).astype(dtype)
    k = r.standard_normal((B, Hkv, Sk, Dk)).astype(dtype)
    v = r.standard_normal((B, Hkv, Sk, Dv)).astype(dtype)
    kw = {}
    mask = None
    if "mask" in opt:
        kind, shape = opt["mask"]
        if kind == "bool":
            mask = r.random(shape) < 0.7
            mask.flat[0] = False  # at least one blocked entry
        else:
            mask = r.standard_normal(shape)
            mask[r.random(shape) < 0.3] = -np.inf
        kw["mask"] = mask
    for key in ("causal", "window", "softcap", "scale"):
        if key in opt:
            kw[key] = opt[key]
    for key in ("kv_lens", "q_lens"):
        if key in opt:
            kw[key] = np.array(opt[key])
    if opt.get("sinks"):
        kw["sinks"] = r.standard_normal(Hq)
    if opt.get("alibi"):
        kw["alibi_slopes"] = 2.0 ** -np.arange(1, Hq + 1)
    return q, k, v, kw


def naive_for(q, k, v, kw):
    mask = kw.get("mask")
    if mask is not None:
        mask = np.broadcast_to(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    nkw = {
        key: kw[key]
        for key in ("causal", "kv_lens", "q_lens", "scale", "window", "softcap", "sinks")
        if key in kw
    }
    return naive(
        q.astype(np.float64),
        k.astype(np.float64),
        v.astype(np.float64),
        mask=mask,
        alibi=kw.get("alibi_slopes"),
        **nkw,
    )


def user_kwargs(kw, rank, variant):
    """Adapt kwargs to a lower rank: masks lose leading axes, lens may be plain ints."""
    kw = dict(kw)
    if "mask" in kw:
        kw["mask"] = mask_for_rank(np.asarray(kw["mask"]), rank)
    if rank < 4:
        for key in ("kv_lens", "q_lens"):
            if key in kw and variant:
                kw[key] = int(kw[key][0])
    return kw


def rank_layouts(case):
    _, B, Hq, Hkv, *_ = case
    out = [(4, "bhsd"), (4, "bshd")]
    if B == 1:
        out += [(3, "bhsd"), (3, "bshd")]
        if Hq == 1 and Hkv == 1:
            out += [(2, "bhsd"), (2, "bshd")]
    return out


GRID = [
    pytest.param(case, rank, layout, id=f"{case[0]}-{rank}d-{layout}")
    for case in CASES
    for rank, layout in rank_layouts(case)
]


@pytest.mark.parametrize("case, rank, layout", GRID)
def test_matches_naive(case, rank, layout):
    q, k, v, kw = build(case)
    want_out, want_lse, want_w = naive_for(q, k, v, kw)
    ukw = user_kwargs(kw, rank, variant=(layout == "bshd"))
    out, lse = ref.attention(
        to_user(q, layout, rank),
        to_user(k, layout, rank),
        to_user(v, layout, rank),
        layout=layout,
        return_lse=True,
        **ukw,
    )
    w = ref.attention_weights(
        to_user(q, layout, rank), to_user(k, layout, rank), layout=layout, **ukw
    )
    assert out.dtype == np.float64 and lse.dtype == np.float64 and w.dtype == np.float64
    assert out.shape == to_user(want_out, layout, rank).shape
    assert lse.shape == want_lse.shape[4 - rank :]
    assert w.shape == want_w.shape[4 - rank :]
    np.testing.assert_allclose(from_user(out, layout, rank), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lead(lse, rank), want_lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lead(w, rank), want_w, rtol=1e-12, atol=1e-12)
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isnan(w).any()


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c[0] in ("plain", "gqa", "causal_sq_gt_sk", "lens_causal", "everything")],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize(
    "dtype, tol",
    [(np.float16, 2e-3), (BF16, 1.6e-2), (np.float32, 1e-6)],
    ids=["f16", "bf16", "f32"],
)
def test_low_precision(case, dtype, tol):
    q, k, v, kw = build(case, dtype)
    want_out, want_lse, _ = naive_for(q, k, v, kw)  # naive on the exact upcast inputs
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float64), want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    out32 = ref.attention(q, k, v, out_dtype=np.float32, **kw)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, want_out, rtol=1e-6, atol=1e-6)
    out64, lse64 = ref.attention(q, k, v, out_dtype=np.float64, return_lse=True, **kw)
    assert out64.dtype == np.float64 and lse64.dtype == np.float64
    np.testing.assert_allclose(out64, want_out, rtol=1e-12, atol=1e-12)


def test_bfloat16_output_is_rounded_once():
    # 1 + 2**-8 + 2**-30 lies just above the midpoint of 1 and 1 + 2**-7: correct
    # rounding gives 1 + 2**-7; rounding through float32 first gives a tie and 1.
    # 1 - 2**-9 - 2**-33 lies just below the midpoint of 1 - 2**-8 and 1: correct
    # rounding gives 1 - 2**-8; through float32, again a tie, broken to even: 1.
    x = np.array([[1 + 2**-8 + 2**-30, 1 - 2**-9 - 2**-33]])
    out = ref.attention(np.zeros((1, 1)), np.zeros((1, 1)), x, scale=1.0, out_dtype=BF16)
    assert out.dtype == BF16
    assert out.astype(np.float64).tolist() == [[1 + 2**-7, 1 - 2**-8]]


# ---------------------------------------------------------------------------
# edge rows: fully masked, padding, NaN
# ---------------------------------------------------------------------------


def test_fully_masked_and_padding_rows():
    r = rng(1)
    q = r.standard_normal((2, 2, 4, 3))
    k = r.standard_normal((2, 2, 5, 3))
    v = r.standard_normal((2, 2, 5, 3))
    mask = np.ones((4, 5), bool)
    mask[1] = False  # row 1 fully masked everywhere
    add = np.where(mask, 0.0, -np.inf)
    for m in (mask, add):
        out, lse = ref.attention(q, k, v, mask=m, q_lens=[4, 2], return_lse=True)
        w = ref.attention_weights(q, k, mask=m, q_lens=[4, 2])
        for a in (out, w):
            assert np.all(a[:, :, 1] == 0) and np.all(a[1, :, 2:] == 0)
        assert np.all(lse[:, :, 1] == -np.inf) and np.all(lse[1, :, 2:] == -np.inf)
        assert np.isfinite(lse[0, :, [0, 2, 3]]).all()
        sums = w.sum(-1)
        np.testing.assert_allclose(sums[0, :, [0, 2, 3]], 1.0, rtol=1e-12)
    # with sinks: masked row has lse = sink, padding row still -inf
    sinks = np.array([0.5, -1.0])
    out, lse = ref.attention(q, k, v, mask=mask, q_lens=[4, 2], sinks=sinks, return_lse=True)
    assert np.all(out[:, :, 1] == 0)
    np.testing.assert_array_equal(lse[:, :, 1], np.broadcast_to(sinks, (2, 2)))
    assert np.all(lse[1, :, 2:] == -np.inf) and np.all(out[1, :, 2:] == 0)


def test_causal_more_queries_than_keys_gives_empty_top_rows():
    r = rng(2)
    q, k, v = r.standard_normal((5, 2)), r.standard_normal((3, 2)), r.standard_normal((3, 2))
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (5,) and np.all(lse[:2] == -np.inf) and np.all(out[:2] == 0)
    np.testing.assert_allclose(out[2], v[0])  # first real row sees only key 0


def test_nan_does_not_leak_from_absent_or_unseen_keys():
    r = rng(3)
    q = r.standard_normal((1, 2, 4, 3))
    k = r.standard_normal((1, 2, 6, 3))
    v = r.standard_normal((1, 2, 6, 3))
    k[..., 4:, :] = np.nan  # past kv_lens
    v[..., 4:, :] = np.inf
    q[..., 3, :] = np.nan  # a padding row
    out, lse = ref.attention(q, k, v, kv_lens=[4], q_lens=[3], return_lse=True)
    assert np.isfinite(out).all()
    clean = ref.attention(q[..., :3, :], k[..., :4, :], v[..., :4, :])
    np.testing.assert_allclose(out[..., :3, :], clean, rtol=1e-14)
    # a NaN value at a key that only later rows see (causal) reaches only those rows
    v2 = r.standard_normal((4, 2))
    v2[2, 1] = np.nan
    k2 = r.standard_normal((4, 3))
    out = ref.attention(r.standard_normal((4, 3)), k2, v2, causal=True)
    assert np.isfinite(out[:2]).all() and np.isfinite(out[:, 0]).all()
    assert np.isnan(out[2:, 1]).all()
    # a NaN key poisons exactly the rows that see it; a NaN query only its row
    k2[1, 0] = np.nan
    w = ref.attention_weights(r.standard_normal((4, 3)), k2, causal=True)
    assert np.isfinite(w[0]).all() and np.isnan(w[1:, :2]).all()
    assert np.all(w[1, 2:] == 0)  # invisible entries stay exactly 0
    q3 = r.standard_normal((3, 3))
    q3[1, 2] = np.nan
    out = ref.attention(q3, r.standard_normal((4, 3)), r.standard_normal((4, 2)))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


# ---------------------------------------------------------------------------
# the seed's worked examples
# ---------------------------------------------------------------------------

X_BANK = np.array(
    [
        [1, 0, 1, 0],  # river
        [0, 1, 0, 1],  # bank
        [1, 1, 0, 0.0],
    ]
)  # flooded


def test_seed_two_head_river_bank_flooded():
    """Second worked example of the seed: two heads on three tokens.

    Reading that reproduces the seed's numbers (the obvious one): X is 3x4 with
    rows river=[1,0,1,0], bank=[0,1,0,1], flooded=[1,1,0,0]; head 1's selector
    takes features 0,1 and head 2's takes features 2,3, used as W_Q = W_K = W_V,
    so Q = K = V = X[:, cols]; scale = 1/sqrt(d_k) = 1/sqrt(2); no mask.
    River, head 1: scores [1, 0, 1]/sqrt(2) -> weights [0.401, 0.198, 0.401],
    output 0.401*[1,0] + 0.198*[0,1] + 0.401*[1,1] = [0.802, 0.599].
    River, head 2: scores [1, 0, 0]/sqrt(2) -> [0.503, 0.248, 0.248],
    output [0.503, 0.248].  Concatenated: [0.802, 0.599, 0.503, 0.248].
    """
    sel1 = np.eye(4)[:, [0, 1]]
    sel2 = np.eye(4)[:, [2, 3]]
    heads = np.stack([X_BANK @ sel1, X_BANK @ sel2])  # (H=2, S=3, D=2)
    w = ref.attention_weights(heads, heads)
    assert w.shape == (2, 3, 3)
    np.testing.assert_array_equal(np.round(w[0, 0], 3), [0.401, 0.198, 0.401])
    np.testing.assert_array_equal(np.round(w[1, 0], 3), [0.503, 0.248, 0.248])
    out = ref.attention(heads, heads, heads)
    np.testing.assert_array_equal(np.round(out[0, 0], 3), [0.802, 0.599])
    np.testing.assert_array_equal(np.round(out[1, 0], 3), [0.503, 0.248])
    concat = out.transpose(1, 0, 2).reshape(3, 4)  # Concat(head1, head2) per token
    np.testing.assert_array_equal(np.round(concat[0], 3), [0.802, 0.599, 0.503, 0.248])
    # the same through layout "bshd": the projection X @ [sel1 | sel2] = X, reshaped
    # (S, H, D) without a transpose, and the output reshaped back is the concat.
    xs = X_BANK.reshape(3, 2, 2)
    concat2 = ref.attention(xs, xs, xs, layout="bshd").reshape(3, 4)
    np.testing.assert_allclose(concat2, concat, rtol=1e-15)
    for dtype in (np.float32, np.float16, BF16):
        low = ref.attention(xs.astype(dtype), xs.astype(dtype), xs.astype(dtype), layout="bshd")
        np.testing.assert_allclose(low.reshape(3, 4).astype(np.float64), concat, atol=5e-3)


def test_seed_causal_mask_pattern():
    r = rng(4)
    q, k = r.standard_normal((3, 4)), r.standard_normal((3, 4))
    w = ref.attention_weights(q, k, causal=True)
    np.testing.assert_array_equal((w != 0).astype(int), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-14)
    # same as the seed's additive M (0 keeps, -inf blocks)
    M = np.where(np.tril(np.ones((3, 3))) == 1, 0.0, -np.inf)
    np.testing.assert_array_equal(ref.attention_weights(q, k, mask=M), w)


def test_seed_aufgabe_context_vector():
    """c = .05 h1 + .10 h2 + .18 h3 + .67 h4: one query, logits log(w_j), scale 1."""
    alphas = np.array([0.05, 0.10, 0.18, 0.67])
    q = np.array([[1.0]])
    k = np.log(alphas)[:, None]
    h = rng(5).standard_normal((4, 6))  # encoder states h1..h4
    w = ref.attention_weights(q, k, scale=1.0)
    np.testing.assert_allclose(w[0], alphas, rtol=1e-14)
    out, lse = ref.attention(q, k, h, scale=1.0, return_lse=True)
    np.testing.assert_allclose(
        out[0], 0.05 * h[0] + 0.10 * h[1] + 0.18 * h[2] + 0.67 * h[3], rtol=1e-13, atol=1e-15
    )
    np.testing.assert_allclose(lse, [0.0], atol=1e-15)  # the alphas already sum to 1


# ---------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------


def make_paged(
    seq_lens,
    q_lens,
    *,
    Hq=4,
    Hkv=2,
    Dk=5,
    Dv=3,
    block_size=4,
    spare=3,
    kv_dtype=np.float64,
    q_dtype=np.float64,
    salt=0,
):
    """Contiguous per-sequence kv scattered into NaN-filled pages by a random permutation."""
    r = rng(6, salt)
    n_blocks = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(n_blocks) + spare
    perm = r.permutation(num_blocks)
    k_pages = np.full((num_blocks, Hkv, block_size, Dk), np.nan)
    v_pages = np.full((num_blocks, Hkv, block_size, Dv), np.nan)
    tables = np.full((len(seq_lens), max(n_blocks) + 1), -1, dtype=np.int32)
    ks, vs, used = [], [], 0
    for b, L in enumerate(seq_lens):
        kb = r.standard_normal((Hkv, L, Dk)).astype(kv_dtype).astype(np.float64)
        vb = r.standard_normal((Hkv, L, Dv)).astype(kv_dtype).astype(np.float64)
        ks.append(kb)
        vs.append(vb)
        for n in range(n_blocks[b]):
            blk = perm[used]
            used += 1
            tables[b, n] = blk
            for t in range(n * block_size, min(L, (n + 1) * block_size)):
                k_pages[blk, :, t % block_size] = kb[:, t]
                v_pages[blk, :, t % block_size] = vb[:, t]
    q = r.standard_normal((sum(q_lens), Hq, Dk)).astype(q_dtype)
    return q, k_pages.astype(kv_dtype), v_pages.astype(kv_dtype), tables, ks, vs


def paged_expected(q, ks, vs, q_lens, **kw):
    outs, lses, start = [], [], 0
    for kb, vb, n in zip(ks, vs, q_lens):
        if n == 0:  # an idle sequence contributes no rows
            continue
        qb = q[start : start + n].astype(np.float64).transpose(1, 0, 2)[None]  # (1, Hq, n, Dk)
        o, l, _ = naive(qb, kb[None], vb[None], **kw)
        outs.append(o[0].transpose(1, 0, 2))
        lses.append(l[0].T)
        start += n
    return np.concatenate(outs), np.concatenate(lses)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"causal": False},
        {"window": (3, 0), "softcap": 2.0},
        {"sinks": [0.1, -0.5, 1.0, 0.0], "alibi_slopes": [0.5, 0.25, 0.125, 0.0625], "scale": 0.7},
    ],
    ids=["causal", "noncausal", "window_softcap", "sinks_alibi_scale"],
)
def test_paged_matches_gathered(extra):
    seq_lens = [1, 7, 12, 9, 8, 5]
    q_lens = [1, 3, 1, 9, 0, 2]  # decode, prefill chunk, whole prompt, idle
    q, kp, vp, tables, ks, vs = make_paged(seq_lens, q_lens, salt=len(extra))
    out, lse = ref.paged_attention(
        q, kp, vp, tables, np.array(seq_lens), q_lens=np.array(q_lens), return_lse=True, **extra
    )
    nkw = dict(extra)
    nkw.setdefault("causal", True)
    if "alibi_slopes" in nkw:
        nkw["alibi"] = nkw.pop("alibi_slopes")
    want_out, want_lse = paged_expected(q, ks, vs, q_lens, **nkw)
    assert out.shape == (sum(q_lens), 4, 3) and lse.shape == (sum(q_lens), 4)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_paged_decode_default_and_mixed_dtypes():
    seq_lens = [5, 1, 8, 3]
    q, kp, vp, tables, ks, vs = make_paged(
        seq_lens, [1] * 4, kv_dtype=np.float16, q_dtype=np.float32, salt=9
    )
    out, lse = ref.paged_attention(q, kp, vp, tables, np.array(seq_lens), return_lse=True)
    assert out.dtype == np.float32 and lse.dtype == np.float32 and out.shape == (4, 4, 3)
    want_out, want_lse = paged_expected(q, ks, vs, [1] * 4, causal=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    out_bf = ref.paged_attention(q, kp, vp, tables, np.array(seq_lens), out_dtype=BF16)
    assert out_bf.dtype == BF16
    np.testing.assert_allclose(out_bf.astype(np.float64), want_out, atol=1.6e-2, rtol=1.6e-2)


def test_paged_validation():
    seq_lens = np.array([5, 3])
    q, kp, vp, tables, _, _ = make_paged([5, 3], [1, 1], salt=11)
    with pytest.raises(ValueError, match="q"):
        ref.paged_attention(q[:1], kp, vp, tables, seq_lens)
    with pytest.raises(ValueError, match="block_tables"):
        ref.paged_attention(q, kp, vp, tables[:, :1], seq_lens)
    bad = tables.copy()
    bad[0, 0] = kp.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        ref.paged_attention(q, kp, vp, bad, seq_lens)
    with pytest.raises(ValueError, match="q_lens"):
        ref.paged_attention(q, kp, vp, tables, seq_lens, q_lens=np.array([1, 4]))
    with pytest.raises(ValueError, match="v_pages"):
        ref.paged_attention(q, kp, vp[:, :1], tables, seq_lens)


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"layout": "sbhd"}, ValueError, "layout"),
        ({"window": (-1, 0)}, ValueError, "window"),
        ({"window": (1,)}, ValueError, "window"),
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"sinks": np.zeros(3)}, ValueError, "sinks"),
        ({"alibi_slopes": np.zeros(1)}, ValueError, "alibi_slopes"),
        ({"mask": np.ones((2, 5), bool)}, ValueError, "mask"),
        ({"mask": np.ones((3, 4), np.int64)}, TypeError, "mask"),
        ({"kv_lens": [5, 1]}, ValueError, "kv_lens"),
        ({"kv_lens": [1]}, ValueError, "kv_lens"),
        ({"q_lens": [1.0, 2.0]}, TypeError, "q_lens"),
        ({"out_dtype": np.int32}, TypeError, "out_dtype"),
    ],
)
def test_argument_errors_name_the_argument(kwargs, exc, name):
    r = rng(7)
    q = r.standard_normal((2, 2, 3, 4))
    k = r.standard_normal((2, 2, 4, 4))
    v = r.standard_normal((2, 2, 4, 4))
    with pytest.raises(exc, match=name):
        ref.attention(q, k, v, **kwargs)


def test_shape_and_dtype_errors():
    r = rng(8)
    q = r.standard_normal((1, 4, 3, 4))
    with pytest.raises(ValueError, match="Hkv"):
        ref.attention(q, np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)))
    with pytest.raises(ValueError, match="head dim"):
        ref.attention(q, np.zeros((1, 2, 2, 5)), np.zeros((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="v"):
        ref.attention(q, np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 3, 4)))
    with pytest.raises(ValueError, match="rank"):
        ref.attention(q, np.zeros((2, 2, 4)), np.zeros((2, 2, 4)))
    with pytest.raises(ValueError, match="rank"):
        ref.attention(np.zeros(4), np.zeros(4), np.zeros(4))
    with pytest.raises(TypeError, match="k"):
        ref.attention(q, np.zeros((1, 2, 2, 4), np.float32), np.zeros((1, 2, 2, 4)))
    with pytest.raises(TypeError, match="q"):
        ref.attention(q.astype(np.int64), q.astype(np.int64), q.astype(np.int64))


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    Sq = draw(st.integers(0, 5))
    Sk = draw(st.integers(0, 6))
    Dk = draw(st.integers(1, 4))
    Dv = draw(st.integers(0, 3))
    r = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kw = {"causal": draw(st.booleans()), "layout": draw(st.sampled_from(["bhsd", "bshd"]))}
    mask_kind = draw(st.sampled_from([None, "bool", "add"]))
    if mask_kind is not None:
        shape = draw(st.sampled_from([(Sq, Sk), (B, 1, Sq, Sk), (1, Hq, 1, Sk), (Sk,)]))
        p = draw(st.floats(0.0, 1.0))
        blocked = r.random(shape) < p
        kw["mask"] = (
            ~blocked
            if mask_kind == "bool"
            else np.where(blocked, -np.inf, r.standard_normal(shape))
        )
    if draw(st.booleans()):
        kw["kv_lens"] = r.integers(0, Sk + 1, B)
    if draw(st.booleans()):
        kw["q_lens"] = r.integers(0, Sq + 1, B)
    if draw(st.booleans()):
        kw["window"] = (
            draw(st.one_of(st.none(), st.integers(0, 4))),
            draw(st.one_of(st.none(), st.integers(0, 4))),
        )
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.1, 10.0))
    if draw(st.booleans()):
        kw["alibi_slopes"] = r.random(Hq)
    if draw(st.booleans()):
        kw["sinks"] = r.standard_normal(Hq) * 3
    q = r.standard_normal((B, Hq, Sq, Dk)) * 2
    k = r.standard_normal((B, Hkv, Sk, Dk)) * 2
    v = r.standard_normal((B, Hkv, Sk, Dv))
    return q, k, v, kw


@seed(SEED)
@settings(max_examples=150, deadline=None)
@given(problems())
def test_property_weights_normalised_and_consistent(problem):
    q, k, v, kw = problem
    layout = kw.pop("layout")
    user = [np.transpose(x, (0, 2, 1, 3)) if layout == "bshd" else x for x in (q, k, v)]
    w = ref.attention_weights(user[0], user[1], layout=layout, **kw)
    out, lse = ref.attention(*user, layout=layout, return_lse=True, **kw)
    assert np.isfinite(w).all() and not np.isnan(lse).any() and np.isfinite(out).all()
    sums = w.sum(-1)
    if "sinks" in kw:
        sink = np.asarray(kw["sinks"])[None, :, None]
        nonempty = np.isfinite(lse)
        # visible weights plus the sink's share make 1
        total = sums + np.where(nonempty, np.exp(sink - np.where(nonempty, lse, 0.0)), 0.0)
        np.testing.assert_allclose(total[nonempty], 1.0, rtol=1e-12)
        assert np.all(sums <= 1.0 + 1e-12)
    else:
        empty = np.all(w == 0, axis=-1)
        np.testing.assert_allclose(sums[~empty], 1.0, rtol=1e-12)
        assert np.array_equal(empty, lse == -np.inf)
    group = q.shape[1] // k.shape[1]
    expect = w @ np.repeat(v, group, axis=1)
    if layout == "bshd":
        expect = np.transpose(expect, (0, 2, 1, 3))
    np.testing.assert_allclose(out, expect, rtol=1e-12, atol=1e-12)
    # the padding rows are zero
    if "q_lens" in kw:
        rows = np.arange(q.shape[2])[None, :] >= np.asarray(kw["q_lens"])[:, None]
        assert np.all(w[rows.nonzero()[0], :, rows.nonzero()[1]] == 0)
        assert np.all(lse[rows.nonzero()[0], :, rows.nonzero()[1]] == -np.inf)
