"""What one request costs in every KV cache group: its true bytes, and the same padded to one
page size as vLLM's hybrid allocator pads.

kvmem charges each group its own pages (:meth:`GroupSpec.num_pages` pages of ``page_bytes``).
The padded layout gives every group one page byte size:

- token groups (full attention, sliding window, indexer) share one page of ``T`` tokens:
  ``align * ceil(S / (align * b))``, the smallest multiple of ``align`` (the largest token
  group's ``page_size``) whose page of the largest bytes per token ``b`` holds the largest
  state ``S``; ``align`` when there is no state group;
- every page, of every group, then costs ``B = T * b`` bytes (a state page is padded up to it;
  a pure-state model has ``B = S``).

This is vLLM's rule (``vllm/platforms/interface.py``: the attention block size is raised until
an attention page holds a Mamba state, then the Mamba page is padded to it), with the groups
described as vLLM groups layers: describe each group with the bytes of the layers that share
its page table. A short request then pins a whole padded page in every group: the
"a 12-token prompt takes a third of the pool" effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmem._validate import integer
from kvmem.allocator._groups import (
    FullAttentionSpec,
    GroupSpec,
    IndexerSpec,
    SlidingWindowSpec,
    StateSpec,
    check_groups,
    first_window_page,
)

__all__ = ["GIB", "PaddedLayout", "RequestCost", "padded_layout", "request_cost"]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class PaddedLayout:
    """One page size for every group: ``page_size`` tokens per token-group page (0 without
    token groups), ``page_bytes`` bytes per page of any group."""

    page_size: int
    page_bytes: int


@dataclass(frozen=True, slots=True)
class RequestCost:
    """A request of ``num_tokens`` tokens, group by group (in the groups' order).

    ``num_pages`` / ``bytes``: kvmem's pages and their true bytes; ``padded_num_pages`` /
    ``padded_bytes``: the same request in the padded layout ``padded``.
    """

    num_tokens: int
    names: tuple[str, ...]
    num_pages: tuple[int, ...]
    bytes: tuple[int, ...]
    padded: PaddedLayout
    padded_num_pages: tuple[int, ...]
    padded_bytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes)

    @property
    def needs(self) -> dict[str, int]:
        """``{group: num_pages}``, as :meth:`GroupAllocator.allocate` takes it."""
        return dict(zip(self.names, self.num_pages))

    @property
    def total_padded_bytes(self) -> int:
        return sum(self.padded_bytes)

    def pool_share(self, pool_bytes: int) -> tuple[float, float]:
        """The fraction of a pool of ``pool_bytes`` this one request takes: ``(kvmem,
        padded)``. The padded pool is ``pool_bytes // page_bytes`` whole pages."""
        pool_bytes = integer(pool_bytes, "pool_bytes", minimum=1)
        padded_pool = (pool_bytes // self.padded.page_bytes) * self.padded.page_bytes
        return (self.total_bytes / pool_bytes,
                self.total_padded_bytes / padded_pool if padded_pool else float("inf"))

    def tokens_per_gib(self) -> tuple[float, float]:
        """Tokens resident per GiB when memory is filled with requests like this one:
        ``(kvmem, padded)``."""
        return (self.num_tokens * GIB / self.total_bytes,
                self.num_tokens * GIB / self.total_padded_bytes)


def _is_token_group(spec: GroupSpec) -> bool:
    return isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, IndexerSpec))


def padded_layout(groups: Sequence[GroupSpec]) -> PaddedLayout:
    """The one page size the padded layout gives ``groups`` (see the module doc)."""
    groups = check_groups(groups)
    tokens = [g for g in groups if _is_token_group(g)]
    state = max((g.bytes_per_state for g in groups if isinstance(g, StateSpec)), default=0)
    if not tokens:
        return PaddedLayout(page_size=0, page_bytes=state)
    align = max(g.page_size for g in tokens)
    per_token = max(g.bytes_per_token for g in tokens)  # type: ignore[union-attr]
    page_size = align * max(1, -(-state // (align * per_token)))
    return PaddedLayout(page_size=page_size, page_bytes=page_size * per_token)


def _padded_pages(spec: GroupSpec, num_tokens: int, page_size: int) -> int:
    if isinstance(spec, StateSpec):
        return 1
    last = -(-num_tokens // page_size)
    if isinstance(spec, SlidingWindowSpec):
        return last - min(last, first_window_page(num_tokens, spec.window, page_size))
    return last


def request_cost(groups: Sequence[GroupSpec], num_tokens: int) -> RequestCost:
    """A request of ``num_tokens`` computed tokens in every group, kvmem's and padded.

    Pages are those held between steps (a sliding window's from the next query's window on,
    a state group's one slot). kvmem's bytes exclude the arena's carving (under one page per
    chunk, see :class:`~kvmem.allocator.GroupAllocator`).
    """
    groups = check_groups(groups)
    num_tokens = integer(num_tokens, "num_tokens", minimum=0)
    padded = padded_layout(groups)
    pages = tuple(g.num_pages(num_tokens) for g in groups)
    padded_pages = tuple(_padded_pages(g, num_tokens, padded.page_size) for g in groups)
    return RequestCost(
        num_tokens=num_tokens,
        names=tuple(g.name for g in groups),
        num_pages=pages,
        bytes=tuple(n * g.page_bytes for n, g in zip(pages, groups)),
        padded=padded,
        padded_num_pages=padded_pages,
        padded_bytes=tuple(n * padded.page_bytes for n in padded_pages),
    )
