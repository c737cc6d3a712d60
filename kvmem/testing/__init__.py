"""Testing helpers for kvmem and for engines that embed it (need ``hypothesis`` where noted).

* :class:`ToyEngine` drives a :class:`~kvmem.manager.KVCacheManager` like an engine and keeps a
  numpy "KV" pool whose values depend on the namespace and the whole token prefix, so a wrong
  page anywhere is visible (numpy only).
* :class:`ManagerMachine` (hypothesis) runs every manager operation in any interleaving against
  a reference model; subclass it to check your own prefix cache or tracker.
* :mod:`kvmem.testing.faults` injects the bugs real engines shipped (BUGS.md) into a manager.
"""

from __future__ import annotations

from typing import Any

from kvmem.testing import faults
from kvmem.testing._toy_engine import ToyEngine, kv_values

__all__ = ["ManagerMachine", "ToyEngine", "faults", "kv_values", "prompts"]


def __getattr__(name: str) -> Any:
    # The state machine needs hypothesis (a dev dependency): import it only when asked for.
    if name in ("ManagerMachine", "prompts", "NAMESPACES"):
        from kvmem.testing import _machine

        return getattr(_machine, name)
    raise AttributeError(f"module 'kvmem.testing' has no attribute {name!r}")
