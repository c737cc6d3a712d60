"""Tiers below the device: full pages kept in host memory or on disk as page bundles.

A tier stores one entry per full page, under a tier key::

    tier key = BLAKE2b-128(prefix key [2] uint64, key = BLAKE2b(identity))

The prefix key is the prefix cache's chained key of the page (it names the page's whole
prefix and its namespace); the identity (model, weights, KV dtype and scale mode, page size,
layout, format version: every field of :class:`CacheIdentity`) is folded in, so a tier of
another identity or a lookup in another namespace can never hit. One entry per page, not per
run: chained keys make every page's key name its prefix, so runs that share leading pages
share entries, eviction works page by page, and a hit is simply the leading keys present
(``longest_prefix``). ``get`` returns those pages as one bundle, each page's digest checked;
a page that fails its check ends the hit there (the pages before it are served, never a gap).

LRU inside a tier: a stored or loaded run is touched last page first, so that a run's leading
pages are evicted last (a page is useless without every page before it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvmem._validate import integer
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    IncompatibleCacheError,
    IntegrityError,
)
from kvmem.transfer._bundle import PageBundle, page_digests
from kvmem.transfer._identity import CacheIdentity

__all__ = ["DiskTier", "HostTier", "TierStats", "tier_keys"]

log = logging.getLogger(__name__)

KeyArray = npt.NDArray[np.uint64]


def identity_digest(identity: CacheIdentity) -> bytes:
    """BLAKE2b-128 of every field of ``identity`` (canonical JSON)."""
    text = json.dumps(identity.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"kvmem-identity").digest()


def _as_keys(keys: npt.ArrayLike) -> KeyArray:
    arr = np.asarray(keys)
    if arr.dtype != np.uint64 or arr.ndim != 2 or arr.shape[1] != 2:
        raise ArgumentError(f"keys: expected prefix keys [n, 2] uint64, got {arr.dtype} "
                            f"{list(arr.shape)}")
    return np.ascontiguousarray(arr, dtype="<u8")


def tier_keys(prefix_keys: npt.ArrayLike, identity: CacheIdentity) -> list[bytes]:
    """The tier key of each page: ``prefix_keys [n, 2]`` uint64 -> n keys of 16 bytes."""
    return _keys_under(identity_digest(identity), _as_keys(prefix_keys))


def _keys_under(secret: bytes, keys: KeyArray) -> list[bytes]:
    """:func:`tier_keys` with the identity's digest already taken (a tier takes it once)."""
    return [_key_under(secret, row) for row in keys]


def _key_under(secret: bytes, row: KeyArray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16, key=secret,
                           person=b"kvmem-tier").digest()


def _leading_keys_present(secret: bytes, keys: KeyArray, present: Any) -> int:
    """How many leading ``keys`` have their tier key in ``present``: hashes up to the first
    miss only (an admission that misses pays for one page, not for its whole prompt)."""
    if not present:
        return 0
    n = 0
    for row in keys:
        if _key_under(secret, row) not in present:
            break
        n += 1
    return n


def require_identity(mine: CacheIdentity, theirs: CacheIdentity) -> None:
    """Raise IncompatibleCacheError naming the first field in which ``theirs`` differs (every
    field counts: a tier stores and serves bytes as they are, it converts nothing)."""
    if not isinstance(theirs, CacheIdentity):
        raise ArgumentTypeError(f"expected a CacheIdentity, got {type(theirs).__name__}")
    for f in fields(mine):
        if getattr(mine, f.name) != getattr(theirs, f.name):
            raise IncompatibleCacheError(f.name, getattr(mine, f.name), getattr(theirs, f.name))


def _checked_bundle(identity: CacheIdentity, bundle: PageBundle) -> None:
    if not isinstance(bundle, PageBundle):
        raise ArgumentTypeError(f"expected a PageBundle, got {type(bundle).__name__}")
    require_identity(identity, bundle.identity)
    if bundle.num_pages and not bundle.prefix_keys.any(axis=1).all():
        raise ArgumentError("a bundle without prefix keys (a zero key) cannot be stored in a "
                            "tier: pass the pages' prefix keys to PageBundle.of")


def page_of(bundle: PageBundle, i: int) -> PageBundle:
    """Page ``i`` of ``bundle`` as a bundle of one page (views)."""
    s = slice(i, i + 1)
    return PageBundle(bundle.identity, bundle.namespace, bundle.token_ids[s],
                      bundle.prefix_keys[s], {k: v[:, s] for k, v in bundle.pages.items()},
                      bundle.static_scales, bundle.page_digests[s])


def join_pages(parts: list[PageBundle]) -> PageBundle:
    """Bundles of consecutive pages (same identity, namespace, static scales) as one."""
    first = parts[0]
    return PageBundle(first.identity, first.namespace,
                      np.concatenate([p.token_ids for p in parts]),
                      np.concatenate([p.prefix_keys for p in parts]),
                      {k: np.concatenate([p.pages[k] for p in parts], axis=1) for k in first.pages},
                      first.static_scales, np.concatenate([p.page_digests for p in parts]))


def _same_scales(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None
                                         and np.array_equal(a, b))


class _HexKeys:
    """A DiskTier's file names seen as a set of tier keys (``key in``, ``bool``)."""

    def __init__(self, names: dict[str, int]) -> None:
        self.names = names

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key.hex() in self.names

    def __bool__(self) -> bool:
        return bool(self.names)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of a tier. Hits and misses count pages asked of ``get``; ``num_dropped_stores``
    counts pages ``put`` could not store (no room, a failing write)."""

    medium: str  # "CPU" or "DISK", as vLLM's KV events name them
    capacity_bytes: int
    num_pages: int
    bytes_used: int
    hit_pages: int
    miss_pages: int
    bytes_stored: int
    bytes_loaded: int
    num_evictions: int
    num_digest_failures: int  # stored pages whose bytes no longer match (removed)
    num_identity_misses: int  # entries found under a key whose identity or key differ
    num_dropped_stores: int


class _Counters:
    def __init__(self) -> None:
        self.hit_pages = self.miss_pages = self.bytes_stored = self.bytes_loaded = 0
        self.num_evictions = self.num_digest_failures = self.num_identity_misses = 0
        self.num_dropped_stores = 0

    def stats(self, medium: str, capacity: int, num_pages: int, used: int) -> TierStats:
        return TierStats(medium, capacity, num_pages, used, **vars(self))


class HostTier:
    """Full pages in host memory: one slab per page array, ``[L, num_slots, bytes]`` uint8
    (pinned when CUDA is available), allocated once; LRU eviction.

    Parameters
    ----------
    capacity_bytes: the page bytes the tier may hold (at least one page: ``identity``'s
        ``bytes_per_page``, data and token scales of every layer).
    identity: the identity of every page stored (a bundle of another is refused).

    Attributes
    ----------
    on_removed: ``fn(prefix_keys [k, 2] uint64)`` after pages left the tier other than by
        :meth:`clear` (LRU eviction, a failed digest or identity check), or None.
    on_evicted: ``fn(bundle)`` with the pages LRU eviction is about to overwrite, one bundle
        per namespace (their bytes, before they are gone: a tier below takes them), or None.
    """

    medium = "CPU"

    def __init__(self, capacity_bytes: int, identity: CacheIdentity) -> None:
        if not isinstance(identity, CacheIdentity):
            raise ArgumentTypeError(f"identity: expected a CacheIdentity, got "
                                    f"{type(identity).__name__}")
        capacity = integer(capacity_bytes, "capacity_bytes", minimum=0)
        spec = identity.pool_spec(1, "cpu")
        self.identity, self.page_nbytes = identity, spec.bytes_per_page
        self._secret = identity_digest(identity)  # (the identity is frozen: taken once)
        n = capacity // self.page_nbytes
        if n == 0:
            raise ConfigError(f"capacity_bytes={capacity} holds no page of {self.page_nbytes} "
                              "bytes; give at least one page's bytes")
        self.capacity_bytes, self.num_slots = capacity, n
        L, pin = identity.num_layers, torch.cuda.is_available()
        sizes = {"data": spec.data_bytes_per_page // L,
                 "token_scales": spec.token_scale_bytes_per_page // L}
        self._buffers = {k: torch.empty((L, n, b), dtype=torch.uint8, pin_memory=pin)
                         for k, b in sizes.items() if b}
        self._slabs = {k: t.numpy() for k, t in self._buffers.items()}  # [L, n, bytes] each
        self._tokens = np.zeros((n, identity.page_size), dtype=np.int64)
        self._keys = np.zeros((n, 2), dtype=np.uint64)
        self._digests = np.zeros((n, 16), dtype=np.uint8)
        self._static: list[npt.NDArray[np.float32] | None] = [None] * n
        self._namespace: list[Any] = [None] * n
        self._free = list(range(n - 1, -1, -1))
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # tier key -> slot, oldest first
        self._n = _Counters()
        self.on_removed: Callable[[KeyArray], None] | None = None
        self.on_evicted: Callable[[PageBundle], None] | None = None

    def _bundle(self, slots: list[int]) -> PageBundle:
        """Stored pages ``slots`` (one namespace, one set of static scales) as a bundle."""
        ids = np.array(slots, dtype=np.int64)
        return PageBundle(self.identity, self._namespace[slots[0]], self._tokens[ids],
                          self._keys[ids], {k: slab[:, ids] for k, slab in self._slabs.items()},
                          self._static[slots[0]], self._digests[ids])

    def _evicted(self, slots: list[int]) -> None:
        """Slots LRU eviction freed, their bytes still there: hand them to ``on_evicted``,
        oldest first, grouped by namespace (never raises: the tier below counts its own
        failures)."""
        if self.on_evicted is None or not slots:
            return
        groups: dict[tuple[int, int], list[int]] = {}
        for slot in slots:
            group_of = (id(self._namespace[slot]), id(self._static[slot]))
            groups.setdefault(group_of, []).append(slot)
        for group in groups.values():
            try:
                self.on_evicted(self._bundle(group))
            except Exception:
                log.warning("host tier: the tier below refused %d evicted pages", len(group),
                            exc_info=True)

    def _removed(self, slots: list[int]) -> None:
        """Slots just freed (by eviction or a failed check): tell ``on_removed``."""
        if self.on_removed is not None and slots:
            self.on_removed(self._keys[slots].copy())

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def num_dropped_stores(self) -> int:
        """Pages ``put`` could not store so far."""
        return self._n.num_dropped_stores

    def put(self, bundle: PageBundle) -> int:
        """Store ``bundle``'s pages (those already stored are only touched); returns the pages
        stored. A bundle larger than the tier stores its leading pages, the rest dropped."""
        _checked_bundle(self.identity, bundle)
        for k, arr in bundle.pages.items():
            slab = self._slabs.get(k)
            if slab is None or slab.shape[2] != arr.shape[2]:
                raise ArgumentError(f"the bundle's {k} pages do not fit the tier's identity")
        count = min(bundle.num_pages, self.num_slots)
        self._n.num_dropped_stores += bundle.num_pages - count
        keys = _keys_under(self._secret, _as_keys(bundle.prefix_keys[:count]))
        for key in reversed(keys):  # touched first: what follows never evicts them
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        new = [i for i, key in enumerate(keys) if key not in self._slot_of]
        evicted = []
        while len(self._free) < len(new):
            _, slot = self._slot_of.popitem(last=False)
            self._free.append(slot)
            evicted.append(slot)
            self._n.num_evictions += 1
        self._evicted(evicted)
        self._removed(evicted)
        slots = np.array([self._free.pop() for _ in new], dtype=np.int64)
        idx = np.array(new, dtype=np.int64)
        for k, slab in self._slabs.items():
            slab[:, slots] = bundle.pages[k][:, idx]
        self._tokens[slots] = bundle.token_ids[idx]
        self._keys[slots] = bundle.prefix_keys[idx]
        self._digests[slots] = bundle.page_digests[idx]
        for i, slot in zip(new, slots.tolist(), strict=True):
            self._static[slot], self._namespace[slot] = bundle.static_scales, bundle.namespace
            self._slot_of[keys[i]] = slot
        for key in reversed(keys):  # the run's first page is the most recently used
            self._slot_of.move_to_end(key)
        self._n.bytes_stored += len(new) * self.page_nbytes
        return len(new)

    def longest_prefix(self, keys: npt.ArrayLike) -> int:
        """The number of leading pages of ``keys`` (``[n, 2]`` uint64 prefix keys) stored."""
        return _leading_keys_present(self._secret, _as_keys(keys), self._slot_of)

    def get(self, keys: npt.ArrayLike, check_digests: bool = True) -> PageBundle | None:
        """The bundle of the longest stored prefix of ``keys`` (``[n, 2]`` uint64), every page's
        digest checked (a page that fails is removed and ends the hit), or None.
        ``check_digests=False`` serves the bytes unchecked (fault injection only)."""
        asked = _as_keys(keys)
        tks = _keys_under(self._secret, asked)
        slots: list[int] = []
        for i, k in enumerate(tks):
            slot = self._slot_of.get(k)
            if slot is None:
                break
            first = slots[0] if slots else slot
            if not (np.array_equal(self._keys[slot], asked[i])
                    and self._namespace[slot] == self._namespace[first]
                    and _same_scales(self._static[slot], self._static[first])):
                self._free.append(self._slot_of.pop(k))
                self._n.num_identity_misses += 1
                self._removed([slot])
                break
            slots.append(slot)
        n = len(slots)
        if n:
            ids = np.array(slots, dtype=np.int64)
            pages = {k: slab[:, ids] for k, slab in self._slabs.items()}  # [L, n, bytes] copies
            tokens, static = self._tokens[ids], self._static[slots[0]]
            bad = np.flatnonzero((page_digests(pages, tokens, static)
                                  != self._digests[ids]).any(axis=1)) if check_digests else ids[:0]
            if bad.size:
                n = int(bad[0])
                self._free.append(self._slot_of.pop(tks[n]))
                self._n.num_digest_failures += 1
                self._removed([slots[n]])
                log.warning("host tier: a page failed its digest check; removed")
                ids, pages, tokens = ids[:n], {k: v[:, :n] for k, v in pages.items()}, tokens[:n]
        self._n.hit_pages += n
        self._n.miss_pages += len(tks) - n
        if n == 0:
            return None
        for k in reversed(tks[:n]):
            self._slot_of.move_to_end(k)
        self._n.bytes_loaded += n * self.page_nbytes
        return PageBundle(self.identity, self._namespace[slots[0]], tokens, self._keys[ids],
                          pages, self._static[slots[0]], self._digests[ids])

    def clear(self) -> int:
        """Forget every page; returns how many there were."""
        n = len(self._slot_of)
        self._free.extend(self._slot_of.values())
        self._slot_of.clear()
        return n

    def stats(self) -> TierStats:
        return self._n.stats(self.medium, self.capacity_bytes, len(self._slot_of),
                             len(self._slot_of) * self.page_nbytes)


class DiskTier:
    """Full pages on disk, one file per page (a one-page bundle's bytes), written atomically
    (a temporary file, fsync, rename); LRU eviction by bytes; the order survives a restart
    (a file's modification time is its last use).

    ::

        directory/kvmem.lock                      held (flock) by the one DiskTier using it
        directory/kvmem.seed                      the prefix keys' seed (``key_seed``)
        directory/<identity digest>/<tier key>.kvb

    Parameters
    ----------
    directory: created if missing; refused (ConfigError) if it cannot be written, or if
        another DiskTier (in this or another process) holds it.
    capacity_bytes: the file bytes the tier may hold.
    identity: pages of other identities in the directory are ignored, never deleted (unless
        :meth:`remove_other_identities`).

    Attributes
    ----------
    on_removed: ``fn(prefix_keys [k, 2] uint64)`` after pages left the tier by LRU eviction
        (a file that fails its check is removed unread: its key is not known), or None.
    """

    medium = "DISK"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 identity: CacheIdentity) -> None:
        if not isinstance(identity, CacheIdentity):
            raise ArgumentTypeError(f"identity: expected a CacheIdentity, got "
                                    f"{type(identity).__name__}")
        self.capacity_bytes = integer(capacity_bytes, "capacity_bytes", minimum=1)
        self.identity, self.root = identity, Path(directory)
        self._secret = identity_digest(identity)  # (the identity is frozen: taken once)
        self.path = self.root / self._secret.hex()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.root / "kvmem.lock", "a+")  # noqa: SIM115 (held until close)
        except OSError as e:
            raise ConfigError(f"disk tier: cannot use {self.root} ({e}); give a directory this "
                              "process can write") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "?"
            self._lock.close()
            raise ConfigError(f"disk tier: {self.root} is in use by another DiskTier (process "
                              f"{holder}); give each tier its own directory") from None
        try:
            self._lock.truncate(0)
            self._lock.write(str(os.getpid()))
            self._lock.flush()
            probe = self.path / f"probe.{os.getpid()}.tmp"
            self._write(probe, b"kvmem")
            probe.unlink()
            self.key_seed = self._key_seed()
        except OSError as e:
            self.close()
            raise ConfigError(f"disk tier: cannot write in {self.path} ({e}); give a directory "
                              "this process can write") from None
        self._size_of: OrderedDict[str, int] = OrderedDict()  # tier key hex -> bytes, oldest first
        self.bytes_used = 0
        entries = []
        for f in self.path.iterdir():
            if f.suffix == ".tmp":  # a write cut short by a crash: never renamed, never valid
                f.unlink(missing_ok=True)
            elif f.suffix == ".kvb":
                st = f.stat()
                entries.append((st.st_mtime_ns, f.stem, st.st_size))
        self._last_use = max((e[0] for e in entries), default=0)
        for _, name, size in sorted(entries):
            self._size_of[name] = size
            self.bytes_used += size
        self._n = _Counters()
        self._keys: dict[str, KeyArray] = {}  # prefix keys of the pages stored by this process
        self.on_removed: Callable[[KeyArray], None] | None = None
        self._make_room(0)

    def _key_seed(self) -> int:
        """The seed of the prefix keys that name this directory's pages: drawn once, kept in
        ``kvmem.seed`` (a manager whose prefix cache was given no seed takes it, so that a
        restarted process computes the same keys)."""
        path = self.root / "kvmem.seed"
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            seed = int.from_bytes(os.urandom(16), "little")
            tmp = self.root / f"kvmem.seed.{os.getpid()}.tmp"
            self._write(tmp, str(seed).encode())
            os.replace(tmp, path)
            return seed

    def __len__(self) -> int:
        return len(self._size_of)

    @property
    def num_dropped_stores(self) -> int:
        """Pages ``put`` could not store so far (no room, a failing write)."""
        return self._n.num_dropped_stores

    def close(self) -> None:
        """Release the directory (another DiskTier may open it)."""
        self._lock.close()

    def _file(self, name: str) -> Path:
        return self.path / f"{name}.kvb"

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _remove(self, name: str) -> None:
        self.bytes_used -= self._size_of.pop(name)
        self._keys.pop(name, None)
        self._file(name).unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        while self._size_of and self.bytes_used + nbytes > self.capacity_bytes:
            name = next(iter(self._size_of))
            key = self._keys.get(name)
            self._remove(name)
            self._n.num_evictions += 1
            if self.on_removed is not None and key is not None:
                self.on_removed(key[None])

    def _touch(self, names: list[str]) -> None:
        for name in reversed(names):  # the run's first page is the most recently used
            self._size_of.move_to_end(name)
            # A file's mtime is its place in the order after a restart: strictly increasing
            # (the file system's clock is too coarse to order touches in one call). A failed
            # utime only gives a restart an older order.
            self._last_use = max(time.time_ns(), self._last_use + 1)
            with contextlib.suppress(OSError):
                os.utime(self._file(name), ns=(self._last_use, self._last_use))

    def put(self, bundle: PageBundle) -> int:
        """Store ``bundle``'s pages in order (those already stored are only touched); returns
        the pages stored. A write that fails (disk full, an I/O error) drops that page and the
        rest of the run, counted and logged: it raises nothing."""
        _checked_bundle(self.identity, bundle)
        names = [k.hex() for k in _keys_under(self._secret, _as_keys(bundle.prefix_keys))]
        self._touch([n for n in names if n in self._size_of])
        stored = 0
        for i, name in enumerate(names):
            if name in self._size_of:
                continue
            data = page_of(bundle, i).to_bytes()
            if len(data) > self.capacity_bytes:
                self._n.num_dropped_stores += len(names) - i
                break
            self._make_room(len(data))
            tmp = self.path / f"{name}.{os.getpid()}.tmp"
            try:
                self._write(tmp, data)
                os.replace(tmp, self._file(name))
            except OSError as e:
                tmp.unlink(missing_ok=True)
                self._n.num_dropped_stores += len(names) - i
                log.warning("disk tier: a store of %d pages dropped at page %d (%s)",
                            len(names), i, e)
                break
            self._size_of[name] = len(data)
            self._keys[name] = bundle.prefix_keys[i].copy()
            self.bytes_used += len(data)
            self._n.bytes_stored += len(data)
            stored += 1
        self._touch([n for n in names if n in self._size_of])
        if stored:
            self._sync_directory()
        return stored

    def _sync_directory(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("disk tier: fsync of %s failed (%s)", self.path, e)

    def longest_prefix(self, keys: npt.ArrayLike) -> int:
        """The number of leading pages of ``keys`` (``[n, 2]`` uint64) with a file (``get``
        may serve fewer: a file is checked only when read)."""
        return _leading_keys_present(self._secret, _as_keys(keys), _HexKeys(self._size_of))

    def get(self, keys: npt.ArrayLike) -> PageBundle | None:
        """The bundle of the longest prefix of ``keys`` (``[n, 2]`` uint64) read back intact,
        or None. A truncated or corrupted file ends the hit and is removed; a file of another
        identity or key ends it too (counted)."""
        asked = _as_keys(keys)
        names = [k.hex() for k in _keys_under(self._secret, asked)]
        parts: list[PageBundle] = []
        for i, name in enumerate(names):
            if name not in self._size_of:
                break
            try:
                page = PageBundle.from_bytes(self._file(name).read_bytes())
            except (OSError, ArgumentError, IntegrityError) as e:
                self._remove(name)
                self._n.num_digest_failures += 1
                log.warning("disk tier: %s unreadable (%s); removed", self._file(name), e)
                break
            first = parts[0] if parts else page
            if (page.identity != self.identity or page.num_pages != 1
                    or not np.array_equal(page.prefix_keys[0], asked[i])
                    or page.namespace != first.namespace
                    or not _same_scales(page.static_scales, first.static_scales)):
                self._remove(name)
                self._n.num_identity_misses += 1
                break
            parts.append(page)
        n = len(parts)
        self._n.hit_pages += n
        self._n.miss_pages += len(names) - n
        if n == 0:
            return None
        self._touch(names[:n])
        self._n.bytes_loaded += sum(self._size_of[name] for name in names[:n])
        return join_pages(parts)

    def clear(self) -> int:
        """Remove every page of this identity; returns how many there were."""
        n = len(self._size_of)
        for name in list(self._size_of):
            self._remove(name)
        return n

    def remove_other_identities(self) -> int:
        """Delete the pages of every other identity in the directory; returns how many."""
        n = 0
        for d in self.root.iterdir():
            if d.is_dir() and d != self.path and len(d.name) == 32:
                n += sum(1 for f in d.iterdir() if f.suffix == ".kvb")
                shutil.rmtree(d)
        return n

    def stats(self) -> TierStats:
        return self._n.stats(self.medium, self.capacity_bytes, len(self._size_of),
                             self.bytes_used)
