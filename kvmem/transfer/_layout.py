"""Where a pool's pages lie in memory, as transport descriptors (see ``_transport.py``).

A pool's page bytes are one tensor ``pages [L, P, page_bytes]`` (``PagePool.page_bytes()``):
page ``p`` of layer ``l`` starts at ``base + l * layer_stride + p * page_bytes``. Pages adjacent
in memory and in the id list go as one descriptor per layer (a run); two sides of one read merge
only where both are adjacent, so that row ``i`` of each side has the same length::

    page ids    [3, 4, 5, 9]       runs: [3, 4, 5] [9]      starts: [0, 3]
    descs       layer 0: (base+3pb, 3pb) (base+9pb, pb)   layer 1: ...   -> L * 2 rows, not L * 4
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvmem.errors import ArgumentError

__all__ = ["page_descs", "run_starts"]


def run_starts(*page_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """Indices where a run of adjacent pages begins in every id list at once.

    page_ids: one or more int arrays ``[n]`` of the same length (a source's and a destination's
    ids); returns int64 ``[num_runs]``, starting with 0 (empty for ``n == 0``).
    """
    ids = [np.asarray(p, dtype=np.int64) for p in page_ids]
    n = len(ids[0])
    if any(len(p) != n for p in ids):
        raise ArgumentError(f"page id lists differ in length: {[len(p) for p in ids]}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = np.zeros(n - 1, dtype=bool)
    for p in ids:
        breaks |= np.diff(p) != 1
    return np.concatenate(([0], np.flatnonzero(breaks) + 1)).astype(np.int64)


def page_descs(
    pages: torch.Tensor,
    page_ids: npt.ArrayLike,
    *,
    merge: bool = True,
    starts: npt.ArrayLike | None = None,
) -> npt.NDArray[np.int64]:
    """Descriptors of ``page_ids`` in every layer of ``pages``, layer-major.

    pages: ``[L, P, page_bytes]`` uint8, each page's bytes contiguous (``PagePool.page_bytes()``).
    page_ids: int ``[n]``, each in ``[0, P)``.
    merge: one descriptor per run of adjacent pages (``starts``, default ``run_starts(page_ids)``);
    ``False``: one per page. Returns int64 ``[L * num_runs, 3]`` (address, nbytes, device id).
    """
    if pages.dim() != 3 or pages.dtype != torch.uint8 or pages.stride(2) != 1:
        raise ArgumentError(
            f"pages must be a [layers, pages, page_bytes] uint8 tensor with contiguous pages; "
            f"got {pages.dtype} {tuple(pages.shape)} strides {pages.stride()}: pass "
            "PagePool.page_bytes()"
        )
    num_layers, num_pages, page_bytes = pages.shape
    ids = np.asarray(page_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= num_pages)):
        raise ArgumentError(f"page ids must be a 1-D array in [0, {num_pages}); got {ids}")
    if pages.stride(1) != page_bytes:
        merge = False  # pages of a layer are not back to back: no run is contiguous
    if not merge:
        first = np.arange(len(ids), dtype=np.int64)
    else:
        first = run_starts(ids) if starts is None else np.asarray(starts, dtype=np.int64)
        inside = np.ones(len(ids), dtype=bool)
        inside[first[(first >= 0) & (first < len(ids))]] = False
        if len(ids) and (first[:1].tolist() != [0] or np.any(np.diff(first) <= 0)
                         or np.any(np.diff(ids)[inside[1:]] != 1)):
            raise ArgumentError(f"starts {first} do not cut page ids {ids} into runs of "
                                "adjacent pages: pass run_starts(page_ids, ...)")
    run_len = np.diff(np.append(first, len(ids)))
    layer_base = pages.data_ptr() + np.arange(num_layers, dtype=np.int64) * pages.stride(0)
    addr = layer_base[:, None] + ids[first][None, :] * pages.stride(1)
    out = np.empty((num_layers * len(first), 3), dtype=np.int64)
    out[:, 0] = addr.ravel()
    out[:, 1] = np.tile(run_len * page_bytes, num_layers)
    out[:, 2] = max(pages.get_device(), 0)
    return out
