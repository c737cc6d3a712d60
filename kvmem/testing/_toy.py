"""ToyEngine: drives a KVCacheManager the way an inference engine does, with checkable "KV".

Each token slot of a flat numpy pool holds a value that, like real keys and values, depends on
the namespace and on every token up to and including the slot's own::

    value(-1) = hash(("kvmem-ns", namespace))
    value(i)  = hash((value(i - 1), token(i)))

So reading a request's slots through the manager's metadata and comparing them with the values
its own tokens imply catches a wrong prefix hit, a missed copy-on-write, a page shared across
namespaces, a page reused under a running request, or a stale mapping. The engine performs the
copy-on-write copies a step asks for before it writes, as a real engine must.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._validate import id_tuple, integer, is_hashable, show, token_array
from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.manager import AdmitResult, KVCacheManager, StepMetadata

__all__ = ["ToyEngine", "kv_values"]


def kv_values(namespace: Any, tokens: list[int], start: int = 0,
              previous: int | None = None) -> list[int]:
    """The slot values of ``tokens[start:]`` (``previous`` is value(start - 1) when known)."""
    value = hash(("kvmem-ns", namespace)) if start == 0 else previous
    if value is None:
        return kv_values(namespace, tokens)[start:]
    out = []
    for tok in tokens[start:]:
        value = hash((value, tok))
        out.append(value)
    return out


@dataclass
class _Seq:
    namespace: Any
    tokens: list[int]  # prompt, then generated tokens (known to the engine, maybe not written)
    prompt_len: int
    values: list[int] = field(default_factory=list)  # expected value of each written slot
    written: int = 0  # tokens whose KV is in the pool (cached prefix included)
    committed: int = 0


class ToyEngine:
    """A tiny continuous-batching engine over a :class:`KVCacheManager` (CPU, numpy).

    Parameters
    ----------
    manager: the manager to drive.
    vocab: generated tokens are drawn from ``0 .. vocab-1`` by a seeded generator.
    sampler: ``sampler(request_id, position) -> token``: the token "sampled" at a position past
        the prompt (default: the seeded generator), e.g. a fuzzer's fixed token streams.

    Attributes
    ----------
    kv: ``[num_pages * page_size]``, int64 — the value written into each slot (0 = never)
    """

    def __init__(self, manager: KVCacheManager, vocab: int = 8, seed: int = 0,
                 sampler: Callable[[Any, int], int] | None = None) -> None:
        if not isinstance(manager, KVCacheManager):
            raise ArgumentTypeError(f"manager={show(manager)}: expected a KVCacheManager")
        integer(vocab, "vocab", minimum=1)
        if sampler is not None and not callable(sampler):
            raise ArgumentTypeError(f"sampler={show(sampler)}: expected a function "
                                    "sampler(request_id, position) -> token, or None")
        seed = integer(seed, "seed", minimum=0)
        self.mgr = manager
        self.sampler = sampler
        self.page_size = manager.page_size
        self.kv = np.zeros(manager.num_pages * manager.page_size, dtype=np.int64)
        self.seqs: dict[Any, _Seq] = {}
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.num_copies = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def admit(self, request_id: Any, prompt: list[int], namespace: Any = None) -> AdmitResult:
        tokens = token_array(prompt, "prompt")  # (np.asarray(..., int64) truncated 1.5 to 1)
        res = self.mgr.admit(request_id, tokens, namespace)
        seq = _Seq(namespace, tokens.tolist(), tokens.size)
        seq.values = kv_values(namespace, seq.tokens[: res.num_cached_tokens])
        seq.written = seq.committed = res.num_cached_tokens
        self.seqs[request_id] = seq
        return res

    def step(self, request_ids: list[Any], num_tokens: int | list[int]) -> StepMetadata:
        """Reserve ``num_tokens`` per request, do the step's copies, write the new tokens' KV."""
        step = self.mgr.reserve(request_ids, num_tokens)
        self.check_step(step)
        self.apply_copies(step)
        counts = step.num_new_tokens.tolist()
        offsets = np.cumsum([0, *counts]).tolist()
        for b, rid in enumerate(step.request_ids):
            seq = self.seqs[rid]
            n = counts[b]
            need = seq.written + n - len(seq.tokens)
            if need > 0 and self.sampler is not None:  # past the prompt: "sample" new tokens
                first = len(seq.tokens)
                seq.tokens.extend(self.sampler(rid, first + i) for i in range(need))
            elif need > 0:
                seq.tokens.extend(self.rng.integers(0, self.vocab, size=need).tolist())
            prev = seq.values[-1] if seq.values else None
            new = kv_values(seq.namespace, seq.tokens[: seq.written + n], seq.written, prev)
            self.kv[step.slot_mapping[offsets[b] : offsets[b + 1]]] = new
            seq.values.extend(new)
            seq.written += n
        return step

    def _seq(self, request_id: Any) -> _Seq:
        """The engine's record of a request (ArgumentError naming it if there is none)."""
        seq = self.seqs.get(request_id) if is_hashable(request_id) else None
        if seq is None:
            raise ArgumentError(f"request {request_id!r} is not in this engine (admit it first; "
                                f"it holds {list(self.seqs)[:8]})")
        return seq

    def check_step(self, step: StepMetadata) -> None:
        """Raise AssertionError unless the step's kernel metadata is exactly what the page table
        implies (the manager may build it incrementally; this rebuilds it from scratch)."""
        _require_step(step)
        table = self.mgr.table
        rows = step.rows
        for b, rid in enumerate(step.request_ids):  # each row is its request's
            assert self.mgr.row_of(rid) == int(rows[b]), (rid, rows[b])
            assert np.array_equal(table.row_pages(int(rows[b])), self.mgr.pages_of(rid)), rid
            assert table.num_tokens[rows[b]] == self.mgr.num_tokens(rid), rid
        csr = table.csr(rows)
        assert np.array_equal(step.kv_indptr, csr.kv_indptr), (step.kv_indptr, csr.kv_indptr)
        assert np.array_equal(step.kv_indices, csr.kv_indices), (step.kv_indices, csr.kv_indices)
        assert np.array_equal(step.kv_last_page_len, csr.kv_last_page_len)
        assert np.array_equal(step.seq_lens, table.num_tokens[rows])
        # (computed, not read: reading the cached property would store it in the step)
        block_table = type(step).__dict__["block_table"].func(step)
        assert np.array_equal(block_table, table.block_table(rows))
        n = step.num_new_tokens.astype(np.int64)
        assert step.qo_indptr.tolist() == [0, *np.cumsum(n).tolist()]
        start = table.num_tokens[rows] - n
        assert np.array_equal(step.slot_mapping, table.token_slots(rows, start, n))

    def apply_copies(self, step: StepMetadata) -> None:
        _require_step(step)
        p = self.page_size
        for src, dst in zip(step.copy_src.tolist(), step.copy_dst.tolist()):
            self.kv[dst * p : (dst + 1) * p] = self.kv[src * p : (src + 1) * p]
            self.num_copies += 1

    def commit(self, request_ids: list[Any]) -> None:
        """Commit every written, uncommitted token of these requests."""
        ids = id_tuple(request_ids, "request_ids")
        for rid in ids:
            self._seq(rid)  # (every id known before anything is committed)
        for rid in ids:
            seq = self.seqs[rid]
            if seq.written > seq.committed:
                self.mgr.commit(rid, np.asarray(seq.tokens[seq.committed : seq.written]))
                seq.committed = seq.written

    def reject(self, request_id: Any, num_tokens: int) -> None:
        """Give back the last ``num_tokens`` written, uncommitted tokens (rejected drafts): the
        manager's slots, and the tokens sampled for them past the prompt."""
        seq = self._seq(request_id)
        self.mgr.reject(request_id, num_tokens)
        seq.written -= num_tokens
        del seq.values[seq.written :]
        del seq.tokens[max(seq.written, seq.prompt_len) :]

    def fork(self, parent_id: Any, child_id: Any) -> None:
        self.mgr.fork(parent_id, child_id)
        parent = self.seqs[parent_id]
        self.seqs[child_id] = _Seq(parent.namespace, list(parent.tokens),
                                   parent.prompt_len, list(parent.values), parent.written,
                                   parent.committed)

    def preempt(self, request_id: Any) -> None:
        self.mgr.preempt(request_id)
        seq = self.seqs[request_id]
        # The manager keeps the committed tokens and the rest of the prompt; tokens sampled but
        # never committed are dropped here (a real engine may pass them to resume()).
        seq.tokens = seq.tokens[: max(seq.committed, seq.prompt_len)]
        seq.values, seq.written, seq.committed = [], 0, 0

    def resume(self, request_id: Any) -> AdmitResult:
        seq = self._seq(request_id)
        res = self.mgr.resume(request_id)
        assert res.num_prompt_tokens == len(seq.tokens), (res, len(seq.tokens))
        seq.prompt_len = len(seq.tokens)  # everything known is now prompt to recompute
        seq.values = kv_values(seq.namespace, seq.tokens[: res.num_cached_tokens])
        seq.written = seq.committed = res.num_cached_tokens
        return res

    def release(self, request_id: Any) -> None:
        self.mgr.release(request_id)
        del self.seqs[request_id]

    def abort(self, request_id: Any) -> None:
        """Forget a request the manager aborted (verify() already released it)."""
        self.seqs.pop(request_id, None)

    # -- checks ---------------------------------------------------------------------------------

    def read(self, request_id: Any) -> npt.NDArray[np.int64]:
        """The values a kernel would read for a running request's written tokens."""
        seq = self._seq(request_id)
        pages = self.mgr.pages_of(request_id).astype(np.int64)
        pos = np.arange(seq.written)
        return self.kv[pages[pos // self.page_size] * self.page_size + pos % self.page_size]

    def check_kv(self, request_ids: list[Any] | None = None) -> None:
        """Raise AssertionError if any running request would read a value its tokens do not
        imply (wrong hit, missing copy, page reused or shared across namespaces)."""
        ids = list(self.mgr.running) if request_ids is None else id_tuple(request_ids,
                                                                          "request_ids")
        for rid in ids:
            got = self.read(rid)
            want = np.array(self.seqs[rid].values, dtype=np.int64)
            if got.shape != want.shape or not np.array_equal(got, want):
                bad: list[int] = (np.flatnonzero(got != want).tolist()
                                  if got.shape == want.shape else [])
                raise AssertionError(
                    f"request {rid!r} reads wrong KV at token positions {bad[:8]} "
                    f"(pages {self.mgr.pages_of(rid).tolist()[:16]})"
                )


def _require_step(step: Any) -> None:
    if not isinstance(step, StepMetadata):
        raise ArgumentTypeError(f"step={show(step)}: expected the StepMetadata reserve returned")
