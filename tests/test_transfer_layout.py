"""page_descs and run_starts: page addresses as descriptors, adjacent pages of a layer merged."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvmem.errors import ArgumentError
from kvmem.transfer._layout import page_descs, run_starts

L, P, PAGE_BYTES = 2, 16, 64


def _bytes(descs: np.ndarray) -> bytes:
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n, _ in descs)


@pytest.fixture
def pages() -> torch.Tensor:
    return torch.randint(0, 256, (L, P, PAGE_BYTES), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))


def test_run_starts_cut_where_any_list_breaks() -> None:
    assert run_starts([3, 4, 5, 9, 10]).tolist() == [0, 3]
    assert run_starts([3, 4, 5, 9, 10], [0, 1, 7, 8, 9]).tolist() == [0, 2, 3]
    assert run_starts([]).tolist() == []
    with pytest.raises(ArgumentError, match="length"):
        run_starts([1, 2], [1])


@pytest.mark.parametrize("merge", [True, False])
def test_descs_name_the_pages_bytes_layer_major(pages: torch.Tensor, merge: bool) -> None:
    ids = np.array([3, 4, 5, 9, 0])
    descs = page_descs(pages, ids, merge=merge)
    assert descs.dtype == np.int64 and descs.shape == (L * (3 if merge else 5), 3)
    assert _bytes(descs) == pages[:, ids].contiguous().numpy().tobytes()
    assert (descs[:, 2] == 0).all()


def test_merging_follows_the_given_starts(pages: torch.Tensor) -> None:
    """Two sides of one read merge only where both are adjacent: rows pair up one to one."""
    src, dst = np.array([0, 1, 2, 3]), np.array([5, 6, 9, 10])
    starts = run_starts(src, dst)
    a, b = page_descs(pages, src, starts=starts), page_descs(pages, dst, starts=starts)
    assert a.shape == b.shape == (L * 2, 3)
    assert (a[:, 1] == b[:, 1]).all()
    with pytest.raises(ArgumentError, match="runs of adjacent pages"):
        page_descs(pages, dst, starts=[0])  # 6 -> 9 is not adjacent
    with pytest.raises(ArgumentError, match="runs"):
        page_descs(pages, src, starts=[1])


def test_bad_pages_are_refused(pages: torch.Tensor) -> None:
    with pytest.raises(ArgumentError, match=r"\[0, 16\)"):
        page_descs(pages, [16])
    with pytest.raises(ArgumentError, match=r"\[0, 16\)"):
        page_descs(pages, [-1])
    with pytest.raises(ArgumentError, match="uint8"):
        page_descs(pages.view(torch.int32), [0])


def test_a_strided_layer_never_merges(pages: torch.Tensor) -> None:
    every_other = pages[:, ::2]
    descs = page_descs(every_other, [0, 1, 2])
    assert descs.shape == (L * 3, 3)
    assert _bytes(descs) == every_other[:, :3].contiguous().numpy().tobytes()
