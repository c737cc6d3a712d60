"""Page addresses as transport descriptors (``int64 [n, 3]``: address, nbytes, device id).

A pool's storage tensors are ``[num_layers, num_pages, ...]`` and contiguous, so page ``p`` of
layer ``l`` is one byte range::

    address = base + (l * num_pages + p) * page_nbytes        page_nbytes: one page, one layer

A :class:`Region` is that arithmetic for one tensor (it travels in a transfer message: the
receiver computes the sender's addresses). Rows whose byte ranges follow each other merge into
one descriptor: adjacent pages of a layer (and, where a run reaches the last page, the next
layer's first page). For a read, source and destination rows merge only where both sides are
contiguous (:func:`paired_descs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError

if TYPE_CHECKING:
    import torch

    from kvmem.cuda import PagePool
    from kvmem.transfer._transport import Transport

__all__ = ["Region", "merge_descs", "page_descs", "paired_descs", "tensor_descs"]

Descs = npt.NDArray[np.int64]


def _device_id(t: torch.Tensor) -> int:
    return 0 if t.device.type == "cpu" else int(t.device.index or 0)


class Region(NamedTuple):
    """One pool tensor's pages: ``[num_layers, num_pages, page_nbytes bytes]`` at ``address``."""

    address: int
    num_layers: int
    num_pages: int
    page_nbytes: int
    device: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Region:
        """The region of a contiguous pool tensor ``[num_layers, num_pages, ...]``."""
        if not t.is_contiguous() or t.dim() < 2:
            raise ArgumentError(f"a region needs a contiguous [layers, pages, ...] tensor; got "
                                f"shape {tuple(t.shape)}")
        L, P = int(t.shape[0]), int(t.shape[1])
        return cls(int(t.data_ptr()), L, P, t.nbytes // max(L * P, 1), _device_id(t))

    def to_json(self) -> list[int]:
        return list(self)

    @classmethod
    def from_json(cls, v: Any) -> Region:
        if not (isinstance(v, list) and len(v) == 5 and all(type(x) is int for x in v)):
            raise ArgumentError(f"malformed region {v!r}")
        return cls(*v)


def tensor_descs(*tensors: torch.Tensor) -> Descs:
    """One descriptor per whole tensor (what a transport registers): ``[k, 3]``, int64."""
    return np.array([[t.data_ptr(), t.nbytes, _device_id(t)] for t in tensors],
                    dtype=np.int64).reshape(-1, 3)


def page_descs(region: Region, pages: npt.ArrayLike, merge: bool = True) -> Descs:
    """Descriptors of ``pages`` (``[n]`` ints) in every layer, layer-major: ``[L * n, 3]``
    int64 unmerged; fewer rows merged (contiguous rows joined)."""
    p = np.asarray(pages, dtype=np.int64).reshape(-1)
    if p.size and (p.min() < 0 or p.max() >= region.num_pages):
        raise ArgumentError(f"pages {p.min()}..{p.max()} out of the region's 0.."
                            f"{region.num_pages - 1}")
    layers = np.arange(region.num_layers, dtype=np.int64)[:, None]
    index = (layers * region.num_pages + p[None, :]).reshape(-1)
    out = np.empty((index.size, 3), dtype=np.int64)
    out[:, 0] = region.address + index * region.page_nbytes
    out[:, 1] = region.page_nbytes
    out[:, 2] = region.device
    return merge_descs(out) if merge else out


def _joins(d: Descs) -> npt.NDArray[np.bool_]:
    """[n - 1]: whether row i + 1 continues row i (same device, next byte)."""
    return (d[1:, 0] == d[:-1, 0] + d[:-1, 1]) & (d[1:, 2] == d[:-1, 2])


def _merge_where(d: Descs, joins: npt.NDArray[np.bool_]) -> Descs:
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    out = d[starts].copy()
    out[:, 1] = np.add.reduceat(d[:, 1], starts)
    return out


def merge_descs(descs: Descs) -> Descs:
    """Join rows whose byte ranges follow each other: ``[m, 3]``, m <= n."""
    return descs.copy() if len(descs) < 2 else _merge_where(descs, _joins(descs))


def paired_descs(src: Region, src_pages: npt.ArrayLike, dst: Region, dst_pages: npt.ArrayLike,
                 merge: bool = True) -> tuple[Descs, Descs]:
    """(source, destination) descriptors that copy ``src_pages`` onto ``dst_pages`` (``[n]``
    each, every layer): rows merged only where both sides are contiguous, so row ``i`` of
    each has the same ``nbytes``."""
    if src.page_nbytes != dst.page_nbytes or src.num_layers != dst.num_layers:
        raise ArgumentError(f"regions differ: {src.num_layers} layers x {src.page_nbytes} B "
                            f"per page vs {dst.num_layers} x {dst.page_nbytes}")
    s = page_descs(src, src_pages, merge=False)
    d = page_descs(dst, dst_pages, merge=False)
    if s.shape != d.shape:
        raise ArgumentError(f"{len(s)} source rows for {len(d)} destination rows")
    if not merge or len(s) < 2:
        return s, d
    joins = _joins(s) & _joins(d)
    return _merge_where(s, joins), _merge_where(d, joins)


def register_pool(pool: PagePool, transport: Transport) -> dict[str, Region]:
    """Register ``pool``'s page tensors (data and, for fp8 token_head scales, its scales) with
    ``transport`` for reads; their regions (:class:`Region`) by name, as a message names them."""
    tensors = {name: t for name, t in (("data", pool.data), ("token_scales", pool.token_scales))
               if t is not None}
    transport.register(tensor_descs(*tensors.values()))
    return {name: Region.of(t) for name, t in tensors.items()}
