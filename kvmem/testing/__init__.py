"""Testing helpers for kvmem and for engines that embed it (need ``hypothesis`` where noted).

* :class:`ToyEngine` drives a :class:`~kvmem.manager.KVCacheManager` like an engine and keeps a
  numpy "KV" pool whose values depend on the namespace and the whole token prefix, so a wrong
  page anywhere is visible (numpy only).
* :class:`ManagerMachine` (hypothesis) runs every manager operation in any interleaving against
  a reference model; subclass it to check your own prefix cache or tracker.
* The device timeline and the fuzzer (``kvmem fuzz``; see ``docs/fuzzing.md``):
  :class:`Timeline` models an asynchronous engine's device (steps in flight, copies and
  transfers that land later) and checks the oracles after every move; :class:`FuzzEngine` is
  the protocol an engine adapter implements (:data:`ENGINES`: ``"manager"``, ``"toy"``, and
  ``"vllm"``, ``"vllm-async"`` where vLLM is installed);
  :func:`campaign`, :func:`replay`, :func:`shrink`, :func:`hunt` and :func:`schedules` run,
  replay and shrink interleavings.
* :mod:`kvmem.testing.faults` injects the bugs real engines shipped (BUGS.md) into a manager,
  and its :data:`~kvmem.testing.faults.CATALOG` switches them on in a fuzzed system.
"""

from __future__ import annotations

from typing import Any

from kvmem.testing import faults
from kvmem.testing._fuzz import (
    CampaignResult,
    FaultResult,
    campaign,
    hunt,
    replay,
    save_reproducer,
    schedules,
    shrink,
)
from kvmem.testing._fuzz_hybrid import HYBRID_FAULTS, HYBRID_ORACLES, hybrid_clean, hybrid_hunt
from kvmem.testing._fuzz_manager import ManagerEngine
from kvmem.testing._fuzz_protocol import FuzzConfig, FuzzEngine, subset_step
from kvmem.testing._fuzz_registry import ENGINES, make_engine
from kvmem.testing._fuzz_toy import ToyEngineAdapter
from kvmem.testing._fuzz_vllm import VLLM_ENGINES
from kvmem.testing._kv_values import kv_value_array
from kvmem.testing._launch import Launch, RequestSpec
from kvmem.testing._oracles import ORACLES, FuzzFailure
from kvmem.testing._run import MOVES, Run
from kvmem.testing._timeline import Timeline
from kvmem.testing._toy import ToyEngine, kv_values

ENGINES.update(VLLM_ENGINES)  # "vllm", "vllm-async": only where vLLM is installed

__all__ = [
    "ENGINES",
    "HYBRID_FAULTS",
    "HYBRID_ORACLES",
    "MOVES",
    "ORACLES",
    "CampaignResult",
    "FaultResult",
    "FuzzConfig",
    "FuzzEngine",
    "FuzzFailure",
    "Launch",
    "ManagerEngine",
    "ManagerMachine",
    "RequestSpec",
    "Run",
    "Timeline",
    "ToyEngine",
    "ToyEngineAdapter",
    "campaign",
    "faults",
    "hunt",
    "hybrid_clean",
    "hybrid_hunt",
    "kv_value_array",
    "kv_values",
    "make_engine",
    "prompts",
    "replay",
    "save_reproducer",
    "schedules",
    "shrink",
    "subset_step",
]


def __getattr__(name: str) -> Any:
    # The state machine needs hypothesis (a dev dependency): import it only when asked for.
    if name in ("ManagerMachine", "prompts", "NAMESPACES"):
        from kvmem.testing import _machine

        return getattr(_machine, name)
    raise AttributeError(f"module 'kvmem.testing' has no attribute {name!r}")
