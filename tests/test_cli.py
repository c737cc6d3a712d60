"""The command line: plan, simulate options, plots, and the benchmarks' options."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.cli import build_parser, main
from kvmem.planning import plan_capacity

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


REQUIRED_KEYS = {
    "kv_bytes_per_token_per_gpu",
    "kv_tokens_per_gpu",
    "kv_pages_per_gpu",
    "weights_gib_per_gpu",
    "weights_gib_total",
    "kv_budget_gib_per_gpu",
    "max_concurrency",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize(("script", "argv", "named"), [
    ("ab_manager.py", ["--batch", "0"], "--batch"),
    ("bench_allocator.py", ["--steps", "0"], "--steps"),
    ("bench_engine.py", ["--steps", "0"], "--steps"),
    ("bench_floor.py", ["--batch", "x"], "--batch"),
    ("bench_fp8.py", ["--repeat", "0"], "--repeat"),
    ("bench_fuzz.py", ["--moves", "0"], "--moves"),
    ("bench_fuzz_lockstep.py", ["--slices", "-1"], "--slices"),
    ("bench_manager.py", ["--seed", "-1"], "--seed"),
    ("bench_offload.py", ["--parts", "roundtrip,nope"], "--parts"),
    ("bench_offload.py", ["--lengths", "1"], "--lengths"),
    ("bench_pool.py", ["--device", "nope"], "--device"),
    ("bench_prompt_hash.py", ["--repeats", "0"], "--repeats"),
    ("bench_hybrid.py", ["--lengths", "12,0"], "--lengths"),
    ("bench_hybrid.py", ["--steps", "0"], "--steps"),
    ("bench_vllm_scheduler.py", ["--decode-steps", "0"], "--decode-steps"),
    ("bench_vllm_floor.py", ["--requests", "0"], "--requests"),
    ("mutation_campaign.py", ["--fuzz-moves", "0"], "--fuzz-moves"),
])
def test_a_bad_benchmark_option_is_one_line_and_status_2(script: str, argv: list[str],
                                                         named: str) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *argv], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in run.stderr, run.stderr


def test_the_offload_benchmarks_idle_part_keeps_the_tier_idle() -> None:
    """bench_offload.py --parts idle (docs/benchmarks.md): both managers ran the trace, the
    tier stored and loaded nothing (the script checks), and the ratios are reported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(BENCHMARKS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "bench_offload.py"), "--parts",
                          "idle", "--steps", "30", "--batch", "16", "--json"], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    idle = result["idle"]
    assert (idle["batch"], idle["steps"]) == (16, 30)
    assert result["idle_tier_step_ratio"] == idle["idle_tier_step_ratio"] > 0
    assert idle["decode_step_us_tier"] > 0 and idle["decode_step_us_no_tier"] > 0
    assert "ttft" not in result and "rows" not in result


def test_the_prompt_hash_benchmark_prints_kvmem_figures_per_length() -> None:
    """bench_prompt_hash.py (docs/benchmarks.md): a row per prompt length with kvmem's medians;
    vLLM's figures and the ratios exactly when vLLM imports (this checkout's kvmem, the
    environment's vLLM if any)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(BENCHMARKS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "bench_prompt_hash.py"),
                          "--repeats", "3"], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    rows = result["lengths"]
    assert [(r["prompt_len"], r["pages"]) for r in rows] == [
        (128, 8), (512, 32), (2048, 128), (4096, 256)]
    with_vllm = result["vllm_hash"] is not None
    for row in rows:
        assert row["kvmem_us"] > 0 and row["kvmem_from_list_us"] > 0, row
        assert ("vllm_us" in row) == ("speedup" in row) == with_vllm, row
        if with_vllm:
            assert row["speedup"] > 0 and row["speedup_from_list"] > 0, row


def test_plan_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "plan", "kimi-k2.6", "--gpu", "h200", "--tp", "8", "--kv-dtype", "fp8_e4m3",
        "--context", "32768", "--json",
    )  # fmt: skip
    assert status == 0
    data = json.loads(out)
    assert set(data) >= REQUIRED_KEYS
    expected = plan_capacity("kimi-k2.6", "h200", 8, kv_dtype="fp8_e4m3", context_len=32768)
    assert data["kv_bytes_per_token_per_gpu"] == 35_136
    assert data["kv_tokens_per_gpu"] == expected.kv_tokens_per_gpu
    assert data["max_concurrency"] == expected.max_concurrency


def test_plan_table_and_compare(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "plan", "kimi-k2.6", "--tp", "8", "--compare", "bf16,fp8_e4m3", "--context",
        "16384", "--concurrency", "64",
    )  # fmt: skip
    assert status == 0
    assert "70,272" in out and "35,136" in out
    assert "max concurrency @ 16,384 tok" in out and "decode tok/s bound @ 64" in out
    header = next(line for line in out.splitlines() if line.startswith("KV dtype"))
    assert "bf16" in header and "fp8_e4m3" in header


def test_plan_offload_gib_gives_host_tier_tokens_in_the_table_and_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "plan", "kimi-k2.6", "--tp", "8", "--compare", "bf16,fp8_e4m3",
                         "--offload-gib", "1024", "--dp", "2")
    assert status == 0
    expected = [plan_capacity("kimi-k2.6", "h200", 8, dp=2, kv_dtype=d, offload_gib=1024)
                for d in ("bf16", "fp8_e4m3")]
    tokens = next(line for line in out.splitlines() if line.startswith("host tier tokens / "))
    assert tokens.split()[-2:] == [f"{p.offload_tokens:,}" for p in expected]
    assert "host tier pages / GPU (1024 GiB / replica)" in out
    assert "host tier tokens, all replicas" in out
    status, out, _ = run(capsys, "plan", "kimi-k2.6", "--tp", "8", "--offload-gib", "1024",
                         "--json")
    data = json.loads(out)
    assert data["offload_gib"] == 1024
    assert data["offload_tokens"] == expected[0].offload_tokens
    assert data["offload_pages_per_gpu"] == expected[0].offload_pages_per_gpu
    status, out, _ = run(capsys, "plan", "kimi-k2.6", "--tp", "8", "--json")
    assert json.loads(out)["offload_tokens"] is None
    status, out, err = run(capsys, "plan", "llama-3.1-8b", "--offload-gib", "0.001")
    assert status == 2 and out == "" and "holds no KV page" in err


def test_plan_compare_json_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "plan", "glm-5.2", "--tp", "8", "--weights", "int4-g32", "--compare",
        "bf16,fp8_e4m3", "--json",
    )  # fmt: skip
    assert status == 0
    data = json.loads(out)
    assert [p["kv_dtype"] for p in data["compare"]] == ["bf16", "fp8_e4m3"]
    assert data["compare"][0]["weights"] == "routed_experts=int4-g32, rest=bf16"


def test_plan_with_hf_config_and_custom_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    status, out, _ = run(
        capsys, "plan", str(tmp_path), "--gpu", "custom", "--gpu-memory-gib", "16",
        "--gpu-bandwidth-gbs", "500", "--reserve-gib", "2", "--json",
    )  # fmt: skip
    assert status == 0
    data = json.loads(out)
    assert data["kv_bytes_per_token_per_gpu"] == 4 * 2 * 2 * 64 * 2
    assert data["gpu_memory_gib"] == 16
    assert data["policy"] == "fixed reserve 2 GiB"


def test_bad_input_exits_non_zero_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "plan", "kimi-k9")
    assert status == 2 and "known models: kimi-k2.6" in err and err.count("\n") == 1
    status, _, err = run(capsys, "plan", "llama-3.1-8b", "--gpu", "tpu")
    assert status == 2 and "known GPUs: h100-80g" in err
    status, _, err = run(capsys, "plan", "llama-3.1-70b", "--gpu", "l40s")
    assert status == 2 and "need 131.4 GiB per GPU" in err
    status, _, err = run(capsys, "plan", "smollm2-135m", "--tp", "2")
    assert status == 2 and "does not divide the 9 attention heads" in err
    status, _, err = run(capsys, "plan", "llama-3.1-8b", "--gpu", "custom")
    assert status == 2 and "--gpu-memory-gib" in err
    status, _, err = run(capsys, "plan", "llama-3.1-8b", "--mem-fraction", "1.5")
    assert status == 2 and "fraction" in err


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "plan", "--list")
    assert status == 0 and "glm-5.2" in out and "mi300x" in out


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "conc.png"
    status, out, _ = run(
        capsys, "plan", "kimi-k2.6", "--tp", "8", "--compare", "bf16,fp8_e4m3", "--plot",
        str(target),
    )  # fmt: skip
    assert status == 0 and "wrote" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_draws_the_plans_the_table_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot uses every planning flag (here --use-mtp: the MTP layer's weights leave less
    memory for KV)."""
    pytest.importorskip("matplotlib")
    import kvmem.cli._plan as cli
    from kvmem.planning import plan_capacity

    drawn: dict[str, list[int]] = {}
    plot = cli._plot
    monkeypatch.setattr(cli, "_plot", lambda plans, path: drawn.update(plot(plans, path)))
    status, _, _ = run(
        capsys, "plan", "deepseek-v3", "--gpu", "h200", "--tp", "8", "--use-mtp", "--plot",
        str(tmp_path / "c.png"),
    )  # fmt: skip
    assert status == 0 and sorted(drawn) == ["bf16", "fp8_e4m3"]
    for dtype in drawn:
        want = plan_capacity("deepseek-v3", "h200", 8, kv_dtype=dtype, use_mtp=True)
        without = plan_capacity("deepseek-v3", "h200", 8, kv_dtype=dtype)
        assert want.weights_gib_per_gpu > without.weights_gib_per_gpu
        assert drawn[dtype][0] == want.concurrency_at(1024) != without.concurrency_at(1024)


def test_module_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "plan", "llama-3.1-8b", "--json"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_bytes_per_token_per_gpu"] == 32 * 2 * 8 * 128 * 2


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import kvmem

    status = main(["--version"])
    out, _ = capsys.readouterr()
    assert status == 0 and out.strip() == f"kvmem {kvmem.__version__}"


def test_every_option_of_every_subcommand_has_help() -> None:
    subs = _subparsers()
    assert set(subs) == {"plan", "simulate", "fuzz"}
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["simulate", "--prefill-tps", "0"], "--prefill-tps"),
        (["simulate", "--prefill-tps", "nan"], "--prefill-tps"),
        (["simulate", "--concurrency", "0"], "--concurrency"),
        (["simulate", "--rate", "-1"], "--rate"),
        (["simulate", "--requests", "1.5"], "--requests"),
        (["simulate", "--max-running", "0"], "--max-running"),
        (["simulate", "--chunk", "0"], "--chunk"),
        (["simulate", "--prefixes", "-1"], "--prefixes"),
        (["simulate", "--prefix-len", "-3"], "--prefix-len"),
        (["simulate", "--prefix-fraction", "1.5"], "--prefix-fraction"),
        (["simulate", "--t0-ms", "-1"], "--t0-ms"),
        (["simulate", "--efficiency", "0"], "--efficiency"),
        (["simulate", "--efficiency", "inf"], "--efficiency"),
        (["simulate", "--seed", "-1"], "--seed"),
        (["simulate", "--tp", "0"], "--tp"),
        (["simulate", "--page-size", "0"], "--page-size"),
        (["simulate", "--kv-dtype", "fp9"], "--kv-dtype"),
        (["simulate", "--compare", "bf16,fp9"], "--compare"),
        (["plan", "llama-3.1-8b", "--tp", "0"], "--tp"),
        (["plan", "llama-3.1-8b", "--dp", "two"], "--dp"),
        (["plan", "llama-3.1-8b", "--context", "0"], "--context"),
        (["plan", "llama-3.1-8b", "--concurrency", "0"], "--concurrency"),
        (["plan", "llama-3.1-8b", "--page-size", "-16"], "--page-size"),
        (["plan", "llama-3.1-8b", "--gpu-memory-gib", "0"], "--gpu-memory-gib"),
        (["plan", "llama-3.1-8b", "--gpu-bandwidth-gbs", "-1"], "--gpu-bandwidth-gbs"),
        (["plan", "llama-3.1-8b", "--reserve-gib", "-1"], "--reserve-gib"),
        (["plan", "llama-3.1-8b", "--mem-fraction", "0"], "--mem-fraction"),
        (["plan", "llama-3.1-8b", "--runtime-overhead-gib", "-2"], "--runtime-overhead-gib"),
        (["plan", "llama-3.1-8b", "--kv-scales", "row"], "--kv-scales"),
        (["plan", "llama-3.1-8b", "--compare", "bf16,bf16"], "twice"),
        (["simulate", "kimi-k2.6", "--compare", "fp8_e4m3,bf16,fp8_e4m3"], "twice"),
    ],
)
def test_bad_numbers_are_one_line_errors_before_any_work(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every numeric option is checked by the parser: exit status 2, one line naming the
    option and the value, no traceback, and nothing simulated or planned."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and names in err and "Traceback" not in err, err


def test_kv_scales_with_bf16_is_refused_not_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "plan", "llama-3.1-8b", "--kv-scales", "head")
    assert status == 2 and "fp8 KV only" in err and err.count("\n") == 1
    # With an fp8 column the scales apply to it (and only to it).
    status, out, _ = run(
        capsys, "plan", "llama-3.1-8b", "--compare", "bf16,fp8_e4m3", "--kv-scales", "head",
        "--json",
    )  # fmt: skip
    assert status == 0
    layouts = [p["kv_scale_layout"] for p in json.loads(out)["compare"]]
    assert layouts == [None, "head"]


def test_plot_into_a_missing_folder_is_refused_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "folder" / "c.png"
    status, out, err = run(capsys, "plan", "kimi-k2.6", "--tp", "8", "--plot", str(target))
    assert status == 2 and out == "" and "does not exist" in err and err.count("\n") == 1
    assert not target.parent.exists()


def test_plan_never_imports_torch_or_the_manager() -> None:
    """`kvmem plan` on an int4 model, with torch made unimportable: planning is pure."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "from kvmem.cli import main\n"
        "status = main(['plan', 'glm-5.2', '--tp', '8', '--weights', 'int4-g32', '--json'])\n"
        "assert status == 0, status\n"
        "assert 'kvmem.manager' not in sys.modules and 'kvmem.simulate' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["weights"] == "routed_experts=int4-g32, rest=bf16"


@pytest.mark.parametrize("argv, named", [
    (["plan", "kimi-k2.6", "--tp", "8", "--kv-dtype", "fp8_e5m2", "--compare",
      "bf16,fp8_e4m3"], "--kv-dtype fp8_e5m2 and --compare"),
    (["simulate", "llama-3.1-8b", "--kv-dtype", "fp8_e4m3", "--compare", "bf16,fp16"],
     "--kv-dtype fp8_e4m3 and --compare"),
    (["simulate", "llama-3.1-8b", "--prefix-len", "100"], "--prefixes"),
    (["simulate", "llama-3.1-8b", "--prefix-fraction", "0.5"], "--prefixes"),
])
def test_cli_refuses_a_setting_it_would_ignore(capsys: pytest.CaptureFixture[str],
                                               argv: list[str], named: str) -> None:
    from kvmem.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and named in err


def test_cli_kv_dtype_alone_still_picks_the_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvmem.cli import main

    assert main(["plan", "kimi-k2.6", "--tp", "8", "--kv-dtype", "fp8_e4m3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_dtype"] == "fp8_e4m3"
    assert main(["plan", "kimi-k2.6", "--tp", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_dtype"] == "bf16"


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`kvmem simulate ... --json | head`: the CLI promises one line or none on stderr, never
    a traceback."""
    import subprocess
    import sys

    code = "import sys; from kvmem.cli import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp",
         "1", "--requests", "400", "--prompt-len", "64", "--output-len", "400", "--json",
         "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and proc.returncode in (0, 141)


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


def test_plan_groups_prints_each_group_and_the_padded_layout(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "plan", "qwen3-next-80b-a3b", "--tp", "2", "--context", "12",
                         "--padded-compare")
    assert status == 0
    lines = out.splitlines()
    assert any(line.split()[:3] == ["kvmem", "state", "state"] for line in lines)
    assert sum(line.startswith("padded  state") for line in lines) == 3
    assert "544-token pages" in out and "tokens per GiB" in out
    status, out, _ = run(capsys, "plan", "qwen3-next-80b-a3b", "--tp", "2", "--groups")
    assert status == 0 and "padded" not in out and "requests of 4,096 tokens" in out


def test_plan_groups_json_has_every_group_of_both_layouts(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "plan", "glm-5.2", "--tp", "8", "--kv-dtype", "fp8_e4m3",
                         "--context", "1000", "--padded-compare", "--json")
    assert status == 0
    result = json.loads(out)
    assert REQUIRED_KEYS - {"max_concurrency"} <= set(result["plan"])
    groups = result["groups"]
    assert set(groups) == {"model", "kv_dtype", "tp", "context_len", "kv_budget_bytes_per_gpu",
                           "kvmem", "padded", "gain"}
    row_keys = {"name", "kind", "page_size", "bytes_per_token", "bytes_per_state", "page_bytes",
                "pages_per_request", "bytes_per_request", "bytes_at_capacity"}
    assert [g["name"] for g in groups["kvmem"]["groups"]] == ["full", "indexer"]
    for layout in ("kvmem", "padded"):
        assert all(set(g) == row_keys for g in groups[layout]["groups"])
        assert groups[layout]["tokens_fit"] == 1000 * groups[layout]["requests_fit"]
    assert groups["kvmem"]["groups"][1]["bytes_per_token"] == 21 * 132
    status, out, _ = run(capsys, "plan", "gpt-oss-120b", "--compare", "bf16,fp8_e4m3",
                         "--groups", "--json")
    assert status == 0
    assert [c["groups"]["kv_dtype"] for c in json.loads(out)["compare"]] == ["bf16", "fp8_e4m3"]


@pytest.mark.parametrize(("argv", "words"), [
    (["plan", "qwen4-next", "--groups"], "unknown model 'qwen4-next'"),
    (["plan", "glm-5.2", "--groups", "--context", "-3"], "--context: expected an integer >= 1"),
    (["plan", "glm-5.2", "--padded-compare", "--page-size", "0"], "--page-size"),
    (["plan", "qwen3-next-80b-a3b", "--tp", "3", "--groups"], "TP 3 does not divide"),
])
def test_plan_groups_bad_input_is_one_clear_line(
        capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == "" and words in err and "Traceback" not in err


def test_the_hybrid_benchmark_prints_tokens_per_gib_per_model() -> None:
    """bench_hybrid.py --json (docs/benchmarks.md): one {model, kvmem, padded} per model; the
    padded layout never holds more tokens per GiB; a 12-token request on Qwen3-Next pins a
    544-token page in each of vLLM's four groups; the two-group decode step is timed (a few
    steps here: the figures are the benchmark's, not the test's)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(BENCHMARKS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run_ = subprocess.run([sys.executable, str(BENCHMARKS / "bench_hybrid.py"), "--json",
                           "--lengths", "12", "--steps", "3"], cwd=BENCHMARKS,
                          capture_output=True, text=True, timeout=300, env=env)
    assert run_.returncode == 0, run_.stderr
    result = json.loads(run_.stdout)
    assert result["steps"] == 3 and result["two_group_over_one_group"] > 0
    assert result["two_group_step_us_median"] > 0 and result["one_group_step_us_median"] > 0
    rows = {r["model"]: r for r in result["tokens_per_gib"]}
    assert list(rows) == ["gpt-oss-120b", "qwen3-next-80b-a3b", "glm-5.2"]
    assert all(set(r) == {"model", "kvmem", "padded"} for r in rows.values())
    assert all(r["kvmem"] >= r["padded"] > 0 for r in rows.values())
    # TP 2: 4 padded pages of 544 x 12 x 1,024 bytes against one 16-token page + the state
    qwen = rows["qwen3-next-80b-a3b"]
    assert qwen["padded"] == 12 * 2**30 / (4 * 544 * 12 * 1024)
    assert qwen["kvmem"] == 12 * 2**30 / (16 * 12 * 1024 + 36 * 548_864)
