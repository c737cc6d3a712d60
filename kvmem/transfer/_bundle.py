"""Page bundles: one format for a run of a request's full pages that leave a pool.

A bundle is what every page mover shares (a transfer to another process, a host or disk tier)::

    identity        CacheIdentity: model, weights, dtype, scales, page shape, format version
    namespace       the pages' namespace (tenant, adapter, salt)
    token_ids       [n, page_size]   int64    the tokens each page holds, in order
    prefix_keys     [n, 2]           uint64   the sender's prefix-cache keys of the pages (keyed
                                              by its cache's secret: a receiver computes its own)
    data            [L, n, B]        uint8    each layer's page bytes in the storage dtype
    token_scales    [L, n, S]        uint8    fp8 token_head scales (float32 bytes), or absent
    static_scales   [L, C, Hs]       float32  the pool's fp8 tensor/head scales, or absent
    page_digests    [n, 16]          uint8    one digest per page (see page_digests)

The digest is SHA-256 (hashlib), its first 16 bytes, after a domain prefix: a cryptographic hash,
so bytes from another lifetime of a page, a torn read or a forged run cannot match by accident
or by construction (a CRC only guards against noise), and the fastest one hashlib has where the
CPU has SHA instructions (x86 SHA-NI, ARMv8 SHA2: 1.7 GB/s on this project's machine, BLAKE2b
0.9). It is still the largest cost of moving a page that is not the copy itself (see
docs/benchmarks.md, ``bench_transfer.py``). One digest per page (over every layer's bytes, its
token scales, the static scales and its token ids) lets a receiver that already holds a prefix
check only the pages it read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from kvmem.errors import ArgumentError, IntegrityError
from kvmem.transfer._identity import CacheIdentity
from kvmem.transfer._wire import namespace_from_json, namespace_json, pack, unpack

if TYPE_CHECKING:
    from kvmem.cuda import PagePool

__all__ = ["PageBundle", "gather_pages", "page_digests", "pool_page_digests"]

U8 = npt.NDArray[np.uint8]
DIGEST_BYTES = 16
_PAGE_DOMAIN = b"kvmem page digest v2\0"  # what the hash is of, before any byte of a page


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A ``[L, P, ...]`` tensor as ``[L, P, nbytes per page]`` uint8 (a view)."""
    L, P = t.shape[:2]
    return t.reshape(L, P, -1).view(torch.uint8)


def gather_pages(pool: PagePool, pages: npt.ArrayLike) -> dict[str, U8]:
    """Copies of ``pages``' bytes in every layer, on the host: ``{"data": [L, n, B]}`` and, for
    token_head scales, ``"token_scales": [L, n, S]``, uint8."""
    ids = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=pool.device)
    out = {"data": _bytes_view(pool.data).index_select(1, ids).cpu().numpy()}
    if pool.token_scales is not None:
        out["token_scales"] = _bytes_view(pool.token_scales).index_select(1, ids).cpu().numpy()
    return out


def static_scales_of(pool: PagePool) -> npt.NDArray[np.float32] | None:
    """The pool's fp8 tensor/head scales ``[L, C, Hs]`` float32 on the host, or None."""
    return None if pool.static_scales is None else pool.static_scales.cpu().numpy().copy()


def _digests(num_pages: int, page_chunks: Callable[[int], Iterator[Any]],
             token_ids: npt.NDArray[np.int64],
             static_scales: npt.NDArray[np.float32] | None) -> U8:
    """``[n, 16]`` uint8: page ``i``'s digest over ``page_chunks(i)`` (contiguous byte buffers,
    hashed in order without a copy), the static scales and its token ids."""
    static = b"" if static_scales is None else np.ascontiguousarray(static_scales).tobytes()
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    out = np.empty((num_pages, DIGEST_BYTES), dtype=np.uint8)
    for i in range(num_pages):
        h = hashlib.sha256(_PAGE_DOMAIN)
        for chunk in page_chunks(i):
            h.update(chunk)
        h.update(static)
        h.update(tokens[i])
        out[i] = np.frombuffer(h.digest()[:DIGEST_BYTES], dtype=np.uint8)
    return out


def page_digests(pages: dict[str, U8], token_ids: npt.NDArray[np.int64],
                 static_scales: npt.NDArray[np.float32] | None) -> U8:
    """One BLAKE2b digest per page: ``[n, 16]`` uint8, over the page's bytes in every layer
    (``pages`` as :func:`gather_pages` returns them, ``[L, n, B]`` per name, names in sorted
    order, layer by layer), the static scales and its token ids (``[n, page_size]``)."""
    arrays = [np.ascontiguousarray(pages[name]) for name in sorted(pages)]

    def chunks(i: int) -> Iterator[U8]:
        return (a[layer, i] for a in arrays for layer in range(a.shape[0]))

    return _digests(token_ids.shape[0], chunks, token_ids, static_scales)


def pool_page_digests(pool: PagePool, pages: npt.ArrayLike, token_ids: npt.NDArray[np.int64],
                      static_scales: npt.NDArray[np.float32] | None) -> U8:
    """``page_digests(gather_pages(pool, pages), token_ids, static_scales)`` without the
    gather's copy: ``[n, 16]`` uint8. A host pool's pages are hashed where they lie, layer by
    layer; a device pool's are copied to the host once, page-major (``[n, L, B]``), and each
    page hashed in one call. The pages must not change meanwhile (leased, read final)."""
    ids = np.asarray(pages, dtype=np.int64).reshape(-1)
    named = {"data": pool.data, "token_scales": pool.token_scales}
    tensors = [_bytes_view(t) for _, t in sorted(named.items()) if t is not None]
    if pool.device.type == "cpu":
        arrays = [t.numpy() for t in tensors]  # [L, P, B] views of the pool
        L = arrays[0].shape[0]

        def chunks(i: int) -> Iterator[U8]:
            p = int(ids[i])
            return (a[layer, p] for a in arrays for layer in range(L))
    else:
        ids_t = torch.as_tensor(ids, device=pool.device)
        host = [t.transpose(0, 1).index_select(0, ids_t).cpu().numpy().reshape(ids.size, -1)
                for t in tensors]  # [n, L * B] each

        def chunks(i: int) -> Iterator[U8]:
            return (h[i] for h in host)

    return _digests(ids.size, chunks, token_ids, static_scales)


@dataclass(frozen=True)
class PageBundle:
    """A run of full pages that left a pool (see the module docstring for the fields)."""

    identity: CacheIdentity
    namespace: Any
    token_ids: npt.NDArray[np.int64]
    prefix_keys: npt.NDArray[np.uint64]
    pages: dict[str, U8]
    static_scales: npt.NDArray[np.float32] | None
    page_digests: U8

    @property
    def num_pages(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def of(cls, pool: PagePool, pages: npt.ArrayLike, token_ids: npt.ArrayLike,
           identity: CacheIdentity, namespace: Any = None,
           prefix_keys: npt.ArrayLike | None = None) -> PageBundle:
        """Bundle ``pages`` (``[n]``) of ``pool`` holding ``token_ids`` (``[n * page_size]``)."""
        ids = np.asarray(pages, dtype=np.int64).reshape(-1)
        P = identity.page_size
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if tokens.size != ids.size * P:
            raise ArgumentError(f"{ids.size} full pages hold {ids.size * P} tokens; got "
                                f"{tokens.size} token ids")
        keys = (np.zeros((ids.size, 2), dtype=np.uint64) if prefix_keys is None
                else np.asarray(prefix_keys, dtype=np.uint64).reshape(ids.size, 2))
        data = gather_pages(pool, ids)
        static = static_scales_of(pool)
        page_tokens = tokens.reshape(ids.size, P)
        return cls(identity, namespace, page_tokens, keys, data, static,
                   page_digests(data, page_tokens, static))

    @property
    def digest(self) -> bytes:
        """The bundle's content digest: BLAKE2b of its page digests, namespace and identity."""
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"kvmem-bundle")
        h.update(self.page_digests.tobytes())
        h.update(repr((namespace_json(self.namespace), self.identity.to_json())).encode())
        return h.digest()

    def check(self) -> None:
        """Raise IntegrityError unless every page's bytes match its digest."""
        found = page_digests(self.pages, self.token_ids, self.static_scales)
        bad = np.flatnonzero((found != self.page_digests).any(axis=1))
        if bad.size:
            raise IntegrityError(f"page bundle: pages {bad.tolist()[:8]} of {self.num_pages} do "
                                 "not match their digests (corrupted or torn); do not load it")

    def to_bytes(self) -> bytes:
        arrays: dict[str, npt.NDArray[Any]] = {"token_ids": self.token_ids,
                                               "prefix_keys": self.prefix_keys,
                                               "page_digests": self.page_digests}
        arrays.update({f"pages.{k}": v for k, v in self.pages.items()})
        if self.static_scales is not None:
            arrays["static_scales"] = self.static_scales
        return pack("bundle", {"identity": self.identity.to_json(),
                               "namespace": namespace_json(self.namespace),
                               "digest": self.digest.hex()}, arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> PageBundle:
        """The bundle :meth:`to_bytes` wrote; raises IntegrityError if a page or the whole
        does not match its digest."""
        head, arrays = unpack(data, "bundle")
        try:
            bundle = cls(CacheIdentity.from_json(head["identity"]),
                         namespace_from_json(head["namespace"]), arrays["token_ids"],
                         arrays["prefix_keys"],
                         {k[6:]: v for k, v in arrays.items() if k.startswith("pages.")},
                         arrays.get("static_scales"), arrays["page_digests"])
        except (KeyError, TypeError) as e:
            raise ArgumentError(f"a page bundle without {e}") from None
        _require_layout(bundle)  # (the digests cover the arrays' bytes, not their names)
        bundle.check()
        if bundle.digest.hex() != head.get("digest"):
            raise IntegrityError("page bundle: its digest does not match its contents")
        return bundle

    def write_into(self, pool: PagePool, pages: npt.ArrayLike) -> None:
        """Store the bundle's bytes into ``pages`` (``[n]``) of a pool of the same storage
        (same dtype, scales and layout, and equal static scales): bit for bit."""
        ids = torch.as_tensor(np.asarray(pages, dtype=np.int64).reshape(-1), device=pool.device)
        if ids.numel() != self.num_pages:
            raise ArgumentError(f"{ids.numel()} pages for a bundle of {self.num_pages}")
        static = static_scales_of(pool)
        mine = self.static_scales
        same = (static is None and mine is None) or (
            static is not None and mine is not None and np.array_equal(static, mine))
        if not same:
            raise ArgumentError("the pool's static scales differ from the bundle's; load it "
                                "through a conversion (pool.write) instead")
        targets = {"data": pool.data, "token_scales": pool.token_scales}
        for name, arr in self.pages.items():
            t = targets.get(name)
            if t is None or _bytes_view(t).shape[2] != arr.shape[2]:
                raise ArgumentError(f"the pool has no {name} of the bundle's page size")
        for name, arr in self.pages.items():
            t = targets[name]
            assert t is not None
            _bytes_view(t).index_copy_(1, ids, torch.from_numpy(arr.copy()).to(pool.device))


def _require_layout(bundle: PageBundle) -> None:
    """Raise ArgumentError unless ``bundle.pages`` holds exactly the page arrays of its
    identity's layout, each ``[L, n, bytes]`` (a corrupted name or shape is refused)."""
    ident, n = bundle.identity, bundle.num_pages
    spec = ident.pool_spec(1, "cpu")
    L = ident.num_layers
    want = {k: (L, n, b // L) for k, b in (("data", spec.data_bytes_per_page),
                                          ("token_scales", spec.token_scale_bytes_per_page)) if b}
    got = {k: tuple(v.shape) for k, v in bundle.pages.items()}
    if got != want:
        raise ArgumentError(f"a page bundle whose page arrays {got} do not fit its identity's "
                            f"layout {want}")

