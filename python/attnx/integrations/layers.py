"""Multi-head attention layer, the seed's ``MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W_O``.

The layer holds the four learned matrices W_Q, W_K, W_V, W_O (and optional biases) as NumPy arrays
and runs the attention step on attnx's kernels: each projection is one matmul over all heads, the
heads are a reshape to ``(B, S, H, D)`` (layout ``"bshd"``, no transpose, no copy), and one
``attnx.attention`` call does every head of every sequence.

Weight convention
-----------------
The attributes follow the **seed's (right-multiplication) convention**, ``Q = X @ W_Q``:

=======  ==============================  ==========================================
W_Q      ``(d_model, num_heads * head_dim)``       ``Q = x @ W_Q + b_Q``
W_K      ``(context_dim, num_kv_heads * head_dim)`` ``K = context @ W_K + b_K``
W_V      ``(context_dim, num_kv_heads * head_dim)`` ``V = context @ W_V + b_V``
W_O      ``(num_heads * head_dim, d_model)``        ``y = Concat(heads) @ W_O + b_O``
=======  ==============================  ==========================================

PyTorch's ``nn.Linear`` (and so every torch state dict) stores the transpose, ``(out, in)``:
:meth:`MultiHeadAttention.from_state_dict` and :meth:`MultiHeadAttention.state_dict` convert.
Columns ``h*head_dim : (h+1)*head_dim`` of W_Q belong to head ``h`` (torch's split too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._validate import flag as _flag
from .._validate import positive_int as _positive
from .._validate import rank_lens
from .._validate import storage_dtype as _storage_dtype
from ..ops import attention as _api
from . import tensors as _tensors

__all__ = ["MultiHeadAttention"]

# Keys whose weights one kernel call reads out (_kernel_weights): its one-hot V is (Sk, 256),
# broadcast over the batch and the kv heads.
_WEIGHT_KEYS = 256


def _kernel_weights(q: np.ndarray, k: np.ndarray, **masks: Any) -> np.ndarray:
    """A ``(B, H, Sq, Sk)``: the softmax weights the kernel applies to ``q`` (B, Sq, H, D) and
    ``k`` (B, Sk, Hkv, D) under ``masks`` (attention's causal, mask, kv_lens, q_lens).

    ``P V`` with V a block of the identity's columns is that block of P, so the weights are read
    out of attnx.attention itself: every mask rule is the kernel's, with no second copy of them.
    Sk multiply-adds more per weight than the forward pass: a view for inspection."""
    B, Sq, H, _ = q.shape
    Sk, G = k.shape[1], k.shape[2]
    w = np.empty((B, H, Sq, Sk), q.dtype)
    for j0 in range(0, Sk, _WEIGHT_KEYS):  # blocks of keys, each one call over every head
        n = min(_WEIGHT_KEYS, Sk - j0)
        eye = np.zeros((Sk, n), q.dtype)
        eye[j0 + np.arange(n), np.arange(n)] = 1
        v = np.broadcast_to(eye[None, :, None, :], (B, Sk, G, n))
        w[..., j0 : j0 + n] = _api.attention(q, k, v, layout="bshd", **masks).transpose(0, 2, 1, 3)
    return w


_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _layer_dtype(dtype):
    """A layer's dtype: float64 (computed in float64), or a storage dtype (float32, float16,
    bfloat16: computed in float32)."""
    try:
        if dtype is not None and np.dtype(dtype) == _F64:  # (np.dtype(None) is float64)
            return _F64
    except TypeError:
        pass
    try:
        return _storage_dtype(dtype)
    except TypeError:
        raise TypeError(
            f"dtype: expected 'float32', 'float16', 'bfloat16' or 'float64', got {dtype!r}"
        ) from None


def _to_numpy(t, name):
    """A NumPy array from a NumPy array, a list, or a (CPU or not) torch tensor."""
    if hasattr(t, "detach"):  # a torch tensor: no torch import needed
        t = t.detach()
        if hasattr(t, "cpu"):
            t = t.cpu()
        if str(getattr(t, "dtype", "")) == "torch.bfloat16":
            t = t.float()
        t = t.numpy()
    a = np.asarray(t)
    if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected a real-valued array, got dtype {a.dtype}")
    return a


def _param(name, doc):
    attr = "_" + name

    def fget(self):
        return getattr(self, attr)

    def fset(self, value):
        shape = self._shapes()[name]
        if value is None:
            if name.startswith("W"):
                raise ValueError(f"{name}: a weight matrix cannot be None")
            setattr(self, attr, None)
            return
        a = _to_numpy(value, name)
        if a.shape != shape:
            raise ValueError(
                f"{name}: expected shape {shape}, got {a.shape}"
                + (
                    " (attributes use x @ W, i.e. (in, out); torch's Linear stores "
                    "(out, in): transpose it or use from_state_dict)"
                    if a.shape == shape[::-1] and len(shape) == 2
                    else ""
                )
            )
        setattr(self, attr, np.array(a, dtype=self.dtype, copy=True))

    return property(fget, fset, doc=doc)


class MultiHeadAttention:
    """Multi-head (and grouped-query) attention with learned projections, on attnx's kernels.

    ``layer(x)`` is self-attention (Q, K and V all from ``x``); ``layer(y, context=x)`` is
    cross-attention (queries from ``y``, keys and values from ``x``, as a translation decoder
    reading its encoder)::

        Q = x W_Q + b_Q        K = context W_K + b_K        V = context W_V + b_V
        head_h = softmax(Q_h K_gᵀ / sqrt(head_dim) + M) V_g     g = h // (num_heads // num_kv_heads)
        y = Concat(head_1, ..., head_H) W_O + b_O

    Parameters
    ----------
    d_model : int
        Width of ``x`` and of the output.
    num_heads : int
        Query heads.
    num_kv_heads : int, optional
        Key/value heads (GQA; ``1`` is MQA). Must divide ``num_heads``; default ``num_heads``.
    head_dim : int, optional
        Width of one head; default ``d_model // num_heads`` (which must then divide exactly).
    bias : bool
        Whether the four projections have biases (initialised to zero).
    dtype : float32 (default), float16, bfloat16 or float64
        Storage dtype of the weights and dtype of the output; the projections and attention are
        computed in float32 (in float64 for float64).
    context_dim : int, optional
        Width of ``context`` for cross-attention (torch's ``kdim``/``vdim``); default
        ``d_model``.
    seed, rng : optional
        Random initialisation (Xavier-uniform, as ``torch.nn.MultiheadAttention``): pass a
        ``numpy.random.Generator`` as ``rng`` or an int ``seed``.

    Attributes
    ----------
    W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O : ndarray
        Settable: assign any array of the right shape (converted to ``dtype``, copied). Shapes
        follow the seed's ``x @ W`` convention, ``(in, out)`` — the transpose of torch's
        ``(out, in)``; see the module docstring. Biases are ``None`` when absent; assigning an
        array to one adds it.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> layer = attnx.MultiHeadAttention(d_model=8, num_heads=2, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    >>> y, w = layer(x, causal=True, return_weights=True)
    >>> y.shape, w.shape
    ((3, 8), (2, 3, 3))
    """

    W_Q = _param("W_Q", "Query projection, ``(d_model, num_heads*head_dim)``: ``Q = x @ W_Q``.")
    W_K = _param("W_K", "Key projection, ``(context_dim, num_kv_heads*head_dim)``.")
    W_V = _param("W_V", "Value projection, ``(context_dim, num_kv_heads*head_dim)``.")
    W_O = _param("W_O", "Output projection, ``(num_heads*head_dim, d_model)``.")
    b_Q = _param("b_Q", "Query bias ``(num_heads*head_dim,)`` or None.")
    b_K = _param("b_K", "Key bias ``(num_kv_heads*head_dim,)`` or None.")
    b_V = _param("b_V", "Value bias ``(num_kv_heads*head_dim,)`` or None.")
    b_O = _param("b_O", "Output bias ``(d_model,)`` or None.")

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        dtype: Any = np.float32,
        *,
        context_dim: int | None = None,
        seed: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.d_model = _positive(d_model, "d_model")
        self.num_heads = _positive(num_heads, "num_heads")
        self.num_kv_heads = (
            self.num_heads if num_kv_heads is None else _positive(num_kv_heads, "num_kv_heads")
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: must divide num_heads={self.num_heads}, got {self.num_kv_heads}"
            )
        if head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(
                    f"head_dim: d_model={self.d_model} is not a multiple of "
                    f"num_heads={self.num_heads}; pass head_dim explicitly"
                )
            head_dim = self.d_model // self.num_heads
        self.head_dim = _positive(head_dim, "head_dim")
        self.context_dim = (
            self.d_model if context_dim is None else _positive(context_dim, "context_dim")
        )
        bias = _flag(bias, "bias")
        self.dtype = _layer_dtype(dtype)
        self._compute = _F64 if self.dtype == _F64 else _F32  # what x, Q, K, V and heads are in
        if rng is not None and seed is not None:
            raise ValueError("rng: pass either rng or seed, not both")
        if rng is None:
            rng = np.random.default_rng(seed)
        elif not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng: expected a numpy.random.Generator, got {type(rng).__name__}")

        def xavier(shape):
            bound = np.sqrt(6.0 / (shape[0] + shape[1]))
            return rng.uniform(-bound, bound, size=shape)

        shapes = self._shapes()
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            setattr(self, name, xavier(shapes[name]))
        for name in ("b_Q", "b_K", "b_V", "b_O"):
            setattr(self, name, np.zeros(shapes[name]) if bias else None)

    # ---- shapes ----------------------------------------------------------------------------
    def _shapes(self):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return {
            "W_Q": (self.d_model, q),
            "W_K": (self.context_dim, kv),
            "W_V": (self.context_dim, kv),
            "W_O": (q, self.d_model),
            "b_Q": (q,),
            "b_K": (kv,),
            "b_V": (kv,),
            "b_O": (self.d_model,),
        }

    def __repr__(self) -> str:
        return (
            f"MultiHeadAttention(d_model={self.d_model}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"bias={self.b_Q is not None}, dtype={self.dtype.name})"
        )

    # ---- forward ---------------------------------------------------------------------------
    def _proj(self, x, w, b):
        w = self.__dict__["_" + w]
        b = self.__dict__["_" + b]
        ct = self._compute
        y = x @ (w if w.dtype == ct else w.astype(ct))
        if b is not None:
            y += b if b.dtype == ct else b.astype(ct)
        return y

    @_tensors.tensor_io
    def __call__(
        self,
        x: Any,
        context: Any | None = None,
        *,
        causal: bool = False,
        mask: Any | None = None,
        kv_lens: Any | None = None,
        q_lens: Any | None = None,
        return_weights: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Self-attention (``context=None``) or cross-attention over ``context``.

        Parameters
        ----------
        x : array ``(S, d_model)`` or ``(B, S, d_model)``
            The sequence(s) that supply the queries (and keys/values for self-attention).
        context : array ``(Sk, context_dim)`` / ``(B, Sk, context_dim)``, optional
            Supplies keys and values (cross-attention); same rank and batch as ``x``.
        causal : bool
            Bottom-right aligned as in :func:`attnx.attention` (the seed's lower triangle when
            queries and keys have the same length).
        mask : array, optional
            Boolean (True = may attend) or additive float, broadcastable to
            ``(B, num_heads, Sq, Sk)`` (``(num_heads, Sq, Sk)`` or ``(Sq, Sk)`` work for both
            ranks).
        kv_lens : int array ``(B,)`` (an int for unbatched input), optional
            Valid key lengths: padding keys at ``j >= kv_lens[b]`` are ignored.
        q_lens : int array ``(B,)`` (an int for unbatched input), optional
            Valid query lengths: rows ``i >= q_lens[b]`` are padding and their output is 0
            (also after the output bias).
        return_weights : bool
            Also return the per-head attention maps ``(B, num_heads, Sq, Sk)`` (``(num_heads,
            Sq, Sk)`` for unbatched input), in the compute dtype (float32, or float64 for a
            float64 layer). They are the kernel's own weights on the same Q and K, read out as
            ``attention(q, k, I)`` over blocks of the identity, so every mask is applied as in
            ``y``; the kernel never forms the score matrix, so asking for the maps costs the
            O(Sq·Sk) memory it avoids and Sk more multiply-adds per weight.

        Returns
        -------
        y : ndarray of ``x``'s rank, ``(..., Sq, d_model)``, dtype ``self.dtype``
        weights : ndarray, only if ``return_weights``
        """
        x32, c32, unbatched = self._batched_inputs(x, context)
        if unbatched:
            kv_lens = rank_lens(kv_lens, 3)
            q_lens = rank_lens(q_lens, 3)
        B, Sq, _ = x32.shape
        if B * Sq == 0:  # no rows: return at once (numpy would still walk a huge empty batch)
            return self._no_rows(B, Sq, c32.shape[1], unbatched, return_weights)
        y, q, k = self._attend(x32, c32, causal, mask, kv_lens, q_lens)
        if unbatched:
            y = y[0]
        if not _flag(return_weights, "return_weights"):
            return y
        w = _kernel_weights(q, k, causal=causal, mask=mask, kv_lens=kv_lens, q_lens=q_lens)
        return y, (w[0] if unbatched else w)

    def _batched_inputs(self, x: Any, context: Any) -> tuple[np.ndarray, np.ndarray, bool]:
        """``(x, context, unbatched)`` checked, batched and in the compute dtype (float64 for a
        float64 layer); context is x for self-attention."""
        x, c, unbatched = self._inputs(x, context)
        if unbatched:
            x, c = x[None], c[None]
        x32 = x.astype(self._compute, copy=False)
        c32 = x32 if c is x else c.astype(self._compute, copy=False)
        return x32, c32, unbatched

    def _no_rows(
        self, B: int, Sq: int, Sk: int, unbatched: bool, return_weights: Any
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The result of a call with no query rows: zeros of the shapes asked for."""
        y = np.zeros((B, Sq, self.d_model), self.dtype)
        w = np.zeros((B, self.num_heads, Sq, Sk), self._compute)
        y, w = (y[0], w[0]) if unbatched else (y, w)
        return (y, w) if return_weights else y

    def _inputs(self, x: Any, context: Any) -> tuple[np.ndarray, np.ndarray, bool]:
        """``(x, context, unbatched)`` as NumPy arrays, checked (context is x for self-attention)."""
        x = _to_numpy(x, "x")
        if x.ndim not in (2, 3):
            raise ValueError(f"x: expected (S, d_model) or (B, S, d_model), got shape {x.shape}")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: last axis must be d_model={self.d_model}, got shape {x.shape}")
        unbatched = x.ndim == 2
        if context is None:
            if self.context_dim != self.d_model:
                raise ValueError(
                    f"context: required, since context_dim={self.context_dim} "
                    f"differs from d_model={self.d_model}"
                )
            return x, x, unbatched
        c = _to_numpy(context, "context")
        if c.ndim != x.ndim:
            raise ValueError(f"context: expected rank {x.ndim} like x, got shape {c.shape}")
        if c.shape[-1] != self.context_dim:
            raise ValueError(
                f"context: last axis must be context_dim={self.context_dim}, got shape {c.shape}"
            )
        if not unbatched and c.shape[0] != x.shape[0]:
            raise ValueError(f"context: batch {c.shape[0]} differs from x's batch {x.shape[0]}")
        return x, c, unbatched

    def _attend(
        self, x32: np.ndarray, c32: np.ndarray, causal: bool, mask: Any, kv_lens: Any, q_lens: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(y, q, k)``: the layer's output over batched inputs in the compute dtype, and the
        projected queries and keys (``"bshd"``)."""
        B, Sq, _ = x32.shape
        Sk = c32.shape[1]
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        # one matmul per projection, all heads at once; heads are a free reshape to "bshd"
        q = self._proj(x32, "W_Q", "b_Q").reshape(B, Sq, H, D)
        k = self._proj(c32, "W_K", "b_K").reshape(B, Sk, G, D)
        v = self._proj(c32, "W_V", "b_V").reshape(B, Sk, G, D)
        heads = np.empty((B, Sq, H, D), self._compute)  # the kernel writes Concat(heads) in place
        _api.attention(
            q,
            k,
            v,
            causal=causal,
            mask=mask,
            kv_lens=kv_lens,
            q_lens=q_lens,
            layout="bshd",
            out=heads,
        )
        y = self._proj(heads.reshape(B, Sq, H * D), "W_O", "b_O")
        if q_lens is not None:
            pad = np.arange(Sq)[None, :] >= np.asarray(q_lens)[:, None]
            y[pad] = 0.0
        return y.astype(self.dtype, copy=False), q, k

    forward = __call__

    # ---- state dicts -----------------------------------------------------------------------
    def state_dict(self, prefix: str = "") -> dict[str, np.ndarray]:
        """The weights under torch-style names and torch's ``(out, in)`` convention:
        ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``, ``out_proj.weight`` (and
        ``.bias``), as copies."""
        d = {}
        for proj, w, b in (
            ("q_proj", "W_Q", "b_Q"),
            ("k_proj", "W_K", "b_K"),
            ("v_proj", "W_V", "b_V"),
            ("out_proj", "W_O", "b_O"),
        ):
            d[f"{prefix}{proj}.weight"] = np.ascontiguousarray(getattr(self, w).T)
            if getattr(self, b) is not None:
                d[f"{prefix}{proj}.bias"] = getattr(self, b).copy()
        return d

    @classmethod
    def from_state_dict(
        cls,
        d: dict[str, Any],
        num_heads: int,
        num_kv_heads: int | None = None,
        prefix: str = "",
        *,
        dtype: Any = np.float32,
    ) -> MultiHeadAttention:
        """Builds a layer from a model's state dict (torch's ``(out, in)`` weights).

        Accepted names (after ``prefix``), NumPy arrays or torch tensors:

        - ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight`` and ``out_proj.weight`` or
          ``o_proj.weight`` (Hugging Face, e.g. Llama, BART), each with an optional ``.bias``;
        - ``in_proj_weight`` ``(3E, E)`` (+ ``in_proj_bias``), ``out_proj.weight`` (+
          ``out_proj.bias``): ``torch.nn.MultiheadAttention``;
        - ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` (+ ``in_proj_bias``):
          ``torch.nn.MultiheadAttention`` with ``kdim == vdim != embed_dim``.

        ``head_dim`` is ``rows(W_Q) / num_heads``; ``num_kv_heads`` defaults to what the key
        projection's rows imply (GQA checkpoints need no extra argument). Missing biases of a
        biased layer are zero.
        """
        (wq, wk, wv, wo), (bq, bk, bv, bo) = _state_dict_weights(d, prefix)
        num_heads = _positive(num_heads, "num_heads")
        head_dim, num_kv_heads = _head_shape(wq, wk, wv, wo, num_heads, num_kv_heads)
        d_model = wq.shape[1]
        has_bias = any(b is not None for b in (bq, bk, bv, bo))
        layer = cls(
            d_model,
            num_heads,
            num_kv_heads,
            head_dim,
            bias=has_bias,
            dtype=dtype,
            context_dim=wk.shape[1],
            seed=0,
        )
        layer.W_Q, layer.W_K, layer.W_V, layer.W_O = wq.T, wk.T, wv.T, wo.T
        for name, b in (("b_Q", bq), ("b_K", bk), ("b_V", bv), ("b_O", bo)):
            if b is not None:
                setattr(layer, name, b)
        return layer


def _state_dict_weights(d: dict[str, Any], prefix: str) -> tuple[tuple, tuple]:
    """``((W_Q, W_K, W_V, W_O), (b_Q, b_K, b_V, b_O))`` of a state dict in torch's ``(out, in)``
    convention, under any of the names :meth:`MultiHeadAttention.from_state_dict` accepts
    (biases None where absent)."""

    def get(name):
        return _to_numpy(d[prefix + name], prefix + name) if prefix + name in d else None

    if get("in_proj_weight") is not None:
        w = get("in_proj_weight")
        if w.ndim != 2 or w.shape[0] % 3:
            raise ValueError(f"{prefix}in_proj_weight: expected (3*E, E), got {w.shape}")
        wq, wk, wv = np.split(w, 3, axis=0)
        bias = get("in_proj_bias")
        bq, bk, bv = (None,) * 3 if bias is None else np.split(bias, 3)
    elif get("q_proj_weight") is not None:
        wq, wk, wv = get("q_proj_weight"), get("k_proj_weight"), get("v_proj_weight")
        bias = get("in_proj_bias")
        if bias is None:
            bq = bk = bv = None
        else:
            nq, nk = wq.shape[0], wk.shape[0]
            bq, bk, bv = bias[:nq], bias[nq : nq + nk], bias[nq + nk :]
    else:
        wq, wk, wv = get("q_proj.weight"), get("k_proj.weight"), get("v_proj.weight")
        bq, bk, bv = get("q_proj.bias"), get("k_proj.bias"), get("v_proj.bias")
    out_name = "out_proj" if get("out_proj.weight") is not None else "o_proj"
    wo, bo = get(out_name + ".weight"), get(out_name + ".bias")
    missing = [
        n for n, a in (("query", wq), ("key", wk), ("value", wv), ("output", wo)) if a is None
    ]
    if missing:
        raise KeyError(
            f"from_state_dict: no {', '.join(missing)} projection weight under "
            f"prefix {prefix!r}; expected q_proj.weight/k_proj.weight/"
            f"v_proj.weight/out_proj.weight (or o_proj.weight), or "
            f"in_proj_weight/out_proj.weight; got keys {sorted(d)[:12]}"
        )
    for name, a in (("query", wq), ("key", wk), ("value", wv), ("output", wo)):
        if a.ndim != 2:
            raise ValueError(f"from_state_dict: {name} weight must be 2-D (out, in), got {a.shape}")
    return (wq, wk, wv, wo), (bq, bk, bv, bo)


def _head_shape(
    wq: np.ndarray,
    wk: np.ndarray,
    wv: np.ndarray,
    wo: np.ndarray,
    num_heads: int,
    num_kv_heads: int | None,
) -> tuple[int, int]:
    """``(head_dim, num_kv_heads)`` that the projection weights imply, checked against each
    other and against ``num_kv_heads`` where given."""
    if wq.shape[0] % num_heads:
        raise ValueError(
            f"num_heads: W_Q has {wq.shape[0]} output rows, not a multiple of num_heads={num_heads}"
        )
    head_dim = wq.shape[0] // num_heads
    if wk.shape != wv.shape:
        raise ValueError(
            f"from_state_dict: key weight {wk.shape} and value weight "
            f"{wv.shape} differ (the layer reads one context for both)"
        )
    if wk.shape[0] % head_dim:
        raise ValueError(
            f"from_state_dict: key weight has {wk.shape[0]} rows, not a "
            f"multiple of head_dim={head_dim}"
        )
    inferred = wk.shape[0] // head_dim
    if num_kv_heads is None:
        num_kv_heads = inferred
    elif _positive(num_kv_heads, "num_kv_heads") != inferred:
        raise ValueError(
            f"num_kv_heads: {num_kv_heads} given, but the key weight has "
            f"{wk.shape[0]} rows = {inferred} heads of {head_dim}"
        )
    d_model = wq.shape[1]
    if wo.shape != (d_model, wq.shape[0]):
        raise ValueError(
            f"from_state_dict: output weight must be (d_model, "
            f"num_heads*head_dim) = {(d_model, wq.shape[0])}, got {wo.shape}"
        )
    return head_dim, num_kv_heads
