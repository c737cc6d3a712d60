"""Bytes on the wire: a JSON header and raw numpy arrays, no pickle.

::

    b"KVMW" | u32 little-endian header length | header (UTF-8 JSON) | array bytes, back to back

The header holds ``"kind"`` (what the bytes are: ``"bundle"``, ``"offer"``, ``"confirm"``,
``"answer"``), the caller's fields, and ``"arrays"``: ``[name, dtype, shape]`` per array, in the
order their bytes follow (C order, little-endian dtypes only). Nothing in the bytes is executed
or imported; a malformed input raises :class:`~kvmem.errors.ArgumentError`.

Namespaces (None, str, int, bytes, bool, tuples of those) travel as tagged JSON
(:func:`namespace_json`), so the receiver gets back the very namespace the sender used.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = ["namespace_from_json", "namespace_json", "pack", "unpack"]

MAGIC = b"KVMW"
_DTYPES = {"uint8", "int32", "int64", "uint64", "float32"}


def pack(kind: str, header: dict[str, Any], arrays: dict[str, npt.NDArray[Any]]) -> bytes:
    """``header`` (JSON-serializable) and ``arrays`` as bytes (see the module docstring)."""
    arrs = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    for name, a in arrs.items():
        if a.dtype.name not in _DTYPES:
            raise ArgumentTypeError(f"array {name!r} has dtype {a.dtype}; the wire carries "
                                    f"{sorted(_DTYPES)} (view other data as uint8)")
    head = {**header, "kind": kind,
            "arrays": [[n, a.dtype.name, list(a.shape)] for n, a in arrs.items()]}
    text = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(text)), text,
                     *(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
                       for a in arrs.values())])


def unpack(data: bytes, kind: str | None = None
           ) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """(header, arrays) of bytes made by :func:`pack`; ``kind``: the kind expected (None: any;
    the header's ``"kind"`` says which). Arrays are read-only views of ``data``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < 8 or data[:4] != MAGIC:
        raise ArgumentError(f"not kvmem wire bytes (they start {data[:4]!r}, expected {MAGIC!r})")
    (size,) = struct.unpack_from("<I", data, 4)
    try:
        head = json.loads(data[8 : 8 + size])
        specs = head.pop("arrays")
        if not isinstance(head, dict) or not isinstance(specs, list):
            raise ValueError("not a header")
    except (ValueError, KeyError, AttributeError) as e:
        raise ArgumentError(f"kvmem wire bytes with a malformed header ({e})") from None
    if kind is not None and head.get("kind") != kind:
        raise ArgumentError(f"expected a {kind!r}, got a {head.get('kind')!r}")
    arrays: dict[str, npt.NDArray[Any]] = {}
    at = 8 + size
    for spec in specs:
        try:
            name, dtype_name, shape = spec
            if dtype_name not in _DTYPES:
                raise ValueError(f"dtype {dtype_name!r}")
            dtype = np.dtype(dtype_name).newbyteorder("<")
            count = int(np.prod(shape, dtype=np.int64))
            if count < 0 or at + count * dtype.itemsize > len(data):
                raise ValueError(f"array {name!r} runs past the end")
            arrays[name] = np.frombuffer(data, dtype, count, at).reshape(shape)
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"kvmem wire bytes with a malformed array ({e})") from None
        at += count * dtype.itemsize
    if at != len(data):
        raise ArgumentError(f"kvmem wire bytes: {len(data) - at} bytes past the last array")
    return head, arrays


def namespace_json(namespace: Any) -> Any:
    """A namespace as tagged JSON: ``None`` -> null; ``{"s": str}``, ``{"i": int}``,
    ``{"o": bool}``, ``{"b": hex}``, ``{"t": [...]}``."""
    if namespace is None:
        return None
    if isinstance(namespace, (bool, np.bool_)):
        return {"o": bool(namespace)}
    if isinstance(namespace, (int, np.integer)):
        return {"i": int(namespace)}
    if isinstance(namespace, str):
        return {"s": namespace}
    if isinstance(namespace, bytes):
        return {"b": namespace.hex()}
    if isinstance(namespace, tuple):
        return {"t": [namespace_json(x) for x in namespace]}
    raise ArgumentTypeError(f"namespace must be None, str, int, bytes or a tuple of those, got "
                            f"{type(namespace).__name__}")


def namespace_from_json(value: Any) -> Any:
    """The namespace :func:`namespace_json` encoded."""
    if value is None:
        return None
    if isinstance(value, dict) and len(value) == 1:
        (tag, v), = value.items()
        if tag == "o":
            return bool(v)
        if tag == "i":
            return int(v)
        if tag == "s":
            return str(v)
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "t":
            return tuple(namespace_from_json(x) for x in v)
    raise ArgumentError(f"malformed namespace {value!r} in kvmem wire bytes")
