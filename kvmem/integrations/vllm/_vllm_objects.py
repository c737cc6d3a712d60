"""vLLM's objects for the conformance harness: a config from a tiny model ``config.json`` (no
weights), a scheduler on vLLM's manager or kvmem's, requests, and the synthetic model's output.
Every function imports vLLM."""

from __future__ import annotations

import functools
import json
import os
import tempfile
import zlib
from typing import Any

from kvmem.integrations.vllm._streams import (
    STOP_TOKEN,
    SchedulerSpec,
    StreamRequest,
    accepts_draft,
    draft_at,
    token_at,
)

__all__ = ["EventRecorder", "draft_token_ids", "make_block_hasher", "make_request",
           "make_scheduler", "make_speculative_config", "make_vllm_config", "model_output"]


@functools.cache
def _model_dir() -> str:
    """A folder with a tiny model config.json: what ModelConfig needs, without weights."""
    path = os.path.join(tempfile.gettempdir(), "kvmem_vllm_tiny_model")
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20,
           "torch_dtype": "float16", "rms_norm_eps": 1e-5}
    target = os.path.join(path, "config.json")
    tmp = f"{target}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, target)
    return path


@functools.cache
def _model_config(max_model_len: int) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0,
                       max_model_len=max_model_len)


def make_speculative_config(spec: SchedulerSpec) -> Any:
    """vLLM's ``SpeculativeConfig`` for ``spec.spec_method`` (None without one): n-gram, or a
    draft model / EAGLE head that is the tiny model itself (the scheduler reads only its
    method and token counts). EAGLE uses vLLM's last-block drop (``disable_lookahead_block_
    hashes``: kvmem refuses lookahead block hashes)."""
    if spec.spec_method is None:
        return None
    from vllm.config import ParallelConfig, SpeculativeConfig

    if spec.spec_method == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=spec.num_spec_tokens,
                                 prompt_lookup_max=spec.num_spec_tokens, prompt_lookup_min=1)
    return SpeculativeConfig(
        method=spec.spec_method, model=_model_dir(), num_speculative_tokens=spec.num_spec_tokens,
        target_model_config=_model_config(spec.max_model_len),
        target_parallel_config=ParallelConfig(),
        disable_lookahead_block_hashes=spec.spec_method == "eagle")


def make_vllm_config(spec: SchedulerSpec) -> tuple[Any, Any]:
    """``(VllmConfig, KVCacheConfig)`` for a CPU-only scheduler with one full-attention group."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVEventsConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    sc = SchedulerConfig(
        max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len, enable_chunked_prefill=True,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        watermark=spec.watermark, async_scheduling=spec.async_scheduling,
        is_encoder_decoder=False, policy=spec.policy)
    cc = CacheConfig(block_size=spec.block_size, enable_prefix_caching=spec.enable_prefix_caching)
    cc.num_gpu_blocks = spec.num_blocks
    events = (KVEventsConfig(enable_kv_cache_events=True, publisher="null")
              if spec.kv_events else None)
    vc = VllmConfig(scheduler_config=sc, model_config=_model_config(spec.max_model_len),
                    cache_config=cc, device_config=DeviceConfig(device="cpu"),
                    kv_events_config=events, speculative_config=make_speculative_config(spec))
    if spec.max_loras:
        from vllm.config import LoRAConfig

        # (set after the config is built: VllmConfig checks a LoRA config against the
        # model's weights, which the tiny model has none of; the scheduler reads max_loras)
        object.__setattr__(vc, "lora_config", LoRAConfig(max_loras=spec.max_loras))
    if spec.connector:
        from kvmem.integrations.vllm._connector_script import connector_config

        vc.kv_transfer_config = connector_config(policy=spec.load_failure_policy)
    kc = KVCacheConfig(num_blocks=spec.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=spec.block_size, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return vc, kc


class EventRecorder:
    """Stands in for the KV event publisher: keeps the batches it is given."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def make_scheduler(spec: SchedulerSpec, kvmem: bool, log_stats: bool = False,
                   kv_transfer_config: Any = None) -> Any:
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``), on vLLM's own manager
    or (``kvmem=True``) kvmem's; ``kv_transfer_config``: a KV connector's config (vLLM's
    ``KVTransferConfig``) in place of the spec's own."""
    from vllm.v1.structured_output import StructuredOutputManager

    if kvmem:
        from kvmem.integrations.vllm._scheduler import KVMemAsyncScheduler, KVMemScheduler

        cls: Any = KVMemAsyncScheduler if spec.async_scheduling else KVMemScheduler
        if spec.paranoid:
            cls = type(f"Paranoid{cls.__name__}", (cls,), {"verify_block_tables": True})
    else:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        cls = AsyncScheduler if spec.async_scheduling else Scheduler
    vc, kc = make_vllm_config(spec)
    if kv_transfer_config is not None:
        vc.kv_transfer_config = kv_transfer_config
    sched = cls(vllm_config=vc, kv_cache_config=kc,
                structured_output_manager=StructuredOutputManager(vc),
                block_size=spec.block_size, log_stats=log_stats)
    sched.kv_event_publisher = EventRecorder()
    if spec.encoder_cache_size:
        # The tiny model takes no multimodal inputs, so vLLM gave it no encoder budget: the
        # scheduler gets one as a multimodal model's would be (vLLM's own tests do the same).
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        sched.max_num_encoder_input_tokens = spec.encoder_cache_size
        sched.encoder_cache_manager = EncoderCacheManager(cache_size=spec.encoder_cache_size)
    return sched


@functools.cache
def make_block_hasher(block_size: int) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def make_request(r: StreamRequest, block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=r.max_tokens, stop_token_ids=[STOP_TOKEN],
                            ignore_eos=True)
    lora = None
    if r.lora is not None:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(r.lora, lora_id(r.lora), f"/loras/{r.lora}")
    mm = None
    if r.mm:
        from vllm.multimodal.inputs import (
            MultiModalFeatureSpec,
            MultiModalKwargsItem,
            PlaceholderRange,
        )

        mm = [MultiModalFeatureSpec(data=MultiModalKwargsItem.dummy(), modality="image",
                                    identifier=ident,
                                    mm_position=PlaceholderRange(offset=offset, length=length))
              for ident, offset, length in r.mm]
    return Request(request_id=r.rid, prompt_token_ids=list(r.prompt), sampling_params=params,
                   pooling_params=None, arrival_time=float(r.arrival), cache_salt=r.salt,
                   priority=r.priority, block_hasher=make_block_hasher(block_size),
                   lora_request=lora, mm_features=mm)


def lora_id(name: str) -> int:
    """A stream's LoRA adapter id for ``name`` (vLLM's ``lora_int_id``: positive, one per
    name)."""
    return 1 + zlib.crc32(name.encode()) % (1 << 30)


def model_output(sched: Any, out: Any, seed: int = 0, acceptance: float = 0.0) -> Any:
    """The synthetic model's ``ModelRunnerOutput`` for a step, built right after ``schedule()``
    returned it: for each request whose prompt (or resumed sequence) is complete after this
    step, its token (``token_at``) at each draft position the verifier accepts (the drafter
    guessed it: ``accepts_draft``, in order, up to the first miss) and one more (the first
    miss's correction, or the bonus token); none otherwise. So a step whose ``k`` drafts are
    rejected from the ``j``-th on samples ``j + 1`` tokens and rolls ``k - j`` back."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    drafts = out.scheduled_spec_decode_tokens
    sampled: list[list[int]] = []
    for rid in ids:
        req = sched.requests.get(rid)
        if req is None or req.is_prefill_chunk:
            sampled.append([])
            continue
        k = len(drafts.get(rid, ()))
        first = req.num_computed_tokens - k  # the position of the step's first sampled token
        tokens = [token_at(rid, first, seed)]
        for pos in range(first, first + k):
            if not accepts_draft(rid, pos, seed, acceptance):
                break
            tokens.append(token_at(rid, pos + 1, seed))
        sampled.append(tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


def draft_token_ids(sched: Any, out: Any, spec: SchedulerSpec, seed: int = 0) -> Any:
    """The synthetic drafter's ``DraftTokenIds`` after a step's output was applied (what a
    synchronous engine hands ``update_draft_token_ids``): for each request the step ran, drafts
    for the positions after its tokens (``draft_at``): ``num_spec_tokens`` of them, or (n-gram,
    which proposes only what it finds) a varying number, possibly none."""
    import zlib

    from vllm.v1.outputs import DraftTokenIds

    rids: list[str] = []
    drafts: list[list[int]] = []
    for rid in out.num_scheduled_tokens:
        req = sched.requests.get(rid)
        if req is None or req.is_finished():
            continue
        n = req.num_tokens
        k = spec.num_spec_tokens
        if spec.spec_method == "ngram":
            k = zlib.crc32(f"ngram:{seed}:{rid}:{n}".encode()) % (k + 1)
        rids.append(rid)
        drafts.append([draft_at(rid, pos, seed, spec.draft_acceptance)
                       for pos in range(n, n + k)])
    return DraftTokenIds(rids, drafts)
