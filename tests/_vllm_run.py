"""One vLLM engine, greedy, in this process: what tests/test_vllm.py compares across backends.

    python tests/_vllm_run.py MODEL_DIR {attnx,vllm} OUT.json

Runs the scenarios of tests/test_vllm.py's SCENARIOS (given as JSON on stdin: a list of
``{"name", "prompts", "max_tokens"}``) in order on one ``vllm.LLM`` with chunked prefill (small
``max_num_batched_tokens``) and prefix caching on, and writes each scenario's generated token ids,
attnx's batch counts (attnx.vllm's STATS) and the backend class vLLM used. Run as a script (and
in its own process) because the backend is chosen per process, by ATTNX_VLLM, when vLLM loads
its plugins.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, backend, out_path = sys.argv[1:4]
    scenarios = json.load(sys.stdin)
    os.environ["ATTNX_VLLM"] = "1" if backend == "attnx" else "0"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine here: STATS readable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
              max_num_seqs=8, enable_prefix_caching=True, enforce_eager=True, seed=0,
              block_size=32)
    result: dict = {"tokens": {}}
    for sc in scenarios:
        params = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"], ignore_eos=True)
        outs = llm.generate(sc["prompts"], params, use_tqdm=False)
        result["tokens"][sc["name"]] = [list(o.outputs[0].token_ids) for o in outs]
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    result["backend"] = AttentionBackendEnum.CPU_ATTN.get_path()
    if backend == "attnx":
        from attnx import _vllm

        result["stats"] = dict(_vllm.STATS)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
