"""The numpy floor of a decode step: how fast could a numpy-only manager be? Prints JSON.

``FloorDecode`` does the least work a decode step of ``bench_manager.py``'s trace needs, in as
few numpy calls as its author found, and nothing else: no argument checks, hooks, events, step
fences, namespaces, LRU or generations, no handling of forks or of a batch that changed. Per
step, for a batch of 256 requests that each gain one token:

    reserve   a fresh page (and its expected tag) for each request whose token starts a page,
              the slot mapping, the CSR spliced from the previous step's, copies for the kernel
    verify    the kernel's arrays equal the private copies, every page written has one holder,
              every spliced-in page's tag is the one recorded for it
    commit    the tokens stored, each page that filled hashed (kvmem's key function) and
              entered in a dict index with one more holder

It runs in lockstep with kvmem's manager (CheckingTracker, prefix reuse) and, when vLLM imports,
vLLM's KVCacheManager, on the decode trace without replacements (no request finishes: the floor
does not admit). ``floor_decode_step_us_median`` against ``vllm_decode_step_us_median`` bounds
the speedup any numpy-only manager can reach on this machine (``floor_speedup_vs_vllm``);
``kvmem_over_floor`` is kvmem's step over the floor's, and ``kvmem_reserve_over_floor`` (and
``verify``, ``commit``) the same per phase.

``FloorAdmit`` is the same for one request's admission on the shared-prompt trace (keys, the
longest cached run, the new pages, their tags, the prefill chunk's metadata, the new keys
entered), in lockstep with kvmem's ``can_admit`` + ``admit`` + ``reserve`` + ``commit`` and vLLM's
hashing + ``get_computed_blocks`` + ``allocate_slots``: ``floor_admit_prefill_us_median``,
``kvmem_admit_prefill_over_floor`` (paired), and ``floor_admit_prefill_speedup_vs_vllm``, the
admission speedup no numpy-and-Python manager can pass here.

    python benchmarks/bench_floor.py [--steps 1000] [--batch 256] [--requests 1000]
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from bench_manager import (
    PAGE_SIZE,
    BestEffort,
    KvmemDecode,
    KvmemShared,
    VllmDecode,
    VllmShared,
    clock,
    decode_trace,
    lockstep,
    median,
    paired,
    shared_prompt_trace,
    vllm_api,
    vllm_imports,
)

from kvmem.allocator import PrefixKeys
from kvmem.cli.args import Parser, number

_M1 = np.array(0xFF51AFD7ED558CCD, dtype=np.uint64)
_M2 = np.array(0xC4CEB9FE1A85EC53, dtype=np.uint64)
_S = np.array(33, dtype=np.uint64)


class FloorDecode:
    """The minimal decode step, on flat numpy arrays (see the module docstring)."""

    def __init__(self, prompts: list[np.ndarray], steps: int, num_pages: int) -> None:
        P, W = PAGE_SIZE, 512
        B = len(prompts)
        self.steps = steps
        self.rows = np.arange(B, dtype=np.intp)
        self.rows_w = self.rows * W
        self.num_tokens = np.array([p.size for p in prompts], dtype=np.int64)
        self.pages = np.zeros(B * W, dtype=np.int32)  # page table, (row, col) at row * W + col
        self.expected = np.zeros(B * W, dtype=np.int64)  # tags the rows recorded
        self.tags = np.zeros(num_pages, dtype=np.int64)
        self.refcounts = np.zeros(num_pages, dtype=np.int32)
        self.free = np.arange(num_pages, dtype=np.int32)[::-1].copy()
        self.num_free, self.last_tag = num_pages, 0
        self.page_tokens = np.zeros((num_pages, P), dtype=np.int32)
        rng = np.random.default_rng(0)
        self.K = rng.integers(1, 2**63, size=(1, 2 * P), dtype=np.uint64) | np.uint64(1)
        self.Q = rng.integers(1, 2**63, size=2, dtype=np.uint64) | np.uint64(1)
        self.row_key = np.zeros((B, 2), dtype=np.uint64)
        self.index: dict[int, int] = {}
        counts = (self.num_tokens + P - 1) // P
        for r, p in enumerate(prompts):  # the prompts' pages (untimed)
            new = self.allocate(int(counts[r]))
            self.pages[r * W : r * W + new.size] = new
            self.expected[r * W : r * W + new.size] = self.tags[new]
            slots = (new[:, None] * P + np.arange(P)).reshape(-1)
            self.page_tokens.reshape(-1)[slots[: p.size]] = p
        self.counts = counts
        self.indptr = np.zeros(B + 1, dtype=np.int32)
        np.add.accumulate(counts, out=self.indptr[1:], dtype=np.int32)
        self.indices = np.concatenate([self.pages[r * W : r * W + c]
                                       for r, c in enumerate(counts.tolist())])
        self.tokens = np.ones(B, dtype=np.int32)
        self.qo_indptr = np.arange(B + 1, dtype=np.int32)
        self.num_new = np.ones(B, dtype=np.int32)
        self.times: dict[str, list[float]] = {k: [] for k in ("decode", "reserve", "verify",
                                                               "commit")}

    def allocate(self, n: int) -> np.ndarray:
        start = self.num_free - n
        pages = self.free[start : self.num_free][::-1].astype(np.intp)
        self.num_free = start
        self.refcounts[pages] = 1
        self.tags[pages] = np.arange(self.last_tag + 1, self.last_tag + 1 + n)
        self.last_tag += n
        return pages

    def step(self, i: int) -> None:
        P = PAGE_SIZE
        rows, rows_w = self.rows, self.rows_w
        t0 = clock()
        # reserve
        start = self.num_tokens
        col = start // P
        offset = start - col * P
        grow = (offset == 0).nonzero()[0]  # the new token starts a page
        at = rows_w[grow] + col[grow]
        new = self.allocate(grow.size)
        self.pages[at] = new
        self.expected[at] = self.tags[new]
        self.num_tokens = start + 1
        token_pages = self.pages[rows_w + col]
        slots = np.multiply(token_pages, P, dtype=np.int64)
        slots += offset
        counts = col + 1
        indptr = np.zeros(rows.size + 1, dtype=np.int32)
        np.add.accumulate(counts, out=indptr[1:], dtype=np.int32)
        indices = np.insert(self.indices, self.indptr[grow + 1], new)
        kernel = (slots.copy(), self.qo_indptr.copy(), indptr.copy(), indices.copy(),
                  np.add(offset, 1, dtype=np.int32), self.num_tokens.astype(np.int32),
                  self.num_new.copy())
        t1 = clock()
        # verify
        ok = (np.array_equal(kernel[0], slots) and np.array_equal(kernel[2], indptr)
              and np.array_equal(kernel[3], indices)
              and bool((self.refcounts[token_pages] == 1).all()))
        fresh = indices[indptr[grow + 1] - 1].astype(np.intp)
        ok = ok and np.array_equal(self.tags[fresh], self.expected[at])
        t2 = clock()
        # commit
        self.page_tokens.reshape(-1)[slots] = self.tokens
        full = (offset == P - 1).nonzero()[0]
        if full.size:
            pages = token_pages[full].astype(np.intp)
            x = np.concatenate((self.page_tokens[pages], self.page_tokens[pages]), axis=1,
                               dtype=np.uint64, casting="unsafe")
            x += np.uint64(1)
            x *= self.K
            x ^= x >> np.uint64(31)
            s = np.matmul(x.reshape(-1, 2, P), np.ones(P, dtype=np.uint64))
            s += (col[full].astype(np.uint64) + np.uint64(1))[:, None] * self.Q
            for m in (_M1, _M2, None):
                s ^= s >> _S
                if m is not None:
                    s *= m
            keys = s + self.row_key[full]
            self.row_key[full] = keys
            list(map(self.index.setdefault, keys[:, 0].tolist(), pages.tolist()))
            self.refcounts[pages] += 1
        t3 = clock()
        assert ok
        self.counts, self.indptr, self.indices = counts, indptr, indices
        for key, us in (("decode", t3 - t0), ("reserve", t1 - t0), ("verify", t2 - t1),
                        ("commit", t3 - t2)):
            self.times[key].append(us * 1e6)

    def finish(self) -> None:
        held = np.bincount(self.indices, minlength=self.tags.size)
        assert ((self.refcounts - held) >= 0).all()  # every page listed is held


class FloorAdmit:
    """The minimal admission of ``bench_manager.py``'s shared-prompt trace: per request, the
    prompt's full pages keyed (kvmem's key function, one vectorized pass), the longest cached
    run found in a dict index (one lookup per page until the first miss), the rest of the pages
    allocated and their expected tags recorded, the slot mapping and CSR of the one prefill
    chunk (copies for the kernel), then the new full pages' tokens stored and their keys
    entered. No argument checks, namespaces, LRU, events, hooks or eviction; release (untimed)
    drops the request's references. ``prefill_us``: the whole admission, as kvmem's."""

    def __init__(self, prompts: list[np.ndarray], num_pages: int = 256 * 96) -> None:
        P, W = PAGE_SIZE, 128
        self.prompts, self.live = prompts, []
        self.keys = PrefixKeys(0, P)
        self.root = self.keys.root(None)
        self.index: dict[int, int] = {}
        self.tags = np.zeros(num_pages, dtype=np.int64)
        self.refcounts = np.zeros(num_pages, dtype=np.int32)
        self.free = list(range(num_pages - 1, -1, -1))
        self.last_tag = 0
        self.page_tokens = np.zeros((num_pages, P), dtype=np.int32)
        self.table = np.zeros((256, W), dtype=np.int32)
        self.expected = np.zeros((256, W), dtype=np.int64)
        self.rows = list(range(255, -1, -1))
        self.row_of: dict[int, tuple[int, int]] = {}
        self.prefill_us: list[float] = []

    def step(self, rid: int) -> None:
        P = PAGE_SIZE
        if len(self.live) == 200:
            self.release(self.live.pop(0))
        prompt = self.prompts[rid]
        t0 = clock()
        n = prompt.size // P
        keys = self.keys.run_keys(self.root, 0, prompt[: n * P].reshape(n, P))
        hit: list[int] = []
        for key in keys[:, 0].tolist():
            page = self.index.get(key)
            if page is None:
                break
            hit.append(page)
        total = -(-prompt.size // P)
        new = [self.free.pop() for _ in range(total - len(hit))]
        self.tags[new] = np.arange(self.last_tag + 1, self.last_tag + 1 + len(new))
        self.last_tag += len(new)
        pages = np.array(hit + new, dtype=np.int32)
        self.refcounts[pages] += 1
        row = self.rows.pop()
        self.table[row, :total] = pages
        self.expected[row, :total] = self.tags[pages]
        start = len(hit) * P
        positions = np.arange(start, prompt.size, dtype=np.int64)
        slots = pages[positions // P].astype(np.int64) * P + positions % P
        kernel = (slots, np.array([0, prompt.size - start], dtype=np.int32),
                  np.array([0, total], dtype=np.int32), pages.copy(),
                  np.array([(prompt.size - 1) % P + 1], dtype=np.int32))
        self.page_tokens.reshape(-1)[slots] = prompt[start:]
        full = pages[len(hit): n]
        list(map(self.index.setdefault, keys[len(hit):, 0].tolist(), full.tolist()))
        self.refcounts[full] += 1
        self.prefill_us.append((clock() - t0) * 1e6)
        assert kernel[0].size == prompt.size - start
        self.row_of[rid] = (row, total)
        self.live.append(rid)

    def release(self, rid: int) -> None:
        row, total = self.row_of.pop(rid)
        pages = self.table[row, :total]
        self.refcounts[pages] -= 1
        self.free.extend(pages[self.refcounts[pages] == 0].tolist())
        self.rows.append(row)

    def finish(self) -> None:
        assert (self.refcounts >= 0).all()


def compare(steps: int, batch: int, contenders: dict[str, Any], skip: int = 0
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """kvmem (CheckingTracker), ``contenders`` (name -> class built from ``(prompts, steps,
    num_pages)``) and vLLM when it imports, in lockstep on the decode trace without
    replacements (no request finishes: the floors do not admit). Returns the JSON figures
    (medians without the first ``skip`` steps, paired ratios to vLLM) and the runners."""
    prompts, trace = decode_trace(0, steps, batch)
    steady = [(np.empty(0, dtype=np.int64), []) for _ in trace]
    # Every request's prompt (at most 2000 tokens) and what it decodes, and some to spare.
    num_pages = batch * ((2000 + steps) // PAGE_SIZE + 2) + 1024
    runners: dict[str, Any] = {"kvmem": KvmemDecode(prompts, steady, "checking", num_pages)}
    runners.update({name: make(prompts, steps, num_pages) for name, make in contenders.items()})
    vllm = None
    if vllm_imports():
        api = BestEffort(vllm_api)
        vllm = BestEffort(lambda: VllmDecode(api.runner, prompts, steady), api.error)
    lockstep([*runners.values(), *([vllm] if vllm is not None else [])], steps)
    result: dict[str, Any] = {
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "lockstep": True, "batch": batch, "steps": steps,
    }
    for name, runner in runners.items():
        for k in ("decode_step", "reserve", "verify", "commit"):
            result[f"{name}_{k}_us_median"] = median(runner.times[k.split("_")[0]][skip:])
    if vllm is not None and vllm.error is None:
        theirs = vllm.runner.decode[skip:]
        result["vllm_decode_step_us_median"] = median(theirs)
        for name, runner in runners.items():
            result[f"{name}_speedup_vs_vllm"] = paired(theirs, runner.times["decode"][skip:])
    elif vllm is not None:
        result["vllm_error"] = vllm.error
    return result, runners


def compare_admit(num_requests: int) -> dict[str, Any]:
    """kvmem (CheckingTracker), ``FloorAdmit`` and vLLM when it imports, in lockstep on the
    shared-prompt trace: the admission figures (medians without the first request)."""
    _system, prompts = shared_prompt_trace(0, num_requests)
    kvmem, floor = KvmemShared(prompts, "checking"), FloorAdmit(prompts)
    runners: list[Any] = [kvmem, floor]
    vllm = None
    if vllm_imports():
        api = BestEffort(vllm_api)
        vllm = BestEffort(lambda: VllmShared(api.runner, prompts), api.error)
        runners.append(vllm)
    lockstep(runners, num_requests)
    ours, least = kvmem.prefill_us[1:], floor.prefill_us[1:]
    result = {"kvmem_admit_prefill_us_median": median(ours),
              "floor_admit_prefill_us_median": median(least),
              "kvmem_admit_prefill_over_floor": paired(ours, least)}
    if vllm is not None and vllm.error is None:
        v = vllm.runner
        theirs = [a + h for a, h in zip(v.admit[1:], v.hashing[1:])]
        result["vllm_admit_with_hash_us_median"] = median(theirs)
        result["kvmem_admit_prefill_speedup_vs_vllm"] = paired(theirs, ours)
        result["floor_admit_prefill_speedup_vs_vllm"] = paired(theirs, least)
    return result


def main() -> None:
    parser = Parser(prog="bench_floor.py", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--steps", type=number(int, 1), default=1000)
    parser.add_argument("--batch", type=number(int, 1), default=256)
    parser.add_argument("--requests", type=number(int, 1), default=1000)
    args = parser.parse_args()
    result, _ = compare(args.steps, args.batch, {"floor": FloorDecode})
    for k in ("decode_step", "reserve", "verify", "commit"):  # (the first is the headline)
        result[f"kvmem_{k}_over_floor".replace("_decode_step", "")] = round(
            result[f"kvmem_{k}_us_median"] / result[f"floor_{k}_us_median"], 2)
    result.update(compare_admit(args.requests))
    print(json.dumps(result, indent=2))

if __name__ == "__main__":
    main()
