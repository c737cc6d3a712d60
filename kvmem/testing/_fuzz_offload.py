"""The offload engine: the reference engine over a small device pool with a host tier below it,
write-through stores and deferred copies (``kvmem fuzz --engine offload``).

::

    device pool (PagePool, few pages)  --- write-through store at commit (deferred) --->  HostTier
         ^                                                                            (few pages,
         +---------- deferred load at admission (a tier hit), lands later -----------  LRU)

    admit     a prompt's pages past the device hits that the tier holds are loaded into fresh
              pages: a transfer op in the timeline; the request waits (not scheduled) until the
              ``transfer`` move runs ``land_copies()`` and reports it
    commit    the full pages the prefix cache takes are stored (deferred): a transfer op that
              reads them (``read_pages``: guarded until it lands)
    transfer  ``land_copies()``: every deferred copy lands at once; the device model takes the
              values the pool holds now in each loaded slot
    corrupt   one stored page's bytes change in the host tier (kvmem must find it by digest: a
              miss, never wrong K/V)
    clear     a weights update: every request with K/V of the old weights is preempted, the
              prefix cache reset (every tier cleared, pending copies cancelled), and the K/V
              value function changes (a new epoch): K/V of the old weights is wrong from now on

A slot's K/V value is stored in the pool as in the disaggregated engine (four 16-bit chunks of
an int64 in a float32 pool). The pool holds the value of the weights' epoch: the device model's
value salted with the epoch (never unsalted), written when a step launches. A loaded slot reads
back as the device model's value only when it holds the current epoch's value of the request's
own tokens and namespace; anything else lands as the raw pool value, which no request's tokens
imply, so the ``reads`` oracle sees a request that reads it.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem.cuda import PagePool, PoolSpec
from kvmem.testing._fuzz_disagg import read_values, write_values
from kvmem.testing._fuzz_manager import ManagerEngine
from kvmem.testing._fuzz_protocol import FuzzConfig
from kvmem.testing._fuzz_slots import PREEMPTED, RECEIVING, RUNNING, SlotEngine
from kvmem.testing._kv_values import kv_value_array, namespace_key
from kvmem.testing._launch import Launch
from kvmem.testing._oracles import FuzzFailure
from kvmem.testing._value_oracles import ValueOracles

__all__ = ["OffloadDiskEngine", "OffloadEngine"]

Int64Array = npt.NDArray[np.int64]

LOADING = RECEIVING  # a request whose deferred load has not landed (not scheduled)


def epoch_key(ns_key: int, epoch: int) -> int:
    """The pool's value key of a namespace under the weights of ``epoch`` (never the device
    model's own key)."""
    return ns_key ^ namespace_key(("kvmem-weights-epoch", epoch))


class OffloadValues(ValueOracles):
    """The value oracles, for admissions that load pages from a tier later: the request holds
    its hits and loaded tokens (``num_tokens``, the AdmitResult's cached tokens) but has
    committed only its device hits until the load lands."""

    def admitted(self, slot: int, request_id: Any, tokens: Int64Array, match: Any,
                 result: Any, what: str = "admit") -> int:
        mgr, P = self.mgr, self.P
        if not mgr.is_loading(request_id):
            return super().admitted(slot, request_id, tokens, match, result, what)
        self.ran["admission"] += 1
        committed, held = mgr.num_committed(request_id), mgr.num_tokens(request_id)
        pages = mgr.pages_of(request_id)
        hits, n = committed // P, int(tokens.size)
        loaded = held - committed
        problems = []
        if result is not None and (result.num_cached_tokens != held
                                   or result.num_hit_pages != hits
                                   or (result.num_host_pages + result.num_disk_pages) * P
                                   != loaded):
            problems.append(f"returned {result}, but the request holds {held} tokens of which "
                            f"{committed} committed")
        if committed % P or held % P or loaded <= 0 or held > (n - 1) // P * P:
            problems.append(f"{committed} committed and {held} held tokens: not whole pages "
                            "below the prompt's length, with some loading")
        if pages.size != -(-n // P):
            problems.append(f"{pages.size} pages for a {n}-token prompt")
        if match is not None and not np.array_equal(match.pages, pages[:hits]):
            problems.append(f"hit pages {pages[:hits].tolist()[:8]}, but match_prefix found "
                            f"{np.asarray(match.pages).tolist()[:8]}")
        if hits and not np.array_equal(mgr.tokens_of(request_id), tokens[:committed]):
            problems.append(f"its {hits} hit pages do not hold the prompt's first tokens")
        if problems:
            raise FuzzFailure("admission", f"{what}({request_id!r}) with a tier load: "
                              + "; ".join(problems))
        c = self.counts
        c["prefix_queries"] += 1
        c["prefix_query_tokens"] += n
        c["prefix_hit_tokens"] += committed
        self.num_pages[slot] = k = min(pages.size, self.width)
        self.pages[slot, :k] = pages[:k]
        return int(committed)


class OffloadEngine(ManagerEngine):
    """The reference engine with a host tier, write-through, deferred copies (module docstring).

    Attributes
    ----------
    host_pages: the host tier's pages (small: its LRU evicts now and then)
    disk_pages: > 0: a ``DiskTier`` of about as many pages below the host tier (the host tier's
        evictions go there), in a temporary directory removed with the engine
    pool: the device pool (``PagePool``); tier: its ``HostTier``; disk: its ``DiskTier`` or None
    epoch: the weights' epoch (the ``clear`` move starts a new one)
    counts: tier traffic the run caused (loads started, stores started, corruptions, resets)
    """

    name: ClassVar[str] = "offload"
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {"fork", "preempt", "resume", "clear", "hooks", "copies", "tiers"})
    host_pages: ClassVar[int] = 48
    disk_pages: ClassVar[int] = 0

    def __init__(self, config: FuzzConfig) -> None:
        from kvmem.allocator import HashedPrefixCache
        from kvmem.manager import KVCacheManager
        from kvmem.transfer import CacheIdentity, DiskTier, HostTier, OffloadConfig

        # Half the config's pages (at least a longest request's): the device evicts often.
        num_pages = max(config.num_pages // 2, -(-config.max_len // config.page_size) + 2)
        spec = PoolSpec(num_layers=1, num_pages=num_pages, page_size=config.page_size,
                        num_kv_heads=1, head_dim=4, dtype="fp32", device="cpu")
        self.pool = PagePool(spec)
        identity = CacheIdentity.of(spec, "fuzz", "w0")
        self.tier = HostTier(self.host_pages * spec.bytes_per_page, identity)
        tiers: tuple[Any, ...] = (self.tier,)
        self.disk: Any = None
        if self.disk_pages:
            directory = tempfile.mkdtemp(prefix="kvmem-fuzz-disk-")
            # (a file holds a page's bytes and a header of about a KiB)
            self.disk = DiskTier(directory, self.disk_pages * (spec.bytes_per_page + 1024),
                                 identity)
            # (the lock file closes when the tier is collected; the finalizer holds nothing of it)
            weakref.finalize(self, shutil.rmtree, directory, True)
            tiers = (self.tier, self.disk)
        # (a seeded key: the tiers' keys and files are the same in every replay)
        mgr = KVCacheManager(
            num_pages, page_size=config.page_size, max_seqs=config.max_seqs,
            prefix_cache=HashedPrefixCache(seed=0),
            max_pages_per_seq=-(-config.max_len // config.page_size) + 1,
            tracker=config.tracker, watermark=0.0, pool=self.pool,
            offload=OffloadConfig(tiers, write="through", copies="deferred"))
        # Copy-on-write copies go to the device model like the manager engine's (the step lists
        # them); the engine makes them in the pool when it launches the step.
        mgr._reserver.copy_pages = None
        SlotEngine.__init__(self, config, mgr)
        self.max_in_flight = config.max_in_flight
        self._bt = None
        self.values = OffloadValues(mgr, config.max_requests, config.max_len)
        self.epoch = 0
        # each deferred copy in flight (the offload's PendingLoad / PendingStore) -> its op
        self.copy_ops: dict[int, tuple[Any, Launch]] = {}
        self.counts = dict.fromkeys(("loads", "stores", "landings", "corruptions", "resets"), 0)

    # -- values ---------------------------------------------------------------------------------

    def _values(self, s: int, start: int, stop: int, epoch: int | None) -> Int64Array:
        """The K/V values of slot ``s``'s positions ``start..stop-1`` (``epoch``: the pool's
        under those weights; None: the device model's)."""
        spec = self.specs[s]
        assert spec is not None
        key = namespace_key(spec.namespace)
        if epoch is not None:
            key = epoch_key(key, epoch)
        return kv_value_array(key, self.tok[s, :stop])[start:]

    def launch(self, choice: int) -> Launch | None:
        op = super().launch(choice)
        if op is not None and op.copy_src.size:
            self.pool.copy_pages(op.copy_src.astype(np.int32), op.copy_dst.astype(np.int32))
        if op is not None and op.slot_mapping.size:  # the step writes the pool (its K/V)
            at = 0
            for rid, start, n in zip(op.request_ids, op.starts.tolist(), op.num_new.tolist(),
                                     strict=True):
                s = self.slot_of[rid]
                write_values(self.pool, op.slot_mapping[at : at + n],
                             self._values(s, start, start + n, self.epoch))
                at += n
        return op

    # -- admission: loads ----------------------------------------------------------------------

    def _admitted(self, s: int) -> None:
        """Slot ``s`` was admitted or resumed: it waits while a tier load into it is pending."""
        rid = self.ids[s]
        if self.manager.is_loading(rid):
            self.sched[s] = self.manager.num_tokens(rid)
            self.state[s] = LOADING

    def resume(self, choice: int) -> bool:
        before = self._pick(PREEMPTED, choice)
        if not super().resume(choice):
            return False
        assert before is not None
        self._admitted(before)
        return True

    # -- the copies ----------------------------------------------------------------------------

    def take_copies(self) -> tuple[list[Launch], list[Launch]]:
        offload = self.manager.offload
        pending = {id(c): c for c in (*offload.loads, *offload.stores)}
        loads = {id(c) for c in offload.loads}
        started = []
        P = self.manager.page_size
        for key, copy in pending.items():
            if key in self.copy_ops:
                continue
            if key in loads:  # a load into a request's fresh pages
                s = self.slot_of[copy.request_id]
                slots = (copy.pages.astype(np.int64)[:, None] * P + np.arange(P)).reshape(-1)
                op = Launch((copy.request_id,), [copy.first_token], [copy.tokens.size],
                            [0, 0], np.empty(0, dtype=np.int64), slots, kind="transfer")
                self.busy[s] += 1
                self.ops[op] = (None, np.array([s], dtype=np.int64), self.inc[[s]].copy())
                self.counts["loads"] += 1
            else:  # a store reads committed pages
                op = Launch((), [], [], [0], np.empty(0, dtype=np.int64),
                            np.empty(0, dtype=np.int64), kind="transfer", read_pages=copy.pages)
                self.ops[op] = (None, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
                self.counts["stores"] += 1
            self.copy_ops[key] = (copy, op)
            started.append(op)
        ended = [op for key, (_, op) in self.copy_ops.items() if key not in pending]
        for key in [k for k in self.copy_ops if k not in pending]:
            del self.copy_ops[key]
        return started, ended

    def land_copies(self) -> list[tuple[Launch, Any]]:
        report = self.manager.land_copies()
        self.counts["landings"] += 1
        out = []
        for copy, op in self.copy_ops.values():
            landed = None
            if op.request_ids:
                landed = self._landed(copy, op)
            out.append((op, landed))
        self.copy_ops.clear()
        for rid, k in report.items():
            s = self.slot_of.get(rid)
            if s is not None and self.state[s] == LOADING:
                self.sched[s] = self.comm[s] = k
                self.state[s] = RUNNING
        return out

    def _landed(self, load: Any, op: Launch) -> Int64Array:
        """What the load's slots hold now, as the device model's values: a slot that holds
        the current weights' value of the request's tokens in some namespace gives that
        namespace's model value (the request's own, or another tenant's: a failure names it);
        anything else its raw pool value (which no request's tokens imply: the old weights',
        a corrupted chunk, bytes no load reached)."""
        got = read_values(self.pool, op.slot_mapping)
        s = self.ops[op][1][0]
        start, stop = int(op.starts[0]), int(op.starts[0] + op.num_new[0])
        if self.ids[s] != load.request_id or self.specs[s] is None:
            return got  # (the request is gone: nobody reads these slots)
        landed = got.copy()
        tokens = self.tok[s, :stop]
        for ns in (self.specs[s].namespace, *self.config.namespaces):
            key = namespace_key(ns)
            same = got == kv_value_array(epoch_key(key, self.epoch), tokens)[start:]
            landed[same] = kv_value_array(key, tokens)[start:][same]
            if same.all():
                break
        return landed

    def finish(self, op: Launch) -> Sequence[Any]:
        if op.kind != "transfer":
            return super().finish(op)
        _, slots, _ = self.ops.pop(op)
        self._release_ops(slots)
        return []

    # -- the tier and the weights --------------------------------------------------------------

    def corrupt(self, a: int, b: int) -> bool:
        """One stored page's bytes change: in the host tier a chunk of one slot's K/V value
        plus one, on disk one byte of its file (its bytes, not its digest)."""
        slots = sorted(self.tier._slot_of.values())
        files = [] if self.disk is None else sorted(self.disk.path.glob("*.kvb"))
        if not slots and not files:
            return False
        self.counts["corruptions"] += 1
        pick = a % (len(slots) + len(files))
        if pick >= len(slots):
            path: Path = files[pick - len(slots)]
            data = bytearray(path.read_bytes())
            data[b % len(data)] ^= 0x10
            path.write_bytes(bytes(data))
            return True
        slot = slots[pick]
        P = self.manager.page_size
        k = self.tier._slabs["data"][0, slot].view(np.float32)[: P * 4]  # K: [P, 1 head, 4]
        j = b % k.size
        k[j] = (k[j] + 1) % 65536
        return True

    def clear_cache(self) -> bool:
        """A weights update: preempt every request with K/V computed (running ones: their steps
        in flight compute with the old weights too; loading ones with device hits), reset the
        prefix cache, start a new epoch. A request whose only K/V is its pending load stays:
        the reset cancels the load and it recomputes."""
        for s in list(self.order):
            if self.state[s] == RUNNING or (self.state[s] == LOADING and self.comm[s] > 0):
                self._preempt_slot(s)
        self.manager.clear_prefix_cache()
        self.epoch += 1
        self.counts["resets"] += 1
        return True


class OffloadDiskEngine(OffloadEngine):
    """The offload engine with a disk tier below a smaller host tier (``kvmem fuzz --engine
    offload-disk``): the host tier's evictions cascade to disk, loads come from both."""

    name: ClassVar[str] = "offload-disk"
    host_pages: ClassVar[int] = 12
    disk_pages: ClassVar[int] = 48
