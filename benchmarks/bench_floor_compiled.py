"""What a compiled core would buy: ``bench_floor.py``'s minimal decode step, compiled. JSON.

kvmem's allocator is numpy-only (DESIGN.md), so this is an experiment for that design decision,
not a kvmem feature: ``CompiledFloorDecode`` does exactly the work of ``FloorDecode`` (same
state, same trace, same outputs: pages and expected tags, slot mapping, CSR and copies for the
kernel; verify of the copies, write set and new entries; tokens stored, filled pages hashed with
kvmem's key function and entered in a dict index) in loops compiled by numba, and runs in
lockstep with kvmem, the numpy floor and, when it imports, vLLM. Needs ``pip install numba``
(not a kvmem dependency); its first steps include the compilation and are dropped.

    python benchmarks/bench_floor_compiled.py [--steps 1000] [--batch 256]
"""

from __future__ import annotations

import json

import numpy as np
from bench_floor import FloorDecode, compare
from bench_manager import PAGE_SIZE, clock
from numba import njit, types
from numba.typed import Dict

from kvmem.cli.args import Parser, number

M1, M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


@njit(cache=True)
def _reserve(num_tokens, pages, expected, tags, refcounts, free, counters, old_indptr,
             old_indices, W, P):  # type: ignore[no-untyped-def]
    B = num_tokens.size
    slots = np.empty(B, np.int64)
    token_pages = np.empty(B, np.int32)
    offsets = np.empty(B, np.int64)
    last_len = np.empty(B, np.int32)
    seq_lens = np.empty(B, np.int32)
    grew = np.zeros(B, np.bool_)
    nnz = old_indices.size
    for b in range(B):
        t = num_tokens[b]
        col = t // P
        off = t - col * P
        if off == 0:  # the token starts a page: allocate it, record its tag
            counters[0] -= 1
            counters[1] += 1
            page = free[counters[0]]
            refcounts[page] = 1
            tags[page] = counters[1]
            pages[b * W + col] = page
            expected[b * W + col] = counters[1]
            grew[b] = True
            nnz += 1
        p = pages[b * W + col]
        token_pages[b] = p
        slots[b] = p * P + off
        offsets[b] = off
        last_len[b] = off + 1
        num_tokens[b] = t + 1
        seq_lens[b] = t + 1
    indptr = np.empty(B + 1, np.int32)
    indptr[0] = 0
    indices = np.empty(nnz, np.int32)
    o = 0
    for b in range(B):  # the previous CSR with each new page spliced in
        s0, s1 = old_indptr[b], old_indptr[b + 1]
        indices[o : o + s1 - s0] = old_indices[s0:s1]
        o += s1 - s0
        if grew[b]:
            indices[o] = token_pages[b]
            o += 1
        indptr[b + 1] = o
    kernel = (slots.copy(), indptr.copy(), indices.copy(), last_len, seq_lens,
              np.arange(B + 1).astype(np.int32), np.ones(B, np.int32))  # + qo_indptr, num_new
    return kernel, slots, indptr, indices, token_pages, offsets, grew


@njit(cache=True)
def _verify(kernel, slots, indptr, indices, token_pages, grew, num_tokens, tags, refcounts,
            expected, W, P):  # type: ignore[no-untyped-def]
    k_slots, k_indptr, k_indices = kernel[0], kernel[1], kernel[2]
    if k_slots.size != slots.size or k_indices.size != indices.size:
        return False
    for i in range(slots.size):
        if k_slots[i] != slots[i] or refcounts[token_pages[i]] != 1:
            return False
    for i in range(indptr.size):
        if k_indptr[i] != indptr[i]:
            return False
    for i in range(indices.size):
        if k_indices[i] != indices[i]:
            return False
    for b in range(grew.size):  # the new entries: the tag recorded for them
        if grew[b]:
            col = (num_tokens[b] - 1) // P
            if tags[indices[indptr[b + 1] - 1]] != expected[b * W + col]:
                return False
    return True


@njit(cache=True)
def _commit(tokens, slots, offsets, token_pages, page_tokens, row_key, K, Q, refcounts, index,
            num_tokens, P):  # type: ignore[no-untyped-def]
    flat = page_tokens.reshape(-1)
    for b in range(slots.size):
        flat[slots[b]] = tokens[b]
        if offsets[b] != P - 1:
            continue
        page = token_pages[b]  # it filled: hash it (kvmem's key function), index it
        position = np.uint64((num_tokens[b] - 1) // P + 1)
        for lane in range(2):
            s = np.uint64(0)
            for c in range(P):
                x = (np.uint64(page_tokens[page, c]) + np.uint64(1)) * K[0, lane * P + c]
                s += x ^ (x >> np.uint64(31))
            s += position * Q[lane]
            s ^= s >> np.uint64(33)
            s *= M1
            s ^= s >> np.uint64(33)
            s *= M2
            s ^= s >> np.uint64(33)
            row_key[b, lane] += s
        if row_key[b, 0] not in index:
            index[row_key[b, 0]] = page
        refcounts[page] += 1


class CompiledFloorDecode(FloorDecode):
    """``FloorDecode``'s step in compiled loops (same state and outputs)."""

    def __init__(self, prompts: list[np.ndarray], steps: int, num_pages: int) -> None:
        super().__init__(prompts, steps, num_pages)
        self.counters = np.array([self.num_free, self.last_tag], dtype=np.int64)
        self.nb_index = Dict.empty(key_type=types.uint64, value_type=types.int64)

    def step(self, i: int) -> None:
        P, W = PAGE_SIZE, 512
        t0 = clock()
        kernel, slots, indptr, indices, token_pages, offsets, grew = _reserve(
            self.num_tokens, self.pages, self.expected, self.tags, self.refcounts,
            self.free, self.counters, self.indptr, self.indices, W, P)
        t1 = clock()
        ok = _verify(kernel, slots, indptr, indices, token_pages, grew, self.num_tokens,
                     self.tags, self.refcounts, self.expected, W, P)
        t2 = clock()
        _commit(self.tokens, slots, offsets, token_pages, self.page_tokens, self.row_key,
                self.K, self.Q, self.refcounts, self.nb_index, self.num_tokens, P)
        t3 = clock()
        assert ok
        self.indptr, self.indices = indptr, indices
        for key, us in (("decode", t3 - t0), ("reserve", t1 - t0), ("verify", t2 - t1),
                        ("commit", t3 - t2)):
            self.times[key].append(us * 1e6)


def main() -> None:
    parser = Parser(prog="bench_floor_compiled.py",
                    description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--steps", type=number(int, 1), default=1000)
    parser.add_argument("--batch", type=number(int, 1), default=256)
    args = parser.parse_args()
    # The compiled step's first calls compile (or load numba's cache): skipped.
    result, runners = compare(args.steps, args.batch,
                              {"floor": FloorDecode, "compiled": CompiledFloorDecode}, skip=20)
    floor, compiled = runners["floor"], runners["compiled"]
    # The same work: the same CSR, page keys (kvmem's key function) and page holders.
    assert np.array_equal(compiled.indices, floor.indices)
    assert np.array_equal(compiled.row_key, floor.row_key)
    assert np.array_equal(compiled.refcounts, floor.refcounts)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
