"""``python -m attnx``: what this machine runs (version, instruction set, threads) and the seed's
two-head worked example; ``python -m attnx bench``: the side-by-side benchmark (attnx.bench)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

import attnx


def _fmt(xs):
    return "[" + ", ".join(f"{x:.3f}" for x in np.ravel(xs)) + "]"


def info():
    f = attnx.cpu_features()
    flags = ", ".join(k for k in ("sse2", "avx2", "fma", "f16c", "avx512f") if f.get(k))
    print(f"attnx {attnx.__version__}")
    print(f"instruction set: {f['isa']} (CPU offers: {flags})")
    print(f"threads: {attnx.get_num_threads()} (attnx's own pool, fork-safe)")
    print()
    # The seed's multi-head example: three tokens, four features, two heads of two features each,
    # each head using its slice of X as Q = K = V, scale 1/sqrt(2) (the default for d_k = 2).
    words = ["river", "bank", "flooded"]
    X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.float32)
    heads = np.stack([X[:, 0:2], X[:, 2:4]])              # (H=2, S=3, D=2)
    out = attnx.attention(heads, heads, heads)             # (2, 3, 2)
    weights = attnx.reference.attention_weights(heads, heads)
    ref = attnx.reference.attention(heads, heads, heads)
    concat = np.concatenate([out[0], out[1]], axis=-1)     # (3, 4)
    print("Worked example (the seed's two heads): X rows river / bank / flooded")
    for w, row in zip(words, X):
        print(f"  {w:8s} {_fmt(row)}")
    print("  head 1 = features 0,1; head 2 = features 2,3; Q = K = V; scale 1/sqrt(2)")
    print(f"  head 1 weights for 'river': {_fmt(weights[0, 0])}")
    print(f"  head 1 output for 'river':  {_fmt(out[0, 0])}")
    print(f"  head 2 output for 'river':  {_fmt(out[1, 0])}")
    print(f"  concatenated for 'river':   {_fmt(concat[0])}")
    err = float(np.max(np.abs(out - ref)))
    print(f"  attnx vs the NumPy reference: max |diff| = {err:.1e}")
    print()
    print("Benchmark: python -m attnx bench [--quick] [--threads N] [--json FILE] [--plot FILE.png]")
    return 0 if err < 1e-5 else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m attnx", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    b = sub.add_parser("bench", help="measure this machine's limits and time the suite "
                                     "against the NumPy reference and torch SDPA")
    b.add_argument("--quick", action="store_true",
                   help="fewer samples and a smaller reference shape (about a minute)")
    b.add_argument("--threads", type=int, default=None,
                   help="threads for attnx and torch (default: attnx.get_num_threads())")
    b.add_argument("--repeat", type=int, default=None,
                   help="interleaved repetitions per row (default 7, --quick 3)")
    b.add_argument("--json", metavar="FILE", default=None, help="save everything, with machine info")
    b.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart (needs matplotlib)")
    b.add_argument("--tiny", action="store_true",
                   help="tiny shapes for smoke tests (also ATTNX_BENCH_TINY=1); numbers are meaningless")
    args = parser.parse_args(argv)
    if args.command is None:
        return info()
    from . import bench

    bench.run(threads=args.threads, repeat=args.repeat, quick=args.quick, tiny=args.tiny,
              json_path=args.json, plot_path=args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
