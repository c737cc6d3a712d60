"""The simulator: workloads, timelines and the simulate command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from adversarial import (  # the shared menagerie of bad arguments
    BAD,
    SETTINGS,
    contracted,
    is_not_integer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_fixtures import TINY_VOCAB  # noqa: F401 (fixtures)

from kvmem.cli import main
from kvmem.cli import main as cli_main
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    KVMemError,
)
from kvmem.planning import (
    FixedReserve,
    GPUSpec,
    plan_capacity,
)
from kvmem.simulate import Arrivals, LengthDist, Workload, simulate

GIB = 1 << 30


CLI_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


SIMULATE_NUMERIC = ["--tp", "--page-size", "--requests", "--concurrency", "--rate", "--prefixes",
                    "--prefix-len", "--prefix-fraction", "--max-running", "--chunk",
                    "--prefill-tps", "--t0-ms", "--efficiency", "--seed", "--offload-gib",
                    "--offload-gbs"]


SMALL_SIM = ["simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp", "1", "--requests", "3",
             "--prompt-len", "10", "--output-len", "5", "--no-progress"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (status, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


_HANGS = """
import sys
from kvmem.errors import ConfigError
from kvmem.planning import ThroughputModel, plan_capacity
from kvmem.simulate import Arrivals, LengthDist, Workload, simulate

plan = plan_capacity("llama-3.1-8b", "h100-80g", 1)
lengths = dict(prompt_len=LengthDist.parse("100-200"), output_len=LengthDist.parse("1000-2000"))
cases = [
    (Workload(num_requests=5, concurrency=4, **lengths),
     ThroughputModel(t0_s=1e305, efficiency=1, context_len=1)),
    (Workload(num_requests=5, concurrency=4, **lengths),
     ThroughputModel(t0_s=0, efficiency=1e-320, context_len=1)),
    (Workload(num_requests=50, rate=5e-324, **lengths), None),
]
for workload, step_model in cases:
    try:
        simulate(workload, plan, step_model=step_model)
    except ConfigError as exc:
        assert "float" in str(exc), exc
    else:
        sys.exit("no error")
"""


def tiny_plan(memory_mib: int = 1024, page_size: int = 16):  # type: ignore[no-untyped-def]
    """SmolLM2-135M on a small custom GPU: 23,040 B per token, a few thousand tokens of KV."""
    gpu = GPUSpec(name="tiny", memory_mib=memory_mib, bandwidth_gbs=1000)
    return plan_capacity(
        "smollm2-135m", gpu, 1, policy=FixedReserve(reserve_gib=0.5), page_size=page_size
    )


@SETTINGS
@given(bad=BAD, field=st.sampled_from(["num_requests", "concurrency", "num_prefixes",
                                       "prefix_len", "prefix_fraction", "namespaces", "seed"]))
def test_workload_fields(bad: Any, field: str) -> None:
    from kvmem.simulate import LengthDist, Workload

    fields: dict[str, Any] = {
        "num_requests": 4, "concurrency": 2, "prompt_len": LengthDist.parse("8-16"),
        "output_len": LengthDist.parse("4"), "num_prefixes": 1, "prefix_len": 4,
        "prefix_fraction": 0.5, "namespaces": 1, "seed": 3,
    }
    Workload(**fields)
    exc = contracted(lambda: Workload(**{**fields, field: bad}))
    if field != "prefix_fraction" and is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and field in str(exc)
    contracted(lambda: LengthDist.parse(bad))
    contracted(lambda: LengthDist(kind="uniform", a=bad, b=10))


def test_simulate_arguments() -> None:
    from kvmem.planning import GPUSpec
    from kvmem.simulate import LengthDist, Workload, simulate

    plan = plan_capacity("smollm2-135m", GPUSpec(name="t", memory_mib=1024, bandwidth_gbs=1000),
                         1, policy=FixedReserve(reserve_gib=0.5))
    w = Workload(num_requests=3, concurrency=2, prompt_len=LengthDist.parse("8"),
                 output_len=LengthDist.parse("4"))
    assert simulate(w, plan).num_completed == 3
    for kwargs in ({"chunk": 0}, {"chunk": 1.5}, {"max_running": True},
                   {"prefill_tokens_per_s": 0}, {"prefill_tokens_per_s": float("nan")},
                   {"sample_every": -1.0}, {"prefix_cache": 1}, {"progress": 3}):
        with pytest.raises((ArgumentError, ArgumentTypeError)):
            simulate(w, plan, **kwargs)
    with pytest.raises(ArgumentTypeError):
        simulate({"num_requests": 3}, plan)  # type: ignore[arg-type]


@CLI_SETTINGS
@given(option=st.sampled_from(SIMULATE_NUMERIC),
       value=st.sampled_from(["-1", "-0.5", "abc", "nan", "inf", "", "1e999", "--", "0x10"]))
def test_cli_simulate_refuses_bad_numbers(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    status = cli_main(["simulate", "llama-3.1-8b", f"{option}={value}"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1, (option, value, err)
    assert option in err


@pytest.mark.parametrize("text", ["1.5", "1e3", "2.5-9", "0", "5-2", "lognormal:100"])
def test_a_length_that_is_no_token_count_is_refused(text: str) -> None:
    from kvmem import ConfigError
    from kvmem.simulate import LengthDist

    with pytest.raises(ConfigError, match="cannot read the length"):
        LengthDist.parse(text)


def test_workload_prefix_settings_without_prefixes_are_refused() -> None:
    from kvmem import ConfigError
    from kvmem.simulate import LengthDist, Workload

    lengths = dict(prompt_len=LengthDist.parse("10"), output_len=LengthDist.parse("5"))
    for extra in ({"prefix_len": 100}, {"prefix_fraction": 0.5}):
        with pytest.raises(ConfigError, match="num_prefixes"):
            Workload(num_requests=3, concurrency=2, **lengths, **extra)
    assert Workload(num_requests=3, concurrency=2, num_prefixes=2, prefix_len=8,
                    prefix_fraction=0.5, **lengths).prefix_len == 8


def test_prompts_keep_to_max_len() -> None:
    """prompts(max_len=3) drew the stem's head whole: prompts of up to 12 tokens."""
    from hypothesis import given, settings

    from kvmem.testing import prompts

    @settings(max_examples=200, database=None)
    @given(prompts(max_len=3))
    def short(prompt: list[int]) -> None:
        assert 1 <= len(prompt) <= 3, prompt

    @settings(max_examples=1, database=None)
    @given(prompts(max_len=0))
    def empty(prompt: list[int]) -> None:
        pass

    short()
    with pytest.raises(ArgumentError, match="max_len"):
        empty()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--requests", "99999999999999999999", "num_requests"),  # was numpy's ValueError
        ("--chunk", "99999999999999999999", "chunk"),  # was an OverflowError
        ("--prefixes", "99999999999999999999", "num_prefixes"),  # numpy's ValueError
        ("--prefix-len", "99999999999999999999", "prefix_len"),  # an OverflowError
    ],
)
def test_simulate_refuses_counts_beyond_its_arrays_in_one_line(
    capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    extra = {"--prefixes": ["--prefix-len", "5"], "--prefix-len": ["--prefixes", "1"]}
    err = _one_line_error(capsys, [*SMALL_SIM, option, value, *extra.get(option, [])])
    assert err.startswith("kvmem simulate: error:") and message in err


def test_workload_refuses_more_requests_than_token_ids_can_name() -> None:
    # Request i's first token id is 100_000 + i, and token ids are int32.
    with pytest.raises(KVMemError, match="num_requests"):
        Workload(num_requests=2**31, concurrency=1, prompt_len=LengthDist.parse("10"),
                 output_len=LengthDist.parse("5"))


def test_a_slow_prefill_keeps_the_timeline_at_about_200_samples() -> None:
    # simulate()'s default sampling is "about 200 samples over the expected run"; it ignored
    # the prefill time, so a slow --prefill-tps ran for minutes appending millions of samples.
    w = Workload(num_requests=3, concurrency=3, prompt_len=LengthDist.parse("10"),
                 output_len=LengthDist.parse("5"))
    report = simulate(w, model="llama-3.1-8b", gpu="h100-80g", tp=1, prefill_tokens_per_s=0.3)
    assert report.simulated_seconds > 99  # 30 prompt tokens at 0.3 tokens/s
    assert 100 <= len(report.timeline) <= 400


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"kind": "fixed", "a": 5_000_000}, "a=5000000"),  # was silently clipped to 1,048,576
        ({"kind": "uniform", "a": 10, "b": 2_000_000}, "b=2000000"),
        ({"kind": "fixed", "a": 2.5}, "a=2.5"),  # was silently truncated to 2
        ({"kind": "uniform", "a": 2, "b": 3.7}, "b=3.7"),
        ({"kind": "fixed", "a": 2, "b": 7}, "b=7"),  # b was ignored
    ],
)
def test_a_length_that_is_no_token_count_is_refused_not_clipped(
    kwargs: dict[str, object], named: str
) -> None:
    from kvmem.errors import ConfigError
    from kvmem.simulate import LengthDist

    with pytest.raises(ConfigError, match=named):
        LengthDist(**kwargs)


def test_cli_prompt_longer_than_max_len_is_refused_not_clipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--prompt-len 10000000` used to run (or fail to fit) as 1,048,576-token prompts."""
    status, out, err = run(capsys, "simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp", "1",
                           "--requests", "2", "--prompt-len", "10000000", "--no-progress")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "10000000" in err and "1,048,576" in err
    assert "1048576 prompt" not in err


def test_lengths_at_max_len_and_lognormal_bounds_still_work() -> None:
    import numpy as np

    from kvmem.simulate import LengthDist

    rng = np.random.default_rng(0)
    assert LengthDist.parse("1048576").sample(rng, 2).tolist() == [1 << 20, 1 << 20]
    assert LengthDist(kind="fixed", a=2.0).sample(rng, 1).tolist() == [2]
    wide = LengthDist(kind="lognormal", a=2, b=1000)  # high() raised OverflowError
    assert wide.high() == wide.max_len
    assert LengthDist(kind="lognormal", a=1000, b=0.6).high() == pytest.approx(1000 * np.exp(3))


def test_a_simulated_clock_past_a_float_is_a_config_error_not_a_hang() -> None:
    """An absurd step model or arrival rate made simulated time inf, and the timeline's
    sampling loop (`while next_sample <= inf`) never ended."""
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", _HANGS],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("workload", "max_running"),
    [({"num_requests": 200, "concurrency": 64}, 1), ({"num_requests": 3, "concurrency": 64}, 256)],
)
def test_the_default_timeline_has_about_200_samples(
    workload: dict[str, int], max_running: int
) -> None:
    """simulate(sample_every=None) promises "about 200 samples"; with max_running=1 (the
    estimate assumed all 64 clients run at once) it took about 12,800."""
    from kvmem.planning import plan_capacity
    from kvmem.simulate import LengthDist, Workload, simulate

    w = Workload(prompt_len=LengthDist.parse("100-200"), output_len=LengthDist.parse("10-20"),
                 **workload)
    report = simulate(w, plan_capacity("llama-3.1-8b", "h100-80g", 1), max_running=max_running)
    assert 100 <= len(report.timeline) <= 400, len(report.timeline)


def test_report_shape_bf16_queues_fp8_holds_all_64() -> None:
    """64 clients of 11-20K-token requests on Kimi K2.6, 8 x H200, TP 8 (the report's setup)."""
    workload = Workload(
        num_requests=128,
        concurrency=64,
        prompt_len=LengthDist.parse("10000-18000"),
        output_len=LengthDist.parse("1000-2000"),
    )
    bf16 = simulate(workload, plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="bf16"), chunk=32)
    fp8 = simulate(workload, plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3"), chunk=32)
    for r in (bf16, fp8):
        assert r.num_completed == 128
    # BF16: 653K tokens cannot hold 64 requests of up to 20K: it queues or preempts.
    assert bf16.max_running < 64
    assert bf16.num_queued > 0 or bf16.num_preemptions > 0
    assert bf16.queue_delay_max_s > 1.0
    # FP8: 1.31M tokens hold all 64 at once; nobody waits, nothing is preempted.
    assert fp8.max_running == 64 and fp8.p50_running == 64
    assert fp8.num_queued == 0 and fp8.num_preemptions == 0
    assert fp8.queue_delay_max_s == 0.0
    assert fp8.output_tokens_per_s > bf16.output_tokens_per_s


def test_growth_past_the_pool_preempts_and_resumes() -> None:
    plan = tiny_plan()
    assert 500 < plan.kv_pages_per_gpu < 2000
    workload = Workload(
        num_requests=16,
        concurrency=8,
        prompt_len=LengthDist(kind="fixed", a=1000),
        output_len=LengthDist(kind="fixed", a=2000),
    )
    r = simulate(workload, plan, chunk=16)
    assert r.num_completed == 16
    assert r.num_preemptions > 0
    assert r.num_resumes == r.num_preemptions
    assert r.recomputed_tokens > 0
    assert r.output_tokens == 16 * 2000
    assert r.peak_page_usage <= 1.0


def test_prefill_rate_charges_admission_and_recomputation() -> None:
    plan = tiny_plan()
    workload = Workload(
        num_requests=10,
        concurrency=4,
        prompt_len=LengthDist(kind="fixed", a=1000),
        output_len=LengthDist(kind="fixed", a=500),
    )
    free = simulate(workload, plan, chunk=16)
    slow = simulate(workload, plan, chunk=16, prefill_tokens_per_s=1000.0)
    # 10 prompts of 1000 tokens at 1000 tok/s add 10 s (no preemption at this size).
    assert free.num_preemptions == slow.num_preemptions == 0
    extra = slow.simulated_seconds - free.simulated_seconds
    assert extra == pytest.approx(10.0, rel=0.05)


def test_shared_prefixes_hit_the_prefix_cache() -> None:
    plan = plan_capacity("llama-3.1-8b", "h100-80g", 1)
    workload = Workload(
        num_requests=200,
        concurrency=16,
        prompt_len=LengthDist(kind="uniform", a=600, b=800),
        output_len=LengthDist(kind="fixed", a=32),
        num_prefixes=2,
        prefix_len=512,
    )
    hit = simulate(workload, plan)
    # Every request reuses its prefix's 32 full pages, except the first 16, admitted together
    # before any prompt was committed (pages become reusable only once their KV is written).
    arr = Arrivals(workload)
    expected = (200 - 16) * 512 / float(arr.prompt.sum())
    assert hit.prefix_hit_rate == pytest.approx(expected, rel=0.02)
    miss = simulate(workload, plan, prefix_cache=False)
    assert miss.prefix_hit_rate == 0.0
    assert miss.output_tokens == hit.output_tokens == 200 * 32


def test_open_loop_light_load_does_not_queue() -> None:
    plan = plan_capacity("llama-3.1-8b", "h100-80g", 1)
    workload = Workload(
        num_requests=300,
        rate=5.0,
        prompt_len=LengthDist.parse("lognormal:500,0.5"),
        output_len=LengthDist.parse("50-150"),
        seed=3,
    )
    r = simulate(workload, plan)
    assert r.num_completed == 300 and r.num_queued == 0 and r.num_preemptions == 0
    arrivals = Arrivals(workload)
    assert r.output_tokens == int(arrivals.output.sum())
    assert r.simulated_seconds >= float(arrivals.times[-1])
    ts = [p.t for p in r.timeline]
    assert ts == sorted(ts) and len(ts) > 10
    assert all(p.running <= r.max_running for p in r.timeline)
    assert r.queue_delay_max_s < 1.0  # admission waits at most one chunk


def test_progress_callback_reaches_the_total() -> None:
    calls: list[tuple[int, int]] = []
    workload = Workload(
        num_requests=50,
        concurrency=10,
        prompt_len=LengthDist(kind="fixed", a=100),
        output_len=LengthDist(kind="fixed", a=20),
    )
    simulate(workload, tiny_plan(), progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (50, 50)


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match="does not fit in an empty pool"):
        simulate(
            Workload(
                num_requests=2,
                concurrency=1,
                prompt_len=LengthDist(kind="fixed", a=200_000),
                output_len=LengthDist(kind="fixed", a=1),
            ),
            tiny_plan(),
        )
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        Workload(
            num_requests=1,
            prompt_len=LengthDist(kind="fixed", a=1),
            output_len=LengthDist(kind="fixed", a=1),
        )
    with pytest.raises(ConfigError, match="cannot read the length"):
        LengthDist.parse("lots")
    with pytest.raises(ValueError, match="b >= a"):
        LengthDist(kind="uniform", a=10, b=5)
    assert LengthDist.parse("lognormal:1000,0.5").kind == "lognormal"
    lengths = LengthDist.parse("10-20").sample(np.random.default_rng(0), 1000)
    assert lengths.min() >= 10 and lengths.max() <= 20


def test_thousands_of_requests_take_seconds() -> None:
    plan = plan_capacity("llama-3.1-8b", "h100-80g", 1)
    workload = Workload(
        num_requests=3000,
        rate=40.0,
        prompt_len=LengthDist.parse("lognormal:300,0.5"),
        output_len=LengthDist.parse("lognormal:100,0.5"),
    )
    start = time.perf_counter()
    r = simulate(workload, plan)
    assert r.num_completed == 3000
    assert time.perf_counter() - start < 30.0  # about 2 s on one core; guards against O(n^2)


def test_cli_simulate_json_and_compare(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        ["simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp", "1", "--requests", "40",
         "--concurrency", "8", "--prompt-len", "200-400", "--output-len", "20", "--json"]
    )  # fmt: skip
    out, _ = capsys.readouterr()
    assert status == 0
    data = json.loads(out)
    assert data["num_completed"] == 40 and data["output_tokens"] == 800
    assert {"num_preemptions", "prefix_hit_rate", "timeline", "queue_delay_p95_s"} <= set(data)
    status = main(
        ["simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp", "1", "--requests", "20",
         "--rate", "4", "--prompt-len", "100", "--output-len", "10", "--compare",
         "bf16,fp8_e4m3", "--no-progress"]
    )  # fmt: skip
    out, _ = capsys.readouterr()
    assert status == 0 and "KV bf16" in out and "KV fp8_e4m3" in out and "running  |" in out
    status = main(["simulate", "nope"])
    _, err = capsys.readouterr()
    assert status == 2 and "known models" in err


def test_prompt_tokens_are_the_documented_sequence() -> None:
    """Arrivals.tokens reads each prompt from one table; it equals the formula."""
    w = Workload(num_requests=700, concurrency=8, prompt_len=LengthDist.parse("1-300"),
                 output_len=LengthDist.parse("5"), num_prefixes=3, prefix_len=40,
                 prefix_fraction=0.5, seed=3)
    arr = Arrivals(w)
    for i in range(w.num_requests):
        p = int(arr.prefix_id[i])
        head = arr.prefixes[p] if p >= 0 else np.empty(0, dtype=np.int64)
        own = (np.arange(int(arr.prompt[i]) - head.size, dtype=np.int64) * 7919 + i) % 100_000
        own[0] = 100_000 + i
        got = arr.tokens(i)
        assert got.dtype == np.int64 and np.array_equal(got, np.concatenate([head, own]))


def test_a_fixed_seed_gives_the_same_report() -> None:
    """Prefixes, two namespaces, queueing, preemption and eviction on a small pool: the counts
    are pinned (computed before the prefix cache's and simulate's speedups), so an optimization
    that changes what the manager does shows here."""
    gpu = GPUSpec(name="tiny", memory_mib=1024, bandwidth_gbs=1000)
    plan = plan_capacity("smollm2-135m", gpu, 1, policy=FixedReserve(reserve_gib=0.5),
                         page_size=16)
    w = Workload(num_requests=200, concurrency=48, prompt_len=LengthDist.parse("100-1500"),
                 output_len=LengthDist.parse("200-2000"), num_prefixes=3, prefix_len=400,
                 prefix_fraction=0.6, namespaces=2, seed=7)
    r = simulate(w, plan, max_running=48)
    got = (r.num_completed, r.num_queued, r.num_preemptions, r.num_resumes,
           r.recomputed_tokens, r.num_evictions, r.max_running, r.output_tokens)
    assert got == (200, 193, 246, 246, 130154, 29563, 17, 221947)
    assert r.prefix_hit_rate == pytest.approx(0.3296730215944228, rel=1e-12)
    assert r.simulated_seconds == pytest.approx(184.5930648318171, rel=1e-9)


def _returning_prefixes(num_requests: int = 60, concurrency: int = 1) -> Workload:
    """8 prefixes of 1,024 tokens (8,192 tokens of prefixes), more than the tiny plan's device
    pool keeps cached beside the running requests: prefixes leave the device and come back."""
    return Workload(num_requests=num_requests, concurrency=concurrency,
                    prompt_len=LengthDist(kind="uniform", a=1100, b=1400),
                    output_len=LengthDist(kind="fixed", a=16), num_prefixes=8, prefix_len=1024,
                    seed=5)


def test_a_host_tier_serves_the_prefixes_the_device_evicted() -> None:
    """One request at a time: every request after the first of its prefix finds the whole
    prefix on the device or in an unbounded host tier, as on a device that never evicts; the
    report's per-tier figures agree with each other and with the plan's bytes."""
    plan = tiny_plan()
    workload = _returning_prefixes()
    arr = Arrivals(workload)
    without = simulate(workload, plan)
    tier = simulate(workload, plan, offload_gib=64.0)
    huge = simulate(workload, tiny_plan(memory_mib=64 * 1024))
    assert without.offload_gib is None and without.host_hit_rate is None
    assert without.num_evictions > 0 and huge.num_evictions == 0
    assert tier.num_preemptions == without.num_preemptions == huge.num_preemptions == 0
    query = float(arr.prompt.sum())
    firsts = len(set(arr.prefix_id.tolist()))
    expected = (workload.num_requests - firsts) * 1024
    assert huge.prefix_hit_rate * query == pytest.approx(expected)
    assert without.prefix_hit_rate * query < expected  # the device alone lost some
    assert tier.host_hit_rate is not None and tier.host_hit_rate > 0
    assert (tier.prefix_hit_rate + tier.host_hit_rate) * query == pytest.approx(expected)
    assert tier.host_hit_tokens == 16 * tier.host_loaded_pages
    assert tier.host_hit_rate * query == pytest.approx(tier.host_hit_tokens)
    page_bytes = plan.kv_bytes_per_page_per_gpu
    assert tier.host_bytes_loaded_per_gpu == tier.host_loaded_pages * page_bytes
    assert tier.host_bytes_stored_per_gpu == tier.host_stored_pages * page_bytes
    assert 0 < (tier.host_stored_pages or 0) <= tier.num_evictions
    assert tier.host_evictions == 0 and tier.host_load_seconds == 0.0
    assert tier.offload_pages_per_gpu == plan.offload_pages(64.0)
    assert tier.output_tokens == without.output_tokens
    assert "hit rate device" in tier.summary() and "host" in tier.summary()


def test_a_small_host_tier_evicts_and_serves_less() -> None:
    plan = tiny_plan()
    workload = _returning_prefixes()
    small_gib = 10 * plan.kv_bytes_per_page_per_gpu / GIB  # 10 pages: a sixth of a prefix
    small = simulate(workload, plan, offload_gib=small_gib)
    big = simulate(workload, plan, offload_gib=64.0)
    assert small.offload_pages_per_gpu == 10
    assert (small.host_evictions or 0) > 0
    assert 0 < (small.host_hit_tokens or 0) < (big.host_hit_tokens or 0)


def test_host_loads_are_charged_at_the_given_bandwidth() -> None:
    plan = tiny_plan()
    workload = _returning_prefixes()
    free = simulate(workload, plan, prefill_tokens_per_s=5000.0, offload_gib=64.0)
    charged = simulate(workload, plan, prefill_tokens_per_s=5000.0, offload_gib=64.0,
                       offload_gbs=0.5)
    assert charged.host_loaded_pages == free.host_loaded_pages
    load_s = (free.host_loaded_pages or 0) * plan.kv_bytes_per_page_per_gpu / 0.5e9
    assert load_s > 0 and charged.host_load_seconds == pytest.approx(load_s)
    assert charged.simulated_seconds - free.simulated_seconds == pytest.approx(load_s, rel=0.05)
    # the tier saves prefill: fewer tokens prefilled than without it
    without = simulate(workload, plan, prefill_tokens_per_s=5000.0)
    assert free.simulated_seconds < without.simulated_seconds


def test_bad_host_tier_arguments_are_refused() -> None:
    plan, workload = tiny_plan(), _returning_prefixes(num_requests=8)
    with pytest.raises(ConfigError, match="give offload_gib as well"):
        simulate(workload, plan, offload_gbs=10.0)
    with pytest.raises(ConfigError, match="keep the prefix cache"):
        simulate(workload, plan, offload_gib=1.0, prefix_cache=False)
    with pytest.raises(ConfigError, match="holds no page"):
        simulate(workload, plan, offload_gib=1e-6)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ArgumentError, match="offload_gib"):
            simulate(workload, plan, offload_gib=bad)
        with pytest.raises(ArgumentError, match="offload_gbs"):
            simulate(workload, plan, offload_gib=1.0, offload_gbs=bad)
    with pytest.raises(ArgumentTypeError, match="offload_gib"):
        simulate(workload, plan, offload_gib="1")  # type: ignore[arg-type]


def test_cli_simulate_offload_reports_each_tier(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "smollm2-135m", "--gpu", "h100-80g", "--tp", "1", "--requests", "20",
            "--concurrency", "1", "--prompt-len", "300", "--output-len", "4", "--prefixes", "2",
            "--prefix-len", "256", "--no-progress", "--offload-gib", "1"]
    status, out, _ = run(capsys, *argv)
    assert status == 0 and "host tier:" in out and "hit rate device" in out
    status, out, _ = run(capsys, *argv, "--json")
    data = json.loads(out)
    for key in ("offload_gib", "offload_pages_per_gpu", "host_hit_rate", "host_hit_tokens",
                "host_stored_pages", "host_loaded_pages", "host_bytes_stored_per_gpu",
                "host_bytes_loaded_per_gpu", "host_evictions", "host_load_seconds"):
        assert data[key] is not None, key
    assert data["offload_gib"] == 1.0
    status, out, _ = run(capsys, *argv[:-2], "--json")
    assert json.loads(out)["host_hit_rate"] is None
    err = _one_line_error(capsys, [*argv[:-2], "--offload-gbs", "10"])
    assert "offload_gib" in err
    err = _one_line_error(capsys, [*argv, "--no-prefix-cache"])
    assert "prefix cache" in err


# -- KV cache groups ---------------------------------------------------------------------------

from kvmem.allocator import (  # noqa: E402
    FullAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
)
from kvmem.simulate import padded_specs, simulate_groups  # noqa: E402


def _group_workload(**kw: Any) -> Workload:
    args: dict[str, Any] = dict(num_requests=40, concurrency=40,
                                prompt_len=LengthDist(kind="fixed", a=12),
                                output_len=LengthDist(kind="fixed", a=20), seed=3)
    args.update(kw)
    return Workload(**args)


def test_group_simulation_holds_what_a_hand_count_says() -> None:
    """Full attention on 16-token pages of 100 bytes per token, one 10,000-byte state: a
    request of 12 prompt + 20 output tokens holds 2 full pages and 1 state at its end
    (3,200 + 10,000 bytes). 40 clients on a budget that fits every one: all run at once, no
    preemption, 20 steps, and at the peak (32 tokens each) 80 full pages and 40 states."""
    groups = (FullAttentionSpec("full", 16, 100), StateSpec("state", 10_000))
    report = simulate_groups(_group_workload(), groups, 4 << 20)
    assert (report.num_completed, report.decode_steps, report.num_preemptions) == (40, 20, 0)
    assert report.output_tokens == 40 * 20 and report.max_running == 40
    assert report.peak_tokens == 40 * 32
    full, state = report.groups
    assert (full.pages_at_peak, state.pages_at_peak) == (80, 40)
    assert full.bytes_at_peak == 80 * 1600 and state.bytes_at_peak == 40 * 10_000


def test_padded_groups_fit_fewer_requests_and_the_window_releases_pages() -> None:
    """The same groups padded: one page size of 16 * ceil(10,000 / 1,600) = 112 tokens at 100
    bytes (11,200 bytes), so a 12-token request pins 11,200 bytes of attention where kvmem pins
    1,600. On a budget of 20 padded pages, 10 requests run at once padded; kvmem fits more.
    A sliding window of 16 on 16-token pages holds at most 2 pages per request."""
    groups = (FullAttentionSpec("full", 16, 100), StateSpec("state", 10_000),
              SlidingWindowSpec("swa", 16, 16, 100))
    padded = padded_specs(groups)
    assert [(g.page_size, g.page_bytes) for g in padded] == [(112, 11_200), (0, 11_200),
                                                             (112, 11_200)]
    budget = 30 * 11_200
    mine = simulate_groups(_group_workload(), groups, budget)
    theirs = simulate_groups(_group_workload(), groups, budget, layout="padded")
    assert theirs.max_running == 10 and mine.max_running > 10
    assert mine.tokens_per_step > theirs.tokens_per_step
    assert mine.num_completed == theirs.num_completed == 40
    swa = mine.groups[2]
    assert swa.max_pages <= 2 * mine.max_running


def test_group_simulation_refuses_bad_input() -> None:
    groups = (FullAttentionSpec("full", 16, 100),)
    with pytest.raises(ConfigError, match="does not fit the budget"):
        # one chunk of 4 pages; a request grows to 92 tokens, 6 pages, alone
        simulate_groups(_group_workload(output_len=LengthDist(kind="fixed", a=80)), groups,
                        4 * 1600)
    with pytest.raises(ConfigError, match="closed loop"):
        simulate_groups(_group_workload(concurrency=None, rate=1.0), groups, 1 << 20)
    with pytest.raises(ArgumentError, match="budget_bytes=-5"):
        simulate_groups(_group_workload(), groups, -5)
    with pytest.raises(ConfigError, match="layout="):
        simulate_groups(_group_workload(), groups, 1 << 20, layout="vllm")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="expected a Workload"):
        simulate_groups({"num_requests": 4}, groups, 1 << 20)  # type: ignore[arg-type]


def test_simulate_groups_cli_json_has_both_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["simulate", "qwen3-next-80b-a3b", "--tp", "2", "--groups",
                   "--padded-compare", "--requests", "300", "--concurrency", "300",
                   "--max-running", "300", "--prompt-len", "12", "--output-len", "4",
                   "--json"])
    out, _ = capsys.readouterr()
    assert status == 0
    result = json.loads(out)
    assert {"model", "kv_dtype", "tp", "kvmem", "padded"} == set(result)
    assert [g["name"] for g in result["kvmem"]["groups"]] == ["full", "state"]
    assert [g["name"] for g in result["padded"]["groups"]] == ["full", "state0", "state1",
                                                               "state2"]
    assert result["padded"]["groups"][0]["page_size"] == 544
    for layout in ("kvmem", "padded"):
        assert result[layout]["num_completed"] == 300


@pytest.mark.parametrize(("argv", "words"), [
    (["simulate", "qwen4-next", "--groups"], "unknown model 'qwen4-next'"),
    (["simulate", "gpt-oss-120b", "--tp", "1", "--groups", "--rate", "2"], "--rate"),
    (["simulate", "gpt-oss-120b", "--groups", "--requests", "-1"], "--requests"),
])
def test_simulate_groups_bad_input_is_one_clear_line(
        capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and words in err and "Traceback" not in err
