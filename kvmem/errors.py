"""Every error kvmem raises, in one place.

::

    KVMemError                      root: catch this to catch everything kvmem raises
    ├── OutOfPagesError             an allocation asked for more pages than are free
    ├── InvalidFreeError            a free of a page that is free, out of range, or over-freed
    ├── IntegrityError              bookkeeping or a request's page mapping is inconsistent
    └── ConfigError (ValueError)    a spec, plan or model description that cannot work

Messages say what was asked, what was found, and what to do. An operation that raises has
changed no state.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "IntegrityError",
    "InvalidFreeError",
    "KVMemError",
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
