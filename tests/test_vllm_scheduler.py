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
from kvmem.errors import ArgumentError
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


def test_a_kv_connector_is_bound_to_kvmems_adapter(tmp_path: object) -> None:
    """vLLM's __init__ binds the connector to the manager it built; kvmem's scheduler binds
    it to its adapter (connectors read the manager they were bound to)."""
    from vllm.config import KVTransferConfig

    vc, kc = make_vllm_config(SPEC)
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    sched = _build(vc, kc)
    assert sched.connector._kv_cache_manager is sched.kv_cache_manager
    assert sched.kv_cache_manager.connector


@pytest.mark.parametrize(("attr", "option"), [
    ("decode_context_parallel_size", "DCP/PCP"),
    ("prefill_context_parallel_size", "DCP/PCP"),
])
def test_context_parallelism_is_refused(attr: str, option: str) -> None:
    vc, kc = make_vllm_config(SPEC)
    object.__setattr__(vc.parallel_config, attr, 2)
    with pytest.raises(KVMemError, match=option):
        _build(vc, kc)


def test_eagle_with_lookahead_block_hashes_is_refused_naming_the_fix() -> None:
    """EAGLE with prefix caching hashes each block with the token after it (vLLM's default):
    kvmem keys a page by its own tokens, so the scheduler refuses it and says how to get
    vLLM's last-block drop instead (which it supports)."""
    vc, kc = make_vllm_config(dataclasses.replace(SPEC, spec_method="eagle", num_spec_tokens=2))
    vc.speculative_config.disable_lookahead_block_hashes = False
    assert vc.num_hash_lookahead_tokens == 1
    with pytest.raises(KVMemError, match="disable_lookahead_block_hashes=True"):
        _build(vc, kc)


def test_multi_module_mtp_with_prefix_caching_is_refused() -> None:
    """Multi-module MTP keeps a request's last k - 1 computed tokens out of vLLM's cache;
    kvmem caches every committed page, so it is refused with prefix caching on."""
    vc, kc = make_vllm_config(dataclasses.replace(SPEC, spec_method="eagle", num_spec_tokens=3))
    sc = vc.speculative_config
    sc.method = "mtp"
    sc.draft_model_config.hf_config.num_nextn_predict_layers = 3
    assert vc.num_prefill_lookahead_tokens == 3 and vc.num_hash_lookahead_tokens == 0
    with pytest.raises(KVMemError, match="multi-module MTP"):
        _build(vc, kc)


def test_partial_prefix_hits_are_refused() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    vc, kc = make_vllm_config(SPEC)
    with pytest.raises(KVMemError, match="hash_block_size"):
        KVMemScheduler(vllm_config=vc, kv_cache_config=kc,
                       structured_output_manager=StructuredOutputManager(vc), block_size=4,
                       hash_block_size=2)


# -- keys: LoRA adapters, multimodal inputs, resumable requests ----------------------------------

_MM = dataclasses.replace(SPEC, encoder_cache_size=64, max_loras=2, kv_events=False)


def _hits(stream: object) -> dict[str, int]:
    """Each request's prefix-hit tokens when it was first scheduled, on kvmem's manager, after
    checking that every step agrees with vLLM's manager."""
    from kvmem.integrations.vllm.conformance import compare, run_stream

    c = compare(stream)
    assert c.ok, c.first_difference
    hits: dict[str, int] = {}
    for step in run_stream(stream, kvmem=True).steps:
        for rid, computed in step.new:
            hits.setdefault(rid, computed)
    return hits


def test_multimodal_inputs_hit_exactly_where_vllm_hits() -> None:
    """vLLM keys each block that overlaps an image with the image's hash and its offset from
    the block's start: the same image at the same offsets hits, another hash or offset misses
    from the first block it overlaps, and the text blocks before an image are shared with a
    text-only prompt. Every step agrees with vLLM's manager."""
    from kvmem.integrations.vllm.conformance import StreamSpec

    prompt = tuple(range(10, 30))  # 5 blocks of 4
    at = 3  # (a second wave arrives once the first is cached)
    stream = StreamSpec(_MM, (
        StreamRequest("a", prompt, 2, mm=(("img1", 2, 8),)),  # blocks 0-2 overlap it
        StreamRequest("late", prompt, 2, mm=(("img3", 9, 6),)),  # blocks 2-3
        StreamRequest("b", prompt, 2, arrival=at, mm=(("img1", 2, 8),)),
        StreamRequest("other-hash", prompt, 2, arrival=at, mm=(("img2", 2, 8),)),
        StreamRequest("other-offset", prompt, 2, arrival=at, mm=(("img1", 3, 8),)),
        StreamRequest("text", prompt, 2, arrival=at),
        StreamRequest("late-b", prompt, 2, arrival=at + 3, mm=(("img3", 9, 6),)),
    ))
    hits = _hits(stream)
    assert hits["b"] == 16 and hits["late-b"] == 16  # (at most (20 - 1) // 4 blocks)
    assert hits["other-hash"] == hits["other-offset"] == 0
    assert hits["text"] == 8  # blocks 0-1, before "late"'s image


def test_a_block_partly_covering_an_image_keys_its_text_tokens_too() -> None:
    """The block where an image ends also holds text: a prompt with the same image that
    differs in that text misses from that block on (and hits the blocks before); the same
    prompt and image hits through it, as in vLLM."""
    from kvmem.integrations.vllm.conformance import StreamSpec

    prompt = tuple(range(10, 30))
    changed = (*prompt[:10], 999, *prompt[11:])  # position 10: block 2, past the image
    image = (("img1", 2, 7),)  # positions 2-8: blocks 0-1 and the start of block 2
    stream = StreamSpec(_MM, (
        StreamRequest("a", prompt, 2, mm=image),
        StreamRequest("b", changed, 2, arrival=3, mm=image),
        StreamRequest("c", prompt, 2, arrival=3, mm=image),
    ))
    hits = _hits(stream)
    assert hits["b"] == 8 and hits["c"] == 16


def test_the_same_prompt_under_two_lora_adapters_never_shares() -> None:
    """vLLM keys every block with the adapter's name and path: the same prompt hits under its
    own adapter only, and not without one; with cache_salt both must agree."""
    from kvmem.integrations.vllm.conformance import StreamSpec

    prompt = tuple(range(10, 30))
    stream = StreamSpec(_MM, (
        StreamRequest("x1", prompt, 2, lora="x"),
        StreamRequest("x-salted", prompt, 2, lora="x", salt="t"),
        StreamRequest("x2", prompt, 2, arrival=4, lora="x"),
        StreamRequest("y", prompt, 2, arrival=4, lora="y"),
        StreamRequest("base", prompt, 2, arrival=4),
        StreamRequest("x-salted-2", prompt, 2, arrival=8, lora="x", salt="t"),
        StreamRequest("y-salted", prompt, 2, arrival=8, lora="y", salt="t"),
    ))
    hits = _hits(stream)
    assert hits["x2"] == hits["x-salted-2"] == 16
    assert hits["y"] == hits["base"] == hits["y-salted"] == 0


def test_lora_requests_report_their_adapter_in_kv_events() -> None:
    """A LoRA adapter's blocks are stored in the KV events under its name (vLLM's lora_name,
    lora_id and the name in the first block's extra keys, with the salt)."""
    from vllm.distributed.kv_events import BlockStored

    from kvmem.integrations.vllm._vllm_objects import lora_id, model_output

    d = Driver(dataclasses.replace(_MM, kv_events=True), kvmem=True)
    d.add(StreamRequest("x1", tuple(range(10, 20)), 1, lora="x", salt="t"))
    out = d.sched.schedule()
    d.sched.update_from_output(out, model_output(d.sched, out))
    stored = [ev for ev in d.sched.kv_event_publisher.events if isinstance(ev, BlockStored)]
    assert stored and all(ev.lora_name == "x" and ev.lora_id == lora_id("x") for ev in stored)
    assert stored[0].extra_keys[0] == ("x", "t")


def _session_run(kvmem: bool, async_scheduling: bool, in_flight: int = 1,
                 max_tokens: int = 3) -> list[object]:
    """A resumable (streaming input) session under vLLM's scheduler: each chunk runs to
    ``max_tokens`` and the session waits for input; it gets two more chunks (vLLM drops the
    last sampled token and appends the chunk, keeping the session's blocks) and then ends;
    with each chunk a request whose prompt is the session's tokens arrives. ``in_flight``:
    steps scheduled before the oldest one's output is handed back (an async engine's
    pipeline: a session then stops with steps in flight, which vLLM rolls back). Returns
    each step's canonical output and the session's and the first other request's tokens."""
    from vllm.v1.request import RequestStatus

    from kvmem.integrations.vllm._vllm_objects import model_output
    from kvmem.integrations.vllm.conformance import make_request, make_scheduler

    spec = dataclasses.replace(SPEC, async_scheduling=async_scheduling)
    sched = make_scheduler(spec, kvmem)
    session = make_request(StreamRequest("s", tuple(range(10, 23)), max_tokens), 4)
    session.resumable = True
    sched.add_request(session)
    records: list[object] = []
    chunks = [tuple(range(40, 47)), tuple(range(60, 65)), None]
    others: list[object] = []
    pending: list[tuple[object, object]] = []
    for _ in range(80):
        if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ and chunks:
            chunk = chunks.pop(0)
            update = make_request(StreamRequest("s", chunk or (1,), max_tokens), 4)
            update.resumable = chunk is not None
            sched.add_request(update)
            if chunk is not None:
                other = make_request(StreamRequest(f"o{len(others)}",
                                                   tuple(session.all_token_ids), 2), 4)
                others.append(other)
                sched.add_request(other)
        if not sched.has_requests() and not pending:
            break
        if sched.has_requests():
            out = sched.schedule()
            records.append(_canonical(sched, out))
            pending.append((out, model_output(sched, out)))
        if len(pending) >= in_flight or not sched.has_requests():
            sched.update_from_output(*pending.pop(0))
    records.append([list(session.all_token_ids), others and list(others[0].all_token_ids)])
    if kvmem:
        assert sched.kv_cache_manager.num_integrity_aborts == 0
        sched.kv_cache_manager.check()
    return records


@pytest.mark.parametrize(("async_scheduling", "in_flight"), [(False, 1), (True, 1), (True, 2),
                                                              (True, 3)])
@pytest.mark.parametrize("max_tokens", [1, 3, 4])
def test_a_resumable_session_schedules_exactly_as_vllm(async_scheduling: bool, in_flight: int,
                                                        max_tokens: int) -> None:
    """Every step's output (the resumed session's kept blocks, the other requests' hits on
    them, usage) agrees with vLLM's manager, also when the session stops with steps in
    flight (vLLM rolls its computed tokens back and keeps its blocks: kvmem gives the slots
    back and keeps the pages), and the session got its chunks."""
    vllm_records = _session_run(False, async_scheduling, in_flight, max_tokens)
    kvmem_records = _session_run(True, async_scheduling, in_flight, max_tokens)
    assert len(kvmem_records) == len(vllm_records)
    for t, (a, b) in enumerate(zip(vllm_records, kvmem_records)):
        assert a == b, f"step {t}"
    tokens, other = vllm_records[-1]
    kept = max_tokens - 1  # (vLLM drops each chunk's last sampled token)
    assert tokens[13 + kept : 20 + kept] == list(range(40, 47))
    assert other[: 20 + kept] == tokens[: 20 + kept]
    hit = [n for r in vllm_records[:-1] for (rid, n, _) in r["new"] if rid == "o0"]
    assert hit == [(19 + kept) // 4 * 4]  # the first other request hit the session's blocks


def _request_with(rid: str, **fields: object) -> object:
    from kvmem.integrations.vllm.conformance import make_request

    req = make_request(StreamRequest(rid, tuple(range(10, 30)), 2, mm=(("img", 2, 4),)), 4)
    for name, value in fields.items():
        setattr(req, name, value)
    return req


def _mm(offset: int, length: int, ident: object = "img") -> object:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange

    return MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy(), modality="image",
                                 identifier=ident,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


@pytest.mark.parametrize(("features", "error", "match"), [
    ([(8, 4), (2, 4)], ArgumentError, "not sorted"),
    ([(2, 6), (6, 4)], ArgumentError, "not sorted"),
    ([(2, 4, None)], ArgumentError, "identifier"),
], ids=["unsorted", "overlapping", "no-identifier"])
def test_bad_multimodal_inputs_are_refused_and_change_nothing(features: list[tuple[object, ...]],
                                                              error: type, match: str) -> None:
    d = Driver(_MM, kvmem=True)
    req = _request_with("q", mm_features=[_mm(*f) for f in features])
    with pytest.raises(error, match=match):
        d.sched.add_request(req)
    assert not d.sched.requests and not d.sched.has_requests()
    assert not d.sched.kvmem.running


def test_a_token_id_past_the_fold_range_in_an_image_block_is_refused() -> None:
    """Key tokens of image blocks live at 2**30 and above: a prompt id there in such a block
    cannot be folded one to one; refused naming the range, nothing added."""
    d = Driver(_MM, kvmem=True)
    req = _request_with("q")
    req._all_token_ids[1] = 1 << 30
    with pytest.raises(KVMemError, match="vocabulary ids below"):
        d.sched.add_request(req)
    assert not d.sched.requests


def test_multimodal_inputs_with_kv_events_are_refused_naming_why() -> None:
    d = Driver(dataclasses.replace(_MM, kv_events=True), kvmem=True)
    with pytest.raises(KVMemError, match="KV events"):
        d.sched.add_request(_request_with("q"))
    assert not d.sched.requests


def test_a_streaming_update_with_multimodal_inputs_is_refused_and_changes_nothing() -> None:
    """A session's later chunk may bring an image that starts inside a block kvmem keyed
    already; refused, naming the fix, and the session is left as it was."""
    from vllm.v1.request import RequestStatus

    from kvmem.integrations.vllm.conformance import make_request

    d = Driver(_MM, kvmem=True)
    session = make_request(StreamRequest("s", tuple(range(10, 23)), 1), 4)
    session.resumable = True
    d.sched.add_request(session)
    for _ in range(5):
        if session.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            break
        d.step()
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    before = list(session.all_token_ids)
    update = _request_with("s", resumable=True)
    with pytest.raises(KVMemError, match="first chunk"):
        d.sched.add_request(update)
    assert list(session.all_token_ids) == before
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ


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


# -- speculative decoding: vLLM's scheduler loop on both managers ---------------------------------


def _spec_run(kvmem: bool, spec: SchedulerSpec, prompts: list[tuple[int, ...]],
              max_tokens: int = 14, arrivals: tuple[int, ...] = ()) -> tuple[list[object], object]:
    """vLLM's scheduler loop with speculative decoding, as an engine runs it: ``schedule()``;
    a ``ModelRunnerOutput`` whose sampled tokens accept, for request ``i`` at step ``t``, the
    first ``(t + i) % (k + 1)`` of its ``k`` scheduled drafts (so some steps reject every
    draft, some a tail, some none); ``update_from_output()``; then (synchronous scheduling)
    the drafter's next drafts through ``update_draft_token_ids``. Request ``i`` arrives
    before step ``arrivals[i]`` (0 by default). Returns each step's output in a form both
    managers must agree on, and the scheduler."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from kvmem.integrations.vllm.conformance import make_request, make_scheduler

    sched = make_scheduler(spec, kvmem, log_stats=True)
    requests = [make_request(StreamRequest(f"r{i}", p, max_tokens), spec.block_size)
                for i, p in enumerate(prompts)]
    records: list[object] = []
    for t in range(200):
        for i, req in enumerate(requests):
            if (arrivals[i] if i < len(arrivals) else 0) == t:
                sched.add_request(req)
        if t > max(arrivals, default=0) and not sched.has_requests():
            break
        out = sched.schedule()
        records.append(_canonical(sched, out))
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            i = int(rid[1:])
            if sched.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            k = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            sampled.append([100 + 10 * t + j for j in range((t + i) % (k + 1) + 1)])
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
            sampled_token_ids=sampled))
        if not spec.async_scheduling:
            live = [r for r in ids if r in sched.requests and not sched.requests[r].is_finished()]
            sched.update_draft_token_ids(DraftTokenIds(
                live, [[50 + j for j in range(spec.num_spec_tokens)] for _ in live]))
    records.append([(r.request_id, list(r.output_token_ids)) for r in requests])
    return records, sched


def _canonical(sched: object, out: object) -> dict[str, object]:
    """A step's ``SchedulerOutput`` with block ids renamed by first appearance (the two
    managers may pick different free blocks; which blocks are shared, kept and new may not
    differ), and the KV cache usage."""
    names: dict[int, int] = {}

    def rename(ids: object) -> object:
        return None if ids is None else [names.setdefault(b, len(names)) for b in ids[0]]

    c = out.scheduled_cached_reqs
    return {
        "new": [(r.req_id, r.num_computed_tokens, rename(r.block_ids))
                for r in out.scheduled_new_reqs],
        "cached": list(zip(c.req_ids, c.num_computed_tokens, map(rename, c.new_block_ids))),
        "tables": {rid: rename((sched.kv_cache_manager.get_block_ids(rid)[0],))
                   for rid in sorted(out.num_scheduled_tokens)},
        "num_scheduled": dict(out.num_scheduled_tokens),
        "drafts": {r: list(t) for r, t in out.scheduled_spec_decode_tokens.items()},
        "total": out.total_num_scheduled_tokens,
        "preempted": sorted(out.preempted_req_ids), "finished": sorted(out.finished_req_ids),
        "usage": sched.get_kv_cache_usage(),
    }


_PROMPTS = [tuple(range(10, 19)), tuple(range(10, 22)), tuple(range(40, 47))]


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("paranoid", [False, True])
def test_speculative_steps_with_rejected_drafts_schedule_exactly_as_vllm(
        method: str, async_scheduling: bool, paranoid: bool) -> None:
    """Every step's output (scheduled tokens and drafts, computed tokens after rejected drafts
    rolled back, new and kept blocks, the block tables, usage) and every request's tokens
    agree; kvmem's integrity check (and the paranoid one, which checks the workers' block
    tables, holding the kept blocks past a step's tokens) runs on every step and stays
    silent."""
    spec = dataclasses.replace(SPEC, num_blocks=24, spec_method=method, num_spec_tokens=3,
                               async_scheduling=async_scheduling, paranoid=paranoid)
    vllm_records, _ = _spec_run(False, spec, _PROMPTS, arrivals=(0, 0, 3))
    kvmem_records, sched = _spec_run(True, spec, _PROMPTS, arrivals=(0, 0, 3))
    assert len(kvmem_records) == len(vllm_records)
    for t, (a, b) in enumerate(zip(vllm_records, kvmem_records)):
        assert a == b, f"step {t}"
    drafts = [len(d) for r in vllm_records[:-1] for d in r["drafts"].values()]
    assert sum(drafts) > 10  # (the run speculated)
    adapter = sched.kv_cache_manager
    assert adapter.num_integrity_aborts == 0
    assert adapter.num_verified_steps >= len(vllm_records) - 2
    adapter.check()
    sched.kvmem.check()


def test_rejected_drafts_keep_their_blocks_and_their_slots_go_back() -> None:
    """vLLM rolls a request's computed tokens back when its drafts are rejected and keeps its
    blocks; kvmem gives the rejected slots back (``reject(keep_pages=True)``) before the
    request's next reserve: the same blocks, the same free count, and the next step writes
    where the rejected drafts were."""
    spec = dataclasses.replace(SPEC, spec_method="draft_model", num_spec_tokens=4)
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from kvmem.integrations.vllm.conformance import make_request, make_scheduler

    runs = {}
    for kvmem in (False, True):
        sched = make_scheduler(spec, kvmem)
        req = make_request(StreamRequest("a", tuple(range(10, 16)), 20), 4)
        sched.add_request(req)
        seen = []
        for sampled in ([11], [12], [13, 14, 15, 16, 17], [18]):  # step 2: drafts rejected
            out = sched.schedule()
            (blocks,) = sched.kv_cache_manager.get_block_ids("a")
            seen.append((out.num_scheduled_tokens["a"], req.num_computed_tokens, blocks,
                         sched.kv_cache_manager.usage))
            if kvmem:
                seen[-1] += (sched.kvmem.num_tokens("a"),)
            sched.update_from_output(out, ModelRunnerOutput(
                req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[sampled]))
            sched.update_draft_token_ids(DraftTokenIds(["a"], [[50, 51, 52, 53]]))
        runs[kvmem] = (seen, list(req.output_token_ids), sched)
    vllm_seen, kvmem_seen = runs[False][0], runs[True][0]
    assert [s[:4] for s in kvmem_seen] == vllm_seen
    # Step 1: 1 + 4 drafts after 6 computed tokens, and 4 lookahead slots: 15 slots in 4
    # blocks. Every draft rejected: vLLM rolls back to 7 computed tokens and keeps the 4
    # blocks, which step 2's 12 tokens and 4 lookahead slots fit (no new block). kvmem
    # reserved the 15 slots, then gave the 8 rejected and lookahead ones back (7 + 5 = 12).
    assert [(n, c, len(b)) for n, c, b, _ in vllm_seen] == [
        (6, 6, 3), (5, 11, 4), (5, 12, 4), (5, 17, 6)]
    assert vllm_seen[2][2] == vllm_seen[1][2] and kvmem_seen[2][2] == kvmem_seen[1][2]
    assert [s[4] for s in kvmem_seen] == [10, 15, 12, 21]
    assert runs[True][1] == runs[False][1]
    sched = runs[True][2]
    assert sched.kv_cache_manager.num_integrity_aborts == 0
    sched.kv_cache_manager.check()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_eagle_drops_the_last_block_of_a_prefix_hit_as_vllm_does(method: str) -> None:
    """A prompt whose first 3 blocks are cached hits 3 blocks with a draft model and 2 with
    EAGLE (vLLM's use_eagle: the block before the generation point is recomputed), on both
    managers."""
    spec = dataclasses.replace(SPEC, spec_method=method, num_spec_tokens=2)
    prompts = [tuple(range(10, 23)), (*range(10, 22), 90, 91, 92)]
    for kvmem in (False, True):
        records, _ = _spec_run(kvmem, spec, prompts, max_tokens=2, arrivals=(0, 6))
        hits = [n for r in records[:-1] for rid, n, _ in r["new"] if rid == "r1"]
        assert hits == [12 if method == "draft_model" else 8], kvmem


def _speculative_adapter() -> tuple[object, object]:
    """A speculative adapter with one request admitted (6 prompt tokens, committed) and a
    step of 1 + 3 drafts scheduled after them (slots 6..9 reserved, token 6 known)."""
    from kvmem.integrations.vllm import VllmKVCacheAdapter
    from kvmem.integrations.vllm._vllm_objects import make_request

    adapter = VllmKVCacheAdapter(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4,
                                 speculative=True)
    request = make_request(StreamRequest("r0", tuple(range(20, 26)), max_tokens=8), 4)
    hit, _, _ = adapter.get_computed_blocks(request)
    assert adapter.allocate_slots(request, 6, 0, hit) is not None
    adapter.flush()
    request.num_computed_tokens = 6
    request.append_output_token_ids(30)
    assert adapter.allocate_slots(request, 4) is not None
    adapter.flush()
    request.num_computed_tokens = 10
    return adapter, request


def test_a_rollback_below_committed_tokens_is_refused_naming_it() -> None:
    """Guards the rejected-slot give-back: vLLM rolling a request back below tokens kvmem
    already committed (which no engine does: drafts are committed only once accepted) is an
    error that says so, not a silent shift of every later slot."""
    adapter, request = _speculative_adapter()
    assert adapter.manager.num_committed("r0") == 7
    request.num_computed_tokens = 8  # 2 drafts rejected: given back at the next flush
    assert adapter.allocate_slots(request, 1) is not None
    adapter.flush()
    assert adapter.manager.num_tokens("r0") == 9
    request.num_computed_tokens = 6  # below the 7 committed
    assert adapter.allocate_slots(request, 1) is not None
    with pytest.raises(KVMemError, match="cannot un-commit"):
        adapter.flush()
    assert adapter.manager.num_tokens("r0") == 9  # nothing was given back


def test_a_request_advanced_without_allocate_slots_is_refused_naming_it() -> None:
    adapter, request = _speculative_adapter()
    request.num_computed_tokens = 12  # past the 10 slots kvmem reserved
    assert adapter.allocate_slots(request, 1) is not None
    with pytest.raises(KVMemError, match="without allocate_slots"):
        adapter.flush()


# -- KV connectors: vLLM's scheduler loop with a connector, on both managers ----------------------


def _connector_run(kvmem: bool, spec: SchedulerSpec, prompts: dict[str, tuple[int, ...]],
                   transfer: object, worker: object = None, arrivals: dict[str, int] | None = None,
                   max_tokens: int = 6, on_step: object = None, setup: object = None
                   ) -> tuple[list[object], object]:
    """vLLM's scheduler loop with a KV connector (``transfer``: vLLM's ``KVTransferConfig``)
    and a stand-in for the workers' side of its transfers (``worker``: a
    ``WorkerStandIn``, by default one that reports loads and sends done 2 steps after they
    began). Request ``rid`` arrives before step ``arrivals[rid]`` (0 by default).
    ``on_step(t, sched, out)`` runs after each ``schedule()``. Returns each step's output in
    the form both managers must agree on (with the connector's KV events), and the
    scheduler."""
    from kvmem.integrations.vllm._connector_script import WorkerStandIn
    from kvmem.integrations.vllm._vllm_objects import make_request, make_scheduler, model_output

    worker = worker if worker is not None else WorkerStandIn()
    sched = make_scheduler(spec, kvmem, log_stats=True, kv_transfer_config=transfer)
    if setup is not None:
        setup(sched)
    arrivals = arrivals or {}
    requests = {rid: make_request(StreamRequest(rid, p, max_tokens), spec.block_size)
                for rid, p in prompts.items()}
    records: list[object] = []
    last = max(arrivals.values(), default=0)
    for t in range(200):
        for rid, req in requests.items():
            if arrivals.get(rid, 0) == t:
                sched.add_request(req)
        if t > last and not sched.has_requests():
            break
        out = sched.schedule()
        if on_step is not None:
            on_step(t, sched, out)
        record = _canonical(sched, out)
        record["waiting_for_kv"] = sorted(
            r.request_id for r in sched.requests.values()
            if r.status.name == "WAITING_FOR_REMOTE_KVS")
        mro = model_output(sched, out)
        mro.kv_connector_output = worker.output(sched, out, t)
        sched.update_from_output(out, mro)
        record["events"] = [(type(e).__name__, getattr(e, "medium", None))
                            for e in sched.kv_event_publisher.events]
        sched.kv_event_publisher.events.clear()
        records.append(record)
    records.append([(rid, list(r.output_token_ids), r.status.name)
                    for rid, r in requests.items()])
    return records, sched


def _same_run(spec: SchedulerSpec, prompts: dict[str, tuple[int, ...]], transfer: object,
              make_worker: object = None, extra_removed: int = 0, **kw: object
              ) -> tuple[list[object], object]:
    """Both managers through :func:`_connector_run`; asserts every step agrees and kvmem's
    integrity check ran silently; returns vLLM's records and kvmem's scheduler.
    ``extra_removed``: BlockRemoved events kvmem publishes and vLLM does not (a failed load's
    blocks under ``recompute``, which kvmem takes out of its prefix cache)."""
    from kvmem.integrations.vllm._connector_script import WorkerStandIn

    make = make_worker or WorkerStandIn
    vllm_records, _ = _connector_run(False, spec, prompts, transfer, make(), **kw)
    kvmem_records, sched = _connector_run(True, spec, prompts, transfer, make(), **kw)
    assert len(kvmem_records) == len(vllm_records)
    removed = 0
    for t, (a, b) in enumerate(zip(vllm_records, kvmem_records)):
        if extra_removed and isinstance(a, dict):
            extra = list(b["events"])
            for e in a["events"]:
                extra.remove(e)
            assert set(extra) <= {("BlockRemoved", "GPU")}, f"step {t}"
            removed += len(extra)
            a, b = {**a, "events": None}, {**b, "events": None}
        assert a == b, f"step {t}"
    assert removed == extra_removed
    adapter = sched.kv_cache_manager
    assert adapter.num_integrity_aborts == 0
    assert adapter.num_verified_steps > 0
    adapter.check()
    sched.kvmem.check()
    return vllm_records, sched


_SHARED = tuple(range(10, 26))  # 4 blocks of 4
_CONN_PROMPTS = {"a": (*_SHARED, 1, 2, 3), "b": (*_SHARED, 7, 8), "c": tuple(range(60, 71))}


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("caching", [True, False])
def test_external_hits_schedule_exactly_as_vllm(is_async: bool, async_scheduling: bool,
                                                caching: bool) -> None:
    """External matched tokens (synchronous and asynchronous loads), local prefix hits
    before them, delayed frees and the connector's KV events: every step's output, block
    tables, usage, the requests waiting for their KV and the published events agree with
    vLLM's manager; the connector was handed the blocks kvmem allocated."""
    from kvmem.integrations.vllm._connector_script import connector_config

    spec = dataclasses.replace(SPEC, num_blocks=30, async_scheduling=async_scheduling,
                               enable_prefix_caching=caching, kv_events=True)
    transfer = connector_config(hits={"a": (12, is_async), "b": (18, is_async),
                                      "c": (8, is_async)},
                                delay_free=("a", "c"), events=True)
    records, sched = _same_run(spec, _CONN_PROMPTS, transfer, arrivals={"b": 4})
    assert any(r["waiting_for_kv"] for r in records[:-1]) == is_async
    assert any(("BlockStored", "CPU") in r["events"] for r in records[:-1])
    allocs = sched.connector.allocs
    assert {rid for rid, _, n in allocs if n} == {"a", "b", "c"}
    assert all(tokens and status.startswith("FINISHED") for _, tokens, status in records[-1])


def test_delayed_frees_are_never_reused_before_the_connector_releases_them() -> None:
    """Guards the delayed free: a finished request whose blocks the connector still reads
    (request_finished says delay_free_blocks) keeps them, in kvmem a lease, until
    finished_sending; a request that needs every free block meanwhile waits instead of
    getting them (were they freed at the finish, it would be scheduled at once, and its
    blocks would include the held ones). Both managers agree step by step."""
    from kvmem.integrations.vllm._connector_script import WorkerStandIn, connector_config

    spec = dataclasses.replace(SPEC, num_blocks=11, max_model_len=64)  # 10 usable blocks
    prompts = {"held": tuple(range(10, 29)), "big": tuple(range(100, 128))}
    transfer = connector_config(delay_free=("held",))
    seen: dict[str, object] = {}

    def on_step(t: int, sched: object, out: object) -> None:
        held = sched.requests.get("held")
        if held is not None and held.is_finished():
            ids = {b for rid, blocks in sched.connector.finished if rid == "held"
                   for b in blocks}
            assert ids
            seen.setdefault("first_held", t)
            for r in out.scheduled_new_reqs:
                assert not ids & set(r.block_ids[0]), f"step {t}: held blocks reused"
        if "big" in out.num_scheduled_tokens:
            seen.setdefault("big", t)

    _records, sched = _same_run(spec, prompts, transfer,
                               make_worker=lambda: WorkerStandIn(lag=3),
                               arrivals={"big": 3}, max_tokens=4, on_step=on_step)
    # "big" (7 blocks) waited for the held request's 5 blocks to come back.
    assert seen["big"] >= seen["first_held"] + 3
    assert sched.kvmem.check() is None


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("how", ["request", 1, 3])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("paranoid", [False, True])
def test_async_load_failures_follow_vllms_policy(policy: str, how: object,
                                                 async_scheduling: bool, paranoid: bool) -> None:
    """An asynchronous load that fails as a whole (failed_recving) or from one block on
    (invalid_block_ids): with ``recompute`` the request recomputes from its last valid block
    (kvmem gives back the failed tail's slots and commits only the valid prefix), with
    ``fail`` it finishes with an error; the same steps as vLLM's manager either way. With the
    paranoid check, guards the worker block table of a request rolled back below pages it
    keeps (it was rebuilt from the step's pages only: the kept page read as the null
    block)."""
    from kvmem.integrations.vllm._connector_script import WorkerStandIn, connector_config

    # (the paranoid runs in chunks of 8 tokens: a rolled-back request's step then covers
    # fewer pages than it keeps)
    spec = dataclasses.replace(SPEC, num_blocks=30, async_scheduling=async_scheduling,
                               paranoid=paranoid,
                               max_num_batched_tokens=8 if paranoid else 32)
    transfer = connector_config(hits={"a": (16, True), "b": (12, True)}, policy=policy)
    records, _sched = _same_run(spec, _CONN_PROMPTS, transfer,
                               make_worker=lambda: WorkerStandIn(fail_loads={"a": how}),
                               arrivals={"b": 1})
    statuses = dict((rid, status) for rid, _, status in records[-1])
    assert statuses["b"] == "FINISHED_LENGTH_CAPPED" or statuses["b"].startswith("FINISHED")
    if policy == "fail":
        assert statuses["a"] == "FINISHED_ERROR"
    else:
        assert statuses["a"] != "FINISHED_ERROR"
        first = next(r for r in records[:-1] if "a" in r["num_scheduled"])
        assert first["num_scheduled"]["a"] > 19 - 16  # it recomputed more than its last token


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_sync_load_failures_follow_vllms_policy(policy: str) -> None:
    """A synchronous load whose block 2 fails (invalid_block_ids in the output of the step
    that loaded it), no block shared: vLLM rolls the request back to block 2 (recompute)
    or fails it and evicts the blocks (fail); kvmem agrees step by step, its slots past the
    rollback committed already and recomputed in place. Under ``recompute`` kvmem also
    takes the failed blocks out of its prefix cache (2 BlockRemoved events vLLM does not
    publish: vLLM keeps them cached while they are recomputed)."""
    from kvmem.integrations.vllm._connector_script import WorkerStandIn, connector_config

    spec = dataclasses.replace(SPEC, num_blocks=30)
    prompts = {"a": _CONN_PROMPTS["a"], "c": _CONN_PROMPTS["c"]}
    transfer = connector_config(hits={"a": (16, False)}, policy=policy)
    records, _sched = _same_run(spec, prompts, transfer,
                               make_worker=lambda: WorkerStandIn(fail_loads={"a": 2}),
                               extra_removed=2 if policy == "recompute" else 0)
    statuses = dict((rid, status) for rid, _, status in records[-1])
    assert (statuses["a"] == "FINISHED_ERROR") == (policy == "fail")


def test_a_failed_block_shared_by_two_requests_is_recomputed_by_both() -> None:
    """Guards vllm#49250: two requests share a block whose synchronous load failed. vLLM
    rolls back only the first and lets the other go on as if the block were recomputed,
    which it may not be yet (wrong outputs). kvmem's scheduler rolls back each to its own
    first invalid block, and takes the failed blocks out of the prefix cache: a later
    request with the same prefix finds none of them."""
    from kvmem.integrations.vllm._connector_script import WorkerStandIn, connector_config

    spec = dataclasses.replace(SPEC, num_blocks=40)
    prompts = {"a": (*_SHARED, 1, 2, 3), "b": (*_SHARED, 7, 8), "late": (*_SHARED, 9)}
    transfer = connector_config(hits={"a": (16, False)}, policy="recompute")
    computed_after: dict[str, int] = {}

    def on_step(t: int, sched: object, out: object) -> None:
        if t == 1:
            for rid in ("a", "b"):
                computed_after[rid] = sched.requests[rid].num_computed_tokens
        for r in out.scheduled_new_reqs:
            if r.req_id == "late":
                computed_after["late"] = r.num_computed_tokens  # its prefix hit

    # a loads 16 tokens (4 blocks) and computes 3; b hits a's blocks in the same step.
    # a's block 1 failed: both recompute from token 4.
    records, sched = _connector_run(True, spec, prompts, transfer,
                                    WorkerStandIn(fail_loads={"a": 1}),
                                    arrivals={"late": 3}, on_step=on_step)
    first = records[0]
    assert first["num_scheduled"] == {"a": 3, "b": 2}
    second = records[1]
    assert second["num_scheduled"]["a"] == 19 - 4 and second["num_scheduled"]["b"] == 18 - 4
    assert computed_after["late"] <= 4  # the failed blocks left the cache
    adapter = sched.kv_cache_manager
    assert adapter.num_integrity_aborts == 0
    adapter.check()
    sched.kvmem.check()


def _example_connector_stores(prompts: dict[str, tuple[int, ...]]) -> object:
    """A setup that makes vLLM's ExampleConnector find these prompts in its storage (the
    folder its worker side would have written, named by the connector itself)."""
    import torch

    def setup(sched: object) -> None:
        conn = sched.connector
        for prompt in prompts.values():
            n = (len(prompt) - 1) // 4 * 4
            conn._generate_foldername_debug(torch.tensor(prompt)[:n], [], create_folder=True)
    return setup


@pytest.mark.parametrize("connector", ["ExampleConnector", "DecodeBenchConnector",
                                       "OffloadingConnector"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllms_own_connectors_schedule_exactly_as_on_vllms_manager(
        connector: str, async_scheduling: bool, tmp_path: object) -> None:
    """vLLM's own connectors, from the installed vLLM, scheduler side: ExampleConnector
    (synchronous loads of prompts found in its storage), DecodeBenchConnector (fills every
    prompt but its last token) and OffloadingConnector (stores to CPU, then a second wave of
    the same prompts loads them back asynchronously, its worker side played by
    ``OffloadingWorkerStandIn``): the same steps as vLLM's manager, the connector handed
    kvmem's blocks, kvmem's integrity check silent."""
    from vllm.config import KVTransferConfig

    from kvmem.integrations.vllm._connector_script import OffloadingWorkerStandIn, WorkerStandIn

    spec = dataclasses.replace(SPEC, num_blocks=40, async_scheduling=async_scheduling,
                               kv_events=True)
    prompts = dict(_CONN_PROMPTS)
    arrivals: dict[str, int] = {"b": 2}
    make_worker: object = WorkerStandIn
    setup = None
    extra: dict[str, object] = {}
    if connector == "ExampleConnector":
        extra = {"shared_storage_path": str(tmp_path)}
        setup = _example_connector_stores({"a": prompts["a"], "c": prompts["c"]})
    elif connector == "OffloadingConnector":
        extra = {"cpu_bytes_to_use": 1 << 16}
        make_worker = OffloadingWorkerStandIn
        prompts.update({f"{rid}2": p for rid, p in prompts.items()})
        arrivals.update({"a2": 12, "b2": 12, "c2": 14})
    transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                kv_connector_extra_config=extra)

    def on_step(t: int, sched: object, out: object) -> None:
        if t == 10 and connector == "OffloadingConnector":  # the GPU cache forgets them
            assert sched.kv_cache_manager.reset_prefix_cache()

    records, sched = _same_run(spec, prompts, transfer, make_worker=make_worker,
                               arrivals=arrivals, setup=setup, on_step=on_step)
    hits = [r for r in records[:-1] for _, n, _ in r["new"] if n]
    assert hits, "no request found anything outside the GPU cache"
    assert sched.connector._kv_cache_manager is sched.kv_cache_manager
    if connector == "OffloadingConnector":
        assert any(r["waiting_for_kv"] for r in records[:-1])  # the second wave loaded


# -- KV connector calls with bad arguments: a clear error, nothing changed ------------------------


def _connector_adapter(connector: bool = True) -> tuple[object, object]:
    """An adapter serving a connector, with request "a" admitted (4 hit-less tokens) and
    flushed; and a maker of requests."""
    from kvmem.integrations.vllm import VllmKVCacheAdapter
    from kvmem.integrations.vllm._vllm_objects import make_request

    adapter = VllmKVCacheAdapter(num_blocks=12, block_size=4, max_model_len=64, max_num_seqs=4,
                                 connector=connector)

    def req(rid: str, n: int = 9) -> object:
        return make_request(StreamRequest(rid, tuple(range(10, 10 + n)), 4), 4)

    a = req("a")
    assert adapter.allocate_slots(a, 9) is not None
    adapter.flush()
    return adapter, req


def _state(adapter: object) -> tuple[object, ...]:
    m = adapter.manager
    return (sorted(m.running), m.allocator.num_free, m.num_tokens("a"), m.num_committed("a"),
            dict(adapter._held), set(adapter._resync), adapter._num_free())


def test_external_tokens_without_a_connector_are_refused_changing_nothing() -> None:
    adapter, req = _connector_adapter(connector=False)
    before = _state(adapter)
    with pytest.raises(KVMemError, match="connector=True"):
        adapter.allocate_slots(req("b"), 1, num_external_computed_tokens=4)
    assert _state(adapter) == before


@pytest.mark.parametrize("external", [-4, 2.5, 100])
def test_bad_external_token_counts_are_refused_changing_nothing(external: object) -> None:
    adapter, req = _connector_adapter()
    before = _state(adapter)
    with pytest.raises((ValueError, TypeError), match="external"):
        adapter.allocate_slots(req("b"), 1, num_external_computed_tokens=external)
    assert _state(adapter) == before


@pytest.mark.parametrize("ids", [{0}, {12}, {-1}, {"3"}, {1, 99}])
def test_evicting_bad_block_ids_is_refused_changing_nothing(ids: set[object]) -> None:
    adapter, _ = _connector_adapter()
    before = _state(adapter)
    with pytest.raises(ValueError, match="block ids"):
        adapter.evict_blocks(ids)
    assert _state(adapter) == before


def test_freeing_blocks_not_popped_is_refused_changing_nothing() -> None:
    from kvmem.integrations.vllm._blocks import KVMemBlock

    adapter, req = _connector_adapter()
    assert adapter.allocate_slots(req("b", 5), 5) is not None
    popped = adapter.pop_blocks_for_free(req("b", 5))
    assert popped and all(b.hold is not None for b in popped)
    before = _state(adapter)
    with pytest.raises(ValueError, match="pop_blocks_for_free"):
        adapter.block_pool.free_blocks([*popped, KVMemBlock(3)])
    assert _state(adapter) == before
    adapter.block_pool.free_blocks(reversed(popped))  # (vLLM frees them in reverse order)
    assert not adapter._held
    with pytest.raises(ValueError, match="pop_blocks_for_free"):
        adapter.block_pool.free_blocks(popped)  # twice
    adapter.check()


def test_holding_a_request_twice_is_refused_changing_nothing() -> None:
    adapter, req = _connector_adapter()
    a = req("a")
    adapter.hold(a)
    assert "a" not in adapter.manager.running and "a" in adapter._held
    before = (adapter.manager.allocator.num_free, dict(adapter._held))
    with pytest.raises(ValueError, match="already held"):
        adapter.hold(a)
    assert (adapter.manager.allocator.num_free, dict(adapter._held)) == before
    adapter.free(a)
    assert not adapter._held
    adapter.check()


@pytest.mark.parametrize("tokens", [3, -4, 16])
def test_bad_truncations_and_zeroing_starts_are_refused(tokens: int) -> None:
    from kvmem.integrations.vllm._blocks import PrefixHit

    adapter, _ = _connector_adapter()
    hit = PrefixHit([1, 2], 0)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        adapter.truncate_computed_blocks(hit, tokens)
    assert hit.ids == [1, 2]
    if tokens != 16:
        with pytest.raises(ValueError, match="start_token"):
            adapter.record_blocks_for_zeroing("a", tokens)
