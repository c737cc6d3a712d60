"""Promises of README.md, docs/data_types.md and docs/capacity_planning.md (planning, the CLI,
the simulator), each probed where an audit found it broken (or held but untested); the
manager's, the page table's and the integrity layer's are in test_doc_promises.py."""

from __future__ import annotations

import pytest

from kvmem import ArgumentTypeError, KVMemError

# -- docs/capacity_planning.md: FixedReserve(reserve_gib), MemoryFraction(fraction) ------------

def test_reserve_policies_take_their_one_field_by_position() -> None:
    from kvmem.planning import FixedReserve, MemoryFraction, plan_capacity

    assert FixedReserve(10) == FixedReserve(reserve_gib=10)
    assert MemoryFraction(0.8) == MemoryFraction(fraction=0.8)
    fixed = plan_capacity("llama-3.1-8b", "h100-80g", policy=FixedReserve(10))
    assert fixed.kv_budget_gib_per_gpu == pytest.approx(
        fixed.gpu_memory_gib - fixed.weights_gib_per_gpu - 10)
    with pytest.raises(ArgumentTypeError, match="reserve_gib twice"):
        FixedReserve(1, reserve_gib=2)
    with pytest.raises(ArgumentTypeError, match="positional"):
        MemoryFraction(0.5, 0.6)
    with pytest.raises(KVMemError):
        MemoryFraction(1.5)


def test_specs_given_positional_arguments_raise_a_kvmem_error() -> None:
    from kvmem import GPUSpec, PoolSpec

    for build in (lambda: GPUSpec("x", 1000, 100), lambda: PoolSpec(2)):
        with pytest.raises(ArgumentTypeError, match="by name"):
            build()


# -- docs/errors.md, the command line: a setting that would be ignored is refused, status 2 ----

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


# -- docs/data_types.md -------------------------------------------------------------------------

def test_fp8_pool_spec_scales_default_to_tensor_and_bf16_has_none() -> None:
    from kvmem import PoolSpec
    from kvmem.integrations.hf import DEFAULT_FP8_SCALES

    shape = dict(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
    assert PoolSpec(**shape, dtype="fp8_e4m3").scales == "tensor"
    assert PoolSpec(**shape, dtype="bf16").scales is None
    assert DEFAULT_FP8_SCALES == "token_head"


@pytest.mark.parametrize("scales, ratio", [("tensor", 2.0), ("head", 2.0),
                                           ("token_head", 2.0 / (1 + 4 / 128))])
def test_an_fp8_pool_holds_twice_the_tokens_of_bf16_up_to_page_rounding(scales: str,
                                                                         ratio: float) -> None:
    from kvmem import PoolSpec

    shape = dict(num_layers=32, num_pages=4, page_size=16, num_kv_heads=8, head_dim=128)
    bf16 = PoolSpec(**shape, dtype="bf16")
    fp8 = PoolSpec(**shape, dtype="fp8_e4m3", scales=scales)
    budget = 1000 * bf16.bytes_per_page  # a whole number of bf16 pages
    assert fp8.num_pages_for_budget(budget) == int(ratio * 1000)
    assert fp8.num_pages_for_budget(budget + bf16.bytes_per_page - 1) <= int(ratio * 1001)


# -- README.md and docs/capacity_planning.md: the figures as printed ------------------------------

def test_the_kimi_and_glm_figures_are_the_ones_the_docs_print() -> None:
    from kvmem.planning import fit_throughput, get_model, plan_capacity

    kimi = {d: plan_capacity("kimi-k2.6", "h200", tp=8, kv_dtype=d, context_len=16384)
            for d in ("bf16", "fp8_e4m3")}
    assert [p.kv_tokens_per_gpu for p in kimi.values()] == [653_125, 1_306_251]
    assert [p.max_concurrency for p in kimi.values()] == [39, 79]
    assert kimi["fp8_e4m3"].kv_bytes_per_token_per_gpu == 35_136
    assert round(kimi["bf16"].weights_gib_per_gpu, 2) == 71.83
    assert round(kimi["bf16"].kv_budget_gib_per_gpu, 2) == 42.74
    assert round(kimi["bf16"].mem_fraction_static, 4) == 0.8160
    glm = get_model("glm-5.2")
    tokens = {(w, d): plan_capacity(glm, "h200", tp=8, kv_dtype=d, weights=w)
              for w in ("fp8", "int4-g32") for d in ("bf16", "fp8_e4m3")}
    assert {k: p.kv_tokens_per_gpu for k, p in tokens.items()} == {
        ("fp8", "bf16"): 437_757, ("fp8", "fp8_e4m3"): 850_076,
        ("int4-g32", "bf16"): 829_801, ("int4-g32", "fp8_e4m3"): 1_611_380}
    fp8_w, int4_w = tokens["fp8", "bf16"], tokens["int4-g32", "bf16"]
    assert (round(fp8_w.weights_gib_total, 2), round(int4_w.weights_gib_total, 2)) == (
        703.72, 419.94)
    assert (round(fp8_w.weights_gib_per_gpu, 2), round(int4_w.weights_gib_per_gpu, 2)) == (
        88.18, 54.36)
    assert (round(fp8_w.kv_budget_gib_per_gpu, 2), round(int4_w.kv_budget_gib_per_gpu, 2)) == (
        37.76, 71.58)
    bf16 = plan_capacity("kimi-k2.6", "h200", tp=8, kv_dtype="bf16")
    fit = fit_throughput(bf16, [(1, 137), (8, 731), (16, 1106), (32, 1558)])
    assert (round(fit.t0_s * 1e3, 2), round(fit.efficiency, 3), fit.context_len) == (
        5.40, 0.695, 4870)
    fp8 = plan_capacity("kimi-k2.6", "h200", tp=8, kv_dtype="fp8_e4m3")
    assert round(fit.tokens_per_s(fp8, 64)) == 2474


def test_the_simulate_figures_are_the_ones_the_docs_print(
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/capacity_planning.md: `kvmem simulate kimi-k2.6 --compare bf16,fp8_e4m3
    --requests 300`."""
    import json

    from kvmem.cli import main

    argv = ["simulate", "kimi-k2.6", "--compare", "bf16,fp8_e4m3", "--requests", "300",
            "--json", "--no-progress"]
    assert main(argv) == 0
    bf16, fp8 = json.loads(capsys.readouterr().out)["compare"]
    assert (bf16["kv_tokens"], fp8["kv_tokens"]) == (653_120, 1_306_240)
    assert (round(bf16["mean_running"], 1), bf16["max_running"]) == (40.7, 45)
    assert (bf16["num_queued"], round(bf16["queue_delay_p95_s"]), bf16["num_preemptions"]) == (
        258, 39, 4)
    assert (round(fp8["mean_running"], 1), fp8["max_running"], fp8["num_queued"],
            fp8["num_preemptions"]) == (59.6, 64, 0, 0)
    assert (round(bf16["output_tokens_per_s"]), round(fp8["output_tokens_per_s"])) == (
        1265, 1876)


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


# -- docs/capacity_planning.md: lengths are N, LO-HI or lognormal:MEDIAN,SIGMA; a Workload refuses
# a setting it would ignore ---------------------------------------------------------------------

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
