"""The amx path's chunked gated delta rule over bf16 inputs: its products against the state run on
AMX-BF16 tiles (cpp/src/kernels/delta_amx-inl.h; the amx-emulated path runs the same code over
emulated tiles), with operands packed as bf16 pairs into whole 16 x 32 tiles. The shapes here
put data at every edge of that layout (chunks of fewer than 16 tokens and odd ones, K and V not
multiples of 32, K != V, a state whose rows end inside a tile), and the gates at its semantics'
edges (exact zeros, resets, packed sequences). Tolerance: helpers.delta's DELTA_TILE_ERR bf16
unit roundoffs of the largest reference value."""

from __future__ import annotations

import numpy as np
import pytest

import attnx

from helpers import BF16, check_delta_rule


def inputs(rng, B, T, Hk, Hv, K, V, *, per_channel=False):
    q = rng.standard_normal((B, T, Hk, K)).astype(BF16)
    k = rng.standard_normal((B, T, Hk, K)).astype(BF16)
    v = rng.standard_normal((B, T, Hv, V)).astype(BF16)
    g = -0.3 * rng.random((B, T, Hv, K) if per_channel else (B, T, Hv)).astype(np.float32)
    beta = rng.random((B, T, Hv)).astype(np.float32)
    return q, k, v, g, beta


def state0(rng, N, Hv, K, V):
    return (0.1 * rng.standard_normal((N, Hv, K, V))).astype(np.float32)


# T: one token, fewer than a chunk, a chunk, a chunk and one, odd lengths across chunks.
# K, V: multiples of 32 and not, K != V both ways, K past one row block of the state (32 rows).
SHAPES = [
    (1, 32, 32),
    (5, 40, 24),
    (15, 33, 70),
    (16, 128, 64),
    (17, 64, 128),
    (31, 80, 96),
    (33, 17, 160),
    (97, 128, 128),
    (130, 48, 32),
]


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("T, K, V", SHAPES)
def test_tile_shapes_match_reference(amx_isa, rng, T, K, V, gate):
    q, k, v, g, beta = inputs(rng, 2, T, 1, 2, K, V, per_channel=gate == "channel")
    check_delta_rule(
        q, k, v, g, beta, initial_state=state0(rng, 2, 2, K, V), qk_l2norm=True, _mode="chunked"
    )


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_gates_with_zeros_and_resets(amx_isa, rng, gate):
    """Exact zeros (no decay) in some positions and channels, and resets (exp(g) = 0) at a
    chunk's first, last and middle positions: segments shorter than a chunk start and end there."""
    T, K, V = 70, 48, 40
    q, k, v, g, beta = inputs(rng, 1, T, 1, 2, K, V, per_channel=gate == "channel")
    g[:, ::3] = 0.0
    if gate == "channel":
        g[..., ::5] = 0.0
    for t in (0, 15, 16, 23, 47, 69):
        g[:, t, 0] = -np.inf
        g[:, t, 1] = -200.0
    o, state = check_delta_rule(
        q, k, v, g, beta, initial_state=state0(rng, 1, 2, K, V), qk_l2norm=True, _mode="chunked"
    )
    assert np.isfinite(o.astype(np.float32)).all() and np.isfinite(state).all()


def test_cu_seqlens_packed(amx_isa, rng):
    """Packed sequences whose chunks end anywhere in a tile: each one alone gives the same."""
    cu = np.array([0, 1, 17, 17, 50, 64, 99])
    q, k, v, g, beta = inputs(rng, 1, 101, 2, 4, 40, 72, per_channel=True)
    s0 = state0(rng, 6, 4, 40, 72)
    o, state = check_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, qk_l2norm=True, _mode="chunked"
    )
    for n in range(6):
        a, b = cu[n], cu[n + 1]
        one, one_state = attnx.gated_delta_rule(
            *(x[:, a:b] for x in (q, k, v, g, beta)),
            initial_state=s0[n : n + 1],
            qk_l2norm=True,
            output_final_state=True,
            _mode="chunked",
        )
        np.testing.assert_array_equal(o[:, a:b], one)
        np.testing.assert_array_equal(state[n], one_state[0])


def test_tiles_run_and_threads_agree(amx_isa, rng):
    """The products do run on tiles (the result is not the vector path's bit for bit), and a
    value head gives the same alone, with its key head's other value heads, on 1 or 2 threads."""
    q, k, v, g, beta = inputs(rng, 2, 75, 1, 4, 64, 48)
    s0 = state0(rng, 2, 4, 64, 48)
    kw = dict(initial_state=s0, qk_l2norm=True, output_final_state=True, _mode="chunked")
    o1, s1 = attnx.gated_delta_rule(q, k, v, g, beta, num_threads=1, **kw)
    o2, s2 = attnx.gated_delta_rule(q, k, v, g, beta, num_threads=2, **kw)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(s1, s2)
    h = slice(2, 3)
    one, one_state = attnx.gated_delta_rule(
        q, k, v[:, :, h], g[:, :, h], beta[:, :, h], **{**kw, "initial_state": s0[:, h]}
    )
    np.testing.assert_array_equal(o1[:, :, h], one)
    np.testing.assert_array_equal(s1[:, h], one_state)
    attnx._core.set_isa("avx512bf16")
    _, vector_state = attnx.gated_delta_rule(q, k, v, g, beta, **kw)
    assert not np.array_equal(s1, vector_state)


def _bf16(x):
    return x.astype(np.float32).astype(BF16).astype(np.float64)


def tiles_twin(q, k, v, g, beta, s0):
    """The chunked form in float64 with the amx path's roundings (docs/numerics.md): per chunk of
    16 tokens, the rows of K and Q (gated per channel), S0, the gated keys Kd and U rounded to
    bf16 before their products; everything else exact. One sequence and value head, l2-normalised
    q and k, finite gates without resets: q, k (T, K), v (T, V), g (T,) or (T, K), beta (T,),
    s0 (K, V). Returns the output before its rounding to bf16, and the final state."""
    T, K = q.shape
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(K)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    S, out = s0.astype(np.float64), np.zeros((T, v.shape[1]))
    for t0 in range(0, T, 16):
        sl = slice(t0, min(T, t0 + 16))
        Q, Kc, b = q[sl], k[sl], beta[sl]
        G = np.cumsum(g[sl], axis=0)
        if G.ndim == 1:  # per head: exp(G) scales the rows of K S0 and Q S0
            E = np.exp(G[:, None] - G[None, :])
            A, P = (Kc @ Kc.T) * E, (Q @ Kc.T) * E
            Xk = np.exp(G)[:, None] * (_bf16(Kc) @ _bf16(S))
            Xq = np.exp(G)[:, None] * (_bf16(Q) @ _bf16(S))
            kd, dec = Kc * np.exp(G[-1] - G)[:, None], np.full(K, np.exp(G[-1]))
        else:  # per channel: exp(G) scales K and Q
            E = np.exp(G[:, None, :] - G[None, :, :])
            A = np.einsum("tc,sc,tsc->ts", Kc, Kc, E)
            P = np.einsum("tc,sc,tsc->ts", Q, Kc, E)
            Xk = _bf16(Kc * np.exp(G)) @ _bf16(S)
            Xq = _bf16(Q * np.exp(G)) @ _bf16(S)
            kd, dec = Kc * np.exp(G[-1] - G), np.exp(G[-1])
        U = b[:, None] * (v[sl] - Xk)
        for t in range(len(b)):
            U[t] -= b[t] * (A[t, :t] @ U[:t])
        out[sl] = Xq + np.tril(P) @ U
        S = dec[:, None] * S + _bf16(kd).T @ _bf16(U)
    return out, S


TWIN_REL = 5e-4  # x the largest twin value: the kernel's float32 arithmetic (and its vector exp)
#                  against the twin's float64 lands an occasional operand on the other side of a
#                  bf16 rounding tie (a 2^-8 change of one element); measured 4e-7 to 1.02e-4
#                  (T = 97 to 1024). 30x inside the reference's tolerance (4 x 2^-8).


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("T, K, V", [(15, 33, 70), (97, 48, 32), (200, 128, 64)])
def test_matches_its_rounding_twin(amx_isa, rng, T, K, V, gate):
    """The kernel computes what its documented roundings give, far inside the reference's
    tolerance: a misplaced pair or a dropped row shows up here at the 1e-2 level."""
    q, k, v, g, beta = inputs(rng, 1, T, 1, 1, K, V, per_channel=gate == "channel")
    s0 = state0(rng, 1, 1, K, V)
    o, s = attnx.gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=s0,
        qk_l2norm=True,
        output_final_state=True,
        _mode="chunked",
    )
    f64 = lambda x: x[0, :, 0].astype(np.float64)  # noqa: E731
    to, ts = tiles_twin(f64(q), f64(k), f64(v), f64(g), f64(beta), s0[0, 0])
    np.testing.assert_allclose(s[0, 0], ts, rtol=0, atol=TWIN_REL * np.abs(ts).max())
    o_err = np.abs(o[0, :, 0].astype(np.float64) - to).max()
    assert o_err <= 2.0**-8 * np.abs(to).max() + TWIN_REL * np.abs(to).max()  # + its bf16 rounding
