"""GroupPool: the pages of every KV cache group of a hybrid model in ONE byte buffer.

The buffer is the :class:`~kvmem.allocator.GroupAllocator`'s budget, chunk by chunk. Page
``p`` of group ``g`` lies at ``GroupAllocator.byte_offsets(g, p)``: chunk ``p //
pages_per_chunk``, slot ``p % pages_per_chunk`` in it. Every group sees its pages through a
strided view of the same bytes (no padding, no copies)::

    buffer (uint8)   |chunk 0            |chunk 1            |chunk 2            |
    group 'full'      [page 0][page 1]                         [page 4][page 5]
    group 'state'                         [slot 1      ]
    view of a field   as_strided(shape (num_chunks, pages_per_chunk, *field_shape),
                                 strides (chunk_bytes, page_bytes, contiguous) / itemsize)

A group's page is a record of named fields, laid out one after another, each contiguous: an
attention group's page holds ``k<l>`` and ``v<l>`` (``[page_size, kv_heads, head_dim]``) for
each of its layers; a state group's page (one request's state) holds each layer's conv and
recurrent states; an indexer group's page holds each layer's indexer keys. The fields' bytes
must add up to the group spec's ``page_bytes``: the allocator charges exactly what the pool
stores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from kvmem._validate import show
from kvmem.allocator import GroupAllocator
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError

__all__ = ["GroupPool"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class GroupPool:
    """One buffer of ``allocator``'s chunks; every group's pages are strided views of it.

    Parameters
    ----------
    allocator:
        The groups' allocator (a ``HybridManager``'s ``allocator``); page ids are its ids.
    fields:
        ``{group: {field: shape of the field in one page}}``, for every group; a token
        group's field shapes start with its ``page_size`` (one row per token).
    dtype:
        The element type of every field (fp32, bf16, fp16, fp64).
    device:
        Where the buffer lives.

    Raises
    ------
    ConfigError
        A group's fields do not add up to its spec's ``page_bytes``, a token group's field
        does not hold ``page_size`` tokens, or the chunk size is not a whole number of
        elements.
    """

    def __init__(self, allocator: GroupAllocator, fields: Mapping[str, Mapping[str, Sequence[int]]],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if not isinstance(allocator, GroupAllocator):
            raise ArgumentTypeError(f"allocator={show(allocator)}: expected a GroupAllocator "
                                    "(e.g. HybridManager(...).allocator)")
        if dtype not in _DTYPES:
            raise ArgumentTypeError(f"dtype={show(dtype)}: expected one of {_DTYPES}")
        if not isinstance(fields, Mapping) or set(fields) != set(allocator.names):
            got = sorted(fields) if isinstance(fields, Mapping) else show(fields)
            raise ConfigError(f"fields names groups {got}; the allocator's groups are "
                              f"{list(allocator.names)}: give every group its fields")
        self.allocator = allocator
        self.dtype = dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        chunk_bytes = allocator.chunk_bytes
        if chunk_bytes % self.itemsize:
            raise ConfigError(f"chunk_bytes={chunk_bytes} is not a multiple of {dtype}'s "
                              f"{self.itemsize} bytes: pick a chunk size that is")
        self.num_chunks = allocator.arena.num_chunks
        self.buffer = torch.zeros(self.num_chunks * chunk_bytes, dtype=torch.uint8,
                                  device=device)
        self._elements = self.buffer.view(dtype)
        # {group: {field: (element offset in the page, shape)}}
        self._fields: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {}
        for spec in allocator.groups:
            offset, layout = 0, {}
            for name, shape in fields[spec.name].items():
                dims = tuple(int(d) for d in shape)
                if not dims or min(dims) < 1:
                    raise ConfigError(f"group {spec.name!r} field {name!r}: shape {dims} must "
                                      "have positive dimensions")
                if spec.page_size and dims[0] != spec.page_size:
                    raise ConfigError(f"group {spec.name!r} field {name!r}: shape {dims} must "
                                      f"start with the group's page_size {spec.page_size}")
                layout[name] = (offset, dims)
                offset += math.prod(dims)
            if offset * self.itemsize != spec.page_bytes:
                raise ConfigError(f"group {spec.name!r}: its fields hold {offset * self.itemsize}"
                                  f" bytes per page but its spec charges {spec.page_bytes}; "
                                  "derive the spec and the fields from one description")
            self._fields[spec.name] = layout

    # -- views ---------------------------------------------------------------------------------

    def field(self, group: str, name: str) -> torch.Tensor:
        """``[num_chunks, pages_per_chunk, *shape]``: field ``name`` of every page of ``group``,
        a view of the buffer (page ``p`` at ``[p // pages_per_chunk, p % pages_per_chunk]``)."""
        offset, shape = self._field(group, name)
        g = self.allocator.names.index(group)
        inner = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return torch.as_strided(
            self._elements, (self.num_chunks, self.allocator.pages_per_chunk[g], *shape),
            (self.allocator.chunk_bytes // self.itemsize,
             self.allocator.page_bytes[g] // self.itemsize, *inner),
            offset)

    def page_bytes(self, group: str) -> torch.Tensor:
        """``[num_chunks, pages_per_chunk, page_bytes]`` uint8: every page of ``group``, a view."""
        self._field(group, None)
        g = self.allocator.names.index(group)
        pb = self.allocator.page_bytes[g]
        return torch.as_strided(self.buffer, (self.num_chunks, self.allocator.pages_per_chunk[g],
                                              pb), (self.allocator.chunk_bytes, pb, 1))

    def locate(self, group: str, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chunk, slot)`` of each page id (``[k]`` int64 each): where ``field`` keeps it."""
        ppc = self.allocator.pages_per_chunk[self.allocator.names.index(group)]
        pages = pages.to(device=self.buffer.device, dtype=torch.int64)
        return pages // ppc, pages % ppc

    def gather(self, group: str, name: str, pages: torch.Tensor) -> torch.Tensor:
        """``[k, *shape]``: field ``name`` of pages ``pages`` (``[k]`` int), a copy."""
        return self.field(group, name)[self.locate(group, pages)]

    def page(self, group: str, name: str, page: int) -> torch.Tensor:
        """``[*shape]``: field ``name`` of one page (a state slot), a view to read and write."""
        chunk, slot = divmod(int(page), self.allocator.pages_per_chunk[
            self.allocator.names.index(group)])
        return self.field(group, name)[chunk, slot]

    # -- writes --------------------------------------------------------------------------------

    def write_tokens(self, group: str, name: str, slot_mapping: torch.Tensor,
                     values: torch.Tensor) -> None:
        """Write token ``t``'s row ``values[t]`` (``[T, *shape[1:]]``) at ``slot_mapping[t]``
        (``[T]`` int64, ``page * page_size + offset``) of a token group's field."""
        _, shape = self._field(group, name)
        if values.shape[1:] != shape[1:] or values.shape[0] != slot_mapping.shape[0]:
            raise ArgumentError(f"values {tuple(values.shape)} for {slot_mapping.shape[0]} slots "
                                f"of field {name!r} of group {group!r} (rows of {shape[1:]})")
        slots = slot_mapping.to(device=self.buffer.device, dtype=torch.int64)
        chunk, slot = self.locate(group, slots // shape[0])
        self.field(group, name)[chunk, slot, slots % shape[0]] = values.to(self.dtype)

    def copy_pages(self, copies: Iterable[tuple[str, int, int]]) -> None:
        """Make the copies a ``HybridManager.take_copies()`` lists: each ``(group, src, dst)``
        copies page (or state slot) ``src`` of ``group`` into ``dst``, every field, in order."""
        for group, src, dst in copies:
            view = self.page_bytes(group)
            ppc = self.allocator.pages_per_chunk[self.allocator.names.index(group)]
            view[divmod(int(dst), ppc)].copy_(view[divmod(int(src), ppc)])

    # -- internals -----------------------------------------------------------------------------

    def _field(self, group: str, name: str | None) -> tuple[int, tuple[int, ...]]:
        layout = self._fields.get(group) if isinstance(group, str) else None
        if layout is None:
            raise ArgumentError(f"group={group!r}: no such group; the groups are "
                                f"{list(self._fields)}")
        if name is None:
            return 0, ()
        if name not in layout:
            raise ArgumentError(f"field={name!r}: group {group!r} has fields {list(layout)}")
        return layout[name]
