"""Allocator benchmark: the decode-step trace and allocate/free churn. Prints JSON.

Decode-step trace: batch 256, page size 16, 2000 steps. Every running request gains one token per
step; 1% of requests finish each step and are replaced by one with a 500..2000-token prompt
(seeded). Timed per step, each part separately and in total: replacing the finished requests
(free their pages, open rows, allocate the new prompts), the decode growth of the whole batch
(pages where rows cross a boundary, page-table update, slot mapping), and FlashInfer CSR metadata
for the batch. The same trace on a plain Python-list free stack is printed as a floor.

    python benchmarks/bench_allocator.py [--steps 2000] [--batch 256]
"""

from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

from kvmem import PageAllocator, PageTable
from kvmem.cli.args import Parser, number

PAGE_SIZE = 16


def trace(rng: np.random.Generator, steps: int, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step: which batch slots finish, and the prompt lengths of their replacements."""
    out = []
    for _ in range(steps):
        num_done = rng.binomial(batch, 0.01)
        done = rng.choice(batch, size=num_done, replace=False)
        out.append((done, rng.integers(500, 2001, size=num_done)))
    return out


def initial_prompts(rng: np.random.Generator, batch: int) -> np.ndarray:
    return rng.integers(500, 2001, size=batch)


def run_kvmem(steps: list, prompts: np.ndarray) -> dict[str, list[float]]:
    """Per-step timings (us): replacing finished requests, the batch's decode growth, CSR."""
    batch = prompts.size
    alloc = PageAllocator(batch * 300)
    table = PageTable(max_seqs=batch, max_pages_per_seq=512, page_size=PAGE_SIZE)
    rows = table.add_rows(batch)
    table.grow(rows, prompts, alloc)
    times: dict[str, list[float]] = {"replace": [], "decode": [], "metadata": [], "total": []}
    for done, new_prompts in steps:
        t0 = time.perf_counter()
        if done.size:  # finished requests leave and new ones arrive, as one batch each
            alloc.free(np.concatenate([table.remove_row(r) for r in rows[done].tolist()]))
            rows[done] = table.add_rows(done.size)
            table.grow(rows[done], new_prompts, alloc)
        t1 = time.perf_counter()
        table.grow(rows, 1, alloc)
        t2 = time.perf_counter()
        table.csr(rows)
        t3 = time.perf_counter()
        for key, us in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            times[key].append(us * 1e6)
    alloc.check()
    return times


def run_floor(steps: list, prompts: np.ndarray) -> dict[str, list[float]]:
    """The same trace on a Python list free stack and per-request Python lists (no metadata)."""
    batch = prompts.size
    free = list(range(batch * 300))
    pages: list[list[int]] = [[] for _ in range(batch)]
    tokens = [0] * batch

    def grow(i: int, n: int) -> None:
        need = -(-(tokens[i] + n) // PAGE_SIZE) - len(pages[i])
        for _ in range(need):
            pages[i].append(free.pop())
        tokens[i] += n

    for i, n in enumerate(prompts.tolist()):
        grow(i, n)
    times: dict[str, list[float]] = {"decode": [], "total": []}
    for done, new_prompts in steps:
        t0 = time.perf_counter()
        for slot, prompt_len in zip(done.tolist(), new_prompts.tolist()):
            free.extend(pages[slot])
            pages[slot], tokens[slot] = [], 0
            grow(slot, prompt_len)
        t1 = time.perf_counter()
        for i in range(batch):
            if tokens[i] % PAGE_SIZE == 0:
                pages[i].append(free.pop())
            tokens[i] += 1
        t2 = time.perf_counter()
        times["decode"].append((t2 - t1) * 1e6)
        times["total"].append((t2 - t0) * 1e6)
    return times


def churn(rng: np.random.Generator, num_ops: int = 20000) -> float:
    """Allocate/free requests of 1..64 pages, up to 256 live; pages per second."""
    alloc = PageAllocator(256 * 64)
    live: list[np.ndarray] = []
    sizes = rng.integers(1, 65, size=num_ops)
    picks = rng.integers(0, 256, size=num_ops)
    moved = 0
    t0 = time.perf_counter()
    for size, pick in zip(sizes.tolist(), picks.tolist()):
        if len(live) == 256 or (live and pick % 2):
            pages = live.pop(pick % len(live))
            alloc.free(pages)
        else:
            pages = alloc.allocate(size)
            live.append(pages)
        moved += pages.size
    elapsed = time.perf_counter() - t0
    alloc.check()
    return moved / elapsed


def main() -> None:
    parser = Parser(prog="bench_allocator.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=number(int, 1), default=2000)
    parser.add_argument("--batch", type=number(int, 1), default=256)
    parser.add_argument("--seed", type=number(int, 0), default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    prompts = initial_prompts(rng, args.batch)
    steps = trace(rng, args.steps, args.batch)
    times = run_kvmem(steps, prompts)
    floor_us = run_floor(steps, prompts)

    def median(values: list[float]) -> float:
        return round(float(np.median(values)), 2)

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "batch": args.batch,
        "steps": args.steps,
        "page_size": PAGE_SIZE,
        "decode_step_us_median": median(times["decode"]),
        "metadata_us_median": median(times["metadata"]),
        "replace_us_median": median(times["replace"]),
        "step_total_us_median": median(times["total"]),
        "floor_decode_step_us_median": median(floor_us["decode"]),
        "floor_step_total_us_median": median(floor_us["total"]),
        "churn_pages_per_s": round(churn(np.random.default_rng(args.seed))),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
