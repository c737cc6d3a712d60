"""The batched mapping check: does every page a request is about to read still belong to it?

For each request ``b`` of a batch, the kernel will read pages ``0 .. num_pages[b]-1`` from its
row of the metadata (a padded block table, or FlashInfer CSR). Entry ``(b, j)`` is good when the
page id is in range, the page is live (tag != 0) and its tag equals the tag the request recorded
when the page was mapped. Block-table entries past ``num_pages[b]`` must be the pad value.

One function per metadata format, each in a numpy form and a torch form (tensors on any device)
that return identical results. The torch form is imported lazily so this module needs no torch.

Metadata that is malformed as a whole (a field of the wrong rank, length or dtype, a
``kv_indptr`` that does not start at 0, decreases, or does not end at ``kv_indices``' length) is
no request's fault: :func:`validate_csr` and :func:`validate_block_table` refuse it with a
:class:`~kvmem.errors.MetadataError` naming the field, before anything is checked or changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from kvmem.errors import MetadataError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PAD",
    "BadEntries",
    "Reason",
    "check_block_table",
    "check_block_table_torch",
    "check_csr",
    "check_csr_torch",
    "require_int_array",
    "require_one_kind",
    "validate_block_table",
    "validate_csr",
]

PAD = -1  # what a block table holds past a request's pages (kvmem.integrity.PAD)


class Reason:
    """Why an entry failed (the ``reason`` codes of :class:`BadEntries`)."""

    OUT_OF_RANGE = 1  # page id outside 0..num_pages-1
    FREED = 2  # page is free (tag 0): freed behind the request's back
    REALLOCATED = 3  # page is live with another tag: freed and handed to someone else
    UNMAPPED = 4  # the request never recorded a page at this position
    PADDING = 5  # block-table entry past the request's pages is not the pad value
    LENGTH = 6  # CSR lists a different number of pages than the request maps, or a block
    # table is narrower than them

    NAMES: ClassVar[dict[int, str]] = {
        1: "page id out of range",
        2: "page was freed (tag 0) while still mapped",
        3: "page was reallocated to another lifetime (tag changed)",
        4: "no page was recorded at this position",
        5: "padding entry is not the pad value",
        6: "metadata lists a different number of pages than the request maps",
    }


class BadEntries(NamedTuple):
    """Every failing entry of a check, as parallel int64 arrays of length ``k``.

    batch_index: ``[k]`` — index into the batch (not the page-table row)
    position: ``[k]`` — page position within the request (-1 for a LENGTH failure)
    page: ``[k]`` — page id found in the metadata (-1 when none)
    expected_tag: ``[k]`` — tag the request recorded (0 when none)
    found_tag: ``[k]`` — tag the page carries now (-1 when the id is out of range)
    reason: ``[k]`` — a :class:`Reason` code
    """

    batch_index: npt.NDArray[np.int64]
    position: npt.NDArray[np.int64]
    page: npt.NDArray[np.int64]
    expected_tag: npt.NDArray[np.int64]
    found_tag: npt.NDArray[np.int64]
    reason: npt.NDArray[np.int64]

    @property
    def num_bad(self) -> int:
        return int(self.batch_index.size)


# -- validation: malformed metadata is refused, never checked -----------------------------------


def require_int_array(name: str, value: Any, shape: tuple[int | None, ...]) -> None:
    """Refuse ``value`` unless it is a numpy array or torch tensor of integers whose shape
    matches ``shape`` (1-D or 2-D; None: any length). Raises MetadataError naming the field."""
    if isinstance(value, np.ndarray):  # (the common case first, in a few attribute reads)
        got_shape = value.shape
        if value.dtype.kind in "iu" and len(got_shape) == len(shape) and (
                shape[0] is None or got_shape[0] == shape[0]) and (
                len(shape) < 2 or shape[1] is None or got_shape[1] == shape[1]):
            return
    if isinstance(value, np.ndarray):
        integer = value.dtype.kind in "iu"
    elif hasattr(value, "is_floating_point") and hasattr(value, "shape"):  # a torch tensor
        integer = not (value.is_floating_point() or value.is_complex()
                       or str(value.dtype) == "torch.bool")
    else:
        raise MetadataError(
            f"{name} must be a numpy array or a torch tensor of integers, got "
            f"{type(value).__name__}; pass the arrays the kernel reads (e.g. step.tensors())"
        )
    got = tuple(value.shape)
    if not integer or len(got) != len(shape) or any(
            want is not None and g != want for g, want in zip(got, shape)):
        want_text = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise MetadataError(
            f"{name} must be integers shaped {want_text}, got shape {list(got)} of "
            f"{value.dtype}; nothing was checked or changed"
        )


def validate_csr(kv_indptr: Any, kv_indices: Any, batch_size: int) -> None:
    """Refuse a CSR that is malformed as a whole: ``kv_indptr`` ``[batch_size + 1]`` from 0,
    non-decreasing, ending at ``kv_indices``' length; ``kv_indices`` ``[nnz]``; integers, numpy
    or torch. Raises MetadataError naming the field, what it is, and what was expected."""
    require_int_array("kv_indptr", kv_indptr, (batch_size + 1,))
    require_int_array("kv_indices", kv_indices, (None,))
    first, last = int(kv_indptr[0]), int(kv_indptr[-1])
    decreases = bool((kv_indptr[1:] < kv_indptr[:-1]).sum())
    if first != 0 or last != kv_indices.shape[0] or decreases:
        raise MetadataError(
            f"kv_indptr must start at 0, never decrease, and end at len(kv_indices) = "
            f"{kv_indices.shape[0]}; got first {first}, last {last}"
            f"{', and it decreases' if decreases else ''}. Nothing was checked or changed"
        )


def validate_block_table(block_table: Any, batch_size: int) -> None:
    """Refuse a block table that is not ``[batch_size, W]`` integers (numpy or torch)."""
    require_int_array("block_table", block_table, (batch_size, None))


def _require_inputs(torch_form: bool, metadata: dict[str, Any], num_pages: Any,
                    expected_tags: Any, tags: Any) -> None:
    """Refuse (MetadataError, nothing checked) what a check cannot compare: malformed metadata
    (:func:`validate_csr`, :func:`validate_block_table`), ``num_pages`` not ``[B]`` integers,
    ``expected_tags`` not ``[B, *]`` integers, ``tags`` not ``[*]`` integers, or an argument of
    the other form's kind (numpy arrays for the numpy form; tensors on one device for the
    torch form)."""
    require_int_array("num_pages", num_pages, (None,))
    batch = int(num_pages.shape[0])
    csr = "block_table" not in metadata
    if csr:
        require_int_array("kv_indptr", metadata["kv_indptr"], (batch + 1,))
        require_int_array("kv_indices", metadata["kv_indices"], (None,))
    else:
        validate_block_table(metadata["block_table"], batch)
    require_int_array("expected_tags", expected_tags, (batch, None))
    require_int_array("tags", tags, (None,))
    given = {**metadata, "num_pages": num_pages, "expected_tags": expected_tags, "tags": tags}
    if torch_form or not all(type(v) is np.ndarray for v in given.values()):
        require_one_kind(given, torch_form)
    if csr:
        validate_csr(metadata["kv_indptr"], metadata["kv_indices"], batch)


def require_one_kind(given: Mapping[str, Any], torch_form: bool | None = None) -> None:
    """Refuse (MetadataError naming them, nothing checked) arguments that mix numpy arrays with
    tensors, or tensors on different devices. ``torch_form``: which kind they must all be
    (a check's form); None: the kind of the first."""
    if torch_form is None:
        torch_form = not isinstance(next(iter(given.values())), np.ndarray)
    other = sorted(k for k, v in given.items() if isinstance(v, np.ndarray) == torch_form)
    if other:
        got, want = ("numpy arrays", "tensors") if torch_form else ("tensors", "numpy arrays")
        raise MetadataError(
            f"{', '.join(other)}: got {got} where the others are {want}: the check runs where "
            "the tags are; pass numpy metadata with numpy tags (allocator.tags, a step's "
            "arrays), tensors on one device with a device mirror (pool.tags, "
            "step.tensors(device)). Nothing was checked")
    devices = {k: str(v.device) for k, v in given.items()}
    if len(set(devices.values())) > 1:
        raise MetadataError(
            f"the tensors are on different devices ({devices}); pass them all on the device "
            "the tags are on. Nothing was checked")


def _reasons(xp: Any, in_range: Any, found: Any, expected: Any) -> Any:
    """Reason code per entry (0 = good); works for numpy and torch alike."""
    reason = xp.where(found != expected, Reason.REALLOCATED, 0)
    reason = xp.where(found == 0, Reason.FREED, reason)
    reason = xp.where(expected == 0, Reason.UNMAPPED, reason)
    return xp.where(in_range, reason, Reason.OUT_OF_RANGE)


def _lookup_np(
    page: npt.NDArray[Any], tags: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    in_range = (page >= 0) & (page < tags.shape[0])
    safe = tags if tags.shape[0] else np.zeros(1, dtype=np.int64)  # (no page: none in range)
    found = np.where(in_range, safe[np.clip(page, 0, safe.shape[0] - 1)], -1)
    return in_range, found


_EMPTY = np.empty(0, dtype=np.int64)
_NO_BAD_ENTRIES = BadEntries(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)


def _all_good_np(
    pages: npt.NDArray[Any], expected: npt.NDArray[np.int64], tags: npt.NDArray[np.int64]
) -> bool:
    """The fast verdict: every page in range, recorded, and carrying its recorded tag.

    A page with tag 0 cannot pass, since a recorded tag is never 0.
    """
    if pages.size == 0:
        return True
    if int(pages.min()) < 0 or int(pages.max()) >= tags.shape[0]:
        return False
    return bool(expected.all()) and np.array_equal(tags[pages], expected)


def check_block_table(
    block_table: npt.NDArray[np.int32],
    num_pages: npt.NDArray[np.integer[Any]],
    expected_tags: npt.NDArray[np.int64],
    tags: npt.NDArray[np.int64],
) -> BadEntries:
    """Check a padded block table against the recorded tags.

    A correct batch costs one masked gather and one comparison; only a failing one pays for the
    detailed pass that names every bad entry.

    Parameters
    ----------
    block_table: ``[B, W]``, int32 — what the kernel reads, PAD past each row's pages
    num_pages: ``[B]``, int — pages the kernel reads per row
    expected_tags: ``[B, >= W]``, int64 — tag recorded per (request, position); 0 = none
    tags: ``[num_physical_pages]``, int64 — current tag of every page (0 = free)

    Positions past ``expected_tags``' width count as recorded nothing (0); a row with more
    pages than ``W`` columns fails with LENGTH. Raises MetadataError for a block table that is
    not ``[B, W]`` integers, for other arguments not shaped as above, and for tensors (the
    torch form's).
    """
    _require_inputs(False, {"block_table": block_table}, num_pages, expected_tags, tags)
    expected_tags = _widen(expected_tags, block_table.shape[1])
    width = block_table.shape[1]
    inside = np.arange(width) < num_pages[:, None]
    too_few = np.flatnonzero(num_pages > width)  # the kernel would read past the table
    if not too_few.size and _all_good_np(
        block_table[inside], expected_tags[:, :width][inside], tags
    ) and (block_table[~inside] == PAD).all():
        return _NO_BAD_ENTRIES
    in_range, found = _lookup_np(block_table, tags)
    reason = _reasons(np, in_range, found, expected_tags[:, :width])
    reason = np.where(inside, reason, np.where(block_table != PAD, Reason.PADDING, 0))
    b, j = np.nonzero(reason)
    return _with_length_failures(BadEntries(
        b.astype(np.int64),
        j.astype(np.int64),
        block_table[b, j].astype(np.int64),
        np.where(inside[b, j], expected_tags[b, j], 0).astype(np.int64),
        found[b, j].astype(np.int64),
        reason[b, j].astype(np.int64),
    ), too_few)


def _with_length_failures(entries: BadEntries, batch_index: npt.NDArray[Any]) -> BadEntries:
    """``entries`` followed by a LENGTH failure (position, page and found tag -1, expected tag
    0) for each of ``batch_index``."""
    minus = np.full(batch_index.size, -1, dtype=np.int64)
    return BadEntries(
        np.concatenate([entries.batch_index, batch_index.astype(np.int64)]),
        np.concatenate([entries.position, minus]),
        np.concatenate([entries.page, minus]),
        np.concatenate([entries.expected_tag, np.zeros_like(minus)]),
        np.concatenate([entries.found_tag, minus]),
        np.concatenate([entries.reason, np.full_like(minus, Reason.LENGTH)]),
    )


def _widen(expected: Any, width: int) -> Any:
    """``expected`` ``[B, w]`` padded with zeros (nothing recorded) to at least ``width``."""
    if expected.shape[1] >= width:
        return expected
    if isinstance(expected, np.ndarray):
        return np.pad(expected, ((0, 0), (0, width - expected.shape[1])))
    import torch

    return torch.nn.functional.pad(expected, (0, width - expected.shape[1]))


def check_csr(
    kv_indptr: npt.NDArray[np.int32],
    kv_indices: npt.NDArray[np.int32],
    num_pages: npt.NDArray[np.integer[Any]],
    expected_tags: npt.NDArray[np.int64],
    tags: npt.NDArray[np.int64],
) -> BadEntries:
    """Check FlashInfer CSR metadata against the recorded tags.

    Parameters
    ----------
    kv_indptr: ``[B + 1]``, int32; kv_indices: ``[nnz]``, int32 — what the kernel reads
    num_pages: ``[B]``, int — pages each request should read
    expected_tags: ``[B, max_pages]``, int64 — tag recorded per (request, position); 0 = none
    tags: ``[num_physical_pages]``, int64 — current tag of every page (0 = free)

    Raises MetadataError for a malformed CSR (see :func:`validate_csr`), for other arguments
    not shaped as above, and for tensors (the torch form's).
    """
    _require_inputs(False, {"kv_indptr": kv_indptr, "kv_indices": kv_indices}, num_pages,
                    expected_tags, tags)
    expected_tags = _widen(expected_tags, 1)  # (nothing recorded: one column of zeros)
    indptr = kv_indptr.astype(np.int64)
    counts = indptr[1:] - indptr[:-1]
    width = int(counts.max()) if counts.size else 0
    if width <= expected_tags.shape[1] and np.array_equal(counts, num_pages):
        # Row-major order of the mask is CSR order: one masked gather lines the recorded tags
        # up with kv_indices.
        inside = np.arange(width) < counts[:, None]
        if _all_good_np(kv_indices, expected_tags[:, :width][inside], tags):
            return _NO_BAD_ENTRIES
    b = np.repeat(np.arange(counts.size), counts)
    j = np.arange(kv_indices.size) - np.repeat(kv_indptr[:-1].astype(np.int64), counts)
    j_ok = j < expected_tags.shape[1]
    expected = np.where(j_ok, expected_tags[b, np.minimum(j, expected_tags.shape[1] - 1)], 0)
    in_range, found = _lookup_np(kv_indices, tags)
    reason = _reasons(np, in_range, found, expected)
    bad = np.flatnonzero(reason)
    return _with_length_failures(BadEntries(
        b[bad].astype(np.int64),
        j[bad].astype(np.int64),
        kv_indices[bad].astype(np.int64),
        expected[bad].astype(np.int64),
        found[bad].astype(np.int64),
        reason[bad].astype(np.int64),
    ), np.flatnonzero(counts != num_pages))


# -- torch forms: same logic on tensors of any device ------------------------------------------


def _to_numpy(*tensors: torch.Tensor) -> list[npt.NDArray[np.int64]]:
    return [t.to("cpu", copy=False).numpy().astype(np.int64) for t in tensors]


def _lookup_torch(page: torch.Tensor, tags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    in_range = (page >= 0) & (page < tags.shape[0])
    safe = tags if tags.shape[0] else tags.new_zeros(1)  # (no page: none in range)
    found = torch.where(in_range, safe[page.long().clamp(0, safe.shape[0] - 1)], -1)
    return in_range, found


def check_block_table_torch(
    block_table: torch.Tensor,
    num_pages: torch.Tensor,
    expected_tags: torch.Tensor,
    tags: torch.Tensor,
) -> BadEntries:
    """:func:`check_block_table` on torch tensors (all on one device); the host waits for the
    device a few times (nonzero, the copies back), never once per entry."""
    import torch

    _require_inputs(True, {"block_table": block_table}, num_pages, expected_tags, tags)
    block_table = block_table.long()  # (a uint8 255 is no PAD: compared as numpy compares it)
    expected_tags = _widen(expected_tags, block_table.shape[1])
    width = block_table.shape[1]
    inside = torch.arange(width, device=block_table.device) < num_pages[:, None]
    in_range, found = _lookup_torch(block_table, tags)
    expected = expected_tags[:, :width]
    reason = _reasons(torch, in_range, found, expected)
    reason = torch.where(inside, reason, (block_table != PAD).long() * Reason.PADDING)
    b, j = torch.nonzero(reason, as_tuple=True)
    arrays = _to_numpy(
        b, j, block_table[b, j], torch.where(inside[b, j], expected[b, j], 0), found[b, j],
        reason[b, j], torch.nonzero(num_pages > width, as_tuple=True)[0],
    )
    return _with_length_failures(BadEntries(*arrays[:6]), arrays[6])


def check_csr_torch(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_pages: torch.Tensor,
    expected_tags: torch.Tensor,
    tags: torch.Tensor,
) -> BadEntries:
    """:func:`check_csr` on torch tensors (all on one device); the host waits for the device a
    few times (repeat_interleave, nonzero, the copies back), never once per entry."""
    import torch

    _require_inputs(True, {"kv_indptr": kv_indptr, "kv_indices": kv_indices}, num_pages,
                    expected_tags, tags)
    expected_tags = _widen(expected_tags, 1)  # (nothing recorded: one column of zeros)
    counts = kv_indptr[1:].long() - kv_indptr[:-1].long()
    b = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    j = torch.arange(kv_indices.numel(), device=counts.device) - kv_indptr[:-1].long()[b]
    max_pages = expected_tags.shape[1]
    expected = torch.where(j < max_pages, expected_tags[b, j.clamp(max=max_pages - 1)], 0)
    in_range, found = _lookup_torch(kv_indices, tags)
    reason = _reasons(torch, in_range, found, expected)
    bad = torch.nonzero(reason, as_tuple=True)[0]
    wrong_len = torch.nonzero(counts != num_pages.long(), as_tuple=True)[0]
    parts = _to_numpy(b[bad], j[bad], kv_indices[bad], expected[bad], found[bad], reason[bad],
                      wrong_len)
    return _with_length_failures(BadEntries(*parts[:6]), parts[6])
