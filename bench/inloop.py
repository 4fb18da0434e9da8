"""Attention where a model calls it: right after another thread pool's matrix product (issue 17, item 7).

In a model's loop every attention call follows a matmul run by another pool (OpenBLAS under
NumPy, torch's OpenMP runtime under torch), whose idle threads may keep spinning on the cores
attnx is about to use. This measures attnx's prefill alone and right after each kind of matmul,
interleaved in one run, and prints the slowdowns; ``--threads`` sets every pool's size.

    python bench/inloop.py                 # B1 H8 S2048 D64, 1024x1024 matmuls, 20 rounds
    python bench/inloop.py --quick         # S512, 5 rounds
    OPENBLAS_NUM_THREADS=1 python bench/inloop.py   # the NumPy row without OpenBLAS threads

Prints figures for this machine and moment only: compare rows within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import attnx


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cases(size, rng):
    """name -> the work done right before attention (None: nothing)."""
    a = rng.standard_normal((size, size), dtype=np.float32)
    out = {"alone": None, "after NumPy matmul": lambda: a @ a}
    try:
        import torch
    except ImportError:
        return out
    t = torch.from_numpy(a)
    out["after torch matmul"] = lambda: torch.mm(t, t)
    out["after torch matmul, torch tensors in"] = ("torch", lambda: torch.mm(t, t))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--matmul", type=int, default=1024, help="size of the square matmul before attention"
    )
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument(
        "--threads", type=int, help="attnx and torch threads (OpenBLAS: OPENBLAS_NUM_THREADS)"
    )
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.rounds = 512, 5
    if args.threads:
        attnx.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.heads, args.seq, args.dim), dtype=np.float32)
    work = cases(args.matmul, rng)
    if args.threads and "after torch matmul" in work:
        import torch

        torch.set_num_threads(args.threads)
    q_t = None
    times = {name: [] for name in work}
    for _ in range(args.rounds):
        for name, before in work.items():  # interleaved: every case sees the same machine
            x = q
            if isinstance(before, tuple):
                import torch

                q_t = q_t if q_t is not None else torch.from_numpy(q)
                x, before = q_t, before[1]
            if before is not None:
                before()
            times[name].append(_time(lambda: attnx.attention(x, x, x)))
    base = statistics.median(times["alone"])
    flops = 4 * args.heads * args.seq * args.seq * args.dim
    print(
        f"attnx prefill B1 H{args.heads} S{args.seq} D{args.dim}, {attnx.get_num_threads()} threads, "
        f"median of {args.rounds}:"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:40s} {med * 1e3:8.2f} ms  {flops / med / 1e9:7.1f} GFLOP/s  {med / base:5.2f}x alone"
        )


if __name__ == "__main__":
    main()
