"""What the fuzzer gives engines (:class:`RequestSpec`) and what they give back
(:class:`Launch`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError

__all__ = ["EMPTY64", "Launch", "RequestSpec"]

Int64Array = npt.NDArray[np.int64]

_EMPTY32 = np.empty(0, dtype=np.int32)
_EMPTY32.flags.writeable = False
EMPTY64 = np.empty(0, dtype=np.int64)
EMPTY64.flags.writeable = False




class RequestSpec:
    """A request the fuzzer submits: its namespace and its whole token stream.

    ``tokens[:prompt_len]`` is the prompt; ``tokens[i]`` for ``i >= prompt_len`` is the token the
    model samples at position ``i`` (an engine must use exactly these). The request finishes when
    the K/V of every position ``< len(tokens)`` has been computed.
    """

    __slots__ = ("namespace", "parent", "prompt_len", "request_id", "tokens")

    def __init__(self, request_id: Any, namespace: Any, tokens: Int64Array, prompt_len: int,
                 parent: Any = None) -> None:
        self.request_id = request_id
        self.namespace = namespace
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.parent = parent

    @property
    def prompt(self) -> Int64Array:
        return self.tokens[: self.prompt_len]

    @property
    def max_len(self) -> int:
        return int(self.tokens.size)

    def __repr__(self) -> str:
        return (f"RequestSpec({self.request_id!r}, ns={self.namespace!r}, "
                f"prompt_len={self.prompt_len}, max_len={self.max_len})")


class Launch:
    """Device work an engine launched: a step (or a transfer), as its kernels see it.

    Parameters
    ----------
    request_ids: ``[B]`` the requests the step computes
    starts: ``[B]`` int — first position each request computes in this step
    num_new: ``[B]`` int — positions computed (``starts[b] .. starts[b] + num_new[b] - 1``)
    kv_indptr: ``[B + 1]`` int; kv_indices: ``[nnz]`` int — the pages each request reads, in
        order (FlashInfer CSR, as the attention kernel gets it), covering every position up to
        ``starts + num_new``
    slot_mapping: ``[T]`` int — where each computed position's K/V is written
        (``page * page_size + offset``), request by request, ``T = sum(num_new)``
    copy_src, copy_dst: ``[C]`` int — page copies the step does before anything else
        (copy-on-write); they land on the device after every earlier step completed
    held_sources: ``[C']`` int — copy-on-write sources the manager keeps alive for this
        reserve's copies until the next reserve (default ``copy_src``; an engine that does not
        do the copies it was asked for still reports what the manager holds)
    fence: the ``step_id`` of the :class:`~kvmem.manager.StepHandle` that covers this work, or
        None when the engine took none
    kind: ``"step"`` (reads and writes; completes in launch order) or ``"transfer"`` (writes
        only, e.g. KV arriving from a prefill node; lands in any order)
    writes_first: the step's kernels write its K/V before attention reads (vLLM's backends,
        layer by layer), so a request may read another's same-step write (a same-step prefix
        hit); default False: old positions are read before the step's writes land
    source_pages: ``[S]`` int — for a transfer from another manager (a prefill pool), the pages
        it reads there (the ``transfer_lifetime`` oracle watches their lifetimes); default none
    source_tags: ``[S]`` int64 — their lifetime tags when the transfer was offered (default: their
        tags when the fuzzer sees the launch)
    read_pages: ``[R]`` int — pages of this pool a transfer reads (a copy into a tier below the
        device): guarded like the pages it writes until it lands; default none

    Attributes
    ----------
    rejected: ``[B]`` int, or empty (none) — for a speculative step, how many of each request's
        last computed positions are draft tokens the verifier rejects: the device writes them
        with draft values (:data:`~kvmem.testing._device_memory.DRAFT`), not the true tokens'
    """

    __slots__ = ("copy_dst", "copy_src", "ent_flat", "fence", "guard", "held_sources", "id",
                 "kind", "kv_counts", "kv_indices", "kv_indptr", "mrows", "num_new",
                 "pending_copies", "read_pages", "rejected", "request_ids", "slot_mapping",
                 "source_pages", "source_tags", "starts", "write_pages", "writes_first")

    def __init__(self, request_ids: tuple[Any, ...], starts: npt.ArrayLike,
                 num_new: npt.ArrayLike, kv_indptr: npt.ArrayLike, kv_indices: npt.ArrayLike,
                 slot_mapping: npt.ArrayLike, copy_src: npt.ArrayLike = _EMPTY32,
                 copy_dst: npt.ArrayLike = _EMPTY32, fence: int | None = None,
                 kind: str = "step", held_sources: npt.ArrayLike | None = None,
                 writes_first: bool = False, source_pages: npt.ArrayLike = _EMPTY32,
                 source_tags: npt.ArrayLike | None = None,
                 read_pages: npt.ArrayLike = _EMPTY32) -> None:
        if kind not in ("step", "transfer"):
            raise ArgumentError(f"Launch kind must be 'step' or 'transfer', got {kind!r}")
        self.request_ids = tuple(request_ids)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.num_new = np.asarray(num_new, dtype=np.int64)
        self.kv_indptr = np.asarray(kv_indptr, dtype=np.int64)
        self.kv_indices = np.asarray(kv_indices, dtype=np.int64)
        self.slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
        self.copy_src = np.asarray(copy_src, dtype=np.int64)
        self.copy_dst = np.asarray(copy_dst, dtype=np.int64)
        self.held_sources = (self.copy_src if held_sources is None or held_sources is copy_src
                             else np.asarray(held_sources, dtype=np.int64))
        self.fence = fence
        self.kind = kind
        self.writes_first = writes_first
        self.source_pages = np.asarray(source_pages, dtype=np.int64)
        self.source_tags = None if source_tags is None else np.asarray(source_tags,
                                                                         dtype=np.int64)
        self.read_pages = np.asarray(read_pages, dtype=np.int64)
        b = len(self.request_ids)
        if (self.starts.shape != (b,) or self.num_new.shape != (b,)
                or self.kv_indptr.shape != (b + 1,) or self.copy_src.shape != self.copy_dst.shape):
            raise ArgumentError(
                f"a Launch of {b} requests needs starts/num_new [{b}], kv_indptr [{b + 1}] and "
                f"copy_src/copy_dst of one shape; got {self.starts.shape}, "
                f"{self.num_new.shape}, {self.kv_indptr.shape}, {self.copy_src.shape}/"
                f"{self.copy_dst.shape}"
            )
        # Filled by the timeline when it registers the op.
        self.id = -1
        self.mrows = EMPTY64
        self.guard = EMPTY64
        self.write_pages = EMPTY64
        self.ent_flat = EMPTY64  # per CSR entry: its place in the model's [rows, width]
        self.kv_counts = EMPTY64  # pages each request reads
        self.pending_copies = 0
        self.rejected = EMPTY64  # set by a speculative engine

    def __repr__(self) -> str:
        return (f"Launch(#{self.id} {self.kind}, {len(self.request_ids)} requests, "
                f"{int(self.num_new.sum())} tokens, {self.copy_src.size} copies, "
                f"fence={self.fence})")
