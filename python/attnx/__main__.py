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
    names = ("sse2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16",
             "neon", "dotprod", "bf16", "i8mm", "sve")
    flags = ", ".join(k for k in names if f.get(k)) or "none of the extensions attnx has kernels for"
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
    print("  your own shape: python -m attnx bench --case prefill|decode|paged-decode --heads 32:8 "
          "--seq 2048 --context 4096 ...; a model: python -m attnx bench --config config.json")
    return 0 if err < 1e-5 else 1


def _lengths(text):
    """``"512,2048"`` -> [512, 2048] (argparse type of --seq / --context)."""
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected positive lengths like 2048 or 512,2048, got {text!r}")
    return xs


def _bench_parser(sub):
    b = sub.add_parser("bench", help="measure this machine's limits and time attnx against the "
                                     "NumPy reference, torch SDPA and onnxruntime GQA")
    b.add_argument("--quick", action="store_true",
                   help="fewer samples and a smaller reference shape (about a minute)")
    b.add_argument("--threads", type=int, default=None,
                   help="threads for attnx and its peers (default: attnx.get_num_threads())")
    b.add_argument("--repeat", type=int, default=None,
                   help="interleaved repetitions per row (default 7, --quick 3)")
    b.add_argument("--json", metavar="FILE", default=None, help="save everything, with machine info")
    b.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart (needs matplotlib)")
    b.add_argument("--tiny", action="store_true",
                   help="tiny shapes for smoke tests (also ATTNX_BENCH_TINY=1); numbers are meaningless")
    b.add_argument("--in-loop", action="store_true",
                   help="add rows timing attnx's prefill right after a 1024x1024 NumPy / torch "
                        "matmul, as in a model's loop, against the same call alone")
    own = b.add_argument_group("your own shape (instead of the fixed suite)")
    own.add_argument("--case", choices=("prefill", "decode", "paged-decode"),
                     help="time one shape: causal prefill (S queries on S keys), decode (one query "
                          "on L contiguous keys) or paged-decode (one query on L keys in pages)")
    own.add_argument("--config", metavar="config.json",
                     help="a Hugging Face model config: time its prefill at every --seq and its "
                          "paged decode at every --context")
    own.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    own.add_argument("--heads", default="32:8", help="query:KV heads, e.g. 32:8, or one number (default 32:8)")
    own.add_argument("--seq", type=_lengths, action="append", metavar="S[,S...]",
                     help="prefill length(s) (default 2048; --config: 512,2048)")
    own.add_argument("--context", type=_lengths, action="append", metavar="L[,L...]",
                     help="decode context length(s) (default 4096)")
    own.add_argument("--head-dim", type=int, default=128, help="head dimension D (default 128)")
    own.add_argument("--kv-dtype", choices=("fp32", "fp16", "bf16", "int8", "fp8"), default="fp32",
                     help="dtype of K and V (prefill: of q, k and v too; default fp32). int8 and fp8 "
                          "(e4m3, with per-token scales) are paged-decode only; --config then runs "
                          "its prefill rows in fp32")
    own.add_argument("--block-size", type=int, default=16, help="paged-decode tokens per page (default 16)")
    own.add_argument("--window", type=int, default=None,
                     help="sliding window: keys each query sees, itself included")
    own.add_argument("--no-causal", action="store_true", help="prefill without the causal mask")
    return b


def _own_cases(args, parser):
    """The cases --case / --config ask for (None: the fixed suite); errors name the flag."""
    from .bench import _cases

    if args.case is None and args.config is None:
        return None, None
    if args.case and args.config:
        parser.error("--case and --config: give one of them")
    for flag in ("batch", "head_dim", "block_size", "window"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected a positive number, got {value}")
    flat = lambda xs: [n for x in xs for n in x] if xs else None  # noqa: E731
    seqs, contexts = flat(args.seq), flat(args.context) or [4096]
    try:
        if args.config:
            model, cases = _cases.from_config(args.config, batch=args.batch, seqs=seqs or [512, 2048],
                                              contexts=contexts, kv_dtype=args.kv_dtype,
                                              block=args.block_size, quick=args.quick)
            return cases, (f"model {model['name']}: heads {model['heads'][0]}:{model['heads'][1]}, "
                           f"head dim {model['head_dim']}, sliding window {model['window'] or 'none'}")
        cases = _cases.custom(args.case, batch=args.batch, heads=_cases.parse_heads(args.heads),
                              seqs=seqs or [2048], contexts=contexts, head_dim=args.head_dim,
                              kv_dtype=args.kv_dtype, block=args.block_size, window=args.window,
                              causal=not args.no_causal, quick=args.quick)
        return cases, None
    except ValueError as e:
        parser.error(str(e))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m attnx", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    b = _bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        return info()
    from . import bench

    cases, title = _own_cases(args, b)
    bench.run(threads=args.threads, repeat=args.repeat, quick=args.quick, tiny=args.tiny,
              json_path=args.json, plot_path=args.plot, cases=cases, in_loop=args.in_loop, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
