"""The vLLM adapter: its documented behaviour, prefix cache order, events and benchmarks."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from kvmem import ArgumentError, ArgumentTypeError, ConfigError, HashedPrefixCache, KVMemError
from kvmem.integrations.vllm import VllmOrderPrefixCache, vllm_import_error
from kvmem.integrations.vllm.conformance import (
    Driver,
    SchedulerSpec,
    StreamRequest,
    StreamSpec,
    make_scheduler,
    make_vllm_config,
)
from kvmem.manager import KVCacheManager
from kvmem.testing import ManagerMachine

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


_ADAPTER = {"num_blocks": 16, "block_size": 4, "max_model_len": 64, "max_num_seqs": 4}


def _fake_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``vllm`` is a broken install raising a multi-line ImportError."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("\\nIMPORTANT: PLEASE READ THIS\\n\\nthe C extension failed\\n")\n')
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}


def _mgr(num_pages: int = 16, page_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_pages, page_size=page_size, max_seqs=8,
                          prefix_cache=VllmOrderPrefixCache(seed=1), tracker="checking",
                          watermark=0.0, kv_events=True)


def _run(mgr: KVCacheManager, rid: str, tokens: list[int], ns: object = None) -> int:
    """Admit, prefill and commit a whole prompt; returns the cached tokens it reused."""
    res = mgr.admit(rid, np.array(tokens), namespace=ns)
    mgr.reserve([rid], len(tokens) - res.num_cached_tokens)
    mgr.commit(rid, tokens[res.num_cached_tokens:])
    return res.num_cached_tokens


class VllmOrderMachine(ManagerMachine):
    """kvmem's whole state machine (forks, copy-on-write, fences, preemption, faults' absence)
    against the vLLM-order cache."""

    def make_manager(self) -> KVCacheManager:
        return KVCacheManager(num_pages=self.num_pages, page_size=self.page_size,
                              max_seqs=self.max_seqs, max_pages_per_seq=self.max_pages_per_seq,
                              prefix_cache=VllmOrderPrefixCache(seed=3), tracker="checking",
                              watermark=0.0)


if vllm_import_error() is None:
    from kvmem.integrations.vllm import VllmKVCacheAdapter


def _events_of_a_reset(kvmem: bool, caching: bool) -> list[str]:
    """Run one request to its end, reset the prefix cache, run a step: the event names."""
    from kvmem.integrations.vllm.conformance import make_request, model_output

    spec = SchedulerSpec(num_blocks=20, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                         max_model_len=64, enable_prefix_caching=caching)
    s = make_scheduler(spec, kvmem)
    s.add_request(make_request(StreamRequest("a", tuple(range(10, 20)), 2), 4))
    while s.has_requests():
        out = s.schedule()
        s.update_from_output(out, model_output(s, out))
    s.kv_event_publisher.events = []
    assert s.reset_prefix_cache() is True
    out = s.schedule()
    s.update_from_output(out, model_output(s, out))  # publishes the step's events
    return [type(e).__name__ for e in s.kv_event_publisher.events]


def _benchmark(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/NAME.py as a module (the folder on the path: they import each other)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


@pytest.mark.parametrize(("mutate", "named"), [
    (_ec, "ec_transfer_config"),
    (_metrics, "kv_cache_metrics"),
    (_aux, "aux_output_config"),
    (lambda vc: _with_model(vc, is_encoder_decoder=True), "encoder-decoder"),
    (lambda vc: _with_parallel(vc, prefill_context_parallel_size=2), "prefill_context_parallel"),
], ids=["ec", "kv_cache_metrics", "aux", "encoder-decoder", "pcp"])
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


def test_a_lora_config_is_supported() -> None:
    """LoRA adapters only change block keys, which kvmem computes as vLLM does (the adapter
    in the namespace)."""
    vc, kc = make_vllm_config(SPEC)
    _lora(vc)
    assert _build(vc, kc).kvmem.num_pages == SPEC.num_blocks - 1


def _features(layout: list[tuple[int, int]], names: list[str]) -> list[Any]:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=name,
                                  mm_position=PlaceholderRange(offset=o, length=n))
            for (o, n), name in zip(layout, names)]


def test_multimodal_extra_keys_are_vllms_block_by_block() -> None:
    """kvmem's per-block multimodal keys are exactly what vLLM's own
    ``generate_block_hash_extra_keys`` gives each block of a request, over random layouts of
    inputs (adjacent, several in a block, one spanning blocks, at the prompt's end) and block
    sizes."""
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    from vllm.v1.request import Request

    from kvmem.integrations.vllm._keys import mm_extra_keys

    rng = random.Random(0)
    for _ in range(300):
        block_size = rng.choice((1, 2, 3, 4, 16))
        layout, at = [], rng.randrange(0, 6)
        for _ in range(rng.randint(1, 4)):
            length = rng.randint(1, 9)
            layout.append((at, length))
            at += length + rng.choice((0, 0, 1, 5))
        num_tokens = at + rng.randint(0, 2 * block_size)
        names = [f"img{rng.randrange(3)}" for _ in layout]
        req = Request(request_id="r", prompt_token_ids=[5] * num_tokens,
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      mm_features=_features(layout, names))
        vllm_keys, mm_idx = {}, 0
        for j in range(num_tokens // block_size):
            keys, mm_idx = generate_block_hash_extra_keys(
                req, j * block_size, (j + 1) * block_size, mm_idx)
            if keys:
                vllm_keys[j] = keys
        ours = {j: keys for j, keys in mm_extra_keys(req.mm_features, block_size)
                if j < num_tokens // block_size}
        assert ours == vllm_keys, (layout, block_size)


def test_key_tokens_fold_exactly_the_blocks_with_images() -> None:
    """A multimodal request's key tokens: its own ids in blocks without an image, ids at
    2**30 and above in blocks with one; slices and indexing agree with each other, follow
    the live token list (outputs appended), and two images' folds differ."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvmem.integrations.vllm._keys import KEY_TOKEN_BASE, key_tokens

    def request(name: str) -> Any:
        return Request(request_id=name, prompt_token_ids=list(range(10, 30)),
                       sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                       mm_features=_features([(5, 4)], [name]))

    req = request("img")
    keys = key_tokens(req, 4)  # the image at 5-8: blocks 1 and 2
    whole = keys[:]
    assert whole[:4] == list(range(10, 14)) and whole[12:] == list(range(22, 30))
    assert all(t >= KEY_TOKEN_BASE for t in whole[4:12])
    assert [keys[i] for i in range(len(keys))] == whole and keys[3:9] == whole[3:9]
    req.append_output_token_ids(77)
    assert len(keys) == 21 and keys[20] == 77 and keys[-1] == 77
    assert key_tokens(request("other"), 4)[4:12] != whole[4:12]
    with pytest.raises(ValueError, match="step 1"):
        keys[::2]


def test_a_lora_namespace_is_the_adapters_name_and_path_with_the_salt() -> None:
    """vLLM keys every block of a LoRA request with the adapter's name and path (not its id):
    re-pointing a name at another path must not reuse KV, and the salt still separates."""
    from vllm.lora.request import LoRARequest

    from kvmem.integrations.vllm._keys import namespace_of
    from kvmem.integrations.vllm.conformance import make_request

    def ns(lora: Any, salt: str | None = None) -> Any:
        req = make_request(StreamRequest("q", (11, 12, 13), 2, salt=salt), 4)
        req.lora_request = lora
        return namespace_of(req)

    a = LoRARequest("a", 1, "/p")
    assert ns(a) == ns(LoRARequest("a", 2, "/p"))  # (the id is not in vLLM's key)
    assert len({ns(a), ns(LoRARequest("a", 1, "/q")), ns(LoRARequest("b", 1, "/p")),
                ns(a, "t"), ns(None), ns(None, "t")}) == 6
    assert ns(None, "") is None and ns(None, "t") == "t"


def test_plain_requests_key_by_their_own_token_list() -> None:
    """Without multimodal inputs the key tokens are the request's token list itself (no copy
    on the decode path)."""
    from kvmem.integrations.vllm._keys import key_tokens
    from kvmem.integrations.vllm.conformance import make_request

    req = make_request(StreamRequest("q", (11, 12, 13), 2), 4)
    assert key_tokens(req, 4) is req._all_token_ids


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
    (lambda: SchedulerSpec(spec_method="medusa", num_spec_tokens=2),  # type: ignore[arg-type]
     "spec_method='medusa'", ValueError),
    (lambda: SchedulerSpec(spec_method="eagle"), "num_spec_tokens=0", ValueError),
    (lambda: SchedulerSpec(num_spec_tokens=2), "num_spec_tokens=2", ValueError),
    (lambda: SchedulerSpec(spec_method="ngram", num_spec_tokens=2, draft_acceptance=1.5),
     "draft_acceptance=1.5", ValueError),
    (lambda: SchedulerSpec(encoder_cache_size=-1), "encoder_cache_size=-1", ValueError),
    (lambda: SchedulerSpec(max_loras=-1), "max_loras=-1", ValueError),
    (lambda: StreamRequest("a", (1, 2), 3, lora=5), "lora=5", TypeError),  # type: ignore[arg-type]
    (lambda: StreamRequest("a", (1,) * 8, 3, mm=(("i", 1),)), "mm=", TypeError),  # type: ignore[arg-type]
    (lambda: StreamRequest("a", (1,) * 8, 3, mm=(("i", 4, 2), ("j", 1, 2))), "sorted",
     ValueError),
    (lambda: StreamRequest("a", (1,) * 8, 3, mm=(("i", 4, 0),)), "length >= 1", ValueError),
    (lambda: StreamRequest("a", (1,) * 8, 3, mm=(("i", 4, 5),)), "past the prompt",
     ValueError),
    (lambda: StreamSpec(SchedulerSpec(encoder_cache_size=2),
                        (StreamRequest("a", (1,) * 8, 1, mm=(("i", 0, 3),)),)),
     "encoder_cache_size=2", ValueError),
], ids=["blocks", "block_size", "batched<seqs", "watermark", "policy", "flag", "empty-prompt",
        "max_tokens", "abort-before-arrival", "float-token", "duplicate-ids", "too-long",
        "pipeline", "spec-method", "no-drafts", "drafts-without-method", "acceptance",
        "encoder-budget", "max-loras", "lora-type", "mm-type", "mm-unsorted", "mm-empty",
        "mm-past-prompt", "mm-wider-than-budget"])
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
    with pytest.raises(KVMemError, match="speculative="):
        random_stream(random.Random(0), speculative=1)  # type: ignore[arg-type]
    with pytest.raises(KVMemError, match="spec_methods="):
        random_stream(random.Random(0), spec_methods=("medusa",))  # type: ignore[arg-type]
    with pytest.raises(KVMemError, match="keys="):
        random_stream(random.Random(0), keys=1)  # type: ignore[arg-type]
    # Streams drawn before speculative decoding (and then adapters and images) joined are the
    # same streams.
    plain = random_stream(random.Random(3), speculative=False, keys=False)
    assert plain.sched.spec_method is None
    assert random_stream(random.Random(3), speculative=True, keys=False).requests == (
        plain.requests)
    keyed = random_stream(random.Random(3), speculative=False, keys=True)
    assert [(r.rid, r.prompt) for r in keyed.requests] == [
        (r.rid, r.prompt) for r in plain.requests]
    assert keyed.sched.encoder_cache_size > 0 and plain.sched.encoder_cache_size == 0
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


def test_duplicates_are_cached_and_the_first_is_found_first() -> None:
    mgr = _mgr()
    prompt = list(range(10, 19))  # two full pages and one token
    # Both compute the same two pages before either is cached: vLLM caches both copies.
    for rid in ("a", "b"):
        mgr.admit(rid, np.array(prompt))
    for rid in ("a", "b"):
        mgr.reserve([rid], len(prompt))
        mgr.commit(rid, prompt)
    cache = mgr.cache
    assert cache is not None
    assert cache.num_cached == 4
    a_pages, b_pages = mgr.pages_of("a")[:2], mgr.pages_of("b")[:2]
    match = cache.match(np.array(prompt), None, 2)
    assert match.pages.tolist() == a_pages.tolist()
    # Once a's copies are gone, b's still serve the prefix.
    mgr.release("a")
    mgr.release("b")
    evicted, _ = cache.evict(2)
    assert sorted(evicted.tolist()) == sorted(a_pages.tolist())
    assert cache.match(np.array(prompt), None, 2).pages.tolist() == b_pages.tolist()
    mgr.check()


def test_a_stale_first_duplicate_falls_back_to_the_next_one_under_its_key() -> None:
    """match() confirms the first page under each key for the whole prompt at once; a key
    whose first page fails (here: its cached lifetime no longer the page's) is walked, and a
    duplicate that still holds the tokens serves the hit, as vLLM's block pool would."""
    mgr = _mgr()
    prompt = list(range(10, 19))
    for rid in ("a", "b"):
        mgr.admit(rid, np.array(prompt))
    for rid in ("a", "b"):
        mgr.reserve([rid], len(prompt))
        mgr.commit(rid, prompt)
    cache = mgr.cache
    assert isinstance(cache, VllmOrderPrefixCache)
    a_pages, b_pages = mgr.pages_of("a")[:2].tolist(), mgr.pages_of("b")[:2].tolist()
    assert cache.match(np.array(prompt), None, 2).pages.tolist() == a_pages
    for i, expected in ((1, [a_pages[0], b_pages[1]]), (0, b_pages)):
        cache._tag[a_pages[i]] += 1  # a's page i: no longer the lifetime that was cached
        assert cache.match(np.array(prompt), None, 2).pages.tolist() == expected
    cache._tag[b_pages[0]] += 1  # and no copy of page 0 left: no hit at all
    assert cache.match(np.array(prompt), None, 2).pages.size == 0


def test_eviction_follows_release_order_deepest_page_first() -> None:
    mgr = _mgr()
    _run(mgr, "a", list(range(100, 109)))
    _run(mgr, "b", list(range(200, 209)))
    a, b = mgr.pages_of("a")[:2].tolist(), mgr.pages_of("b")[:2].tolist()
    mgr.release("b")  # b first: its pages are older in the free queue
    mgr.release("a")
    cache = mgr.cache
    assert cache is not None
    order = [int(cache.evict(1)[0][0]) for _ in range(4)]
    assert order == [b[1], b[0], a[1], a[0]]


def test_a_hit_takes_pages_out_of_the_queue_and_a_release_puts_them_last() -> None:
    mgr = _mgr()
    _run(mgr, "a", list(range(100, 109)))
    _run(mgr, "b", list(range(200, 209)))
    mgr.release("a")
    mgr.release("b")
    cache = mgr.cache
    assert cache is not None
    assert cache.num_evictable == 4
    assert _run(mgr, "a2", list(range(100, 109))) == 8  # hits a's pages
    assert cache.num_evictable == 2
    hit = mgr.pages_of("a2")[:2].tolist()
    mgr.release("a2")
    order = [int(cache.evict(1)[0][0]) for _ in range(4)]
    assert order[2:] == [hit[1], hit[0]]


def test_namespaces_never_share() -> None:
    mgr = _mgr()
    prompt = list(range(10, 19))
    _run(mgr, "a", prompt, ns="tenant-a")
    assert _run(mgr, "b", prompt, ns="tenant-b") == 0
    assert _run(mgr, "c", prompt, ns="tenant-a") == 8


def test_a_bound_cache_cannot_be_bound_again() -> None:
    cache = VllmOrderPrefixCache()
    KVCacheManager(8, page_size=4, max_seqs=2, prefix_cache=cache)
    with pytest.raises(KVMemError):
        KVCacheManager(8, page_size=4, max_seqs=2, prefix_cache=cache)


def test_the_package_imports_without_vllm_and_says_how_to_get_it() -> None:
    error = vllm_import_error()
    assert error is None or "setup_vllm_cpu.sh" in error


TestVllmOrderMachine = VllmOrderMachine.TestCase


TestVllmOrderMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_the_package_names_are_exactly_the_intended_ones() -> None:
    import kvmem.integrations.vllm as pkg

    assert set(pkg.__all__) == {
        "VLLM_VERSION", "KVMemAsyncScheduler", "KVMemBlocks", "KVMemScheduler",
        "VllmKVCacheAdapter", "VllmOrderPrefixCache", "check_supported", "vllm_import_error"}
    assert pkg.VLLM_VERSION == "0.33.0"
    if vllm_import_error() is None:  # the lazy names load on first use
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None
    with pytest.raises(AttributeError):
        pkg.NoSuchName  # noqa: B018


@pytest.mark.parametrize("cls", [VllmOrderPrefixCache, HashedPrefixCache])
def test_a_cache_refuses_a_bad_seed_and_a_second_manager(cls: type) -> None:
    for seed, error in (("x", ArgumentTypeError), (1.5, ArgumentTypeError), (True,
                        ArgumentTypeError), (-1, ArgumentError)):
        with pytest.raises(error, match="seed"):
            cls(seed=seed)
    cache = cls(seed=7)
    with pytest.raises(ConfigError, match="not bound"):
        _ = cache.allocator
    KVCacheManager(16, page_size=4, prefix_cache=cache)
    with pytest.raises(ConfigError, match="already bound"):
        KVCacheManager(16, page_size=4, prefix_cache=cache)
    assert cache.allocator.num_pages == 16


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_a_reset_reports_all_blocks_cleared_as_vllm_does_with_caching_on_or_off(
        caching: bool) -> None:
    """KV events and prefix caching off are both supported: vLLM's block pool reports
    ``AllBlocksCleared`` on every successful reset, cache or not; kvmem's adapter reported
    nothing without a prefix cache."""
    assert _events_of_a_reset(False, caching) == ["AllBlocksCleared"]
    assert _events_of_a_reset(True, caching) == ["AllBlocksCleared"]


def test_an_empty_prompt_is_refused_in_add_request_and_changes_nothing() -> None:
    """vLLM's engine refuses an empty prompt before its scheduler; given to kvmem's scheduler
    directly it was queued, then every ``schedule()`` raised the manager's ``max_pages=-1``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    d = Driver(SPEC, kvmem=True)
    empty = Request(request_id="e", prompt_token_ids=[], sampling_params=SamplingParams(
        max_tokens=2), pooling_params=None)
    with pytest.raises(KVMemError, match=r"'e'.*empty prompt") as info:
        d.sched.add_request(empty)
    assert isinstance(info.value, ValueError)
    assert not d.sched.requests and not d.sched.has_requests()
    d.add(StreamRequest("a", (11, 12, 13), 2))
    d.run()
    assert d.requests["a"].is_finished()


def test_a_salt_past_the_namespace_limit_is_refused_in_add_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvmem's manager tells apart ``MAX_NAMESPACES`` namespaces in its life (2**20; 3 here).
    The request with one salt too many was queued and its admission inside ``schedule()``
    raised, every step after (it stayed at the head of the queue): the scheduler served no
    one. Now ``add_request`` refuses it, naming the request and the salt, and the rest run."""
    import kvmem.allocator._admission as admission

    monkeypatch.setattr(admission, "MAX_NAMESPACES", 3)  # None and two salts
    d = Driver(SPEC, kvmem=True)
    d.add(StreamRequest("a", (11, 12, 13), 2, salt="t1"))
    d.add(StreamRequest("b", (11, 12, 13), 2, salt="t2"))
    with pytest.raises(KVMemError, match=r"'c'.*cache_salt='t3'"):
        d.add(StreamRequest("c", (11, 12, 13), 2, salt="t3"))
    assert "c" not in d.sched.requests
    d.add(StreamRequest("d", (11, 12, 13), 2, salt="t1"))  # a salt it knows is still served
    d.run()
    assert all(d.requests[rid].is_finished() for rid in "abd")
    d.sched.kv_cache_manager.check()


def test_a_max_model_len_too_long_for_the_page_table_is_named_as_max_model_len() -> None:
    """docs/vllm.md: the adapter's arguments are checked by their own names. A context whose
    blocks overflow int32 was refused as the manager's ``max_pages_per_seq``, which the caller
    never passed."""
    args = {"num_blocks": 16, "block_size": 4, "max_num_seqs": 4}
    with pytest.raises(KVMemError, match=r"^max_model_len=1099511627776: .*block_size=4") as info:
        VllmKVCacheAdapter(max_model_len=1 << 40, **args)
    assert isinstance(info.value, ValueError)
    assert "max_pages_per_seq" not in str(info.value)


def test_a_long_prefill_threshold_past_max_model_len_is_refused_when_the_spec_is_built() -> None:
    """docs/vllm.md: the specs are checked when built, before vLLM sees them, with vLLM's own
    limits; this one reached vLLM as a pydantic ValidationError when the scheduler was built."""
    with pytest.raises(KVMemError, match=r"long_prefill_token_threshold=100.*max_model_len=64"
                       ) as info:
        SchedulerSpec(max_model_len=64, long_prefill_token_threshold=100)
    assert isinstance(info.value, ValueError)
    spec = SchedulerSpec(max_model_len=64, long_prefill_token_threshold=64)  # vLLM's bound
    Driver(spec, kvmem=True)


def test_the_readme_says_what_the_scenario_table_says() -> None:
    """The README said one of vLLM's scenarios re-created differs; docs/vllm.md's table (and
    tests/test_vllm_conformance.py) has every one agree."""
    doc = (ROOT / "docs" / "vllm.md").read_text()
    table = doc.split("### vLLM's own scenarios", 1)[1].split("\n\n")[2]
    results = [row.rsplit("|", 2)[1].strip() for row in table.splitlines()[2:]]
    assert len(results) >= 10 and all(r.startswith("agree") for r in results), results
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "scenarios re-created (all agree)" in readme
    assert "one differs" not in readme


def test_the_churn_benchmark_prints_the_documented_keys(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    churn = _benchmark("bench_vllm_churn", monkeypatch)
    assert churn.main(["--requests", "8", "--steps", "3", "--warmup", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("mismatched_steps", "vllm_step_us_median", "kvmem_step_us_median",
                "step_speedup", "vllm_kv_us_median", "kvmem_kv_us_median", "kv_speedup",
                "paired_step_speedup", "paired_kv_speedup", "kvmem_flush_us_median",
                "verify_paths", "joined_per_step", "kvmem_flushes_per_step"):
        assert key in result, key
    assert result["steps"] == 3 and result["mismatched_steps"] == 0


def test_the_churn_benchmark_by_call_splits_each_managers_kv_time_by_method(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_vllm_churn.py --by-call (docs/benchmarks.md): per manager, the KV time a step
    spends in each method and the calls a step (one allocate_slots per running request);
    without the option, neither."""
    import json

    churn = _benchmark("bench_vllm_churn", monkeypatch)
    assert churn.main(["--requests", "8", "--steps", "4", "--warmup", "2", "--by-call"]) == 0
    result = json.loads(capsys.readouterr().out)
    for w in ("vllm", "kvmem"):
        by_call, calls = result["kv_us_by_call"][w], result["kv_calls_by_call"][w]
        assert by_call["allocate_slots"] > 0 and calls["allocate_slots"] == 8, (w, calls)
        assert set(by_call) == set(calls) and all(v >= 0 for v in by_call.values())
    assert result["mismatched_steps"] == 0
    assert churn.main(["--requests", "8", "--steps", "2", "--warmup", "0"]) == 0
    assert "kv_us_by_call" not in json.loads(capsys.readouterr().out)  # (only when asked)


def test_the_churn_sweep_prints_one_cell_per_rate_and_length_at_its_exact_rate(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_vllm_churn.py --sweep (docs/benchmarks.md): a cell per churn rate and prompt
    length with the default run's figures, both managers scheduling alike in every cell, and
    exactly the cell's rate of requests joining each measured step (0: a steady batch)."""
    import json

    churn = _benchmark("bench_vllm_churn", monkeypatch)
    assert churn.main(["--sweep", "--requests", "8", "--steps", "2", "--warmup", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "step_speedup" not in result  # the top-level figures are the default run's only
    cells = result["sweep"]
    assert [(c["churn_per_step"], c["prompt_len"]) for c in cells] == [
        (rate, length) for rate in (0, 1, 2, 8) for length in (128, 512, 1024, 4096)]
    for c in cells:
        assert c["mismatched_steps"] == 0 and c["steps"] == 2 and c["requests"] == 8, c
        assert c["joined_per_step"] == c["churn_per_step"], c
        for key in ("vllm_step_us_median", "kvmem_step_us_median", "step_speedup",
                    "paired_step_speedup", "vllm_kv_us_median", "kvmem_kv_us_median",
                    "kv_speedup", "paired_kv_speedup", "kvmem_flush_us_median"):
            assert c[key] > 0, (key, c)
        # The decodes and the requests joining share a flush (a join's lookup flushes only
        # when the queue fills or takes a page it reads): fewer than one for the decodes and
        # one per join, as when every join's lookup and block ids flushed.
        rate, flushes = c["churn_per_step"], c["kvmem_flushes_per_step"]
        assert flushes == 1 if rate == 0 else 1 <= flushes <= (1 + rate if rate < 2 else rate), c
        # The flushes that admitted a request are timed apart: every step's at a rate, none
        # in a steady batch.
        assert ("kvmem_flush_join_us_median" in c) == (rate > 0), c
        assert c.get("kvmem_flush_join_us_median", 1) > 0
        assert rate > 0 or c["kvmem_flush_decode_us_median"] > 0, c
    # Rate 0 never replaces a request; rate r adds r a step through the fill and the steps.
    assert {c["requests_added"] for c in cells if c["churn_per_step"] == 0} == {8}
    assert {c["requests_added"] for c in cells if c["churn_per_step"] == 2} == {8 + 2 * 2}


@pytest.mark.parametrize(("script", "argv", "named"), [
    ("bench_vllm_churn", ["--steps", "0"], "--steps"),  # was a StatisticsError after the run
    ("bench_vllm_churn", ["--sweep", "--requests", "4"], "--requests"),  # below rate 8
    ("bench_vllm_churn", ["--requests", "0"], "--requests"),  # was the SchedulerSpec's traceback
    ("bench_vllm_churn", ["--requests", "9000"], "--requests"),  # past vLLM's 8192-token step
    ("bench_vllm_churn", ["--warmup", "-1"], "--warmup"),
    ("bench_vllm_floor", ["--decode-steps", "0"], "--decode-steps"),
    ("bench_vllm_floor", ["--requests", "0"], "--requests"),
])
def test_a_bad_vllm_benchmark_option_is_one_line_and_status_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], script: str,
        argv: list[str], named: str) -> None:
    # (not "benchmark": that name is pytest-benchmark's fixture where the plugin is installed)
    assert _benchmark(script, monkeypatch).main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and named in err


def test_the_floor_benchmark_prints_the_documented_keys_and_its_bound(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    floor = _benchmark("bench_vllm_floor", monkeypatch)
    assert floor.main(["--requests", "8", "--decode-steps", "20"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["batch"] == 8 and r["decode_steps"] == 20 and r["mismatched_steps"] == 0
    # (the KV times less an estimate of the timers' own cost: on a busy machine a step's
    # estimate may exceed its per-request calls, so only the flush is surely positive)
    assert r["kvmem_flush_us"] > 0 and r["kvmem_per_request_us"] < r["kvmem_kv_us"]
    assert r["kv_speedup_bound"] == pytest.approx(
        r["vllm_kv_us"] / (r["floor_step_us"] + r["kvmem_per_request_us"]), rel=0.01)
    assert r["floor_step_us"] > 0 and r["floor_step_warm_us"] > 0
