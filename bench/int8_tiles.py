"""Integer queries over int8 pages: AMX-INT8 tiles against the other paths, interleaved (issue 33).

Chunked prefill (512 new tokens of a 4096-token sequence in pages, Hq32 Hkv8 D128, causal):
  tiles  integer queries, Q K^T on int8 tiles (AMX-INT8 where the amx path runs, else emulated)
  vec    integer queries on the vector kernels (set_int8_tiles("off"): FMAs over the codes for
         many rows, VNNI for few)
  float  the float32 query over the dequantised keys (set_int8_query(False))
  bf16   the same problem over bf16 pages (AMX-BF16 on the amx path)
Decode (B8 Hq32 Hkv8 L2048 D128 int8, one query token: 4 rows per kv head), and the crossover:
the tiles forced down to M rows per kv head (--rows: GQA groups of M query heads per kv head),
against VNNI.

    python bench/int8_tiles.py                    # both, 1 thread then 2, 20 s each
    python bench/int8_tiles.py --only decode --rows 4 8 16
    python bench/int8_tiles.py --seconds 5

Each variant is timed in turn inside one loop (interleaved), best and median of its calls; one
thread is timed in this thread's CPU time (time.thread_time), two in wall time. Figures are for
this machine and moment only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

import attnx
from attnx import reference as ref


def pages(rng, B, Hkv, L, D, block):
    """B sequences of L tokens in scrambled blocks: (k, v, tables, lens) as float32."""
    nb = B * L // block
    k = rng.standard_normal((nb, Hkv, block, D), dtype=np.float32)
    v = rng.standard_normal((nb, Hkv, block, D), dtype=np.float32)
    tables = rng.permutation(nb).reshape(B, L // block).astype(np.int32)
    return k, v, tables, np.full(B, L, np.int64)


def variants(q, k, v, tables, lens, q_lens, with_bf16):
    """name -> (setup, call) for one problem."""
    (kq, ks), (vq, vs) = ref.quantize_kv(k, "int8"), ref.quantize_kv(v, "int8")
    kw = dict(k_scales=ks, v_scales=vs, q_lens=q_lens, causal=True)

    def int8(query, tiles, rows=9):
        def setup():
            attnx.set_int8_query(query)
            attnx._core.set_int8_tiles(tiles, rows)

        return setup, lambda: attnx.paged_attention(q, kq, vq, tables, lens, **kw)

    out = {"tiles": int8(True, "auto"), "vec": int8(True, "off"), "float": int8(False, "auto")}
    if with_bf16:
        kb, vb = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
        qb = q.astype(ml_dtypes.bfloat16)
        out["bf16"] = (
            lambda: None,
            lambda: attnx.paged_attention(qb, kb, vb, tables, lens, q_lens=q_lens, causal=True),
        )
    return out


def race(cases, seconds, clock):
    """Alternates the cases for `seconds`; name -> list of times."""
    times = {name: [] for name in cases}
    for setup, call in cases.values():  # warm-up: scratch, packed tiles, the team
        setup()
        call()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, (setup, call) in cases.items():
            setup()
            t = clock()
            call()
            times[name].append(clock() - t)
    attnx.set_int8_query(False)
    attnx._core.set_int8_tiles("auto", 9)
    return times


def report(title, times, base, work=None):
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  {title} ({len(times[base])} rounds)")
    for name in times:
        rate = f", {work / best[name] / 1e9:7.1f} GFLOP/s" if work else ""
        print(
            f"    {name:8s} best {best[name] * 1e3:8.2f} ms, median {med[name] * 1e3:8.2f} ms"
            f"{rate}; {base}/this: best {best[base] / best[name]:.2f}x, "
            f"median {med[base] / med[name]:.2f}x"
        )


def chunked(rng, seconds, clock):
    Hq, Hkv, L, D, new = 32, 8, 4096, 128, 512
    k, v, tables, lens = pages(rng, 1, Hkv, L, D, 16)
    q = rng.standard_normal((new, Hq, D), dtype=np.float32)
    cases = variants(q, k, v, tables, lens, np.array([new]), True)
    flops = 4.0 * Hq * D * (new * (L - new) + new * (new + 1) / 2)
    report("chunked prefill 512 on 4096, Hq32 Hkv8 D128", race(cases, seconds, clock), "vec", flops)


def decode(rng, seconds, clock, rows):
    B, Hkv, L, D = 8, 8, 2048, 128
    k, v, tables, lens = pages(rng, B, Hkv, L, D, 16)
    for m in rows:  # M query heads per kv head: the item's rows
        q = rng.standard_normal((B, Hkv * m, D), dtype=np.float32)
        qkv = (q, k, v, tables, lens, np.ones(B, np.int64))
        cases = variants(*qkv, False)
        cases["tiles"] = variants(*qkv, False)["tiles"]
        setup_t, call_t = cases["tiles"]

        def forced(setup_t=setup_t, m=m):
            setup_t()
            attnx._core.set_int8_tiles("auto", min(m, 9))

        cases["tiles"] = (forced, call_t)
        report(
            f"decode B8 Hq{Hkv * m} Hkv8 L2048 D128 int8: {m} rows per kv head",
            race(cases, seconds, clock),
            "vec",
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="time spent alternating, per shape")
    ap.add_argument("--only", choices=["chunk", "decode"], default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[4], help="decode rows per kv head")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"isa {attnx.cpu_features()['isa']}, amx_int8 {attnx.cpu_features()['amx_int8']}")
    for n in args.threads:
        attnx.set_num_threads(n)
        clock = time.thread_time if n == 1 else time.perf_counter
        print(f"{n} thread(s), {'thread CPU' if n == 1 else 'wall'} time")
        rng = np.random.default_rng(0)
        if args.only in (None, "chunk"):
            chunked(rng, args.seconds, clock)
        if args.only in (None, "decode"):
            decode(rng, args.seconds, clock, args.rows)


if __name__ == "__main__":
    main()
