"""A step of the paged KV cache: one forward pass over a batch of sequences' new tokens
(:class:`Step`), made by :meth:`attnx.PagedKVCache.begin_step`; it writes each layer's new keys
and values and attends (one ``_core.StepPlan`` for every layer), and advances linear layers'
states."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from .._validate import index as _index
from ..integrations import tensors as _tensors
from ..ops import paged as _api
from .blocks import stack_rows

if TYPE_CHECKING:
    from . import PagedKVCache, SeqState

__all__ = ["StaleStepError", "Step", "packed_tokens"]


_NO_KEYWORDS: dict[str, Any] = {}


class StaleStepError(RuntimeError):
    """A step's sequence was truncated, freed or stepped again after ``begin_step``."""


def _stale(what: str) -> StaleStepError:
    """The error of a call on a step whose sequences changed since it began."""
    return StaleStepError(
        f"{what}: a sequence of this step was truncated, freed or stepped again since begin_step"
    )


class Step:
    """One forward step of a batch of sequences: their new tokens, packed in sequence order.

    Made by :meth:`PagedKVCache.begin_step`. :meth:`attend` takes the new tokens packed,
    ``(T, heads, D)``, or, when every sequence of the step has the same ``S`` new tokens, a
    model's ``(B, Hq, S, head_dim)`` / ``(B, num_kv_heads, S, D)`` arrays as its attention module
    holds them (read in place where the strides allow); the result is then
    ``(B, S, Hq, value_dim)`` (and lse ``(B, S, Hq)``).

    Attributes
    ----------
    seq_ids : list of int
    q_lens : int32 ``(B,)``, new tokens per sequence
    seq_lens : int32 ``(B,)``, tokens per sequence after the step
    positions : int32 ``(T,)``, absolute position of every new token (for RoPE)
    block_tables : int32 ``(B, max_blocks)``
    slots : int64 ``(T,)``, where each new token is written (``block * block_size + offset``)
    num_tokens : int, ``T``
    """

    def __init__(
        self,
        cache: PagedKVCache,
        ids: list[int],
        seqs: list[SeqState],
        starts: list[int],
        counts: list[int],
    ) -> None:
        bs = cache.block_size
        self._cache = cache
        self._seqs = seqs
        self._versions = [s.version for s in seqs]
        self._epoch = cache._epoch
        self.seq_ids = ids
        self.q_lens = np.array(counts, dtype=np.int32)
        self.seq_lens = np.array([s.length for s in seqs], dtype=np.int32)
        self.block_tables = stack_rows([s.row for s in seqs])
        self.num_tokens = sum(counts)
        seq_index = np.repeat(np.arange(len(seqs)), self.q_lens)
        pos = (
            np.arange(self.num_tokens, dtype=np.int64)
            - np.repeat(np.cumsum(self.q_lens, dtype=np.int64) - self.q_lens, self.q_lens)
            + np.array(starts, dtype=np.int64)[seq_index]
        )
        self.positions = pos.astype(np.int32)
        self.slots = self.block_tables[seq_index, pos // bs].astype(np.int64) * bs + pos % bs
        self._starts = starts
        self._shared: Any = None  # the shared-prefix groups, planned at the first attend
        self._step_plan: Any = None  # the _core.StepPlan, made at the first attend
        self._linear_done: set[int] = set()  # linear layers already advanced by this step
        # layers (attention 0 .. num_layers - 1, then linear ones) whose rows or states this step
        # has written: with all of them, the step has ended (_step_written)
        self._written: set[int] = set()
        self._layers = cache.num_layers + cache.linear_layers

    def _wrote(self, layer: int) -> None:
        """Layer ``layer`` (linear ones numbered after the attention layers) has written this
        step's rows; after the last one, the cache counts the step's tokens written. (Layers
        attended from several threads at once: set.add is atomic, and _step_written, if two
        threads both see the set full, does its work once.)"""
        written = self._written
        if layer not in written:
            written.add(layer)
            if len(written) == self._layers:
                self._cache._step_written(self)

    @property
    def shared_prefix(self) -> list[tuple[list[int], int, int]]:
        """The groups of this step's sequences whose shared blocks ``attend`` reads once for all
        of them (by default): ``(seq_ids, first, end)`` each, the table entries ``[first, end)``
        they share (groups nest: the members of an inner group also share everything before
        ``first``); empty when none do (few shared keys, a sliding window)."""
        if self._cache.sliding_window is not None:
            return []
        g = self._shared_groups()
        return [
            ([self.seq_ids[i] for i in rows], p0, p)
            for rows, p0, p in zip(g.rows, g.starts, g.blocks)
        ]

    def _shared_groups(self) -> Any:
        """The groups of this step's sequences that share leading blocks (planned once, for
        every layer)."""
        if self._shared is None:
            from ..ops import cascade as _shared

            self._shared = _shared.plan_groups(
                self.block_tables, self.seq_lens, self.q_lens, self._cache.block_size
            )
        return self._shared

    @_tensors.tensor_io
    def attend(
        self,
        layer: int,
        q: Any,
        k: Any,
        v: Any = None,
        *,
        scale: float | None = None,
        num_threads: int | None = None,
        return_lse: bool = False,
        window: Any = None,
        softcap: float | None = None,
        sinks: Any = None,
        alibi_slopes: Any = None,
        shared_prefix: bool = True,
    ) -> Any:
        """Writes this step's new keys and values into layer ``layer`` and attends.

        Parameters
        ----------
        layer : int
        q : ndarray ``(T, Hq, head_dim)``, the new queries packed in sequence order
        k : ndarray ``(T, num_kv_heads, head_dim)``; v : ``(T, num_kv_heads, value_dim)``
            Converted to the cache's dtype as they are stored (quantised, each row with its
            scale, in a quantised cache). ``v`` must be None when the cache has
            ``value_from_key`` (the values are read from the keys). Or a model's layout (see
            :class:`Step`).
        window, softcap, sinks, alibi_slopes
            As in :func:`attnx.attention`. A cache with ``sliding_window=W`` uses
            ``window=(W - 1, None)`` by default and refuses a wider left side.
        shared_prefix : bool
            As in :func:`attnx.paged_attention` (default True): shared leading blocks read once.

        Returns
        -------
        ndarray ``(T, Hq, value_dim)`` of q's dtype: each new query attends causally
        (bottom-right) to everything its sequence holds, its own new tokens included. With
        ``return_lse``, also the log-sum-exp, float32 ``(T, Hq)``.

        Raises
        ------
        StaleStepError
            A sequence of the step changed since :meth:`PagedKVCache.begin_step`.
        ValueError, TypeError
            A malformed argument. Nothing is written.
        """
        # step_call's options in its order
        opts = (scale, num_threads, return_lse, window, softcap, sinks, alibi_slopes, shared_prefix)
        return self._attend(layer, q, k, v, opts, _NO_KEYWORDS)

    def attend_arrays(self, layer: int, q: Any, k: Any, v: Any = None, **options: Any) -> Any:
        """:meth:`attend` on NumPy arrays, without its tensor conversion, with its keyword
        arguments: for a caller that already holds NumPy views of its tensors (the Hugging Face
        backend, once per layer)."""
        return self._attend(layer, q, k, v, (), options)

    def _attend(
        self, layer: int, q: Any, k: Any, v: Any, options: tuple, keywords: dict[str, Any]
    ) -> Any:
        """One layer through the step's ``_core.StepPlan`` (made at the first call), ``options``
        and ``keywords`` the positional and keyword arguments of :func:`attnx.ops.paged.step_call`
        after ``v``; counts the layer written."""
        cache = self._cache
        # is_current's first test inline (this runs once per model layer)
        if cache._epoch != self._epoch and not cache.is_current(self):
            raise _stale("attend")
        step_plan = self._step_plan
        if step_plan is None:  # the tables, slots and shared-prefix groups, once for every layer
            from ..ops import cascade as _shared

            step_plan = self._step_plan = _core.StepPlan(
                cache._all_layer_pages(),
                self.block_tables,
                self.seq_lens,
                self.q_lens,
                self.slots,
                cache.value_from_key,
                None if cache.sliding_window is None else cache.sliding_window - 1,
                _shared.MIN_SAVED_KEYS,
            )
        result = _api.step_call(step_plan, layer, q, k, v, *options, **keywords)
        if len(self._written) < self._layers:  # returned: its rows are written (a refusal none)
            self._wrote(layer if type(layer) is int else _index(layer, "layer", cache.num_layers))
        return result

    def linear(
        self,
        layer: int,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        *,
        scale: float | None = None,
        qk_l2norm: bool = False,
        num_threads: int | None = None,
    ) -> Any:
        """Runs gated delta-rule layer ``layer`` (of the cache's ``linear_layers``) over this
        step's tokens, from each sequence's state, and stores the advanced states.

        Parameters
        ----------
        layer : int, in ``[0, linear_layers)`` (numbered apart from the full-attention layers)
        q, k : ndarray ``(T, Hk, K)``; v : ``(T, Hv, V)``, the step's tokens packed in sequence
            order (as ``attend``), with ``(Hv, K, V)`` the cache's ``state_shape``
        g : ``(T, Hv)`` or ``(T, Hv, K)``; beta : ``(T, Hv)``
        scale, qk_l2norm, num_threads : as in :func:`attnx.gated_delta_rule`

        Returns
        -------
        ndarray ``(T, Hv, V)`` of q's dtype.

        Raises
        ------
        StaleStepError
            A sequence of the step changed since ``begin_step``.
        ValueError, TypeError
            A malformed argument, or ``layer`` already run in this step (a state advances once
            per step). Nothing is written.
        """
        from ..ops.delta_rule import gated_delta_rule

        li = self._linear_index(layer)
        q, k, v, g, beta = (x if hasattr(x, "shape") else np.asarray(x) for x in (q, k, v, g, beta))
        self._check_linear_tokens(q, k, v)
        if not self._cache.is_current(self):
            raise _stale("linear")
        cu = np.concatenate([[0], np.cumsum(self.q_lens, dtype=np.int64)])
        o, final = gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            scale=scale,
            initial_state=self._linear_states(li),
            output_final_state=True,
            qk_l2norm=qk_l2norm,
            cu_seqlens=cu,
            num_threads=num_threads,
        )
        self._advance_states(li, np.asarray(final))  # nothing above wrote anything
        return o[0]

    def _linear_index(self, layer: Any) -> int:
        """``linear``'s ``layer`` checked: a linear layer of the cache not yet run in this step."""
        cache = self._cache
        if cache.linear_layers == 0:
            raise ValueError(
                "layer: this cache has no linear layers (PagedKVCache(..., linear_layers=n, state_shape=...))"
            )
        li = _index(layer, "layer", cache.linear_layers)
        if li in self._linear_done:
            raise ValueError(
                f"layer: linear layer {li} already ran in this step (its states advance once per step)"
            )
        return li

    def _check_linear_tokens(self, q: Any, k: Any, v: Any) -> None:
        """``linear``'s q, k and v checked against this step's tokens and the cache's
        ``state_shape``."""
        assert self._cache.state_shape is not None
        hv, kw, vw = self._cache.state_shape
        for name, x, heads, width in (("q", q, None, kw), ("k", k, None, kw), ("v", v, hv, vw)):
            shape = tuple(x.shape)
            if (
                len(shape) != 3
                or shape[0] != self.num_tokens
                or shape[2] != width
                or (heads and shape[1] != heads)
            ):
                want = f"(T={self.num_tokens}, {'Hv=' + str(heads) if heads else 'Hk'}, {width})"
                raise ValueError(
                    f"{name}: expected {want} for this step and the cache's state_shape, got {shape}"
                )

    def _linear_states(self, li: int) -> np.ndarray:
        """Linear layer ``li``'s state of each sequence of the step, stacked (zero where a
        sequence has none yet)."""
        assert self._cache.state_shape is not None
        zero = np.zeros(self._cache.state_shape, np.float32)
        return np.stack([zero if s.state is None else s.state[li] for s in self._seqs])

    def _advance_states(self, li: int, final: np.ndarray) -> None:
        """Stores linear layer ``li``'s advanced states ``final`` (one per sequence) and counts
        the layer run."""
        cache = self._cache
        assert cache.state_shape is not None
        for i, s in enumerate(self._seqs):
            if s.state is None:
                s.state = np.zeros((cache.linear_layers, *cache.state_shape), np.float32)
            s.state[li] = final[i]
        self._linear_done.add(li)
        self._wrote(cache.num_layers + li)


def packed_tokens(x: Any) -> Any:
    """A model's ``(B, H, S, D)`` array as ``(B * S, H, D)`` tokens in sequence order (None stays)."""
    if x is None:
        return None
    x = np.asarray(x)
    return x.transpose(0, 2, 1, 3).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])
