"""kvmem: a paged KV-cache memory manager for LLM inference engines."""

from __future__ import annotations

from kvmem.errors import ConfigError, IntegrityError, InvalidFreeError, KVMemError, OutOfPagesError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "IntegrityError",
    "InvalidFreeError",
    "KVMemError",
    "OutOfPagesError",
    "__version__",
]
