"""PagedKVCache modes for model variants: sliding-window block release and MLA's latent values."""

import numpy as np
import pytest

import attnx
from attnx import reference


def _decode(cache, seq, steps, rng, hq, layer=0):
    """Runs `steps` (new-token counts) on one sequence; returns outputs and the K/V written."""
    ks, vs, outs = [], [], []
    for n in steps:
        st = cache.begin_step([seq], [n])
        q = rng.standard_normal((n, hq, cache.head_dim), dtype=np.float32)
        k = rng.standard_normal((n, cache.num_kv_heads, cache.head_dim), dtype=np.float32)
        v = (
            None
            if cache.value_from_key
            else rng.standard_normal((n, cache.num_kv_heads, cache.value_dim), dtype=np.float32)
        )
        outs.append((q, st.attend(layer, q, k, v)))
        ks.append(k)
        vs.append(k[..., : cache.value_dim] if v is None else v)
    return outs, np.concatenate(ks), np.concatenate(vs)


@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_window_matches_reference_and_releases_blocks(window):
    rng = np.random.default_rng(window)
    cache = attnx.PagedKVCache(1, 2, 8, num_blocks=64, block_size=4, sliding_window=window)
    a = cache.new_sequence()
    steps = [7, 1, 1, 9, 1, 20, 1, 1]
    outs, K, V = _decode(cache, a, steps, rng, hq=4)
    start = 0
    for (q, o), n in zip(outs, steps):
        end = start + n
        r = reference.attention(
            q,
            K[:end],
            V[:end],
            causal=True,
            layout="bshd",
            window=(window - 1, None),
            out_dtype=np.float64,
        )
        np.testing.assert_allclose(o, r, atol=2e-6)
        start = end
    table = cache.block_table(a)
    total = sum(steps)
    # blocks wholly before the last step's first window are gone
    first_live = max(0, total - steps[-1] - window + 1) // 4
    assert (table[:first_live] == -1).all() and (table[first_live:] >= 0).all()
    assert cache.num_used_blocks == len(table) - first_live
    cache.free(a)
    assert cache.num_free_blocks == 64


def test_sliding_window_rollback_limits_and_fork():
    cache = attnx.PagedKVCache(1, 1, 4, num_blocks=32, block_size=4, sliding_window=6)
    rng = np.random.default_rng(0)
    a = cache.new_sequence()
    _decode(cache, a, [20, 1], rng, hq=1)
    b = cache.fork(a)  # released entries stay released in the fork; refcounts skip them
    cache.truncate(a, 19)  # the next token needs keys 14.., still held
    with pytest.raises(ValueError, match="length"):
        cache.truncate(a, 5)
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks == 32


def test_sliding_window_rejects_wider_attend_window():
    cache = attnx.PagedKVCache(1, 1, 4, num_blocks=8, block_size=4, sliding_window=3)
    a = cache.new_sequence()
    st = cache.begin_step([a], [2])
    x = np.zeros((2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="window"):
        st.attend(0, x, x, x, window=(5, None))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_latent_values_are_key_prefix(dtype):
    """DeepSeek MLA decode: one latent kv head, key width 576 (512 latent + 64 rope), values the
    first 512 features, many query heads; stored once."""
    rng = np.random.default_rng(1)
    cache = attnx.PagedKVCache(
        2, 1, 576, num_blocks=16, block_size=16, dtype=dtype, value_dim=512, value_from_key=True
    )
    assert cache.v_pages(1).shape == (16, 1, 16, 512)
    assert np.shares_memory(cache.v_pages(1), cache.k_pages(1))
    assert cache.stats()["bytes_per_token"] == 2 * 576 * np.dtype(cache.dtype).itemsize
    a = cache.new_sequence()
    outs, K, V = _decode(cache, a, [30, 1, 1], rng, hq=16, layer=1)
    K = K.astype(cache.dtype).astype(np.float32)
    start = 0
    for q, o in outs:
        end = start + q.shape[0]
        r = reference.attention(
            q, K[:end], K[:end, :, :512], causal=True, layout="bshd", out_dtype=np.float64
        )
        np.testing.assert_allclose(o, r, atol=2e-5)
        start = end
    st = cache.begin_step([a], [1])
    x = np.zeros((1, 1, 576), np.float32)
    with pytest.raises(ValueError, match="v"):
        st.attend(0, np.zeros((1, 16, 576), np.float32), x, np.zeros((1, 1, 512), np.float32))


def test_latent_requires_value_dim_within_keys():
    with pytest.raises(ValueError, match="value_dim"):
        attnx.PagedKVCache(1, 1, 8, num_blocks=4, value_dim=16, value_from_key=True)
