"""Admission: what a prompt needs (pages, its cached prefix) and whether it fits now.

::

    plan(prompt, ns)      pages = ceil(n / P); the longest cached prefix of at most
                          (n - 1) // P full pages in the namespace (the last prompt token is
                          always computed: it yields the first logits)
    fits(plan, keep)      a free row, and pages - hits + keep <= free + evictable - (hits that
                          stop being evictable)
    map(plan)             share the hits, allocate the rest, open the row

``can_admit`` plans and checks; the ``admit`` right after it (no manager call in between, and
no page allocated or freed: BUGS.md 7) reuses that plan instead of matching the prompt again.
Likewise an ``admit`` right after a ``match_prefix`` lookup (an engine that schedules itself,
e.g. vLLM's, looks the prefix up first), of the same leading tokens in the same namespace and
asking for exactly the pages that lookup found, reuses its match.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem.allocator._page_table import PageTable
from kvmem.allocator._pages import MANAGER_OUT_OF_PAGES, Pages
from kvmem.allocator._prefix_cache import PrefixMatch
from kvmem.allocator._prefix_keys import namespace_bytes
from kvmem.errors import ArgumentError, KVMemError, OutOfPagesError
from kvmem.integrity import MAX_NAMESPACES

__all__ = ["Admission", "Namespaces", "Plan"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
_EMPTY_PAGES = np.empty(0, dtype=np.int32)
_EMPTY_PAGES.flags.writeable = False


class Namespaces:
    """The namespaces a manager has seen, by canonical encoding (``1`` and ``True``, or
    ``(1, "a")`` and ``(True, "a")``, are different namespaces): id 0 is None."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {b"n": 0}
        self._names: list[Any] = [None]

    def id_of(self, namespace: Any, register: bool, data: bytes | None = None) -> int:
        """The namespace's id; -1 if unseen and not ``register`` (no page can hold it).
        ``data``: its canonical encoding, when the caller has it."""
        if data is None:
            data = namespace_bytes(namespace)
        ns = self._ids.get(data)
        if ns is None:
            if not register:
                return -1
            ns = len(self._names)
            if ns >= MAX_NAMESPACES:
                raise KVMemError(
                    f"this manager has seen {ns} namespaces, the most it can tell apart; use "
                    "fewer (a namespace is a tenant, adapter or salt, not a request)"
                )
            self._ids[data] = ns
            self._names.append(namespace)
        return ns

    def name(self, namespace_id: int) -> Any:
        return self._names[namespace_id]


class Plan(NamedTuple):
    """What admitting a prompt takes: ``num_pages`` for the whole prompt, of which the cached
    prefix ``match`` provides ``hits`` (``evictable_hits`` of them held by the cache alone), in
    namespace ``namespace_id``."""

    tokens: Int64Array
    namespace: Any
    encoding: bytes  # the namespace's canonical encoding
    namespace_id: int
    num_pages: int
    match: PrefixMatch | None
    hits: int
    evictable_hits: int


class Admission:
    """Plans and maps admissions for a manager's pages and page table."""

    def __init__(self, pages: Pages, table: PageTable, namespaces: Namespaces) -> None:
        self.pages = pages
        self.table = table
        self.namespaces = namespaces
        # (stamp, plan, allocator.changes.num_logged then) of the latest can_admit
        self._memo: tuple[int, Plan, int] | None = None
        # (stamp, allocator.changes.num_logged, namespace encoding, the matched pages' tokens
        # (a copy), the match) of the latest lookup that found pages
        self._matched: tuple[int, int, bytes, Int64Array, PrefixMatch] | None = None
        self.reuse_lookups = True  # False: every admission matches (for a differential test)

    def match(self, tokens: Int64Array, namespace: Any, max_pages: int,
              stamp: int | None = None) -> PrefixMatch:
        """The cached pages holding ``tokens``' leading full pages in ``namespace`` (at most
        ``max_pages``), each confirmed; a lookup that changes nothing. ``stamp``: the
        manager's call counter, to remember the match for the admission right after."""
        data = namespace_bytes(namespace)
        ns = self.namespaces.id_of(namespace, False, data)
        cache = self.pages.cache
        self._matched = None
        if cache is None or ns < 0 or max_pages <= 0:  # (nothing to find: the namespace's root)
            root = np.zeros(2, dtype=np.uint64) if cache is None else cache.root_key(namespace)
            return PrefixMatch(_EMPTY_PAGES, np.empty((0, 2), dtype=np.uint64), root, 0)
        match = cache.match(tokens, namespace, max_pages, ns)
        if stamp is not None and match.pages.size and self.reuse_lookups:
            self._matched = (stamp, self.pages.allocator.changes.num_logged, data,
                             tokens[: match.pages.size * self.table.page_size].copy(), match)
        return match

    def _recall_match(self, stamp: int | None, tokens: Int64Array, data: bytes,
                      max_pages: int) -> PrefixMatch | None:
        """The latest lookup's match (once) if it was remembered at ``stamp``, no page changed
        lifetime since, and it is for this namespace and these leading tokens and found
        exactly ``max_pages`` pages: then matching again would find the same pages (a walk
        asked for no more pages than it confirmed before cannot find fewer or others)."""
        memo, self._matched = self._matched, None
        if (memo is None or memo[0] != stamp or memo[2] != data
                or memo[1] != self.pages.allocator.changes.num_logged):
            return None
        match = memo[4]
        head = memo[3]
        if (match.pages.size != max_pages or tokens.size < head.size
                or np.count_nonzero(tokens[: head.size] != head)):
            return None
        return match

    def plan(self, tokens: Int64Array, namespace: Any, register: bool,
             who: str = "a request", stamp: int | None = None) -> Plan:
        """The prompt's plan; raises if it can never fit (empty, longer than a row), naming
        the request as ``who`` (e.g. ``"request 'r1'"``). ``stamp``: the manager's call
        counter when a lookup right before it (:meth:`match`) may be reused."""
        t = self.table
        n = tokens.size
        if n == 0:
            raise ArgumentError(f"{who} needs at least one prompt token; got none (nothing "
                                "changed)")
        num_pages = -(-n // t.page_size)
        if num_pages > t.max_pages_per_seq:
            raise ArgumentError(
                f"{who}: a prompt of {n} tokens needs {num_pages} pages but a request may map "
                f"at most max_pages_per_seq={t.max_pages_per_seq}; shorten it or raise the "
                "limit (nothing changed)"
            )
        data = namespace_bytes(namespace)
        ns = self.namespaces.id_of(namespace, register, data)
        cache = self.pages.cache
        if cache is None:
            return Plan(tokens, namespace, data, ns, num_pages, None, 0, 0)
        max_pages = (n - 1) // t.page_size
        match = self._recall_match(stamp, tokens, data, max_pages) if stamp is not None else None
        if match is None:
            match = cache.match(tokens, namespace, max_pages, ns)
        return Plan(tokens, namespace, data, ns, num_pages, match, int(match.pages.size),
                    match.num_evictable)

    def fits(self, plan: Plan, keep_free: int) -> bool:
        """Whether a row is free and the plan's pages can be had with ``keep_free`` left."""
        if self.table.num_free_rows == 0:
            return False
        return (plan.num_pages - plan.hits + keep_free
                <= self.pages.available() - plan.evictable_hits)

    def remember(self, stamp: int, plan: Plan) -> None:
        self._memo = (stamp, plan, self.pages.allocator.changes.num_logged)

    def recall(self, stamp: int, tokens: Any, namespace: Any) -> Plan | None:
        """The plan remembered at ``stamp`` if it is for these tokens and namespace and no
        page changed lifetime since (once). The stamp counts the manager's own calls only: a
        hit evicted and reallocated behind its back (BUGS.md 7) must be matched again, not
        acquired."""
        memo, self._memo = self._memo, None
        if (memo is None or memo[0] != stamp
                or memo[2] != self.pages.allocator.changes.num_logged):
            return None
        plan = memo[1]
        same = plan.tokens is tokens or (  # (an array of floats or bools is refused by admit)
            type(tokens) is np.ndarray and tokens.dtype.kind in "iu"
            and plan.tokens.shape == tokens.shape
            and not np.count_nonzero(plan.tokens != tokens))
        if not same or (plan.namespace is not namespace
                         and plan.encoding != namespace_bytes(namespace)):
            return None
        if plan.namespace_id < 0:  # planned before the namespace had an id
            plan = plan._replace(namespace_id=self.namespaces.id_of(namespace, True,
                                                                    plan.encoding))
        return plan

    def require(self, plan: Plan) -> None:
        """Raise (nothing changed) unless a row is free and the plan's pages are there."""
        t = self.table
        if t.num_free_rows == 0:
            raise KVMemError(f"all max_seqs={t.max_seqs} rows are mapped; release or preempt a "
                             "request before admitting another")
        if not self.fits(plan, 0):
            raise OutOfPagesError(plan.num_pages - plan.hits,
                                  self.pages.available() - plan.evictable_hits,
                                  MANAGER_OUT_OF_PAGES)

    def map(self, plan: Plan, num_loaded: int = 0) -> tuple[int, Int32Array, Int32Array]:
        """Share the hits, allocate the rest, open the row: (row, its pages, the new ones).
        ``num_loaded``: the first new pages hold the prompt's next pages already (loaded from
        a tier by the caller, who commits them): the row starts with their tokens too.
        Raises (nothing changed) when no row is free or the pages are not there."""
        t = self.table
        self.require(plan)
        hit_pages = _EMPTY_PAGES if plan.match is None else plan.match.pages
        self.pages.share_hits(hit_pages)
        new = self.pages.allocate(plan.num_pages - hit_pages.size, plan.namespace_id)
        pages = np.concatenate([hit_pages, new]) if hit_pages.size else new
        row = t.open_row(pages, (hit_pages.size + num_loaded) * t.page_size,
                         hit_pages.size * t.page_size, namespace_id=plan.namespace_id,
                         prefix_key=None if plan.match is None else plan.match.last_key)
        return row, pages, new
