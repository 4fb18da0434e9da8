"""bf16 prefill against fp32 prefill, interleaved (issue 13, item 4: bf16 >= 1.6x our fp32 GFLOP/s).

The full bench times each row on its own, minutes apart; on a shared host the two rows' medians
then swing by more than the margin. This alternates the two calls for a fixed time and prints
the ratio of their best times and of their medians.

    python bench/ratio.py            # B1 H8 S2048 D64
    python bench/ratio.py --gqa      # B1 Hq32 Hkv8 S2048 D128 causal
    python bench/ratio.py --seconds 30

Needs ml_dtypes (a dependency of attnx). Figures are for this machine and moment only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gqa", action="store_true", help="causal GQA, D128, instead of prefill D64")
    ap.add_argument("--seconds", type=float, default=12.0, help="time spent alternating")
    args = ap.parse_args()
    B, Hq, Hkv, S, D = (1, 32, 8, 2048, 128) if args.gqa else (1, 8, 8, 2048, 64)
    rng = np.random.default_rng(0)
    f32 = [rng.standard_normal((B, h, S, D), dtype=np.float32) for h in (Hq, Hkv, Hkv)]
    bf16 = [x.astype(ml_dtypes.bfloat16) for x in f32]
    flops = 4.0 * B * Hq * S * S * D * (0.5 if args.gqa else 1.0)
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    args_of = {"fp32": f32, "bf16": bf16}
    for name in times:  # warm-up: scratch, packed-K buffers, the thread team
        attnx.attention(*args_of[name], causal=args.gqa)
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        for name, xs in args_of.items():
            t = time.perf_counter()
            attnx.attention(*xs, causal=args.gqa)
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    print(
        f"isa {attnx.cpu_features()['isa']}, {attnx.get_num_threads()} threads, "
        f"{len(times['fp32'])} pairs: fp32 {flops / best['fp32'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {flops / best['bf16'] / 1e9:.1f} GFLOP/s; bf16 / fp32: best "
        f"{best['fp32'] / best['bf16']:.2f}x, medians "
        f"{statistics.median(times['fp32']) / statistics.median(times['bf16']):.2f}x"
    )


if __name__ == "__main__":
    main()
