"""Hooks and KV events of a manager: queued while an operation runs, delivered after it.

``fn(event)`` is called after the operation has completed, so a hook that raises never leaves
the manager half-changed (the operation stands; the hook's error is re-raised as
:class:`HookError` once every hook has run). An operation that raises delivers nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem._manager_types import HOOK_KINDS, KVEvent, ManagerEvent
from kvmem._validate import choice, show
from kvmem.errors import ArgumentError, ArgumentTypeError, HookError

__all__ = ["HookBus"]

logger = logging.getLogger("kvmem.manager")

Hook = Callable[[ManagerEvent], Any]


class HookBus:
    """Registered hooks, the events queued for them, and the KV events kept for routers."""

    def __init__(self, kv_events: bool) -> None:
        self.kv_events = kv_events
        self._hooks: dict[str, list[Hook]] = {k: [] for k in HOOK_KINDS}
        self._queued: list[tuple[Hook, ManagerEvent]] = []
        self._events: list[KVEvent] = []

    def add(self, kind: str, fn: Hook) -> None:
        kind = choice(kind, "kind", HOOK_KINDS)
        if not callable(fn):
            raise ArgumentTypeError(f"fn={show(fn)}: a hook must be callable (it is called "
                                    "with a ManagerEvent); nothing was added")
        self._hooks[kind].append(fn)

    def remove(self, kind: str, fn: Hook) -> None:
        kind = choice(kind, "kind", HOOK_KINDS)
        if fn not in self._hooks[kind]:
            raise ArgumentError(f"{fn!r} is not registered for {kind!r}; nothing was removed")
        self._hooks[kind].remove(fn)

    def wants(self, kind: str) -> bool:
        return bool(self._hooks[kind])

    def emit(self, kind: str, request_id: Any = None, pages: npt.NDArray[np.int32] | None = None,
             detail: Any = None) -> None:
        """Queue ``kind``'s hooks (the event carries a read-only copy of ``pages``)."""
        hooks = self._hooks[kind]
        if hooks:
            if pages is not None:  # one read-only copy: every hook of the event sees the same
                pages = pages.copy()
                pages.flags.writeable = False
            event = ManagerEvent(kind, request_id, pages, detail)
            self._queued.extend((fn, event) for fn in hooks)

    def kv_event(self, event: KVEvent) -> None:
        """Keep a KV event for :meth:`take_events` and queue the ``kv_event`` hooks."""
        if self.kv_events:
            self._events.append(event)
            self.emit("kv_event", detail=event)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    @property
    def pending(self) -> bool:
        return bool(self._queued)

    def discard(self) -> None:
        """The operation raised: deliver nothing it queued."""
        self._queued.clear()

    def flush(self) -> None:
        """Run every queued hook; raise HookError after all ran if any raised."""
        queued, self._queued = self._queued, []
        errors: list[tuple[ManagerEvent, BaseException]] = []
        for fn, event in queued:
            try:
                fn(event)
            except Exception as e:  # every hook runs; the first error is raised below
                logger.exception("kvmem hook %r raised on %s", fn, event.kind)
                errors.append((event, e))
        if errors:
            event, first = errors[0]
            raise HookError(
                f"{len(errors)} hook call(s) raised; the first, on {event.kind!r} "
                f"(request {event.request_id!r}), raised {first!r}. The operation itself "
                "completed and the manager is consistent; fix or remove the hook."
            ) from first
