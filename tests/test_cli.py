"""The ``kvmem`` command line: ``kvmem plan``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.planning import plan_capacity

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
    import kvmem.cli as cli
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
