"""Argument checks shared by the public entry points (numpy only; no torch).

Every check raises :class:`~kvmem.errors.ArgumentTypeError` (a ``TypeError``) for a value of
the wrong type and :class:`~kvmem.errors.ArgumentError` (a ``ValueError``) for a value out of
range, with a message that names the argument, shows the value and says what was expected.

"Integer-like" is an ``int`` or a numpy integer, never a ``bool``, a float (even ``2.0``) or a
string: a count of ``1.5`` or ``"2"`` is refused, not truncated. "Real" adds Python and numpy
floats, finite only. Index arrays are 1-D integer arrays (numpy, or lists/tuples of
integer-likes); one integer where a list of ids is expected is refused, and bounds are checked
before anything is used, so a negative id never indexes from the end and a large one never
wraps.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "INT32_MAX",
    "choice",
    "flag",
    "holds_a_bool",
    "id_tuple",
    "index_array",
    "integer",
    "integers",
    "is_hashable",
    "is_integer_like",
    "real",
    "show",
    "token_array",
]

INT32_MAX = int(np.iinfo(np.int32).max)  # the largest page id or token id

_SHOW_CHARS = 60


def show(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, with its type: ``True (bool)``, ``[1.5] (list)``."""
    text = repr(value)
    if len(text) > _SHOW_CHARS:
        text = text[: _SHOW_CHARS - 3] + "..."
    return f"{text} ({type(value).__name__})"


def is_integer_like(value: Any) -> bool:
    """An ``int`` or numpy integer, and not a ``bool`` (nor ``np.bool_``)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in {minimum}..{maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def integer(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as a Python int, if it is integer-like and within ``[minimum, maximum]``."""
    if type(value) is int:  # the common case, without the isinstance chain
        v = value
    elif is_integer_like(value):
        v = int(value)
    else:
        raise ArgumentTypeError(f"{name}={show(value)}: expected {_an_integer(minimum, maximum)}.")
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise ArgumentError(f"{name}={v}: expected {_an_integer(minimum, maximum)}.")
    return v


def _an_integer(minimum: int | None, maximum: int | None) -> str:
    return f"an integer{_bounds(minimum, maximum)} (int or numpy integer; not bool, float or str)"


def real(
    value: Any,
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float:
    """``value`` as a finite float (int, float or numpy number; not bool or str) in range.

    ``exclusive_minimum`` makes the lower bound strict (``> minimum``).
    """
    low = "" if minimum is None else f" {'>' if exclusive_minimum else '>='} {minimum:g}"
    high = "" if maximum is None else f"{' and' if low else ''} <= {maximum:g}"
    want = f"a finite number{low}{high} (int or float; not bool or str)"
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ArgumentTypeError(f"{name}={show(value)}: expected {want}.")
    v = float(value)
    too_low = minimum is not None and (v <= minimum if exclusive_minimum else v < minimum)
    if not math.isfinite(v) or too_low or (maximum is not None and v > maximum):
        raise ArgumentError(f"{name}={v!r}: expected {want}.")
    return v


def flag(value: Any, name: str) -> bool:
    """``value`` if it is a ``bool`` (or ``np.bool_``); 0/1 and strings are refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name}={show(value)}: expected True or False.")
    return bool(value)


def choice(value: Any, name: str, options: Collection[str]) -> str:
    """``value`` if it is one of the strings ``options``."""
    listed = ", ".join(repr(o) for o in options)
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name}={show(value)}: expected one of {listed}.")
    if value not in options:
        raise ArgumentError(f"{name}={value!r}: expected one of {listed}.")
    return value


def index_array(
    value: Any, name: str, *, bound: int | None = None, minimum: int = 0, what: str = "id"
) -> npt.NDArray[np.int64]:
    """A 1-D int64 copy of a sequence of integer-likes (numpy integer array, list or tuple).

    Refuses a scalar (one id where a list is expected), a string, bools, floats (``[1.7]`` is
    not page 1) and anything not 1-D; with ``bound``, every entry must lie in
    ``[minimum, bound)``: nothing is wrapped or indexed from the end.
    """
    want = f"a 1-D sequence of integer {what}s"
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple, range)):
        items = list(value)
        bad = [x for x in items if not is_integer_like(x)]
        if bad:
            raise ArgumentTypeError(
                f"{name} holds {show(bad[0])}: expected {want} (int or numpy integer; not bool, "
                "float or str)."
            )
        try:
            arr = np.array(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
        except OverflowError:
            raise ArgumentError(
                f"{name} holds an integer beyond int64: expected {what}s that fit in 64 bits."
            ) from None
    else:
        raise ArgumentTypeError(
            f"{name}={show(value)}: expected {want} (a list, tuple or integer array; one {what} "
            f"is passed as [{what}])."
        )
    if arr.ndim != 1:
        raise ArgumentError(f"{name} has shape {arr.shape}: expected {want}.")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name} has dtype {arr.dtype}: expected {want}.")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise ArgumentError(f"{name} holds {int(arr.max())}, beyond int64: expected {what}s "
                            "that fit in 64 bits.")
    out = arr.astype(np.int64)
    lo, hi = int(out.min()), int(out.max())
    if lo < minimum or (bound is not None and hi >= bound):
        valid = f"{minimum}..{bound - 1}" if bound is not None else f">= {minimum}"
        raise ArgumentError(
            f"{name} holds {what}s from {lo} to {hi}: expected every {what} in {valid}. "
            "Nothing was changed."
        )
    return out


def integers(value: Any, name: str, *, minimum: int = 0, maximum: int | None = None,
             size: int | None = None) -> npt.NDArray[np.int64]:
    """:func:`index_array` of counts in ``[minimum, maximum]`` (inclusive), ``size`` of them
    when given."""
    out = index_array(value, name, bound=None if maximum is None else maximum + 1,
                      minimum=minimum, what="count")
    if size is not None and out.size != size:
        raise ArgumentError(f"{name} lists {out.size} counts: expected {size}, one per request. "
                            "Nothing was changed.")
    return out


def id_tuple(value: Any, name: str) -> tuple[Any, ...]:
    """Request ids given as a sequence (list, tuple, 1-D array...) as a tuple. One id where a
    sequence is expected (a str, bytes, an int), a mapping or a set is refused: ``"AB"`` is not
    ``["A", "B"]``."""
    if type(value) is tuple:
        return value
    if type(value) is list:
        return tuple(value)
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return tuple(value.tolist())
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{name}={show(value)}: expected a sequence of request ids (a "
                                "list or tuple, in batch order); wrap one id in a list.")
    return tuple(value)


def token_array(value: Any, name: str) -> npt.NDArray[np.int64]:
    """Token ids (a 1-D sequence, array or tensor of ints in ``0 .. INT32_MAX``) as a fresh
    ``[n]`` int64 array: the caller keeps its own object."""
    if hasattr(value, "detach"):  # a torch tensor, on any device
        value = value.detach().cpu().numpy()
    try:
        tokens = None if isinstance(value, (str, bytes)) else np.asarray(value)
    except ValueError:  # ragged nested lists
        tokens = None
    if tokens is None or tokens.ndim != 1:
        shape = (f"a {type(value).__name__}" if isinstance(value, (str, bytes))
                 else "ragged" if tokens is None else f"shape {tokens.shape}")
        raise ArgumentError(f"{name}={show(value)}: expected a 1-D sequence of token ids, got "
                            f"{shape}.")
    if tokens.size == 0:
        return tokens.astype(np.int64)
    if tokens.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name} has dtype {tokens.dtype}: expected integer token ids "
                                "(int or numpy integer; not bool, float or str).")
    if isinstance(value, (list, tuple)) and holds_a_bool(value, tokens):
        raise ArgumentTypeError(f"{name} holds a bool: expected integer token ids (int or numpy "
                                "integer; True is not token 1).")
    if int(np.minimum.reduce(tokens)) < 0 or int(np.maximum.reduce(tokens)) > INT32_MAX:
        raise ArgumentError(f"{name} holds ids from {int(tokens.min())} to {int(tokens.max())}: "
                            f"expected token ids in 0..{INT32_MAX}.")
    return tokens.astype(np.int64)


def holds_a_bool(items: Sequence[Any], as_array: npt.NDArray[Any]) -> bool:
    """Whether a list of ints also holds a bool (numpy reads ``[5, True]`` as ``[5, 1]``): only
    the entries that read as 0 or 1 are looked at."""
    return any(isinstance(items[i], (bool, np.bool_))
               for i in np.flatnonzero(as_array <= 1).tolist())


def is_hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
