"""Faults: the bugs real engines shipped (``docs/BUGS.md``), as switches on a running system.

Two kinds, both through public surfaces only (no private attribute of the manager is touched):

* **One-shot faults** (functions): put a :class:`~kvmem.manager.KVCacheManager` into the state a
  bug produces, through its public components (``allocator``, ``table``, ``fences``), so that a
  test can prove the matching detector fires: ``verify`` aborts the victim and only the victim,
  or ``check`` reports the broken accounting.
* **The fault catalog** (:data:`CATALOG`, for ``kvmem fuzz --faults``): each :class:`Fault` is
  switched on in a fuzzed system and the fuzzer must find an interleaving where an oracle fires.
  kvmem-side faults flip a switch of ``manager.fault_hooks`` or wrap ``manager.cache`` so
  that kvmem skips one of its own protections; engine-side faults flip a switch in the engine
  adapter (``engine.bugs``) so that the engine misuses kvmem the way a real engine did;
  injected faults break something behind everyone's back at a move the fuzzer chooses.

Row numbers are BUGS.md's.
"""

from __future__ import annotations

from kvmem.testing._fault_catalog import CATALOG, Fault
from kvmem.testing._one_shot_faults import (
    free_behind_back,
    lose_fence_completion,
    overwrite_page_entry,
    reallocate_behind_back,
    row_of,
    share_write_page,
)

__all__ = [
    "CATALOG",
    "Fault",
    "free_behind_back",
    "lose_fence_completion",
    "overwrite_page_entry",
    "reallocate_behind_back",
    "row_of",
    "share_write_page",
]
