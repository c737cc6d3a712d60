"""``plan_capacity``: model + GPU + parallelism + dtypes + reserve policy -> CapacityPlan.

How one GPU's memory is divided (a TP group of ``tp`` GPUs holds one replica)::

    |<------------------------------ gpu memory (driver's MiB) ------------------------------>|
    | weights (shard + replicated) | KV pool: pages of page_size tokens      | reserve          |
    |                              |<-------- kv_budget_gib_per_gpu -------->| activations,     |
    |                              |                                         | graphs, context  |

The reserve comes from a policy: a fixed number of GiB, a fraction of memory for weights + KV
(``--mem-fraction-static`` / ``gpu_memory_utilization`` style), or :class:`SGLangPolicy`, which
recomputes SGLang's documented default ``mem_fraction_static`` (``_reserve.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kvmem._validate import choice, flag, integer, real, show
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.planning._accounting import GIB, KVLayout, WeightBytes, kv_layout, weight_bytes
from kvmem.planning._presets import get_gpu, get_model, weight_scheme
from kvmem.planning._reserve import (
    FixedReserve,
    MemoryFraction,
    ReservePolicy,
    SGLangPolicy,
    sglang_mem_fraction_static,
)
from kvmem.planning._spec import (
    KV_DTYPES,
    SCALE_LAYOUTS,
    GPUSpec,
    ModelSpec,
    WeightScheme,
)

__all__ = [
    "CapacityPlan",
    "decode_bytes_per_step",
    "expected_active_experts",
    "plan_capacity",
    "tokens_freed",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_MAX_BYTES = 1 << 1000  # far below a float's largest (about 2**1024)
_MAX_OFFLOAD_GIB = float(1 << 40)  # a GiB count beyond any host (an exbibyte is 2**30 GiB)


class CapacityPlan(BaseModel):
    """What fits, per GPU and per replica (one TP group of ``tp`` GPUs). Sizes in GiB (2**30).

    ``kv_tokens_per_gpu`` is the number of tokens of context one replica can hold: every GPU of
    the TP group holds its slice (GQA heads) or a full copy (MLA latent) of each of those tokens.
    """

    model_config = _FROZEN

    model: str
    gpu: str
    gpu_memory_gib: float
    tp: int
    dp: int
    num_gpus: int
    kv_dtype: str
    kv_scale_layout: str | None  # None for bf16/fp16 KV (no scales)
    weights: str
    page_size: int
    policy: str
    mem_fraction_static: float | None

    kv_bytes_per_token_per_gpu: int
    kv_attention_bytes_per_token_per_gpu: int
    kv_indexer_bytes_per_token_per_gpu: int
    kv_sliding_bytes_per_token_per_gpu: int
    sliding_window: int
    kv_bytes_per_page_per_gpu: int
    kv_state_bytes_per_request_per_gpu: int = 0  # linear-attention layers' state

    weights_gib_total: float
    weights_gib_per_gpu: float
    weights_gib_replicated_per_gpu: float
    weights_gib_by_class: dict[str, float]

    reserve_gib_per_gpu: float
    kv_budget_gib_per_gpu: float
    kv_tokens_per_gpu: int
    kv_pages_per_gpu: int
    kv_tokens_total: int

    context_len: int | None = None
    max_concurrency: int | None = None
    max_concurrency_total: int | None = None

    # For the decode bandwidth model (bytes one GPU reads per step).
    gpu_bandwidth_gbs: float
    decode_dense_weight_bytes: float
    decode_routed_weight_bytes: float
    num_experts: int
    experts_top_k: int
    decode_concurrency: int | None = None
    decode_tokens_per_s_bound: float | None = None

    # A host tier (offload_gib of host memory per replica, over its TP ranks): what it holds.
    offload_gib: float | None = None
    offload_pages_per_gpu: int | None = None
    offload_tokens: int | None = None
    offload_tokens_total: int | None = None

    def sequence_bytes(self, context_len: int) -> int:
        """KV bytes one sequence of ``context_len`` tokens takes on one GPU, pages rounded up."""
        context_len = integer(context_len, "context_len", minimum=1)
        pages = -(-context_len // self.page_size)
        nbytes = pages * self.kv_bytes_per_page_per_gpu
        if self.kv_sliding_bytes_per_token_per_gpu:
            window_pages = min(pages, -(-self.sliding_window // self.page_size) + 1)
            nbytes += window_pages * self.page_size * self.kv_sliding_bytes_per_token_per_gpu
        return nbytes + self.kv_state_bytes_per_request_per_gpu

    def concurrency_at(self, context_len: int) -> int:
        """Sequences of ``context_len`` tokens one replica holds at once (pages rounded up)."""
        budget = int(self.kv_budget_gib_per_gpu * GIB)
        return max(0, budget // self.sequence_bytes(context_len))

    def offload_pages(self, offload_gib: float) -> int:
        """Full pages a host tier of ``offload_gib`` GiB per replica holds on each TP rank.

        The replica's host memory is split evenly over its ``tp`` ranks (as vLLM's
        ``--kv-offloading-size``), and each rank's tier stores whole pages of that rank's
        ``kv_bytes_per_page_per_gpu`` bytes (a host page holds what a device page holds:
        every layer's K/V and its token scales), as :class:`kvmem.transfer.HostTier` rounds.
        """
        offload_gib = real(offload_gib, "offload_gib", minimum=0, exclusive_minimum=True,
                           maximum=_MAX_OFFLOAD_GIB)
        return int(offload_gib * GIB) // self.tp // self.kv_bytes_per_page_per_gpu

    def to_json_dict(self) -> dict[str, object]:
        """The plan as one JSON-ready dict (what ``kvmem plan --json`` prints)."""
        return self.model_dump(mode="json")


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts a batch of ``num_tokens`` tokens routes to, per layer.

    With uniform routing each token picks ``top_k`` of ``num_experts``; an expert is missed by all
    tokens with probability ``(1 - top_k / num_experts) ** num_tokens``.
    """
    num_experts = integer(num_experts, "num_experts", minimum=0)
    top_k = integer(top_k, "top_k", minimum=0, maximum=num_experts)
    num_tokens = integer(num_tokens, "num_tokens", minimum=0)
    if num_experts == 0:
        return 0.0
    # Past 2**62 tokens every routed expert is hit; a larger int exponent overflows the float.
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** min(num_tokens, 1 << 62))


def decode_bytes_per_step(plan: CapacityPlan, concurrency: int, context_len: int) -> float:
    """Bytes one GPU reads in one decode step: weights touched plus every sequence's KV.

    Dense weights (attention, dense MLP, shared experts, lm_head, routers) are read every step;
    routed experts only as far as the batch activates them; each of ``concurrency`` sequences
    reads ``context_len`` tokens of KV (its sliding layers only the window).
    """
    if not isinstance(plan, CapacityPlan):
        raise ArgumentTypeError(f"plan={show(plan)}: expected a CapacityPlan.")
    concurrency = integer(concurrency, "concurrency", minimum=1)
    context_len = integer(context_len, "context_len", minimum=0)
    active = expected_active_experts(plan.num_experts, plan.experts_top_k, concurrency)
    routed = plan.decode_routed_weight_bytes * (
        active / plan.num_experts if plan.num_experts else 0
    )
    kv = concurrency * context_len * plan.kv_bytes_per_token_per_gpu
    if plan.kv_sliding_bytes_per_token_per_gpu:
        kv += (
            concurrency
            * min(context_len, plan.sliding_window)
            * (plan.kv_sliding_bytes_per_token_per_gpu)
        )
    if kv > _MAX_BYTES:  # past a float's range: the sum would raise OverflowError
        raise ConfigError(
            f"concurrency={show(concurrency)} x context_len={show(context_len)} reads more KV "
            "bytes than a float can count; use a realistic batch and context."
        )
    return plan.decode_dense_weight_bytes + routed + kv


# Long for its docstring and argument checks; the arithmetic is in _plan and its helpers.
def plan_capacity(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    tp: int = 1,
    *,
    dp: int = 1,
    kv_dtype: str = "bf16",
    kv_scale_layout: str | None = None,
    weights: WeightScheme | str | None = None,
    policy: FixedReserve | MemoryFraction | SGLangPolicy | None = None,
    page_size: int = 16,
    context_len: int | None = None,
    concurrency: int | None = None,
    use_mtp: bool = False,
    offload_gib: float | None = None,
) -> CapacityPlan:
    """How many tokens of KV fit, and how many requests of a given length run at once.

    Parameters
    ----------
    model : ModelSpec or str
        A spec or a preset name (``kimi-k2.6``, ``llama-3.1-8b``, ...).
    gpu : GPUSpec or str
        A spec or a preset name (``h200``, ``h100-80g``, ...).
    tp : int
        Tensor-parallel GPUs per replica.
    dp : int
        Replicas (data parallel); totals are per replica times ``dp``.
    kv_dtype : str
        ``bf16``, ``fp16``, ``fp8_e4m3`` or ``fp8_e5m2``.
    kv_scale_layout : str, optional
        FP8 scales per ``tensor`` (the default for fp8), ``head`` or ``token_head`` (fp32).
        bf16/fp16 KV has no scales: giving a layout with them is refused, not ignored.
    weights : WeightScheme or str, optional
        A scheme or a name (``native``, ``bf16``, ``fp8``, ``int4-g32``, ``mxfp4``); the model's
        published checkpoint by default.
    policy : FixedReserve, MemoryFraction or SGLangPolicy, optional
        How much memory stays out of the KV pool; :class:`SGLangPolicy` by default.
    page_size : int
        Tokens per KV page.
    context_len : int, optional
        Tokens per sequence for ``max_concurrency``.
    concurrency : int, optional
        Sequences per decode step for ``decode_tokens_per_s_bound`` (needs ``context_len``).
    use_mtp : bool
        Load the MTP layers (speculative decoding).
    offload_gib : float, optional
        Host memory of a host tier per replica, in GiB, summed over its TP ranks (each rank
        stores its own pages): fills ``offload_pages_per_gpu``, ``offload_tokens`` (per
        replica) and ``offload_tokens_total`` (all replicas).

    Returns
    -------
    CapacityPlan

    Raises
    ------
    ConfigError
        When TP cannot split the heads, the weights do not fit, or the reserve leaves no KV pool.
    """
    if not isinstance(model, (str, ModelSpec)):
        raise ArgumentTypeError(f"model={show(model)}: expected a preset name or a ModelSpec.")
    if not isinstance(gpu, (str, GPUSpec)):
        raise ArgumentTypeError(f"gpu={show(gpu)}: expected a preset name or a GPUSpec.")
    tp = integer(tp, "tp", minimum=1)
    dp = integer(dp, "dp", minimum=1)
    kv_dtype = choice(kv_dtype, "kv_dtype", KV_DTYPES)
    kv_scale_layout = _scale_layout(kv_dtype, kv_scale_layout)
    if weights is not None and not isinstance(weights, (str, WeightScheme)):
        raise ArgumentTypeError(
            f"weights={show(weights)}: expected None, a scheme name (e.g. 'int4-g32') or a "
            "WeightScheme."
        )
    if policy is not None and not isinstance(policy, (FixedReserve, MemoryFraction, SGLangPolicy)):
        raise ArgumentTypeError(
            f"policy={show(policy)}: expected None, FixedReserve, MemoryFraction or SGLangPolicy."
        )
    page_size = integer(page_size, "page_size", minimum=1)
    if context_len is not None:
        context_len = integer(context_len, "context_len", minimum=1)
    if concurrency is not None:
        concurrency = integer(concurrency, "concurrency", minimum=1)
    use_mtp = flag(use_mtp, "use_mtp")
    if offload_gib is not None:
        offload_gib = real(offload_gib, "offload_gib", minimum=0, exclusive_minimum=True,
                           maximum=_MAX_OFFLOAD_GIB)
    spec = get_model(model) if isinstance(model, str) else model
    card = get_gpu(gpu) if isinstance(gpu, str) else gpu
    scheme = weight_scheme(weights, spec) if isinstance(weights, str) else (weights or spec.weights)
    plan = _plan(
        spec, card, scheme, policy or SGLangPolicy(), tp, dp, kv_dtype, kv_scale_layout,
        page_size, use_mtp,
    )
    return _with_offload(_with_context(plan, context_len, concurrency), offload_gib)


def _scale_layout(kv_dtype: str, kv_scale_layout: str | None) -> str | None:
    """The checked FP8 scale layout: ``tensor`` by default for fp8, refused for bf16/fp16."""
    if kv_scale_layout is None:
        return "tensor" if kv_dtype.startswith("fp8") else None
    kv_scale_layout = choice(kv_scale_layout, "kv_scale_layout", SCALE_LAYOUTS)
    if not kv_dtype.startswith("fp8"):
        raise ConfigError(
            f"kv_scale_layout={kv_scale_layout!r} applies to fp8 KV only; {kv_dtype} KV has "
            "no scales. Leave kv_scale_layout unset, or pick kv_dtype fp8_e4m3/fp8_e5m2."
        )
    return kv_scale_layout


def _plan(
    spec: ModelSpec,
    card: GPUSpec,
    scheme: WeightScheme,
    policy: ReservePolicy,
    tp: int,
    dp: int,
    kv_dtype: str,
    kv_scale_layout: str | None,
    page_size: int,
    use_mtp: bool,
) -> CapacityPlan:
    """:func:`plan_capacity` on checked arguments, before the context and concurrency rows."""
    layout = kv_layout(spec, kv_dtype, kv_scale_layout or "tensor", tp)
    wb = weight_bytes(spec, scheme, tp, use_mtp=use_mtp)
    mem_bytes = card.memory_mib * (1 << 20)
    budget, fraction = _kv_budget(spec, card, scheme, policy, tp, wb, layout, page_size)
    tokens = budget // layout.bytes_per_token
    page_bytes = layout.bytes_per_token * page_size
    return CapacityPlan(
        model=spec.name,
        gpu=card.name,
        gpu_memory_gib=card.memory_gib,
        tp=tp,
        dp=dp,
        num_gpus=tp * dp,
        kv_dtype=kv_dtype,
        kv_scale_layout=kv_scale_layout,
        weights=scheme.label(),
        page_size=page_size,
        policy=policy.describe(),
        mem_fraction_static=fraction,
        kv_bytes_per_token_per_gpu=layout.bytes_per_token,
        kv_attention_bytes_per_token_per_gpu=layout.attention_bytes_per_token,
        kv_indexer_bytes_per_token_per_gpu=layout.indexer_bytes_per_token,
        kv_sliding_bytes_per_token_per_gpu=layout.sliding_bytes_per_token,
        sliding_window=layout.sliding_window,
        kv_bytes_per_page_per_gpu=page_bytes,
        kv_state_bytes_per_request_per_gpu=layout.state_bytes_per_request,
        weights_gib_total=wb.total / GIB,
        weights_gib_per_gpu=wb.per_gpu / GIB,
        weights_gib_replicated_per_gpu=wb.replicated_per_gpu / GIB,
        weights_gib_by_class={k: v / GIB for k, v in wb.by_class.items()},
        reserve_gib_per_gpu=(mem_bytes - wb.per_gpu - budget) / GIB,
        kv_budget_gib_per_gpu=budget / GIB,
        kv_tokens_per_gpu=tokens,
        kv_pages_per_gpu=budget // page_bytes,
        kv_tokens_total=tokens * dp,
        gpu_bandwidth_gbs=card.bandwidth_gbs,
        decode_dense_weight_bytes=_dense_read_bytes(spec, scheme, wb),
        decode_routed_weight_bytes=wb.by_class["routed_experts"],
        num_experts=spec.moe.num_experts if spec.moe else 0,
        experts_top_k=spec.moe.top_k if spec.moe else 0,
    )


def _kv_budget(
    spec: ModelSpec,
    card: GPUSpec,
    scheme: WeightScheme,
    policy: ReservePolicy,
    tp: int,
    wb: WeightBytes,
    layout: KVLayout,
    page_size: int,
) -> tuple[int, float | None]:
    """Bytes per GPU left for KV pages, and the memory fraction the policy used (if any)."""
    mem_bytes = card.memory_mib * (1 << 20)
    fraction: float | None = None
    if isinstance(policy, FixedReserve):
        budget = mem_bytes - wb.per_gpu - policy.reserve_gib * GIB
    elif isinstance(policy, MemoryFraction):
        fraction = policy.fraction
        budget = mem_bytes * fraction - wb.per_gpu
    else:
        fraction = sglang_mem_fraction_static(card, tp, policy, spec.vision)
        budget = mem_bytes * fraction - wb.per_gpu - policy.runtime_overhead_gib * GIB
    if wb.per_gpu >= mem_bytes:
        raise ConfigError(
            f"{spec.name} weights ({scheme.label()}) need {wb.per_gpu / GIB:.1f} GiB per GPU at "
            f"TP {tp} but a {card.name} has {card.memory_gib:.1f} GiB; use more GPUs per replica "
            "or smaller weights."
        )
    budget -= layout.fixed_bytes
    if budget < layout.bytes_per_token * page_size:
        raise ConfigError(
            f"{spec.name} at TP {tp} on {card.name}: weights take {wb.per_gpu / GIB:.1f} GiB of "
            f"{card.memory_gib:.1f} GiB and {policy.describe()} leaves "
            f"{max(budget, 0) / GIB:.2f} GiB, not even one KV page of {page_size} tokens "
            f"({layout.bytes_per_token * page_size / GIB:.3g} GiB); use more GPUs per replica, "
            "smaller weights, a smaller reserve or a smaller page_size."
        )
    return int(budget), fraction


def _dense_read_bytes(spec: ModelSpec, scheme: WeightScheme, wb: WeightBytes) -> float:
    """Weight bytes a decode step reads whatever the batch: all non-expert weights but the input
    embedding table and the vision tower (routed experts are read as far as they are active)."""
    embed_share = 0.5 if not spec.tie_word_embeddings else 1.0  # the lm_head half is read
    vision_bytes = spec.vision.num_params * scheme.other.bytes_per_param() if spec.vision else 0.0
    return (
        wb.by_class["attention"]
        + wb.by_class["dense_mlp"]
        + wb.by_class["shared_experts"]
        + wb.by_class["other"]
        - vision_bytes
        + wb.by_class["embeddings"] * embed_share
    )


def _with_context(
    plan: CapacityPlan, context_len: int | None, concurrency: int | None
) -> CapacityPlan:
    """``plan`` with its max concurrency at ``context_len`` and decode bound at ``concurrency``."""
    updates: dict[str, object] = {}
    if context_len is not None:
        conc = plan.concurrency_at(context_len)
        updates.update(
            context_len=context_len, max_concurrency=conc, max_concurrency_total=conc * plan.dp
        )
    if concurrency is not None:
        if context_len is None:
            raise ConfigError("a decode bound at a concurrency needs context_len as well.")
        step_s = decode_bytes_per_step(plan, concurrency, context_len) / (
            plan.gpu_bandwidth_gbs * 1e9
        )
        updates.update(
            decode_concurrency=concurrency, decode_tokens_per_s_bound=concurrency / step_s
        )
    return plan.model_copy(update=updates) if updates else plan


def _with_offload(plan: CapacityPlan, offload_gib: float | None) -> CapacityPlan:
    """``plan`` with what a host tier of ``offload_gib`` GiB per replica holds."""
    if offload_gib is None:
        return plan
    pages = plan.offload_pages(offload_gib)
    if pages == 0:
        raise ConfigError(
            f"a host tier of {offload_gib:g} GiB over {plan.tp} rank(s) holds no KV page of "
            f"{plan.kv_bytes_per_page_per_gpu:,} bytes per rank ({plan.page_size} tokens); give "
            f"at least {plan.kv_bytes_per_page_per_gpu * plan.tp / GIB:.3g} GiB."
        )
    tokens = pages * plan.page_size
    return plan.model_copy(update={
        "offload_gib": offload_gib, "offload_pages_per_gpu": pages, "offload_tokens": tokens,
        "offload_tokens_total": tokens * plan.dp})


def tokens_freed(before: CapacityPlan, after: CapacityPlan) -> int:
    """KV tokens per replica that ``after`` holds beyond ``before`` (e.g. smaller weights)."""
    for name, plan in (("before", before), ("after", after)):
        if not isinstance(plan, CapacityPlan):
            raise ArgumentTypeError(f"{name}={show(plan)}: expected a CapacityPlan.")
    return after.kv_tokens_per_gpu - before.kv_tokens_per_gpu
