"""attnx: exact, fast attention for the CPU.

``attnx.attention`` computes ``softmax(q kᵀ · scale + M) v`` with a tiled, online-softmax C++
kernel (SIMD chosen at import, threads from attnx's own fork-safe pool); ``attnx.PagedKVCache``
keeps keys and values in a pool of fixed-size blocks and decodes many sequences at once;
``attnx.reference`` is the pure-NumPy definition that every kernel is tested against.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
import threading as _threading

from . import _core, _validate, reference
from . import layers as layers  # (the module names existing code reads after `import attnx`)
from . import torch_compat as torch_compat
from .cache import CacheFullError, PagedKVCache, StaleStepError, Step
from .cache.session import SessionError
from .cache.session import info as session_info
from .integrations import tensors as _tensors
from .integrations.layers import MultiHeadAttention
from .integrations.sdpa import scaled_dot_product_attention
from .ops.attention import attention
from .ops.delta_rule import gated_delta_rule
from .ops.merge import merge_attention
from .ops.paged import paged_attention

# the torch ops, imported on the first tensor an entry point sees (torch is then loaded already)
_tensors.load_torch_ops = lambda: _importlib.import_module(".integrations.torch_ops", __name__)

# The version lives in pyproject.toml only; read back from the installed metadata on first use
# (importlib.metadata costs tens of ms to import, so `import attnx` does not pay for it).
__version__: str


def __getattr__(name: str) -> str:
    if name == "__version__":
        from importlib import metadata

        try:
            version = metadata.version("attnx")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            version = "0+unknown"
        globals()["__version__"] = version
        return version
    raise AttributeError(f"module 'attnx' has no attribute {name!r}")


__all__ = [
    "CacheFullError",
    "MultiHeadAttention",
    "PagedKVCache",
    "SessionError",
    "StaleStepError",
    "Step",
    "attention",
    "cpu_features",
    "float32_precision",
    "gated_delta_rule",
    "get_num_threads",
    "int8_query",
    "merge_attention",
    "paged_attention",
    "reference",
    "scaled_dot_product_attention",
    "session_info",
    "set_float32_precision",
    "set_int8_query",
    "set_num_threads",
    "share_blas_threads",
    "share_torch_threads",
]


def cpu_features() -> dict[str, bool | str]:
    """What this CPU offers and which kernel path is active.

    Returns a dict: ``{"sse2", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
    "avx512bf16", "avx512_vnni", "avx_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "amx_fp16", "amx_permitted", "neon", "dotprod", "bf16", "i8mm", "sve": bool, "isa": "scalar"
    | "avx2" | "avx2vnni" | "avx512" | "avx512vnni" | "avx512bf16" | "amx" | "amx-emulated" |
    "avx2vnni-evex" | "neon" | "neon-bf16"}`` (the x86 flags are false on ARM, the ARM ones on
    x86). ``amx_permitted``: the OS granted this process the AMX tile state. The path is the
    fastest the CPU supports, measured (docs/platforms.md), unless ``ATTNX_ISA`` forced one at
    import.

    ``avx512vnni`` is ``avx512`` with VNNI's integer dot products for integer queries over int8
    KV (AVX-512 CPUs with VNNI whose bf16 dot products are not faster than float32 FMAs: Cascade
    Lake, Ice Lake, later Xeons without AMX permission); ``avx2vnni`` is ``avx2`` with AVX-VNNI's
    for the same (AVX-VNNI without AVX-512: Alder Lake and later client cores, Sierra Forest;
    ``avx2vnni-evex``, forced only: its kernels over AVX512-VNNI's form of the instruction, for
    tests). ``avx512bf16`` is ``avx512vnni`` with bf16 dot products (AVX512_BF16) for prefill over
    bfloat16 q, k and v, ``amx`` the same with AMX tile products (``amx-emulated``, forced only:
    the same tile loop over emulated tiles, for tests on CPUs without AMX); ``ATTNX_ISA=avx512``
    keeps bfloat16 on the float32-widening kernels. ``neon`` is the path of every aarch64 CPU
    (Advanced SIMD), ``neon-bf16`` the same with BFDOT for bfloat16 prefill and SDOT for integer
    queries, where the CPU has BF16 and DotProd.

    ``bf16_products``: the active path multiplies prefill in bf16 (``avx512bf16``, ``amx``,
    ``neon-bf16``), which is what :func:`set_float32_precision` ``("bf16")`` lets float32 calls
    use; where it is false that setting changes nothing. ``integer_products``: the active path
    computes integer queries over int8 KV with integer dot products (``avx2vnni``,
    ``avx512vnni``, ``avx512bf16``, ``amx``, ``neon-bf16``), where :func:`set_int8_query`'s
    default turns them on.
    """
    f: dict[str, bool | str] = dict(_core.cpu_features())
    f["isa"] = _core.active_isa()
    f["bf16_products"] = _core.active_bf16_products()
    f["integer_products"] = _core.active_integer_products()
    return f


def set_num_threads(n):
    """Threads for every later call (``n >= 1``); ``0`` returns to the default, read at each
    call: ``ATTNX_NUM_THREADS`` if set (a ValueError at the call if it is not a positive
    integer), else ``OMP_NUM_THREADS`` if set, else the CPUs this process may run on. A count
    above 4 per such CPU (or above 1024) is capped, with a RuntimeWarning. The environment is
    never changed."""
    _core.set_num_threads(_validate.thread_count(n, "n", 0, "an int >= 0", stacklevel=3))


def get_num_threads():
    """Threads a call uses when it is not given ``num_threads`` (see :func:`set_num_threads`)."""
    return _core.get_num_threads()


def share_blas_threads(on=True):
    """Runs NumPy's (and any loaded OpenBLAS's) matrix products on attnx's thread pool, or, with
    ``on=False``, gives OpenBLAS its own threads back; returns how many OpenBLAS libraries now use
    attnx's pool.

    In a model's loop each attention call follows a matmul. OpenBLAS's idle threads spin for about
    70 ms after each one, and an attention call in that window shares the cores with them (prefill
    measured 1.46x slower; bench/NOTES.md). One pool for both removes the fight. ``import attnx``
    does this for the OpenBLAS libraries already loaded (NumPy's) unless ``ATTNX_SHARE_BLAS=0``;
    call it again after loading another (SciPy's). Needs OpenBLAS 0.3.28+; older builds, MKL and
    other BLAS are left alone (0 is returned for them).
    """
    return _core.share_blas_threads(bool(on))


def share_torch_threads(on=True):
    """Runs attnx's threads on torch's OpenMP team (or, with ``on=False``, on attnx's own pool
    again); returns whether a team is in use.

    torch's idle OpenMP threads spin for a few milliseconds after every op, so between two torch
    ops attnx's own pool would fight them for the cores (bench/NOTES.md). attnx turns this on the
    first time it sees a torch tensor (a Hugging Face model's first attention call), or on
    ``import attnx.torch_ops``, unless ``ATTNX_SHARE_TORCH=0``. It applies to every later call,
    NumPy arrays included. A fork()ed child goes back to attnx's own pool (GNU OpenMP does not
    survive fork).
    """
    return _core.share_omp_threads(bool(on))


def set_int8_query(on=True):
    """Integer queries over int8 KV pages, for every later call: ``True`` on, ``False`` off,
    ``None`` the default (read once when a call starts).

    On: each query row, times the scale, is quantised like the keys (``s_q = max|q| / 127``,
    round half to even) and ``QKᵀ`` is computed over the codes, exactly (integer dot products
    where the kernels have them; the same scores on every path), times ``s_q`` and each key's
    scale. ``P V`` stays in float32. ``attnx.reference.paged_attention(..., int8_query=True)`` is
    its twin. Off: the float32 query against the dequantised keys. The default (``None``) is on
    where the active path has integer dot products (``cpu_features()["integer_products"]``:
    AVX512-VNNI on ``avx512vnni``, ``avx512bf16`` and ``amx``, AMX-INT8 on ``amx``, AVX-VNNI on
    ``avx2vnni``, SDOT on ``neon-bf16``), where they
    are faster, and off elsewhere, where the same FMAs would only add the query's rounding
    (docs/numerics.md, "Integer queries"). ``ATTNX_INT8_QUERY=1``, ``0`` or ``auto`` at import
    sets it too. :func:`int8_query` says what calls do now.

    Returns the previous setting (``True``, ``False`` or ``None``). Raises TypeError, naming
    ``on``, for anything but a bool or None.
    """
    setting = -1 if on is None else int(_validate.flag(on, "on"))
    before = _core.int8_query_setting()
    _core.set_int8_query(setting)
    return None if before < 0 else bool(before)


def int8_query():
    """Whether calls over int8 KV pages use integer queries now: the :func:`set_int8_query`
    setting, or where it is the default, whether the active path has integer dot products."""
    return bool(_core.int8_query())


FLOAT32_PRECISIONS = ("float32", "bf16")


class _Previous(str):
    """The setting a :func:`set_float32_precision` call replaced; a ``with`` block over the call
    puts it back at its end. Blocks that overlap in several threads (one enters, another enters,
    the first leaves) keep the setting of the block entered last that is still open, and the
    last one to end restores the setting from before the first: each block's own "previous" would
    leave the second thread's stale one behind."""

    _now: str  # the setting the call made (what the block holds while it is open)

    def __new__(cls, before: str, now: str | None = None) -> _Previous:
        previous = super().__new__(cls, before)
        previous._now = before if now is None else now  # (None: a copy, as str rebuilds one)
        return previous

    def __enter__(self) -> _Previous:
        with _BLOCKS_LOCK:
            if not _OPEN_BLOCKS:
                _BEFORE_BLOCKS[0] = str(self)
            _OPEN_BLOCKS.append(self)
            _core.set_float32_bf16_products(self._now == "bf16")
        return self

    def __exit__(self, *exc: object) -> None:
        with _BLOCKS_LOCK:
            for i in range(len(_OPEN_BLOCKS) - 1, -1, -1):
                if _OPEN_BLOCKS[i] is self:
                    del _OPEN_BLOCKS[i]
                    break
            now = _OPEN_BLOCKS[-1]._now if _OPEN_BLOCKS else _BEFORE_BLOCKS[0]
            _core.set_float32_bf16_products(now == "bf16")


_BLOCKS_LOCK = _threading.Lock()
_OPEN_BLOCKS: list[_Previous] = []  # the open ``with`` blocks, in the order they were entered
_BEFORE_BLOCKS = ["float32"]  # the setting when the first of them was entered


def set_float32_precision(precision):
    """Which products float32 attention may use, for every later call (the process-wide
    setting, read once when a call starts; compare ``torch.set_float32_matmul_precision``).

    ``"float32"`` (the default): float32 products throughout. ``"bf16"``: where the active path
    multiplies in bf16 (``cpu_features()["bf16_products"]``: AMX tiles or AVX512_BF16 dot
    products), prefill over float32 q, k and v (more than 8 query rows per kv head: dense
    calls, chunked prefill over float32 pages, a cache step, the torch ops and the Hugging Face
    backend) takes them: q, k, v and the probabilities P are rounded to bf16 (round to nearest
    even, a relative error of at most 2^-8 each: half a bf16 ulp), the sums, the softmax, the output and the lse
    stay float32 (docs/numerics.md, "bf16 products"). The setting allows bf16 products, it
    does not emulate them: decode, other paths (``ATTNX_ISA=avx512``, CPUs without them) and
    other dtypes keep their float32 results bit for bit; float64 is never affected.
    ``attnx.reference.attention(..., bf16_products=True)`` is the twin.

    Returns the previous setting, a str that also works as a context manager restoring it::

        with attnx.set_float32_precision("bf16"):
            out = attnx.attention(q, k, v)

    The setting stays process-wide inside a block; blocks open in several threads at once hold
    the setting of the one entered last, and the last to end restores the setting from before
    the first.

    Raises ValueError, naming ``precision``, for anything but ``"float32"`` or ``"bf16"``.
    """
    want = _validate.choice(precision, FLOAT32_PRECISIONS, "precision")
    before = float32_precision()
    _core.set_float32_bf16_products(want == "bf16")
    return _Previous(before, want)


def float32_precision():
    """The products float32 attention may use: ``"float32"`` or ``"bf16"`` (see
    :func:`set_float32_precision`)."""
    return "bf16" if _core.float32_bf16_products() else "float32"


def _select_isa_from_env():
    # Fail at import, with a clear message, if ATTNX_ISA asks for what this CPU lacks.
    isa = _os.environ.get("ATTNX_ISA", "").strip()
    if isa:
        try:
            _core.set_isa(isa)
        except ValueError as exc:
            raise ImportError(f"attnx: {exc}") from None


def _int8_query_from_env():
    # "1" on, "0" off, "auto" (or unset) the default; anything else fails at import.
    value = _os.environ.get("ATTNX_INT8_QUERY", "auto").strip()
    settings = {"1": True, "0": False, "auto": None, "": None}
    if value not in settings:
        raise ImportError(f"attnx: ATTNX_INT8_QUERY={value!r}: expected 1, 0 or auto")
    set_int8_query(settings[value])


_select_isa_from_env()
_int8_query_from_env()
if _os.environ.get("ATTNX_SHARE_BLAS", "1").strip() != "0":
    share_blas_threads()
