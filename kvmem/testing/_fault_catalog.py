"""The fault catalog (:data:`CATALOG`, for ``kvmem fuzz --faults``): each :class:`Fault` is a
bug class switched on in a fuzzed system (see :mod:`kvmem.testing.faults`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvmem.errors import KVMemError
from kvmem.testing._fault_caches import TenantlessCache, WeakKeyCache
from kvmem.testing._one_shot_faults import overwrite_page_entry

if TYPE_CHECKING:
    from kvmem.testing._run import Run

__all__ = ["CATALOG", "Fault"]

Int32Array = npt.NDArray[np.int32]


class Fault:
    """One bug class, switchable on a running fuzzed system.

    Attributes
    ----------
    name: the catalog's key
    bugs: BUGS.md rows it models
    side: ``"kvmem"`` (kvmem skips a protection), ``"engine"`` (the engine misuses kvmem) or
        ``"injected"`` (something breaks state behind everyone's back)
    timeline: whether only an asynchronous device makes it observable (steps in flight, copies
        or transfers landing later)
    engines: the engine adapters it applies to (None: every engine on a KVCacheManager)
    weights: move weights that make it likely (merged over the config's)
    expected: the oracle meant to catch it (informative; the report says which did)
    """

    name: ClassVar[str] = ""
    bugs: ClassVar[tuple[int, ...]] = ()
    side: ClassVar[str] = "kvmem"
    timeline: ClassVar[bool] = False
    engines: ClassVar[tuple[str, ...] | None] = None
    weights: ClassVar[dict[str, float]] = {}
    expected: ClassVar[str] = ""
    injects: ClassVar[bool] = False

    def install(self, run: Run) -> None:
        """Switch the fault on in ``run`` (called once, before the first move)."""

    def inject(self, run: Run, a: int, b: int) -> bool:
        """One injection (the ``inject`` move); returns whether it did anything."""
        return False

    @classmethod
    def describe(cls) -> str:
        return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


class _EngineBug(Fault):
    side = "engine"
    switch: ClassVar[str] = ""

    def install(self, run: Run) -> None:
        run.engine.bugs.add(self.switch)


# kvmem-side: wrappers around a public component -------------------------------------------------


class _FencesFault(Fault):
    """kvmem skips one of its own protections: a switch of ``manager.fault_hooks``."""

    hook: ClassVar[str] = ""
    # Step fences only matter to an engine with steps in flight (the toy engine is synchronous:
    # there, these faults cannot happen, so no check can see them).
    engines = ("manager",)

    def install(self, run: Run) -> None:
        setattr(run.engine.manager.fault_hooks, self.hook, False)


class FenceBypassed(_FencesFault):
    """kvmem frees pages dropped during a step at once, as if no step were in flight: a request
    released (finished, aborted, preempted) while a launched step still reads its pages gives
    them to the next allocation."""

    name = "free_before_step_completes"
    bugs = (1, 5)
    timeline = True
    hook = "hold_dropped_pages"
    expected = "happens_before"
    weights: ClassVar[dict[str, float]] = {"abort": 6, "preempt": 4, "complete": 4}


class FenceLosesReferences(_FencesFault):
    """The fence gets the step's completion but drops the references it held instead of freeing
    them (the deferred-free path never frees): pages leak."""

    name = "fence_drops_references"
    bugs = (2,)
    timeline = True
    hook = "retire_frees"
    expected = "refcounts"
    weights: ClassVar[dict[str, float]] = {"abort": 6, "preempt": 4}


class CowSourceUnfenced(_FencesFault):
    """kvmem does not hold a copy-on-write source for the step that copies it: a drop of
    references that includes a source whose copy has not landed is freed at once, and the page
    is reused before the copy lands."""

    name = "cow_source_reused_before_copy"
    bugs = (9, 14)
    timeline = True
    expected = "happens_before"
    weights: ClassVar[dict[str, float]] = {"fork": 10, "abort": 6, "preempt": 4, "copy": 1,
                                           "complete": 4, "launch": 12}

    def install(self, run: Run) -> None:
        def unheld(pages: Int32Array) -> bool:
            sources = run.pending_copy_sources()
            return bool(sources.size and np.isin(pages, sources).any())

        run.engine.manager.fault_hooks.free_at_once = unheld


class WeakPrefixKey(Fault):
    """The prefix cache keys and confirms pages by a weak digest of their tokens (here each
    token mod 2): a different prefix hits and a request reads another prompt's K/V."""

    name = "weak_prefix_key"
    bugs = (10,)
    expected = "reads"

    def install(self, run: Run) -> None:
        mgr = run.engine.manager
        if mgr.cache is not None:
            mgr.cache = WeakKeyCache(mgr.cache)


class TenantlessCacheKey(Fault):
    """The prefix cache's key misses the tenant (namespace): another tenant's pages hit. kvmem
    still records namespace-qualified tags, so its own check before decode sees it."""

    name = "tenantless_cache_key"
    bugs = (11,)
    expected = "verify"

    def install(self, run: Run) -> None:
        mgr = run.engine.manager
        if mgr.cache is not None:
            mgr.cache = TenantlessCache(mgr.cache)


# kvmem-side, transfers: switches of the disaggregated engine's sender and receiver -----------


class _TransferFault(Fault):
    """kvmem's transfer room skips one of its own protections: a switch of the ``disagg``
    engine's :class:`~kvmem.transfer.TransferFaults` (its sender's and its receiver's)."""

    switch: ClassVar[str] = ""
    timeline = True
    engines = ("disagg",)

    def install(self, run: Run) -> None:
        setattr(getattr(run.engine, "faults"), self.switch, False)  # noqa: B009 (DisaggEngine)


class StaleTransferReference(_TransferFault):
    """The sender offers page ids with no lifetime behind them (no lease, every confirm "ok"):
    the prefill side reuses the pages while the decode side reads them, and a decode step uses
    bytes of a lifetime that had ended (vllm#52234: the previous prompt's answer, HTTP 200)."""

    name = "stale_transfer_reference"
    bugs = (5, 9)
    switch = "lease_pages"
    expected = "transfer_lifetime"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "transfer": 6}


class LateWriteAfterAbort(_TransferFault):
    """The receiver frees an aborted load's destination pages at the abort, while its read is
    still in flight: the pages go to another request and the late write lands in them
    (vllm PR #56104, sglang#24527)."""

    name = "late_write_after_abort"
    bugs = (1,)
    switch = "hold_until_final"
    expected = "happens_before"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "abort": 8}


class CommitAfterLeaseExpiry(_TransferFault):
    """The receiver commits a load on its digests without waiting for the sender's answer: a
    lease that expired before the read completed goes unnoticed, and decode uses bytes of
    pages the sender had let go (8 of 42 requests in aws-do-eks PR #84)."""

    name = "commit_after_lease_expiry"
    bugs = (5, 9)
    switch = "wait_for_answer"
    expected = "transfer_lifetime"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "expire": 4}


class DuplicatedCompletion(_TransferFault):
    """The sender keeps a transfer open after its confirm: a duplicated confirm (or the lease
    term) ends its lease a second time."""

    name = "duplicated_completion"
    bugs = (3,)
    switch = "end_lease_once"
    expected = "kvmem_error"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "notice": 12}


class LostCompletion(_TransferFault):
    """The sender never expires a lease: when the confirm is lost, the leased pages are
    stranded (vllm#46283, PR #50754)."""

    name = "lost_completion"
    bugs = (2,)
    switch = "expire_leases"
    expected = "leases"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "notice": 12}


class KilledSenderReadAsDone(_TransferFault):
    """The receiver takes a failed read for a finished one: the prefill process dies mid-
    transfer and its request decodes from pages no byte reached."""

    name = "killed_sender_read_as_done"
    bugs = (8,)
    switch = "fail_failed_reads"
    expected = "reads"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "kill": 4}


class RecomputeWithSharedPages(_TransferFault):
    """A load that failed is committed into the prefix cache anyway and its request recomputed
    through a fresh admission: the recompute, and any request sharing the prefix, hits the
    failed pages (vllm#49250)."""

    name = "recompute_with_shared_pages"
    bugs = (8,)
    switch = "commit_checked_only"
    expected = "transfer_lifetime"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "kill": 2, "expire": 3}


# kvmem-side, tiers: switches of the offload engine's tiers ----------------------------------


class _OffloadFault(Fault):
    """kvmem's offload skips one of its own protections: a switch of the ``offload`` engine's
    :class:`~kvmem.transfer.OffloadFaults` (``manager.offload.faults``)."""

    switch: ClassVar[str] = ""
    timeline = True
    engines = ("offload", "offload-disk")

    def install(self, run: Run) -> None:
        setattr(run.engine.manager.offload.faults, self.switch, True)


class LoadAfterReuse(_OffloadFault):
    """A deferred load from the host tier neither leases nor marks its destination pages: its
    request is aborted (or preempted) before the load lands, the pages go to another request,
    and the late load writes into them (vllm#47282)."""

    name = "tier_load_after_reuse"
    bugs = (9,)
    switch = "load_without_fence"
    expected = "happens_before"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "abort": 6, "clear": 0, "corrupt": 0,
                                           "fork": 0, "hook": 0}


class StoreAfterFree(_OffloadFault):
    """A deferred write-through store holds no lease on the pages it reads: they are evicted
    and reused before the copy lands, and the tier stores another prompt's K/V under this
    prefix's key (vllm#45704)."""

    name = "tier_store_after_free"
    bugs = (9,)
    switch = "store_without_fence"
    expected = "happens_before"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "transfer": 1, "clear": 0.05}


class CorruptedTierPageServed(_OffloadFault):
    """The host tier serves a stored page without checking its digest: a page whose bytes
    changed in host memory is loaded as the prompt's K/V."""

    name = "tier_digest_skipped"
    bugs = (22,)
    timeline = False
    switch = "skip_digest"
    expected = "reads"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "corrupt": 6, "clear": 0.05}


class NamespaceBlindTier(_OffloadFault):
    """Tier lookups ignore the namespace (keys chain from the root of no tenant, a hit's tenant
    is not confirmed): a tenant's prompt loads another tenant's stored pages."""

    name = "tier_namespace_blind"
    bugs = (11,)
    timeline = False
    switch = "namespace_blind"
    expected = "reads"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "clear": 0, "corrupt": 0, "abort": 0,
                                           "fork": 0, "hook": 0, "preempt": 0}


class ResetKeepsPendingCopies(_OffloadFault):
    """A prefix-cache reset for new weights lets the copies in flight finish: a pending load
    lands the old weights' K/V into a request that computes with the new ones, and a pending
    store puts it into the tier (vllm#57727)."""

    name = "tier_reset_keeps_pending"
    bugs = (20,)
    switch = "reset_keeps_pending"
    expected = "reads"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "clear": 1, "transfer": 2,
                                           "corrupt": 0, "abort": 0, "fork": 0, "preempt": 0,
                                           "hook": 0}


class PartialRestore(_OffloadFault):
    """A load writes every page of its run but the last, and reports the whole run loaded: the
    request reads a page no byte of its prefix reached (sglang#30057)."""

    name = "tier_partial_restore"
    bugs = (21,)
    timeline = False
    switch = "partial_restore"
    expected = "reads"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "clear": 0.05, "corrupt": 0.2}


# engine-side: switches the adapters honour --------------------------------------------------


class RetireAtLaunch(_EngineBug):
    """The engine retires a step's fence when it launches the step (a synchronous engine's habit
    under overlap scheduling): the fence no longer holds what is dropped during the step."""

    name = "retire_at_launch"
    bugs = (1, 5)
    timeline = True
    switch = "retire_at_launch"
    engines = ("manager",)
    expected = "fences"


class CompletionLost(_EngineBug):
    """The engine's deferred-free path never gets the step's completion signal: the step's
    fence is never retired and what it holds leaks forever."""

    name = "fence_completion_lost"
    bugs = (2,)
    timeline = True
    switch = "drop_completion"
    engines = ("manager",)
    expected = "fences"


class CommitAtLaunch(_EngineBug):
    """The engine commits a step's tokens when it schedules the step, before the K/V lands: the
    full pages enter the prefix cache and a request admitted meanwhile reuses pages whose
    writes have not landed (same-step prefix hit)."""

    name = "prefix_hit_before_write_lands"
    bugs = (6,)
    timeline = True
    switch = "commit_at_launch"
    engines = ("manager",)
    expected = "landed_hit"
    weights: ClassVar[dict[str, float]] = {"submit": 12, "abort": 4, "finish": 6}


class TransferUnfenced(_EngineBug):
    """A KV transfer into a request's pages (P/D disaggregation) holds no fence: the request is
    aborted mid-transfer, its pages go to another request, and the late write lands in them."""

    name = "transfer_without_fence"
    bugs = (1, 9)
    timeline = True
    switch = "no_transfer_fence"
    engines = ("manager",)
    expected = "happens_before"
    weights: ClassVar[dict[str, float]] = {"receive": 10, "abort": 8, "transfer": 1, "submit": 8}


class CommitOnAbort(_EngineBug):
    """On abort the engine commits everything it scheduled for the request, landed or not,
    before releasing it: pages with K/V still in flight enter the prefix index."""

    name = "commit_on_abort"
    bugs = (8,)
    timeline = True
    switch = "commit_on_abort"
    engines = ("manager",)
    expected = "landed_hit"
    weights: ClassVar[dict[str, float]] = {"abort": 8, "submit": 12}


class SkipCowCopy(_EngineBug):
    """The engine ignores the copy-on-write copies a step asks for: a forked request writes its
    own tail page, which never received the shared tokens' K/V."""

    name = "cow_copy_skipped"
    bugs = (14, 16)
    switch = "skip_cow_copy"
    engines = ("manager", "toy")
    expected = "reads"
    weights: ClassVar[dict[str, float]] = {"fork": 10}


class NamespaceDropped(_EngineBug):
    """The engine admits every request without its tenant salt (namespace): requests of
    different tenants share prefix pages."""

    name = "tenant_salt_dropped"
    bugs = (11,)
    switch = "namespace_dropped"
    engines = ("manager", "toy", "vllm", "vllm-async")
    expected = "reads"


class LeakOnAbort(_EngineBug):
    """The engine's abort path forgets the request without releasing it in kvmem: its pages
    leak."""

    name = "leak_on_abort"
    bugs = (2, 8)
    switch = "leak_on_abort"
    engines = ("manager", "toy", "vllm", "vllm-async")
    expected = "requests"
    weights: ClassVar[dict[str, float]] = {"abort": 8}


class ReleaseRetried(_EngineBug):
    """A hook raises during release; the engine takes the HookError for a failed release and
    releases again (two release paths for one request)."""

    name = "release_retried_on_hook_error"
    bugs = (3,)
    switch = "hook_error_retried"
    engines = ("manager",)
    expected = "kvmem_error"
    weights: ClassVar[dict[str, float]] = {"hook": 10, "abort": 6}


class StaleBlockTable(_EngineBug):
    """The engine hands its kernels a block table from a reused buffer whose columns past each
    request's pages still hold an earlier request's pages."""

    name = "stale_block_table"
    bugs = (13,)
    switch = "stale_block_table"
    engines = ("manager",)
    expected = "verify"


class WrongChunkSlice(_EngineBug):
    """Chunked prefill hands the kernel the wrong slice of the page table (a request's first two
    pages swapped)."""

    name = "wrong_chunk_slice"
    bugs = (12,)
    switch = "wrong_chunk_slice"
    engines = ("manager",)
    expected = "verify"


class DraftLengthsKept(_EngineBug):
    """After a speculative step the engine gives kvmem back the rejected drafts but its own
    lengths still count them: the request's next step hands the kernel lengths that read the
    rejected drafts' slots after the rollback."""

    name = "draft_lengths_kept"
    bugs = (12,)
    switch = "draft_lengths_kept"
    engines = ("manager-spec",)
    expected = "verify"


class RejectedDraftsCommitted(_EngineBug):
    """The engine takes the verifier's rejected drafts for accepted: it commits the true tokens
    over slots that hold the drafts' K/V, and a prefix hit or a fork reads a rejected draft's
    slot."""

    name = "rejected_drafts_committed"
    bugs = (8,)
    switch = "commit_rejected_drafts"
    engines = ("manager-spec",)
    expected = "reads"


# injected: something breaks behind everyone's back ----------------------------------------------


def _victim(run: Run, a: int) -> Any:
    from kvmem.testing._fuzz_protocol import stable_pick

    running = run.engine.manager.running
    return running[stable_pick(a, running)] if running else None


def _victim_page(run: Run, a: int, b: int) -> Any:
    """One page of a running request, as a 1-element array (None when nothing runs)."""
    rid = _victim(run, a)
    if rid is None:
        return None
    pages = run.engine.manager.pages_of(rid)
    return pages[b % pages.size : b % pages.size + 1]


class SecondReleasePath(Fault):
    """A second release path drops a running request's reference to one of its pages (the
    first path, kvmem's, drops it again later)."""

    name = "second_release_path"
    bugs = (3, 5)
    side = "injected"
    injects = True
    expected = "refcounts"

    def inject(self, run: Run, a: int, b: int) -> bool:
        page = _victim_page(run, a, b)
        if page is not None:
            run.engine.manager.allocator.free(page)
        return page is not None


class RefcountOverincrement(Fault):
    """A page gains a holder nobody will release (fork plus sliding window counted a page
    twice)."""

    name = "refcount_overincrement"
    bugs = (4, 15)
    side = "injected"
    injects = True
    expected = "refcounts"

    def inject(self, run: Run, a: int, b: int) -> bool:
        page = _victim_page(run, a, b)
        if page is not None:
            run.engine.manager.allocator.share(page)
        return page is not None


class StalePageTableEntry(Fault):
    """A request's page-table entry names another request's page (a stale or misplaced entry
    the kernel would read)."""

    name = "stale_page_table_entry"
    bugs = (12, 13)
    side = "injected"
    injects = True
    expected = "verify"

    def inject(self, run: Run, a: int, b: int) -> bool:
        mgr = run.engine.manager
        running = mgr.running
        if len(running) < 2:
            return False
        victim = _victim(run, a)
        other = _victim(run, b)
        if other == victim:
            return False
        pos = b % max(1, -(-mgr.num_tokens(victim) // mgr.page_size))
        page = int(mgr.pages_of(other)[0])
        try:
            if int(mgr.pages_of(victim)[pos]) == page:
                return False
            overwrite_page_entry(mgr, victim, pos, page)
        except (KVMemError, IndexError):
            return False
        return True


CATALOG: dict[str, Fault] = {f.name: f for f in (
    FenceBypassed(), CowSourceUnfenced(), RetireAtLaunch(), CompletionLost(), CommitAtLaunch(),
    TransferUnfenced(), CommitOnAbort(), FenceLosesReferences(), SkipCowCopy(),
    NamespaceDropped(), TenantlessCacheKey(), WeakPrefixKey(), LeakOnAbort(), ReleaseRetried(),
    SecondReleasePath(), RefcountOverincrement(), StalePageTableEntry(), StaleBlockTable(),
    WrongChunkSlice(), StaleTransferReference(), LateWriteAfterAbort(), CommitAfterLeaseExpiry(),
    DuplicatedCompletion(), LostCompletion(), KilledSenderReadAsDone(), RecomputeWithSharedPages(),
    LoadAfterReuse(), StoreAfterFree(), CorruptedTierPageServed(), NamespaceBlindTier(),
    ResetKeepsPendingCopies(), PartialRestore(), DraftLengthsKept(), RejectedDraftsCommitted(),
)}
