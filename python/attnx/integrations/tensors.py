"""Tensors in, the same kind out: PyTorch tensors and ``__dlpack__`` objects at attnx's entry points.

Every public entry point is wrapped by :func:`tensor_io`. A call whose arguments are all NumPy
arrays (or lists, scalars, None) goes straight through. Otherwise each tensor argument is viewed
as a NumPy array without a copy (float32 / float16 through ``Tensor.numpy()``, bfloat16 by viewing
its storage as int16 and then as ``ml_dtypes.bfloat16``), the NumPy function runs, and its arrays
come back as the kind of the first tensor argument: ``torch.from_numpy`` (zero-copy) for torch,
``xp.from_dlpack`` for an array-API object, NumPy otherwise. A tensor given as ``out=`` is written
in place through its NumPy view and returned itself.

torch is never imported here: a torch tensor can only exist once the user imported torch, so
``sys.modules`` is where it is looked up. The first tensor seen registers attnx's
``torch.library`` ops (:mod:`attnx.integrations.torch_ops`); under ``torch.compile`` an entry point with such
an op routes its tensors to it, so dynamo sees one opaque op instead of NumPy code.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["is_torch", "like", "tensor_io", "to_numpy"]

# argument types that are never tensors: checked by identity, so the NumPy path stays fast
_PLAIN = frozenset({np.ndarray, type(None), bool, int, float, str, tuple, list})

_TRAINING = (
    "attnx computes no gradients (inference only): call it under torch.no_grad() or "
    "torch.inference_mode(), pass .detach()ed tensors, or use "
    "torch.nn.functional.scaled_dot_product_attention to train"
)

# What each argument type is, found once per type: a decode loop passes the same few types
# (tensors, ints, a Step) three or four times per layer and step. Safe to keep: a torch.Tensor
# subclass cannot exist before torch is imported, so no type's answer changes later.
_PLAIN_KIND, _TORCH_KIND, _DLPACK_KIND = 0, 1, 2
_kinds: dict = dict.fromkeys(_PLAIN, _PLAIN_KIND)


def _torch():
    return sys.modules.get("torch")


def _kind(x):
    t = type(x)
    k = _kinds.get(t)
    if k is None:
        torch = _torch()
        if torch is not None and issubclass(t, torch.Tensor):
            k = _TORCH_KIND
        elif issubclass(t, (np.ndarray, np.generic)) or not hasattr(t, "__dlpack__"):
            k = _PLAIN_KIND
        else:
            k = _DLPACK_KIND
        _kinds[t] = k
    return k


def is_torch(x):
    """True for a torch tensor (torch already imported by whoever made it)."""
    return _kind(x) == _TORCH_KIND


_registered = False

# The torch.library front ends by entry-point name: attnx.integrations.torch_ops fills this when
# it is imported (it calls the ops, which sit above this module, so this module never imports it).
# ``load_torch_ops`` imports it: set by ``attnx/__init__.py``, which knows both.
TORCH_OPS: dict[str, Callable[..., Any]] = {}
load_torch_ops: Callable[[], object] | None = None


def _register_ops():
    """Import attnx's torch ops once (they register torch.ops.attnx.*), on the first tensor seen."""
    global _registered
    if not _registered and load_torch_ops is not None:
        _registered = True
        load_torch_ops()


@functools.cache
def _bf16():
    import ml_dtypes  # (a core dependency; imported when the first bfloat16 tensor comes)

    return np.dtype(ml_dtypes.bfloat16)


def _bf16_view(t, torch):
    """A bfloat16 tensor as ml_dtypes.bfloat16, through an int16 view: the same element size, so
    every stride is kept and nothing is copied."""
    return t.view(torch.int16).numpy().view(_bf16())


def _torch_to_numpy(t, name):
    # A decode loop calls this three or four times per layer and step. Tensor.numpy() refuses
    # every case below itself (another device, a sparse layout, requires_grad, a conj or neg
    # bit), so the common case is that one call (bfloat16: viewed as int16 first, once it is
    # known not to require grad), and the checks below run only to say what to do (or to take
    # the no-grad and conj/neg cases that attnx can read).
    torch = _torch()
    try:
        if t.dtype is not torch.bfloat16:
            return t.numpy()
        if not t.requires_grad:  # (an int16 view never requires grad: numpy() would take it)
            return _bf16_view(t, torch)
    except (TypeError, RuntimeError):
        pass
    if not t.is_cpu:
        raise ValueError(
            f"{name}: attnx runs on the CPU, got a tensor on {t.device}: move it with "
            f".cpu(), or use torch.nn.functional.scaled_dot_product_attention on "
            f"{t.device.type}"
        )
    if t.requires_grad:
        if torch.is_grad_enabled():
            raise ValueError(f"{name}: the tensor requires grad; {_TRAINING}")
        t = t.detach()
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        return _bf16_view(t, torch)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(
            f"{name}: cannot view a tensor of dtype {t.dtype} as a NumPy array; "
            "expected float32, float16 or bfloat16"
        ) from exc


def to_numpy(x, name="x"):
    """A NumPy view of a torch tensor or ``__dlpack__`` object (zero-copy); anything else as is."""
    k = _kind(x)
    if k == _PLAIN_KIND:
        return x
    if k == _TORCH_KIND:
        if not _registered:  # the first tensor seen: torch.ops.attnx and torch's thread team
            _register_ops()
        return _torch_to_numpy(x, name)
    try:
        return np.from_dlpack(x)
    except (TypeError, RuntimeError, BufferError, ValueError) as exc:
        raise TypeError(
            f"{name}: cannot read a {type(x).__name__} through __dlpack__ on the CPU: {exc}"
        ) from exc


def like(a, template):
    """NumPy array ``a`` as the kind of ``template`` (torch tensor, array-API object or NumPy)."""
    if not isinstance(a, np.ndarray):
        return a
    if is_torch(template):
        torch = _torch()
        if a.strides and min(a.strides) < 0:  # torch.from_numpy refuses negative strides
            a = np.ascontiguousarray(a)
        if a.dtype.kind == "V":  # ml_dtypes.bfloat16 (dtype.name is a slow Python property)
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    ns = getattr(template, "__array_namespace__", None)
    if ns is not None:
        try:
            return ns().from_dlpack(a)
        except Exception:  # noqa: BLE001 - a namespace that cannot take NumPy keeps NumPy
            return a
    return a


def _wrap(res, template, out, out_np):
    if isinstance(res, tuple):
        return tuple(_wrap(r, template, out, out_np) for r in res)
    if out is not None and res is out_np:
        return out
    return like(res, template)


def _open_sequences(args, kwargs, names, positions):
    """``args`` and ``kwargs`` with each argument named in ``names`` that is a sequence of arrays
    (a list, a tuple or an iterator) as a list of NumPy views of its items; and the first
    tensor among those items, or None."""
    template = None
    args = list(args)
    for i, name in zip(positions, names):
        holder, key = (args, i) if i < len(args) else (kwargs, name)
        if holder is kwargs and name not in kwargs:
            continue
        v = holder[key]
        if isinstance(v, (list, tuple)) or (hasattr(v, "__next__") and _kind(v) == _PLAIN_KIND):
            v = list(v)
            if template is None:
                template = next((x for x in v if _kind(x) != _PLAIN_KIND), None)
            holder[key] = [to_numpy(x, f"{name}[{j}]") for j, x in enumerate(v)]
    return args, kwargs, template


def tensor_io(fn=None, *, torch_op=None, sequences=()):
    """Decorator: tensor arguments in, the same kind of results out (see the module docstring).

    ``torch_op``: the name of a :mod:`attnx.integrations.torch_ops` function that takes the same arguments;
    while ``torch.compile`` traces, calls with torch tensors go there instead. ``sequences``:
    names of arguments that are sequences of arrays (``merge_attention``'s parts): their items
    are arguments too (the first tensor among them sets the kind of the results).
    """
    if fn is None:
        return functools.partial(tensor_io, torch_op=torch_op, sequences=sequences)
    names = fn.__code__.co_varnames
    positions = [names.index(n) for n in sequences]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        template = None
        for x in args:
            if _kind(x) != _PLAIN_KIND:
                template = x
                break
        if template is None:
            for x in kwargs.values():
                if _kind(x) != _PLAIN_KIND:
                    template = x
                    break
        if sequences:
            kwargs = dict(kwargs)
            args, kwargs, inner = _open_sequences(args, kwargs, sequences, positions)
            template = template if template is not None else inner
        if template is None:  # the NumPy path: nothing to convert
            return fn(*args, **kwargs)
        if _kind(template) == _TORCH_KIND:
            torch = _torch()
            if torch_op is not None and torch.compiler.is_compiling():
                _register_ops()
                return TORCH_OPS[torch_op](*args, **kwargs)
        args = [to_numpy(x, names[i] if i < len(names) else "arg") for i, x in enumerate(args)]
        out = kwargs.get("out")
        kwargs = {k: to_numpy(x, k) for k, x in kwargs.items()}
        out_np = kwargs.get("out")
        res = fn(*args, **kwargs)
        return _wrap(res, template, out, out_np)

    return wrapper
