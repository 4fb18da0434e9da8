"""attnx inside Hugging Face ``transformers``: an attention backend and a paged KV cache for ``generate``.

>>> import attnx.hf
>>> attnx.hf.register()                                   # "attnx" joins AttentionInterface
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnx")

``register()`` adds two functions under one name: :func:`attention_forward` (what a model's
attention module calls with its ``(B, H, S, D)`` query/key/value views) and :func:`mask_hook`
(what ``transformers.masking_utils`` calls to build the model's mask once per forward).

The mask contract. transformers builds masks in absolute positions: query ``q_offset + i`` may see
key ``kv_offset + j`` iff the mask function allows it and the 2-D padding mask keeps ``j``.
attnx's ``causal`` is aligned bottom-right, query ``i`` seeing key ``j <= i + (Lk - Sq)``, which is
the same rule exactly when ``Lk = q_offset - kv_offset + Sq``: the keys end where the queries end
(a dynamic cache) or ``kv_lens`` cuts off the unwritten slots of a static one. torch's
``is_causal`` is aligned top-left; where ``sdpa`` leans on it (no mask, ``Sq > 1``) the keys are
cut to ``Sq`` first, as ``sdpa_attention_forward`` does, so both alignments agree.

:func:`mask_hook` returns exactly the mask ``sdpa`` gets (``None`` where ``sdpa`` would use
``is_causal``), so any consumer stays correct, and tags it with what it was made of when that is
a known pattern (causal, bidirectional or causal sliding window, plus 2-D padding).
:func:`attention_forward` then passes the padding as lengths (``kv_lens``: right padding of an
encoder, the free tail of a static cache) or as a ``(B, 1, 1, Sk)`` key mask (left padding), never
as an ``Sq x Sk`` mask; an untagged mask (custom patterns, packed sequences, a user's 4-D mask)
is passed whole, boolean or additive.
"""

from __future__ import annotations

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"attnx.hf needs torch and transformers (>= 5.24): pip install 'attnx[hf]' ({exc})"
    ) from exc

import numpy as np

from ..cache import PagedKVCache
from ..cache.step import packed_tokens as _packed
from ..ops import attention as _api
from . import torch_ops  # noqa: F401  (torch.ops.attnx, and attnx's regions on torch's thread team)
from .tensors import like, to_numpy

__all__ = ["NAME", "PagedCache", "attention_forward", "mask_hook", "register"]

NAME = "attnx"


def register(name=NAME):
    """Registers attnx as ``attn_implementation=name`` (default ``"attnx"``) for every model."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_hook)


# ---- masks ----------------------------------------------------------------------------------------


class _Spec:
    """What a mask from :func:`mask_hook` is made of: ``causal`` (else bidirectional), a causal
    sliding ``window`` (keys ``kv > q - window``) or None, the padding row ``pad`` ``(B, Sk)``
    (None: nothing padded) and ``shift = q_offset - kv_offset``."""

    __slots__ = ("causal", "pad", "shift", "window")

    def __init__(self, causal, window, pad, shift):
        self.causal, self.window, self.pad, self.shift = causal, window, pad, shift


def _closure(fn):
    cells = fn.__closure__ or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _pattern(mask_function):
    """``(causal, window)`` for the mask functions transformers builds its standard masks from;
    None for anything else (which keeps its materialised mask)."""
    if mask_function is causal_mask_function:
        return True, None
    if mask_function is bidirectional_mask_function:
        return False, None
    # sliding_window_causal_mask_function(w) = and_masks(sliding_window_overlay(w), causal_mask_function)
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = _closure(mask_function).get("mask_functions", ())
        if (
            len(parts) == 2
            and parts[1] is causal_mask_function
            and getattr(parts[0], "__qualname__", "")
            == "sliding_window_overlay.<locals>.inner_mask"
        ):
            window = _closure(parts[0]).get("sliding_window")
            if isinstance(window, int) and window > 0:
                return True, window
    return None


def mask_hook(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    allow_is_bidirectional_skip=False,
    use_vmap=False,
    device="cpu",
    **kwargs,
):
    """transformers' mask hook for ``"attnx"``: ``sdpa``'s mask, tagged with what it is made of."""
    mask = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
    pattern = None if mask is None or use_vmap else _pattern(mask_function)
    if pattern is not None:
        pad = None
        if attention_mask is not None:
            kv_offset = int(kv_offset)
            pad = prepare_padding_mask(attention_mask, kv_length, kv_offset)[
                :, kv_offset : kv_offset + kv_length
            ]
            pad = None if bool(pad.all()) else pad.to(torch.bool)
        mask._attnx_spec = _Spec(pattern[0], pattern[1], pad, int(q_offset) - int(kv_offset))
    return mask


def _prefix_lengths(pad):
    """``pad.sum(1)`` if every row is True then False (right padding), else None."""
    lens = pad.sum(1)
    if torch.equal(pad, torch.arange(pad.shape[1]) < lens[:, None]):
        return lens.to(torch.int32)
    return None


def _plan(spec, batch, q_len, kv_len):
    """attnx arguments for a tagged mask: dict(causal, kv_lens, mask, window), or None where the
    materialised mask must be used instead."""
    pad = spec.pad
    if pad is not None and (pad.shape[-1] != kv_len or pad.shape[0] not in (1, batch)):
        return None
    if not spec.causal:
        if pad is None:
            return dict(causal=False, kv_lens=None, mask=None, window=None)
        lens = _prefix_lengths(pad)
        if lens is not None:
            return dict(causal=False, kv_lens=lens, mask=None, window=None)
        return dict(causal=False, kv_lens=None, mask=pad[:, None, None, :], window=None)
    seen = spec.shift + q_len  # keys up to the last query's position: attnx's Lk for bottom-right
    if seen > kv_len or seen < 0:
        return None
    kv_lens = None if seen == kv_len else torch.full((batch,), seen, dtype=torch.int32)
    mask = None
    if pad is not None and not bool(pad[:, :seen].all()):
        mask = pad[:, None, None, :]
    window = None if spec.window is None else (spec.window - 1, None)
    return dict(causal=True, kv_lens=kv_lens, mask=mask, window=window)


def _dense_plan(attention_mask, is_causal, batch, q_len, kv_len):
    """(plan, keys to keep): attnx arguments for whatever mask the model passed."""
    if attention_mask is None:
        # sdpa's rule: is_causal only with a mask-free prefill, and then top-left aligned, which
        # equals bottom-right once the keys are cut to the queries (an empty static cache)
        causal = bool(is_causal) and q_len > 1
        keep = q_len if causal and kv_len > q_len else kv_len
        return dict(causal=causal, kv_lens=None, mask=None, window=None), keep
    spec = getattr(attention_mask, "_attnx_spec", None)
    if (
        spec is not None
        and attention_mask.shape[-2] == q_len
        and attention_mask.shape[-1] == kv_len
    ):
        plan = _plan(spec, batch, q_len, kv_len)
        if plan is not None:
            return plan, kv_len
    return dict(causal=False, kv_lens=None, mask=attention_mask[..., :kv_len], window=None), kv_len


def _sinks(s_aux):
    return None if s_aux is None else s_aux.detach().to(torch.float32)


def _with_position_bias(position_bias, attention_mask, is_causal, query, key, value):
    """sdpa's handling of a learned position bias: (additive mask, key, value)."""
    from transformers.integrations.sdpa_attention import create_position_bias_mask

    q_len = query.shape[2]
    causal = bool(is_causal) and q_len > 1 and attention_mask is None
    if causal and key.shape[2] > q_len:  # sdpa's cut to the queries (an empty static cache)
        key, value, position_bias = (
            key[:, :, :q_len],
            value[:, :, :q_len],
            position_bias[..., :q_len],
        )
    return create_position_bias_mask(position_bias, attention_mask, causal, query, key), key, value


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """transformers' attention interface for ``"attnx"``.

    ``query`` ``(B, Hq, Sq, D)``, ``key``/``value`` ``(B, Hkv, Sk, D)`` as the model made them (GQA
    without ``repeat_kv``, any strides with a contiguous last axis: no copies); returns
    ``(out (B, Sq, Hq, Dv), None)``. ``scaling``, ``softcap`` and ``s_aux`` (per-head sink logits)
    are honoured, and a ``position_bias`` (T5) joins the mask as in ``sdpa``; a sliding window is
    read from the model's mask (``sliding_window`` is what built it).
    """
    if dropout and getattr(module, "training", False):
        raise ValueError(
            "dropout: attnx is inference only; call model.eval() (or use 'sdpa' to train)"
        )
    paged = getattr(key, "_attnx_paged", None)
    if paged is not None:
        return paged.attend(
            module, query, key, value, attention_mask, scaling, softcap, s_aux
        ), None
    batch, heads, q_len, _ = query.shape
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if kwargs.get("position_bias") is not None:  # (T5 and kin) one additive mask, as sdpa makes it
        attention_mask, key, value = _with_position_bias(
            kwargs["position_bias"], attention_mask, is_causal, query, key, value
        )
        is_causal = False
    plan, keep = _dense_plan(attention_mask, is_causal, batch, q_len, key.shape[2])
    if keep != key.shape[2]:
        key, value = key[:, :, :keep], value[:, :, :keep]
    out = query.new_empty((batch, q_len, heads, value.shape[-1]))
    _api.attention(
        query,
        key,
        value,
        scale=scaling,
        softcap=softcap,
        sinks=_sinks(s_aux),
        out=out.transpose(1, 2),
        **plan,
    )
    return out, None


# ---- the paged cache ------------------------------------------------------------------------------


class _PagedLayer(CacheLayerMixin):
    """One model layer's view of a :class:`PagedCache`: ``update`` hands the new keys and values to
    attention (which stores and attends in one call, reading the pages in place)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, parent, index):
        super().__init__()
        self._parent, self._index = parent, index

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._parent._handoff(self._index, key_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length):
        return self._parent.seen + query_length, 0

    def get_seq_length(self):
        return self._parent.seen

    def get_max_length(self):
        return -1

    def crop(self, tokens_to_remove):  # the cache crops all layers at once (PagedCache.crop)
        pass

    def reset(self):
        pass


def _model_shape(config):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return text.num_hidden_layers, kv_heads, head_dim


def _storage(dtype):
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).replace("torch.", "")


class PagedCache(Cache):
    """A ``transformers`` cache whose keys and values live in one :class:`attnx.PagedKVCache`.

    ``model.generate(..., past_key_values=attnx.hf.PagedCache(model.config, num_blocks=...))``
    (with ``attn_implementation="attnx"``): each batch row is one attnx sequence, every step writes
    the new tokens into the pool and attends over the pages in place. Padding tokens (0 in the
    attention mask) are never stored, so left-padded prompts cost no pool memory.

    Parameters
    ----------
    config : the model's ``PretrainedConfig`` (layers, kv heads, head size)
    num_blocks : int
        Pages in the pool; ``num_blocks * block_size`` tokens in all.
    block_size : int
    dtype : ``"float32"``, ``"float16"``, ``"bfloat16"`` or a torch dtype; default: the model's
        key dtype at the first step.
    """

    def __init__(self, config, num_blocks=1024, block_size=16, dtype=None):
        self._shape = _model_shape(config)
        super().__init__(layers=[_PagedLayer(self, i) for i in range(self._shape[0])])
        self._num_blocks, self._block_size, self._dtype = num_blocks, block_size, _storage(dtype)
        self.pool = None  # the PagedKVCache, made at the first step
        self.seq_ids = None  # one attnx sequence per batch row
        self.seen = 0  # positions per row as transformers counts them (padding included)
        self._step = None
        self._valid = None
        self._direct = False
        self._attended = set()
        self._pending = set()

    # -- the step protocol: update() hands over, attention_forward() stores and attends
    def _handoff(self, layer, key_states):
        if layer in self._pending:
            raise RuntimeError(
                "PagedCache: a layer's new keys were never attended; the model must "
                "run with attn_implementation='attnx' (attnx.hf.register() first)"
            )
        self._pending.add(layer)
        key_states._attnx_paged = self

    def _begin(self, batch, q_len, dtype, attention_mask):
        if self.pool is None:
            layers, kv_heads, head_dim = self._shape
            self.pool = PagedKVCache(
                num_layers=layers,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                num_blocks=self._num_blocks,
                block_size=self._block_size,
                dtype=self._dtype or _storage(dtype),
            )
        if self.seq_ids is None:
            self.seq_ids = [self.pool.new_sequence() for _ in range(batch)]
        if len(self.seq_ids) != batch:
            raise ValueError(
                f"PagedCache: holds {len(self.seq_ids)} sequences, the step has batch {batch}"
            )
        valid = _new_tokens(attention_mask, batch, q_len)
        counts = [q_len] * batch if valid is None else valid.sum(1).tolist()
        self._step = self.pool.begin_step(self.seq_ids, counts)
        self._direct = dtype in (
            torch.float32,
            torch.float16,
        )  # the model's tensors view as NumPy as they are
        self._valid = None if valid is None else valid.reshape(-1).nonzero().squeeze(1).numpy()
        self._attended = set()
        self.seen += q_len

    def attend(self, module, query, key, value, attention_mask, scaling, softcap, s_aux):
        """Stores this layer's new keys and values in the pool and attends: ``(B, Sq, Hq, Dv)``."""
        layer = module.layer_idx
        batch, heads, q_len, _ = query.shape
        if self._step is None or layer in self._attended:
            self._begin(batch, q_len, key.dtype, attention_mask)
        self._attended.add(layer)
        self._pending.discard(layer)
        spec = getattr(attention_mask, "_attnx_spec", None)
        window = None if spec is None or spec.window is None else (spec.window - 1, None)
        valid = self._valid
        sinks = None if s_aux is None else to_numpy(_sinks(s_aux), "s_aux")
        # Once per layer and step, inside the model's loop, where every extra step of glue costs
        # several times what it costs alone: NumPy views of the model's tensors, one Step call
        # that reads their (B, H, S, D) layout as it is and returns (B, S, Hq, Dv), no torch op.
        direct = self._direct
        if direct:  # float32 / float16: Tensor.numpy() refuses what to_numpy checks (see there)
            try:
                q, k, v = query.numpy(), key.numpy(), value.numpy()
            except (TypeError, RuntimeError):
                direct = False
        if not direct:
            q, k, v = to_numpy(query, "query"), to_numpy(key, "key"), to_numpy(value, "value")
        if valid is None:
            o = self._step.attend_arrays(
                layer, q, k, v, scale=scaling, softcap=softcap, sinks=sinks, window=window
            )
            return torch.from_numpy(o) if direct else like(o, query)
        # padded rows: only the real tokens are stored and attend, padding rows get zeros
        q, k, v = (_packed(x)[valid] for x in (q, k, v))
        o = self._step.attend_arrays(
            layer, q, k, v, scale=scaling, softcap=softcap, sinks=sinks, window=window
        )
        full = np.zeros((batch * q_len,) + o.shape[1:], o.dtype)
        full[valid] = o
        return like(full.reshape(batch, q_len, heads, o.shape[-1]), query)

    # -- transformers' Cache API, for the whole cache at once
    def get_seq_length(self, layer_idx=0):
        return self.seen

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.seen + query_length, 0

    def reset(self):
        if self.pool is not None and self.seq_ids is not None:
            for s in self.seq_ids:
                self.pool.free(s)
        self.seq_ids, self.seen, self._step, self._pending = None, 0, None, set()

    def crop(self, tokens_to_remove):
        """Drops the last ``-tokens_to_remove`` positions of every row (all of them stored tokens)."""
        n = -tokens_to_remove if tokens_to_remove < 0 else self.seen - tokens_to_remove
        if n <= 0 or self.seq_ids is None:
            return
        for s in self.seq_ids:
            self.pool.truncate(s, self.pool.length(s) - n)
        self.seen -= n
        self._step = None

    def _reselect(self, rows):
        if self.seq_ids is None:
            return
        old = self.seq_ids
        self.seq_ids = [self.pool.fork(old[int(r)]) for r in rows]
        for s in old:
            self.pool.free(s)
        self._step = None

    def reorder_cache(self, beam_idx):
        self._reselect(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats):
        if self.seq_ids is not None:
            self._reselect([r for r in range(len(self.seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices):
        self._reselect(torch.as_tensor(indices).tolist())

    @property
    def is_compileable(self):
        return False


def _new_tokens(attention_mask, batch, q_len):
    """Which of the step's ``q_len`` tokens per row are real (not padding): bool ``(B, Sq)``, or
    None when all are."""
    if attention_mask is None:
        return None
    spec = getattr(attention_mask, "_attnx_spec", None)
    if spec is None or not spec.causal:
        raise ValueError(
            "PagedCache: expected the model's causal mask (built by attnx.hf.mask_hook) or "
            "none; custom 4-D masks need the dense path (a DynamicCache)"
        )
    if spec.pad is None:
        return None
    valid = spec.pad[:, -q_len:].expand(batch, q_len)
    return None if bool(valid.all()) else valid
