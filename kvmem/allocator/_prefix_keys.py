"""The prefix cache's key function: chained 128-bit keys of full pages, namespace in every key.

Key of page ``i`` of a prompt (per 64-bit lane ``l`` of two, all arithmetic modulo 2**64)::

    s_i   = sum_c  xorshift((token[c] + 1) * K[l, c])      (c = 0 .. page_size-1)
    g_i   = fmix(s_i + (i + 1) * Q[l])
    key_i = key_{i-1} + g_i,      key_{-1} = root(namespace) = blake2b(secret, namespace)

``K`` and ``Q`` are random odd constants drawn from ``seed``, so the keys of a whole prompt
come from a dozen vectorized numpy calls instead of a hash call per page. The keys are keyed,
not cryptographic: a cache confirms every hit against the page's stored token ids and
namespace, so a collision can only cost a miss. A namespace enters through its canonical byte
encoding (:func:`namespace_bytes`), so ``1`` and ``True``, or ``(1, "a")`` and
``(True, "a")``, are different namespaces everywhere.

numpy and hashlib only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from kvmem._validate import integer, token_array
from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = ["Namespace", "PrefixKeys", "namespace_bytes"]

KeyArray = npt.NDArray[np.uint64]  # [k, 2]: one 128-bit key per row
Int64Array = npt.NDArray[np.int64]
Namespace = Hashable  # None, str, int, bytes, or a tuple of those (tenant, LoRA id, salt, ...)


def namespace_bytes(namespace: Namespace) -> bytes:
    """The canonical, injective byte encoding of a namespace: None, a str, an int (or numpy
    integer; never a bool, which encodes as itself), bytes, or a tuple of those. Namespaces
    are equal exactly when their encodings are."""
    if namespace is None:
        return b"n"
    if isinstance(namespace, (bool, np.bool_)):
        return b"o1" if namespace else b"o0"
    if isinstance(namespace, (int, np.integer)):
        return b"i" + str(int(namespace)).encode()
    if isinstance(namespace, str):
        data = namespace.encode()
        return b"s" + str(len(data)).encode() + b":" + data
    if isinstance(namespace, bytes):
        return b"b" + str(len(namespace)).encode() + b":" + namespace
    if isinstance(namespace, tuple):
        parts = [namespace_bytes(x) for x in namespace]
        return b"t" + str(len(parts)).encode() + b"(" + b"".join(
            str(len(p)).encode() + b":" + p for p in parts
        ) + b")"
    raise ArgumentTypeError(
        f"namespace must be None, str, int, bytes or a tuple of those, got "
        f"{type(namespace).__name__} {namespace!r}; encode other values (a LoRA config, an "
        "image hash) as one of those"
    )


# 0-d arrays rather than numpy scalars: a ufunc takes them as they are, a scalar is converted
# on every call.
_M1 = np.array(0xFF51AFD7ED558CCD, dtype=np.uint64)
_M2 = np.array(0xC4CEB9FE1A85EC53, dtype=np.uint64)
_S33 = np.array(33, dtype=np.uint64)
_S31 = np.array(31, dtype=np.uint64)
_ONE = np.array(1, dtype=np.uint64)
_LANES = np.dtype((np.void, 16))  # a row of two uint64 lanes as one item
_MASK = (1 << 64) - 1
_M1_INT = int(_M1)
_M2_INT = int(_M2)


def _fmix_int(s: int) -> int:
    """:func:`_fmix` of one value (taken modulo 2**64), in Python ints."""
    s &= _MASK
    s ^= s >> 33
    s = (s * _M1_INT) & _MASK
    s ^= s >> 33
    s = (s * _M2_INT) & _MASK
    return s ^ (s >> 33)


def _fmix(x: npt.NDArray[np.uint64], tmp: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """64-bit finalizer (avalanche): every output bit depends on every input bit. In place;
    ``tmp``: scratch of ``x``'s shape."""
    np.right_shift(x, _S33, out=tmp)
    x ^= tmp
    x *= _M1
    np.right_shift(x, _S33, out=tmp)
    x ^= tmp
    x *= _M2
    np.right_shift(x, _S33, out=tmp)
    x ^= tmp
    return x


class PrefixKeys:
    """The key function (module docstring) for one page size and seed.

    Parameters
    ----------
    seed: the constants' seed (the same seed gives the same keys in every process).
    page_size: tokens per page.
    """

    def __init__(self, seed: int, page_size: int) -> None:
        rng = np.random.default_rng(integer(seed, "seed", minimum=0))
        self._secret = rng.bytes(32)
        self.page_size = integer(page_size, "page_size", minimum=1, maximum=65536)
        self._K = rng.integers(1, 2**63, size=(2, self.page_size), dtype=np.uint64)
        self._K |= np.uint64(1)  # [2, page_size]: one row per lane
        self._Q = rng.integers(1, 2**63, size=2, dtype=np.uint64) | np.uint64(1)
        self._pq = self._position_table(1024)
        self._Q_int = [int(v) for v in self._Q]  # for one key at a time (key_ints)
        self._K_ints = self._K.tolist()  # the same, as Python ints (key_ints)
        self._ones = np.ones(self.page_size, dtype=np.uint64)  # sums tokens by matmul
        # Scratch for _page_values, [pages, 2 * page_size] each: see _hash_buffers.
        self._hash_x = self._hash_y = self._K_rows = np.empty((0, 2 * self.page_size), np.uint64)
        self._roots: dict[bytes, KeyArray] = {}

    def root(self, namespace: Namespace) -> KeyArray:
        """The key a namespace's page 0 chains from: ``[2]``, uint64."""
        data = namespace_bytes(namespace)
        root = self._roots.get(data)
        if root is None:
            digest = hashlib.blake2b(data, digest_size=16, key=self._secret).digest()
            root = np.frombuffer(digest, dtype=np.uint64).copy()
            root.flags.writeable = False
            self._roots[data] = root
        return root

    def _page_values(self, token_ids: npt.NDArray[np.integer],
                     position_values: KeyArray) -> KeyArray:
        """``g`` of each page: ``token_ids [k, page_size]`` and its pages' ``(position + 1) *
        Q`` (``position_values [k, 2]``, :meth:`_position_values`) -> ``[k, 2]`` (a fresh
        array)."""
        k, p = token_ids.shape
        x, y, k_rows = self._hash_buffers(k)
        # A row per page: its tokens once per lane, so that no operation broadcasts (a
        # broadcast runs a short loop per page and lane: twice the cost at a decode step).
        x.reshape(k, 2, p)[...] = token_ids[:, None, :]  # (a cast copy: no arithmetic)
        x += _ONE
        x *= k_rows  # (token + 1) * K: token 0 still moves the sum
        np.right_shift(x, _S31, out=y)
        x ^= y
        # The sum per page and lane, [k, 2]: a matmul with ones costs less than np.add.reduce.
        s = np.matmul(x.reshape(k, 2, p), self._ones)
        s += position_values
        return _fmix(s, np.empty_like(s))

    def _hash_buffers(self, k: int) -> tuple[KeyArray, KeyArray, KeyArray]:
        """Scratch for :meth:`_page_values` of ``k`` pages, ``x`` and ``y``, and ``K`` (both
        lanes) repeated for each page: ``[k, 2 * page_size]``, uint64. A prompt's worth of
        fresh temporaries costs more than hashing into them."""
        if k > self._K_rows.shape[0]:
            row = self._K.reshape(1, -1)
            if k * self.page_size > 1 << 20:  # a rare huge batch: temporaries, not kept
                x = np.empty((k, row.size), np.uint64)
                return x, np.empty_like(x), row
            size = max(k, 2 * self._K_rows.shape[0])
            self._hash_x = np.empty((size, row.size), np.uint64)
            self._hash_y = np.empty_like(self._hash_x)
            self._K_rows = np.repeat(row, size, axis=0)
        return self._hash_x[:k], self._hash_y[:k], self._K_rows[:k]

    def _position_values(self, positions: npt.NDArray[np.integer]) -> KeyArray:
        """``(position + 1) * Q`` per lane: ``[k, 2]``, uint64 (from a table grown on demand)."""
        try:
            return self._pq[positions].view(np.uint64).reshape(-1, 2)
        except IndexError:  # a position past the table (positions are never negative)
            self._pq = self._position_table(max(2 * self._pq.size, int(np.max(positions)) + 1))
            return self._pq[positions].view(np.uint64).reshape(-1, 2)

    def _run_position_values(self, first: int, k: int) -> KeyArray:
        """:meth:`_position_values` of positions ``first .. first+k-1``: a view of ``k`` rows
        of the table, ``[k, 2]`` (a run of pages: no gather)."""
        if first + k > self._pq.size:
            self._pq = self._position_table(max(2 * self._pq.size, first + k))
        return self._pq[first : first + k].view(np.uint64).reshape(k, 2)

    def _position_table(self, size: int) -> npt.NDArray[np.void]:
        """``(position + 1) * Q`` for positions ``0 .. size-1``, a row per position as one
        item (gathering ``[k]`` items costs half gathering ``[k, 2]`` rows)."""
        table = np.arange(1, size + 1, dtype=np.uint64)[:, None] * self._Q
        return table.view(_LANES).reshape(size)

    def prompt_keys(self, token_ids: npt.NDArray[np.integer], root: KeyArray,
                    max_pages: int | None = None) -> KeyArray:
        """Keys of a prompt's full pages (at most ``max_pages``) chained from ``root`` (a
        namespace's :meth:`root`): ``[k, 2]``, uint64."""
        if type(token_ids) is not np.ndarray or token_ids.dtype.kind not in "iu" or (
                token_ids.ndim != 1):
            token_ids = token_array(token_ids, "token_ids")  # checked; the manager's pass as is
        if max_pages is not None:
            max_pages = integer(max_pages, "max_pages", minimum=0)
        p = self.page_size
        k = token_ids.size // p if max_pages is None else min(token_ids.size // p, max_pages)
        if k <= 0:
            return np.empty((0, 2), dtype=np.uint64)
        return self.run_keys(root, 0, token_ids[: k * p].reshape(k, p))

    def page_keys(self, parent_keys: KeyArray, counts: npt.NDArray[np.integer],
                  first_positions: npt.NDArray[np.integer],
                  token_ids: npt.NDArray[np.integer]) -> KeyArray:
        """Chained keys of ``R`` runs of consecutive full pages (``PrefixCache.page_keys``)."""
        token_ids = np.asarray(token_ids)
        counts = np.asarray(counts)
        if token_ids.size == counts.size * self.page_size:
            # One page per run (the decode step): no segmented sum.
            keys = self._page_values(token_ids.reshape(-1, self.page_size),
                                     self._position_values(first_positions))
            keys += np.asarray(parent_keys, dtype=np.uint64)
            return keys
        counts = counts.astype(np.int64, copy=False)
        total = int(counts.sum())
        if total == 0:
            return np.empty((0, 2), dtype=np.uint64)
        starts = np.cumsum(counts) - counts
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        positions = np.repeat(np.asarray(first_positions, dtype=np.int64), counts) + within
        g = self._page_values(token_ids.reshape(total, self.page_size),
                              self._position_values(positions))
        # Segmented cumulative sum (mod 2**64): the global one, less the sum before each run,
        # plus the run's parent key. sums[i]: the sum of g before page i.
        sums = np.zeros((total + 1, 2), dtype=np.uint64)
        np.cumsum(g, axis=0, out=sums[1:])
        offsets = sums[starts] - np.asarray(parent_keys, dtype=np.uint64)
        keys = sums[1:]
        keys -= np.repeat(offsets, counts, axis=0)
        return keys

    def run_keys(self, parent_key: KeyArray, first_position: int,
                 token_ids: npt.NDArray[np.integer]) -> KeyArray:
        """:meth:`page_keys` of one run: ``token_ids [k, page_size]`` from page position
        ``first_position``, chained from ``parent_key [2]`` -> ``[k, 2]``, uint64 (a plain
        cumulative sum: no segments to cut)."""
        k = token_ids.shape[0]
        keys = self._page_values(token_ids, self._run_position_values(first_position, k))
        if k:
            # key_i = parent + g_0 + ... + g_i: the parent added to one row, then a running
            # sum (np.add.accumulate itself: np.cumsum's wrapper costs as much again).
            keys[0] += parent_key
            np.add.accumulate(keys, axis=0, out=keys)
        return keys

    def key_ints(self, parent0: int, parent1: int,
                 tokens: npt.NDArray[np.integer] | Sequence[int], position: int
                 ) -> tuple[int, int]:
        """The key of one page (``tokens``: its ``page_size`` ids) as two Python ints (the
        key's lanes), all in Python ints (one page's arithmetic costs less than numpy's fixed
        cost per call); equal to :meth:`page_keys`."""
        toks = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
        if len(toks) != self.page_size:
            raise ArgumentError(f"key_ints got {len(toks)} token ids: expected one page "
                                f"({self.page_size})")
        s0 = s1 = 0
        for t, k0, k1 in zip(toks, self._K_ints[0], self._K_ints[1]):
            x = ((t + 1) * k0) & _MASK  # (token + 1) * K, modulo 2**64 as numpy's
            s0 += x ^ (x >> 31)
            x = ((t + 1) * k1) & _MASK
            s1 += x ^ (x >> 31)
        q0, q1 = self._Q_int
        return ((parent0 + _fmix_int(s0 + (position + 1) * q0)) & _MASK,
                (parent1 + _fmix_int(s1 + (position + 1) * q1)) & _MASK)

    def first_key(self, root: KeyArray, tokens: Int64Array) -> tuple[int, int]:
        """Key of page 0 (``tokens[:page_size]``) chained from ``root``, as two Python ints."""
        return self.key_ints(int(root[0]), int(root[1]), tokens[: self.page_size], 0)

