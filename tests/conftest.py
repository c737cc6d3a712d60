"""Shared fixtures: a manager factory, a full-state snapshot, the tiny model, the CUDA skip and
the opt-in switch for long randomized campaigns (``KVMEM_LONG_TESTS=1`` or ``--long``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvmem import KVCacheManager

PAGE_SIZE = 4
"""The page size ``make_manager`` uses unless told otherwise."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked long (same as KVMEM_LONG_TESTS=1)")


def _long_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--long")) or os.environ.get("KVMEM_LONG_TESTS", "") not in (
        "", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _long_enabled(config):
        skip_long = pytest.mark.skip(reason="a long randomized campaign; run with "
                                            "KVMEM_LONG_TESTS=1 or --long")
        for item in items:
            if "long" in item.keywords:
                item.add_marker(skip_long)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def new_manager(num_pages: int = 32, *, page_size: int = PAGE_SIZE, max_seqs: int = 8,
                max_pages_per_seq: int = 16, tracker: Any = "checking", watermark: float = 0.0,
                **kw: Any) -> KVCacheManager:
    """A small manager for tests: checking tracker, no watermark, 32 pages of 4 tokens."""
    return KVCacheManager(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                          max_pages_per_seq=max_pages_per_seq, tracker=tracker,
                          watermark=watermark, **kw)


@pytest.fixture(scope="session")
def make_manager() -> Callable[..., KVCacheManager]:
    """A factory: ``make_manager(num_pages=32, *, page_size=4, max_seqs=8,
    max_pages_per_seq=16, tracker="checking", watermark=0.0, **kw)`` (session scoped, so
    hypothesis tests may use it)."""
    return new_manager


def _freeze(value: Any) -> Any:
    """A comparable, independent copy of plain state (arrays, numbers, containers)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape),
                value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted((_freeze(v) for v in value), key=repr))
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _freeze(v)) for k, v in value.items())))
    return _SKIP


_SKIP = object()
# Memo tables and scratch buffers: they cache what the state determines, they are not state.
_NOT_STATE = {"_memo", "_arange", "_flat_pages", "_slot_offsets", "_tokens_flat", "_flat",
              "_row_marks"}


def _fields(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    names = list(getattr(obj, "__dict__", {})) or [
        n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())]
    out = {}
    for name in names:
        if name in _NOT_STATE or not hasattr(obj, name):
            continue
        frozen = _freeze(getattr(obj, name))
        if frozen is not _SKIP:
            out[name] = frozen
    return out


def _registry(requests: Any) -> tuple[Any, ...]:
    """Every known request (its namespace, prompt and saved tokens) and the running rows."""
    known = tuple((repr(rid), repr(r.namespace), r.namespace_id, _freeze(r.prompt),
                   _freeze(r.saved)) for rid, r in requests.known.items())
    return known, _freeze(requests.rows), _freeze(requests._ids)


def full_snapshot(manager: KVCacheManager) -> dict[str, Any]:
    """The manager's whole state: allocator arrays, page table, page tokens, tracker, prefix
    cache, fences, namespaces, the request registry, the counters and the stats. Two snapshots
    are equal exactly when nothing a later call can observe changed between them. The
    verifier's held proof and its path counters are left out: they decide which check the next
    verify runs, never its verdict."""
    m: Any = manager
    return {
        "allocator": _fields(m.allocator),
        "table": _fields(m.table),
        "pages": _fields(m.pages),
        "tracker": _fields(m.tracker),
        "prefix cache": _fields(m.cache),
        "fences": _fields(m.fences),
        "namespaces": _fields(m.namespaces),
        "registry": (tuple(m.running), tuple(m.preempted), *_registry(m._requests)),
        "counters": _freeze(m._counters),
        "stats": m.stats(),
    }


@pytest.fixture(scope="session")
def snapshot() -> Callable[[KVCacheManager], dict[str, Any]]:
    """``snapshot(manager)``: the manager's whole state (``full_snapshot``); compare two with
    ``==`` to prove a refused call changed nothing."""
    return full_snapshot


@pytest.fixture(scope="module")
def tiny() -> Any:
    """A tiny random Llama (model_fixtures.tiny_llama; needs transformers, the hf extra)."""
    from model_fixtures import tiny_llama

    return tiny_llama()
