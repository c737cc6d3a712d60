"""vLLM's own core tests as the judge of kvmem's scheduler classes.

vLLM 0.33.0's ``tests/v1/core`` (from its source distribution on PyPI, the same commit as the
wheel) run twice with pytest, test bodies unchanged: once as they are (vLLM's ``Scheduler`` /
``AsyncScheduler``), once with :class:`~kvmem.integrations.vllm.KVMemScheduler` /
:class:`~kvmem.integrations.vllm.KVMemAsyncScheduler` swapped in by a pytest plugin
(:mod:`kvmem.integrations.vllm._judge_plugin`). Each test gets a verdict, and a test that fails
only on kvmem a reason class read from its exception::

    PYTHONPATH=/tmp/vllm_env/site:/tmp/vllm_env/deps python -m kvmem.integrations.vllm judge

What it sets up, once, in a cache folder (``~/.cache/kvmem/vllm-judge`` by default):

- ``vllm-0.33.0.tar.gz``: downloaded from the URL PyPI's simple index lists for it, checked
  against the sha256 pinned here (and listed there). vLLM's test code is never copied into
  kvmem: only this folder holds it, extracted from the archive (``tests/`` only, so vLLM's
  source in the archive cannot shadow the installed package).
- ``hf/``: a Hugging Face cache with a ``config.json`` for each model the tests name (no
  weights, no tokenizer), so ``ModelConfig`` builds offline (``HF_HUB_OFFLINE=1``).
- ``deps/``: what vLLM's model inspection imports for the hybrid (Qwen3-Next) tests and the
  scheduler environment lacks (``compressed-tensors``, ``loguru``), pinned, with
  ``pip --target``. Without it those tests fail on both runs.

pytest runs with ``--noconftest`` (vLLM's ``tests/conftest.py`` imports the whole engine) and
``VLLM_TARGET_DEVICE=cpu``; the two runs go side by side.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import resource
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from kvmem.errors import KVMemError

logger = logging.getLogger(__name__)

__all__ = ["SDIST", "SDIST_SHA256", "check_sha256", "classify", "extract_tests", "fetch_sdist",
           "format_listing", "format_report", "judge", "run", "unexpected", "verdict",
           "write_hf_cache"]

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
TESTS = "tests/v1/core"
DEFAULT_CACHE = Path("~/.cache/kvmem/vllm-judge").expanduser()
# vLLM 0.33.0 pins compressed-tensors; loguru is its dependency.
DEPS = ("compressed-tensors==0.17.0", "loguru==0.8.0")

# The models tests/v1/core names, as far as vLLM's config reads them (architecture, sizes,
# context). Multimodal ones also need torchvision to be inspected; where it is missing their
# tests fail on both runs.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "ffn_dim": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "torch_dtype": "float16", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1},
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 1024,
        "ffn_dim": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 512,
        "do_layer_norm_before": False, "torch_dtype": "float16", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1},
    "hmellor/tiny-random-LlamaForCausalLM": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32"},
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 4096,
        "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
        "num_hidden_layers": 32, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "sliding_window": 32768,
        "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 151643,
        "eos_token_id": 151643},
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 28, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645},
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "intermediate_size": 5120, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 48,
        "vocab_size": 151936, "max_position_embeddings": 262144, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mlp_only_layers": [], "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645},
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 36, "vocab_size": 151936,
        "max_position_embeddings": 128000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "sliding_window": 32768, "use_sliding_window": False,
        "max_window_layers": 70, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
        "video_token_id": 151656, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                          "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                          "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                          "spatial_patch_size": 14, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                          "temporal_patch_size": 2},
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645},
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "image_token_index": 32000, "pad_token_id": 32001, "projector_hidden_act": "gelu",
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "vocab_size": 32064, "torch_dtype": "float16",
        "text_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "vocab_size": 32064, "torch_dtype": "float16"},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024,
                          "image_size": 336, "intermediate_size": 4096,
                          "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14,
                          "projection_dim": 768, "vocab_size": 32000}},
}
_REVISION = "0" * 40  # the snapshot every fake model's refs/main names


# -- the source distribution ----------------------------------------------------------------------

def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str = SDIST_SHA256) -> None:
    """Raise :class:`KVMemError` unless the file's sha256 is ``expected`` (hex)."""
    found = sha256_of(path)
    if found != expected.lower():
        raise KVMemError(f"{path}: sha256 {found}, expected {expected} (vLLM {VERSION}'s "
                         f"source distribution); delete the file to download it again")


def sdist_entry(index: dict[str, Any], filename: str = SDIST) -> tuple[str, str]:
    """``(url, sha256)`` of ``filename`` in a PEP 691 simple index page (JSON)."""
    for entry in index.get("files", ()):
        if entry.get("filename") == filename:
            sha = entry.get("hashes", {}).get("sha256")
            if not sha:
                raise KVMemError(f"PyPI's simple index lists {filename} without a sha256")
            return entry["url"], sha
    raise KVMemError(f"PyPI's simple index ({SIMPLE_INDEX}) does not list {filename}")


def fetch_sdist(cache_dir: Path, download: bool = True) -> Path:
    """The checked ``vllm-0.33.0.tar.gz`` in ``cache_dir``, downloaded first if it is not there.

    The download goes to a temporary name and is renamed only once its sha256 matches both the
    pinned digest and the one PyPI's simple index lists."""
    path = cache_dir / SDIST
    if path.exists():
        check_sha256(path)
        return path
    if not download:
        raise KVMemError(f"{path} is missing and downloading is off (--no-download)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    request = urllib.request.Request(SIMPLE_INDEX,
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        url, listed = sdist_entry(json.load(response))
    if listed != SDIST_SHA256:
        raise KVMemError(f"PyPI lists {SDIST} with sha256 {listed}, expected {SDIST_SHA256}")
    logger.info("downloading %s", url)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as f:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                f.write(chunk)
        check_sha256(part)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


def extract_tests(sdist: Path, cache_dir: Path) -> Path:
    """Extract the archive's ``tests/`` (only) under ``cache_dir``; returns the folder that holds
    ``tests/`` (pytest's root for the runs)."""
    root = cache_dir / f"vllm-{VERSION}"
    done = root / ".extracted"
    if done.exists():
        return root
    prefix = f"vllm-{VERSION}/tests/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise KVMemError(f"{sdist} holds no {prefix}")
        tar.extractall(cache_dir, members=members, filter="data")
    done.write_text(SDIST_SHA256)
    return root


def write_hf_cache(hf_home: Path) -> Path:
    """A Hugging Face cache under ``hf_home`` with one ``config.json`` per model of
    :data:`MODEL_CONFIGS`; returns the hub folder (``HF_HUB_CACHE``)."""
    hub = hf_home / "hub"
    for repo, config in MODEL_CONFIGS.items():
        model = hub / f"models--{repo.replace('/', '--')}"
        snapshot = model / "snapshots" / _REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (model / "refs").mkdir(exist_ok=True)
        (model / "refs" / "main").write_text(_REVISION)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
    return hub


def install_deps(cache_dir: Path) -> Path | None:
    """:data:`DEPS` in ``cache_dir/deps`` (once); None (and a warning) when pip fails."""
    deps = cache_dir / "deps"
    done = deps / ".installed"
    if done.exists() and done.read_text() == "\n".join(DEPS):
        return deps
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--upgrade",
                             "--no-deps", "--target", str(deps), *DEPS],
                            capture_output=True, text=True)
    if result.returncode != 0:
        logger.warning("pip could not install %s (the hybrid-model tests will fail on both "
                       "runs): %s", " ".join(DEPS), result.stderr.strip()[-500:])
        return None
    done.write_text("\n".join(DEPS))
    return deps


# -- verdicts -------------------------------------------------------------------------------------

PASS_BOTH = "pass on both"
FAIL_BOTH = "fail on both"
FAIL_KVMEM = "fail only on kvmem"
PASS_KVMEM = "pass only on kvmem"
SKIPPED = "skipped"
VERDICTS = (PASS_BOTH, FAIL_BOTH, FAIL_KVMEM, PASS_KVMEM, SKIPPED)
OTHER = "other"

_REFUSAL = re.compile(r"does not support (?P<what>.+?) \(found ")
_CONNECTOR_ONLY = re.compile(r"serves (?P<what>.+?), which kvmem's vLLM adapter refuses")


def verdict(vllm_outcome: str | None, kvmem_outcome: str | None) -> str:
    """One of :data:`VERDICTS`; a test missing from a run (its module failed to import there)
    counts as failed in it."""
    if SKIPPED in (vllm_outcome, kvmem_outcome):
        return SKIPPED
    vllm_ok, kvmem_ok = vllm_outcome == "passed", kvmem_outcome == "passed"
    if vllm_ok and kvmem_ok:
        return PASS_BOTH
    if vllm_ok:
        return FAIL_KVMEM
    return PASS_KVMEM if kvmem_ok else FAIL_BOTH


def classify(error: dict[str, Any] | None, built_scheduler: bool = True) -> str:
    """The reason class of a failure on kvmem, from its exception as the plugin recorded it
    (``built_scheduler``: whether the test entered a scheduler's ``__init__`` on kvmem):

    - ``refused: WHAT``: kvmem's refusal (a ``KVMemError``) of a feature, named as the refusal
      names it (``kv_transfer_config (KV connectors)``, ``speculative_config (speculative
      decoding)``...);
    - ``the test reads kv_cache_manager.NAME`` / ``vllm.MODULE reads kv_cache_manager.NAME``: an
      ``AttributeError`` on one of kvmem's objects (the adapter is the scheduler's
      ``kv_cache_manager``), raised in the test's code or in that vLLM module's: they read vLLM's
      own manager's private state (``block_pool``, ``coordinator``);
    - ``the test builds the scheduler without __init__``: an ``AttributeError`` on one of
      kvmem's objects in a test that built no scheduler through ``__init__``
      (``object.__new__``);
    - :data:`OTHER`: anything else (a wrong result, a kvmem error that is no refusal).
    """
    if error is None:
        return OTHER
    message = error.get("message", "")
    if error.get("kvmem_error"):
        found = _REFUSAL.search(message) or _CONNECTOR_ONLY.search(message)
        if found:
            return f"refused: {found['what']}"
    owner = error.get("attribute_of") or ""
    if error.get("type") == "AttributeError" and owner.startswith("kvmem.") and error.get(
            "attribute"):
        if not built_scheduler:
            return "the test builds the scheduler without __init__"
        reader = ("the test" if error.get("raised_in") == "test"
                  else error.get("raised_at") or "vLLM")
        name = ("kv_cache_manager" if owner.endswith(".VllmKVCacheAdapter")
                else owner.rsplit(".", 1)[-1])
        return f"{reader} reads {name}.{error['attribute']}"
    return OTHER


def judge(vllm_record: dict[str, Any], kvmem_record: dict[str, Any]) -> dict[str, Any]:
    """The report of two runs' records (the plugin's JSON): per test its outcomes, verdict,
    whether it builds a scheduler (in either run) and, failing only on kvmem, its reason class
    and error; totals over all tests and over those that build a scheduler; kvmem's integrity
    aborts over the kvmem run."""
    vllm_tests, kvmem_tests = vllm_record["tests"], kvmem_record["tests"]
    tests: dict[str, dict[str, Any]] = {}
    for nodeid in sorted(set(vllm_tests) | set(kvmem_tests)):
        on_vllm, on_kvmem = vllm_tests.get(nodeid, {}), kvmem_tests.get(nodeid, {})
        entry = {"vllm": on_vllm.get("outcome"), "kvmem": on_kvmem.get("outcome"),
                 "builds_scheduler": bool(on_vllm.get("schedulers") or on_kvmem.get("schedulers")),
                 "kvmem_schedulers": on_kvmem.get("schedulers", [])}
        entry["verdict"] = verdict(entry["vllm"], entry["kvmem"])
        if entry["verdict"] == FAIL_KVMEM:
            entry["reason"] = classify(on_kvmem.get("error"), bool(on_kvmem.get("schedulers")))
            entry["error"] = on_kvmem.get("error")
        tests[nodeid] = entry

    def totals(selected: list[dict[str, Any]]) -> dict[str, int]:
        counts = Counter(t["verdict"] for t in selected)
        return {"tests": len(selected),
                "pass_on_vllm": sum(t["vllm"] == "passed" for t in selected),
                "pass_on_kvmem": sum(t["kvmem"] == "passed" for t in selected),
                **{v: counts[v] for v in VERDICTS}}

    builders = [t for t in tests.values() if t["builds_scheduler"]]
    reasons = Counter(t["reason"] for t in tests.values() if t["verdict"] == FAIL_KVMEM)
    return {
        "vllm_version": VERSION, "tests_path": TESTS,
        "all_tests": totals(list(tests.values())),
        "build_a_scheduler": totals(builders),
        "integrity_failures": sum(t.get("integrity_failures", 0)
                                  for t in kvmem_tests.values()),
        "kvmem_only_failures_by_reason": dict(sorted(reasons.items(),
                                                     key=lambda kv: (-kv[1], kv[0]))),
        "collect_errors": {"vllm": sorted(vllm_record.get("collect_errors", {})),
                           "kvmem": sorted(kvmem_record.get("collect_errors", {}))},
        "tests": tests,
    }


def unexpected(report: dict[str, Any], expected_other: tuple[str, ...] | list[str] = ()
               ) -> list[str]:
    """What makes the judge fail, one line each: a test that fails only on kvmem for a reason of
    class :data:`OTHER` and is not in ``expected_other``, or one in ``expected_other`` that no
    longer does (the list stays exact)."""
    problems = []
    for nodeid, t in report["tests"].items():
        if t["verdict"] == FAIL_KVMEM and t["reason"] == OTHER and nodeid not in expected_other:
            problems.append(f"{nodeid} fails only on kvmem ({OTHER})")
    for nodeid in expected_other:
        t = report["tests"].get(nodeid)
        if t is None or t["verdict"] != FAIL_KVMEM or t["reason"] != OTHER:
            now = "not run" if t is None else t["verdict"]
            if t is not None and t["verdict"] == FAIL_KVMEM:
                now = f"{FAIL_KVMEM} ({t['reason']})"
            problems.append(f"{nodeid} was expected to fail only on kvmem ({OTHER}); it is {now}")
    return problems


def format_listing(report: dict[str, Any]) -> str:
    """The tests that fail only on kvmem, one bullet per reason class (Markdown): per test file
    the test functions, ``(n)`` for n parametrizations of one."""
    lines = []
    for reason, count in report["kvmem_only_failures_by_reason"].items():
        per_file: dict[str, Counter[str]] = {}
        for nodeid, t in report["tests"].items():
            if t["verdict"] == FAIL_KVMEM and t["reason"] == reason:
                path, name = nodeid.split("::", 1)
                per_file.setdefault(path.rsplit("/", 1)[-1], Counter())[name.split("[")[0]] += 1
        files = "; ".join(
            f"{path}: " + ", ".join(f"`{name}`" + (f" ({n})" if n > 1 else "")
                                    for name, n in sorted(names.items()))
            for path, names in sorted(per_file.items()))
        lines.append(f"- **{reason}** ({count}): {files}")
    return "\n".join(lines)


def format_report(report: dict[str, Any], list_tests: bool = False) -> str:
    """The report as text: the totals table, kvmem's integrity aborts, the reasons of
    kvmem-only failures, the tests of class ``other`` with their errors and those that pass
    only on kvmem; with ``list_tests``, every kvmem-only failure by reason
    (:func:`format_listing`)."""
    cols = ("tests", "pass_on_vllm", "pass_on_kvmem", *VERDICTS)
    lines = ["| | " + " | ".join(c.replace("_", " ") for c in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for name, key in (("tests that build a scheduler", "build_a_scheduler"),
                      ("all tests", "all_tests")):
        lines.append(f"| {name} | " + " | ".join(str(report[key][c]) for c in cols) + " |")
    lines += ["", f"kvmem's integrity aborts (all tests): {report['integrity_failures']}",
              "", "| fails only on kvmem: reason | tests |", "|---|---:|"]
    lines += [f"| {r} | {n} |" for r, n in report["kvmem_only_failures_by_reason"].items()]
    for side, errors in report["collect_errors"].items():
        if errors:
            lines.append(f"\nmodules that failed to import on {side}: {', '.join(errors)}")
    if list_tests:
        lines += ["", format_listing(report)]
    for nodeid, t in report["tests"].items():
        if t["verdict"] == FAIL_KVMEM and t["reason"] == OTHER:
            error = t["error"] or {}
            lines.append(f"\n{OTHER}: {nodeid}\n    {error.get('type')}: "
                         f"{error.get('message', '')[:400]}")
        elif t["verdict"] == PASS_KVMEM:
            lines.append(f"\n{PASS_KVMEM}: {nodeid}")
    return "\n".join(lines)


# -- the two runs ---------------------------------------------------------------------------------

def _env(root: Path, hf_home: Path, deps: Path | None) -> dict[str, str]:
    import kvmem

    kvmem_root = str(Path(kvmem.__file__).resolve().parents[1])
    path = [str(root), kvmem_root, *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))]
    if deps is not None:
        path.append(str(deps))
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join(path), "VLLM_TARGET_DEVICE": "cpu",
                "HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    return env


def _pytest_command(root: Path, out: Path, swap: bool) -> list[str]:
    return [sys.executable, "-m", "pytest", TESTS, "--rootdir", str(root), "--noconftest",
            "-q", "-p", "no:cacheprovider", "-W", "ignore", "--continue-on-collection-errors",
            "-p", "kvmem.integrations.vllm._judge_plugin", f"--kvmem-judge-out={out}",
            *(["--kvmem-judge-swap"] if swap else [])]


def run(cache_dir: Path = DEFAULT_CACHE, download: bool = True, side_by_side: bool = True,
        timeout_s: float = 3600) -> dict[str, Any]:
    """Set up (once), run vLLM's tests on vLLM's schedulers and on kvmem's, and return
    :func:`judge`'s report with ``seconds`` (wall time of the two runs) and ``cpu_seconds``
    (their CPU time) added. Each run's pytest
    output is kept in ``cache_dir/runs/{vllm,kvmem}.log``."""
    cache_dir = Path(cache_dir).expanduser()
    root = extract_tests(fetch_sdist(cache_dir, download), cache_dir)
    hf_home = cache_dir / "hf"
    write_hf_cache(hf_home)
    env = _env(root, hf_home, install_deps(cache_dir))
    runs = cache_dir / "runs"
    runs.mkdir(exist_ok=True)
    start = time.perf_counter()
    cpu_start = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = {}
    for side, swap in (("vllm", False), ("kvmem", True)):
        out = runs / f"{side}.json"
        out.unlink(missing_ok=True)
        with open(runs / f"{side}.log", "w") as log:
            procs[side] = subprocess.Popen(_pytest_command(root, out, swap), cwd=root, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)
        if not side_by_side:
            procs[side].wait(timeout=timeout_s)
    for proc in procs.values():
        proc.wait(timeout=timeout_s)
    seconds = time.perf_counter() - start
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = cpu.ru_utime + cpu.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime
    records = {}
    for side, proc in procs.items():
        out = runs / f"{side}.json"
        if not out.exists():  # pytest itself failed (exit status 2+ without a session end)
            raise KVMemError(f"pytest on {side} exited with status {proc.returncode} and no "
                             f"record; see {runs / f'{side}.log'}")
        records[side] = json.loads(out.read_text())
    report = judge(records["vllm"], records["kvmem"])
    report["seconds"] = round(seconds, 1)
    report["cpu_seconds"] = round(cpu_seconds, 1)
    return report
