"""Run hybrid transformers models on a :class:`~kvmem.hybrid.HybridManager`'s pages.

A hybrid model keeps several kinds of cache; each becomes one KV cache group, all paid from one
byte budget and stored in one :class:`~kvmem.cuda.GroupPool` buffer::

    config.layer_types     group, spec                  a page holds, for each of its layers
    full_attention         'full', FullAttentionSpec    k<l>, v<l> [page_size, kv_heads, head_dim]
    sliding_attention      'sliding', SlidingWindowSpec k<l>, v<l> (config.sliding_window)
    linear_attention       'state', StateSpec           conv<l> [conv_dim, kernel],
                                                        rec<l> [v_heads, k_dim, v_dim]
    indexed_attention      'full'                       k<l> latent [page_size, 1, kv_lora_rank],
      (DSA, MLA latents)                                v<l> rope key [page_size, 1, rope_dim]
                           'indexer', IndexerSpec       i<l> [page_size, index_head_dim]

The seam is transformers' cache object: :class:`PagedHybridLM` runs each request of a
:class:`~kvmem.allocator.HybridStep` as one forward whose ``cache`` is a small
:class:`transformers.Cache` over that request's pages. Its ``update`` writes the new keys and
values at the group's ``slot_mapping`` and returns the request's keys and values read back
from the pages the step lists (a sliding layer's from its window's first page); ``update_indexer``
does the same for DSA indexer keys; the conv and recurrent states of linear-attention layers are
views of the request's state slot, read and written in place. The masks come from the step's
positions (a sliding layer's window included), so the model's own attention code runs unchanged.

Needs transformers 5.x (the hf extra).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvmem._validate import integer, show
from kvmem.allocator import (
    FullAttentionSpec,
    GroupSpec,
    HybridStep,
    IndexerSpec,
    SlidingWindowSpec,
    StateSpec,
)
from kvmem.cuda import GroupPool
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.integrations._kvbatch import check_vocab

try:
    from transformers import Cache
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvmem.integrations.hf_hybrid needs transformers: "
                      "pip install 'kvmem[hf]'") from exc

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["HybridLayout", "PagedHybridLM", "hybrid_groups"]

FULL, SLIDING, STATE, INDEXER = "full", "sliding", "state", "indexer"
_KINDS = {"full_attention": FULL, "indexed_attention": FULL, "sliding_attention": SLIDING,
          "linear_attention": STATE}


@dataclass(frozen=True)
class HybridLayout:
    """A model's KV cache groups and what their pages hold.

    groups: the group specs, for a ``HybridManager``
    fields: ``{group: {field: shape in one page}}``, for a ``GroupPool``
    layer_types: ``config.layer_types`` (the masks' keys)
    layer_groups: the group of each layer's keys and values, or state
    """

    groups: tuple[GroupSpec, ...]
    fields: dict[str, dict[str, tuple[int, ...]]]
    layer_types: tuple[str, ...]
    layer_groups: tuple[str, ...]

    def spec(self, name: str) -> GroupSpec:
        return next(g for g in self.groups if g.name == name)


def hybrid_groups(config: Any, dtype: torch.dtype = torch.float32, page_size: int = 16,
                  sliding_page_size: int | None = None) -> HybridLayout:
    """The KV cache groups of a transformers model config, at ``dtype`` elements.

    Every group's bytes per token (or per state) are exactly what its fields hold, all of its
    layers together. Supports ``config.layer_types`` of ``full_attention``,
    ``sliding_attention`` (window ``config.sliding_window``), ``linear_attention`` (gated
    delta net: ``linear_*`` sizes) and ``indexed_attention`` (DSA with an MLA latent cache;
    an indexer key cache for the layers whose ``indexer_types`` is ``"full"``).

    Parameters
    ----------
    page_size: tokens per page of the full-attention (and indexer) group
    sliding_page_size: tokens per page of the sliding group (default ``page_size``)

    Raises
    ------
    ConfigError: a layer type this function does not know, or a bidirectional model.
    """
    page_size = integer(page_size, "page_size", minimum=1)
    sliding_page_size = page_size if sliding_page_size is None else integer(
        sliding_page_size, "sliding_page_size", minimum=1)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    layers = int(config.num_hidden_layers)
    types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    unknown = sorted({t for t in types if t not in _KINDS})
    if unknown:
        raise ConfigError(f"layer types {unknown} have no kvmem group; known: {sorted(_KINDS)}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError("use_bidirectional_attention=True: kvmem runs causal models only")
    mla = getattr(config, "kv_lora_rank", None) is not None
    fields: dict[str, dict[str, tuple[int, ...]]] = {}
    for layer, kind in enumerate(_KINDS[t] for t in types):
        P = sliding_page_size if kind == SLIDING else page_size
        out = fields.setdefault(kind, {})
        if kind == STATE:
            k_dim = config.linear_num_key_heads * config.linear_key_head_dim
            v_dim = config.linear_num_value_heads * config.linear_value_head_dim
            out[f"conv{layer}"] = (2 * k_dim + v_dim, config.linear_conv_kernel_dim)
            out[f"rec{layer}"] = (config.linear_num_value_heads, config.linear_key_head_dim,
                                  config.linear_value_head_dim)
        elif mla:
            out[f"k{layer}"] = (P, 1, config.kv_lora_rank)
            out[f"v{layer}"] = (P, 1, config.qk_rope_head_dim)
        else:
            head_dim = getattr(config, "head_dim", None) or \
                config.hidden_size // config.num_attention_heads
            out[f"k{layer}"] = out[f"v{layer}"] = (P, config.num_key_value_heads, head_dim)
        if types[layer] == "indexed_attention" and _has_indexer(config, layer):
            fields.setdefault(INDEXER, {})[f"i{layer}"] = (page_size, config.index_head_dim)

    def per_page(name: str) -> int:
        return sum(math.prod(s) for s in fields[name].values()) * itemsize

    groups: list[GroupSpec] = []
    full = None
    if FULL in fields:
        full = FullAttentionSpec(FULL, page_size, per_page(FULL) // page_size)
        groups.append(full)
    if SLIDING in fields:
        groups.append(SlidingWindowSpec(SLIDING, int(config.sliding_window), sliding_page_size,
                                        per_page(SLIDING) // sliding_page_size))
    if STATE in fields:
        groups.append(StateSpec(STATE, per_page(STATE)))
    if INDEXER in fields:
        assert full is not None
        groups.append(IndexerSpec(INDEXER, full, per_page(INDEXER) // page_size))
    order = [g.name for g in groups]
    return HybridLayout(tuple(groups), {name: fields[name] for name in order}, types,
                        tuple(_KINDS[t] for t in types))


def _has_indexer(config: Any, layer: int) -> bool:
    kinds = getattr(config, "indexer_types", None)
    return kinds is None or kinds[layer] == "full"


@dataclass(frozen=True)
class _RequestPages:
    """One request's part of a step: tokens ``start:end`` computed; per token group the pages
    listed (``[k]`` int64, from row index ``first``) and the new tokens' slots (``[n]``
    int64); per state group its slot."""

    start: int
    end: int
    pages: dict[str, torch.Tensor]
    first: dict[str, int]
    slots: dict[str, torch.Tensor]
    states: dict[str, int]


class _PagedCache(Cache):
    """The ``cache`` one request's forward reads and writes: its pages and state slots."""

    def __init__(self, lm: PagedHybridLM, req: _RequestPages) -> None:
        super().__init__(layers=[])
        self.lm = lm
        self.req = req

    def _tokens(self, group: str, name: str, new: torch.Tensor) -> torch.Tensor:
        """Write ``new`` (``[n, ...]``) at the request's slots; return every token the step
        lists (``[end - first * page_size, ...]``) read back from the pages."""
        pool, req = self.lm.pool, self.req
        pool.write_tokens(group, name, req.slots[group], new)
        rows = pool.gather(group, name, req.pages[group]).flatten(0, 1)
        P = self.lm.layout.spec(group).page_size
        return rows[: req.end - req.first[group] * P].to(new.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, heads, n, dim]`` new keys and values -> the request's, ``[1, heads, T, dim]``."""
        group = self.lm.layout.layer_groups[layer_idx]
        k = self._tokens(group, f"k{layer_idx}", key_states[0].transpose(0, 1))
        v = self._tokens(group, f"v{layer_idx}", value_states[0].transpose(0, 1))
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``[1, n, dim]`` new indexer keys -> the request's, ``[1, T, dim]``."""
        return self._tokens(INDEXER, f"i{layer_idx}", indexer_key_states[0])[None]

    def _state(self, kind: str, layer_idx: int) -> torch.Tensor:
        return self.lm.pool.page(STATE, f"{kind}{layer_idx}", self.req.states[STATE])[None]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """``[1, conv_dim, kernel]`` view of the slot; None before the request's first token."""
        return self._state("conv", layer_idx) if self.req.start else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        """Keep the last ``kernel`` inputs in the slot; return them with the new ones
        (``[1, conv_dim, kernel + n]``, left-padded with zeros on a request's first tokens),
        as transformers' ``LinearAttentionLayer`` does."""
        state = self._state("conv", layer_idx)
        kernel = state.shape[-1]
        if self.req.start:
            full = torch.cat([state.to(conv_states.dtype), conv_states], dim=-1)
        else:
            full = torch.nn.functional.pad(conv_states, (max(0, kernel - conv_states.shape[-1]),
                                                         0))
        state.copy_(full[..., -kernel:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """``[1, v_heads, k_dim, v_dim]`` view of the slot; None before the first token."""
        return self._state("rec", layer_idx) if self.req.start else None

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        state = self._state("rec", layer_idx)
        state.copy_(recurrent_states)
        return state

    def has_previous_state(self, layer_idx: int | None = None,
                           state_idx: int | None = None) -> bool:
        return self.req.start > 0

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        pass  # (transformers counts tokens here; kvmem's manager counts them)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.req.start


class PagedHybridLM:
    """A transformers causal LM whose every cache (keys and values, sliding windows, recurrent
    states, DSA indexer keys) lives in a :class:`~kvmem.cuda.GroupPool`.

    Parameters
    ----------
    model: a transformers causal LM whose config ``hybrid_groups`` understands
    layout: ``hybrid_groups(model.config, pool.dtype, ...)``
    pool: a GroupPool over the ``HybridManager``'s allocator, with ``layout.fields``
    """

    def __init__(self, model: PreTrainedModel, layout: HybridLayout, pool: GroupPool) -> None:
        if not isinstance(layout, HybridLayout):
            raise ArgumentTypeError(f"layout={show(layout)}: expected hybrid_groups(config)")
        if not isinstance(pool, GroupPool):
            raise ArgumentTypeError(f"pool={show(pool)}: expected a kvmem.cuda.GroupPool")
        if tuple(pool.allocator.groups) != layout.groups:
            raise ConfigError("the pool's groups are not the layout's: build the HybridManager "
                              "from layout.groups and the GroupPool over its allocator")
        if len(layout.layer_types) != model.config.num_hidden_layers:
            raise ConfigError(f"the layout describes {len(layout.layer_types)} layers, the "
                              f"model has {model.config.num_hidden_layers}")
        self.model = model
        self.layout = layout
        self.pool = pool

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, step: HybridStep) -> torch.Tensor:
        """Run one step: request ``b`` of ``step`` computes its ``num_new_tokens[b]`` tokens.

        Parameters
        ----------
        input_ids: ``[T]`` int64, every request's new tokens packed in the step's order
        step: from ``HybridManager.reserve`` (and ``verify``), after the copies
            ``take_copies()`` listed were made (``pool.copy_pages``)

        Returns
        -------
        ``[T, vocab_size]`` float32: row t predicts the token after token t.
        """
        if not isinstance(step, HybridStep):
            raise ArgumentTypeError(f"step={show(step)}: expected HybridManager.reserve()'s step")
        counts = step.num_new_tokens.astype(np.int64)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64,
                                                                              torch.int32):
            raise ArgumentTypeError(f"input_ids={show(input_ids)}: expected an int64 tensor [T]")
        if input_ids.dim() != 1 or input_ids.shape[0] != int(counts.sum()):
            raise ArgumentError(f"input_ids has shape {tuple(input_ids.shape)}; the step computes "
                                f"{int(counts.sum())} tokens: pass them packed, [T]")
        if input_ids.numel():  # (before any page is written)
            check_vocab(int(input_ids.min()), int(input_ids.max()),
                        int(self.model.config.vocab_size), "input_ids")
        qo = np.concatenate([[0], np.cumsum(counts)])
        out = []
        for b in range(len(step.request_ids)):
            if not counts[b]:
                continue
            req = self._request(step, b, qo)
            positions = torch.arange(req.start, req.end, device=input_ids.device)
            logits = self.model(input_ids=input_ids[qo[b] : qo[b + 1]][None],
                                position_ids=positions[None], attention_mask=self._masks(req),
                                cache=_PagedCache(self, req), use_cache=True).logits
            out.append(logits[0].float())
        if not out:
            return torch.empty(0, self.model.config.vocab_size)
        return torch.cat(out)

    def _request(self, step: HybridStep, b: int, qo: np.ndarray) -> _RequestPages:
        end = int(step.seq_lens[b])
        start = end - int(step.num_new_tokens[b])
        pages, first, slots = {}, {}, {}
        for name, meta in step.groups.items():
            lo, hi = int(meta.indptr[b]), int(meta.indptr[b + 1])
            pages[name] = torch.from_numpy(meta.indices[lo:hi].astype(np.int64))
            first[name] = int(meta.first[b])
            slots[name] = torch.from_numpy(meta.slot_mapping[qo[b] : qo[b + 1]])
        states = {name: int(s[b]) for name, s in step.state_slots.items()}
        return _RequestPages(start, end, pages, first, slots, states)

    def _masks(self, req: _RequestPages) -> dict[str, torch.Tensor | None]:
        """``{layer type: [1, 1, n, T]}``: causal over the keys each group's pages hold from
        its first listed page, a sliding window's limit included; bool (True: attend) for
        ``sdpa``, additive (0 or the dtype's lowest) for ``eager`` attention."""
        implementation = self.model.config._attn_implementation
        if implementation not in ("eager", "sdpa"):
            raise ConfigError(f"the model's attention implementation is {implementation!r}; "
                              "PagedHybridLM hands it masks over the pages' keys, which 'eager' "
                              "and 'sdpa' take: model.set_attn_implementation('sdpa')")
        device = self.pool.buffer.device
        q = torch.arange(req.start, req.end, device=device)[:, None]
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in set(self.layout.layer_types):
            kind = _KINDS[layer_type]
            if kind == STATE:
                masks[layer_type] = None
                continue
            spec = self.layout.spec(kind)
            k = torch.arange(req.first[kind] * spec.page_size, req.end, device=device)[None, :]
            allowed = k <= q
            if isinstance(spec, SlidingWindowSpec):
                allowed &= q - k < spec.window
            if implementation == "eager":
                dtype = self.model.dtype
                masks[layer_type] = torch.zeros(allowed.shape, dtype=dtype, device=device) \
                    .masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
            else:
                masks[layer_type] = allowed[None, None]
        return masks
