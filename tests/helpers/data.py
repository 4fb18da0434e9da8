"""Seeds, dtypes and data: the seeded generators, standard normal arrays, the scores that climb
for the lazy running max, and scrambled paged pools."""

from __future__ import annotations

import os
import zlib

import ml_dtypes
import numpy as np

SEED = int(os.environ.get("ATTNX_TEST_SEED", "0"))
BF16 = np.dtype(ml_dtypes.bfloat16)
F32_EPS = float(np.finfo(np.float32).eps)


def make_rng(*salt):
    """A generator seeded by ATTNX_TEST_SEED and ``salt`` (any repr-able values): for data drawn
    outside a test function (module constants, helpers, hypothesis-driven draws)."""
    return np.random.default_rng([SEED, zlib.crc32(repr(salt).encode())])


def rand(rng, shape, dtype=np.float32):
    """Standard normal values stored in ``dtype``."""
    return rng.standard_normal(shape).astype(dtype)


# Per-16-key climbs of the scores for the lazy running max (softmax-inl.h kLazyMax = 4): below,
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
        ids = perm[at : at + n]
        at += n
        tables[b, :n] = ids
        for j, blk in enumerate(ids):
            owned[blk, : min(block_size, length - j * block_size)] = True
    return tables, owned


def pool_from_sequences(rng, ks, vs, block_size, *, spare=2, extra_cols=1):
    """A scrambled, NaN-poisoned pool holding sequences ``ks[b], vs[b]`` ((L_b, Hkv, D) arrays of
    the pool's dtype). Returns (k_pages, v_pages, block_tables int64, seq_lens)."""
    Hkv, Dk, Dv, dt = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2], ks[0].dtype
    lens = np.array([len(k) for k in ks], np.int64)
    need = -(-lens // block_size)
    nb = int(need.sum()) + spare
    kp = np.full((nb, Hkv, block_size, Dk), np.nan, dt)
    vp = np.full((nb, Hkv, block_size, Dv), np.nan, dt)
    perm = rng.permutation(nb)
    tables = np.full((len(ks), max(1, int(need.max(initial=0)) + extra_cols)), 1 << 30, np.int64)
    at = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        ids = perm[at : at + need[b]]
        at += need[b]
        tables[b, : need[b]] = ids
        for t in range(len(k)):
            kp[ids[t // block_size], :, t % block_size] = k[t]
            vp[ids[t // block_size], :, t % block_size] = v[t]
    return kp, vp, tables, lens
