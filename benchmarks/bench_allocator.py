"""Allocator benchmark: the decode-step trace and allocate/free churn. Prints JSON.

Decode-step trace: batch 256, page size 16, 2000 steps. Every running request gains one token per
step; 1% of requests finish each step and are replaced by one with a 500..2000-token prompt
(seeded). Timed per step: kvmem's work for the step (finishing, admitting, page growth and the
page-table/block-table update of the batch) and, separately, FlashInfer CSR metadata for the batch.
The same trace on a plain Python-list free stack is printed as a floor.

    python benchmarks/bench_allocator.py [--steps 2000] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from kvmem import PageAllocator, PageTable

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


def run_kvmem(steps: list, prompts: np.ndarray) -> tuple[list[float], list[float]]:
    batch = prompts.size
    alloc = PageAllocator(batch * 300)
    table = PageTable(max_seqs=batch, max_pages_per_seq=512, page_size=PAGE_SIZE)
    rows = np.array([table.add_row() for _ in range(batch)], dtype=np.int32)
    for i, n in enumerate(prompts):
        table.grow(rows[i : i + 1], int(n), alloc)
    step_us, meta_us = [], []
    for done, new_prompts in steps:
        t0 = time.perf_counter()
        if done.size:  # finished requests leave and new ones arrive, as one batch each
            alloc.free(table.remove_rows(rows[done]))
            rows[done] = table.add_rows(done.size)
            table.grow(rows[done], new_prompts, alloc)
        table.grow(rows, 1, alloc)
        t1 = time.perf_counter()
        table.csr(rows)
        t2 = time.perf_counter()
        step_us.append((t1 - t0) * 1e6)
        meta_us.append((t2 - t1) * 1e6)
    alloc.check()
    return step_us, meta_us


def run_floor(steps: list, prompts: np.ndarray) -> list[float]:
    """The same trace on a Python list free stack and per-request Python lists."""
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
    step_us = []
    for done, new_prompts in steps:
        t0 = time.perf_counter()
        for slot, prompt_len in zip(done.tolist(), new_prompts.tolist()):
            free.extend(pages[slot])
            pages[slot], tokens[slot] = [], 0
            grow(slot, prompt_len)
        for i in range(batch):
            if tokens[i] % PAGE_SIZE == 0:
                pages[i].append(free.pop())
            tokens[i] += 1
        step_us.append((time.perf_counter() - t0) * 1e6)
    return step_us


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    prompts = initial_prompts(rng, args.batch)
    steps = trace(rng, args.steps, args.batch)
    step_us, meta_us = run_kvmem(steps, prompts)
    floor_us = run_floor(steps, prompts)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
        "batch": args.batch,
        "steps": args.steps,
        "page_size": PAGE_SIZE,
        "decode_step_us_median": round(float(np.median(step_us)), 2),
        "decode_step_us_p99": round(float(np.percentile(step_us, 99)), 2),
        "metadata_us_median": round(float(np.median(meta_us)), 2),
        "floor_decode_step_us_median": round(float(np.median(floor_us)), 2),
        "churn_pages_per_s": round(churn(np.random.default_rng(args.seed))),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
