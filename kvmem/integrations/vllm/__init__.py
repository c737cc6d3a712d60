"""vLLM 0.33's scheduler on kvmem's bookkeeping: a drop-in KV cache manager.

vLLM's v1 ``Scheduler`` builds its ``KVCacheManager`` itself; the one plug-in point is
``scheduler_cls`` (``--scheduler-cls``), which names a ``Scheduler`` subclass::

    vllm serve MODEL --scheduler-cls kvmem.integrations.vllm.KVMemScheduler

- :class:`KVMemScheduler` / :class:`KVMemAsyncScheduler`: vLLM's ``Scheduler`` /
  ``AsyncScheduler`` with ``kv_cache_manager`` replaced by a :class:`VllmKVCacheAdapter` over a
  :class:`kvmem.KVCacheManager`, and kvmem's integrity check on every step's block ids.
- :class:`VllmOrderPrefixCache`: kvmem's prefix cache interface with vLLM's duplicate handling
  and eviction order (numpy only; importable without vLLM).
- :mod:`kvmem.integrations.vllm.conformance`: the differential conformance harness
  (``python -m kvmem.integrations.vllm conformance``).
- :mod:`kvmem.integrations.vllm.judge`: vLLM's own ``tests/v1/core`` run on vLLM's schedulers
  and on kvmem's (``python -m kvmem.integrations.vllm judge``).

Importing this package does not import vLLM; the names that need it are loaded on first use.
vLLM cannot be pip-installed on a CPU-only machine: ``bash benchmarks/setup_vllm_cpu.sh DIR``
makes ``vllm.v1.core`` importable with ``PYTHONPATH=DIR/site:DIR/deps``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmem.integrations.vllm._prefix_cache import VllmOrderPrefixCache

if TYPE_CHECKING:
    from kvmem.integrations.vllm._adapter import VllmKVCacheAdapter
    from kvmem.integrations.vllm._blocks import KVMemBlocks
    from kvmem.integrations.vllm._scheduler import (
        KVMemAsyncScheduler,
        KVMemScheduler,
        check_supported,
    )

__all__ = [
    "VLLM_VERSION",
    "KVMemAsyncScheduler",
    "KVMemBlocks",
    "KVMemScheduler",
    "VllmKVCacheAdapter",
    "VllmOrderPrefixCache",
    "check_supported",
    "vllm_import_error",
]

VLLM_VERSION = "0.33.0"

SETUP_HINT = (
    "vLLM 0.33.0 is not importable: run `bash benchmarks/setup_vllm_cpu.sh /tmp/vllm_env` from "
    "a kvmem checkout, then set PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps (a CPU-only "
    "machine cannot pip-install vLLM; the script unzips its wheel and installs the small "
    "packages its scheduler imports)"
)

_LAZY = {
    "KVMemScheduler": "kvmem.integrations.vllm._scheduler",
    "KVMemAsyncScheduler": "kvmem.integrations.vllm._scheduler",
    "check_supported": "kvmem.integrations.vllm._scheduler",
    "VllmKVCacheAdapter": "kvmem.integrations.vllm._adapter",
    "KVMemBlocks": "kvmem.integrations.vllm._blocks",
}


def vllm_import_error() -> str | None:
    """None when vLLM's scheduler imports (any version; 0.33.0 is the one supported), else a
    one-line message saying how to get it."""
    try:
        importlib.import_module("vllm.v1.core.sched.scheduler")
    except Exception as e:  # ImportError, or a broken install raising anything on import
        # One line, whatever the error says (a broken install's message may span several).
        return f"{SETUP_HINT}. ({type(e).__name__}: {' '.join(str(e).split())})"
    return None


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmem.integrations.vllm' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ImportError as e:
        missing = vllm_import_error()
        if missing is None:  # vLLM imports: the error is something else's
            raise
        raise ImportError(f"kvmem.integrations.vllm.{name} needs vLLM. {missing}") from e
    value = getattr(loaded, name)
    globals()[name] = value
    return value
