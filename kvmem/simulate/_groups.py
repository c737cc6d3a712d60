"""Continuous batching on KV cache groups (``kvmem simulate --groups``): kvmem's groups, each
its own page size, against the same layers padded to one page size as vLLM groups them.

Both layouts run the same workload through the real :class:`~kvmem.allocator.GroupAllocator`
(one byte budget) and :class:`~kvmem.allocator.WindowRow` (a sliding window's pages released as
a request advances); the padded layout's allocator has one page byte size for every group and
chunks of one page, a pool of whole pages as vLLM's. A decode pool, one step at a time::

    admit waiting requests, FCFS, while a row is free and every group has the prompt's pages
        (a sliding group takes the prompt's pages, then frees those before its window)
    each running request writes one token: a new page in a token group when its last is full;
        if a page is not there, preempt the newest request (its pages freed, requeued first)
    sliding rows advance: pages wholly before the next query's window are freed
    finished requests free every page

The clock is decode steps; ``tokens_per_step`` (output tokens over steps) is the throughput
the layout allows when memory, not compute, bounds the batch.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict

from kvmem._validate import integer, show
from kvmem.allocator import (
    FullAttentionSpec,
    GroupAllocator,
    GroupSpec,
    SlidingWindowSpec,
    StateSpec,
    WindowRow,
    check_groups,
    padded_layout,
)
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.simulate._workload import Arrivals, Workload

__all__ = ["GroupSimulationReport", "GroupUse", "padded_specs", "simulate_groups"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
GIB = 1 << 30


def padded_specs(groups: tuple[GroupSpec, ...]) -> tuple[GroupSpec, ...]:
    """``groups`` on :func:`~kvmem.allocator.padded_layout`'s one page size: every token group
    on pages of its ``page_size`` tokens at the largest bytes per token, every state on a page
    of the same bytes."""
    layout = padded_layout(groups)
    out: list[GroupSpec] = []
    per_token = layout.page_bytes // layout.page_size if layout.page_size else 0
    for g in groups:
        if isinstance(g, StateSpec):
            out.append(StateSpec(g.name, layout.page_bytes))
        elif isinstance(g, SlidingWindowSpec):
            out.append(SlidingWindowSpec(g.name, g.window, layout.page_size, per_token))
        else:  # full attention, or an indexer: its own pages of the one size
            out.append(FullAttentionSpec(g.name, layout.page_size, per_token))
    return tuple(out)


class GroupUse(BaseModel):
    """One group's pages at the step that held the most tokens, and its most pages at once."""

    model_config = _FROZEN

    name: str
    page_size: int
    page_bytes: int
    pages_at_peak: int
    bytes_at_peak: int
    max_pages: int


class GroupSimulationReport(BaseModel):
    """What one layout did with the workload. ``peak_tokens_per_gib``: tokens resident at the
    step that held the most, per GiB of the budget."""

    model_config = _FROZEN

    layout: Literal["kvmem", "padded"]
    budget_bytes: int
    num_requests: int
    num_completed: int
    decode_steps: int
    output_tokens: int
    tokens_per_step: float
    mean_running: float
    max_running: int
    num_preemptions: int
    peak_tokens: int
    peak_tokens_per_gib: float
    groups: list[GroupUse]
    wall_seconds: float

    def summary(self) -> str:
        lines = [
            f"{self.layout}: {self.num_completed:,}/{self.num_requests:,} requests in "
            f"{self.decode_steps:,} decode steps, {self.tokens_per_step:,.1f} output tokens per "
            f"step; running mean {self.mean_running:.1f}, max {self.max_running}; "
            f"{self.num_preemptions:,} preemptions",
            f"  peak {self.peak_tokens:,} tokens resident, {self.peak_tokens_per_gib:,.0f} per "
            f"GiB of {self.budget_bytes / GIB:,.2f} GiB",
        ]
        for g in self.groups:
            lines.append(f"  {g.name:<9} pages of {g.page_size or '-'} tok / {g.page_bytes:,} B: "
                         f"{g.pages_at_peak:,} at the peak ({g.bytes_at_peak / GIB:,.2f} GiB), "
                         f"most {g.max_pages:,}")
        return "\n".join(lines)


class _Request:
    """A running request's pages: a list per non-sliding group, a WindowRow per sliding one."""

    __slots__ = ("index", "num_tokens", "pages", "remaining", "rows")

    def __init__(self, index: int, num_tokens: int, remaining: int) -> None:
        self.index = index
        self.num_tokens = num_tokens
        self.remaining = remaining
        self.pages: dict[str, list[npt.NDArray[np.int32]]] = {}
        self.rows: dict[str, WindowRow] = {}


def simulate_groups(workload: Workload, groups: tuple[GroupSpec, ...], budget_bytes: int, *,
                    layout: Literal["kvmem", "padded"] = "kvmem", max_running: int = 256
                    ) -> GroupSimulationReport:
    """Run ``workload`` (closed loop: its ``concurrency`` clients) on ``groups`` sharing
    ``budget_bytes``. ``layout="padded"`` runs the groups on :func:`padded_specs`, chunks of one
    page; ``"kvmem"`` on their own pages, the allocator's default chunks."""
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload={show(workload)}: expected a Workload.")
    if workload.concurrency is None:
        raise ConfigError("simulate_groups runs a closed loop: give the Workload a concurrency "
                          "(clients), not a rate.")
    if layout not in ("kvmem", "padded"):
        raise ConfigError(f"layout={layout!r}: expected 'kvmem' or 'padded'.")
    groups = check_groups(groups)
    budget_bytes = integer(budget_bytes, "budget_bytes", minimum=1)
    max_running = integer(max_running, "max_running", minimum=1)
    specs = padded_specs(groups) if layout == "padded" else groups
    chunk = specs[0].page_bytes if layout == "padded" else None
    ga = GroupAllocator(specs, budget_bytes, chunk)
    return _Run(ga, specs, workload, layout, budget_bytes, max_running).run()


class _Run:
    def __init__(self, ga: GroupAllocator, specs: tuple[GroupSpec, ...], workload: Workload,
                 layout: Literal["kvmem", "padded"], budget: int, max_running: int) -> None:
        self.ga, self.specs, self.layout, self.budget = ga, specs, layout, budget
        arrivals = Arrivals(workload)
        self.prompt = arrivals.prompt
        self.output = arrivals.output
        self.num_requests = workload.num_requests
        assert workload.concurrency is not None
        self.slots = min(workload.concurrency, max_running)
        self.held = dict.fromkeys(ga.names, 0)
        self.max_pages = dict.fromkeys(ga.names, 0)
        self.at_peak = dict.fromkeys(ga.names, 0)
        self.token_groups = [s for s in specs if not isinstance(s, StateSpec)]

    def _prompt_needs(self, num_tokens: int) -> dict[str, int]:
        return {s.name: 1 if isinstance(s, StateSpec) else -(-num_tokens // s.page_size)
                for s in self.specs}

    def _take(self, req: _Request, needs: dict[str, int]) -> None:
        got = self.ga.allocate(needs)
        for name, ids in got.items():
            self.held[name] += ids.size
            if name in req.rows:
                req.rows[name].append(ids)
            else:
                req.pages.setdefault(name, []).append(ids)

    def _advance_windows(self, req: _Request) -> None:
        for name, row in req.rows.items():
            released = row.advance(req.num_tokens)
            if released.size:
                self.ga.free({name: released})
                self.held[name] -= released.size

    def _release(self, req: _Request) -> None:
        pages = {name: np.concatenate(parts) for name, parts in req.pages.items()}
        pages.update({name: row.held_pages() for name, row in req.rows.items()})
        self.ga.free(pages)
        for name, ids in pages.items():
            self.held[name] -= ids.size

    def run(self) -> GroupSimulationReport:
        start = time.perf_counter()
        waiting: deque[_Request] = deque()
        next_new = 0
        running: list[_Request] = []
        steps = output_tokens = preemptions = completed = 0
        running_sum = max_running = peak_tokens = 0
        sliding = {s.name for s in self.specs if isinstance(s, SlidingWindowSpec)}
        while completed < self.num_requests:
            # admit, FCFS, preempted requests first
            while len(running) < self.slots:
                if not waiting and next_new < self.num_requests:
                    i = next_new
                    next_new += 1
                    waiting.append(_Request(i, int(self.prompt[i]), int(self.output[i])))
                if not waiting:
                    break
                req = waiting[0]
                needs = self._prompt_needs(req.num_tokens)
                if not self.ga.can_allocate(needs):
                    if not running:
                        raise ConfigError(
                            f"a request of {req.num_tokens:,} tokens does not fit the budget of "
                            f"{self.budget:,} bytes in the {self.layout} layout even alone; "
                            "give more memory or shorter requests.")
                    break
                waiting.popleft()
                req.rows = {name: WindowRow(s) for s in self.specs if (name := s.name) in sliding
                            and isinstance(s, SlidingWindowSpec)}
                req.pages = {}
                self._take(req, needs)
                self._advance_windows(req)
                running.append(req)
            if not running:
                break
            # one decode step: a page for each request whose last page is full
            i = 0
            while i < len(running):
                req = running[i]
                t = req.num_tokens
                needs = {s.name: 1 for s in self.token_groups if t % s.page_size == 0}
                if needs and not self.ga.can_allocate(needs):
                    if len(running) == 1:
                        raise ConfigError(
                            f"a request growing to {t + 1:,} tokens does not fit the budget of "
                            f"{self.budget:,} bytes in the {self.layout} layout even alone; "
                            "give more memory or shorter requests.")
                    victim = running.pop()  # the newest request gives its pages back
                    self._release(victim)
                    waiting.appendleft(victim)
                    preemptions += 1
                    continue
                if needs:
                    self._take(req, needs)
                i += 1
            for req in running:
                req.num_tokens += 1
                req.remaining -= 1
                self._advance_windows(req)
            steps += 1
            output_tokens += len(running)
            running_sum += len(running)
            max_running = max(max_running, len(running))
            tokens = sum(r.num_tokens for r in running)
            for name, n in self.held.items():
                self.max_pages[name] = max(self.max_pages[name], n)
            if tokens > peak_tokens:
                peak_tokens = tokens
                self.at_peak = dict(self.held)
            done = [r for r in running if r.remaining <= 0]
            for req in done:
                self._release(req)
                completed += 1
            if done:
                running = [r for r in running if r.remaining > 0]
        self.ga.check()
        return GroupSimulationReport(
            layout=self.layout, budget_bytes=self.budget, num_requests=self.num_requests,
            num_completed=completed, decode_steps=steps, output_tokens=output_tokens,
            tokens_per_step=output_tokens / steps if steps else 0.0,
            mean_running=running_sum / steps if steps else 0.0, max_running=max_running,
            num_preemptions=preemptions, peak_tokens=peak_tokens,
            peak_tokens_per_gib=peak_tokens * GIB / self.budget,
            groups=[GroupUse(name=s.name, page_size=s.page_size, page_bytes=s.page_bytes,
                             pages_at_peak=self.at_peak[s.name],
                             bytes_at_peak=self.at_peak[s.name] * s.page_bytes,
                             max_pages=self.max_pages[s.name]) for s in self.specs],
            wall_seconds=time.perf_counter() - start)
