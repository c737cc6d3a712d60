"""Promises of docs/vllm.md, the README's vLLM section and the docstrings of
``kvmem.integrations.vllm`` that a second audit found broken; each test fails without its fix.
(The first audit's are in test_doc_promises_vllm.py.)

Needs vLLM 0.33 importable (``bash benchmarks/setup_vllm_cpu.sh DIR`` and
``PYTHONPATH=DIR/site:DIR/deps``); skipped otherwise. Real vLLM objects, nothing mocked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvmem import KVMemError
from kvmem.integrations.vllm import vllm_import_error
from kvmem.integrations.vllm.conformance import (
    Driver,
    RequestSpec,
    SchedulerSpec,
    make_scheduler,
)

pytestmark = pytest.mark.skipif(vllm_import_error() is not None,
                                reason="vLLM 0.33 is not importable (see setup_vllm_cpu.sh)")

if vllm_import_error() is None:
    from kvmem.integrations.vllm import VllmKVCacheAdapter

ROOT = Path(__file__).resolve().parent.parent
SPEC = SchedulerSpec(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=128)


def _events_of_a_reset(kvmem: bool, caching: bool) -> list[str]:
    """Run one request to its end, reset the prefix cache, run a step: the event names."""
    from kvmem.integrations.vllm.conformance import make_request, model_output

    spec = SchedulerSpec(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                         max_model_len=64, enable_prefix_caching=caching)
    s = make_scheduler(spec, kvmem)
    s.add_request(make_request(RequestSpec("a", tuple(range(10, 20)), 2), 4))
    while s.has_requests():
        out = s.schedule()
        s.update_from_output(out, model_output(s, out))
    s.kv_event_publisher.events = []
    assert s.reset_prefix_cache() is True
    out = s.schedule()
    s.update_from_output(out, model_output(s, out))  # publishes the step's events
    return [type(e).__name__ for e in s.kv_event_publisher.events]


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_a_reset_reports_all_blocks_cleared_as_vllm_does_with_caching_on_or_off(
        caching: bool) -> None:
    """KV events and prefix caching off are both supported: vLLM's block pool reports
    ``AllBlocksCleared`` on every successful reset, cache or not; kvmem's adapter reported
    nothing without a prefix cache."""
    assert _events_of_a_reset(False, caching) == ["AllBlocksCleared"]
    assert _events_of_a_reset(True, caching) == ["AllBlocksCleared"]
