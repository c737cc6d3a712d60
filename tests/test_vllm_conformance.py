"""Differential conformance: vLLM's Scheduler on vLLM's own KV cache manager and on kvmem's.

Two kinds of evidence, both run on the two schedulers and compared step by step (scheduled
requests, num_scheduled_tokens, prefix-hit num_computed_tokens, preempted and finished ids,
KV cache usage, the block tables' sharing structure, the KV events' cache contents, every
request's final tokens):

- hypothesis streams (``KVMEM_VLLM_STREAMS``, 200 by default: the CI profile), each
  :func:`~kvmem.integrations.vllm.conformance.random_stream` of a hypothesis-controlled
  ``Random``, so a failing stream shrinks and prints as a replayable test; and a quarter as
  many per speculative method, every stream speculating (drafts with random acceptance), and
  as many with LoRA adapters and images in every stream, and a quarter as many with a KV
  connector (external hits, asynchronous loads, delayed frees, load failures);
- the scenarios of vLLM's own scheduler and prefix-caching tests (``tests/v1/core/``) that fall
  inside the supported set, re-created here (docs/vllm.md lists them and how they compare).

Needs vLLM 0.33 importable; skipped otherwise.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.integrations.vllm import vllm_import_error
from kvmem.integrations.vllm.conformance import (
    SPEC_METHODS,
    Driver,
    SchedulerSpec,
    SpecMethod,
    StreamRequest,
    compare,
    random_stream,
)

# (The harness above imports vLLM only inside its functions: it loads without vLLM.)
pytestmark = pytest.mark.skipif(vllm_import_error() is not None,
                                reason="vLLM 0.33 is not importable (see setup_vllm_cpu.sh)")


STREAMS = int(os.environ.get("KVMEM_VLLM_STREAMS", "200"))


@settings(max_examples=STREAMS, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.randoms(use_true_random=False))
def test_random_streams_schedule_exactly_as_vllm(rng: random.Random) -> None:
    c = compare(random_stream(rng))
    assert c.ok, (f"{c.first_difference}; outputs differ: {c.outputs_differ}; verify "
                  f"failures: {c.verify_failures}; table mismatches: {c.table_mismatches}\n"
                  f"Replay it:\n\n{c.replay()}")


@pytest.mark.parametrize("method", SPEC_METHODS)
@settings(max_examples=max(STREAMS // 4, 1), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False))
def test_speculative_streams_schedule_exactly_as_vllm(method: SpecMethod,
                                                      rng: random.Random) -> None:
    """Streams with draft tokens every decode step, accepted at a random rate (rejected
    drafts roll the requests back), by n-gram (no lookahead), a draft model (lookahead slots)
    and EAGLE (lookahead slots, prefix hits less their last block): the same step-by-step
    equality, with each step's scheduled drafts and computed tokens compared too."""
    c = compare(random_stream(rng, speculative=True, spec_methods=(method,)))
    assert c.ok, (f"{c.first_difference}; outputs differ: {c.outputs_differ}; verify "
                  f"failures: {c.verify_failures}; table mismatches: {c.table_mismatches}\n"
                  f"Replay it:\n\n{c.replay()}")
    assert c.stream.sched.spec_method == method


@settings(max_examples=max(STREAMS // 4, 1), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False))
def test_streams_with_lora_adapters_and_images_schedule_exactly_as_vllm(
        rng: random.Random) -> None:
    """Streams whose requests carry LoRA adapters and images (prompts of one root mostly
    sharing the root's images, others with images of their own; an encoder budget; a LoRA
    limit or none): the same step-by-step equality, so every prefix hit and miss is vLLM's."""
    c = compare(random_stream(rng, keys=True))
    assert c.ok, (f"{c.first_difference}; outputs differ: {c.outputs_differ}; verify "
                  f"failures: {c.verify_failures}; table mismatches: {c.table_mismatches}\n"
                  f"Replay it:\n\n{c.replay()}")
    assert c.stream.sched.encoder_cache_size > 0  # (the keys were drawn)


@settings(max_examples=max(STREAMS // 4, 1), deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False))
def test_connector_streams_schedule_exactly_as_vllm(rng: random.Random) -> None:
    """Streams with a KV connector: requests find part or all of their prompt outside the
    GPU cache (after a local prefix hit or not), loaded synchronously or asynchronously
    (waiting for their KV meanwhile), keep their blocks with the connector after they finish
    (delayed frees), and loads fail, whole or from one block on, under either of vLLM's
    policies: the same step-by-step equality, with the requests waiting for their KV
    compared too."""
    c = compare(random_stream(rng, connector=True))
    assert c.ok, (f"{c.first_difference}; outputs differ: {c.outputs_differ}; verify "
                  f"failures: {c.verify_failures}; table mismatches: {c.table_mismatches}\n"
                  f"Replay it:\n\n{c.replay()}")
    assert c.stream.sched.connector


# -- vLLM's scenarios ----------------------------------------------------------------------------


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(10, 990) for _ in range(n))


def _both(spec: SchedulerSpec, script: Callable[[Driver], object]
          ) -> tuple[Driver, Driver, object, object]:
    drivers = (Driver(spec, kvmem=False), Driver(spec, kvmem=True))
    results = [script(d) for d in drivers]
    return drivers[0], drivers[1], results[0], results[1]


def _assert_agree(spec: SchedulerSpec, script: Callable[[Driver], object]) -> Driver:
    v, k, rv, rk = _both(spec, script)
    assert rv == rk
    assert len(v.records) == len(k.records)
    for i, (a, b) in enumerate(zip(v.records, k.records)):
        assert a.key() == b.key(), f"step {i}: vLLM {a} / kvmem {b}"
    rv_, rk_ = v.result(), k.result()
    assert rv_.outputs == rk_.outputs and rv_.finish == rk_.finish
    assert rk_.verify_failures == 0 and rk_.table_mismatches == 0
    return k


def test_schedule_all_at_once() -> None:
    """test_schedule: ten short requests scheduled in one step, then decoded to the end."""
    spec = SchedulerSpec(num_blocks=1000, block_size=16, max_num_seqs=16,
                         max_num_batched_tokens=8192, max_model_len=8192)

    def script(d: Driver) -> None:
        for i in range(10):
            d.add(StreamRequest(f"{i}", (i + 10,) * 10, 16))
        d.run()

    k = _assert_agree(spec, script)
    assert len(k.records[0].new) == 10


def test_partial_requests_are_chunked() -> None:
    """test_schedule_partial_requests: three 800-token prompts through a 1024-token budget."""
    spec = SchedulerSpec(num_blocks=1000, block_size=16, max_num_seqs=16,
                         max_num_batched_tokens=1024, max_model_len=4096)

    def script(d: Driver) -> None:
        for i in range(3):
            d.add(StreamRequest(f"{i}", _prompt(i, 800), 8))
        d.run()

    k = _assert_agree(spec, script)
    assert sorted(k.records[0].num_scheduled.values()) == [224, 800]


def test_concurrent_partial_requests_with_a_long_prefill_threshold() -> None:
    """test_schedule_concurrent_partial_requests: a long-prefill threshold splits prompts."""
    spec = SchedulerSpec(num_blocks=1000, block_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, max_model_len=4096,
                         long_prefill_token_threshold=100)

    def script(d: Driver) -> None:
        for i in range(5):
            d.add(StreamRequest(f"{i}", _prompt(i, 300), 6))
        d.run()

    _assert_agree(spec, script)


def test_preempt_during_execution() -> None:
    """test_preempt_during_execution: two 80-token prompts in 10 usable blocks, the second
    scheduled while the first's step is still in flight, then preempted by its growth."""
    spec = SchedulerSpec(num_blocks=11, block_size=16, max_num_seqs=16,
                         max_num_batched_tokens=100, max_model_len=1024,
                         enable_prefix_caching=False, kv_events=False)

    def script(d: Driver) -> list[str]:
        d.add(StreamRequest("0", _prompt(0, 80), 20))
        out0 = d.schedule()
        d.add(StreamRequest("1", _prompt(1, 80), 20))
        out1 = d.schedule()
        d.update(out0)
        out2 = d.schedule()
        preempted = sorted(r.request_id for r in d.sched.waiting)
        d.update(out1)
        d.update(out2)
        d.run()
        return preempted

    k = _assert_agree(spec, script)
    assert k.result().outputs["1"]


def test_reset_prefix_cache() -> None:
    """test_scheduler_reset_prefix_cache: refused while requests hold blocks; with
    reset_running_requests every running request is preempted and the cache is cleared."""
    spec = SchedulerSpec(num_blocks=1000, block_size=4, max_num_seqs=16,
                         max_num_batched_tokens=8192, max_model_len=1024)

    def script(d: Driver) -> tuple[bool, bool, int]:
        for i in range(10):
            d.add(StreamRequest(f"{i}", (*_prompt(0, 12), i + 10), 10))
        d.step()
        refused = d.sched.reset_prefix_cache()
        reset = d.sched.reset_prefix_cache(reset_running_requests=True)
        waiting = len(d.sched.waiting)
        d.run()
        return refused, reset, waiting

    v, k, rv, rk = _both(spec, script)
    assert rv == rk == (False, True, 10)
    for a, b in zip(v.records, k.records):
        assert a.key() == b.key()
    assert any(("cleared",) in r.events for r in k.records)


def test_prefix_hits_at_several_depths() -> None:
    """test_prefill (prefix caching): a three-block common prefix is reused whole, a partial
    match reuses its full blocks only, and the last prompt token is always computed."""
    spec = SchedulerSpec(num_blocks=100, block_size=16, max_num_seqs=16,
                         max_num_batched_tokens=8192, max_model_len=1024)
    common = _prompt(7, 48)

    def script(d: Driver) -> None:
        d.add(StreamRequest("0", (*common, 11, 12, 13), 5))
        d.step()
        d.add(StreamRequest("1", (*common, 14, 15, 16), 5))
        d.add(StreamRequest("2", (*common[:40], 17), 5))
        d.add(StreamRequest("3", common, 5))  # all full blocks hit: the last block is recomputed
        d.run()

    k = _assert_agree(spec, script)
    assert dict(k.records[1].new) == {"1": 48, "2": 32, "3": 32}


def test_eviction_order_least_recently_freed_first() -> None:
    """test_evict: finished requests' blocks are evicted least recently freed first, a
    request's tail first; which prefix survives decides the later hits."""
    spec = SchedulerSpec(num_blocks=11, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=256)

    def script(d: Driver) -> list[tuple[str, int]]:
        d.add(StreamRequest("a", _prompt(1, 16), 1))
        d.run()
        d.add(StreamRequest("b", _prompt(2, 12), 1))
        d.run()
        d.add(StreamRequest("c", _prompt(3, 20), 1))  # evicts a's tail, then more
        d.run()
        hits = []
        for rid, seed, n in (("a2", 1, 16), ("b2", 2, 12)):
            d.add(StreamRequest(rid, (*_prompt(seed, n), 5), 1))
            out = d.step()
            hits += [(nr.req_id, nr.num_computed_tokens) for nr in out.scheduled_new_reqs]
        return hits

    v, k, rv, rk = _both(spec, script)
    assert rv == rk
    for a, b in zip(v.records, k.records):
        assert a.key() == b.key()


def test_cache_salt_is_a_namespace() -> None:
    """test_cache_key_salting: the same prompt under another cache_salt never hits; under the
    same salt it does."""
    spec = SchedulerSpec(num_blocks=200, block_size=4, max_num_seqs=8,
                         max_num_batched_tokens=512, max_model_len=512)
    prompt = _prompt(4, 33)

    def script(d: Driver) -> None:
        d.add(StreamRequest("plain", prompt, 3))
        d.add(StreamRequest("a1", prompt, 3, salt="a"))
        d.step()
        d.add(StreamRequest("b", prompt, 3, salt="b"))
        d.add(StreamRequest("a2", prompt, 3, salt="a"))
        d.add(StreamRequest("plain2", prompt, 3))
        d.run()

    k = _assert_agree(spec, script)
    new = dict(k.records[1].new)
    assert new == {"b": 0, "a2": 32, "plain2": 32}


def test_kv_events_under_eviction() -> None:
    """test_kv_cache_events: BlockStored for every block cached, BlockRemoved for every block
    evicted, with the same cache contents."""
    spec = SchedulerSpec(num_blocks=13, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=256)

    def script(d: Driver) -> None:
        for i in range(6):
            d.add(StreamRequest(f"{i}", _prompt(i % 3, 14 + i), 4, arrival=0))
            d.step()
        d.run()

    k = _assert_agree(spec, script)
    kinds = {key[0] for r in k.records for key in r.events}
    assert {"stored", "removed"} <= kinds


def test_preemption_with_prefix_caching_resumes_from_its_own_blocks() -> None:
    """Preemption under prefix caching (test_prefix_caching's preemption cases): a preempted
    request's full blocks stay cached, so its resume hits them unless they were evicted."""
    spec = SchedulerSpec(num_blocks=14, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=32, max_model_len=256)
    shared = _prompt(9, 12)

    def script(d: Driver) -> None:
        for i in range(3):
            d.add(StreamRequest(f"{i}", shared + _prompt(20 + i, 5), 20))
        d.run()

    k = _assert_agree(spec, script)
    assert any(r.preempted for r in k.records)
    assert any(n for r in k.records for _, n in r.new)


def test_aborts_of_running_and_waiting_requests() -> None:
    """test_finish_request / aborts: a running and a waiting request aborted between steps."""
    spec = SchedulerSpec(num_blocks=20, block_size=4, max_num_seqs=2,
                         max_num_batched_tokens=32, max_model_len=256)

    def script(d: Driver) -> None:
        for i in range(4):
            d.add(StreamRequest(f"{i}", _prompt(i, 10), 10))
        d.step()
        d.step()
        d.abort(["0", "3"])  # 0 runs, 3 waits
        d.run()

    k = _assert_agree(spec, script)
    assert k.result().finish["0"] == k.result().finish["3"] == "abort"


def test_priority_preemption() -> None:
    """test_priority_scheduling_preemption: a high-priority arrival preempts the lowest-priority
    running request, which may already be scheduled in the step."""
    spec = SchedulerSpec(num_blocks=12, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=256, policy="priority")

    def script(d: Driver) -> None:
        for i in range(3):
            d.add(StreamRequest(f"low{i}", _prompt(i, 10), 12, priority=5))
        d.step()
        d.step()
        d.add(StreamRequest("high", _prompt(9, 10), 12, priority=0))
        d.run()

    k = _assert_agree(spec, script)
    assert any(r.preempted for r in k.records)


def test_async_scheduler_with_preemption() -> None:
    """test_async_scheduler: AsyncScheduler (output placeholders, caching after the step's
    output arrives) under preemption."""
    spec = SchedulerSpec(num_blocks=14, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=32, max_model_len=256, async_scheduling=True)

    def script(d: Driver) -> None:
        for i in range(4):
            d.add(StreamRequest(f"{i}", _prompt(i % 2, 9), 14))
        d.run()

    k = _assert_agree(spec, script)
    assert any(r.preempted for r in k.records)


def test_watermark_holds_blocks_back_from_admission() -> None:
    """The scheduler's watermark: admissions keep a fraction of the blocks free."""
    spec = SchedulerSpec(num_blocks=30, block_size=4, max_num_seqs=8,
                         max_num_batched_tokens=64, max_model_len=256, watermark=0.2)

    def script(d: Driver) -> None:
        for i in range(6):
            d.add(StreamRequest(f"{i}", _prompt(i, 15), 8))
        d.run()

    _assert_agree(spec, script)


def test_large_pool_eviction_is_exact() -> None:
    """In pools of 512+ pages kvmem's manager evicts num_pages // 512 extra pages by default;
    the adapter builds it with evict_ahead=0, vLLM's exact eviction, so prefix hits agree."""
    spec = SchedulerSpec(num_blocks=521, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=2048, max_model_len=2100)
    a = _prompt(1, 1000)

    def script(d: Driver) -> None:
        d.add(StreamRequest("a", a, 1))
        d.run()
        d.add(StreamRequest("b", _prompt(2, 1000), 1))
        d.run()
        d.add(StreamRequest("c", _prompt(3, 100), 1))  # evicts a's deepest blocks
        d.run()
        d.add(StreamRequest("d", (*a[:4 * 240], 5), 1))
        d.run()

    _assert_agree(spec, script)


def test_duplicate_blocks_are_cached_twice_as_vllm_does() -> None:
    """Found by the random streams (shrunk) against kvmem's stock HashedPrefixCache, which keeps
    one page per prefix: two requests computing the same block in one step (neither hits the
    other: the last prompt token is always computed) get a block each, and vLLM's block pool
    caches both; VllmOrderPrefixCache does too, so the events and later evictions agree."""
    from kvmem.integrations.vllm.conformance import StreamSpec

    stream = StreamSpec(
        sched=SchedulerSpec(num_blocks=4, block_size=4, max_num_seqs=2,
                            max_num_batched_tokens=8, max_model_len=256,
                            async_scheduling=True, paranoid=True),
        requests=(StreamRequest("r0", (10, 10, 10, 10), 1),
                  StreamRequest("r1", (10,), 1, abort_at=0),
                  StreamRequest("r2", (10,) * 10, 1, abort_at=0),
                  StreamRequest("r3", (10,) * 10, 1, abort_at=0),
                  StreamRequest("r4", (10, 10, 10, 10), 1, abort_at=1)),
        pipeline=2)
    c = compare(stream)
    assert c.ok, c.first_difference
    stored = c.kvmem.steps[0].events[("stored", ((), 10, 10, 10, 10))]
    assert stored == 2


# -- the adapter's flush: deferred past a new request's lookup unless it could change it -------


def _flushes_per_step(spec: SchedulerSpec, script: Callable[[Driver], object]
                      ) -> tuple[Driver, list[int]]:
    """Run ``script`` on both schedulers (they must agree, as ``_assert_agree`` asks) and
    return kvmem's driver with its adapter's flushes (with work) of each step."""
    counts: list[int] = []

    def counting(d: Driver) -> object:
        if not d.kvmem:
            return script(d)
        adapter = d.sched.kv_cache_manager
        step = d.step

        def counted_step() -> object:
            before = adapter.num_flushes
            out = step()
            counts.append(adapter.num_flushes - before)
            return out

        d.step = counted_step  # type: ignore[method-assign]
        return script(d)

    k = _assert_agree(spec, counting)
    return k, counts


def test_requests_joining_a_running_batch_go_out_in_its_flush() -> None:
    """Requests joining a decoding batch with prompts nothing queued will cache: their lookups
    need no flush, so each step's decodes and admissions are one reserve, one verify and one
    commit (before, each joining request's lookup and block ids flushed the queue: 1 + joins
    flushes a step)."""
    spec = SchedulerSpec(num_blocks=200, block_size=4, max_num_seqs=16,
                         max_num_batched_tokens=256, max_model_len=256)

    def script(d: Driver) -> None:
        for i in range(4):
            d.add(StreamRequest(f"run{i}", _prompt(20 + i, 9), 12))
        d.step()
        for step in range(1, 6):
            for j in range(3):  # three join every step, sharing no page with the queue's
                d.add(StreamRequest(f"new{step}.{j}", _prompt(100 * step + j, 13), 4))
            d.step()
        d.run()

    k, counts = _flushes_per_step(spec, script)
    assert all(len(k.records[s].new) == 3 for s in range(1, 6))
    assert counts[1:6] == [1] * 5  # one flush for 4+ decodes and three admissions a step
    assert k.sched.kv_cache_manager.num_verified_steps == sum(counts)


def test_a_request_hitting_a_page_admitted_earlier_in_its_step_flushes_first() -> None:
    """vLLM caches a request's full blocks when it schedules them, so a request joining later
    in the same step hits the prompt a request admitted before it is computing. That commit is
    queued when the second lookup comes: the lookup's first missing page is one the queue
    fills (same namespace, same leading tokens), so the adapter flushes and looks again.
    Guards the fill half of the rule (without it kvmem found no hit: 0 tokens against 8)."""
    spec = SchedulerSpec(num_blocks=100, block_size=4, max_num_seqs=8,
                         max_num_batched_tokens=128, max_model_len=128)
    shared = _prompt(7, 9)

    def script(d: Driver) -> None:
        d.add(StreamRequest("run", _prompt(8, 6), 8))
        d.step()
        d.add(StreamRequest("a", shared, 3))
        d.add(StreamRequest("b", (*shared[:8], 5, 6), 3))  # its first two pages are a's
        d.add(StreamRequest("c", _prompt(9, 10), 3))  # no page in common: no flush
        d.run()

    k, counts = _flushes_per_step(spec, script)
    assert dict(k.records[1].new) == {"a": 0, "b": 8, "c": 0}
    assert counts[1] == 2  # b's lookup flushed; c's did not


def test_a_request_hitting_a_page_the_queue_will_evict_flushes_first() -> None:
    """A running request's growth, queued, takes the next page of the free order: when no page
    is free that is the least recently released cached page, here the second page of a
    finished prompt. vLLM allocates the growth before it looks up the joining request, so that
    request hits only the first page; the adapter sees that the queue would take a page the
    lookup found, flushes and looks again. Guards the eviction half of the rule (without it
    kvmem hit both pages: 8 tokens against 4)."""
    spec = SchedulerSpec(num_blocks=6, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=64)
    prompt = _prompt(11, 8)

    def script(d: Driver) -> None:
        d.add(StreamRequest("old", prompt, 1))  # 2 full pages, cached when it finishes
        d.add(StreamRequest("old2", _prompt(12, 8), 1))  # 2 more, released after old's
        d.add(StreamRequest("grow", _prompt(13, 3), 4))  # its second page at step 2
        d.step()
        d.step()
        d.add(StreamRequest("b", (*prompt, 7), 2))
        d.run()

    k, counts = _flushes_per_step(spec, script)
    assert dict(k.records[2].new) == {"b": 4}
    assert counts[2] == 2
