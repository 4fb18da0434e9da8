"""Context-parallel decode: one long context's KV cache split over the ranks of a process group.

    torchrun --nproc-per-node 4 examples/context_parallel.py            # 4 local processes
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 examples/context_parallel.py --context 1048576   # 2 machines

Each rank keeps its share of the context (blocks of ``--block-size`` tokens dealt round-robin) in
its own ``attnx.PagedKVCache``; at every decode step each rank attends over its share and the
ranks all-gather and merge their (output, lse) pairs, so every rank has the exact result. The
script prints per-rank KV memory, step time and bytes communicated per step, then decodes the same
context in one process on rank 0 (unless ``--no-single``) and compares. Without torchrun it runs
as a group of one. Random keys, values and queries stand in for a model's projections (the same
on every rank, as a replicated model's would be).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import numpy as np

import attnx
import attnx.distributed as ad

try:
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover
    raise SystemExit("this example needs PyTorch: pip install torch") from exc


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8192, help="tokens of context before decoding")
    p.add_argument("--steps", type=int, default=16, help="decode steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk (tokens per step)")
    p.add_argument(
        "--timeout", type=float, default=120, help="seconds before a silent rank is an error"
    )
    p.add_argument("--no-single", action="store_true", help="skip the one-process comparison")
    return p.parse_args()


def init_group(timeout_s):
    """torchrun's environment, or a group of one when run as a plain script."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the timeout bounds every collective: a rank that dies or stops answering becomes an error
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def tokens(args, what, index, layer, n, heads, width):
    """Stand-in projections, a function of (what, index, layer): the same on every rank."""
    rng = np.random.default_rng([7, what, index, layer])
    return rng.standard_normal((n, heads, width)).astype(np.float32)


def prefill(args, cache, seq):
    for c, start in enumerate(range(0, args.context, args.chunk)):
        n = min(args.chunk, args.context - start)
        step = cache.begin_step([seq], [n])
        for layer in range(args.layers):
            q = tokens(args, 0, c, layer, n, args.q_heads, args.head_dim)
            k = tokens(args, 1, c, layer, n, args.kv_heads, args.head_dim)
            v = tokens(args, 2, c, layer, n, args.kv_heads, args.head_dim)
            step.attend(layer, q, k, v)


def decode(args, cache, seq):
    """Decode ``args.steps`` tokens; returns (last step's outputs per layer, seconds per step)."""
    times, outs = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step = cache.begin_step([seq], [1])
        outs = []
        for layer in range(args.layers):
            q = tokens(args, 3, i, layer, 1, args.q_heads, args.head_dim)
            k = tokens(args, 4, i, layer, 1, args.kv_heads, args.head_dim)
            v = tokens(args, 5, i, layer, 1, args.kv_heads, args.head_dim)
            outs.append(step.attend(layer, q, k, v))
        times.append(time.perf_counter() - t0)
    return outs, np.array(times)


def pool_blocks(args, world):
    """Blocks per rank: its share of the context and the decoded tokens, with one spare."""
    per_rank = -(-(args.context + args.steps) // (args.block_size * world)) + 1
    return per_rank


def main():
    args = parse_args()
    rank, world = init_group(args.timeout)
    cache = ad.ShardedPagedKVCache(
        args.layers,
        args.kv_heads,
        args.head_dim,
        num_blocks=pool_blocks(args, world),
        block_size=args.block_size,
        dtype=args.dtype,
    )
    seq = cache.new_sequence()
    t0 = time.perf_counter()
    prefill(args, cache, seq)
    prefill_s = time.perf_counter() - t0
    outs, times = decode(args, cache, seq)

    stats = cache.stats()
    # per decode step and layer, each rank sends one (out, lse) pair per query head (float32)
    # and a status word, and receives every rank's; begin_step adds two int64 (status, checksum)
    sent = args.layers * (args.q_heads * (args.head_dim + 1) + 1) * 4 + 2 * 8
    row = dict(
        rank=rank,
        tokens=stats["tokens_stored"],
        kv_mib=stats["bytes_used"] / 2**20,
        step_ms=1e3 * float(np.median(times)),
        sent=sent,
        received=sent * world,
        prefill_s=prefill_s,
    )
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(
            f"context {args.context} tokens + {args.steps} decoded, {args.layers} layers, Hq {args.q_heads}, "
            f"Hkv {args.kv_heads}, D {args.head_dim}, {args.dtype} KV, {world} rank(s), "
            f"block {args.block_size} dealt round-robin"
        )
        print(
            f"{'rank':>4} {'tokens':>9} {'KV MiB':>9} {'step ms':>9} {'sent B/step':>12} "
            f"{'recv B/step':>12} {'prefill s':>10}"
        )
        for r in rows:
            print(
                f"{r['rank']:>4} {r['tokens']:>9} {r['kv_mib']:>9.2f} {r['step_ms']:>9.2f} "
                f"{r['sent']:>12} {r['received']:>12} {r['prefill_s']:>10.2f}"
            )
        kv_total = sum(r["kv_mib"] for r in rows)
        print(
            f"KV in all: {kv_total:.2f} MiB; per rank {kv_total / world:.2f} MiB. Communication per "
            f"step: {rows[0]['received'] / 1024:.1f} KiB received per rank, against "
            f"{kv_total / world * 1024:.0f} KiB of KV that stays put on each"
        )
        if not args.no_single:
            compare_single(args, outs, times)
    dist.barrier()
    dist.destroy_process_group()


def compare_single(args, outs, times):
    """The same context decoded by one process with one PagedKVCache."""
    cache = attnx.PagedKVCache(
        args.layers,
        args.kv_heads,
        args.head_dim,
        num_blocks=-(-(args.context + args.steps) // args.block_size) + 1,
        block_size=args.block_size,
        dtype=args.dtype,
    )
    seq = cache.new_sequence()
    prefill(args, cache, seq)
    single_outs, single_times = decode(args, cache, seq)
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(outs, single_outs))
    print(
        f"one process: step {1e3 * float(np.median(single_times)):.2f} ms, "
        f"KV {cache.stats()['bytes_used'] / 2**20:.2f} MiB; "
        f"largest difference from the distributed result {err:.2e}"
    )


if __name__ == "__main__":
    main()
