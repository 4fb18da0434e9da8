"""The amx path's chunked gated delta rule over bf16 inputs: its products against the state run on
AMX-BF16 tiles (cpp/src/kernels/delta_amx-inl.h), with operands packed as bf16 pairs into whole
16 x 32 tiles. The shapes here put data at every edge of that layout (chunks of fewer than 16
tokens and odd ones, K and V not multiples of 32, K != V, a state whose rows end inside a tile),
and the gates at its semantics' edges (exact zeros, resets, packed sequences). Tolerance:
helpers.delta's DELTA_TILE_ERR bf16 unit roundoffs of the largest reference value."""

from __future__ import annotations

import numpy as np
import pytest

import attnx

from helpers import BF16, check_delta_rule, has_amx

pytestmark = pytest.mark.skipif(
    not has_amx(), reason="CPU lacks AMX-BF16, or the OS did not grant the tile state"
)


@pytest.fixture
def amx():
    previous = attnx.cpu_features()["isa"]
    attnx._core.set_isa("amx")
    try:
        yield
    finally:
        attnx._core.set_isa(previous)


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
def test_tile_shapes_match_reference(amx, rng, T, K, V, gate):
    q, k, v, g, beta = inputs(rng, 2, T, 1, 2, K, V, per_channel=gate == "channel")
    check_delta_rule(
        q, k, v, g, beta, initial_state=state0(rng, 2, 2, K, V), qk_l2norm=True, _mode="chunked"
    )


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_gates_with_zeros_and_resets(amx, rng, gate):
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


def test_cu_seqlens_packed(amx, rng):
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


def test_tiles_run_and_threads_agree(amx, rng):
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
