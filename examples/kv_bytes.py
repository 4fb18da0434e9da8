"""KV-cache bytes per token for MHA, GQA and MLA at the same model width, and an MLA decode.

The seed: "DeepSeek's multi-head latent attention reduces the amount of key/value state that
must be cached". This script computes by how much, from the tensor shapes (and checks each figure
against an actual ``attnx.PagedKVCache``, with ``value_from_key=True`` for MLA), for a
DeepSeek-V2-like width: d_model 5120, 128
query heads of width 128, 60 layers, bf16 storage.

- MHA caches K and V for every head:           2 x 128 heads x 128
- GQA (8 kv heads) caches K and V for 8 heads:  2 x   8 heads x 128
- MLA caches one latent row per token: 512 latent features + 64 rotary features. In the
  absorbed form used at decode time, that row *is* the single kv head's key (width 576) and its
  first 512 features are the value (width 512): W_UK and W_UV are folded into the query and
  output projections, so nothing else is stored.

Then it runs such an MLA decode step with ``attnx.paged_attention``: 16 query heads against one
latent kv head whose values are a zero-copy view ``k_pages[..., :512]`` of the key pages, and
checks it against ``attnx.reference.paged_attention`` and against a contiguous copy of the
values; then decodes through a ``PagedKVCache(value_from_key=True)`` step.

    python examples/kv_bytes.py
"""

from __future__ import annotations

import argparse
import math

import numpy as np

import attnx
from attnx import reference as ref

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency of attnx
    BF16 = None


def kv_configs(d_model=5120, heads=128, head_dim=128, gqa_kv_heads=8, latent=512, rope=64):
    """(name, kv heads, key width, value width, stored widths per token) of each design."""
    # d_model only sets the model's width; like DeepSeek-V2, heads x head_dim (16384) need not
    # equal it: every design below serves the same 128 query heads of one 5120-wide model
    return [
        # name, kv heads, Dk, Dv, values stored separately?
        ("MHA", heads, head_dim, head_dim, True),
        (f"GQA ({gqa_kv_heads} kv heads)", gqa_kv_heads, head_dim, head_dim, True),
        (f"MLA (latent {latent} + rope {rope})", 1, latent + rope, latent, False),
    ]


def bytes_per_token_per_layer(kv_heads, dk, dv, separate_values, itemsize):
    """Bytes one token adds to one layer's cache, from the shapes of what is stored."""
    k = kv_heads * dk
    v = kv_heads * dv if separate_values else 0  # MLA: V is a view of K's first dv features
    return (k + v) * itemsize


def cache_bytes_per_token(kv_heads, dk, dv, separate_values, dtype):
    """The same figure from an actual cache: one layer, one block (MLA: values are a view of the
    keys, value_from_key=True, so only the latent rows are stored)."""
    cache = attnx.PagedKVCache(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=dk,
        value_dim=dv,
        num_blocks=1,
        block_size=16,
        dtype=dtype,
        value_from_key=not separate_values,
    )
    return cache.stats()["bytes_per_token"]


def table(args):
    itemsize = np.dtype(args.dtype).itemsize if args.dtype != "bfloat16" else 2
    print(
        f"Model width d_model={args.d_model}, {args.heads} query heads x head_dim "
        f"{args.head_dim}, {args.layers} layers, {args.dtype} storage"
    )
    print(
        f"{'design':34s} {'kv heads':>8s} {'Dk':>5s} {'Dv':>5s} {'B/token/layer':>14s} "
        f"{'x MHA':>7s} {'PagedKVCache':>13s} {'GiB @ ctx':>10s}"
    )
    rows = []
    mha = None
    for name, hkv, dk, dv, separate in kv_configs(
        args.d_model, args.heads, args.head_dim, args.gqa_kv_heads, args.latent, args.rope
    ):
        b = bytes_per_token_per_layer(hkv, dk, dv, separate, itemsize)
        mha = mha or b
        measured = cache_bytes_per_token(hkv, dk, dv, separate, args.dtype)
        assert measured == b, (measured, b)
        measured_s = f"{measured}"
        total = b * args.layers * args.context / 2**30
        print(
            f"{name:34s} {hkv:8d} {dk:5d} {dv:5d} {b:14,d} {b / mha:7.4f} {measured_s:>13s} "
            f"{total:10.2f}"
        )
        rows.append((name, b))
    print(f"(GiB @ ctx: one sequence of {args.context} tokens across all {args.layers} layers)")
    print(
        f"MHA / GQA = {rows[0][1] / rows[1][1]:.0f}x, MHA / MLA = {rows[0][1] / rows[2][1]:.1f}x, "
        f"GQA / MLA = {rows[1][1] / rows[2][1]:.2f}x"
    )
    return rows


def latent_pool(rng, seq_lens, bs, dk, latent):
    """A pool of latent rows (num_blocks, 1 kv head, block_size, dk) handed out shuffled to
    sequences of ``seq_lens``, its values a zero-copy view of the keys' first ``latent``
    features; returns (k_pages, v_pages, block tables)."""
    blocks_per_seq = -(-seq_lens // bs)
    num_blocks = int(blocks_per_seq.sum()) + 3
    k_pages = rng.standard_normal((num_blocks, 1, bs, dk)).astype(np.float32)
    v_pages = k_pages[..., :latent]  # zero-copy: the value is the latent part of the key
    assert np.shares_memory(v_pages, k_pages) and v_pages.base is not None
    ids = rng.permutation(num_blocks)
    tables = np.zeros((len(seq_lens), blocks_per_seq.max()), np.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = ids[start : start + n]
        start += n
    return k_pages, v_pages, tables


def mla_paged(k_pages, v_pages, tables, seq_lens, q, scale, latent):
    """``attnx.paged_attention`` with the values a view of the keys, against the reference and
    against a contiguous copy of the values (and, where bf16 exists, over bf16 pages); returns
    the float32 error."""
    out = attnx.paged_attention(q, k_pages, v_pages, tables, seq_lens, scale=scale)
    want = ref.paged_attention(
        q, k_pages, v_pages, tables, seq_lens, scale=scale, out_dtype=np.float64
    )
    err = float(np.abs(out - want).max())
    copy = attnx.paged_attention(
        q, k_pages, np.ascontiguousarray(v_pages), tables, seq_lens, scale=scale
    )
    print(
        f"  out {out.shape}; max |kernel - reference| = {err:.2e}; view vs contiguous copy "
        f"identical: {bool(np.array_equal(out, copy))}"
    )
    assert err < 1e-5, err
    assert np.array_equal(out, copy)

    if BF16 is not None:
        kb = k_pages.astype(BF16)
        out_b = attnx.paged_attention(q, kb, kb[..., :latent], tables, seq_lens, scale=scale)
        want_b = ref.paged_attention(
            q, kb, kb[..., :latent], tables, seq_lens, scale=scale, out_dtype=np.float64
        )
        err_b = float(np.abs(out_b - want_b).max())
        print(f"  bf16 pages (the storage DeepSeek uses): max |kernel - reference| = {err_b:.2e}")
        assert err_b < 1e-4, err_b
    return err


def mla_cache_decode(rng, hq, dk, latent, bs, scale):
    """The same through a PagedKVCache step: value_from_key stores the latent rows once and
    attend() reads the values from them. A prompt, then decode steps; the last step is checked
    against the reference."""
    cache = attnx.PagedKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=dk,
        value_dim=latent,
        num_blocks=32,
        block_size=bs,
        value_from_key=True,
    )
    seq = cache.new_sequence()
    rows = []
    for n_new in (40, 1, 1, 1):  # a prompt, then decode steps
        c_kv = rng.standard_normal((n_new, 1, dk)).astype(np.float32)  # new latent rows
        q_new = rng.standard_normal((n_new, hq, dk)).astype(np.float32)
        rows.append(c_kv)
        out = cache.begin_step([seq], [n_new]).attend(0, q_new, c_kv, scale=scale)
    hist = np.concatenate(rows)  # (T, 1, 576)
    want = ref.attention(
        q_new,
        hist,
        hist[..., :latent],
        causal=True,
        layout="bshd",
        scale=scale,
        out_dtype=np.float64,
    )
    err_c = float(np.abs(out - want).max())
    st = cache.stats()
    print(
        f"  PagedKVCache(value_from_key=True): {st['tokens_stored']} tokens, "
        f"{st['bytes_per_token']} bytes/token (float32), last decode step vs reference: "
        f"{err_c:.2e}"
    )
    assert err_c < 1e-5, err_c


def mla_decode(args, rng):
    print()
    print("MLA decode over the paged cache: one latent kv head, Dk = 576, Dv = 512 (a view)")
    latent, rope, hq, bs = args.latent, args.rope, args.mla_heads, 16
    dk = latent + rope
    seq_lens = np.array([1, 37, 250, 16, 129])
    k_pages, v_pages, tables = latent_pool(rng, seq_lens, bs, dk, latent)
    # absorbed queries: [q_nope W_UK, q_rope]
    q = rng.standard_normal((len(seq_lens), hq, dk)).astype(np.float32)
    # DeepSeek scales by the un-absorbed query-key width (128 + 64), not by 576
    scale = 1.0 / math.sqrt(args.head_dim + rope)
    print(
        f"  q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} "
        f"(strides {v_pages.strides}: a view), seq_lens {seq_lens.tolist()}"
    )
    err = mla_paged(k_pages, v_pages, tables, seq_lens, q, scale, latent)
    print(f"  stored per token: {dk} values ({dk * 2} bytes in bf16) for all {hq} query heads")
    mla_cache_decode(rng, hq, dk, latent, bs, scale)
    return err


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=5120)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--gqa-kv-heads", type=int, default=8)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--mla-heads", type=int, default=16, help="query heads in the MLA decode demo")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = table(args)
    mla_decode(args, np.random.default_rng(args.seed))
    return rows


if __name__ == "__main__":
    main()
