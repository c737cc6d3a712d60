"""A model's KV cache groups and what a workload costs in each: kvmem's groups against the
same layers padded to one page size as vLLM groups them.

kvmem's layout, one group per kind of layer (no group padded to another's page size)::

    full      FullAttentionSpec    every full-attention layer (MLA or GQA), page_size tokens
    swa       SlidingWindowSpec    every sliding-window layer, page_size tokens, its window
    state     StateSpec            every linear-attention layer's state: one slot per request
    indexer   IndexerSpec          the DSA indexer's keys, on the full group's token positions

vLLM's layout (``vllm/v1/core/kv_cache_planning.py``, 0.33): a model whose layers are all full
attention (MLA and indexer included) is one group, unpadded; otherwise the layers are bucketed
by kind, every group holds ``group_size`` layers (the smallest bucket's count, or the largest's
when it is under 1.5 times the smallest; a bucket's last group is filled with padding layers),
and all groups share one page byte size (:func:`~kvmem.allocator.padded_layout`). A group's
page costs its ``group_size`` layers, padding layers included: they are slots of the tensors
every group shares.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvmem._validate import integer, show
from kvmem.allocator import (
    FullAttentionSpec,
    GroupSpec,
    IndexerSpec,
    SlidingWindowSpec,
    StateSpec,
    padded_layout,
    request_cost,
)
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.planning._accounting import GIB, layer_kv_bytes_per_token
from kvmem.planning._plan import CapacityPlan
from kvmem.planning._spec import ModelSpec

__all__ = ["GroupPlan", "GroupRow", "LayoutPlan", "kv_groups", "plan_groups", "vllm_groups"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def _per_layer(model: ModelSpec, plan: CapacityPlan) -> int:
    return layer_kv_bytes_per_token(model.attention, plan.kv_dtype,
                                    plan.kv_scale_layout or "tensor", plan.tp)


def kv_groups(model: ModelSpec, plan: CapacityPlan) -> tuple[GroupSpec, ...]:
    """kvmem's groups for ``model`` on one GPU of ``plan`` (its dtype, TP and page size)."""
    _check(model, plan)
    per_layer = _per_layer(model, plan)
    full = FullAttentionSpec("full", plan.page_size, model.num_full_layers * per_layer)
    groups: list[GroupSpec] = [full]
    attn = model.attention
    if attn.num_sliding_layers:
        assert attn.sliding_window is not None  # validated by AttentionSpec
        groups.append(SlidingWindowSpec("swa", attn.sliding_window, plan.page_size,
                                        attn.num_sliding_layers * per_layer))
    if model.linear:
        groups.append(StateSpec("state", model.linear.num_layers
                                * model.linear.state_bytes_per_layer(plan.tp)))
    if model.indexer:
        idx = model.indexer
        groups.append(IndexerSpec("indexer", full,
                                  idx.num_cache_layers * idx.bytes_per_token_per_layer()))
    return tuple(groups)


def vllm_groups(model: ModelSpec, plan: CapacityPlan) -> tuple[GroupSpec, ...]:
    """The groups vLLM 0.33 makes of ``model``'s layers (see the module doc), each described
    with its ``group_size`` layers' bytes, for :func:`~kvmem.allocator.padded_layout`."""
    _check(model, plan)
    per_layer = _per_layer(model, plan)
    attn = model.attention
    idx = model.indexer
    if not attn.num_sliding_layers and not model.linear:
        # all layers full attention: one group, every layer's own page size, no padding
        indexer = idx.num_cache_layers * idx.bytes_per_token_per_layer() if idx else 0
        return (FullAttentionSpec("full", plan.page_size,
                                  model.num_full_layers * per_layer + indexer),)
    if idx:
        raise ConfigError(f"{model.name}: a DSA indexer beside sliding-window or linear layers "
                          "has its own grouping in vLLM, which kvmem does not model; compare "
                          "a model without one.")
    buckets: list[tuple[str, int, int | None]] = [("full", model.num_full_layers, per_layer)]
    if attn.num_sliding_layers:
        buckets.append(("swa", attn.num_sliding_layers, per_layer))
    if model.linear:
        buckets.append(("state", model.linear.num_layers, None))
    counts = [n for _, n, _ in buckets]
    group_size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups: list[GroupSpec] = []
    for kind, num_layers, per_token in buckets:
        num_groups = -(-num_layers // group_size)
        for i in range(num_groups):
            name = kind if num_groups == 1 else f"{kind}{i}"
            if kind == "state":
                assert model.linear is not None
                groups.append(StateSpec(name, group_size
                                        * model.linear.state_bytes_per_layer(plan.tp)))
            elif kind == "swa":
                assert attn.sliding_window is not None and per_token is not None
                groups.append(SlidingWindowSpec(name, attn.sliding_window, plan.page_size,
                                                group_size * per_token))
            else:
                assert per_token is not None
                groups.append(FullAttentionSpec(name, plan.page_size, group_size * per_token))
    return tuple(groups)


def _check(model: ModelSpec, plan: CapacityPlan) -> None:
    if not isinstance(model, ModelSpec):
        raise ArgumentTypeError(f"model={show(model)}: expected a ModelSpec "
                                "(get_model('glm-5.2'), load_hf_config).")
    if not isinstance(plan, CapacityPlan):
        raise ArgumentTypeError(f"plan={show(plan)}: expected a CapacityPlan.")


class GroupRow(BaseModel):
    """One group of a layout, for a request of the workload's length, on one GPU.

    ``bytes_per_token`` is 0 for a state group, ``bytes_per_state`` 0 for a token group;
    ``bytes_at_capacity`` is what the group holds when the pool is full of such requests.
    """

    model_config = _FROZEN

    name: str
    kind: Literal["full", "sliding_window", "state", "indexer"]
    page_size: int
    bytes_per_token: int
    bytes_per_state: int
    page_bytes: int
    pages_per_request: int
    bytes_per_request: int
    bytes_at_capacity: int


class LayoutPlan(BaseModel):
    """A layout's groups and what fits: ``requests_fit`` whole requests of the workload in the
    KV budget (a padded pool is whole pages), ``tokens_fit`` their tokens, ``tokens_per_gib``
    the tokens resident per GiB when memory is filled with such requests."""

    model_config = _FROZEN

    layout: Literal["kvmem", "padded"]
    page_size: int
    groups: list[GroupRow]
    bytes_per_request: int
    requests_fit: int
    tokens_fit: int
    tokens_per_gib: float


class GroupPlan(BaseModel):
    """kvmem's groups and vLLM's padded groups for one workload (requests of ``context_len``
    tokens), on one GPU of the plan, side by side. ``gain`` is kvmem's tokens per GiB over the
    padded layout's."""

    model_config = _FROZEN

    model: str
    kv_dtype: str
    tp: int
    context_len: int
    kv_budget_bytes_per_gpu: int
    kvmem: LayoutPlan
    padded: LayoutPlan
    gain: float

    def to_json_dict(self) -> dict[str, object]:
        return self.model_dump(mode="json")


_KINDS = {FullAttentionSpec: "full", SlidingWindowSpec: "sliding_window", StateSpec: "state",
          IndexerSpec: "indexer"}


def _layout(name: Literal["kvmem", "padded"], groups: tuple[GroupSpec, ...], context_len: int,
            budget: int) -> LayoutPlan:
    cost = request_cost(groups, context_len)
    if name == "kvmem":
        per_request = cost.total_bytes
        requests = budget // per_request
        pages = cost.num_pages
        page_size = max(g.page_size for g in groups)
        specs = [(g.page_size, g.page_bytes) for g in groups]
    else:
        per_request = cost.total_padded_bytes
        requests = (budget // cost.padded.page_bytes) // sum(cost.padded_num_pages)
        pages = cost.padded_num_pages
        page_size = cost.padded.page_size
        specs = [(0 if isinstance(g, StateSpec) else page_size, cost.padded.page_bytes)
                 for g in groups]
    rows = []
    for g, n, (g_page_size, g_page_bytes) in zip(groups, pages, specs):
        is_state = isinstance(g, StateSpec)
        rows.append(GroupRow(
            name=g.name, kind=_KINDS[type(g)],  # type: ignore[arg-type]
            page_size=g_page_size,
            bytes_per_token=0 if is_state else g_page_bytes // g_page_size,
            bytes_per_state=g_page_bytes if is_state else 0,
            page_bytes=g_page_bytes, pages_per_request=n, bytes_per_request=n * g_page_bytes,
            bytes_at_capacity=requests * n * g_page_bytes))
    return LayoutPlan(layout=name, page_size=page_size, groups=rows,
                      bytes_per_request=per_request, requests_fit=requests,
                      tokens_fit=requests * context_len,
                      tokens_per_gib=context_len * GIB / per_request)


def plan_groups(model: ModelSpec, plan: CapacityPlan, context_len: int) -> GroupPlan:
    """Per-group accounting of ``model`` for requests of ``context_len`` tokens on the KV budget
    of one GPU of ``plan`` (``plan_capacity(model, ...)``), kvmem's and padded.

    Pages are those a request holds between decode steps (a sliding window's from its next
    query's window on); kvmem's bytes leave out the arena's carving (under one page per chunk).
    """
    _check(model, plan)
    if plan.model != model.name:
        raise ConfigError(f"plan is for {plan.model!r}, not {model.name!r}: plan the same "
                          "model.")
    context_len = integer(context_len, "context_len", minimum=1)
    budget = int(plan.kv_budget_gib_per_gpu * GIB)
    mine = _layout("kvmem", kv_groups(model, plan), context_len, budget)
    padded_groups = vllm_groups(model, plan)
    padded_layout(padded_groups)  # checks the set
    theirs = _layout("padded", padded_groups, context_len, budget)
    return GroupPlan(model=model.name, kv_dtype=plan.kv_dtype, tp=plan.tp,
                     context_len=context_len, kv_budget_bytes_per_gpu=budget, kvmem=mine,
                     padded=theirs, gain=mine.tokens_per_gib / theirs.tokens_per_gib)
