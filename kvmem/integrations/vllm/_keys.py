"""What a vLLM request's pages are keyed by in kvmem: its namespace and its key tokens.

vLLM keys block ``j`` by its tokens, its parent's key and the block's extra keys; the ones that
depend on the request only (a LoRA adapter's name and path on every block, the cache salt on
the first) are one namespace in kvmem (the root of its key chain), and the multimodal ones
(each mm input the block overlaps: its identifier and its offset from the block's start) are
folded into the block's token ids:

    namespace        cache_salt or None; with a LoRA adapter ("lora", name, path, salt or None)
    key token i      vLLM's token t, except in a block with multimodal extra keys, where it is
                     2**30 | (t ^ mask[i]), mask[i] a 30-bit hash of the block's extra keys
                     and i's place in the block

So two blocks share a kvmem key exactly when vLLM's keys agree: same tokens (the fold is one to
one for a given mask), same extra keys (else every position's mask differs but with odds
2**-30), same parents. A block with extra keys never matches one without (its ids are
>= 2**30, vocabulary ids are below). vLLM-free: reads the request's fields only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from kvmem.errors import ArgumentError, KVMemError

__all__ = ["KEY_TOKEN_BASE", "KeyTokens", "key_tokens", "mm_extra_keys", "namespace_of"]

#: Key tokens of blocks with multimodal extra keys are at or above this; token ids are below.
KEY_TOKEN_BASE = 1 << 30
_MASK = KEY_TOKEN_BASE - 1


def namespace_of(request: Any) -> Any:
    """The kvmem namespace of a vLLM request: its ``cache_salt`` (an empty salt is none: vLLM
    adds a salt to a block's keys only when it is non-empty), with its LoRA adapter's name and
    path when it has one (vLLM adds them to every block's keys)."""
    salt = request.cache_salt or None
    lora = request.lora_request
    if lora is None:
        return salt
    return ("lora", lora.lora_name, lora.lora_path, salt)


def mm_extra_keys(features: Any, block_size: int
                  ) -> list[tuple[int, tuple[tuple[str, str, int], ...]]]:
    """The blocks whose vLLM key has multimodal extra keys: ``[(block index, (("mm",
    identifier, offset of the input from the block's start), ...))]``. ``features``: vLLM's
    ``mm_features``, sorted by offset, as vLLM assumes."""
    if not features:
        return []
    spans = [(f.identifier, int(f.mm_position.offset), int(f.mm_position.length))
             for f in features]
    last_end = spans[-1][1] + spans[-1][2]
    out: list[tuple[int, tuple[tuple[str, str, int], ...]]] = []
    k = 0  # the first input no earlier block has passed
    num_blocks = -(-max(last_end, 0) // block_size)
    for j in range(num_blocks):
        start, end = j * block_size, (j + 1) * block_size
        keys: list[tuple[str, str, int]] = []
        while k < len(spans):
            ident, offset, length = spans[k]
            if offset >= end:
                break  # the block has not reached this input
            if start >= offset + length:
                k += 1  # passed
                continue
            keys.append(("mm", ident, offset - start))
            if end < offset + length:
                break  # the input goes on into the next block
            k += 1
        if keys:
            out.append((j, tuple(keys)))
    return out


def _masks(extra: list[tuple[int, tuple[Any, ...]]], block_size: int) -> npt.NDArray[np.int64]:
    """``[n]`` int64: the fold mask of each position (``-1``: a block without extra keys,
    left as it is), through the last block with extra keys."""
    if not extra:
        return np.empty(0, dtype=np.int64)
    masks = np.full((extra[-1][0] + 1) * block_size, -1, dtype=np.int64)
    for j, keys in extra:
        digest = hashlib.shake_128(repr(keys).encode()).digest(4 * block_size)
        words = np.frombuffer(digest, dtype="<u4").astype(np.int64) & _MASK
        masks[j * block_size : (j + 1) * block_size] = words
    return masks


class KeyTokens:
    """The key tokens of a request with multimodal inputs: a read-only view of its live token
    list (``request._all_token_ids``, which vLLM appends to and trims) with the positions of
    blocks that have extra keys folded. Indexing and slicing (step 1) give ints and lists, as
    the list would; ``masks``: ``[n]`` int64 (``-1``: unchanged)."""

    __slots__ = ("masks", "tokens")

    def __init__(self, tokens: list[int], masks: npt.NDArray[np.int64]) -> None:
        self.tokens = tokens
        self.masks = masks

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: Any) -> Any:
        tokens = self.tokens
        if not isinstance(index, slice):
            i = index + len(tokens) if index < 0 else index
            t = tokens[i]
            if i < self.masks.size and self.masks[i] >= 0:
                return int(_fold(np.array([t], dtype=np.int64), self.masks[i : i + 1])[0])
            return t
        start, stop, step = index.indices(len(tokens))
        if step != 1:
            raise ValueError("KeyTokens slices take step 1")
        out = tokens[start:stop]
        upto = min(stop, self.masks.size)
        if start >= upto:
            return out
        head = np.array(out[: upto - start], dtype=np.int64)
        return _fold(head, self.masks[start:upto]).tolist() + out[upto - start:]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyTokens) and self[:] == other[:]

    __hash__ = None  # type: ignore[assignment]


def _fold(tokens: npt.NDArray[np.int64], masks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    sel = masks >= 0
    if not np.count_nonzero(sel):
        return tokens
    picked = tokens[sel]
    if int(picked.max()) >= KEY_TOKEN_BASE:
        raise KVMemError(
            f"token id {int(picked.max())} in a block with multimodal inputs: kvmem folds such "
            f"blocks' ids into {KEY_TOKEN_BASE}..{2 * KEY_TOKEN_BASE - 1} and needs vocabulary "
            f"ids below {KEY_TOKEN_BASE}")
    out = tokens.copy()
    out[sel] = KEY_TOKEN_BASE | (picked ^ masks[sel])
    return out


def key_tokens(request: Any, block_size: int) -> Any:
    """What kvmem keys ``request``'s pages by: its token list itself (no multimodal inputs), or
    a :class:`KeyTokens` view of it.

    Raises ArgumentError (nothing changed) when an mm input has no identifier, a negative
    offset or length, or the inputs are not sorted by offset without overlap (vLLM assumes
    so), and KVMemError when a prompt token in a folded block is ``>= 2**30``."""
    features = request.mm_features
    if not features:
        return request._all_token_ids
    prev_end = 0
    for f in features:
        pos = f.mm_position
        if not isinstance(f.identifier, str):
            raise ArgumentError(f"request {request.request_id!r}: mm input identifier "
                                f"{f.identifier!r} is not a str (vLLM keys blocks by it)")
        if pos.offset < prev_end or pos.length < 0:
            spans = [(g.mm_position.offset, g.mm_position.length) for g in features]
            raise ArgumentError(
                f"request {request.request_id!r}: mm inputs at {spans} (offset, length) are "
                "not sorted by offset without overlap, as vLLM's block "
                "keys assume")
        prev_end = pos.offset + pos.length
    view = KeyTokens(request._all_token_ids, _masks(mm_extra_keys(features, block_size),
                                                    block_size))
    # Fold the prompt's ids once: KVMemError now for one past the vocabulary range.
    _ = view[: min(request.num_prompt_tokens, view.masks.size)]
    return view
