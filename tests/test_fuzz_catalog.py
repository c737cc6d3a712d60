"""The fuzzer's fault catalog, its command, its tutorial and what its docs promise."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvmem.testing as t
from kvmem.cli import main
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError
from kvmem.testing._fuzz_hybrid import HYBRID_FAULTS
from kvmem.testing.faults import CATALOG


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


ROOT = Path(__file__).resolve().parents[1]


def load_tutorial() -> Any:
    """examples/fuzz_tutorial.py as a module (also used by test_fuzz_promises.py)."""
    spec = importlib.util.spec_from_file_location("fuzz_tutorial",
                                                  ROOT / "examples" / "fuzz_tutorial.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_tutorial"] = module  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["fuzz_tutorial"]
    return module


DOC = (ROOT / "docs" / "fuzzing.md").read_text()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["fuzz", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def _catalog_rows() -> dict[str, list[str]]:
    """The rows of the doc's fault catalog table (manager engine), by fault."""
    table = DOC[DOC.index("| fault | BUGS.md |") : DOC.index("On the toy engine")]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7:
            rows[cells[0].strip("`")] = cells
    return rows


def _applies(name: str, engine: str) -> bool:
    engines = CATALOG[name].engines
    return engines is None or engine in engines


TOY = {"cow_copy_skipped": "reads", "tenant_salt_dropped": "reads",
       "tenantless_cache_key": "check", "weak_prefix_key": "engine",  # the engine's check_kv
       "leak_on_abort": "requests", "second_release_path": "refcounts",
       "refcount_overincrement": "refcounts", "stale_page_table_entry": "verify"}


def _zero_weights(**keep: float) -> dict[str, float]:
    return {m: keep.get(m, 0) for m in t.FuzzConfig.DEFAULT_WEIGHTS}


def test_faults_json_has_one_entry_per_fault_and_a_fault_free_campaign(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "fuzz", "--faults", "retire_at_launch", "wrong_chunk_slice",
                           "leak_on_abort", "--minutes", "1", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert [e["fault"] for e in data] == ["retire_at_launch", "wrong_chunk_slice",
                                          "leak_on_abort", "none"]
    for e in data:
        assert {"fault", "detected", "detected_by", "schedule_len", "seconds"} <= set(e)
    for e in data[:-1]:
        assert e["detected"] is True and e["detected_by"] and e["schedule_len"] >= 1
    none = data[-1]
    assert none["detected"] is False and none["detected_by"] is None
    assert none["moves"] >= 10_000
    assert "retire_at_launch" in err  # the progress line


def test_a_fault_free_campaign_reports_clean(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--moves", "1500", "--engine", "toy")
    assert status == 0
    assert "none" in out and "clean" in out


def test_save_writes_a_reproducer_that_pytest_runs_and_fails(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, _ = run(capsys, "fuzz", "--faults", "retire_at_launch", "--minutes", "0.2",
                       "--save", str(tmp_path))
    assert status == 0
    files = sorted(tmp_path.glob("test_fuzz_*.py"))
    assert len(files) == 1 and "retire_at_launch" in files[0].name
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(files[0])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the bug is still there
    assert "FuzzFailure" in proc.stdout and "fences" in proc.stdout


def test_list_shows_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--list")
    assert status == 0
    assert all(name in out for name in [*CATALOG, *HYBRID_FAULTS])


def test_list_json_is_the_catalog_as_one_json_list(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--list", "--json")
    assert status == 0
    entries = json.loads(out)
    assert [e["fault"] for e in entries] == [*CATALOG, *HYBRID_FAULTS]
    for e in entries[len(CATALOG) :]:  # the hybrid engine's own catalog
        assert e["engines"] == ["hybrid"]
        assert e["description"] == HYBRID_FAULTS[e["fault"]].describe()
    for e in entries[: len(CATALOG)]:
        f = CATALOG[e["fault"]]
        assert e["bugs"] == list(f.bugs) and e["timeline"] == f.timeline
        assert e["engines"] == (list(f.engines) if f.engines else None)
        assert e["description"] == f.describe()


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--engine", "nope"], "no fuzz engine"),
    (["fuzz", "--faults", "nope"], "unknown faults"),
    (["fuzz", "--config", "huge"], "no fuzz config preset"),
    # what would run forever, run nothing, or be ignored is refused before any work
    (["fuzz", "--minutes", "0"], "--minutes 0.0: expected a number of minutes > 0"),
    (["fuzz", "--minutes", "-1"], "--minutes -1.0: expected"),
    (["fuzz", "--minutes", "nan"], "--minutes nan: expected"),
    (["fuzz", "--minutes", "inf"], "--minutes inf: expected"),
    (["fuzz", "--moves", "0"], "--moves 0: expected at least 1 move"),
    (["fuzz", "--moves", "-5"], "--moves -5: expected at least 1 move"),
    (["fuzz", "--moves", "10", "--minutes", "1"], "--moves and --minutes are alternatives"),
    (["fuzz", "--faults", "--moves", "10"], "it takes no --moves"),
    (["fuzz", "--profile", "ci", "--engine", "toy"], "it takes no --engine"),
    (["fuzz", "--profile", "ci", "--seed", "3", "--minutes", "1"], "it takes no --minutes, --seed"),
    (["fuzz", "--moves", "10", "--save", "/proc/kvmem-no-such-dir"], "--save /proc/kvmem-no-such"),
    (["fuzz", "--moves", "10", "--seed", "-1"], "--seed -1: expected a seed >= 0"),
])
def test_bad_arguments_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                            message: str) -> None:
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert message in err and err.count("\n") == 1


def test_help_shows_each_usage_form_on_its_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "fuzz", "--help")
    assert status == 0
    lines = out.splitlines()
    for form in ("kvmem fuzz [--engine manager] [--minutes 1 | --moves N] [--save DIR] [--json]",
                 "kvmem fuzz --profile ci [--json]"):
        assert form in lines


def test_the_tutorial_code_in_the_docs_is_the_example_verbatim() -> None:
    doc = (ROOT / "docs" / "fuzzing.md").read_text()
    example = (ROOT / "examples" / "fuzz_tutorial.py").read_text()
    tutorial = doc[doc.index("## Tutorial") :]
    blocks = re.findall(r"```python\n(.*?)```", tutorial, flags=re.S)
    assert len(blocks) >= 3
    for block in blocks:
        assert block.strip() in example, block[:200]
    adapter = example[example.index("class MiniServeAdapter") : example.index("class Fixed")]
    assert len([ln for ln in adapter.splitlines() if ln.strip()]) < 100


def test_the_tutorial_finds_the_planted_race_and_its_fix_runs_clean(
        capsys: pytest.CaptureFixture[str]) -> None:
    load_tutorial().main()
    out = capsys.readouterr().out
    assert "MiniServe: happens_before" in out and "no oracle fired" in out


def test_the_catalog_table_lists_every_fault_with_its_bugs_side_and_timeline() -> None:
    rows = _catalog_rows()
    assert list(rows) == [n for n in CATALOG if _applies(n, "manager")] and len(rows) == 19
    for name, (_, bugs, side, timeline, _, _, _) in rows.items():
        f = CATALOG[name]
        assert tuple(int(b) for b in bugs.split(",")) == f.bugs, name
        assert side.split()[0] == f.side, name
        assert (timeline == "yes") == f.timeline, name


def test_the_ci_profile_finds_each_fault_as_the_catalog_table_says() -> None:
    # The same hunts as `kvmem fuzz --profile ci` (fixed seeds and budgets): detected_by, moves
    # to find and shrunk-to length are the table's.
    for name, cells in _catalog_rows().items():
        r = t.hunt(name, "manager", "small", seed=0, max_campaigns=25,
                   moves_per_campaign=1500, shrink_replays=100)
        assert r.detected and r.detected_by == cells[4].split()[0].strip("`"), (name, r)
        assert r.moves == int(cells[5]), (name, r.moves)
        assert r.schedule_len == int(cells[6].split()[0]), (name, r.schedule_len)
        assert r.bugs == CATALOG[name].bugs and r.engine == "manager"


def test_the_toy_engine_finds_the_eight_faults_that_apply_to_it_as_the_doc_says() -> None:
    assert "the eight faults that apply to it" in DOC
    assert sorted(n for n in CATALOG if _applies(n, "toy")) == sorted(TOY)
    for name, oracle in TOY.items():
        r = t.hunt(name, "toy", "small", seed=0, max_campaigns=25, moves_per_campaign=1500,
                   shrink_replays=100)
        assert r.detected and r.detected_by == oracle, (name, r)
    # "The three kvmem fence faults do not apply to the toy engine"
    fences = [n for n, f in CATALOG.items()
              if f.side == "kvmem" and f.timeline and _applies(n, "manager")]
    assert len(fences) == 3 and not any(_applies(n, "toy") for n in fences)


def test_the_vllm_table_names_the_seven_faults_that_apply_to_vllm() -> None:
    table = DOC[DOC.index("| fault | side | detected by |") : DOC.index("`tenant_salt_dropped` is")]
    names = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    for engine in ("vllm", "vllm-async"):
        assert names == [n for n in CATALOG if _applies(n, engine)]
    assert len(names) == 7 and "finds the seven" in DOC


def test_the_ci_profile_runs_the_documented_fault_free_moves() -> None:
    from kvmem.cli import _fuzz as _fuzz_cli

    assert "50,000 fault-free moves on the manager" in DOC
    assert ("10,000 each on the toy, the disaggregated, the offload and the hybrid engines"
            in " ".join(DOC.split()))
    assert _fuzz_cli._CLEAN_MOVES == 10_000  # (the hybrid engine's, in _ci_hybrid)
    assert _fuzz_cli._CI_CLEAN["manager"] == 50_000
    assert (_fuzz_cli._CI_CLEAN["toy"] == _fuzz_cli._CI_CLEAN["disagg"]
            == _fuzz_cli._CI_CLEAN["offload"] == 10_000)
    assert _fuzz_cli._CI_ENGINES == ("manager", "toy", "disagg", "offload")


def test_a_seed_gives_the_same_run_and_json_goes_to_stdout_progress_to_stderr(
        capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for seed in ("5", "5", "6"):
        status, out, err = cli(capsys, "--moves", "700", "--seed", seed, "--json")
        assert status == 0 and "fault-free" in err and "fault-free" not in out
        (entry,) = json.loads(out)
        assert {"fault", "detected", "detected_by", "schedule_len", "seconds"} <= set(entry)
        assert entry["fault"] == "none" and entry["detected"] is False
        assert entry["moves"] >= 700
        del entry["seconds"]
        runs.append(entry)
    assert runs[0] == runs[1] and runs[0]["seed"] != runs[2]["seed"]


def test_a_registered_engine_runs_from_the_cli_exits_1_on_a_failure_and_saves_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tutorial = load_tutorial()
    monkeypatch.setitem(t.ENGINES, "miniserve", tutorial.MiniServeAdapter)
    status, out, err = cli(capsys, "--engine", "miniserve", "--moves", "3000", "--save",
                           str(tmp_path), "--json")
    assert status == 1, err  # a fault-free run tripped a check: not the expected outcome
    (entry,) = json.loads(out)
    assert entry["detected"] is True and entry["detected_by"] == "happens_before"
    assert entry["engine"] == "miniserve" and 1 <= entry["schedule_len"] <= 3
    (path,) = tmp_path.glob("test_fuzz_*.py")
    spec = importlib.util.spec_from_file_location("saved_reproducer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert len(module.SCHEDULE) == entry["schedule_len"]
    (test,) = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    with pytest.raises(t.FuzzFailure) as e:
        test()
    assert e.value.oracle == "happens_before"
    monkeypatch.setitem(t.ENGINES, "miniserve", tutorial.FixedMiniServeAdapter)
    assert cli(capsys, "--engine", "miniserve", "--moves", "800")[0] == 0


@pytest.mark.parametrize("argv, message", [
    # the second fault does not apply to toy: refused before the first is hunted
    (["--faults", "leak_on_abort", "retire_at_launch", "--engine", "toy"],
     "faults ['retire_at_launch'] do not apply to the 'toy' engine"),
    (["--list", "--moves", "3"], "--list prints the catalog and runs nothing; it takes no "
     "--moves"),
    (["--list", "--profile", "ci"], "it takes no --profile"),
])
def test_what_cannot_run_is_refused_before_any_work(capsys: pytest.CaptureFixture[str],
                                                    argv: list[str], message: str) -> None:
    status, out, err = cli(capsys, *argv)
    assert status == 2 and out == ""
    assert message in err and err.count("\n") == 1  # no progress line: nothing ran


def test_a_refused_command_creates_no_save_folder(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    for argv in (["--faults", "nope"], ["--engine", "nope"], ["--config", "huge"],
                 ["--faults", "retire_at_launch", "--engine", "toy"]):
        folder = tmp_path / "found"
        assert cli(capsys, *argv, "--save", str(folder))[0] == 2
        assert not folder.exists(), argv


@pytest.mark.parametrize("call, error, message", [
    (lambda: t.campaign("nope"), ArgumentError, "no fuzz engine 'nope'"),
    (lambda: t.campaign(engine=5), ArgumentTypeError, "engine=5"),
    (lambda: t.campaign(config="huge"), ArgumentError, "no fuzz config preset 'huge'"),
    (lambda: t.campaign(config=5), ArgumentTypeError, "config=5"),
    (lambda: t.campaign(fault="nope"), ArgumentError, "no fault 'nope'"),
    (lambda: t.replay([], fault=5), ArgumentTypeError, "fault=5"),
    (lambda: t.hunt("retire_at_launch", "toy"), ArgumentError, "applies to engines"),
    (lambda: t.Run().step("teleport", 0, 0), ArgumentError, "no move 'teleport'"),
    (lambda: t.FuzzConfig(prompt_len=(5, 2)), ArgumentError, "lo <= hi"),
    (lambda: t.FuzzConfig(max_new=(9, 3)), ArgumentError, "lo <= hi"),
    (lambda: t.FuzzConfig(max_len=10), ArgumentError, "exceeds max_len=10"),
    (lambda: t.FuzzConfig(namespaces=()), ArgumentError, "namespaces=()"),
    (lambda: t.FuzzConfig(namespaces="ab"), ArgumentError, "namespaces='ab'"),
    (lambda: t.FuzzConfig(strict_commits="yes"), ArgumentTypeError, "strict_commits='yes'"),
    (lambda: t.FuzzConfig(weights=_zero_weights()), ArgumentError, "every move has weight 0"),
    (lambda: t.campaign("toy", {"weights": _zero_weights(receive=1)}), ArgumentError,
     "has a weight > 0"),  # toy offers no receive: nothing to draw
    (lambda: t.FuzzConfig.from_dict("small"), ArgumentTypeError, "expected a dict"),
    (lambda: t.FuzzConfig.from_dict({"prompt_len": 5}), ArgumentTypeError, "prompt_len=5"),
    (lambda: t.shrink([("submit", 0, 0)], "reads", max_replays=-1), ArgumentError,
     "max_replays=-1"),
    (lambda: t.shrink([("submit", 0, 0)], "nope"), ArgumentError, "oracle='nope'"),
    (lambda: t.shrink([("submit", 0, 0)], "reads"), ArgumentError, "nothing to shrink"),
    (lambda: t.shrink([("submit", 0, 0)], "reads", sed=1), ArgumentError, "['sed']"),
    (lambda: t.shrink([("teleport", 0, 0)], "reads"), ArgumentError, "schedule[0]"),
    (lambda: t.Launch(("a",), [0], [1], [0, 1], [0], [0], kind="copy"), ArgumentError,
     "'step' or 'transfer'"),
    (lambda: t.Launch(("a",), [0, 1], [1], [0, 1], [0], [0]), ArgumentError,
     "a Launch of 1 requests"),
])
def test_bad_arguments_are_argument_errors_naming_them(call: Any, error: type,
                                                       message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)
    assert isinstance(info.value, KVMemError) and isinstance(info.value, (ValueError, TypeError))


def test_save_reproducer_refuses_what_would_not_replay_and_writes_nothing(
        tmp_path: Path) -> None:
    failure = t.FuzzFailure("fences", "x")
    good = [("submit", 0, 0), ("launch", 0, 0)]
    for kwargs, error, message in [
        ({"schedule": [("teleport", 0, 0)]}, ArgumentError, "schedule[0]"),
        ({"schedule": "submit"}, ArgumentTypeError, "schedule=str"),
        ({"seed": -1}, ArgumentError, "seed=-1"),
        ({"engine": t.ManagerEngine}, ArgumentTypeError, "engine="),
        ({"fault": "nope"}, ArgumentError, "no fault 'nope'"),
        ({"failure": "fences"}, ArgumentTypeError, "failure='fences'"),
        ({"config": "huge"}, ArgumentError, "no fuzz config preset"),
    ]:
        args = {"schedule": good, "failure": failure, "engine": "manager",
                "fault": "retire_at_launch", "seed": 0, "config": "small", **kwargs}
        with pytest.raises(error) as info:
            t.save_reproducer(tmp_path / "out", **args)
        assert message in str(info.value), kwargs
        assert not (tmp_path / "out").exists()
    # A config as replay takes it (a preset name) is fine, and the file replays.
    path = t.save_reproducer(tmp_path / "out", good, failure, "manager", "retire_at_launch", 0,
                             "small")
    assert "'num_pages': 48" in path.read_text()


def test_a_campaign_whose_weights_stop_applying_ends_instead_of_hanging() -> None:
    def hung(*_: Any) -> None:
        raise AssertionError("the campaign hangs: no move applies any more")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:  # only submit is drawn, and it stops applying once target_running requests are alive
        r = t.campaign("manager", {"weights": _zero_weights(submit=1)}, None, 0, 10**6)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert r.failure is None and r.moves == t.FuzzConfig().target_running


def test_replay_gives_the_same_failure_and_shrink_never_lengthens_it() -> None:
    r = t.campaign("manager", "small", "commit_on_abort", 0, max_moves=1500)
    assert r.failure is not None
    kw = {"engine": "manager", "fault": "commit_on_abort", "seed": 0, "config": "small"}
    for _ in range(2):
        with pytest.raises(t.FuzzFailure) as e:
            t.replay(r.schedule, **kw)
        assert (e.value.oracle, e.value.move, e.value.detail) == \
            (r.failure.oracle, r.failure.move, r.failure.detail)
    small, failure = t.shrink(r.schedule, r.failure.oracle, max_replays=60, **kw)
    assert len(small) <= len(r.schedule) and failure.oracle == r.failure.oracle
    with pytest.raises(t.FuzzFailure) as again:
        t.replay(small, **kw)
    assert again.value.oracle == failure.oracle
    assert t.shrink(r.schedule, r.failure.oracle, max_replays=0, **kw)[0] == \
        r.schedule[: r.failure.move + 1]  # no replay left: the schedule cut at the failure


def test_hunt_without_a_deadline_depends_only_on_its_arguments() -> None:
    a, b = (t.hunt("tenant_salt_dropped", "manager", "small", seed=1, shrink_replays=30)
            for _ in range(2))
    assert a.detected and (a.schedule, a.moves, a.detected_by, a.seed) == \
        (b.schedule, b.moves, b.detected_by, b.seed)


def test_a_move_that_does_not_apply_changes_nothing() -> None:
    run = t.Run("manager", "small", None, 0)
    for name in ("complete", "retire", "finish", "copy", "transfer", "abort", "inject"):
        assert run.step(name, 3, 4) is False
    assert run.num_moves == 0 and run.alive == {} and len(run.engine.manager.running) == 0


def test_fuzz_config_presets_and_from_dict() -> None:
    bench = t.FuzzConfig.preset("bench")
    assert (bench.num_pages, bench.page_size, bench.target_running, bench.max_in_flight) == \
        (4096, 16, 64, 2)
    assert t.FuzzConfig.preset("small").to_dict() == t.FuzzConfig().to_dict()
    for cfg in (bench, t.FuzzConfig()):  # through JSON: tuples come back as lists
        back = t.FuzzConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert back.to_dict() == cfg.to_dict() and back.namespaces == cfg.namespaces
    part = t.FuzzConfig.from_dict({"num_pages": 20, "prompt_len": [2, 8]})
    assert part.num_pages == 20 and part.prompt_len == (2, 8)
    assert part.page_size == t.FuzzConfig().page_size


def test_the_engine_protocol_is_what_the_doc_draws() -> None:
    for method in ("submit", "abort", "launch", "retire", "finish", "fork", "preempt",
                   "resume", "receive", "clear_cache", "check"):
        assert callable(getattr(t.FuzzEngine, method)), method
        assert f"{method}(" in DOC or method in DOC
    for attr in ("capabilities", "stream_ordered", "max_in_flight"):
        assert hasattr(t.FuzzEngine, attr)
    assert t.ManagerEngine(t.FuzzConfig()).max_in_flight == 2  # two steps in flight
    assert t.ToyEngineAdapter(t.FuzzConfig()).max_in_flight == 0  # synchronous
    assert "writes_first" in t.Launch.__slots__


def test_max_in_flight_0_runs_an_adapter_synchronously() -> None:
    # MiniServe's planted race needs a step in flight; run synchronously it cannot happen.
    tutorial = load_tutorial()

    class Synchronous(tutorial.MiniServeAdapter):  # type: ignore[name-defined,misc]
        def __init__(self, config: t.FuzzConfig) -> None:
            super().__init__(config)
            self.max_in_flight = 0

    r = t.campaign(Synchronous, "small", None, 0, 1500)
    assert r.failure is None and r.moves >= 1500
    assert t.campaign(tutorial.MiniServeAdapter, "small", None, 0, 1500).failure is not None


def test_the_vllm_engines_without_vllm_say_what_is_missing(
        capsys: pytest.CaptureFixture[str]) -> None:
    if "vllm" in t.ENGINES:
        pytest.skip("vLLM is installed")
    for argv in (["--engine", "vllm-async", "--moves", "10"], ["--profile", "ci-vllm"]):
        status, out, err = cli(capsys, *argv)
        assert status == 2 and out == "" and "needs vLLM" in err
    with pytest.raises(ArgumentError, match="registered only where vLLM is installed"):
        t.campaign("vllm")


def test_importing_kvmem_testing_never_imports_vllm() -> None:
    code = "import sys, kvmem.testing; print(any(m.split('.')[0] == 'vllm' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "False"


def test_the_tutorial_prints_what_the_doc_shows_and_the_adapter_is_under_40_lines(
        capsys: pytest.CaptureFixture[str]) -> None:
    load_tutorial().main()
    out = capsys.readouterr().out.splitlines()
    tutorial = DOC[DOC.index("## Tutorial") :]
    shown = re.findall(r"```\n(MiniServe:.*?)```", tutorial, flags=re.S)[0].splitlines()
    assert out[:2] == shown
    assert "after 69 moves; shrunk to 3 moves" in shown[0]
    example = (ROOT / "examples" / "fuzz_tutorial.py").read_text()
    adapter = example[example.index("class MiniServeAdapter") : example.index("class Fixed")]
    assert len(adapter.rstrip().splitlines()) < 40 and "under 40 lines" in DOC


# The speculative manager engine's faults: oracle, moves to find, shrunk-to length (the doc's).
SPEC_FAULTS = {"draft_lengths_kept": ("verify", 163, 8),
               "rejected_drafts_committed": ("reads", 1399, 24)}


def test_the_speculative_faults_are_found_by_their_oracle_and_shrunk_as_the_doc_says() -> None:
    """Guards the draft faults: an engine whose kernel lengths still count rejected drafts
    (kvmem's verify sees a read of rejected slots after the rollback), and one that commits
    rejected drafts (a later read finds a draft's K/V where the true token's must be)."""
    assert [n for n, f in CATALOG.items() if f.engines == ("manager-spec",)] == list(SPEC_FAULTS)
    section = DOC[DOC.index("### Speculative decoding") : DOC.index("### On the disaggregated")]
    for name, (oracle, moves, length) in SPEC_FAULTS.items():
        assert CATALOG[name].expected == oracle and CATALOG[name].side == "engine"
        r = t.hunt(name, "manager-spec", "small", seed=0, max_campaigns=25,
                   moves_per_campaign=1500, shrink_replays=100)
        assert r.detected and r.detected_by == oracle, (name, r)
        assert (r.moves, r.schedule_len) == (moves, length), (name, r.moves, r.schedule_len)
        assert f"| `{name}` | {', '.join(map(str, CATALOG[name].bugs))} |" in section
        assert f"| `{oracle}` | {moves} | {length} |" in section
        with pytest.raises(t.FuzzFailure) as e:  # the shrunk schedule still fails
            t.replay(r.schedule, "manager-spec", name, r.seed, "small")
        assert e.value.oracle == oracle
        if name == "rejected_drafts_committed":
            assert "a rejected draft's K/V" in str(e.value)


def test_a_fault_free_run_with_speculation_is_silent_and_rejects_drafts() -> None:
    """The speculative engine rejects drafts (their slots hold draft values) and no oracle
    fires: kvmem's reject leaves no rejected slot for a later step to read."""
    for seed in range(2):
        r = t.campaign("manager-spec", "small", None, seed, max_moves=2000)
        assert r.failure is None, r.failure
        run = t.replay(r.schedule, "manager-spec", None, seed, "small")
        assert run.engine.num_rejected > 50
        assert run.timeline.counts["reads"] > 100 and run.timeline.counts["full_checks"] > 10
        assert all(v > 0 for v in run.engine.values.ran.values())


def test_a_request_waits_for_its_drafts_verdict_while_another_op_finishes() -> None:
    """Guards the speculative engine's bookkeeping: finishing an op that lists a request must
    not end the wait of that request's own speculative step still in flight (its next step was
    launched before the verdict and the rejected drafts' page leaked: ``refcounts``)."""
    schedule = [("submit", 0, 732729), ("submit", 936754, 943162), ("launch", 63955, 0),
                ("launch", 810677, 0), ("complete", 0, 0), ("complete", 0, 0),
                ("launch", 373655, 0), ("launch", 0, 0), ("finish", 0, 0), ("finish", 0, 0),
                ("complete", 0, 0), ("launch", 0, 0)]
    run = t.replay(schedule, "manager-spec", None, 10**6, "small")
    assert run.engine.num_rejected >= 2
