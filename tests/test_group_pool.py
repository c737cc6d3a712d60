"""GroupPool: every KV cache group's pages as strided views of one byte buffer, at the byte
offsets the GroupAllocator gives them; no group's page overlaps another's while both are held."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem.allocator import FullAttentionSpec, GroupAllocator, SlidingWindowSpec, StateSpec
from kvmem.cuda import GroupPool
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError

FULL = FullAttentionSpec("full", page_size=4, bytes_per_token=2 * 2 * 3 * 4)  # k, v [2, 3] fp32
SWA = SlidingWindowSpec("swa", window=6, page_size=2, bytes_per_token=5 * 4)
STATE = StateSpec("state", bytes_per_state=(7 + 2 * 3) * 4)
FIELDS = {"full": {"k": (4, 2, 3), "v": (4, 2, 3)}, "swa": {"x": (2, 5)},
          "state": {"conv": (7,), "rec": (2, 3)}}


def pool(budget: int = 4096, chunk_bytes: int | None = None) -> GroupPool:
    return GroupPool(GroupAllocator([FULL, SWA, STATE], budget, chunk_bytes), FIELDS)


def test_a_page_lies_at_the_allocators_byte_offset() -> None:
    p = pool()
    ga = p.allocator
    for group, fields in FIELDS.items():
        pages = ga.allocate({group: 3})[group]
        offset = 0
        for name, shape in fields.items():
            n = int(np.prod(shape))
            for page in pages.tolist():
                values = torch.arange(n, dtype=torch.float32).reshape(shape) + 1000 * page
                p.page(group, name, page).copy_(values)
                at = int(ga.byte_offsets(group, [page])[0]) + offset * 4
                stored = p.buffer[at : at + 4 * n].view(torch.float32).reshape(shape)
                assert torch.equal(stored, values)
            offset += n


def test_groups_pages_held_at_once_never_overlap() -> None:
    """Pages of three groups, allocated together from shared chunks, each filled with its own
    pattern: every page reads back its own bytes."""
    p = pool(chunk_bytes=192)
    pages = p.allocator.allocate({"full": 5, "swa": 9, "state": 4})
    fill = 0
    for group, ids in pages.items():
        for page in ids.tolist():
            fill += 1
            p.page_bytes(group)[p.locate(group, torch.tensor(page))].fill_(fill)
    fill = 0
    for group, ids in pages.items():
        for page in ids.tolist():
            fill += 1
            view = p.page_bytes(group)[p.locate(group, torch.tensor(page))]
            assert bool((view == fill).all()), (group, page)


def test_tokens_are_written_at_their_slots_and_gathered_by_page() -> None:
    p = pool()
    pages = p.allocator.allocate({"full": 2})["full"]
    slots = torch.tensor([int(pages[1]) * 4 + 2, int(pages[0]) * 4 + 3])
    rows = torch.randn(2, 2, 3)
    p.write_tokens("full", "v", slots, rows)
    got = p.gather("full", "v", torch.from_numpy(pages))  # [2 pages, 4 tokens, 2, 3]
    assert torch.equal(got[1, 2], rows[0]) and torch.equal(got[0, 3], rows[1])
    with pytest.raises(ArgumentError, match="values"):
        p.write_tokens("full", "v", slots, torch.randn(2, 3, 3))


def test_copy_pages_copies_every_field_of_a_page() -> None:
    p = pool()
    src, dst = p.allocator.allocate({"state": 2})["state"].tolist()
    p.page("state", "conv", src).copy_(torch.randn(7))
    p.page("state", "rec", src).copy_(torch.randn(2, 3))
    p.copy_pages([("state", src, dst)])
    for name in ("conv", "rec"):
        assert torch.equal(p.page("state", name, dst), p.page("state", name, src))


def test_fields_that_do_not_match_the_specs_bytes_are_refused() -> None:
    ga = GroupAllocator([FULL, SWA, STATE], 4096)
    with pytest.raises(ConfigError, match=r"'state'.*charges"):
        GroupPool(ga, {**FIELDS, "state": {"conv": (7,)}})
    with pytest.raises(ConfigError, match="page_size"):
        GroupPool(ga, {**FIELDS, "swa": {"x": (5, 2)}})
    with pytest.raises(ConfigError, match="every group"):
        GroupPool(ga, {"full": FIELDS["full"]})
    with pytest.raises(ArgumentTypeError):
        GroupPool(ga, FIELDS, dtype=torch.int8)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        GroupPool(GroupAllocator([StateSpec("s", 6)], 600, 15), {"s": {"x": (3,)}},
                  dtype=torch.float16)  # a page of the next chunk would start mid-element
    with pytest.raises(ArgumentError, match="no such group"):
        pool().field("nope", "k")
