"""A small continuous-batching generation loop on kvmem pages, written to be copied.

One :meth:`Engine.step` does what a serving engine does per iteration::

    admit      waiting requests, oldest first, while the manager can hold their prompts
               (prefix reuse: pages of a shared system prompt are mapped, not recomputed)
    schedule   every running request gets tokens within a budget: 1 if it is decoding, a chunk
               of its remaining prompt if it is still prefilling (chunked prefill)
    reserve    manager.reserve(ids, num_tokens) -> slot_mapping + CSR for the packed batch
               (no preemption: if the running requests outgrow the pool, step() raises
               OutOfPagesError and allocates nothing)
    verify     manager.verify(ids, step): the integrity check on the very arrays the kernel
               reads; a failing request is aborted (and released) and dropped from the batch,
               and so is a request the caller aborted (:meth:`Engine.abort`): one abort path
    forward    one packed forward of the model: K/V written to pages, attention over pages,
               logits only at each request's last token
    commit     manager.commit_batch(ids, tokens): the fed tokens' KV is in pages (full pages
               become reusable prefixes)
    sample     greedy; a request whose prompt is complete appends its next token
    release    finished requests give their pages back

Greedy sampling keeps the loop deterministic, so a run can be compared token for token with
``model.generate(do_sample=False)``, or with another run of the same steps. "The same steps"
matters: a request's logits depend, in their last bits, on the other rows of its batch (the
model's matmuls pick kernels and summation orders by the batch's shape), so two runs agree
token for token only while they run the same batches. A run where the integrity check aborts
a request is compared with a run where the caller aborts it at the same step
(:meth:`Engine.abort`), never with a run where it kept running. Time spent in each phase is
recorded per step (:class:`StepTiming`) so the share of kvmem's own work can be measured.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import torch

from kvmem._validate import integer, is_hashable, show, token_array
from kvmem.allocator import namespace_bytes
from kvmem.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    KVMemError,
    OutOfPagesError,
)
from kvmem.integrations._kvbatch import KVBatch, PagedModel, check_vocab, require_manager_fits

if TYPE_CHECKING:
    from kvmem.manager import KVCacheManager, StepMetadata, VerifyReport

__all__ = [
    "Engine",
    "Request",
    "StepTiming",
]

log = logging.getLogger(__name__)

Status = Literal["waiting", "running", "finished", "aborted"]


@dataclass(eq=False)
class Request:
    """One generation request: the engine's own object (the manager only sees its id).

    Parameters
    ----------
    request_id:
        Any hashable id, unique among live requests.
    prompt_ids:
        The prompt's token ids.
    max_new_tokens:
        Generate at most this many tokens.
    namespace:
        Tenant / adapter / cache salt: pages are shared only within one namespace.
    stop_token_ids:
        Generation ends after any of these is produced (it is kept in ``output_ids``).
    """

    request_id: Hashable
    prompt_ids: Sequence[int]
    max_new_tokens: int = 64
    namespace: Hashable | None = None
    stop_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: Status = "waiting"
    abort_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV was in pages at admission
    num_host_tokens: int = 0  # of those, the tokens loaded from the manager's host tier
    num_disk_tokens: int = 0  # ... and from its disk tier
    loading: bool = False  # a deferred tier load into its pages has not landed
    num_computed: int = 0  # tokens (prompt + fed outputs) whose KV is in pages
    queued_at: float | None = None  # time.perf_counter() when the engine took the request
    first_token_at: float | None = None  # time.perf_counter() when its first token was sampled

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds (queued to first sampled token); None before it."""
        if self.queued_at is None or self.first_token_at is None:
            return None
        return self.first_token_at - self.queued_at

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def next_tokens(self, limit: int) -> list[int]:
        """The next tokens to feed: up to ``limit`` of the prompt, or the newest output token."""
        done = len(self.prompt_ids)
        if self.num_computed < done:
            return list(self.prompt_ids[self.num_computed : min(done, self.num_computed + limit)])
        return self.output_ids[self.num_computed - done : self.num_computed - done + limit]


class StepTiming(NamedTuple):
    """Seconds spent in each phase of one step, and its size.

    ``kvmem`` work is ``admit + reserve + verify + commit`` (allocation, prefix matching,
    metadata, the integrity check); ``forward`` is the model (including page writes and paged
    attention); ``other`` is the engine's own Python (scheduling, sampling, bookkeeping).
    """

    batch_size: int
    num_tokens: int
    num_decode: int
    admit: float
    reserve: float
    verify: float
    forward: float
    commit: float
    other: float

    @property
    def total(self) -> float:
        return self.admit + self.reserve + self.verify + self.forward + self.commit + self.other

    @property
    def kvmem(self) -> float:
        return self.admit + self.reserve + self.verify + self.commit


def _keep_requests(step: StepMetadata, keep: np.ndarray) -> tuple[np.ndarray, ...]:
    """Drop aborted requests from a step's packed metadata.

    Returns
    -------
    (slot_mapping, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, token_keep)
        The kept requests' arrays (shapes as in ``StepMetadata``) and ``token_keep`` ``[T]``,
        bool: which packed tokens survive.
    """
    qo_len = np.diff(step.qo_indptr)
    kv_len = np.diff(step.kv_indptr)
    token_keep = np.repeat(keep, qo_len)
    qo_indptr = np.zeros(int(keep.sum()) + 1, dtype=np.int32)
    np.cumsum(qo_len[keep], out=qo_indptr[1:])
    kv_indptr = np.zeros_like(qo_indptr)
    np.cumsum(kv_len[keep], out=kv_indptr[1:])
    kv_indices = step.kv_indices[np.repeat(keep, kv_len)]
    return (
        step.slot_mapping[token_keep],
        qo_indptr,
        kv_indptr,
        kv_indices,
        step.kv_last_page_len[keep],
        token_keep,
    )


class Engine:
    """Continuous batching of greedy generation over a :class:`PagedCausalLM` and a manager.

    Parameters
    ----------
    lm:
        The model on its page pool (a :class:`~kvmem.integrations.hf.PagedCausalLM`).
    manager:
        Owns the pages of ``lm.pool`` (same ``num_pages`` and ``page_size``).
    max_num_seqs:
        Most requests running at once.
    max_num_batched_tokens:
        Token budget of one forward (decode tokens first, then prefill chunks).
    chunk_size:
        Largest prefill chunk of one request in one step.
    """

    def __init__(
        self,
        lm: PagedModel,
        manager: KVCacheManager,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        chunk_size: int = 256,
    ) -> None:
        if not (hasattr(getattr(lm, "pool", None), "spec") and callable(getattr(lm, "forward",
                                                                             None))):
            raise ArgumentTypeError(f"lm={show(lm)}: expected a PagedModel (.pool, a PagePool, "
                                    "and .forward), e.g. PagedCausalLM.build(model, num_pages)")
        from kvmem.manager import KVCacheManager

        if not isinstance(manager, KVCacheManager):
            raise ArgumentTypeError(f"manager={show(manager)}: expected a kvmem.KVCacheManager")
        require_manager_fits(manager, lm, "build both from the same numbers")
        max_num_seqs = integer(max_num_seqs, "max_num_seqs", minimum=1)
        max_num_batched_tokens = integer(max_num_batched_tokens, "max_num_batched_tokens",
                                         minimum=1)
        chunk_size = integer(chunk_size, "chunk_size", minimum=1)
        self.lm = lm
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.done: list[Request] = []
        self.timings: list[StepTiming] = []
        self._aborts: dict[Hashable, str] = {}  # running requests to abort at the next verify

    # -- the public loop ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; it is admitted at the start of a later step.

        Raises
        ------
        ArgumentTypeError, ArgumentError, ConfigError
            The request is malformed (its id, prompt, ``max_new_tokens``, ``stop_token_ids``
            or ``namespace``), holds token ids outside the model's vocabulary, cannot fit in
            the manager's pages (a prompt, beside the watermark that admission keeps free),
            has already run, or its id is waiting or running here.
            Nothing is queued.
        """
        self._check_request(request)
        request.status = "waiting"
        request.queued_at = time.perf_counter()
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join a request the manager already holds, admitted outside this engine (a
        :class:`~kvmem.transfer.Receiver` that loaded its prompt's pages from another
        process), to the running batch. It resumes from ``manager.num_committed(request_id)``
        computed tokens: the engine prefills the rest of its prompt, then decodes.

        Raises
        ------
        ArgumentError
            The request is malformed (as :meth:`add_request` says), the manager does not hold
            it, holds slots it reserved and did not commit, or holds tokens that are not the
            leading tokens of its prompt; or the engine runs ``max_num_seqs`` requests.
            Nothing changes.
        """
        self._check_request(request)
        mgr, rid = self.manager, request.request_id
        if rid not in mgr.running:
            raise ArgumentError(f"request {rid!r} is not running in the manager; admit it there "
                                "first (or queue it with add_request)")
        computed = mgr.num_committed(rid)
        prompt = token_array(request.prompt_ids, "prompt_ids")
        held = mgr.tokens_of(rid)
        if (mgr.num_tokens(rid) != computed or computed > prompt.size
                or not np.array_equal(held, prompt[:computed])):
            raise ArgumentError(
                f"request {rid!r}: the manager holds {mgr.num_tokens(rid)} slots with "
                f"{computed} tokens committed, which must be the first tokens of its "
                f"{prompt.size}-token prompt with nothing reserved beyond them")
        if len(self.running) >= self.max_num_seqs:
            raise ArgumentError(f"the engine already runs max_num_seqs={self.max_num_seqs} "
                                f"requests; add request {rid!r} after one has finished")
        request.status = "running"
        request.num_cached_tokens = request.num_computed = computed
        request.queued_at = time.perf_counter()
        self.running.append(request)

    def _check_request(self, request: Any) -> None:
        """Refuse (a KVMemError naming what is wrong) a request this engine cannot queue."""
        if not isinstance(request, Request):
            raise ArgumentTypeError(f"request={show(request)}: expected an engine Request.")
        if not is_hashable(request.request_id):
            raise ArgumentTypeError(f"request_id={show(request.request_id)}: expected a "
                                    "hashable id (a str or an int).")
        integer(request.max_new_tokens, "max_new_tokens")
        prompt = token_array(request.prompt_ids, "prompt_ids")  # ints in 0..INT32_MAX, 1-D
        if request.max_new_tokens < 1 or not prompt.size:
            raise ConfigError(
                f"request {request.request_id!r}: needs a non-empty prompt and max_new_tokens "
                f">= 1, got {prompt.size} prompt tokens and max_new_tokens="
                f"{request.max_new_tokens}"
            )
        if request.status != "waiting" or request.output_ids or request.num_computed:
            raise ArgumentError(
                f"request {request.request_id!r} has already run (status {request.status!r}, "
                f"{len(request.output_ids)} tokens generated); queue a new Request")
        vocab_size = getattr(self.lm, "vocab_size", None)  # PagedCausalLM's; None: unknown
        check_vocab(int(prompt.min()), int(prompt.max()),
                    vocab_size if isinstance(vocab_size, int) else None,
                    f"request {request.request_id!r}: prompt_ids")
        # A Collection, not any Iterable: checking an iterator here would use it up, and the
        # loop tests `token in stop_token_ids` after every token.
        if isinstance(request.stop_token_ids, (str, bytes)) or not isinstance(
                request.stop_token_ids, Collection):
            raise ArgumentTypeError(f"stop_token_ids={show(request.stop_token_ids)}: expected "
                                    "a tuple of token ids, e.g. (tokenizer.eos_token_id,)")
        for token in request.stop_token_ids:
            integer(token, "stop_token_ids", minimum=0)
        namespace_bytes(request.namespace)  # None, str, int, bytes or a tuple, or raises
        mgr = self.manager
        total = prompt.size + request.max_new_tokens
        most = min(mgr.max_pages_per_seq, mgr.num_pages) * mgr.page_size
        if total > most:
            raise ArgumentError(
                f"request {request.request_id!r}: {prompt.size} prompt + "
                f"{request.max_new_tokens} new tokens may need {-(-total // mgr.page_size)} "
                f"pages, more than a request can map here (max_pages_per_seq="
                f"{mgr.max_pages_per_seq}, num_pages={mgr.num_pages}); shorten it, lower "
                "max_new_tokens or give the manager more pages")
        prompt_pages = -(-prompt.size // mgr.page_size)
        if prompt_pages + mgr.watermark_pages > mgr.num_pages:  # can_admit would never pass
            raise ArgumentError(
                f"request {request.request_id!r}: its {prompt.size}-token prompt needs "
                f"{prompt_pages} pages and admission keeps {mgr.watermark_pages} of the "
                f"manager's {mgr.num_pages} pages free (its watermark), so it could never be "
                "admitted; shorten it, or give the manager more pages or a lower watermark")
        if any(r.request_id == request.request_id for r in (*self.waiting, *self.running)):
            raise ArgumentError(f"request_id={show(request.request_id)} is already waiting or "
                                "running in this engine; give each request its own id.")

    def abort(self, request_id: Hashable, reason: str = "aborted by the caller") -> None:
        """Abort a request: a waiting one leaves the queue now; a running one is aborted at the
        verify point of the next step, where the integrity check aborts requests (after that
        step is scheduled, before its forward), and its pages are released there.

        So a caller's abort and the check's abort change a run in exactly the same way, and a
        run whose request the check aborted can be compared token for token with a fault-free
        run that aborts the same request at the same step.

        Raises
        ------
        ArgumentError
            No waiting or running request has this id.
        """
        if not isinstance(reason, str):
            raise ArgumentTypeError(f"reason={show(reason)}: expected a str.")
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.status, r.abort_reason = "aborted", reason
                self.done.append(r)
                return
        if not any(r.request_id == request_id for r in self.running):
            raise ArgumentError(
                f"request_id={show(request_id)}: no waiting or running request has this id "
                f"(running: {[r.request_id for r in self.running][:8]})."
            )
        self._aborts[request_id] = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Request]:
        """Run one iteration of the loop (see the module docstring).

        Returns
        -------
        list[Request]
            Requests that finished or were aborted during this step.

        Raises
        ------
        OutOfPagesError
            The running requests need more pages than are free: the engine does not preempt.
            Nothing was allocated; the requests stay running.
        """
        t0 = time.perf_counter()
        self._land()
        self._admit()
        t1 = time.perf_counter()
        batch, feeds = self._schedule()
        if not batch:
            return []
        ids = [r.request_id for r in batch]
        t2 = time.perf_counter()
        step, kv = self._reserve(ids, feeds)
        t3 = time.perf_counter()
        report = self._verify(ids, step, kv)
        t4 = time.perf_counter()
        batch, feeds, kv, ended = self._drop_aborted(report, batch, feeds, step, kv)
        if not batch:
            return ended
        input_ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64)
        last = kv.qo_indptr[1:].long() - 1
        t5 = time.perf_counter()
        next_ids = self.lm.forward(input_ids, kv, last).argmax(dim=-1).tolist()
        t6 = time.perf_counter()
        if self.manager.offload is not None:  # the prefill rate it weighs loads against
            prefilled = sum(len(f) for r, f in zip(batch, feeds, strict=True)
                            if r.num_computed < len(r.prompt_ids))
            if prefilled:
                self.manager.offload.observe_prefill(prefilled, t6 - t5)
        self._commit(batch, feeds)
        t7 = time.perf_counter()
        num_decode, finished = self._sample(batch, feeds, next_ids)
        t8 = time.perf_counter()
        self.timings.append(
            StepTiming(
                batch_size=len(batch),
                num_tokens=int(input_ids.numel()),
                num_decode=num_decode,
                admit=t1 - t0,
                reserve=t3 - t2,
                verify=t4 - t3,
                forward=t6 - t5,
                commit=t7 - t6,
                other=(t2 - t1) + (t5 - t4) + (t8 - t7),
            )
        )
        return ended + finished

    def run(
        self,
        arrivals: dict[int, Sequence[Request]] | None = None,
        before_step: Callable[[int, Engine], None] | None = None,
    ) -> list[Request]:
        """Step until every request has ended.

        Parameters
        ----------
        arrivals:
            ``arrivals[s]`` are added just before step ``s`` (staggered arrivals).
        before_step:
            Called as ``before_step(s, engine)`` after step ``s``'s arrivals and before the
            step runs (fault drills, logging, admission control). Without it, the steps in
            which nothing is waiting or running until the next arrival are skipped (they do
            nothing), so arrivals far apart cost no idle loop.

        Returns
        -------
        list[Request]
            Every request that ended, in the order it ended.
        """
        if before_step is not None and not callable(before_step):
            raise ArgumentTypeError(f"before_step={show(before_step)}: expected a callable "
                                    "before_step(step, engine), or None")
        if arrivals is not None and not isinstance(arrivals, Mapping):
            raise ArgumentTypeError(f"arrivals={show(arrivals)}: expected a dict of step -> "
                                    "requests, e.g. {0: [Request(...)], 5: [...]}")
        pending = dict(arrivals or {})
        for step, requests in pending.items():
            integer(step, "arrival step")
            if isinstance(requests, Request) or not isinstance(requests, Sequence):
                raise ArgumentTypeError(f"arrivals[{step!r}]={show(requests)}: expected a list "
                                        "of Requests")
            for r in requests:
                self._check_request(r)
        if any(k < 0 for k in pending):
            raise ConfigError(f"arrival steps must be >= 0, got {sorted(pending)[:8]}")
        ids = [r.request_id for rs in pending.values() for r in rs]
        if len(set(ids)) != len(ids):
            raise ArgumentError(f"arrivals list a request id twice ({ids[:8]}...); give each "
                                "request its own id")
        s = 0
        while self.has_work() or pending:
            if before_step is None and not self.has_work() and s not in pending:
                s = min(pending)  # idle until the next arrival
            for r in pending.pop(s, ()):
                self.add_request(r)
            if before_step is not None:
                before_step(s, self)
            self.step()
            s += 1
        return list(self.done)

    # -- the phases ------------------------------------------------------------------------------

    def _admit(self) -> None:
        mgr = self.manager
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not mgr.can_admit(r.prompt_ids, r.namespace):
                if not self.running:
                    raise KVMemError(
                        f"request {r.request_id!r} ({len(r.prompt_ids)} prompt tokens) cannot "
                        "be admitted even with no request running; give the manager more pages"
                    )
                break  # FIFO: wait for running requests to finish
            res = mgr.admit(r.request_id, r.prompt_ids, r.namespace)
            self.waiting.popleft()
            r.status = "running"
            r.num_cached_tokens = r.num_computed = res.num_cached_tokens
            r.num_host_tokens = res.num_host_pages * mgr.page_size
            r.num_disk_tokens = res.num_disk_pages * mgr.page_size
            r.loading = res.loading
            self.running.append(r)

    def _land(self) -> None:
        """Land the manager's deferred tier copies; requests whose loads ended are ready."""
        landed = self.manager.land_copies()
        for r in self.running:
            if r.request_id in landed:
                r.loading = False
                r.num_computed = landed[r.request_id]

    def _schedule(self) -> tuple[list[Request], list[list[int]]]:
        """Decode tokens first (one per decoding request), then prefill chunks, in budget;
        a request whose tier load has not landed waits."""
        budget = self.max_num_batched_tokens
        decoding = [r for r in self.running if r.num_computed >= len(r.prompt_ids)]
        prefilling = [r for r in self.running
                      if r.num_computed < len(r.prompt_ids) and not r.loading]
        batch, feeds = [], []
        for r in decoding[:budget]:
            batch.append(r)
            feeds.append(r.next_tokens(1))
        budget -= len(batch)
        for r in prefilling:
            if budget <= 0:
                break
            fed = r.next_tokens(min(self.chunk_size, budget))
            batch.append(r)
            feeds.append(fed)
            budget -= len(fed)
        return batch, feeds

    def _reserve(self, ids: list[Hashable], feeds: list[list[int]]) -> tuple[StepMetadata, KVBatch]:
        """Slots for every fed token (copy-on-write done), and the batch's kernel metadata."""
        lens = {len(f) for f in feeds}
        # A uniform step (every decode step) passes an int: the manager's vectorized fast path.
        try:
            step = self.manager.reserve(ids, lens.pop() if len(lens) == 1 else
                                        [len(f) for f in feeds])
        except OutOfPagesError as exc:  # admission looked at prompts only; growth outran it
            raise OutOfPagesError(
                exc.num_requested, exc.num_free,
                f"The {len(ids)} running requests outgrew the pool, and this engine does not "
                "preempt (it admits a request when its prompt fits): give the manager pages "
                "for max_num_seqs requests of prompt + max_new_tokens tokens, or lower "
                "max_num_seqs or max_new_tokens.") from None
        if step.copy_src.size:  # copy-on-write, when the manager has no pool to do it itself
            src, dst = torch.from_numpy(step.copy_src), torch.from_numpy(step.copy_dst)
            self.lm.pool.copy_pages(src, dst)
        kv = KVBatch.from_arrays(
            self.lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr, step.kv_indices,
            step.kv_last_page_len,
        )
        return step, kv

    def _verify(self, ids: list[Hashable], step: StepMetadata, kv: KVBatch) -> VerifyReport:
        """Check the very metadata the kernel reads: on a CPU pool the tensors share the step's
        numpy memory (zero-copy); on a device pool, check the device tensors there."""
        if kv.kv_indices.device.type == "cpu":
            return self.manager.verify(ids, step)
        # the CSR, slot mapping and lengths the kernels read, checked on their device
        return self.manager.verify(
            ids, metadata={k: v for k, v in kv._asdict().items() if k != "pool"}
        )

    def _drop_aborted(
        self,
        report: VerifyReport,
        batch: list[Request],
        feeds: list[list[int]],
        step: StepMetadata,
        kv: KVBatch,
    ) -> tuple[list[Request], list[list[int]], KVBatch, list[Request]]:
        """End the requests the check aborted (the manager released them) and those the caller
        aborted (released here, at the same point); the rest of the batch proceeds.

        Returns the kept requests, their feeds and metadata, and the requests that ended.
        """
        ended: list[Request] = []
        aborted = dict(report.aborted)  # the manager released these
        for r in list(self.running):  # the caller's aborts, at the same point
            if r.request_id in self._aborts and r.request_id not in aborted:
                self.manager.release(r.request_id)
                aborted[r.request_id] = self._aborts[r.request_id]
        self._aborts.clear()
        if not aborted:
            return batch, feeds, kv, ended
        keep = np.array([r.request_id not in aborted for r in batch], dtype=bool)
        kv = KVBatch.from_arrays(self.lm.pool, *_keep_requests(step, keep)[:5])
        for r in list(self.running):
            if r.request_id in aborted:
                self._end(r, "aborted", aborted[r.request_id])
                ended.append(r)
        batch = [r for r, k in zip(batch, keep) if k]
        feeds = [f for f, k in zip(feeds, keep) if k]
        return batch, feeds, kv, ended

    def _commit(self, batch: list[Request], feeds: list[list[int]]) -> None:
        """The fed tokens' KV is in pages (full pages become reusable prefixes)."""
        kept = [r.request_id for r in batch]
        if all(len(f) == len(feeds[0]) for f in feeds):  # [B, k]: no ragged path
            self.manager.commit_batch(kept, np.array(feeds, dtype=np.int64))
        else:
            self.manager.commit_batch(kept, feeds)

    def _sample(
        self, batch: list[Request], feeds: list[list[int]], next_ids: list[int]
    ) -> tuple[int, list[Request]]:
        """Append each complete prompt's next token (greedy); release the finished requests.

        Returns the number of decoding requests and the requests that finished.
        """
        num_decode = 0
        finished: list[Request] = []
        for r, fed, tok in zip(batch, feeds, next_ids):
            num_decode += r.num_computed >= len(r.prompt_ids)
            r.num_computed += len(fed)
            if r.num_computed < len(r.prompt_ids):
                continue  # a prefill chunk short of the prompt's end: its logits are not used
            if not r.output_ids:
                r.first_token_at = time.perf_counter()
            r.output_ids.append(int(tok))
            if len(r.output_ids) >= r.max_new_tokens or tok in r.stop_token_ids:
                self.manager.release(r.request_id)
                self._end(r, "finished")
                finished.append(r)
        return num_decode, finished

    def _end(self, r: Request, status: Status, reason: str | None = None) -> None:
        r.status = status
        r.abort_reason = reason
        self.running.remove(r)
        self.done.append(r)
        if reason is not None:
            log.warning("request %r aborted: %s", r.request_id, reason)
