"""Promises of docs/vllm.md, the README's vLLM section, the docstrings of
``kvmem.integrations.vllm`` and its command, each probed where an audit found it broken (or
held but untested); the manager's are in test_doc_promises.py, the rest of the docs' in
test_doc_promises_outer.py.

Needs vLLM 0.33 importable (``bash benchmarks/setup_vllm_cpu.sh DIR`` and
``PYTHONPATH=DIR/site:DIR/deps``); skipped otherwise. The tests that need vLLM *absent* run the
command in a subprocess without it.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmem import KVMemError
from kvmem.integrations.vllm import vllm_import_error
from kvmem.integrations.vllm.conformance import (
    Driver,
    SchedulerSpec,
    StreamRequest,
    StreamSpec,
    make_vllm_config,
)

pytestmark = pytest.mark.skipif(vllm_import_error() is not None,
                                reason="vLLM 0.33 is not importable (see setup_vllm_cpu.sh)")

if vllm_import_error() is None:
    from kvmem.integrations.vllm import KVMemScheduler, VllmKVCacheAdapter

ROOT = Path(__file__).resolve().parent.parent
SPEC = SchedulerSpec(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=128)


def _build(vc: Any, kc: Any, block_size: int = 4, **kw: Any) -> Any:
    from vllm.v1.structured_output import StructuredOutputManager

    return KVMemScheduler(vllm_config=vc, kv_cache_config=kc,
                          structured_output_manager=StructuredOutputManager(vc),
                          block_size=block_size, **kw)


def _with_model(vc: Any, **attrs: Any) -> None:
    """``vc`` with a copy of its model config whose ``attrs`` read as given (the harness caches
    one ModelConfig per length: never change it in place)."""
    mc = copy.copy(vc.model_config)
    props = {name: property(lambda self, v=value: v) for name, value in attrs.items()}
    mc.__class__ = type("PatchedModelConfig", (type(mc),), props)
    object.__setattr__(vc, "model_config", mc)


def _with_parallel(vc: Any, **attrs: Any) -> None:
    par = copy.copy(vc.parallel_config)
    for name, value in attrs.items():
        object.__setattr__(par, name, value)
    object.__setattr__(vc, "parallel_config", par)


def _spec(cls_name: str = "FullAttentionSpec", block_size: int = 4, **kw: Any) -> Any:
    import torch
    from vllm.v1 import kv_cache_interface as kci

    return getattr(kci, cls_name)(block_size=block_size, num_kv_heads=1, head_size=1,
                                  dtype=torch.float32, **kw)


def _group(spec: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return KVCacheGroupSpec(["layer"], spec)


# -- refused at construction, "a KVMemError naming the option" -------------------------------


def test_prompt_embeddings_are_refused_at_construction() -> None:
    """vLLM keys a block of a prompt given as embeddings by their hash; kvmem keys pages by
    token ids (all 0 for such a prompt): two different prompts of the same length would share
    pages. The engine option is refused at construction, naming it."""
    vc, kc = make_vllm_config(SPEC)
    _with_model(vc, enable_prompt_embeds=True)
    with pytest.raises(KVMemError, match="enable_prompt_embeds"):
        _build(vc, kc)


def test_a_prompt_embeds_request_is_refused_and_changes_nothing() -> None:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    d = Driver(SPEC, kvmem=True)
    req = Request(request_id="emb", prompt_token_ids=None, prompt_embeds=torch.zeros(12, 8),
                  sampling_params=SamplingParams(max_tokens=2), pooling_params=None)
    with pytest.raises(KVMemError, match=r"prompt_embeds.*'emb'|'emb'.*prompt_embeds"):
        d.sched.add_request(req)
    assert not d.sched.requests and not d.sched.has_requests()


def test_two_embedding_prompts_never_share_a_page_on_vllms_manager() -> None:
    """What the refusal protects: on vLLM's own manager the second embeddings prompt of the
    same length gets no prefix hit (before the fix, kvmem's gave it 8 cached tokens)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvmem.integrations.vllm._vllm_objects import make_block_hasher, model_output

    d = Driver(SPEC, kvmem=False)
    g = torch.Generator().manual_seed(0)

    def request(rid: str) -> Any:
        return Request(request_id=rid, prompt_token_ids=None,
                       prompt_embeds=torch.randn(12, 8, generator=g),
                       sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                       pooling_params=None, block_hasher=make_block_hasher(4))

    d.sched.add_request(request("a"))
    for _ in range(3):
        out = d.sched.schedule()
        d.sched.update_from_output(out, model_output(d.sched, out))
    d.sched.add_request(request("b"))
    out = d.sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("b", 0)]


def test_context_parallelism_is_refused_naming_it_when_it_scales_the_block_size() -> None:
    """vLLM's engine core hands a DCP scheduler ``block_size = cache block size * dcp``; the
    refusal names DCP (it named ``hash_block_size``, which the user never set)."""
    vc, kc = make_vllm_config(SPEC)
    _with_parallel(vc, decode_context_parallel_size=2)
    with pytest.raises(KVMemError, match="DCP/PCP") as info:
        _build(vc, kc, block_size=8)
    assert "hash_block_size" not in str(info.value)
    assert "decode_context_parallel_size=2" in str(info.value)


def test_a_group_block_size_other_than_the_schedulers_says_what_it_found() -> None:
    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups[0] = _group(_spec(block_size=8))
    with pytest.raises(KVMemError) as info:
        _build(vc, kc, block_size=4)
    message = str(info.value)
    assert "kv_cache_spec.block_size=8" in message and "block_size=4" in message
    assert "hash_block_size" not in message


def test_partial_prefix_hits_name_both_sizes() -> None:
    vc, kc = make_vllm_config(SPEC)
    with pytest.raises(KVMemError, match="hash_block_size=2, block_size=4"):
        _build(vc, kc, hash_block_size=2)


def test_a_model_without_a_kv_cache_group_is_not_called_several() -> None:
    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups.clear()
    with pytest.raises(KVMemError, match="no KV cache group") as info:
        _build(vc, kc)
    assert "several" not in str(info.value)


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_too_few_blocks_is_a_kvmem_error_before_vllm_builds_its_manager(num_blocks: int) -> None:
    vc, kc = make_vllm_config(SPEC)
    kc.num_blocks = num_blocks
    with pytest.raises(KVMemError, match=f"num_blocks={num_blocks}.*null block"):
        _build(vc, kc)


def test_a_refused_model_is_told_to_use_vllms_own_scheduler_not_to_unset_itself() -> None:
    """The message says what to do: a hybrid model cannot "unset several KV cache groups"."""
    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups.append(_group(_spec("SlidingWindowSpec", sliding_window=8)))
    with pytest.raises(KVMemError, match="several KV cache groups") as info:
        _build(vc, kc)
    message = str(info.value)
    assert "Unset several" not in message and "vLLM's own Scheduler" in message
    assert "2 groups" in message and "SlidingWindowSpec" in message


def _ec(vc: Any) -> None:
    from vllm.config import ECTransferConfig

    object.__setattr__(vc, "ec_transfer_config",
                       ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_both"))


def _lora(vc: Any) -> None:
    from vllm.config import LoRAConfig

    object.__setattr__(vc, "lora_config", LoRAConfig())


def _metrics(vc: Any) -> None:
    obs = copy.copy(vc.observability_config)
    object.__setattr__(obs, "kv_cache_metrics", True)
    object.__setattr__(vc, "observability_config", obs)


def _aux(vc: Any) -> None:
    aux = copy.copy(vc.aux_output_config)
    aux.enable_return_routed_experts = True
    object.__setattr__(vc, "aux_output_config", aux)


@pytest.mark.parametrize(("mutate", "named"), [
    (_ec, "ec_transfer_config"),
    (_lora, "lora_config"),
    (_metrics, "kv_cache_metrics"),
    (_aux, "aux_output_config"),
    (lambda vc: _with_model(vc, is_encoder_decoder=True), "encoder-decoder"),
    (lambda vc: _with_model(vc, supports_multimodal_inputs=True), "multimodal"),
    (lambda vc: _with_parallel(vc, prefill_context_parallel_size=2), "prefill_context_parallel"),
], ids=["ec", "lora", "kv_cache_metrics", "aux", "encoder-decoder", "multimodal", "pcp"])
def test_each_engine_option_in_the_refused_column_is_named(mutate: Any, named: str) -> None:
    vc, kc = make_vllm_config(SPEC)
    mutate(vc)
    with pytest.raises(KVMemError, match=named):
        _build(vc, kc)


@pytest.mark.parametrize(("spec_name", "kw"), [
    ("ChunkedLocalAttentionSpec", {"attention_chunk_size": 8}),
    ("CrossAttentionSpec", {}),
], ids=["chunked-local", "cross-attention"])
def test_other_attention_kinds_are_refused_naming_the_spec(spec_name: str,
                                                           kw: dict[str, Any]) -> None:
    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups[0] = _group(_spec(spec_name, **kw))
    with pytest.raises(KVMemError, match=spec_name):
        _build(vc, kc)


def test_mla_is_supported() -> None:
    vc, kc = make_vllm_config(SPEC)
    kc.kv_cache_groups[0] = _group(_spec("MLAAttentionSpec"))
    assert _build(vc, kc).kvmem.num_pages == SPEC.num_blocks - 1


@pytest.mark.parametrize("what", ["mm_features", "resumable"])
def test_multimodal_and_resumable_requests_are_refused_and_change_nothing(what: str) -> None:
    from kvmem.integrations.vllm.conformance import make_request

    d = Driver(SPEC, kvmem=True)
    req = make_request(StreamRequest("q", (11, 12, 13), 2), 4)
    setattr(req, what, [object()] if what == "mm_features" else True)
    with pytest.raises(KVMemError, match="'q'"):
        d.sched.add_request(req)
    assert not d.sched.requests and not d.sched.has_requests()


# -- "cache_salt (kvmem's namespace)": the same prefix hits as vLLM's ------------------------


def test_an_empty_cache_salt_is_no_salt_as_in_vllm() -> None:
    """vLLM adds a salt to a block's keys only when it is non-empty, so ``cache_salt=""``
    shares the unsalted prefix (offline ``LLM.generate`` passes it through); kvmem made it a
    namespace of its own: no hit where vLLM's manager gives 8 tokens."""
    from kvmem.integrations.vllm.conformance import compare

    prompt = tuple(range(10, 22))
    stream = StreamSpec(SPEC, (StreamRequest("a", prompt, 3),
                               StreamRequest("b", prompt, 3, arrival=3, salt=""),
                               StreamRequest("c", prompt, 3, arrival=3, salt="tenant")))
    c = compare(stream)
    assert c.ok, c.first_difference
    new = {rid: hit for step in c.kvmem.steps for rid, hit in step.new}
    assert new["b"] == 8 and new["c"] == 0


# -- the paranoid check: "or KVMEM_VLLM_VERIFY_BLOCK_TABLES=1" -------------------------------


def test_the_environment_variable_turns_the_paranoid_check_on_after_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable was read once, when the module was imported: set afterwards (in the
    process that builds the engine), it did nothing."""
    vc, kc = make_vllm_config(SPEC)
    monkeypatch.setenv("KVMEM_VLLM_VERIFY_BLOCK_TABLES", "1")
    sched = _build(vc, kc)
    assert sched.verify_block_tables is True
    assert sched.kv_cache_manager.worker_block_table is not None
    monkeypatch.delenv("KVMEM_VLLM_VERIFY_BLOCK_TABLES")
    vc, kc = make_vllm_config(SPEC)
    plain = _build(vc, kc)
    assert plain.kv_cache_manager.worker_block_table is None


# -- VllmKVCacheAdapter(...): the error contract ------------------------------------------------

_ADAPTER = {"num_blocks": 16, "block_size": 4, "max_model_len": 64, "max_num_seqs": 4}


@pytest.mark.parametrize(("name", "value", "kind"), [
    ("block_size", 0, ValueError),
    ("block_size", 2.5, TypeError),
    ("num_blocks", True, TypeError),
    ("num_blocks", 1.5, TypeError),
    ("num_blocks", "16", TypeError),
    ("num_blocks", 1, ValueError),
    ("max_model_len", 0, ValueError),
    ("max_model_len", -1, ValueError),
    ("max_num_seqs", 0, ValueError),
    ("watermark", -0.5, ValueError),
    ("watermark", 1.0, ValueError),
    ("watermark", float("nan"), ValueError),
    ("watermark", "x", TypeError),
    ("enable_caching", "no", TypeError),
    ("seed", "s", TypeError),
])
def test_a_bad_adapter_argument_is_a_kvmem_error_naming_it(name: str, value: Any,
                                                           kind: type) -> None:
    """It raised ZeroDivisionError (block_size=0), TypeError / ValueError from arithmetic,
    named the manager's num_pages / page_size, or accepted max_model_len=0 and watermarks
    outside vLLM's [0, 1)."""
    with pytest.raises(KVMemError, match=f"^{name}=") as info:
        VllmKVCacheAdapter(**{**_ADAPTER, name: value})
    assert isinstance(info.value, kind)
    if name == "seed":  # a seed nothing would use (no prefix cache) is still checked
        with pytest.raises(KVMemError, match=r"^seed="):
            VllmKVCacheAdapter(**{**_ADAPTER, "enable_caching": False, name: value})


def test_an_admission_of_no_tokens_is_a_kvmem_value_error_and_admits_nothing() -> None:
    from kvmem.integrations.vllm.conformance import make_request

    adapter = VllmKVCacheAdapter(**_ADAPTER)
    req = make_request(StreamRequest("z", (11, 12, 13), 2), 4)
    with pytest.raises(KVMemError, match=r"'z'.*num_new_tokens") as info:
        adapter.allocate_slots(req, 0)
    assert isinstance(info.value, ValueError)  # what vLLM's own manager raises
    assert not adapter.manager.running
    assert adapter.get_block_ids("z") == ([],)
    adapter.check()


def test_a_running_request_given_no_tokens_is_a_kvmem_value_error_and_nothing_queues() -> None:
    """vLLM's manager refuses 0 new tokens for a running request too (ValueError)."""
    from kvmem.integrations.vllm.conformance import make_request

    adapter = VllmKVCacheAdapter(**_ADAPTER)
    req = make_request(StreamRequest("z", (11, 12, 13), 2), 4)
    assert adapter.allocate_slots(req, 3) is not None
    adapter.flush()
    req.num_computed_tokens = 3
    with pytest.raises(KVMemError, match=r"'z'.*num_new_tokens") as info:
        adapter.allocate_slots(req, 0)
    assert isinstance(info.value, ValueError)
    assert not adapter._queue.entries and adapter.manager.num_tokens("z") == 3
    adapter.check()


# -- python -m kvmem.integrations.vllm conformance: bad options ---------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["conformance", "--streams", "-1"], "--streams"),
    (["conformance", "--streams", "0"], "--streams"),
    (["conformance", "--streams", "1", "--batch", "0", "--decode-steps", "2"], "--batch"),
    (["conformance", "--streams", "1", "--batch", "9000", "--decode-steps", "2"], "--batch"),
    (["conformance", "--decode-steps", "-1"], "--decode-steps"),
    (["conformance", "--streams", "abc"], "--streams"),
    (["conformance", "--bogus"], "--bogus"),
    ([], "command"),
])
def test_a_bad_option_is_one_line_and_status_2_before_any_work(
        capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    """``--streams -1`` compared nothing and exited 0 (as if every stream agreed); ``--batch 0``
    ran the streams, then died in vLLM's config with a traceback and status 1 (as if a stream
    differed)."""
    from kvmem.integrations.vllm.__main__ import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0]


# -- the conformance harness: its specs and functions keep the error contract -----------------


@pytest.mark.parametrize(("build", "named", "kind"), [
    (lambda: SchedulerSpec(num_blocks=1), "num_blocks=1", ValueError),
    (lambda: SchedulerSpec(block_size=0), "block_size=0", ValueError),
    (lambda: SchedulerSpec(max_num_seqs=8, max_num_batched_tokens=4),
     "max_num_batched_tokens=4", ValueError),
    (lambda: SchedulerSpec(watermark=1.0), "watermark=1.0", ValueError),
    (lambda: SchedulerSpec(policy="lifo"), "policy='lifo'", ValueError),  # type: ignore[arg-type]
    (lambda: SchedulerSpec(paranoid="yes"), "paranoid=", TypeError),  # type: ignore[arg-type]
    (lambda: StreamRequest("a", (), 3), "prompt=()", ValueError),
    (lambda: StreamRequest("a", (1, 2), 0), "max_tokens=0", ValueError),
    (lambda: StreamRequest("a", (1, 2), 3, arrival=5, abort_at=2), "abort_at=2", ValueError),
    (lambda: StreamRequest("a", (1.5,), 3), "prompt=", TypeError),  # type: ignore[arg-type]
    (lambda: StreamSpec(SchedulerSpec(), (StreamRequest("a", (1,), 1),) * 2), "twice",
     ValueError),
    (lambda: StreamSpec(SchedulerSpec(max_model_len=8), (StreamRequest("a", (1,) * 9, 1),)),
     "max_model_len=8", ValueError),
    (lambda: StreamSpec(SchedulerSpec(), (), pipeline=0), "pipeline=0", ValueError),
], ids=["blocks", "block_size", "batched<seqs", "watermark", "policy", "flag", "empty-prompt",
        "max_tokens", "abort-before-arrival", "float-token", "duplicate-ids", "too-long",
        "pipeline"])
def test_a_bad_stream_spec_is_refused_when_built(build: Any, named: str, kind: type) -> None:
    """They were unchecked: vLLM's pydantic ValidationError, its ``assert`` on a duplicate
    request id, an IndexError inside vLLM's block pool (a prompt past max_model_len), or
    nothing at all (``pipeline=0`` ran as 1, an abort before the arrival never happened)."""
    with pytest.raises(KVMemError, match=re.escape(named)) as info:
        build()
    assert isinstance(info.value, kind)


def test_the_harness_functions_refuse_what_is_not_theirs() -> None:
    import random

    from kvmem.integrations.vllm.conformance import compare, random_stream

    with pytest.raises(KVMemError, match="max_requests=0"):
        random_stream(random.Random(0), max_requests=0)
    with pytest.raises(KVMemError, match="rng=5"):
        random_stream(5)  # type: ignore[arg-type]
    with pytest.raises(KVMemError, match="stream="):
        compare(SPEC)  # type: ignore[arg-type]
    with pytest.raises(KVMemError, match="kvmem="):
        Driver(SPEC, kvmem="yes")  # type: ignore[arg-type]
    # A replay typed by hand with lists is the stream it stands for.
    spec = StreamSpec(SPEC, [StreamRequest("a", [11, 12, 13], 2)])  # type: ignore[arg-type]
    assert spec == StreamSpec(SPEC, (StreamRequest("a", (11, 12, 13), 2),))


def test_the_json_keys_are_there_without_timing(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/vllm.md: ``--json`` prints at least these keys; with ``--decode-steps 0`` (no
    timing) the timing keys were missing, not null."""
    import json

    from kvmem.integrations.vllm.__main__ import main

    assert main(["conformance", "--streams", "1", "--decode-steps", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("streams", "steps", "mismatched_steps", "verify_failures", "table_mismatches",
                "vllm_step_us_median", "kvmem_step_us_median", "step_speedup",
                "vllm_kv_us_median", "kvmem_kv_us_median", "kv_speedup"):
        assert key in result, key
    assert result["streams"] == 1 and result["steps"] > 0
    assert result["step_speedup"] is None and result["timed_stream"] is None


def _fake_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``vllm`` is a broken install raising a multi-line ImportError."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("\\nIMPORTANT: PLEASE READ THIS\\n\\nthe C extension failed\\n")\n')
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}


def test_a_broken_vllm_install_is_still_one_line(tmp_path: Path) -> None:
    """``vllm_import_error`` promises one line, and the command prints it as its one line;
    a broken install's multi-line message made it four."""
    env = _fake_vllm(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kvmem.integrations.vllm", "conformance",
                           "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "setup_vllm_cpu.sh" in lines[0] and "the C extension failed" in lines[0]


def test_a_name_that_needs_vllm_says_how_to_get_it(tmp_path: Path) -> None:
    """``from kvmem.integrations.vllm import KVMemScheduler`` (and building a
    ``VllmKVCacheAdapter``, whose module loads without vLLM) without vLLM raised vLLM's bare
    ImportError; it is still an ImportError, now with the setup hint."""
    env = _fake_vllm(tmp_path)
    code = ("from kvmem.integrations.vllm import VllmOrderPrefixCache\n"  # needs no vLLM
            "try:\n"
            "    from kvmem.integrations.vllm import KVMemScheduler\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "from kvmem.integrations.vllm import VllmKVCacheAdapter\n"  # loads without vLLM
            "try:\n"
            "    VllmKVCacheAdapter(num_blocks=16, block_size=4, max_model_len=64,\n"
            "                       max_num_seqs=4)\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    assert "KVMemScheduler needs vLLM" in lines[0] and "setup_vllm_cpu.sh" in lines[0]
    assert "VllmKVCacheAdapter needs vLLM" in lines[1] and "setup_vllm_cpu.sh" in lines[1]
