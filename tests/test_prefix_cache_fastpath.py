"""HashedPrefixCache key paths: the one-page-per-run path (the decode step), the segmented path
and prompt_keys give the same, documented keys, whichever scratch they hash in."""

from __future__ import annotations

import numpy as np

from kvmem import PageAllocator
from kvmem.allocator import HashedPrefixCache

MASK = (1 << 64) - 1


def bound(page_size: int = 16, seed: int = 20240611) -> HashedPrefixCache:
    cache = HashedPrefixCache(seed=seed)
    cache.bind(PageAllocator(8), page_size)
    return cache


def reference_keys(seed: int, page_size: int, root: list[int], tokens: list[int],
                   first_position: int) -> list[tuple[int, int]]:
    """The chained keys of consecutive pages, as the class docstring defines them, in Python
    ints (K and Q drawn from ``seed`` as ``bind`` draws them)."""
    rng = np.random.default_rng(seed)
    rng.bytes(32)  # the namespace secret
    K = (rng.integers(1, 2**63, size=(2, page_size), dtype=np.uint64) | 1).tolist()
    Q = (rng.integers(1, 2**63, size=2, dtype=np.uint64) | 1).tolist()

    def fmix(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & MASK
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & MASK
        return x ^ (x >> 33)

    keys, key = [], list(root)
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        position = first_position + i
        for lane in range(2):
            s = 0
            for c, token in enumerate(page):
                v = ((token + 1) * K[lane][c]) & MASK
                s += v ^ (v >> 31)
            key[lane] = (key[lane] + fmix((s + (position + 1) * Q[lane]) & MASK)) & MASK
        keys.append((key[0], key[1]))
    return keys


def test_keys_are_those_of_the_documented_hash() -> None:
    """Bit for bit what this seed gave before (routers recompute keys), and the docstring's
    formula: prompt_keys, and the one-page path at positions inside and past the position
    table (1024 entries at first)."""
    cache = bound()
    tokens = (np.arange(64, dtype=np.int64) * 7919) % 50021
    keys = cache.prompt_keys(tokens, ("tenant", 7))
    assert [tuple(map(hex, k)) for k in keys.tolist()] == [
        ("0x12f92fb33058bba", "0x3d7ae09152f6f304"),
        ("0xeb28c8944d050a9a", "0x3724f2fb8a4432ea"),
        ("0xad6725ea65105ffd", "0x96521102ffc494c1"),
        ("0x6d97453e8f61609c", "0xf366cb2259e0ff05"),
    ]
    root = cache.root_key(("tenant", 7)).tolist()
    assert keys.tolist() == [list(k) for k in
                             reference_keys(cache.seed, 16, root, tokens.tolist(), 0)]
    parents = np.array([[1, 2], [2**64 - 1, 0], [12345, 2**63]], dtype=np.uint64)
    positions = np.array([0, 5, 4000])
    got = cache.page_keys(parents, np.ones(3, np.int64), positions,
                          tokens[:48].reshape(3, 16).astype(np.int32))
    assert [tuple(map(hex, k)) for k in got.tolist()] == [
        ("0x12620ead76c2d5e6", "0x8439ca96db9cfbdc"),
        ("0xcca081ef588e03da", "0x955d52c5bd096db9"),
        ("0xfe4e2e7a4a22627f", "0x45797f45fa913f6f"),
    ]
    for i in range(3):
        want = reference_keys(cache.seed, 16, parents[i].tolist(),
                              tokens[16 * i : 16 * (i + 1)].tolist(), int(positions[i]))
        assert got[i].tolist() == list(want[0])


def test_one_page_runs_equal_the_segmented_path_and_prompt_keys() -> None:
    """Every page of several prompts (namespaces, lengths, int widths), hashed three ways:
    prompt_keys; page_keys with runs of several pages (the segmented sum); page_keys with one
    page per run, all prompts' pages mixed in one batch as a decode step offers them."""
    cache = bound(page_size=4)
    rng = np.random.default_rng(7)
    prompts = [(rng.integers(0, 2**31, 4 * n).astype(dtype), ns)
               for n, dtype, ns in ((9, np.int32, None), (1, np.int64, "a"), (30, np.int32, "a"),
                                    (5, np.int64, ("t", 2)))]
    whole = [cache.prompt_keys(tokens, ns) for tokens, ns in prompts]
    parent_rows, token_rows, position_rows = [], [], []
    for (tokens, ns), keys in zip(prompts, whole):
        k = keys.shape[0]
        parents = np.concatenate([cache.root_key(ns)[None], keys[:-1]])
        pages = tokens.reshape(k, 4)
        # Runs of 1..4 pages.
        cuts = np.unique(np.concatenate([[0], rng.integers(0, k, 3), [k]]))
        counts = np.diff(cuts)
        segmented = cache.page_keys(parents[cuts[:-1]], counts, cuts[:-1], pages)
        assert np.array_equal(segmented, keys)
        parent_rows.append(parents)
        token_rows.append(pages.astype(np.int64))
        position_rows.append(np.arange(k))
    order = rng.permutation(sum(keys.shape[0] for keys in whole))
    one_page = cache.page_keys(np.concatenate(parent_rows)[order],
                               np.ones(order.size, np.int64),
                               np.concatenate(position_rows)[order],
                               np.concatenate(token_rows)[order])
    assert np.array_equal(one_page, np.concatenate(whole)[order])
    assert one_page.dtype == np.uint64 and one_page.flags.c_contiguous


def test_returned_keys_do_not_share_the_scratch() -> None:
    """The hashing scratch is reused call after call: keys returned earlier must not change."""
    cache = bound(page_size=4)
    rng = np.random.default_rng(3)
    parents = rng.integers(0, 2**63, (6, 2)).astype(np.uint64)
    tokens = rng.integers(0, 1000, (6, 4))
    first = [cache.page_keys(parents, np.ones(6, np.int64), np.arange(6), tokens),
             cache.page_keys(parents[:2], np.array([2, 4]), np.array([0, 9]), tokens),
             cache.prompt_keys(tokens.reshape(-1), None)]
    saved = [keys.copy() for keys in first]
    for k in (6, 3, 40):  # same size, smaller, and larger (the scratch grows)
        cache.page_keys(rng.integers(0, 2**63, (k, 2)).astype(np.uint64), np.ones(k, np.int64),
                        np.arange(k), rng.integers(0, 1000, (k, 4)))
        cache.prompt_keys(rng.integers(0, 1000, 4 * k), "b")
    for keys, want in zip(first, saved):
        assert np.array_equal(keys, want)


def test_a_huge_batch_hashes_into_temporaries_with_the_same_keys() -> None:
    """Past 2**20 tokens, page_values hashes into temporaries instead of kept scratch: the
    keys equal those of smaller batches (kept scratch) of the same pages."""
    cache = bound(page_size=1)
    tokens = np.random.default_rng(5).integers(0, 50000, (1 << 20) + 3).astype(np.int32)
    keys = cache.prompt_keys(tokens, "n")
    head = cache.page_keys(cache.root_key("n")[None], np.array([1000]), np.array([0]),
                           tokens[:1000, None])
    assert np.array_equal(keys[:1000], head)
    k = tokens.size
    tail = cache.page_keys(keys[k - 1001 : k - 1], np.ones(1000, np.int64),
                           np.arange(k - 1000, k), tokens[k - 1000 :, None])
    assert np.array_equal(keys[k - 1000 :], tail)
