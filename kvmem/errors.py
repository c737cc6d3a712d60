"""Every error kvmem raises, in one place.

::

    KVMemError                          root: catch this to catch everything kvmem raises
    ├── OutOfPagesError                 an allocation asked for more pages (or byte-arena
    │                                   chunks) than are free
    ├── InvalidFreeError                a free of a page that is free, out of range, or over-freed
    ├── IntegrityError                  bookkeeping or a request's page mapping is inconsistent
    ├── ConcurrentUseError              a second thread entered a manager another one is in
    ├── HookError                       a hook raised; the operation itself completed
    ├── IncompatibleCacheError          two caches whose pages cannot be exchanged (a transfer)
    ├── ArgumentError (ValueError)      an argument of the right type with a value that cannot
    │   │                               work: out of range, wrong shape, unknown name
    │   ├── ConfigError                 a spec, plan or model description that cannot work
    │   └── MetadataError               kernel metadata given to verify() is malformed
    └── ArgumentTypeError (TypeError)   an argument of the wrong type: a bool, float or str where
                                        an integer is expected, a list where a tensor is

Messages say what was asked, what was found, and what to do. An operation that raises has
changed no state, except where a hook raised (``HookError``): the operation completed first.
The contract every public entry point keeps (what "integer-like" means, page ids that never
wrap, negative ids that never index from the end) is in docs/errors.md.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ConcurrentUseError",
    "ConfigError",
    "HookError",
    "IncompatibleCacheError",
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

    def __init__(self, num_requested: int, num_free: int, what_to_do: str | None = None,
                 unit: str = "pages") -> None:
        self.num_requested = num_requested
        self.num_free = num_free
        if what_to_do is None:
            what_to_do = "Free or evict pages first, or check can_allocate() before allocating."
        super().__init__(
            f"asked for {num_requested} {unit} but only {num_free} are free; nothing was "
            f"allocated. {what_to_do}"
        )


class InvalidFreeError(KVMemError):
    """A free named a page that is free, out of range, or more times than it has holders.

    Nothing was freed: the allocator validates the whole call before changing anything.
    """


class IntegrityError(KVMemError):
    """Page bookkeeping, or a request's mapping of pages, is inconsistent."""


class ArgumentError(KVMemError, ValueError):
    """An argument has an acceptable type but a value that cannot work (out of range, wrong
    shape or length, an unknown name). Nothing was changed."""


class ArgumentTypeError(KVMemError, TypeError):
    """An argument has the wrong type: a bool, float or str where an integer is expected, a
    list where a tensor is, a tensor of the wrong dtype. Nothing was changed."""


class ConfigError(ArgumentError):
    """A configuration (pool spec, model, plan) that cannot work as given."""


class MetadataError(ArgumentError):
    """Kernel metadata given to ``verify`` is malformed (a field of the wrong shape, a CSR whose
    ``kv_indptr`` does not fit its ``kv_indices``...): it was refused, nothing changed."""


class HookError(KVMemError):
    """A hook raised. The operation that triggered it completed (``result`` is what it
    returned: a step's metadata, a handle, a report); every other hook still ran."""

    result: object = None


class ConcurrentUseError(KVMemError):
    """Two threads were inside one manager at once; the second was refused before it changed
    anything. A manager is used by one thread at a time (hold a lock of your own around it)."""


class IncompatibleCacheError(KVMemError):
    """Two caches whose pages cannot be exchanged: a field of their ``CacheIdentity`` (model,
    weights, page shape, format version) differs. A different KV dtype, scale mode or layout is
    not refused: the receiver converts. ``field``, ``mine`` and ``theirs`` name the difference."""

    def __init__(self, field: str, mine: object, theirs: object) -> None:
        self.field, self.mine, self.theirs = field, mine, theirs
        super().__init__(f"the peer's cache differs in {field}: {theirs!r} there, {mine!r} "
                         "here; pages can move only between caches of the same model, weights, "
                         "page shape and format version (nothing was transferred)")
