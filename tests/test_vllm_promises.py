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
    SchedulerSpec,
    StreamRequest,
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
    s.add_request(make_request(StreamRequest("a", tuple(range(10, 20)), 2), 4))
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


# -- add_request: what the scheduler cannot serve is refused there, changing nothing ------------


def test_an_empty_prompt_is_refused_in_add_request_and_changes_nothing() -> None:
    """vLLM's engine refuses an empty prompt before its scheduler; given to kvmem's scheduler
    directly it was queued, then every ``schedule()`` raised the manager's ``max_pages=-1``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    d = Driver(SPEC, kvmem=True)
    empty = Request(request_id="e", prompt_token_ids=[], sampling_params=SamplingParams(
        max_tokens=2), pooling_params=None)
    with pytest.raises(KVMemError, match=r"'e'.*empty prompt") as info:
        d.sched.add_request(empty)
    assert isinstance(info.value, ValueError)
    assert not d.sched.requests and not d.sched.has_requests()
    d.add(StreamRequest("a", (11, 12, 13), 2))
    d.run()
    assert d.requests["a"].is_finished()


def test_a_salt_past_the_namespace_limit_is_refused_in_add_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvmem's manager tells apart ``MAX_NAMESPACES`` namespaces in its life (2**20; 3 here).
    The request with one salt too many was queued and its admission inside ``schedule()``
    raised, every step after (it stayed at the head of the queue): the scheduler served no
    one. Now ``add_request`` refuses it, naming the request and the salt, and the rest run."""
    import kvmem.allocator._admission as admission

    monkeypatch.setattr(admission, "MAX_NAMESPACES", 3)  # None and two salts
    d = Driver(SPEC, kvmem=True)
    d.add(StreamRequest("a", (11, 12, 13), 2, salt="t1"))
    d.add(StreamRequest("b", (11, 12, 13), 2, salt="t2"))
    with pytest.raises(KVMemError, match=r"'c'.*cache_salt='t3'"):
        d.add(StreamRequest("c", (11, 12, 13), 2, salt="t3"))
    assert "c" not in d.sched.requests
    d.add(StreamRequest("d", (11, 12, 13), 2, salt="t1"))  # a salt it knows is still served
    d.run()
    assert all(d.requests[rid].is_finished() for rid in "abd")
    d.sched.kv_cache_manager.check()


# -- argument checks by their own names ----------------------------------------------------------


def test_a_max_model_len_too_long_for_the_page_table_is_named_as_max_model_len() -> None:
    """docs/vllm.md: the adapter's arguments are checked by their own names. A context whose
    blocks overflow int32 was refused as the manager's ``max_pages_per_seq``, which the caller
    never passed."""
    args = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 4}
    with pytest.raises(KVMemError, match=r"^max_model_len=1099511627776: .*block_size=4") as info:
        VllmKVCacheAdapter(max_model_len=1 << 40, **args)
    assert isinstance(info.value, ValueError)
    assert "max_pages_per_seq" not in str(info.value)


def test_a_long_prefill_threshold_past_max_model_len_is_refused_when_the_spec_is_built() -> None:
    """docs/vllm.md: the specs are checked when built, before vLLM sees them, with vLLM's own
    limits; this one reached vLLM as a pydantic ValidationError when the scheduler was built."""
    with pytest.raises(KVMemError, match=r"long_prefill_token_threshold=100.*max_model_len=64"
                       ) as info:
        SchedulerSpec(max_model_len=64, long_prefill_token_threshold=100)
    assert isinstance(info.value, ValueError)
    spec = SchedulerSpec(max_model_len=64, long_prefill_token_threshold=64)  # vLLM's bound
    Driver(spec, kvmem=True)


# -- the docs agree with each other ------------------------------------------------------------


def test_the_readme_says_what_the_scenario_table_says() -> None:
    """The README said one of vLLM's scenarios re-created differs; docs/vllm.md's table (and
    tests/test_vllm_conformance.py) has every one agree."""
    doc = (ROOT / "docs" / "vllm.md").read_text()
    table = doc.split("### vLLM's own scenarios", 1)[1].split("\n\n")[2]
    results = [row.rsplit("|", 2)[1].strip() for row in table.splitlines()[2:]]
    assert len(results) >= 10 and all(r.startswith("agree") for r in results), results
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "scenarios re-created (all agree)" in readme
    assert "one differs" not in readme


# -- benchmarks/bench_vllm_churn.py and bench_vllm_floor.py -------------------------------------


def _benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/NAME.py as a module (the folder on the path: they import each other)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_churn_benchmark_prints_the_documented_keys(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    churn = _benchmark("bench_vllm_churn", monkeypatch)
    assert churn.main(["--requests", "8", "--steps", "3", "--warmup", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("mismatched_steps", "vllm_step_us_median", "kvmem_step_us_median",
                "step_speedup", "vllm_kv_us_median", "kvmem_kv_us_median", "kv_speedup",
                "kvmem_flush_us_median", "verify_paths"):
        assert key in result, key
    assert result["steps"] == 3 and result["mismatched_steps"] == 0


@pytest.mark.parametrize(("script", "argv", "named"), [
    ("bench_vllm_churn", ["--steps", "0"], "--steps"),  # was a StatisticsError after the run
    ("bench_vllm_churn", ["--requests", "0"], "--requests"),  # was the SchedulerSpec's traceback
    ("bench_vllm_churn", ["--requests", "9000"], "--requests"),  # past vLLM's 8192-token step
    ("bench_vllm_churn", ["--warmup", "-1"], "--warmup"),
    ("bench_vllm_floor", ["--decode-steps", "0"], "--decode-steps"),
    ("bench_vllm_floor", ["--requests", "0"], "--requests"),
])
def test_a_bad_vllm_benchmark_option_is_one_line_and_status_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], script: str,
        argv: list[str], named: str) -> None:
    # (not "benchmark": that name is pytest-benchmark's fixture where the plugin is installed)
    assert _benchmark(script, monkeypatch).main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and named in err


def test_the_floor_benchmark_prints_the_documented_keys_and_its_bound(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    floor = _benchmark("bench_vllm_floor", monkeypatch)
    assert floor.main(["--requests", "8", "--decode-steps", "20"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["batch"] == 8 and r["decode_steps"] == 20 and r["mismatched_steps"] == 0
    assert 0 < r["kvmem_flush_us"] < r["kvmem_kv_us"]
    assert 0 < r["kvmem_per_request_us"] < r["kvmem_kv_us"]  # (a median of the differences)
    assert r["kv_speedup_bound"] == pytest.approx(
        r["vllm_kv_us"] / (r["floor_step_us"] + r["kvmem_per_request_us"]), rel=0.01)
    assert r["floor_step_us"] > 0 and r["floor_step_warm_us"] > 0
