"""The engines the fuzzer knows by name (:data:`ENGINES`; the protocol is
:mod:`kvmem.testing._fuzz_protocol`)."""

from __future__ import annotations

from collections.abc import Callable

from kvmem.errors import ArgumentError
from kvmem.testing._fuzz_disagg import DisaggEngine
from kvmem.testing._fuzz_manager import ManagerEngine, SpeculativeManagerEngine
from kvmem.testing._fuzz_offload import OffloadDiskEngine, OffloadEngine
from kvmem.testing._fuzz_protocol import FuzzConfig, FuzzEngine
from kvmem.testing._fuzz_toy import ToyEngineAdapter

__all__ = ["ENGINES", "make_engine"]


ENGINES: dict[str, Callable[[FuzzConfig], FuzzEngine]] = {
    "manager": ManagerEngine,
    "manager-spec": SpeculativeManagerEngine,
    "disagg": DisaggEngine,
    "offload": OffloadEngine,
    "offload-disk": OffloadDiskEngine,
    "toy": ToyEngineAdapter,
}


def make_engine(name: str, config: FuzzConfig) -> FuzzEngine:
    """An engine adapter by name (``kvmem.testing.ENGINES`` lists them; add yours there)."""
    factory = ENGINES.get(name)
    if factory is None:
        if name in ("vllm", "vllm-async"):
            raise ArgumentError(f"no fuzz engine {name!r}: it is registered only where vLLM is "
                                "installed (docs/vllm.md); here ENGINES has "
                                f"{sorted(ENGINES)}")
        raise ArgumentError(f"no fuzz engine {name!r}; choose one of {sorted(ENGINES)} (register "
                         "yours in kvmem.testing.ENGINES)")
    return factory(config)
