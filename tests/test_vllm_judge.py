"""The judge (kvmem.integrations.vllm.judge): fetching and checking vLLM's source distribution,
the offline model cache, verdicts, reason classes read from real exceptions, the report, and the
pytest plugin that swaps kvmem's schedulers in. No network and no vLLM source distribution: the
judge's real run is `python -m kvmem.integrations.vllm judge` (docs/vllm.md)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from kvmem import KVMemError
from kvmem.integrations.vllm import VllmOrderPrefixCache, vllm_import_error
from kvmem.integrations.vllm import judge as jd
from kvmem.integrations.vllm._judge_plugin import describe_error, side_of

ROOT = Path(__file__).resolve().parent.parent
needs_vllm = pytest.mark.skipif(vllm_import_error() is not None,
                                reason="vLLM 0.33 is not importable (see setup_vllm_cpu.sh)")


# -- the source distribution ----------------------------------------------------------------------

def test_check_sha256_refuses_a_wrong_digest(tmp_path: Path) -> None:
    path = tmp_path / "x.tar.gz"
    path.write_bytes(b"not vllm")
    right = hashlib.sha256(b"not vllm").hexdigest()
    jd.check_sha256(path, right)
    jd.check_sha256(path, right.upper())  # hex digits in either case
    with pytest.raises(KVMemError, match=f"sha256 {right}, expected {jd.SDIST_SHA256}"):
        jd.check_sha256(path)


def test_fetch_sdist_refuses_a_cached_copy_with_a_wrong_digest_and_keeps_it(
        tmp_path: Path) -> None:
    """A cached file that is not vLLM 0.33.0's sdist is neither used nor deleted (it may be the
    user's); nothing is downloaded."""
    (tmp_path / jd.SDIST).write_bytes(b"truncated")
    with pytest.raises(KVMemError, match="delete the file to download it again"):
        jd.fetch_sdist(tmp_path, download=False)
    assert (tmp_path / jd.SDIST).read_bytes() == b"truncated"


def test_fetch_sdist_without_download_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KVMemError, match="missing and downloading is off"):
        jd.fetch_sdist(tmp_path, download=False)
    assert list(tmp_path.iterdir()) == []


def test_sdist_entry_reads_the_simple_index() -> None:
    index = {"files": [
        {"filename": "vllm-0.33.0-cp38-abi3-manylinux_2_31_x86_64.whl", "url": "u1",
         "hashes": {"sha256": "aa"}},
        {"filename": jd.SDIST, "url": "https://files.example/vllm-0.33.0.tar.gz",
         "hashes": {"sha256": jd.SDIST_SHA256}}]}
    assert jd.sdist_entry(index) == ("https://files.example/vllm-0.33.0.tar.gz",
                                     jd.SDIST_SHA256)
    with pytest.raises(KVMemError, match=r"does not list vllm-0\.33\.0\.tar\.gz"):
        jd.sdist_entry({"files": index["files"][:1]})
    with pytest.raises(KVMemError, match="without a sha256"):
        jd.sdist_entry({"files": [{"filename": jd.SDIST, "url": "u", "hashes": {}}]})


def _tar(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_tests_takes_only_tests(tmp_path: Path) -> None:
    """vLLM's source in the archive must not land beside its tests: on PYTHONPATH it would
    shadow the installed vLLM."""
    sdist = tmp_path / "sdist.tar.gz"
    _tar(sdist, {"vllm-0.33.0/tests/v1/core/test_a.py": b"def test_a(): pass\n",
                 "vllm-0.33.0/vllm/__init__.py": b"raise ImportError\n",
                 "vllm-0.33.0/setup.py": b""})
    root = jd.extract_tests(sdist, tmp_path / "cache")
    assert (root / "tests/v1/core/test_a.py").read_text() == "def test_a(): pass\n"
    assert not (root / "vllm").exists() and not (root / "setup.py").exists()
    assert jd.extract_tests(sdist, tmp_path / "cache") == root  # once


def test_extract_tests_refuses_an_archive_without_tests(tmp_path: Path) -> None:
    sdist = tmp_path / "sdist.tar.gz"
    _tar(sdist, {"vllm-0.33.0/vllm/__init__.py": b""})
    with pytest.raises(KVMemError, match=r"holds no vllm-0\.33\.0/tests/"):
        jd.extract_tests(sdist, tmp_path / "cache")


def test_hf_cache_serves_every_model_config_offline(tmp_path: Path) -> None:
    hub_lib = pytest.importorskip("huggingface_hub")
    hub = jd.write_hf_cache(tmp_path / "hf")
    for repo, config in jd.MODEL_CONFIGS.items():
        path = hub_lib.try_to_load_from_cache(repo, "config.json", cache_dir=hub)
        assert isinstance(path, str), repo
        assert json.loads(Path(path).read_text()) == config


# -- verdicts and reasons -------------------------------------------------------------------------

@pytest.mark.parametrize("on_vllm, on_kvmem, expected", [
    ("passed", "passed", jd.PASS_BOTH), ("failed", "failed", jd.FAIL_BOTH),
    ("passed", "failed", jd.FAIL_KVMEM), ("failed", "passed", jd.PASS_KVMEM),
    ("passed", None, jd.FAIL_KVMEM), (None, "passed", jd.PASS_KVMEM),
    ("skipped", "passed", jd.SKIPPED), ("passed", "skipped", jd.SKIPPED)])
def test_verdict(on_vllm: str | None, on_kvmem: str | None, expected: str) -> None:
    assert jd.verdict(on_vllm, on_kvmem) == expected


REFUSAL = ("kvmem's vLLM scheduler does not support speculative_config (speculative decoding) "
           "(found SpeculativeConfig); it supports one full-attention KV cache group, prefix "
           "caching on or off. Unset speculative_config or use vLLM's own Scheduler.")


def _error(exc: BaseException, raised_at: str) -> dict[str, Any]:
    try:
        raise exc
    except BaseException as caught:  # describe what was raised, traceback and all
        return describe_error(caught, raised_at)


def test_a_refusal_is_classed_by_the_feature_it_names() -> None:
    error = _error(KVMemError(REFUSAL), "kvmem.integrations.vllm._scheduler")
    assert error["kvmem_error"] and error["raised_in"] == "kvmem"
    assert jd.classify(error) == "refused: speculative_config (speculative decoding)"
    # The same words outside a KVMemError are no refusal of kvmem's.
    assert jd.classify(_error(ValueError(REFUSAL), "vllm.config")) == jd.OTHER


@needs_vllm
def test_the_refusal_pattern_reads_the_schedulers_own_refusals() -> None:
    """The classes come from kvmem's real messages: a change to their wording must show here,
    not as every refusal turning into `other`."""
    from kvmem.integrations.vllm import _scheduler

    for option, found in (("kv_transfer_config (KV connectors)", "KVTransferConfig"),
                          ("prompt embeddings (prompt_embeds)", "request 'r' has them")):
        error = _error(_scheduler._refuse(option, found), "kvmem.integrations.vllm._scheduler")
        assert jd.classify(error) == f"refused: {option}"


def test_reading_a_missing_attribute_of_kvmems_object_is_classed_by_reader() -> None:
    cache = VllmOrderPrefixCache()
    with pytest.raises(AttributeError) as caught:
        getattr(cache, "block_pool")  # noqa: B009 (as the test would read it)
    exc = caught.value
    in_test = describe_error(exc, "tests.v1.core.test_scheduler")
    assert in_test["attribute"] == "block_pool"
    assert in_test["attribute_of"] == (
        "kvmem.integrations.vllm._prefix_cache.VllmOrderPrefixCache")
    assert jd.classify(in_test) == "the test reads VllmOrderPrefixCache.block_pool"
    in_vllm = describe_error(exc, "vllm.distributed.aux_output_connector.connector")
    assert in_vllm["raised_in"] == "vllm"
    assert jd.classify(in_vllm) == ("vllm.distributed.aux_output_connector.connector reads "
                                    "VllmOrderPrefixCache.block_pool")
    assert jd.classify(in_test, built_scheduler=False) == (
        "the test builds the scheduler without __init__")
    # An AttributeError on anything but kvmem's objects is no such reason.
    with pytest.raises(AttributeError) as caught:
        getattr(object(), "block_pool")  # noqa: B009
    assert jd.classify(describe_error(caught.value, "tests.v1.core.test_scheduler")) == jd.OTHER


def test_a_wrong_result_is_other() -> None:
    assert jd.classify(_error(AssertionError("assert 4 == 2"), "tests.v1.core.x")) == jd.OTHER
    assert jd.classify(None) == jd.OTHER


@pytest.mark.parametrize("module, side", [
    ("tests.v1.core.utils", "test"), ("kvmem.integrations.vllm._scheduler", "kvmem"),
    ("vllm.v1.core.sched.scheduler", "vllm"), ("unittest.mock", "other"),
    ("vllmx", "other"), ("tests", "test")])
def test_side_of(module: str, side: str) -> None:
    assert side_of(module) == side


def _record(tests: dict[str, tuple[str, list[str], dict[str, Any] | None]]) -> dict[str, Any]:
    return {"tests": {n: {"outcome": o, "schedulers": s, "error": e, "integrity_failures": 0}
                      for n, (o, s, e) in tests.items()}, "collect_errors": {}}


def test_judge_counts_verdicts_and_reasons() -> None:
    refused = _error(KVMemError(REFUSAL), "kvmem.integrations.vllm._scheduler")
    wrong = _error(AssertionError("assert 4 == 2"), "tests.v1.core.test_scheduler")
    on_vllm = _record({"t::a": ("passed", ["Scheduler"], None),
                       "t::b": ("passed", ["Scheduler"], None),
                       "t::c": ("passed", ["AsyncScheduler"], None),
                       "t::d": ("passed", [], None),
                       "t::e": ("failed", [], wrong),
                       "t::f": ("skipped", [], None)})
    on_kvmem = _record({"t::a": ("passed", ["KVMemScheduler"], None),
                        "t::b": ("failed", ["KVMemScheduler"], refused),
                        "t::c": ("failed", ["KVMemAsyncScheduler"], wrong),
                        "t::d": ("passed", [], None),
                        "t::e": ("failed", [], wrong),
                        "t::f": ("skipped", [], None)})
    report = jd.judge(on_vllm, on_kvmem)
    assert report["build_a_scheduler"] == {
        "tests": 3, "pass_on_vllm": 3, "pass_on_kvmem": 1, jd.PASS_BOTH: 1, jd.FAIL_BOTH: 0,
        jd.FAIL_KVMEM: 2, jd.PASS_KVMEM: 0, jd.SKIPPED: 0}
    assert report["all_tests"]["tests"] == 6 and report["all_tests"][jd.FAIL_BOTH] == 1
    assert report["all_tests"][jd.SKIPPED] == 1 and report["all_tests"][jd.PASS_BOTH] == 2
    assert report["kvmem_only_failures_by_reason"] == {
        "refused: speculative_config (speculative decoding)": 1, jd.OTHER: 1}
    assert report["tests"]["t::c"]["reason"] == jd.OTHER
    assert report["integrity_failures"] == 0
    assert "reason" not in report["tests"]["t::e"]  # fails on vLLM too
    text = jd.format_report(report)
    assert "| tests that build a scheduler | 3 | 3 | 1 | 1 | 0 | 2 | 0 | 0 |" in text
    assert "other: t::c\n    AssertionError: assert 4 == 2" in text
    assert "t::b" not in text
    assert ("- **refused: speculative_config (speculative decoding)** (1): t: `b`"
            in jd.format_report(report, list_tests=True))
    assert jd.unexpected(report, expected_other=()) == ["t::c fails only on kvmem (other)"]
    assert jd.unexpected(report, expected_other=("t::c",)) == []
    assert jd.unexpected(report, expected_other=("t::c", "t::a")) == [
        "t::a was expected to fail only on kvmem (other); it is pass on both"]


# -- the plugin, in a pytest of its own ------------------------------------------------------------

PROBE = '''
import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler


def test_classes():
    from vllm.v1.core.sched.diffusion_scheduler import DiffusionScheduler
    from kvmem.integrations.vllm import KVMemAsyncScheduler, KVMemScheduler
    assert Scheduler is KVMemScheduler and AsyncScheduler is KVMemAsyncScheduler
    assert not issubclass(DiffusionScheduler, KVMemScheduler)  # vLLM's own stays vLLM's


def _build(**spec):
    from vllm.v1.structured_output import StructuredOutputManager
    from kvmem.integrations.vllm.conformance import SchedulerSpec, make_vllm_config
    vc, kc = make_vllm_config(SchedulerSpec(num_blocks=40, block_size=4, max_num_seqs=4,
                                            max_num_batched_tokens=32, max_model_len=128))
    for name, value in spec.items():
        object.__setattr__(vc, name, value)
    return Scheduler(vllm_config=vc, kv_cache_config=kc, block_size=4,
                     structured_output_manager=StructuredOutputManager(vc))


def test_builds():
    _build()


def test_refused():
    _build(ec_transfer_config=object())


def test_reads_block_pool():
    _build().kv_cache_manager.block_pool


def test_skipped():
    pytest.skip("no")


def test_mocked_manager():
    from unittest.mock import Mock
    _build().kv_cache_manager = Mock()


def test_integrity_abort():
    from kvmem.integrations.vllm.conformance import Driver, SchedulerSpec, StreamRequest
    from kvmem.testing import faults
    d = Driver(SchedulerSpec(num_blocks=40, block_size=4, max_num_seqs=4,
                             max_num_batched_tokens=32, max_model_len=128), kvmem=True)
    for i, rid in enumerate(("r2", "r7", "r8")):
        d.add(StreamRequest(rid, tuple(range(100 * i + 10, 100 * i + 19)), 12))
    d.step()
    d.step()
    faults.free_behind_back(d.sched.kvmem, sorted(d.sched.kvmem.running)[1], 1)
    d.sched.schedule()  # aborts the request whose page was freed under it
'''


@needs_vllm
def test_the_plugin_swaps_kvmems_schedulers_in_and_records_each_test(tmp_path: Path) -> None:
    # Where vLLM's tests are (a package tests.v1.core), so their frames read as the test's.
    core = tmp_path / "tests" / "v1" / "core"
    core.mkdir(parents=True)
    for folder in (core, core.parent, core.parent.parent):
        (folder / "__init__.py").write_text("")
    (core / "test_probe.py").write_text(PROBE)
    out = tmp_path / "record.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]),
               OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--noconftest", "-p", "kvmem.integrations.vllm._judge_plugin",
                    f"--kvmem-judge-out={out}", "--kvmem-judge-swap", "tests/v1/core"],
                   cwd=tmp_path, env=env, capture_output=True, timeout=600)
    record = json.loads(out.read_text())
    tests = {name.split("::")[1]: t for name, t in record["tests"].items()}
    assert record["swap"] is True
    assert {n: t["outcome"] for n, t in tests.items()} == {
        "test_classes": "passed", "test_builds": "passed", "test_refused": "failed",
        "test_reads_block_pool": "failed", "test_skipped": "skipped",
        "test_integrity_abort": "passed", "test_mocked_manager": "passed"}
    assert tests["test_builds"]["schedulers"] == ["KVMemScheduler"]
    assert tests["test_builds"]["integrity_failures"] == 0
    assert tests["test_integrity_abort"]["integrity_failures"] == 1
    # A test that swaps the manager for a Mock has no kvmem manager to count (the count once
    # summed the Mock's attributes and broke the run).
    assert tests["test_mocked_manager"]["integrity_failures"] == 0
    assert tests["test_classes"]["schedulers"] == []
    # A refused scheduler counts as built: it entered kvmem's __init__.
    assert tests["test_refused"]["schedulers"] == ["KVMemScheduler"]
    assert jd.classify(tests["test_refused"]["error"]) == (
        "refused: ec_transfer_config (encoder cache connectors)")
    assert jd.classify(tests["test_reads_block_pool"]["error"]) == (
        "the test reads kv_cache_manager.block_pool")


@needs_vllm
def test_the_command_without_its_source_distribution_says_so_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Also guards the options' defaults: with ``--expect-other``'s default an empty list,
    kvmem's parser took it for a ``--`` given as its value and refused every run without it."""
    from kvmem.integrations.vllm.__main__ import main

    assert main(["judge", "--no-download", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing and downloading is off" in err
    assert list(tmp_path.iterdir()) == []
