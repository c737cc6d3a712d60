"""Prefix caches bent the way real engines' were: wrappers the fault catalog puts around
``manager.cache``."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmem.allocator import PrefixCache, PrefixMatch

__all__ = ["TenantlessCache", "WeakKeyCache"]


class _CacheWrapper(PrefixCache):
    """Delegates every call to the wrapped (bound) prefix cache; subclasses bend one."""

    def __init__(self, inner: PrefixCache) -> None:
        self.inner = inner
        self.page_size = inner.page_size

    def __getattr__(self, name: str) -> Any:  # namespaces_of, check, ...
        return getattr(self.inner, name)

    def bind(self, allocator: Any, page_size: int, page_tokens: Any = None) -> None:
        self.inner.bind(allocator, page_size, page_tokens)

    def root_key(self, namespace: Any) -> Any:
        return self.inner.root_key(namespace)

    def match(self, token_ids: Any, namespace: Any, max_pages: int,
              namespace_id: int | None = None) -> PrefixMatch:
        return self.inner.match(token_ids, namespace, max_pages, namespace_id)

    def page_keys(self, parent_keys: Any, counts: Any, first_positions: Any,
                  token_ids: Any) -> Any:
        return self.inner.page_keys(parent_keys, counts, first_positions, token_ids)

    def insert(self, keys: Any, pages: Any, namespace_ids: Any) -> Any:
        return self.inner.insert(keys, pages, namespace_ids)

    def acquired(self, pages: Any) -> None:
        self.inner.acquired(pages)

    def released(self, pages: Any) -> None:
        self.inner.released(pages)

    def released_many(self, runs: Any) -> None:
        self.inner.released_many(runs)

    def evict(self, num_pages: int) -> Any:
        return self.inner.evict(num_pages)

    def remove(self, pages: Any) -> Any:
        return self.inner.remove(pages)

    def forget(self, pages: Any) -> Any:
        return self.inner.forget(pages)

    def stale(self) -> Any:
        return self.inner.stale()

    def clear(self) -> Any:
        return self.inner.clear()

    def is_cached(self, pages: Any) -> Any:
        return self.inner.is_cached(pages)

    @property
    def num_cached(self) -> int:
        return self.inner.num_cached

    @property
    def num_evictable(self) -> int:
        return self.inner.num_evictable


class _Mod2:
    """A read view of a page-token store whose every token is taken mod 2."""

    def __init__(self, tokens: Any) -> None:
        self.tokens = tokens

    def __getitem__(self, index: Any) -> Any:
        return np.asarray(self.tokens[index]) % 2


class WeakKeyCache(_CacheWrapper):
    """Keys and confirms pages by a lossy view of their tokens (each token mod 2)."""

    def __init__(self, inner: PrefixCache) -> None:
        super().__init__(inner)
        tokens = getattr(inner, "page_tokens", None)
        if tokens is not None:  # confirmation reads the same lossy view
            inner.page_tokens = _Mod2(tokens)  # type: ignore[attr-defined]

    def match(self, token_ids: Any, namespace: Any, max_pages: int,
              namespace_id: int | None = None) -> PrefixMatch:
        return self.inner.match(np.asarray(token_ids) % 2, namespace, max_pages, namespace_id)

    def page_keys(self, parent_keys: Any, counts: Any, first_positions: Any,
                  token_ids: Any) -> Any:
        return self.inner.page_keys(parent_keys, counts, first_positions,
                                    np.asarray(token_ids) % 2)



class TenantlessCache(_CacheWrapper):
    """Leaves the namespace out of every key and every stored entry."""

    def root_key(self, namespace: Any) -> Any:
        return self.inner.root_key(None)

    def match(self, token_ids: Any, namespace: Any, max_pages: int,
              namespace_id: int | None = None) -> PrefixMatch:
        return self.inner.match(token_ids, None, max_pages, 0)

    def insert(self, keys: Any, pages: Any, namespace_ids: Any) -> Any:
        return self.inner.insert(keys, pages, np.zeros_like(namespace_ids))
