"""The README, the docs' code and figures, the examples and the bug catalog; README.md and
docs/*.md are reference, not a lab notebook (no commit ids, load averages, or "the issue")."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import TINY_VOCAB, example, model_threads, smollm2  # noqa: F401 (fixtures)

from kvmem.cli import main
from kvmem.cuda import PoolSpec

ROOT = Path(__file__).resolve().parents[1]


SECTION = "## Where the tests catch each one"


def _listed() -> dict[int, list[str]]:
    doc = (ROOT / "docs" / "BUGS.md").read_text()
    assert SECTION in doc
    rows: dict[int, list[str]] = {}
    row = None
    for line in doc[doc.index(SECTION):].splitlines():
        m = re.match(r"- \*\*(\d+)\*\*", line)
        if m:
            row = int(m.group(1))
            rows[row] = []
        elif not line.startswith("  "):  # a bullet runs on over its indented lines
            row = None
        if row is not None:
            rows[row] += re.findall(r"`(tests/[\w/]+\.py::[^`]+)`", line)
    return rows


def _missing(ids: set[str], collected: set[str]) -> list[str]:
    """The ids pytest did not collect; one named without its parameters stands for them all."""
    return [i for i in sorted(ids) if i not in collected
            and not any(c.startswith(i + "[") for c in collected)]


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run_without_transformers(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run an example with transformers made unimportable: loading a model would fail loudly."""
    code = (
        "import runpy, sys\n"
        "sys.modules['transformers'] = None\n"
        f"sys.argv = [{script!r}, *{list(argv)!r}]\n"
        f"runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def _readme_ppl_rows() -> dict[tuple[str, str], int]:
    """(KV pages, scales) -> bytes/token of docs/benchmarks.md's perplexity table."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text[text.index("| KV pages"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        if cells[2] != "-":
            rows[(cells[0], cells[1].split("*")[0].strip())] = int(cells[2].replace(",", ""))
    return rows


def _doc_block(path: str, heading: str | None = None) -> str:
    text = (ROOT / path).read_text()
    if heading is not None:
        text = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]


README = (Path(__file__).parent.parent / "README.md").read_text()


def _block(heading: str) -> str:
    section = README[README.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_every_row_of_bugs_md_lists_tests_that_exist() -> None:
    """docs/BUGS.md's "Where the tests catch each one" names at least one test per row of
    its table (1..N), and pytest collects every test it names."""
    rows = _listed()
    table = re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "BUGS.md").read_text(), re.M)
    assert sorted(rows) == [int(n) for n in table] == list(range(1, len(table) + 1))
    assert all(rows[n] for n in rows), [n for n in rows if not rows[n]]
    ids = {i for ids in rows.values() for i in ids}
    files = sorted({i.split("::")[0] for i in ids})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert collected, out.stdout + out.stderr
    assert not _missing(ids, collected), _missing(ids, collected)
    assert _missing({"tests/test_docs.py::test_no_such_test"}, collected)  # the check can fail


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


def test_the_host_tier_figures_are_the_ones_the_docs_print(
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/capacity_planning.md: `kvmem plan kimi-k2.6 --tp 8 --compare bf16,fp8_e4m3
    --offload-gib 1024` and the `kvmem simulate ... --offload-gib 64` line."""
    import json

    from kvmem.planning import plan_capacity

    plans = [plan_capacity("kimi-k2.6", "h200", 8, kv_dtype=d, offload_gib=1024)
             for d in ("bf16", "fp8_e4m3")]
    assert [(p.offload_pages_per_gpu, p.offload_tokens) for p in plans] == [
        (122_238, 1_955_808), (244_476, 3_911_616)]
    argv = ["simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp", "1", "--requests", "2000",
            "--concurrency", "64", "--prompt-len", "2000-6000", "--output-len", "200-400",
            "--prefixes", "200", "--prefix-len", "4000", "--prefill-tps", "10000",
            "--offload-gib", "64", "--offload-gbs", "25", "--json", "--no-progress"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["offload_pages_per_gpu"], round(r["prefix_hit_rate"], 3),
            round(r["host_hit_rate"], 3)) == (32_768, 0.366, 0.258)


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("perplexity.py", ["--text", "no/such/file.txt"], "no such file"),
        ("perplexity.py", ["--window", "1"], "--window"),
        ("perplexity.py", ["--chunk", "0"], "--chunk"),
        ("perplexity.py", ["--tokens", "x"], "--tokens"),
        ("perplexity.py", ["--kv-dtype", "bf16", "--scales", "head"], "fp8"),
        ("serve_smollm2.py", ["--drill"], "--tracker checking"),
        ("serve_smollm2.py", ["--max-new-tokens", "0"], "--max-new-tokens"),
        ("serve_smollm2.py", ["--kv-dtype", "bf16", "--scales", "head"], "fp8"),
        ("serve_smollm2.py", ["--offload-gib", "0"], "--offload-gib"),
        ("serve_smollm2.py", ["--offload-dir", "/tmp/x"], "--offload-gib"),
        ("serve_smollm2.py", ["--offload-gib", "1", "--drill", "--tracker", "checking"],
         "--drill"),
    ],
)
def test_bad_arguments_fail_fast_in_one_line(script: str, argv: list[str], message: str) -> None:
    proc = _run_without_transformers(script, *argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_text_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    proc = _run_without_transformers("perplexity.py", "--text", str(bad))
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr, proc.stderr


def test_the_readme_bytes_per_token_column_is_smollm2s_pool_spec() -> None:

    rows = _readme_ppl_rows()
    assert len(rows) == 8
    for (dtype, scales), size in rows.items():
        spec = PoolSpec(num_layers=30, num_pages=1, attention="gqa", num_kv_heads=3, head_dim=64,
                        dtype=dtype, scales=None if scales == "-" else scales, device="cpu")
        assert spec.bytes_per_token == size, (dtype, scales)


@pytest.mark.model
def test_the_transformers_doc_code_block_runs_as_written(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/transformers.md's first code block, with the session's model for load_smollm2()
    (the same offline load, done once) and two chat prompts for prompt_a / prompt_b."""
    import kvmem.integrations.hf as hf

    model, tokenizer = smollm2
    monkeypatch.setattr(hf, "load_smollm2", lambda: smollm2)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from serve_smollm2 import chat_prompts
    finally:
        sys.path.remove(str(ROOT / "examples"))
    prompt_a, prompt_b = chat_prompts(tokenizer, ("What is a page?", "What is a cache?"))
    ns: dict[str, Any] = {"prompt_a": prompt_a, "prompt_b": prompt_b}
    exec(compile(_doc_block("docs/transformers.md"), "transformers.md", "exec"), ns)
    lm, manager, engine = ns["lm"], ns["manager"], ns["engine"]
    assert lm.pool.spec.dtype == "fp8_e4m3" and lm.pool.spec.scales == "token_head"
    done = {r.request_id: r for r in engine.done}
    assert sorted(done) == ["a", "b"]
    assert all(r.status == "finished" and len(r.output_ids) == 64 for r in done.values())
    assert done["a"].num_cached_tokens == 0 and done["b"].num_cached_tokens == 32  # system prompt
    assert manager.stats().num_used == 0 and manager.stats().num_integrity_failures == 0
    manager.check()
    model.set_attn_implementation("sdpa")


@pytest.mark.model
def test_the_tour_plans_kimi_serves_on_fp8_and_catches_the_drill(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """README's first command ends in `python examples/tour.py`: the plan's figures, six
    requests on fp8 pages, exactly the victim aborted with docs/transformers.md's reason, and
    the example's own check against the fault-free run."""
    import kvmem.integrations.hf as hf

    monkeypatch.setattr(hf, "load_smollm2", lambda: smollm2)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import tour

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = tour.main()
        import serve_smollm2

        with contextlib.redirect_stdout(io.StringIO()) as js, \
                contextlib.redirect_stderr(io.StringIO()):
            json_status = serve_smollm2.main(["--max-new-tokens", "3", "--json"])
    finally:
        sys.path.remove(str(ROOT / "examples"))
    text = out.getvalue()
    assert status == 0, text
    assert re.search(r"KV bytes / token / GPU\s+70,272\s+35,136", text)
    assert re.search(r"KV tokens / replica\s+653,125\s+1,306,251", text)
    assert len(re.findall(r"^--- req-\d ", text, re.M)) == 6
    assert len(re.findall(r": finished$", text, re.M)) == 5
    assert ("--- req-1 (54 prompt tokens, 0 from the prefix cache): aborted\n    aborted: page "
            "was reallocated to another lifetime (tag changed) (expected tag 16, found 18): "
            "position 4, page 15") in text  # the reason docs/transformers.md prints
    assert "fp8_e4m3 (token_head scales) pages take 12240 bytes per token (bf16: 23040)" in text
    assert "integrity failures: 1" in text and "now 40 free, 24 cached, 0 used" in text
    assert "drill: 5 of 5 other requests generated exactly the tokens of the fault-free run" \
        in text
    assert "req-1 aborted (page was reallocated" in err.getvalue()  # progress on stderr
    rows = json.loads(js.getvalue())
    assert json_status == 0 and [r["id"] for r in rows] == [f"req-{i}" for i in range(6)]
    assert all(set(r) == {"id", "status", "reason", "token_ids"} for r in rows)
    assert all(r["status"] == "finished" and len(r["token_ids"]) <= 3 for r in rows)
    smollm2[0].set_attn_implementation("sdpa")


@pytest.mark.model
def test_serve_example_makes_room_for_its_max_new_tokens() -> None:
    # `serve_smollm2.py --max-new-tokens 400` ran out of its fixed 64 pages mid-run (the
    # engine does not preempt), a traceback after the model load. The real tokenizer (chat
    # template), a tiny random Llama of its vocabulary for speed.
    from model_fixtures import _require_model_packages

    _require_model_packages()
    import transformers
    from transformers import AutoTokenizer

    from kvmem.integrations.hf import smollm2_gguf_path

    serve = example("serve_smollm2")
    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                              local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = serve.serve(model, tokenizer, kv_dtype="bf16", max_new_tokens=400)
    assert {r.status for r in out["requests"]} == {"finished"}
    assert out["peak_pages"] > serve.NUM_PAGES  # the six at once needed more than 64 pages
    assert out["stats"].num_pages >= out["peak_pages"]
    assert serve.parse_args([]).max_new_tokens == 48
    with pytest.raises(SystemExit):
        serve.parse_args(["--max-new-tokens", str(serve.MAX_NEW_TOKENS + 1)])


@pytest.mark.model
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_the_offload_example_loads_evicted_turns_from_the_host_tier_bit_exact(
        smollm2: tuple[Any, Any], kv_dtype: str) -> None:  # noqa: F811
    """`serve_smollm2.py --offload-gib`: the chats' earlier turns leave the small device pool
    and come back from the host tier; the tokens are those of the run whose pages never left
    the device (same cached tokens per turn, so the same prefill chunks: loaded pages are
    bit-exact), and every turn's figures add up to its prompt."""
    model, tokenizer = smollm2
    serve = example("serve_smollm2")
    kw = {"kv_dtype": kv_dtype, "max_new_tokens": 4, "num_turns": 2}
    tiered = serve.converse(model, tokenizer, offload_gib=0.05, **kw)
    kept = serve.converse(model, tokenizer, offload_gib=None, keep_every_page=True, **kw)
    figures = serve.turn_figures(tiered, kept)
    assert tiered["stats"].num_evictions > 0 and kept["stats"].num_evictions == 0
    assert sum(figures["host_hits"]) > 0 and figures["tokens_match_without_tier"]
    assert [r.num_cached_tokens for r in tiered["turns"]] == [
        r.num_cached_tokens for r in kept["turns"]]
    offload = tiered["stats"].offload
    assert offload.loaded_pages * 16 == sum(figures["host_hits"])
    assert offload.tier.num_digest_failures == offload.load_misses == 0
    for i, prompt in enumerate(figures["prompt_tokens"]):
        assert figures["disk_hits"][i] == 0 and figures["ttft_s"][i] > 0
        assert (figures["device_hits"][i] + figures["host_hits"][i]
                + figures["recomputed_tokens"][i]) == prompt
    assert len(figures["turns"]) == 2 * serve.NUM_CONVERSATIONS
    model.set_attn_implementation("sdpa")


@pytest.mark.model
def test_the_offload_example_with_a_disk_tier_serves_evicted_turns_from_disk(
        smollm2: tuple[Any, Any], tmp_path: Any) -> None:  # noqa: F811
    """`serve_smollm2.py --offload-gib G --offload-dir DIR` with a host tier of a few pages:
    its evictions go to disk and come back bit-exact (tokens of the run that kept every page),
    and stay in the directory."""
    model, tokenizer = smollm2
    serve = example("serve_smollm2")
    kw = {"kv_dtype": "bf16", "max_new_tokens": 4, "num_turns": 2}
    few_pages = 4 * 30 * 16 * 2 * 3 * 64 * 2 / (1 << 30)  # 4 bf16 pages of SmolLM2-135M
    first = serve.converse(model, tokenizer, offload_gib=few_pages, offload_dir=str(tmp_path),
                           **kw)
    kept = serve.converse(model, tokenizer, offload_gib=None, keep_every_page=True, **kw)
    figures = serve.turn_figures(first, kept)
    assert sum(figures["disk_hits"]) > 0 and figures["tokens_match_without_tier"]
    assert first["stats"].offload.loaded_by_medium["DISK"] * 16 == sum(figures["disk_hits"])
    assert any(tmp_path.glob("*/*.kvb"))  # kept for the next run (the manager tests restart)
    model.set_attn_implementation("sdpa")


@pytest.mark.model
def test_the_offload_examples_json_has_the_documented_keys_per_turn(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """`serve_smollm2.py --offload-gib G --json`: one entry per turn under each documented key,
    no disk hits, host hits, and exit status 0 because the tokens match the run without a
    tier that kept every page."""
    import kvmem.integrations.hf as hf

    monkeypatch.setattr(hf, "load_smollm2", lambda: smollm2)
    serve = example("serve_smollm2")
    with contextlib.redirect_stdout(io.StringIO()) as out, \
            contextlib.redirect_stderr(io.StringIO()):
        status = serve.main(["--offload-gib", "0.05", "--max-new-tokens", "2", "--json"])
    figures = json.loads(out.getvalue())
    num_turns = serve.NUM_CONVERSATIONS * serve.NUM_TURNS
    for key in ("turns", "prompt_tokens", "device_hits", "host_hits", "disk_hits",
                "recomputed_tokens", "ttft_s", "ttft_s_recomputed"):
        assert len(figures[key]) == num_turns, key
    assert status == 0 and figures["tokens_match_without_tier"] is True
    assert isinstance(figures["tokens_match_recomputed"], bool)
    assert set(figures["disk_hits"]) == {0} and sum(figures["host_hits"]) > 0
    smollm2[0].set_attn_implementation("sdpa")


def test_the_loops_size_in_the_transformers_doc_is_the_files() -> None:
    # docs/transformers.md said "It is about 200 lines" of a 549-line engine.py.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    said = re.search(r"It is about (\d+) lines", (root / "docs/transformers.md").read_text())
    assert said is not None
    lines = len((root / "kvmem/integrations/engine.py").read_text().splitlines())
    assert abs(lines - int(said.group(1))) <= 0.15 * lines, (said.group(0), lines)


def test_the_embedding_example_runs_and_its_commented_calls_work() -> None:
    code = _block("## Embedding it in an engine")
    ns: dict = {"prompt_ids": list(range(1, 41)), "batch": ["req-1"]}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["res"].num_prompt_tokens == 40 and ns["report"].aborted == {}
    mgr, pool, step = ns["mgr"], ns["pool"], ns["step"]
    assert mgr.num_tokens("req-1") == 41  # the prompt and the decode step's slot
    assert mgr.num_committed("req-1") == 40
    assert mgr.tokens_of("req-1").tolist() == ns["prompt_ids"]

    # The comment's per-layer calls, on the decode step: write the new token's K/V, attend.
    from kvmem import paged_attention

    t = step.tensors("cpu")
    k = v = torch.randn(1, 3, 64)
    pool.write(0, t["slot_mapping"], k, v)
    q = torch.randn(1, 9, 64)  # 9 query heads over 3 KV heads (GQA)
    out = paged_attention(q, torch.tensor([0, 1]), pool, 0, t["kv_indptr"], t["kv_indices"],
                          t["kv_last_page_len"])
    assert out.shape == (1, 9, 64) and torch.isfinite(out).all()


# -- docs as reference: figures and their history live in docs/benchmarks.md ------------------

# 7-40 hex digits with at least one letter and one digit, not inside a path, URL or word
# (the same pattern as the project's before-stop hook).
COMMIT_ID = re.compile(
    r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
# A measurement diary: the machine's load ("load average 0.9", "load 2.5-3.0", "1-minute load
# 0.85"), the issue or session a figure came from.
DIARY = re.compile(
    r"\bload[ -]average|\bload avg\b|\bload \d|\b(?:the|this) (?:issue|session)\b", re.I)


def reference_docs() -> list[Path]:
    """README.md and every docs/*.md but docs/benchmarks.md."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
    return [ROOT / "README.md", *docs]


def hits(pattern: re.Pattern[str], text: str) -> list[str]:
    """Each match, as 'line N: the match'."""
    return [f"line {n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1)
            for m in pattern.finditer(line)]


@pytest.mark.parametrize("path", reference_docs(), ids=lambda p: p.name)
def test_no_commit_id_in_the_docs(path: Path) -> None:
    found = hits(COMMIT_ID, path.read_text())
    assert not found, (f"{path.name} cites commits {found}: history belongs in commit messages, "
                       "figures (with what they were measured at) in docs/benchmarks.md")


@pytest.mark.parametrize("path", reference_docs(), ids=lambda p: p.name)
def test_no_measurement_diary_in_the_docs(path: Path) -> None:
    found = hits(DIARY, path.read_text())
    assert not found, (f"{path.name} reads as a diary {found}: say what kvmem does; put figures "
                       "in docs/benchmarks.md")


def test_the_commit_id_check_fires_on_ids_and_not_on_paths_words_or_numbers() -> None:
    fires = ["One run at commit `49c90a0`: 384 us.", "measured at cc520c1 (quiet)",
             "(d942367, three runs)", "full id 9708d5a1b2c3d4e5f60718293a4b5c6d7e8f9012 here"]
    for line in fires:
        assert hits(COMMIT_ID, line), line
    silent = ["653,125 / 1,306,251 tokens", "2026-12-02", "seeds 1000-1999",
              "the default is 0xdeadbeef", "a sha256 block hash", "see /tmp/ab12cd3ef/x.py",
              "https://github.com/org/repo/commit/49c90a0", "blake2b keys", "abcdefab",
              "1234567", "fp8_e4m3 token_head", "deadbeef12-suffix", "x49c90a0"]
    for line in silent:
        assert not hits(COMMIT_ID, line), line


def test_the_diary_check_fires_on_load_and_issue_phrases_and_not_on_loading() -> None:
    fires = ["(load average 0.9-1.0, nothing else running)", "`f22b7c2`, load 6.5):",
             "three runs started at 1-minute load 0.85-0.94", "On the issue's workload",
             "figures from this session", "Load Average: 2"]
    for line in fires:
        assert hits(DIARY, line), line
    silent = ["`load_tags` and `update_tags` raise", "before they load the model",
              "load_hf_config(path) reads llama", "a loaded pool", "workload of 256 requests",
              "issue and pull-request numbers of the projects named", "download the wheel"]
    for line in silent:
        assert not hits(DIARY, line), line


def test_hybrid_md_code_runs_as_written() -> None:
    """docs/hybrid.md's two blocks (the groups, then one budget for them) run in order: the
    allocation takes pages in every group it names, and the bookkeeping checks out."""
    ns: dict[str, Any] = {}
    exec(compile(_doc_block("docs/hybrid.md", "## Groups"), "hybrid.md", "exec"), ns)
    exec(compile(_doc_block("docs/hybrid.md", "## One byte budget"), "hybrid.md", "exec"), ns)
    assert ns["fit"].fits and {k: v.size for k, v in ns["pages"].items()} == {
        "full": 40, "gdn": 1, "indexer": 40}
    ga = ns["ga"]
    chunk = ns["offsets"].tolist()[0] // ga.chunk_bytes  # the state lies in a chunk of its group
    assert ga.arena.owners[chunk] == ga.names.index("gdn")
    ga.check()


def test_the_hybrid_example_aborts_only_the_request_whose_window_page_was_released() -> None:
    """examples/hybrid_groups.py (numpy only): a prefix restored in every group, a fork's
    copies, and the injected window fault caught for its one request."""
    out = _run_without_transformers("hybrid_groups.py")
    assert out.returncode == 0, out.stderr
    assert "b: 163 prompt tokens, 160 restored from the cache" in out.stdout
    assert "aborted b: group 'swa'" in out.stdout and "a page it released" in out.stdout
    assert "aborted a" not in out.stdout and "the others decode on: True" in out.stdout


def test_hybrid_md_model_block_runs_as_written() -> None:
    """docs/hybrid.md's model block: a tiny Gemma 3 prefilled on a HybridManager's pages gives
    the logits of the same model without a cache, and its groups' bookkeeping checks out."""
    pytest.importorskip("transformers", reason="needs the hf extra")
    ns: dict[str, Any] = {}
    code = _doc_block("docs/hybrid.md", "## Models run on kvmem pages")
    exec(compile(code, "hybrid.md", "exec"), ns)
    with torch.no_grad():
        want = ns["model"](torch.tensor(ns["prompt"])[None]).logits[0]
    assert ns["logits"].shape == want.shape
    assert torch.allclose(ns["logits"], want, atol=1e-4)
    ns["manager"].check()
