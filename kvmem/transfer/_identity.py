"""CacheIdentity: what a cache's pages mean, so two sides can tell whether they may exchange them.

::

    model, weights      the engine's names for the model and its weights (a fingerprint: a
                        checkpoint hash, a revision); pages of other weights are other numbers
    page_size, attention, num_layers, num_kv_heads, head_dim, kv_lora_rank, qk_rope_head_dim
                        the shape of a page: must be equal on both sides
    dtype, scales, layout
                        how the page is stored: may differ (the receiver converts: it reads
                        the sender's bytes into a staging pool and writes them through its own)
    format_version      kvmem's bundle/message format (FORMAT_VERSION)

:meth:`CacheIdentity.check` refuses a peer whose shape, model, weights or format differ,
naming the first field that does (:class:`~kvmem.errors.IncompatibleCacheError`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from kvmem.cuda import PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, IncompatibleCacheError

__all__ = ["FORMAT_VERSION", "CacheIdentity"]

FORMAT_VERSION = 2
_CONVERTED = ("dtype", "scales", "layout")  # differ -> converted, not refused


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """The identity of a page pool's contents (see the module docstring)."""

    model: str
    weights: str
    dtype: str
    scales: str | None
    page_size: int
    attention: str
    num_layers: int
    num_kv_heads: int | None
    head_dim: int | None
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    layout: str
    format_version: int = FORMAT_VERSION

    @classmethod
    def of(cls, spec: PoolSpec, model: str, weights: str) -> CacheIdentity:
        """The identity of pages of ``spec``, for ``model`` with ``weights`` (engine-given)."""
        if not isinstance(spec, PoolSpec):
            raise ArgumentTypeError(f"spec: expected a PoolSpec, got {type(spec).__name__}")
        for name, value in (("model", model), ("weights", weights)):
            if not isinstance(value, str) or not value:
                raise ArgumentError(f"{name}={value!r}: expected a non-empty str (the engine's "
                                    "name or fingerprint)")
        return cls(model, weights, spec.dtype, spec.scales, spec.page_size, spec.attention,
                   spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_lora_rank,
                   spec.qk_rope_head_dim, spec.layout)

    def check(self, peer: CacheIdentity) -> None:
        """Raise IncompatibleCacheError, naming the field, unless ``peer``'s pages can be
        loaded into pages of this identity (equal but for dtype, scales and layout)."""
        for f in fields(self):
            if f.name in _CONVERTED:
                continue
            mine, theirs = getattr(self, f.name), getattr(peer, f.name)
            if mine != theirs:
                raise IncompatibleCacheError(f.name, mine, theirs)

    def same_storage(self, peer: CacheIdentity) -> bool:
        """Whether ``peer``'s page bytes are this identity's as they are (no conversion)."""
        return all(getattr(self, n) == getattr(peer, n) for n in _CONVERTED)

    def pool_spec(self, num_pages: int, device: str) -> PoolSpec:
        """A PoolSpec for pages of this identity (a staging pool)."""
        return PoolSpec(num_pages=num_pages, device=device, page_size=self.page_size,
                        attention=self.attention, num_layers=self.num_layers,
                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
                        dtype=self.dtype, scales=self.scales, layout=self.layout)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> CacheIdentity:
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ArgumentError(f"a cache identity needs exactly the fields {sorted(names)}; got "
                                f"{sorted(data) if isinstance(data, dict) else data!r}")
        return cls(**data)

    def replace(self, **changes: Any) -> CacheIdentity:
        return replace(self, **changes)
