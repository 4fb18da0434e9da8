"""Sessions: one sequence's keys and values saved to a safetensors file and loaded back into a
cache, possibly in another process (:meth:`attnx.PagedKVCache.save` / ``load``).

The file holds the valid slots only, in token order, independent of the block size: ``k``
``(num_layers, num_kv_heads, length, head_dim)`` and ``v`` likewise with ``value_dim`` (absent
when values are read from the keys), and, from a hybrid cache, ``state``: the sequence's
recurrent states, float32 ``(linear_layers, Hv, K, V)``. Storage dtypes that safetensors' NumPy
API lacks (bfloat16) are stored as unsigned integers of the same width, the real dtype in the
header. The header is
the file's ``__metadata__``: ``"attnx"`` (JSON: format version, geometry, length, token ids, the
user's ``meta``) and ``"attnx.checksum"`` (blake2b-256 over that JSON and every tensor's name,
dtype, shape and bytes), so a truncated or altered file is refused before anything is written.
The checksum is no signature (anyone can compute it): every field of the header, its type
included, and every tensor's dtype and shape are checked too, so that any malformed or forged
file raises :class:`SessionError`.

Paths are what ``open`` takes (str, bytes or os.PathLike). ``save`` follows a symbolic link: it
replaces the link's target atomically, and the link stays.

safetensors is imported only when a session is saved or loaded (the ``sessions`` extra).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
import struct
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["FORMAT", "SessionError", "info"]

FORMAT = "attnx-kv-session/1"
_GEOMETRY = ("num_layers", "num_kv_heads", "head_dim", "value_dim", "dtype", "value_from_key")
# every field of the attnx header but ``tokens`` (None or a list of ints) and ``meta`` (any JSON),
# with its type (exactly: a bool is no int here, as 1.0 is none)
_FIELDS = {
    "format": str,
    "num_layers": int,
    "num_kv_heads": int,
    "head_dim": int,
    "value_dim": int,
    "dtype": str,
    "value_from_key": bool,
    "length": int,
    "root": str,
}
# geometry only a hybrid cache writes (its files also hold a tensor "state", the sequence's
# recurrent states), and what a file without it means
_HYBRID = {"linear_layers": 0, "state_shape": None}


class SessionError(ValueError):
    """A session file that cannot be loaded into this cache: not a session, truncated or
    corrupted (its checksum does not match), or made for another model. The cache is unchanged."""


def _safetensors_numpy() -> Any:
    try:
        import safetensors.numpy as stn
    except ImportError:
        raise ImportError(
            "sessions need the safetensors package: pip install 'attnx[sessions]' "
            "(or pip install safetensors)"
        ) from None
    return stn


def geometry(cache: Any) -> dict[str, Any]:
    """The figures a session must share with the cache that loads it (those of linear layers
    only where the cache has some, so that other files stay as they were)."""
    geom = {
        "num_layers": cache.num_layers,
        "num_kv_heads": cache.num_kv_heads,
        "head_dim": cache.head_dim,
        "value_dim": cache.value_dim,
        "dtype": cache.dtype.name,
        "value_from_key": cache.value_from_key,
    }
    if cache.linear_layers:
        geom.update(linear_layers=cache.linear_layers, state_shape=list(cache.state_shape))
    return geom


def _stored(a: np.ndarray) -> np.ndarray:
    """``a`` in a dtype safetensors' NumPy API takes: floats it knows as they are, others
    (bfloat16, float8) as unsigned integers of their width."""
    if a.dtype in (np.float32, np.float16, np.float64):
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def _checksum(header_json: str, tensors: Mapping[str, np.ndarray]) -> str:
    # (a header attnx wrote is ASCII; "surrogatepass" lets a forged one's lone surrogate through
    # to the mismatch it is, instead of a UnicodeEncodeError)
    h = hashlib.blake2b(header_json.encode("utf-8", "surrogatepass"), digest_size=32)
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        h.update(f"\0{name}\0{t.dtype.str}\0{t.shape}\0".encode())
        h.update(t.reshape(-1).view(np.uint8).data)  # (no copy; an empty one is fine too)
    return h.hexdigest()


def _json(value: Any, name: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected JSON-serialisable data ({e})") from None


def path_str(path: Any) -> str:
    """``path`` as ``open`` takes it (str, bytes or os.PathLike; not a file descriptor), as a str."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(
            f"path: expected a str, bytes or os.PathLike path, got {type(path).__name__}"
        )
    return os.fsdecode(os.fspath(path))


def _write_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a reader sees the old file or the whole new one:
    a temporary file in the same directory, fsync, rename over ``path``, fsync the directory.
    A symbolic link is followed (as ``open`` would): its target is replaced, the link stays."""
    path = os.path.realpath(path)
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".attnx-session-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # (a platform that cannot open directories: the rename is done)
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def encode(
    geom: dict[str, Any],
    tensors: dict[str, np.ndarray],
    length: int,
    tokens: np.ndarray | None,
    root: bytes,
    meta: Any,
) -> bytes:
    """The bytes of a session file (``root``: the prefix digest chain's start, which carries
    the sequence's extra key, so that a loaded sequence registers its blocks as the saved one)."""
    header = dict(
        geom,
        format=FORMAT,
        length=length,
        root=root.hex(),
        tokens=None if tokens is None else [int(t) for t in tokens],
        meta=meta,
    )
    header_json = _json(header, "meta")
    stored = {name: _stored(t) for name, t in tensors.items()}
    metadata = {"attnx": header_json, "attnx.checksum": _checksum(header_json, stored)}
    return _safetensors_numpy().save(stored, metadata=metadata)


def save(path: str, data: bytes) -> None:
    """Writes the session bytes ``data`` to ``path`` (a :func:`path_str`) atomically."""
    _write_atomic(path, data)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")  # (what attnx writes never holds NaN or Infinity)


def _parse(text: str | bytes, path: str, what: str) -> Any:
    """``text`` parsed as strict JSON; SessionError naming ``what`` if it is not (NaN and
    Infinity included), or nests too deeply for the parser."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise SessionError(
            f"{path}: {what} is corrupted (not JSON, or nested too deeply)"
        ) from None


def _metadata(data: bytes, path: str) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (the format's documented header: a
    little-endian u64 length, then that much JSON), with its two attnx entries (strings)."""
    n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)
    if 8 + n > len(data):
        raise SessionError(f"{path}: not a readable safetensors file (truncated or corrupted)")
    header = _parse(data[8 : 8 + n], path, "the safetensors header")
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or "attnx" not in meta or "attnx.checksum" not in meta:
        raise SessionError(f"{path}: not an attnx session file (no attnx header in its metadata)")
    if not isinstance(meta["attnx"], str) or not isinstance(meta["attnx.checksum"], str):
        raise SessionError(f"{path}: corrupted metadata (its attnx entries must be strings)")
    return meta


def _header(meta: Mapping[str, str], path: str) -> dict[str, Any]:
    """The attnx header of a session's metadata, every field checked for its type and range:
    SessionError if any is missing or wrong."""
    header = _parse(meta["attnx"], path, "the attnx header")
    if not isinstance(header, dict):
        raise SessionError(f"{path}: corrupted attnx header (not a JSON object)")
    if header.get("format") != FORMAT:
        got = reprlib.repr(header.get("format"))
        raise SessionError(f"{path}: format {got}, this attnx reads {FORMAT!r}")
    wrong = _wrong_fields(header)
    if wrong:
        raise SessionError(f"{path}: corrupted attnx header ({'; '.join(wrong)})")
    if header["length"] < 0 or not re.fullmatch("[0-9a-f]{64}", header["root"]):
        raise SessionError(
            f"{path}: corrupted attnx header (length {header['length']}, "
            f"root digest {reprlib.repr(header['root'])})"
        )
    tokens = header.get("tokens")
    if tokens is not None and not _token_list(tokens, header["length"]):
        raise SessionError(
            f"{path}: corrupted attnx header (token ids: expected null or "
            f"{header['length']} ints in int64)"
        )
    return header


def _wrong_fields(header: dict[str, Any]) -> list[str]:
    """What is wrong with the header's fields' types (and the linear layers' values)."""
    wrong = [
        f"{k} is {type(header.get(k)).__name__}, expected {kind.__name__}"
        for k, kind in _FIELDS.items()
        if type(header.get(k)) is not kind
    ]
    if type(header.get("linear_layers", 0)) is not int or header.get("linear_layers", 0) < 0:
        wrong.append("linear_layers: expected an int >= 0")
    shape = header.get("state_shape")
    if shape is not None and not (
        isinstance(shape, list) and len(shape) == 3 and all(type(d) is int and d > 0 for d in shape)
    ):
        wrong.append("state_shape: expected null or 3 ints > 0")
    return wrong


def _token_list(tokens: Any, length: int) -> bool:
    """Whether ``tokens`` is a list of ``length`` ints in int64."""
    return (
        isinstance(tokens, list)
        and len(tokens) == length
        and all(type(t) is int and -(2**63) <= t < 2**63 for t in tokens)
    )


def decode(
    data: bytes, path: str, cache: Any, expect: Mapping[str, Any] | None
) -> tuple[dict[str, np.ndarray], int, np.ndarray | None, bytes]:
    """Checks session bytes against ``cache`` and ``expect``: the tensors (in the cache's
    dtype), the length, the token ids and the chain's root digest. Raises :class:`SessionError`."""
    meta = _metadata(data, path)
    header = _header(meta, path)
    try:
        stored = _safetensors_numpy().load(data)
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error type for a malformed file)
        raise SessionError(f"{path}: truncated or corrupted tensors ({e})") from None
    except BaseException as e:  # (a panic in its Rust code: pyo3's PanicException)
        if type(e).__name__ != "PanicException":
            raise
        raise SessionError(f"{path}: truncated or corrupted tensors ({e})") from None
    if _checksum(meta["attnx"], stored) != meta["attnx.checksum"]:
        raise SessionError(f"{path}: checksum mismatch: the file is corrupted")
    _check_model(header, geometry(cache), expect, path)
    return _tensors(header, stored, cache, path)


def _check_model(
    header: dict[str, Any], geom: dict[str, Any], expect: Mapping[str, Any] | None, path: str
) -> None:
    fields = dict.fromkeys(_GEOMETRY) | _HYBRID
    wrong = [
        f"{k}: file {reprlib.repr(header.get(k, d))}, cache {geom.get(k, d)!r}"
        for k, d in fields.items()
        if header.get(k, d) != geom.get(k, d)
    ]
    if wrong:
        raise SessionError(f"{path}: made for another cache geometry ({'; '.join(wrong)})")
    if expect is None:
        return
    if not isinstance(expect, Mapping):
        raise TypeError(f"expect: expected a dict of meta entries, got {type(expect).__name__}")
    meta = header.get("meta")
    user: dict[str, Any] = meta if isinstance(meta, dict) else {}
    # compared as canonical JSON, so that true is not 1 and 1.0 is not 1
    wanted = {k: _json(v, "expect") for k, v in expect.items()}
    try:
        wrong = [
            f"{k}: file {reprlib.repr(user.get(k, '<missing>'))}, expected {v!r}"
            for k, v in expect.items()
            if k not in user or _json(user[k], "meta") != wanted[k]
        ]
    except RecursionError:
        raise SessionError(f"{path}: corrupted meta (nested too deeply)") from None
    if wrong:
        raise SessionError(f"{path}: made for another model ({'; '.join(wrong)})")


def _tensors(
    header: dict[str, Any], stored: dict[str, np.ndarray], cache: Any, path: str
) -> tuple[dict[str, np.ndarray], int, np.ndarray | None, bytes]:
    n, tokens = header["length"], header.get("tokens")  # (checked by _header)
    root = bytes.fromhex(header["root"])
    ids = None if tokens is None else np.array(tokens, np.int64).reshape(n)
    names = ["k"] + ([] if cache.value_from_key else ["v"])
    if cache.quantised:  # one float32 scale per (layer, head, token) of each stored tensor
        names += [f"{name}_scales" for name in names]
    if cache.linear_layers:  # the recurrent states, float32 (linear_layers, Hv, K, V)
        names.append("state")
    widths = {"k": (cache.head_dim,), "v": (cache.value_dim,), "k_scales": (), "v_scales": ()}
    out = {}
    for name in names:
        t = stored.get(name)
        dtype = np.dtype(np.float32) if name in ("k_scales", "v_scales", "state") else cache.dtype
        shape = (
            (cache.linear_layers,) + tuple(cache.state_shape)
            if name == "state"
            else (cache.num_layers, cache.num_kv_heads, n) + widths[name]
        )
        if t is None or t.shape != shape or t.dtype != _stored(np.empty(0, dtype)).dtype:
            raise SessionError(f"{path}: tensor {name!r} is not {shape} of {dtype.name}")
        out[name] = t.view(dtype)
    if set(stored) != set(names):
        raise SessionError(f"{path}: unexpected tensors {sorted(set(stored) - set(names))}")
    return out, n, ids, root


def info(path: str | bytes | os.PathLike[Any]) -> dict[str, Any]:
    """The header of the session file ``path`` (geometry, length, token ids, meta), read
    without its tensors or checking its checksum (``load`` checks); every field is checked as
    ``load`` checks it. Raises :class:`SessionError` for a file that is no session."""
    p = path_str(path)
    with open(p, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        data = head + f.read(min(n, 1 << 28))
    return _header(_metadata(data, p), p)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
