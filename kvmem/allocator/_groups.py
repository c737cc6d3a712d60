"""KV cache group specs: one frozen, validated spec per kind of group a hybrid model has.

::

    FullAttentionSpec   pages of page_size tokens, bytes_per_token each (all its layers together)
    SlidingWindowSpec   the same, but a request reads only its last `window` tokens
    StateSpec           one fixed-size state per request (Mamba, gated delta net): one slot
    IndexerSpec         a per-token side cache on the token positions of one full-attention
                        group (a DSA indexer): the same page size, its own bytes per token

A group's page is the unit its allocator hands out: ``page_bytes`` bytes, holding
``page_size`` tokens (a state group's page is one request's state). No group is padded to
another's page size. Describe groups as the engine's kernels see them: a group is the set of
layers that share one page table (all full-attention layers of a model, say), and its bytes
per token count all of them.

The specs are plain frozen dataclasses (``kvmem.allocator`` imports no pydantic); a bad value
raises :class:`~kvmem.errors.ConfigError` (a ``ValueError``) or
:class:`~kvmem.errors.ArgumentTypeError` (a ``TypeError``) naming the spec, the field and the
value, and builds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmem._validate import INT32_MAX, is_integer_like, show
from kvmem.errors import ArgumentTypeError, ConfigError

__all__ = [
    "FullAttentionSpec",
    "GroupSpec",
    "IndexerSpec",
    "SlidingWindowSpec",
    "StateSpec",
    "check_groups",
    "first_window_page",
]


def _field(spec: object, name: str, value: Any, minimum: int = 1,
           maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``, or the spec's error naming the field."""
    cls = type(spec).__name__
    if not is_integer_like(value):
        raise ArgumentTypeError(f"invalid {cls}: {name}={show(value)}: expected an integer "
                                f">= {minimum} (int or numpy integer; not bool, float or str).")
    v = int(value)
    if v < minimum or (maximum is not None and v > maximum):
        bound = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"invalid {cls}: {name}={v}: expected an integer {bound}.")
    object.__setattr__(spec, name, v)  # a numpy integer becomes an int
    return v


def _name(spec: object, value: Any) -> None:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"invalid {type(spec).__name__}: name={show(value)}: expected "
                                "a string.")
    if not value or not value.isidentifier():
        raise ConfigError(f"invalid {type(spec).__name__}: name={value!r}: expected a "
                          "non-empty identifier (letters, digits, underscores), e.g. 'full'.")


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Full attention: every token stays resident; pages of ``page_size`` tokens.

    ``bytes_per_token`` counts every layer of the group (K and V, scales included).
    """

    name: str
    page_size: int
    bytes_per_token: int

    def __post_init__(self) -> None:
        _name(self, self.name)
        _field(self, "page_size", self.page_size, maximum=INT32_MAX)
        _field(self, "bytes_per_token", self.bytes_per_token)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    def num_pages(self, num_tokens: int) -> int:
        """Pages a request of ``num_tokens`` tokens holds: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Sliding-window attention: a query at position q reads keys ``q - window + 1 .. q``.

    Pages wholly before the window of the next query are no longer read and can be released
    (see :func:`first_window_page` and :class:`~kvmem.allocator.WindowRow`).
    """

    name: str
    window: int
    page_size: int
    bytes_per_token: int

    def __post_init__(self) -> None:
        _name(self, self.name)
        _field(self, "window", self.window, maximum=INT32_MAX)
        _field(self, "page_size", self.page_size, maximum=INT32_MAX)
        _field(self, "bytes_per_token", self.bytes_per_token)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    def num_pages(self, num_tokens: int) -> int:
        """Pages a request holds between steps once ``num_tokens`` tokens are computed: those
        from the next query's window (position ``num_tokens``) to its last token's page."""
        last = -(-num_tokens // self.page_size)
        return last - min(last, first_window_page(num_tokens, self.window, self.page_size))


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A fixed-size recurrent state per request (Mamba, gated delta net): one slot, whatever
    its length. ``bytes_per_state`` counts every layer of the group (conv and SSM states)."""

    name: str
    bytes_per_state: int

    def __post_init__(self) -> None:
        _name(self, self.name)
        _field(self, "bytes_per_state", self.bytes_per_state)

    @property
    def page_size(self) -> int:
        return 0  # a slot holds a state, not tokens

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_state

    def num_pages(self, num_tokens: int) -> int:
        """One slot per request, whatever its length."""
        return 1


@dataclass(frozen=True, slots=True)
class IndexerSpec:
    """A per-token side cache on the token positions of the full-attention group
    ``attention`` (a DSA indexer's keys): the same page size, so its page i holds the tokens
    of the attention group's page i, at ``bytes_per_token`` bytes each."""

    name: str
    attention: FullAttentionSpec
    bytes_per_token: int

    def __post_init__(self) -> None:
        _name(self, self.name)
        if not isinstance(self.attention, FullAttentionSpec):
            raise ArgumentTypeError(f"invalid IndexerSpec: attention={show(self.attention)}: "
                                    "expected the FullAttentionSpec whose tokens it indexes.")
        _field(self, "bytes_per_token", self.bytes_per_token)

    @property
    def page_size(self) -> int:
        return self.attention.page_size

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    def num_pages(self, num_tokens: int) -> int:
        """As many pages as its attention group's: ceil(num_tokens / page_size)."""
        return self.attention.num_pages(num_tokens)


GroupSpec = FullAttentionSpec | SlidingWindowSpec | StateSpec | IndexerSpec
_KINDS = (FullAttentionSpec, SlidingWindowSpec, StateSpec, IndexerSpec)


def check_groups(groups: Sequence[GroupSpec]) -> tuple[GroupSpec, ...]:
    """``groups`` as a tuple, if they can serve one model together.

    One or more specs, distinct names, and every indexer's attention group among them.
    Raises ConfigError / ArgumentTypeError naming the problem; returns the groups in order.
    """
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ArgumentTypeError(f"groups={show(groups)}: expected a list of group specs "
                                "(FullAttentionSpec, SlidingWindowSpec, StateSpec, IndexerSpec).")
    out = tuple(groups)
    if not out:
        raise ConfigError("groups=[]: a model needs at least one KV cache group.")
    for i, spec in enumerate(out):
        if not isinstance(spec, _KINDS):
            raise ArgumentTypeError(f"groups[{i}]={show(spec)}: expected a group spec "
                                    "(FullAttentionSpec, SlidingWindowSpec, StateSpec, "
                                    "IndexerSpec).")
    names = [spec.name for spec in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"groups name {repeated} more than once: give every group its own "
                          "name.")
    for spec in out:
        if isinstance(spec, IndexerSpec) and spec.attention not in out:
            raise ConfigError(f"indexer group {spec.name!r} indexes attention group "
                              f"{spec.attention.name!r}, which is not among the groups "
                              f"{names}: add it, or index one of them.")
    return out


def first_window_page(num_computed: int, window: int, page_size: int) -> int:
    """Index (in the request's row) of the first page the next query still reads.

    The next query sits at position ``num_computed`` and reads keys from
    ``num_computed - window + 1``; pages before that one's page hold only tokens no later
    query reads. ``0`` while the window still reaches the first token.
    """
    return max(0, num_computed - window + 1) // page_size
