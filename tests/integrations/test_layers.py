"""attnx.MultiHeadAttention against the seed's formula, written out in plain NumPy, and against
torch.nn.MultiheadAttention when torch is installed.

    head_h = softmax(Q_h K_gᵀ / sqrt(d) + M) V_g,   g = h // (H / Hkv)
    MultiHead = Concat(head_1, ..., head_H) W_O
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import attnx
from attnx import layers as layers_mod

from helpers import make_rng

# ---------------------------------------------------------------------------------------------
# the seed's formula, one head at a time (a deliberately plain loop)
# ---------------------------------------------------------------------------------------------


def seed_formula(layer, x, context=None, *, causal=False, mask=None, kv_lens=None, q_lens=None):
    """Returns (y, weights) in float64 for batched x (B, Sq, d_model)."""
    f = np.float64
    c = x if context is None else context
    B, Sq, _ = x.shape
    Sk = c.shape[1]
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    Wq, Wk, Wv, Wo = (np.asarray(w, f) for w in (layer.W_Q, layer.W_K, layer.W_V, layer.W_O))

    def bias(b, n):
        return np.zeros(n) if b is None else np.asarray(b, f)

    Q = x.astype(f) @ Wq + bias(layer.b_Q, H * D)
    K = c.astype(f) @ Wk + bias(layer.b_K, G * D)
    V = c.astype(f) @ Wv + bias(layer.b_V, G * D)
    m = None if mask is None else np.broadcast_to(np.asarray(mask), (B, H, Sq, Sk))
    y = np.zeros((B, Sq, layer.d_model))
    weights = np.zeros((B, H, Sq, Sk))
    for b in range(B):
        Lk = Sk if kv_lens is None else int(kv_lens[b])
        Lq = Sq if q_lens is None else int(q_lens[b])
        heads = []
        for h in range(H):
            g = h // (H // G)
            Qh, Kh, Vh = (
                Q[b, :, h * D : (h + 1) * D],
                K[b, :, g * D : (g + 1) * D],
                V[b, :, g * D : (g + 1) * D],
            )
            S = Qh @ Kh.T / np.sqrt(D)
            allowed = np.ones((Sq, Sk), bool)
            allowed[:, Lk:] = False
            allowed[Lq:, :] = False
            if causal:  # bottom-right: row i sits at key position i + Lk - Lq
                allowed &= np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Lk - Lq)
            if m is not None:
                if m.dtype == bool:
                    allowed &= m[b, h]
                else:
                    S = S + m[b, h]
                    allowed &= m[b, h] != -np.inf
            S = np.where(allowed, S, -np.inf)
            A = np.zeros_like(S)
            rows = allowed.any(1)
            e = np.exp(S[rows] - S[rows].max(1, keepdims=True))
            A[rows] = e / e.sum(1, keepdims=True)
            weights[b, h] = A
            heads.append(A @ Vh)
        yb = np.concatenate(heads, axis=1) @ Wo + bias(layer.b_O, layer.d_model)
        yb[Lq:] = 0.0  # padding query rows are zero
        y[b] = yb
    return y, weights


def close(a, b, tol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b).max(initial=0.0)
    assert err <= tol * max(1.0, np.abs(b).max(initial=0.0)), err


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# the formula, over the layer's arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads", [(4, 4), (4, 2), (4, 1), (6, 3)], ids=lambda h: f"H{h[0]}kv{h[1]}"
)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_seed_formula(heads, cross, bias, causal):
    H, G = heads
    rng = make_rng("formula", heads, cross, bias, causal)
    layer = attnx.MultiHeadAttention(24, H, num_kv_heads=G, bias=bias, seed=1)
    if bias:  # non-zero biases, so that they are checked
        for name in ("b_Q", "b_K", "b_V", "b_O"):
            setattr(layer, name, rng.standard_normal(getattr(layer, name).shape))
    x = rand(rng, 2, 5, 24)
    ctx = rand(rng, 2, 7, 24) if cross else None
    y, w = layer(x, ctx, causal=causal, return_weights=True)
    y_ref, w_ref = seed_formula(layer, x, ctx, causal=causal)
    assert y.dtype == np.float32 and y.shape == (2, 5, 24)
    assert w.shape == (2, H, 5, 7 if cross else 5)
    close(y, y_ref)
    close(w, w_ref, 1e-6)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)


def test_unbatched_equals_batched():
    rng = make_rng("unbatched")
    layer = attnx.MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, seed=2)
    x, ctx = rand(rng, 5, 16), rand(rng, 3, 16)
    y, w = layer(x, ctx, return_weights=True)
    yb, wb = layer(x[None], ctx[None], return_weights=True)
    assert y.shape == (5, 16) and w.shape == (4, 5, 3)
    np.testing.assert_array_equal(y, yb[0])
    np.testing.assert_array_equal(w, wb[0])
    # lengths given as ints for unbatched input
    y2 = layer(x, ctx, kv_lens=2, q_lens=4)
    y2b = layer(x[None], ctx[None], kv_lens=np.array([2]), q_lens=np.array([4]))
    np.testing.assert_array_equal(y2, y2b[0])


def test_head_dim_differs_from_d_model_over_heads():
    rng = make_rng("head_dim")
    layer = attnx.MultiHeadAttention(10, 3, head_dim=7, seed=3)
    assert layer.W_Q.shape == (10, 21) and layer.W_O.shape == (21, 10)
    x = rand(rng, 2, 4, 10)
    close(layer(x), seed_formula(layer, x)[0])


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [(5, 6), (4, 5, 6), (2, 1, 5, 6), (2, 4, 1, 6)])
def test_masks(kind, shape):
    rng = make_rng("mask", kind, shape)
    layer = attnx.MultiHeadAttention(16, 4, num_kv_heads=2, seed=4)
    x, ctx = rand(rng, 2, 5, 16), rand(rng, 2, 6, 16)
    if kind == "bool":
        mask = rng.random(shape) > 0.3
    else:
        mask = rng.standard_normal(shape).astype(np.float32)
        mask[rng.random(shape) < 0.3] = -np.inf
    y, w = layer(x, ctx, mask=mask, return_weights=True)
    y_ref, w_ref = seed_formula(layer, x, ctx, mask=mask)
    close(y, y_ref)
    close(w, w_ref, 1e-6)


def test_fully_masked_row_is_zero_before_the_output_projection():
    rng = make_rng("fully masked")
    layer = attnx.MultiHeadAttention(8, 2, bias=True, seed=5)
    layer.b_O = np.arange(8.0)
    x = rand(rng, 1, 3, 8)
    mask = np.ones((3, 3), bool)
    mask[1] = False
    y = layer(x, mask=mask)
    np.testing.assert_allclose(y[0, 1], np.arange(8.0), atol=1e-6)  # 0 @ W_O + b_O
    assert np.isfinite(y).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_padding(causal, cross):
    rng = make_rng("padding", causal, cross)
    layer = attnx.MultiHeadAttention(16, 4, num_kv_heads=2, bias=True, seed=6)
    layer.b_O = rng.standard_normal(16)
    x = rand(rng, 3, 6, 16)
    ctx = rand(rng, 3, 7, 16) if cross else None
    Sk = 7 if cross else 6
    kv_lens = np.array([Sk, 3, 1])
    q_lens = np.array([6, 2, 4]) if cross else np.array([6, 3, 1])
    if not cross:
        x[1, 3:] = np.nan  # garbage in padding must not leak
        x[2, 1:] = 1e30
    y, w = layer(x, ctx, causal=causal, kv_lens=kv_lens, q_lens=q_lens, return_weights=True)
    y_ref, w_ref = seed_formula(
        layer, np.nan_to_num(x, nan=0.0), ctx, causal=causal, kv_lens=kv_lens, q_lens=q_lens
    )
    for b in range(3):
        close(y[b, : q_lens[b]], y_ref[b, : q_lens[b]])
        close(w[b], w_ref[b], 1e-6)
        assert np.all(y[b, q_lens[b] :] == 0)  # padding rows are exactly zero
        assert np.all(w[b, :, :, kv_lens[b] :] == 0)
    # a sequence alone gives the same rows as inside the padded batch
    b = 1
    alone = layer(x[b, : q_lens[b]], None if ctx is None else ctx[b, : kv_lens[b]], causal=causal)
    close(alone, y[b, : q_lens[b]], 1e-5)


def test_one_kernel_call_per_forward(monkeypatch):
    """All heads and sequences go through a single attnx.attention call (no loop over heads)."""
    calls = []
    real = layers_mod._api.attention

    def spy(*a, **kw):
        calls.append(kw.get("layout"))
        return real(*a, **kw)

    monkeypatch.setattr(layers_mod._api, "attention", spy)
    layer = attnx.MultiHeadAttention(32, 8, num_kv_heads=2, seed=7)
    layer(make_rng("spy").standard_normal((3, 5, 32)))
    assert calls == ["bshd"]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_storage(dtype):
    rng = make_rng("lowp", np.dtype(dtype).name)
    layer = attnx.MultiHeadAttention(16, 4, bias=True, dtype=dtype, seed=8)
    assert layer.W_Q.dtype == np.dtype(dtype) and layer.b_O.dtype == np.dtype(dtype)
    x = rand(rng, 2, 5, 16)
    y = layer(x, causal=True)
    assert y.dtype == np.dtype(dtype)
    y_ref, _ = seed_formula(layer, x, causal=True)
    eps = float(ml_dtypes.finfo(dtype).eps)
    close(y.astype(np.float32), y_ref, 2 * eps)


def test_seed_two_head_example():
    X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], np.float32)
    layer = attnx.MultiHeadAttention(4, 2, head_dim=2)
    layer.W_Q = layer.W_K = layer.W_V = layer.W_O = np.eye(4)
    y, w = layer(X, return_weights=True)
    np.testing.assert_allclose(w[0, 0], [0.401, 0.198, 0.401], atol=5e-4)
    np.testing.assert_allclose(y[0], [0.802, 0.599, 0.503, 0.248], atol=5e-4)


# ---------------------------------------------------------------------------------------------
# weights: attributes, state dicts
# ---------------------------------------------------------------------------------------------


def test_weights_settable_and_checked():
    layer = attnx.MultiHeadAttention(8, 2, num_kv_heads=1, seed=9)
    assert layer.W_Q.shape == (8, 8) and layer.W_K.shape == (8, 4) and layer.W_V.shape == (8, 4)
    assert layer.W_O.shape == (8, 8) and layer.b_Q is None
    w = np.arange(32.0).reshape(8, 4)
    layer.W_K = w
    assert layer.W_K.dtype == np.float32 and np.array_equal(layer.W_K, w)
    w[0, 0] = 99  # the layer keeps its own copy
    assert layer.W_K[0, 0] == 0
    with pytest.raises(ValueError, match=r"W_K: expected shape \(8, 4\).*\(out, in\)"):
        layer.W_K = np.zeros((4, 8))  # torch's convention: the hint says so
    with pytest.raises(ValueError, match="W_O"):
        layer.W_O = np.zeros((8, 7))
    with pytest.raises(ValueError, match="W_Q"):
        layer.W_Q = None
    layer.b_O = np.ones(8)  # adding a bias to a bias-free layer
    y = layer(np.zeros((2, 8), np.float32))
    np.testing.assert_allclose(y, 1.0)
    layer.b_O = None
    assert np.all(layer(np.zeros((2, 8), np.float32)) == 0)
    with pytest.raises(ValueError, match="b_Q"):
        layer.b_Q = np.zeros(7)


def test_seed_and_rng():
    a = attnx.MultiHeadAttention(8, 2, seed=3)
    b = attnx.MultiHeadAttention(8, 2, rng=np.random.default_rng(3))
    c = attnx.MultiHeadAttention(8, 2, seed=4)
    assert np.array_equal(a.W_Q, b.W_Q) and not np.array_equal(a.W_Q, c.W_Q)
    with pytest.raises(ValueError, match="rng"):
        attnx.MultiHeadAttention(8, 2, seed=3, rng=np.random.default_rng(3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=8, num_heads=3), "head_dim"),
        (dict(d_model=8, num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(d_model=0, num_heads=1), "d_model"),
        (dict(d_model=8, num_heads=0), "num_heads"),
        (dict(d_model=8, num_heads=2, head_dim=0), "head_dim"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attnx.MultiHeadAttention(**kwargs)


def test_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        attnx.MultiHeadAttention(8, 2, dtype=np.int32)


def test_bad_inputs():
    layer = attnx.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(ValueError, match="x: last axis"):
        layer(np.zeros((3, 7), np.float32))
    with pytest.raises(ValueError, match="x: expected"):
        layer(np.zeros((1, 1, 3, 8), np.float32))
    with pytest.raises(ValueError, match="context: expected rank"):
        layer(np.zeros((2, 3, 8), np.float32), np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="context: batch"):
        layer(np.zeros((2, 3, 8), np.float32), np.zeros((3, 3, 8), np.float32))
    with pytest.raises(ValueError, match="context: last axis"):
        layer(np.zeros((3, 8), np.float32), np.zeros((3, 6), np.float32))
    with pytest.raises(ValueError, match="mask"):
        layer(np.zeros((3, 8), np.float32), mask=np.ones((4, 4), bool))
    with pytest.raises(ValueError, match="kv_lens"):
        layer(np.zeros((2, 3, 8), np.float32), kv_lens=np.array([1, 2, 3]))


def test_context_dim():
    rng = make_rng("context_dim")
    layer = attnx.MultiHeadAttention(8, 2, context_dim=5, bias=True, seed=1)
    assert layer.W_K.shape == (5, 8) and layer.W_V.shape == (5, 8)
    x, ctx = rand(rng, 2, 3, 8), rand(rng, 2, 4, 5)
    close(layer(x, ctx), seed_formula(layer, x, ctx)[0])
    with pytest.raises(ValueError, match="context: required"):
        layer(x)


def _randomise(layer, rng):
    for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
        if getattr(layer, name) is not None:
            setattr(layer, name, rng.standard_normal(getattr(layer, name).shape))


def test_state_dict_round_trip_with_prefix():
    rng = make_rng("state dict")
    layer = attnx.MultiHeadAttention(12, 6, num_kv_heads=2, bias=True, seed=0)
    _randomise(layer, rng)
    sd = layer.state_dict(prefix="model.layers.0.self_attn.")
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (12, 12)  # torch: (out, in)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (4, 12)
    sd["unrelated.weight"] = np.zeros(3)
    again = attnx.MultiHeadAttention.from_state_dict(sd, 6, prefix="model.layers.0.self_attn.")
    assert again.num_kv_heads == 2 and again.head_dim == 2  # inferred from the shapes
    for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
        np.testing.assert_array_equal(getattr(again, name), getattr(layer, name))


def _hf_form(out_name, w, b):
    """A Hugging Face state dict: q/k/v_proj and the output projection named ``out_name``,
    weights ``w`` and biases ``b`` in (q, k, v, out) order, torch's (out, in) layout."""
    names = ("q_proj", "k_proj", "v_proj", out_name)
    return {
        f"{n}.{kind}": x for kind, xs in (("weight", w), ("bias", b)) for n, x in zip(names, xs)
    }


def _state_dict_forms(w, b):
    """The state-dict spellings from_state_dict reads, each holding weights ``w`` and biases
    ``b`` in (q, k, v, out) order: Hugging Face's two output names and torch's
    nn.MultiheadAttention with packed and separate (kdim/vdim) input projections."""
    wq, wk, wv, wo = w
    bq, bk, bv, bo = b
    return {
        "hf_out_proj": _hf_form("out_proj", w, b),
        "hf_o_proj": _hf_form("o_proj", w, b),
        "torch_mha": {
            "in_proj_weight": np.concatenate([wq, wk, wv]),
            "in_proj_bias": np.concatenate([bq, bk, bv]),
            "out_proj.weight": wo,
            "out_proj.bias": bo,
        },
        "torch_mha_kdim": {
            "q_proj_weight": wq,
            "k_proj_weight": wk,
            "v_proj_weight": wv,
            "in_proj_bias": np.concatenate([bq, bk, bv]),
            "out_proj.weight": wo,
            "out_proj.bias": bo,
        },
    }


def test_from_state_dict_names():
    rng = make_rng("names")
    E, H = 8, 2
    wq, wk, wv, wo = (rng.standard_normal((E, E)) for _ in range(4))
    bq, bk, bv, bo = (rng.standard_normal(E) for _ in range(4))
    x = rand(rng, 2, 3, E)
    ref = attnx.MultiHeadAttention(E, H)
    ref.W_Q, ref.W_K, ref.W_V, ref.W_O = wq.T, wk.T, wv.T, wo.T
    ref.b_Q, ref.b_K, ref.b_V, ref.b_O = bq, bk, bv, bo
    want = ref(x)
    forms = _state_dict_forms((wq, wk, wv, wo), (bq, bk, bv, bo))
    for name, sd in forms.items():
        layer = attnx.MultiHeadAttention.from_state_dict(sd, H)
        np.testing.assert_allclose(layer(x), want, rtol=1e-6, atol=1e-6, err_msg=name)
    # a model without biases, and one with q/k/v biases only (Qwen-style): missing ones are 0
    nob = attnx.MultiHeadAttention.from_state_dict(
        {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv, "o_proj.weight": wo}, H
    )
    assert nob.b_Q is None and nob.b_O is None
    part = attnx.MultiHeadAttention.from_state_dict(
        {
            "q_proj.weight": wq,
            "k_proj.weight": wk,
            "v_proj.weight": wv,
            "o_proj.weight": wo,
            "q_proj.bias": bq,
        },
        H,
    )
    np.testing.assert_array_equal(part.b_K, 0)
    np.testing.assert_array_equal(part.b_O, 0)


def test_from_state_dict_errors():
    E = 8
    w = np.zeros((E, E))
    with pytest.raises(KeyError, match="value"):
        attnx.MultiHeadAttention.from_state_dict(
            {"q_proj.weight": w, "k_proj.weight": w, "o_proj.weight": w}, 2
        )
    with pytest.raises(ValueError, match="num_heads"):
        attnx.MultiHeadAttention.from_state_dict(
            {"q_proj.weight": w, "k_proj.weight": w, "v_proj.weight": w, "o_proj.weight": w}, 3
        )
    with pytest.raises(ValueError, match="num_kv_heads"):
        attnx.MultiHeadAttention.from_state_dict(
            {
                "q_proj.weight": w,
                "k_proj.weight": w[:4],
                "v_proj.weight": w[:4],
                "o_proj.weight": w,
            },
            2,
            num_kv_heads=2,
        )
    with pytest.raises(ValueError, match="differ"):
        attnx.MultiHeadAttention.from_state_dict(
            {"q_proj.weight": w, "k_proj.weight": w, "v_proj.weight": w[:, :4], "o_proj.weight": w},
            2,
        )


# ---------------------------------------------------------------------------------------------
# against torch.nn.MultiheadAttention
# ---------------------------------------------------------------------------------------------


def _torch_mha(E, H, bias, kdim=None, seed=0):
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kdim, vdim=kdim)
    with torch.no_grad():
        for name, p in mha.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return torch, mha.eval()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "case", ["self", "causal", "cross", "key_padding", "bool_mask", "float_mask", "unbatched"]
)
def test_against_torch_multihead_attention(bias, case):
    E, H = 16, 4
    torch, mha = _torch_mha(E, H, bias, seed=zlib.crc32(case.encode()) % 1000)
    layer = attnx.MultiHeadAttention.from_state_dict(mha.state_dict(), H)
    rng = make_rng("torch mha", bias, case)
    x = rand(rng, 3, 5, E)
    ctx = rand(rng, 3, 7, E) if case in ("cross", "key_padding") else x
    Sk = ctx.shape[1]
    kw, tkw = {}, {}
    if case == "causal":
        kw["causal"] = True
        tkw["attn_mask"] = torch.from_numpy(~np.tril(np.ones((5, 5), bool)))  # True = blocked
    elif case == "key_padding":
        lens = np.array([7, 4, 2])
        kw["kv_lens"] = lens
        tkw["key_padding_mask"] = torch.from_numpy(np.arange(Sk)[None, :] >= lens[:, None])
    elif case == "bool_mask":
        m = rng.random((5, Sk)) > 0.3
        m[:, 0] = True  # no fully masked rows (torch gives NaN there)
        kw["mask"] = m
        tkw["attn_mask"] = torch.from_numpy(~m)
    elif case == "float_mask":
        m = rng.standard_normal((3 * H, 5, Sk)).astype(np.float32)
        kw["mask"] = m.reshape(3, H, 5, Sk)
        tkw["attn_mask"] = torch.from_numpy(m)
    if case == "unbatched":
        x = ctx = x[0]
    with torch.no_grad():
        t_out, t_w = mha(
            torch.from_numpy(x),
            torch.from_numpy(ctx),
            torch.from_numpy(ctx),
            need_weights=True,
            average_attn_weights=False,
            **tkw,
        )
    y, w = layer(x, None if ctx is x else ctx, return_weights=True, **kw)
    close(y, t_out.numpy())
    close(w, t_w.numpy(), 1e-5)


def test_against_torch_kdim():
    E, H, C = 12, 3, 5
    torch, mha = _torch_mha(E, H, True, kdim=C)
    layer = attnx.MultiHeadAttention.from_state_dict(mha.state_dict(), H)
    assert layer.context_dim == C
    rng = make_rng("kdim")
    x, ctx = rand(rng, 2, 4, E), rand(rng, 2, 6, C)
    with torch.no_grad():
        t_out, _ = mha(torch.from_numpy(x), torch.from_numpy(ctx), torch.from_numpy(ctx))
    close(layer(x, ctx), t_out.numpy())


def test_from_state_dict_accepts_torch_tensors_including_bfloat16():
    torch, mha = _torch_mha(8, 2, True)
    sd = {k: v.to(torch.bfloat16) for k, v in mha.state_dict().items()}
    layer = attnx.MultiHeadAttention.from_state_dict(sd, 2, dtype=ml_dtypes.bfloat16)
    assert layer.W_Q.dtype == np.dtype(ml_dtypes.bfloat16)
    want = mha.in_proj_weight.detach().to(torch.bfloat16).float().numpy()[:8].T
    np.testing.assert_array_equal(layer.W_Q.astype(np.float32), want)
