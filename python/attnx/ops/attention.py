"""The kernel entry points: normalise ranks, layouts and dtypes, then one call into C++.

Only normalisation lives here (views, never copies of data that is already usable); the C++
binding (``cpp/bindings.cpp``) checks every array and scalar, names the argument in its errors,
and takes its arguments by keyword.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any, Optional, Tuple, Union

import numpy as np

from .. import _core
from ..integrations import tensors as _tensors
from .._validate import as_array as _as_array, kernel_array as _unit_last, real as _real
from .._validate import LAYOUTS as _LAYOUTS, choice as _choice, window_sides as _window

__all__ = ["attention", "paged_attention"]

_KIND_FLOAT = "f"

ArrayLike = Any  # an ndarray, or anything np.asarray takes
IntsLike = Union[int, np.integer, ArrayLike]  # one length (ranks 2 and 3) or an int array
Window = Tuple[Optional[int], Optional[int]]
Result = Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]  # out, or (out, lse)


def _to4(a, name, rank, layout):
    """View a rank-2/3/4 tensor of `layout` as (B, H, S, D)."""
    if a.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} like q, got shape {a.shape}")
    if rank == 4:
        return a.transpose(0, 2, 1, 3) if layout == "bshd" else a
    if rank == 3:
        return (a.transpose(1, 0, 2) if layout == "bshd" else a)[None]
    return a[None, None]


def _from4(x, rank, layout):
    if rank == 4:
        return x.transpose(0, 2, 1, 3) if layout == "bshd" else x
    if rank == 3:
        return x[0].transpose(1, 0, 2) if layout == "bshd" else x[0]
    return x[0, 0]


def _lens(x, rank):
    if x is None or rank == 4:
        return x
    if isinstance(x, numbers.Integral) or (isinstance(x, np.ndarray) and x.ndim == 0):
        return np.reshape(x, (1,))  # ranks 2/3 have B == 1: one length may be a scalar
    return x


def _mask4(mask, rank, logical, additive=np.float32):
    """``mask`` as a 4-D boolean or native additive array that the kernels can read: float32, or
    float64 (``additive``) for float64 inputs, whose kernels compute in float64."""
    m = _as_array(mask, "mask")
    if m.dtype != np.bool_:
        if m.dtype.kind != _KIND_FLOAT and m.dtype.name != "bfloat16":
            raise TypeError(f"mask: expected boolean (True = may attend) or additive float, got dtype {m.dtype}")
        if m.dtype != additive:  # (a byte-swapped one too)
            m = m.astype(additive)  # additive masks are read in the compute type
    if m.ndim > rank:
        raise ValueError(f"mask: shape {m.shape} does not broadcast to {logical}")
    try:
        np.broadcast_shapes(m.shape, logical)
    except ValueError:
        raise ValueError(f"mask: shape {m.shape} does not broadcast to {logical}") from None
    if not m.flags.aligned:  # e.g. a field of a structured array: element strides cannot reach it
        m = np.array(m)
    return m.reshape((1,) * (4 - m.ndim) + m.shape)


def _scale(scale, dk=None):
    """``scale`` as a float, or None for the binding's default ``1/sqrt(Dk)`` (``dk`` is unused:
    kept for callers that pass it)."""
    return None if scale is None else _real(scale, "scale")


def _softcap(softcap):
    return None if softcap is None else _real(softcap, "softcap")


def _out4(out, rank, layout):
    """``out`` viewed as (B, Hq, Sq, Dv) like q; the binding checks its shape and dtype, and
    writes a temporary that it copies in when ``out`` overlaps an input."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy array, got {type(out).__name__}")
    if out.ndim != rank:
        raise ValueError(f"out: expected rank {rank} like q, got shape {out.shape}")
    return _to4(out, "out", rank, layout)


def _thread_count(n, name, minimum, expected, stacklevel):
    """``n`` as a thread count for the core: a Python int in [minimum, 2**31), at most
    ``_core._max_threads()`` (4 per CPU this process may run on, at most 1024); a larger count is
    capped with a RuntimeWarning. ``stacklevel`` is the user's frame, counted from here."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < minimum:
        raise ValueError(f"{name}: expected {expected}, got {n!r}")
    if n >= 2**31:
        raise ValueError(f"{name}: expected at most 2**31 - 1, got {n!r}")
    n = int(n)
    if n > 4:  # the cap is never below 4: the usual counts skip its affinity system call
        cap = _core._max_threads()
        if n > cap:
            warnings.warn(f"{name}={n} capped at {cap} threads (attnx starts at most 4 per CPU this "
                          f"process may run on, and at most 1024)", RuntimeWarning,
                          stacklevel=stacklevel)
            n = cap
    return n


def _threads(num_threads):
    """A call's ``num_threads``: 0 (the default) for None."""
    if num_threads is None:
        return 0
    return _thread_count(num_threads, "num_threads", 1, "a positive int or None", stacklevel=4)


@_tensors.tensor_io(torch_op="attention")
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: bool = False,
              mask: Optional[ArrayLike] = None, kv_lens: Optional[IntsLike] = None,
              q_lens: Optional[IntsLike] = None, scale: Optional[float] = None,
              layout: str = "bhsd", return_lse: bool = False, out: Optional[np.ndarray] = None,
              num_threads: Optional[int] = None, window: Optional[Window] = None,
              softcap: Optional[float] = None, sinks: Optional[ArrayLike] = None,
              alibi_slopes: Optional[ArrayLike] = None) -> Result:
    """Exact scaled dot-product attention, ``softmax(q kᵀ · scale + M) v``, without ever forming
    the full score matrix.

    Parameters
    ----------
    q : ndarray, ``(B, Hq, Sq, Dk)`` (layout ``"bhsd"``) or ``(B, Sq, Hq, Dk)`` (``"bshd"``);
        also ``(Hq, Sq, Dk)`` / ``(Sq, Hq, Dk)`` and ``(Sq, Dk)``. float32, float16 or
        bfloat16 (``ml_dtypes.bfloat16``), computed in float32 (a bfloat16 prefill on a CPU
        with AVX512_BF16: bf16 dot products, P rounded to bf16; README, "bfloat16 compute");
        or float64 (NumPy's default: Python lists convert to it), computed and accumulated in
        float64 by the same tiled kernel (O(S·D) memory), where an additive mask, ``scale``,
        the modifiers and ``lse`` are float64 too.
    k : ndarray, ``(B, Hkv, Sk, Dk)`` in the same layout, rank and dtype. ``Hq % Hkv == 0``:
        query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA; MQA is ``Hkv == 1``).
    v : ndarray, ``(B, Hkv, Sk, Dv)``; ``Dv`` may differ from ``Dk``.
    causal : bool
        Bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)`` with ``Lk``,
        ``Lq`` the valid lengths. With ``Sq == Sk`` this is the usual lower triangle; one new
        query against a cache sees the whole cache. (``torch``'s ``is_causal`` is top-left
        aligned: use :func:`attnx.scaled_dot_product_attention` for that.)
    mask : ndarray, optional
        Boolean (True = may attend) or additive float (0 keeps, -inf blocks), broadcastable to
        ``(B, Hq, Sq, Sk)`` (``(Hq, Sq, Sk)``, ``(Sq, Sk)`` at lower ranks), in bhsd order for
        either layout.
    kv_lens, q_lens : int array ``(B,)``, optional
        Valid key / query lengths per batch: keys at ``j >= kv_lens[b]`` are ignored, query rows
        at ``i >= q_lens[b]`` are padding (output 0, lse -inf).
    scale : float, optional
        Defaults to ``1/sqrt(Dk)``.
    layout : ``"bhsd"`` or ``"bshd"``
    return_lse : bool
        Also return the natural-log log-sum-exp of the scaled, masked scores, float32
        ``(B, Hq, Sq)`` (float64 for float64 inputs; rank-reduced like the output, bhsd order
        for either layout).
    out : ndarray, optional
        Written in place (shape and dtype of the result) and returned.
    num_threads : int, optional
        Threads for this call; default :func:`attnx.get_num_threads`. At most 4 per CPU this
        process may run on (and 1024): a larger count is capped, with a RuntimeWarning.
    window : (left, right), optional
        Sliding window: row ``i`` sees keys ``i' - left <= j <= i' + right``, ``i' = i + Lk - Lq``;
        ``None`` for an unbounded side.
    softcap : float, optional
        Gemma-2 logit soft-capping: ``s = softcap * tanh(s / softcap)`` before bias and mask.
    sinks : float array ``(Hq,)``, optional
        Per-head sink logits: they join the softmax denominator but carry no value (gpt-oss).
    alibi_slopes : float array ``(Hq,)``, optional
        ALiBi: ``s -= slope[h] * |i' - j|``.

    Returns
    -------
    out : ndarray ``(B, Hq, Sq, Dv)`` in q's layout, rank and dtype; and ``lse`` if asked.
        A row that sees no key is all zeros with lse ``-inf`` (never NaN); NaN in the inputs
        propagates to the rows that see it.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> q = k = v = np.eye(3, 4, dtype=np.float32)
    >>> attnx.attention(q, k, v, causal=True).shape
    (3, 4)
    """
    # (the common case, 4-D "bhsd" NumPy arrays, takes the shortest path: a small call from
    # Python should cost a few microseconds, so defaults pass through without calls)
    q = q if type(q) is np.ndarray else _as_array(q, "q")
    k = k if type(k) is np.ndarray else _as_array(k, "k")
    v = v if type(v) is np.ndarray else _as_array(v, "v")
    rank = q.ndim
    plain = rank == 4 and type(layout) is str and layout == "bhsd" and k.ndim == 4 and v.ndim == 4
    if plain:
        q4, k4, v4 = q, k, v
    else:
        if rank not in (2, 3, 4):
            raise ValueError(f"q: expected rank 2 (S, D), 3 (H, S, D) or 4 (B, H, S, D), got shape {q.shape}")
        _choice(layout, _LAYOUTS, "layout")
        q4, k4, v4 = _to4(q, "q", rank, layout), _to4(k, "k", rank, layout), _to4(v, "v", rank, layout)
    q4, k4, v4 = _unit_last(q4), _unit_last(k4), _unit_last(v4)
    if mask is not None:
        mask = _mask4(mask, rank, (q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2])[4 - rank:],
                      np.float64 if q4.dtype == np.float64 else np.float32)
    res = _core.attention(
        q4, k4, v4, mask=mask, causal=causal, return_lse=return_lse, sinks=sinks,
        alibi_slopes=alibi_slopes,
        kv_lens=kv_lens if kv_lens is None else _lens(kv_lens, rank),
        q_lens=q_lens if q_lens is None else _lens(q_lens, rank),
        scale=scale if scale is None else _real(scale, "scale"),
        out=out if out is None else _out4(out, rank, layout),
        num_threads=0 if num_threads is None else _threads(num_threads),
        window=window if window is None else _window(window),
        softcap=softcap if softcap is None else _real(softcap, "softcap"))
    if not return_lse:
        return out if out is not None else res if plain else _from4(res, rank, layout)
    o4, lse = res
    o = out if out is not None else o4 if plain else _from4(o4, rank, layout)
    return o, (lse if rank == 4 else lse[0] if rank == 3 else lse[0, 0])


@_tensors.tensor_io(torch_op="paged_attention")
def paged_attention(q: ArrayLike, k_pages: np.ndarray, v_pages: np.ndarray,
                    block_tables: IntsLike, seq_lens: IntsLike, *,
                    q_lens: Optional[IntsLike] = None, causal: bool = True,
                    scale: Optional[float] = None, return_lse: bool = False,
                    out: Optional[np.ndarray] = None, num_threads: Optional[int] = None,
                    window: Optional[Window] = None, softcap: Optional[float] = None,
                    sinks: Optional[ArrayLike] = None,
                    alibi_slopes: Optional[ArrayLike] = None, shared_prefix: bool = True,
                    k_scales: Optional[np.ndarray] = None,
                    v_scales: Optional[np.ndarray] = None) -> Result:
    """Attention of packed queries against KV stored in pages of a block pool, read in place.

    Parameters
    ----------
    q : ndarray ``(N, Hq, Dk)``
        The new query tokens of all sequences, packed in sequence order: ``N = sum(q_lens)``
        (``N = B`` when ``q_lens`` is None: one decode token per sequence).
    k_pages : ndarray ``(num_blocks, Hkv, block_size, Dk)``
    v_pages : ndarray ``(num_blocks, Hkv, block_size, Dv)``
        The pools (one layer). float32, float16 or bfloat16; q may have another dtype. Or
        quantised, int8, float8_e4m3fn or float8_e5m2, with their scales.
    block_tables : int array ``(B, max_blocks)``
        Sequence ``b``'s kv token ``t`` lives in block ``block_tables[b, t // block_size]`` at
        slot ``t % block_size``. Entries past a sequence's last block are not read.
    seq_lens : int array ``(B,)``
        Tokens held by each sequence, including its new ones.
    q_lens : int array ``(B,)``, optional
        New query tokens per sequence: they are its last ``q_lens[b]`` positions.
    causal : bool
        Bottom-right aligned, as in :func:`attention` (default True).
    scale, return_lse, out, num_threads, window, softcap, sinks, alibi_slopes
        As in :func:`attention`; lse has shape ``(N, Hq)``.
    shared_prefix : bool
        Sequences whose tables start with the same block ids (forks, prefix-cache hits) read
        those blocks once for all their queries, merged with each one's own tail by log-sum-exp
        (default True; used where it saves enough reads, and not with ``window``, ``sinks`` or
        ``alibi_slopes``). False reads every sequence's blocks on their own.
    k_scales, v_scales : float32 ndarray ``(num_blocks, Hkv, block_size)``, optional
        With quantised pages, and only then: row ``(block, head, slot)`` reads as its codes
        times its scale (:func:`attnx.reference.dequantize_kv`), converted as the kernel loads
        it (never a dequantised copy of a page).

    Returns
    -------
    out : ndarray ``(N, Hq, Dv)`` of q's dtype (and lse).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> kp = np.zeros((4, 1, 16, 8), np.float32); vp = np.ones((4, 1, 16, 8), np.float32)
    >>> q = np.ones((1, 2, 8), np.float32)
    >>> attnx.paged_attention(q, kp, vp, np.array([[2, 0]]), np.array([20]))[0, 0, :3]
    array([1., 1., 1.], dtype=float32)
    """
    q = _unit_last(_as_array(q, "q"))
    if q.ndim != 3:
        raise ValueError(f"q: expected shape (N, Hq, Dk), got {q.shape}")
    k_pages = _unit_last(_as_array(k_pages, "k_pages"))
    v_pages = _unit_last(_as_array(v_pages, "v_pages"))
    block_tables = _as_array(block_tables, "block_tables")
    if shared_prefix and window is None and sinks is None and alibi_slopes is None:
        split = _split_shared(q, k_pages, v_pages, block_tables, seq_lens, q_lens, causal, scale,
                              return_lse, out, num_threads, softcap, k_scales, v_scales)
        if split is not None:
            return split
    return _core.paged_attention(
        q, k_pages, v_pages, block_tables, seq_lens, q_lens=q_lens, causal=causal,
        scale=_scale(scale), out=out, return_lse=return_lse, num_threads=_threads(num_threads),
        window=_window(window), softcap=_softcap(softcap), sinks=sinks, alibi_slopes=alibi_slopes,
        k_scales=_scales(k_scales, "k_scales"), v_scales=_scales(v_scales, "v_scales"))


def _scales(x: object, name: str) -> Optional[np.ndarray]:
    """A scale-pages argument as an array (the binding checks it), or None."""
    return None if x is None else _as_array(x, name)


def _shared_plan(q, k_pages, block_tables, seq_lens, q_lens):
    """The shared-prefix groups of a paged call, or None where there are none (or the arguments
    are malformed: the plain path then says how)."""
    from . import cascade as _shared
    bt = np.asarray(block_tables)
    if bt.ndim != 2 or bt.shape[0] < 2 or bt.shape[1] == 0 or not _first_blocks_repeat(bt):
        return None  # no two sequences start on one block: nothing to share (the usual decode)
    try:
        lens = np.asarray(seq_lens)
        ql = np.ones(len(lens), np.int64) if q_lens is None else np.asarray(q_lens)
        if (lens.shape != (bt.shape[0],) or ql.shape != lens.shape
                or bt.dtype.kind not in "iu" or lens.dtype.kind not in "iu" or ql.dtype.kind not in "iu"
                or np.ndim(k_pages) != 4 or int(ql.sum()) != q.shape[0] or (ql < 0).any()
                or (ql > lens).any() or (lens > bt.shape[1] * k_pages.shape[2]).any()):
            return None
    except (TypeError, ValueError):
        return None
    groups = _shared.plan_groups(bt, lens, ql, k_pages.shape[2])
    return (groups, bt, lens, ql) if groups else None


def _first_blocks_repeat(bt: np.ndarray) -> bool:
    """Whether two rows of a block table start with the same block id: sharing needs that, and
    this costs ~1 us where validating the arguments and planning cost ~15 (per decode call)."""
    first = bt[:, 0].tolist()
    return len(set(first)) < len(first)


def _split_shared(q, k_pages, v_pages, block_tables, seq_lens, q_lens, causal, scale, return_lse,
                  out, num_threads, softcap, k_scales=None, v_scales=None):
    """paged_attention through the shared-prefix path, or None where no group shares blocks."""
    from . import cascade as _shared
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != q.dtype
                            or out.shape != q.shape[:2] + v_pages.shape[3:]):
        return None  # (the plain path says what is wrong with it)
    plan = _shared_plan(q, k_pages, block_tables, seq_lens, q_lens)
    if plan is None:
        return None
    groups, bt, lens, ql = plan
    sc, th, cap = _scale(scale), _threads(num_threads), _softcap(softcap)
    ks, vs = _scales(k_scales, "k_scales"), _scales(v_scales, "v_scales")

    def run(qx, table, lens_, ql_, causal_, prior=(None, None), out_=None):
        return _core.paged_attention(qx, k_pages, v_pages, table, lens_, q_lens=ql_, causal=causal_,
                                     scale=sc, out=out_, return_lse=True, num_threads=th,
                                     softcap=cap, k_scales=ks, v_scales=vs, prior_out=prior[0],
                                     prior_lse=prior[1])

    # the shared parts in float32 (exact for half-precision queries), merged into the tails'
    # call, which writes q's dtype (and `out`) with one rounding, as the plain path does
    o, lse = _shared.attend(_wide(q), bt, lens, groups, k_pages.shape[2],
                            lambda table, lens_, prior: run(q, table, lens_, ql, bool(causal),
                                                            prior, out),
                            lambda qg, table, lens_, ql_: run(qg, table, lens_, ql_, False))
    return (o, lse) if return_lse else o


def _wide(q):
    """``q`` in float32 where it is half precision (float32 and float64 as they are), so that
    partial results merge at full precision."""
    return q if q.dtype in (np.float32, np.float64) else q.astype(np.float32)


def paged_step(q: object, k: object, v: object, k_pages: np.ndarray, v_pages: np.ndarray,
               block_tables: np.ndarray, seq_lens: np.ndarray, q_lens: np.ndarray, slots: np.ndarray,
               *, values_from_keys: bool = False, max_left: int | None = None,
               scale: float | None = None, num_threads: int | None = None, return_lse: bool = False,
               window: Any = None, softcap: float | None = None, sinks: Any = None,
               alibi_slopes: Any = None, k_scales: np.ndarray | None = None,
               v_scales: np.ndarray | None = None, prior: Any = None) -> Result:
    """One step of a paged KV cache (:meth:`attnx.Step.attend`): writes the new keys and values
    into their slots, then attends causally from the new queries to their whole sequences.

    Parameters
    ----------
    q : ndarray ``(T, Hq, Dk)``, the new queries packed in sequence order
    k : ndarray ``(T, Hkv, Dk)``; v : ndarray ``(T, Hkv, Dv)``, or None with ``values_from_keys``
        The new keys and values, converted to the pages' dtype as they are written.
    k_pages, v_pages, block_tables, seq_lens, q_lens
        As in :func:`paged_attention`; ``seq_lens`` count the new tokens.
    slots : int64 ``(T,)``
        Where each new token goes: ``block * block_size + offset``.
    values_from_keys : bool
        ``v_pages`` is a view of ``k_pages`` (latent attention): only the keys are written, and
        ``v`` must be None.
    max_left : int, optional
        The pages keep only each sequence's last ``max_left + 1`` keys (a sliding window):
        ``window`` defaults to ``(max_left, None)`` and may not reach further left.
    scale, num_threads, return_lse, window, softcap, sinks, alibi_slopes
        As in :func:`attention`.
    k_scales, v_scales : float32 ``(num_blocks, Hkv, block_size)``, optional
        The scale pages of quantised pages: each new row is quantised and its scale stored.
    prior : ``(out, lse)``, float32 ``(T, Hq, Dv)`` and ``(T, Hq)``, optional
        Each query's finished attention over keys outside these tables (lse ``-inf`` where it
        saw none), merged in by log-sum-exp before the row is written: the shared-prefix path's
        part (``attnx._shared``).

    Returns
    -------
    out : ndarray ``(T, Hq, Dv)`` of q's dtype (and lse ``(T, Hq)``). Every argument is checked
    before the first write.
    """
    plan = _core.StepPlan([(k_pages, v_pages, k_scales, v_scales)], block_tables, seq_lens, q_lens,
                          slots, values_from_keys, max_left)
    return step_call(plan, 0, q, k, v, scale, num_threads, return_lse, window, softcap, sinks,
                     alibi_slopes, prior)


def step_call(plan, layer, q, k, v, scale=None, num_threads=None, return_lse=False, window=None,
              softcap=None, sinks=None, alibi_slopes=None, prior=None):
    """One layer of a cache step through its ``_core.StepPlan``: the Python-side conversions
    (window sides, thread counts) where given, then one binding call that checks the rest.
    ``attnx.Step`` calls it once per model layer, so the common case takes no Python step."""
    if window is not None:
        window = _window(window)
    if num_threads is not None:
        num_threads = _threads(num_threads)
    po, pl = (None, None) if prior is None else prior
    return plan.attend(layer, q, k, v, scale, softcap, window, sinks, alibi_slopes, num_threads,
                       return_lse, po, pl)
