"""Promises of docs/capacity_planning.md, docs/errors.md and the planning and simulation
docstrings, checked by an adversary: each test here failed before the fix it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# -- kvmem plan: "a setting that would be ignored is refused rather than dropped" -----------------


@pytest.mark.parametrize("policy", [["--reserve-gib", "2"], ["--mem-fraction", "0.8"]])
def test_runtime_overhead_with_another_reserve_is_refused_not_ignored(
    capsys: pytest.CaptureFixture[str], policy: list[str]
) -> None:
    """--runtime-overhead-gib applies to the SGLang-like policy only; with --reserve-gib or
    --mem-fraction it used to be dropped without a word."""
    status, out, err = run(capsys, "plan", "llama-3.1-8b", *policy, "--runtime-overhead-gib", "4")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "--runtime-overhead-gib" in err and policy[0] in err


def test_runtime_overhead_alone_still_shrinks_the_sglang_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "plan", "llama-3.1-8b", "--json")
    base = json.loads(out)
    status, out, _ = run(capsys, "plan", "llama-3.1-8b", "--runtime-overhead-gib", "4", "--json")
    assert status == 0
    less = json.loads(out)
    assert less["kv_budget_gib_per_gpu"] == pytest.approx(base["kv_budget_gib_per_gpu"] - 4)


# -- kvmem plan --plot: refused before any work ------------------------------------------------


def test_plot_with_a_format_matplotlib_cannot_write_is_refused_before_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table used to be printed first, then the error (status 2 after the work)."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "conc.txt"
    status, out, err = run(capsys, "plan", "llama-3.1-8b", "--plot", str(target))
    assert status == 2 and out == "", out
    assert err.count("\n") == 1 and ".txt" in err and "png" in err
    assert not target.exists()


def test_plot_with_an_empty_file_name_is_refused_not_ignored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--plot ''` used to print the table, plot nothing and exit 0."""
    status, out, err = run(capsys, "plan", "llama-3.1-8b", "--plot", "")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "--plot" in err


def test_plot_without_matplotlib_is_refused_before_the_table(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # not installed\n"
        "from kvmem.cli import main\n"
        f"raise SystemExit(main(['plan', 'llama-3.1-8b', '--plot', {str(tmp_path / 'c.png')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "pip install" in proc.stderr, proc.stderr


# -- no traceback, no OverflowError/ZeroDivisionError: numbers beyond a float are refused --------


@pytest.mark.parametrize(
    ("option", "named"),
    [("--gpu-memory-gib", "memory_mib"), ("--gpu-bandwidth-gbs", "bandwidth_gbs")],
)
def test_plan_with_an_absurd_custom_gpu_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], option: str, named: str
) -> None:
    """`--gpu-memory-gib 1e300` raised OverflowError and `--gpu-bandwidth-gbs 1e300` (with a
    decode bound) ZeroDivisionError: tracebacks, status 1."""
    argv = ["plan", "llama-3.1-8b", "--gpu", "custom", "--gpu-memory-gib", "96",
            "--gpu-bandwidth-gbs", "4000", "--context", "100", "--concurrency", "2"]
    argv[argv.index(option) + 1] = "1e300"
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_gpu_spec_bounds_keep_plans_finite() -> None:
    from kvmem.errors import ConfigError
    from kvmem.planning import GPUSpec, plan_capacity

    with pytest.raises(ConfigError, match="memory_mib"):
        GPUSpec(name="g", memory_mib=10**300, bandwidth_gbs=1000)
    with pytest.raises(ConfigError, match="bandwidth_gbs"):
        GPUSpec(name="g", memory_mib=1024, bandwidth_gbs=1e300)
    biggest = GPUSpec(name="g", memory_mib=1 << 33, bandwidth_gbs=1e9)
    plan = plan_capacity("llama-3.1-8b", biggest, context_len=1, concurrency=1 << 40)
    assert plan.decode_tokens_per_s_bound is not None and plan.decode_tokens_per_s_bound > 0
    assert plan.kv_tokens_per_gpu > 0


@pytest.mark.parametrize(
    "call",
    [
        "plan_capacity('llama-3.1-8b', 'h200', context_len=10**200, concurrency=10**200)",
        "plan_capacity('llama-3.1-8b', 'h200', context_len=10**400, concurrency=1)",
        "decode_bytes_per_step(plan, 1, 10**400)",
        "fit_throughput(plan, [(10**300, 1000.0), (8, 100.0)], context_len=100)",
        "fit_throughput(plan, [(10**400, 1000.0), (8, 100.0)], context_len=100)",
        "fit_throughput(plan, [(1, 137.0), (8, 731.0)], context_len=10**300)",
        "fit_throughput(plan, [(1, 1e-308), (8, 1e-308)], context_len=100)",
    ],
)
def test_counts_beyond_a_float_are_a_config_error(call: str) -> None:
    """These raised OverflowError (not a kvmem error) or, for tiny tokens/s, a ConfigError that
    blamed a NaN field of ThroughputModel."""
    from kvmem.errors import ConfigError
    from kvmem.planning import decode_bytes_per_step, fit_throughput, plan_capacity

    plan = plan_capacity("kimi-k2.6", "h200", 8)
    names = {"plan": plan, "plan_capacity": plan_capacity,
             "decode_bytes_per_step": decode_bytes_per_step, "fit_throughput": fit_throughput}
    with pytest.raises(ConfigError) as info:
        eval(call, names)
    assert "nan" not in str(info.value)


def test_expected_active_experts_refuses_a_negative_batch_and_saturates() -> None:
    """A batch of -5 tokens used to be 0 active experts; 10**400 tokens raised OverflowError."""
    from kvmem.errors import ArgumentError
    from kvmem.planning import expected_active_experts

    with pytest.raises(ArgumentError, match="num_tokens=-5"):
        expected_active_experts(384, 8, -5)
    assert expected_active_experts(384, 8, 0) == 0
    assert expected_active_experts(384, 8, 10**400) == 384


# -- kvmem.simulate: lengths are token counts, the clock stays finite, ~200 samples -------------


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


_HANGS = """
import sys
from kvmem.errors import ConfigError
from kvmem.planning import ThroughputModel, plan_capacity
from kvmem.simulate import LengthDist, Workload, simulate

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


# -- load_hf_config: counts are integers, "refused, not truncated" (docs/errors.md) -------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", 32.5), ("num_key_value_heads", True), ("hidden_size", "4096"),
     ("intermediate_size", 14336.7), ("tie_word_embeddings", "false"),
     ("tie_word_embeddings", 1)],
)
def test_an_hf_count_that_is_no_integer_is_refused_not_truncated(
    tmp_path: Path, field: str, value: object
) -> None:
    """32.5 layers used to plan as 32, True KV heads as 1, "4096" as 4096; a tie_word_embeddings
    of "false" as tied (bool("false") is True)."""
    from kvmem.errors import ConfigError
    from kvmem.planning import load_hf_config

    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256}
    assert load_hf_config_ok(tmp_path, cfg).num_layers == 32
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        load_hf_config(tmp_path)


def load_hf_config_ok(folder: Path, cfg: dict[str, object]) -> object:
    from kvmem.planning import load_hf_config

    (folder / "config.json").write_text(json.dumps(cfg))
    return load_hf_config(folder)


def test_a_page_larger_than_the_budget_names_the_page_size() -> None:
    """The message said "leaves 112.39 GiB, not even one KV page" and advised more GPUs, not
    naming the page, which was the cause."""
    from kvmem.errors import ConfigError
    from kvmem.planning import plan_capacity

    with pytest.raises(ConfigError, match="page_size") as info:
        plan_capacity("llama-3.1-8b", "h200", page_size=10**9)
    assert "1000000000 tokens" in str(info.value)
