"""Every error kvmem raises, in one place.

::

    KVMemError                      root: catch this to catch everything kvmem raises
    ├── OutOfPagesError             an allocation asked for more pages than are free
    ├── InvalidFreeError            a free of a page that is free, out of range, or over-freed
    ├── IntegrityError              bookkeeping or a request's page mapping is inconsistent
    ├── MetadataError (ValueError)  kernel metadata handed to verify() is malformed
    ├── ConcurrentUseError          two threads inside one manager at once
    ├── ArgumentError (ValueError)  an argument has a wrong value (a negative count, ...)
    ├── ArgumentTypeError (TypeError)  an argument has a wrong type (a float for an int, ...)
    └── ConfigError (ValueError)    a spec, plan or model description that cannot work

Messages say what was asked, what was found, and what to do. An operation that raises has
changed no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ConcurrentUseError",
    "ConfigError",
    "IntegrityError",
    "InvalidFreeError",
    "KVMemError",
    "MetadataError",
    "OutOfPagesError",
]


class KVMemError(Exception):
    """Root of every error kvmem raises."""


class OutOfPagesError(KVMemError):
    """An allocation asked for more pages than are free; nothing was allocated."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        self.num_requested = num_requested
        self.num_free = num_free
        super().__init__(
            f"asked for {num_requested} pages but only {num_free} are free; nothing was "
            "allocated. Free or evict pages first, or check can_allocate() before allocating."
        )


class InvalidFreeError(KVMemError):
    """A free named a page that is free, out of range, or more times than it has holders.

    Nothing was freed: the allocator validates the whole call before changing anything.
    """


class IntegrityError(KVMemError):
    """Page bookkeeping, or a request's mapping of pages, is inconsistent."""


class ConfigError(KVMemError, ValueError):
    """A configuration (pool spec, model, plan) that cannot work as given."""


class MetadataError(KVMemError, ValueError):
    """Kernel metadata given to ``verify`` is malformed (a field of the wrong shape, a CSR whose
    ``kv_indptr`` does not fit its ``kv_indices``...): it was refused, nothing changed."""


class ConcurrentUseError(KVMemError):
    """Two threads were inside one manager at once; the second was refused before it changed
    anything. A manager is used by one thread at a time (hold a lock of your own around it)."""


class ArgumentError(KVMemError, ValueError):
    """An argument has a value the call cannot take; nothing changed."""


class ArgumentTypeError(KVMemError, TypeError):
    """An argument has a type the call cannot take; nothing changed."""


# -- argument checks: the contract every public entry point keeps (docs/errors.md) ------------
# Integer-like means a Python int or a numpy integer, never a bool, a float or a str.


def as_int(name: str, value: Any, minimum: int | None = 0, maximum: int | None = None) -> int:
    """``value`` as an int if it is integer-like and in ``[minimum, maximum]``; else
    ArgumentTypeError / ArgumentError naming ``name``, the value and what was expected."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ArgumentTypeError(
            f"{name} must be an int (or a numpy integer), got {type(value).__name__} {value!r}"
        )
    out = int(value)
    if (minimum is not None and out < minimum) or (maximum is not None and out > maximum):
        bounds = (f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
                  if minimum is not None else f"<= {maximum}")
        raise ArgumentError(f"{name} must be {bounds}, got {out}; nothing changed")
    return out


def as_ints(name: str, values: Any, minimum: int | None = 0, maximum: int | None = None,
            size: int | None = None) -> npt.NDArray[np.int64]:
    """``values`` (a 1-D sequence or array of integer-likes) as ``[k]`` int64, each in
    ``[minimum, maximum]`` and ``k == size`` when given; else ArgumentTypeError / ArgumentError.
    One value where a sequence is expected is refused."""
    if isinstance(values, (str, bytes)) or np.ndim(values) != 1:
        raise ArgumentTypeError(
            f"{name} must be a 1-D sequence of ints, got {type(values).__name__} {values!r:.60}"
        )
    arr = np.asarray(values)
    if arr.size and (arr.dtype.kind not in "iu" or arr.dtype == np.bool_):
        raise ArgumentTypeError(f"{name} must hold ints, got {arr.dtype} ({values!r:.60})")
    if size is not None and arr.size != size:
        raise ArgumentError(f"{name} must list {size} values, got {arr.size}; nothing changed")
    if arr.size and arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > 2**62:
        raise ArgumentError(f"{name} holds {int(arr.max())}, far out of range; nothing changed")
    out = arr.astype(np.int64)
    bad = np.zeros(out.size, dtype=bool)
    if minimum is not None:
        bad |= out < minimum
    if maximum is not None:
        bad |= out > maximum
    if bad.any():
        raise ArgumentError(
            f"{name} must hold values in {minimum}..{maximum if maximum is not None else 'inf'},"
            f" got {out[bad].tolist()[:8]}; nothing changed"
        )
    return out


def as_ids(name: str, values: Any) -> tuple[Any, ...]:
    """Request ids given as a sequence (list, tuple, array...) as a tuple. One id where a
    sequence is expected (a str, bytes, an int) is refused: ``"AB"`` is not ``["A", "B"]``."""
    if type(values) is tuple:
        return values
    if type(values) is list:
        return tuple(values)
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return tuple(values.tolist())
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ArgumentTypeError(
            f"{name} must be a sequence of request ids (a list or tuple, in batch order), got "
            f"{type(values).__name__} {values!r:.60}; wrap one id in a list"
        )
    return tuple(values)


INT32_MAX = int(np.iinfo(np.int32).max)  # the largest page id or token id


def as_token_ids(name: str, value: Any) -> npt.NDArray[np.int64]:
    """Token ids (a 1-D sequence, array or tensor of ints in ``0 .. INT32_MAX``) as a fresh
    ``[n]`` int64 array: the caller keeps its own object."""
    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().cpu().numpy()
    if isinstance(value, (str, bytes)) or np.ndim(value) != 1:
        raise ArgumentError(f"{name} must be a 1-D sequence of ints, got "
                            f"{type(value).__name__} of shape {np.shape(value)}")
    tokens = np.asarray(value)
    if tokens.size == 0:
        return tokens.astype(np.int64)
    if tokens.dtype.kind not in "iu":
        raise ArgumentError(f"{name} must be ints, got {tokens.dtype}")
    if int(np.minimum.reduce(tokens)) < 0 or int(np.maximum.reduce(tokens)) > INT32_MAX:
        raise ArgumentError(f"{name} must be in 0..{INT32_MAX}, got min {int(tokens.min())} "
                            f"and max {int(tokens.max())}")
    return tokens.astype(np.int64)


def is_hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
