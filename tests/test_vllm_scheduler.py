"""kvmem's vLLM scheduler: refusals, the integrity check in the loop, the command.

Needs vLLM 0.33 importable (``bash benchmarks/setup_vllm_cpu.sh DIR`` and
``PYTHONPATH=DIR/site:DIR/deps``); skipped otherwise. The real scheduler runs, on vLLM's own
manager and on kvmem's; nothing of vLLM is mocked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvmem import KVMemError
from kvmem.integrations.vllm import vllm_import_error
from kvmem.integrations.vllm.conformance import (
    Driver,
    SchedulerSpec,
    StreamRequest,
    make_vllm_config,
)
from kvmem.testing import faults

# (The harness above imports vLLM only inside its functions: it loads without vLLM.)
pytestmark = pytest.mark.skipif(vllm_import_error() is not None,
                                reason="vLLM 0.33 is not importable (see setup_vllm_cpu.sh)")


if vllm_import_error() is None:
    from kvmem.integrations.vllm import KVMemScheduler

SPEC = SchedulerSpec(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=128)


def _build(vc: object, kc: object, block_size: int = 4) -> object:
    from vllm.v1.structured_output import StructuredOutputManager

    return KVMemScheduler(vllm_config=vc, kv_cache_config=kc,
                          structured_output_manager=StructuredOutputManager(vc),
                          block_size=block_size)


# -- refusals -------------------------------------------------------------------------------------


def test_a_hybrid_model_is_refused_naming_the_groups() -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8)))
    with pytest.raises(KVMemError, match="several KV cache groups"):
        _build(vc, kc)


def test_a_sliding_window_group_is_refused() -> None:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups[0] = KVCacheGroupSpec(["swa"], SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8))
    with pytest.raises(KVMemError, match="SlidingWindowSpec"):
        _build(vc, kc)


def test_a_kv_connector_is_refused() -> None:
    from vllm.config import KVTransferConfig

    vc, kc = make_vllm_config(SPEC)
    vc.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(KVMemError, match="kv_transfer_config"):
        _build(vc, kc)


@pytest.mark.parametrize(("attr", "option"), [
    ("decode_context_parallel_size", "DCP/PCP"),
    ("prefill_context_parallel_size", "DCP/PCP"),
])
def test_context_parallelism_is_refused(attr: str, option: str) -> None:
    vc, kc = make_vllm_config(SPEC)
    object.__setattr__(vc.parallel_config, attr, 2)
    with pytest.raises(KVMemError, match=option):
        _build(vc, kc)


def test_speculative_decoding_is_refused() -> None:
    vc, kc = make_vllm_config(SPEC)

    class Ngram:  # any speculative config is refused before vLLM looks at it
        pass

    object.__setattr__(vc, "speculative_config", Ngram())
    with pytest.raises(KVMemError, match="speculative_config"):
        _build(vc, kc)


def test_partial_prefix_hits_are_refused() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    vc, kc = make_vllm_config(SPEC)
    with pytest.raises(KVMemError, match="hash_block_size"):
        KVMemScheduler(vllm_config=vc, kv_cache_config=kc,
                       structured_output_manager=StructuredOutputManager(vc), block_size=4,
                       hash_block_size=2)


def test_a_lora_request_is_refused() -> None:
    from vllm.lora.request import LoRARequest

    from kvmem.integrations.vllm.conformance import make_request

    d = Driver(SPEC, kvmem=True)
    req = make_request(StreamRequest("a", (1, 2, 3), 2), 4)
    req.lora_request = LoRARequest("adapter", 1, "/nowhere")
    with pytest.raises(KVMemError, match="LoRA"):
        d.sched.add_request(req)


# -- the integrity check in the loop ---------------------------------------------------------------


def _three(d: Driver) -> None:
    # Ids whose synthetic tokens do not stop before max_tokens (token_at is deterministic).
    for i, rid in enumerate(("r2", "r7", "r8")):
        d.add(StreamRequest(rid, tuple(range(100 * i + 10, 100 * i + 10 + 9)), 12))


@pytest.mark.parametrize("fault", ["free_behind_back", "reallocate_behind_back"])
def test_a_broken_mapping_aborts_only_its_request(fault: str) -> None:
    from vllm.v1.engine import FinishReason

    d = Driver(SPEC, kvmem=True)
    _three(d)
    for _ in range(2):
        d.step()
    mgr = d.sched.kvmem
    running = sorted(mgr.running)
    assert len(running) == 3
    victim = running[1]
    rest = [rid for rid in running if rid != victim]
    getattr(faults, fault)(mgr, victim, 1)  # a page freed (and reused) under the request
    out = d.sched.schedule()
    # The step's output does not carry it; the others proceed.
    assert victim not in out.num_scheduled_tokens
    assert set(out.num_scheduled_tokens) == set(rest)
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert victim not in out.scheduled_cached_reqs.req_ids
    assert victim not in d.sched.requests
    from kvmem.integrations.vllm.conformance import model_output

    results = d.sched.update_from_output(out, model_output(d.sched, out))
    reported = {o.request_id: o for outs in results.values() for o in outs.outputs}
    assert reported[victim].finish_reason == FinishReason.ABORT
    assert "kvmem integrity check" in reported[victim].error.message
    assert mgr.stats().num_integrity_failures == 1
    d.run()
    # The rest of the batch finished with exactly the tokens vLLM's own manager gives them.
    ref = Driver(SPEC, kvmem=False)
    _three(ref)
    ref.run()
    for rid in rest:
        assert list(d.requests[rid].output_token_ids) == list(ref.requests[rid].output_token_ids)
    assert d.requests[victim].is_finished()
    assert d.sched.kv_cache_manager.num_integrity_aborts == 1
    if fault != "reallocate_behind_back":  # that fault leaks a page by design (check reports it)
        d.sched.kv_cache_manager.check()


def test_every_step_is_verified() -> None:
    d = Driver(SPEC, kvmem=True)
    _three(d)
    d.run()
    adapter = d.sched.kv_cache_manager
    assert adapter.num_verified_steps >= len(d.records) - 1
    assert adapter.num_integrity_aborts == 0
    assert d.table_mismatches == 0


# -- the command ------------------------------------------------------------------------------


def test_the_conformance_command_prints_one_json_object(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from kvmem.integrations.vllm.__main__ import main

    status = main(["conformance", "--streams", "3", "--json", "--batch", "8",
                   "--decode-steps", "4"])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    for key in ("streams", "steps", "mismatched_steps", "verify_failures",
                "vllm_step_us_median", "kvmem_step_us_median", "step_speedup"):
        assert key in result
    assert result["streams"] == 3 and result["mismatched_steps"] == 0
    assert result["steps"] > 0 and result["step_speedup"] > 0


def test_without_vllm_the_command_says_how_to_get_it() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-m", "kvmem.integrations.vllm", "conformance",
                           "--json"], capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 2:
        pytest.skip("vLLM is importable without the setup folder on PYTHONPATH")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "setup_vllm_cpu.sh" in lines[0]
    assert proc.stdout == ""


def test_a_stream_spec_replays() -> None:
    from kvmem.integrations.vllm.conformance import StreamSpec, compare

    stream = StreamSpec(SPEC, (StreamRequest("a", tuple(range(10, 30)), 5),
                               StreamRequest("b", tuple(range(10, 26)), 5, arrival=1)))
    c = compare(stream)
    assert c.ok, c.first_difference
    assert "def test_replay" in c.replay() and repr(stream) in c.replay()
    assert dataclasses.asdict(stream)["requests"][1]["arrival"] == 1


def test_the_paranoid_check_catches_a_wrong_block_id_handed_to_the_workers() -> None:
    """With verify_block_tables the ids handed out come from the table the workers build, and
    kvmem checks that very table: a wrong entry (another request's block) aborts its request."""
    d = Driver(dataclasses.replace(SPEC, paranoid=True), kvmem=True)
    _three(d)
    for _ in range(2):
        d.step()
    adapter = d.sched.kv_cache_manager
    table = adapter.worker_block_table
    assert table is not None
    mgr = d.sched.kvmem
    running = sorted(mgr.running)
    victim, other = running[1], running[2]
    # The workers' tables equal kvmem's rows so far.
    for rid in running:
        assert d.worker.tables[rid] == (mgr.pages_of(rid) + 1).tolist()
    row = adapter._reqs[victim].row
    table[row, 0] = int(mgr.pages_of(other)[0])  # as if the adapter had handed out a wrong id
    out = d.schedule()
    assert victim not in out.num_scheduled_tokens
    assert set(out.num_scheduled_tokens) == {r for r in running if r != victim}
    assert adapter.num_integrity_aborts == 1
    d.update(out)
    d.run()
    d.sched.kv_cache_manager.check()


# -- async scheduling's commits, in any order the adapter's surface allows -------------------------


def _async_adapter_with_two_decode_slots() -> tuple[object, object]:
    """An async adapter with one request admitted (6 prompt tokens) and two decode steps
    scheduled (slots 6 and 7 reserved) whose tokens have not arrived."""
    from kvmem.integrations.vllm import VllmKVCacheAdapter
    from kvmem.integrations.vllm._vllm_objects import make_request

    adapter = VllmKVCacheAdapter(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4,
                                 async_scheduling=True)
    request = make_request(StreamRequest("r0", tuple(range(20, 26)), max_tokens=8), 4)
    hit, num_hit, _ = adapter.get_computed_blocks(request)
    assert num_hit == 0
    assert adapter.allocate_slots(request, 6, 0, hit) is not None
    adapter.flush()
    request.num_computed_tokens = 6
    for _ in range(2):
        assert adapter.allocate_slots(request, 1) is not None
        adapter.flush()
        request.num_computed_tokens += 1
    return adapter, request


@pytest.mark.parametrize(("named", "committed"), [((7,), 7), ((8,), 8), ((7, 8), 8), ((8, 8), 8)])
def test_async_tokens_named_by_cache_blocks_are_committed_once_each(named: tuple[int, ...],
                                                                    committed: int) -> None:
    """cache_blocks naming two arrived tokens at once, or the same request twice: each token
    is committed once, its page is cached with its content, and the adapter agrees with the
    manager."""
    adapter, request = _async_adapter_with_two_decode_slots()
    mgr = adapter.manager
    assert mgr.num_committed("r0") == 6
    request.append_output_token_ids(100)
    request.append_output_token_ids(101)
    for upto in named:
        adapter.cache_blocks(request, upto)
    assert adapter.take_events() == []  # (the flush: events are off)
    assert mgr.num_committed("r0") == committed
    adapter.check()
    # The page holding tokens 4..7 (24, 25, 100, 101) is cached once all four are committed: a
    # request with that prefix hits it, one that differs in its last token does not.
    from kvmem.integrations.vllm._vllm_objects import make_request

    probe = make_request(StreamRequest("probe", (*range(20, 26), 100, 101, 7), max_tokens=1), 4)
    assert adapter.get_computed_blocks(probe)[1] == (8 if committed == 8 else 4)
    wrong = make_request(StreamRequest("wrong", (*range(20, 26), 100, 102, 7), max_tokens=1), 4)
    assert adapter.get_computed_blocks(wrong)[1] == 4


def test_async_cache_blocks_naming_committed_tokens_queues_nothing() -> None:
    adapter, request = _async_adapter_with_two_decode_slots()
    adapter.cache_blocks(request, 6)
    assert adapter._queue.commits == []
    adapter.check()
