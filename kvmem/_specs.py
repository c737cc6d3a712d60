"""The base of kvmem's validated, frozen specs (pydantic), and the field types they use.

Users type specs (``PoolSpec``, ``GPUSpec``, ``ModelSpec``, ``Workload``, ...) or load them from
JSON, so they are checked once, at the boundary, under the error contract of docs/errors.md:

- integer fields take an ``int`` or a numpy integer, never a ``bool``, a float or a string
  (pydantic's lax mode would turn ``True`` into 1 and ``"2"`` or ``2.0`` into 2);
- number fields take ints and floats (Python or numpy), finite, never a ``bool`` or a string;
- a copy made with ``model_copy(update=...)`` is checked like a new spec;
- a bad spec raises :class:`~kvmem.errors.ConfigError` (a ``ValueError``), or
  :class:`~kvmem.errors.ArgumentTypeError` (a ``TypeError``) when a field has the wrong type,
  never pydantic's ``ValidationError``; the message names each bad field and its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import numpy as np
from annotated_types import Ge, Gt
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from kvmem._validate import is_integer_like, show
from kvmem.errors import ArgumentTypeError, ConfigError, KVMemError

__all__ = [
    "FROZEN",
    "Int",
    "NonNegativeInt",
    "NonNegativeReal",
    "PositiveInt",
    "PositiveReal",
    "Real",
    "SpecModel",
    "spec_error",
]

FROZEN = ConfigDict(frozen=True, extra="forbid")


def _integer(value: Any) -> Any:
    if not is_integer_like(value):
        raise PydanticCustomError(
            "integer_like_type",
            "expected an integer (int or numpy integer; not bool, float or str)",
        )
    return int(value)


def _real(value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise PydanticCustomError("real_type", "expected a number (int or float; not bool or str)")
    v = float(value)
    if not math.isfinite(v):
        raise PydanticCustomError("finite_number", "expected a finite number")
    return v


Int = Annotated[int, BeforeValidator(_integer)]
PositiveInt = Annotated[int, BeforeValidator(_integer), Gt(0)]
NonNegativeInt = Annotated[int, BeforeValidator(_integer), Ge(0)]
Real = Annotated[float, BeforeValidator(_real)]
PositiveReal = Annotated[float, BeforeValidator(_real), Gt(0)]
NonNegativeReal = Annotated[float, BeforeValidator(_real), Ge(0)]

# pydantic error types that mean "wrong type" rather than "wrong value".
_TYPE_ERRORS = frozenset(
    {
        "integer_like_type",
        "real_type",
        "int_type",
        "float_type",
        "bool_type",
        "string_type",
        "dict_type",
        "list_type",
        "model_type",
        "model_attributes_type",
        "is_instance_of",
    }
)


def spec_error(cls_name: str, exc: ValidationError) -> KVMemError:
    """One kvmem error for a pydantic ``ValidationError``, naming every bad field and value."""
    parts = []
    is_type = False
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ").removeprefix(
            "Assertion failed, "
        )
        kind = str(err.get("type", ""))
        is_type = is_type or kind in _TYPE_ERRORS
        if kind == "missing":
            parts.append(f"{loc} is required but was not given")
        elif kind == "extra_forbidden":
            parts.append(f"{loc} is not a field of {cls_name}")
        elif loc:
            parts.append(f"{loc}={show(err.get('input'))}: {msg}")
        else:
            parts.append(msg)
    text = f"invalid {cls_name}: " + "; ".join(parts)
    if not text.endswith("."):
        text += "."
    return ArgumentTypeError(text) if is_type else ConfigError(text)


class SpecModel(BaseModel):
    """A frozen pydantic model whose validation errors are kvmem errors (see module doc)."""

    model_config = FROZEN
    positional_fields: ClassVar[tuple[str, ...]] = ()  # fields that may be given by position

    def __init__(self, *args: Any, **data: Any) -> None:
        name = type(self).__name__
        if len(args) > len(self.positional_fields):
            raise ArgumentTypeError(
                f"{name} got {len(args)} positional arguments {show(args)}: it takes "
                f"{len(self.positional_fields)} ({', '.join(self.positional_fields) or 'none'}); "
                f"pass fields by name, e.g. {name}(field=value).")
        for field, value in zip(self.positional_fields, args):
            if field in data:
                raise ArgumentTypeError(f"{name} got {field} twice (by position and by name).")
            data[field] = value
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise spec_error(type(self).__name__, e) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise ArgumentTypeError(
            f"{type(self).__name__} is frozen: cannot set {name}={show(value)}; build a new one, "
            f"e.g. {type(self).__name__}(**{{**spec.model_dump(), {name!r}: value}})."
        )

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any:
        """A copy, with ``update``'s fields changed and checked like a new spec's (pydantic's
        own ``model_copy(update=...)`` checks nothing: ``num_pages=0`` would pass)."""
        if not update:
            return super().model_copy(deep=deep)
        if not isinstance(update, Mapping):
            raise ArgumentTypeError(f"update={show(update)}: expected a dict of "
                                    f"{type(self).__name__} fields.")
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields},
                             **update})

    @classmethod
    def from_json(cls, text: str | bytes) -> Any:
        """Parse a spec written by ``model_dump_json``; bad input raises a kvmem error."""
        if not isinstance(text, (str, bytes)):
            raise ArgumentTypeError(f"text={show(text)}: expected a JSON string or bytes.")
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise spec_error(cls.__name__, e) from None

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Validate a dict (e.g. from ``json.load``); bad input raises a kvmem error."""
        if not isinstance(data, dict):
            raise ArgumentTypeError(f"data={show(data)}: expected a dict of {cls.__name__} fields.")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise spec_error(cls.__name__, e) from None
