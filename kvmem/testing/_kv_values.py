"""The K/V values of the fuzzer's device: one int64 per token position, never 0, that depends on
the namespace and the whole token prefix (a read through a wrong page is visible)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer, token_array

__all__ = ["kv_value_array", "namespace_key"]

Int64Array = npt.NDArray[np.int64]

_B = 0x9E3779B97F4A7C15  # odd, so invertible mod 2**64
_B_INV = pow(_B, -1, 1 << 64)
_POS = np.uint64(0xD6E8FEB86659FD93)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_powers: dict[str, npt.NDArray[np.uint64]] = {}


def _power_table(n: int) -> tuple[npt.NDArray[np.uint64], ...]:
    """``B**i``, ``B**-i`` and ``i * POS`` mod 2**64 for ``i < n`` (grown on demand, shared)."""
    have = _powers.get("b")
    if have is None or have.size < n:
        size = max(n, 1024, 0 if have is None else 2 * have.size)
        with np.errstate(over="ignore"):
            b = np.full(size, _B, dtype=np.uint64)
            b[0] = 1
            binv = np.full(size, _B_INV, dtype=np.uint64)
            binv[0] = 1
            _powers["b"] = np.multiply.accumulate(b)
            _powers["binv"] = np.multiply.accumulate(binv)
            _powers["pos"] = np.arange(size, dtype=np.uint64) * _POS
    return _powers["b"][:n], _powers["binv"][:n], _powers["pos"][:n]


def namespace_key(namespace: Any) -> int:
    """A stable 64-bit key of a namespace (the same in every process)."""
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def kv_value_array(ns_key: int, tokens: npt.ArrayLike) -> Int64Array:
    """The K/V value of every position of a token stream: ``[n]``, int64, never 0.

    ``ns_key``: an integer in ``0 .. 2**64 - 1`` (:func:`namespace_key`); ``tokens``: ``[n]``
    token ids (a 1-D sequence, array or tensor of ints in ``0 .. 2**31 - 1``; floats are
    refused, not truncated).

    Position ``i``'s value mixes the namespace key, ``i`` and a polynomial hash of tokens
    ``0 .. i`` (computed for all positions at once: ``h(i) = B**i * sum_j (t_j + 1) B**-j``), so
    two streams agree at ``i`` only if they agree on the namespace and the whole prefix.
    """
    integer(ns_key, "ns_key", minimum=0, maximum=(1 << 64) - 1)  # (namespace_key's)
    t = token_array(tokens, "tokens").view(np.uint64)  # (the same bits as astype)
    n = t.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    pb, pinv, pos = _power_table(n)
    # (Array arithmetic wraps mod 2**64 silently: no np.errstate needed, it costs 2 us a call.)
    s = t + np.uint64(1)
    s *= pinv
    np.cumsum(s, out=s)
    h = pb * s
    h ^= np.uint64(ns_key)
    h += pos
    h ^= h >> _S33
    h *= _M1
    h ^= h >> _S33
    h *= _M2
    h ^= h >> _S33
    out = h.view(np.int64)
    out |= 1  # never 0: 0 is a slot nothing wrote
    return out
