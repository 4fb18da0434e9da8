"""bf16 prefill, and float32 prefill on bf16 products, against fp32 prefill, interleaved (issue 13,
item 4: bf16 >= 1.6x our fp32 GFLOP/s; issue 33, item 4: float32 callers on bf16 products).

The full bench times each row on its own, minutes apart; on a shared host the rows' medians then
swing by more than the margin. This alternates the calls for a fixed time and prints, per row,
its best time (wall; with one thread also the calling thread's CPU time, which other processes
on the host do not inflate) and its ratios to fp32's best and median.

Rows: fp32; fp32 under ``attnx.set_float32_precision("bf16")``; bf16 inputs; torch's fp32
``scaled_dot_product_attention`` where torch is installed.

    python bench/ratio.py                  # B1 H8 S2048 D64
    python bench/ratio.py --gqa            # B1 Hq32 Hkv8 S2048 D128 causal
    python bench/ratio.py --threads 1 --seconds 30

Needs ml_dtypes (a dependency of attnx). Figures are for this machine and moment only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

import attnx


def calls(
    f32: list[np.ndarray], causal: bool, hq: int, hkv: int
) -> dict[str, Callable[[], object]]:
    """The rows: name -> a call."""
    bf16 = [x.astype(ml_dtypes.bfloat16) for x in f32]

    def on_bf16_products():
        with attnx.set_float32_precision("bf16"):
            return attnx.attention(*f32, causal=causal)

    rows: dict[str, Callable[[], object]] = {
        "fp32": lambda: attnx.attention(*f32, causal=causal),
        "fp32 bf16 products": on_bf16_products,
        "bf16": lambda: attnx.attention(*bf16, causal=causal),
    }
    try:
        import torch
    except ImportError:
        return rows
    tq, tk, tv = (torch.from_numpy(x) for x in f32)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows["torch fp32"] = lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=hq != hkv)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gqa", action="store_true", help="causal GQA, D128, instead of prefill D64")
    ap.add_argument("--seconds", type=float, default=12.0, help="time spent alternating")
    ap.add_argument("--threads", type=int, default=0, help="threads (attnx and torch); 0: default")
    args = ap.parse_args()
    B, Hq, Hkv, S, D = (1, 32, 8, 2048, 128) if args.gqa else (1, 8, 8, 2048, 64)
    if args.threads:
        attnx.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    f32 = [rng.standard_normal((B, h, S, D), dtype=np.float32) for h in (Hq, Hkv, Hkv)]
    rows = calls(f32, args.gqa, Hq, Hkv)
    if args.threads and "torch fp32" in rows:
        import torch

        torch.set_num_threads(args.threads)
    flops = 4.0 * B * Hq * S * S * D * (0.5 if args.gqa else 1.0)
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    for call in rows.values():  # warm-up: scratch, packed-K buffers, the thread team
        call()
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        for name, call in rows.items():
            c, t = time.thread_time(), time.perf_counter()
            call()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.thread_time() - c)
    best = {k: min(v) for k, v in wall.items()}
    print(
        f"isa {attnx.cpu_features()['isa']}, {attnx.get_num_threads()} threads, "
        f"{len(wall['fp32'])} rounds, {'causal GQA D128' if args.gqa else 'D64'}"
    )
    for name in rows:
        line = (
            f"  {name:20s} best {best[name] * 1e3:8.2f} ms ({flops / best[name] / 1e9:6.1f} "
            f"GFLOP/s), x fp32: best {best['fp32'] / best[name]:.2f}, median "
            f"{statistics.median(wall['fp32']) / statistics.median(wall[name]):.2f}"
        )
        if args.threads == 1:
            line += f"; CPU best {min(cpu[name]) * 1e3:.2f} ms, x fp32 "
            line += f"{min(cpu['fp32']) / min(cpu[name]):.2f}"
        print(line)


if __name__ == "__main__":
    main()
