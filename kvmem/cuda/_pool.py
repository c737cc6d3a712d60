"""PagePool: the device tensors that hold KV pages, their scales, and a mirror of page tags.

Storage (one stacked tensor per kind, page id on dim 1 so one index moves a page in every layer)::

    data           [num_layers, num_pages, C, page_size, H, D]   NHD  } storage dtype: uint8 for
                   [num_layers, num_pages, C, H, page_size, D]   HND  } fp8, else bf16/fp16/fp32
    token_scales   [num_layers, num_pages, C, page_size, H]      float32, fp8 token_head only
                   (HND: [..., C, H, page_size])
    static_scales  [num_layers, C, Hs]                           float32, fp8 tensor (Hs=1)/head
    tags           [num_pages]                                   int64, tag mirror (one writer:
                                                                 the allocator's follower via
                                                                 sync_tags, or the manager that
                                                                 claimed the pool)

    C = 2 (K, V) for MHA/GQA; MLA keeps its latent as C = 1, H = 1, D = kv_lora_rank + rope.

A slot is ``page * page_size + offset`` (vLLM's ``slot_mapping``; -1 = padding, skipped).
Every method checks its whole input before it changes a byte; ``write(check=False)`` skips the
checks that need the slot values (range, duplicates) for callers that checked the step's slot
mapping once with :meth:`PagePool.check_slots`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

import numpy as np
import torch

from kvmem._validate import flag, integer, show
from kvmem.cuda._checks import (
    IndexLike,
    check_finite,
    check_fits,
    check_range,
    check_slot_values,
    index_tensor,
    pool_device,
    read_dtype,
    words,
    write_rows,
)
from kvmem.cuda._spec import PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError, KVMemError
from kvmem.quant import make_codec

__all__ = ["PagePool", "PoolStats"]

log = logging.getLogger(__name__)

_CHUNK_ELEMS = 1 << 19  # elements per CPU write chunk: 2 MiB of fp32 temporaries
_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TAG_BOUND = 2**63  # tags are non-negative int64, up to 2**63 - 1 (0: free)


class _TagSource(Protocol):
    """What :meth:`PagePool.sync_tags` needs from an allocator."""

    tags: np.ndarray

    def pop_changed_pages(self) -> np.ndarray: ...


class PoolStats(NamedTuple):
    """A snapshot of the pool's write counters (elements, since creation or reset)."""

    num_saturated: int
    num_nonfinite: int
    saturated_per_layer: tuple[int, ...]
    nonfinite_per_layer: tuple[int, ...]


class PagePool:
    """KV pages for every layer on one device, written by slot and read by page.

    Parameters
    ----------
    spec : PoolSpec
        Shapes, page dtype, scales, layout and device.

    Examples
    --------
    >>> spec = PoolSpec(num_layers=2, num_pages=8, num_kv_heads=2, head_dim=64,
    ...                 dtype="fp8_e4m3", scales="token_head", device="cpu")
    >>> pool = PagePool(spec)
    >>> k = v = torch.randn(3, 2, 64)
    >>> pool.write(0, torch.tensor([16, 17, 40]), k, v)   # page 1 slots 0-1, page 2 slot 8
    >>> keys, values = pool.read(0, torch.tensor([1, 2]))  # [2, 16, 2, 64] bfloat16 each
    """

    def __init__(self, spec: PoolSpec) -> None:
        if not isinstance(spec, PoolSpec):
            raise ArgumentTypeError(
                f"spec={show(spec)}: expected a PoolSpec, e.g. PagePool(PoolSpec(num_layers=2, "
                "num_pages=64, num_kv_heads=2, head_dim=64))."
            )
        device = pool_device(spec)
        nbytes = spec.nbytes + spec.tag_nbytes
        check_fits(spec, device, nbytes)
        try:
            self._build(spec, device)
        except (RuntimeError, MemoryError) as e:  # the device cannot hold it
            raise ConfigError(
                f"could not allocate the pool's {nbytes / 2**30:,.2f} GiB on {device} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use fewer "
                "pages or layers."
            ) from None
        log.debug("PagePool on %s: %s", device, spec.describe())

    def _build(self, spec: PoolSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.codec = make_codec(spec.dtype, spec.scales)
        self.format = self.codec.format
        if spec.compute_dtype is not None:
            self.compute_dtype = _COMPUTE[spec.compute_dtype]
        else:
            self.compute_dtype = torch.float32 if spec.dtype == "fp32" else torch.bfloat16

        L, P, ps = spec.num_layers, spec.num_pages, spec.page_size
        C, H, D = spec.num_components, spec.num_heads, spec.width
        self._nhd = spec.layout == "NHD"
        # Elements per row of a layer's row view (see _slot_rows): data, token scales.
        self._row_width = H * D if self._nhd else D
        self._scale_row_width = H if self._nhd else 1
        self._chunk_tokens = max(1, _CHUNK_ELEMS // (C * H * D))
        inner = (C, ps, H, D) if self._nhd else (C, H, ps, D)
        self.data = torch.zeros((L, P, *inner), dtype=self.format.storage_dtype, device=device)
        self.token_scales: torch.Tensor | None = None
        if self.codec.token_scales:
            self.token_scales = torch.zeros((L, P, *inner[:-1]), dtype=torch.float32, device=device)
        self.static_scales: torch.Tensor | None = None
        scale_shape = self.codec.static_scale_shape(C, H)
        if scale_shape is not None:
            shape = (L, *scale_shape)
            if spec.static_scales is not None:
                self.static_scales = torch.tensor(
                    spec.static_scales, dtype=torch.float32, device=device
                ).reshape(shape)
            else:
                self.static_scales = torch.zeros(shape, dtype=torch.float32, device=device)
        # Layers whose every fixed scale is known (> 0); others calibrate on their next write.
        self._calibrated = [spec.static_scales is not None] * L
        self.tags = torch.zeros(P, dtype=torch.int64, device=device)
        self._tag_key: object | None = None  # set by claim_tags(): the mirror's one writer
        self._counters = torch.zeros((L, 2), dtype=torch.int64, device=device)

    # -- views ----------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of KV storage really allocated (data and scales); equals ``spec.nbytes``."""
        return sum(t.nbytes for t in self.storage_tensors().values())

    def storage_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold KV state: ``data`` and, for fp8, its scales."""
        out = {"data": self.data}
        if self.token_scales is not None:
            out["token_scales"] = self.token_scales
        if self.static_scales is not None:
            out["static_scales"] = self.static_scales
        return out

    @property
    def page_bytes(self) -> torch.Tensor:
        """``data`` as raw bytes: ``[num_layers, num_pages, bytes per page per layer]`` uint8."""
        L, P = self.data.shape[:2]
        return self.data.view(L, P, -1).view(torch.uint8)

    def kv_cache(self, layer: int) -> torch.Tensor:
        """One layer's pages as a kernel sees them (fp8 viewed as its float8 dtype).

        Returns
        -------
        MHA/GQA: [num_pages, 2, page_size, H, D] (NHD) or [num_pages, 2, H, page_size, D] (HND);
        MLA: [num_pages, page_size, kv_lora_rank + qk_rope_head_dim].
        """
        self._check_layer(layer)
        pages = self.data[layer].view(self.format.dtype)
        return pages if self.spec.attention == "gqa" else pages[:, 0, :, 0]

    # -- write ----------------------------------------------------------------------------------

    @torch.no_grad()
    def write(
        self,
        layer: int,
        slot_mapping: IndexLike,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        check: bool = True,
    ) -> None:
        """Quantize and store T tokens of one layer into their slots.

        Parameters
        ----------
        layer : int
        slot_mapping : [T], int64 (or int32, numpy, list)
            ``page * page_size + offset`` per token; -1 skips the token.
        k, v : [T, num_kv_heads, head_dim], float32 / bfloat16 / float16, on the pool's device
            MLA: ``write(layer, slot_mapping, latent)`` with latent [T, kv_lora_rank + rope].
        check : bool
            Check slot values (range, no slot twice). Costs one host sync on CUDA; pass False
            only for a slot mapping already checked with :meth:`check_slots`.

        Counts saturated and NaN/inf elements (see :meth:`stats`); with
        ``spec.nonfinite == "raise"``, NaN/inf input raises and nothing is written.
        """
        self._check_layer(layer)
        check = flag(check, "check")
        num_tokens = write_rows(self.spec, self.device, k, v)
        slots = index_tensor(slot_mapping, "slot_mapping", self.device)
        if slots.shape[0] != num_tokens:
            raise ArgumentError(
                f"slot_mapping has {slots.shape[0]} entries for {num_tokens} tokens; give one "
                "slot (or -1) per token."
            )
        if check:
            self.check_slots(slots)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, k = slots[keep], k[keep]
            v = None if v is None else v[keep]
        if slots.numel() == 0:
            return
        if self.spec.nonfinite == "raise":
            check_finite(layer, k, v)
        self._store(layer, slots, k, v)

    def _store(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """Quantize checked tokens (no -1 slot left) and copy them into their slots' rows."""
        static = None if self.static_scales is None else self.static_scales[layer]
        if static is not None and not self._calibrated[layer]:
            static = self.codec.calibrate(self._stack(k, v), static)
        rows = self._slot_rows(slots)  # see _slot_rows: one row copy per (token, K/V[, head])
        rows_per_token = rows.numel() // slots.numel()
        # CPU: cache-sized token chunks keep the fp32 temporaries out of fresh (page-faulting)
        # memory. CUDA's caching allocator has no such cost: one chunk.
        step = slots.numel() if self.device.type == "cuda" else self._chunk_tokens
        data_rows = words(self.data[layer].view(-1, self._row_width))
        scale_rows = None
        if self.token_scales is not None:
            scale_rows = words(self.token_scales[layer].view(-1, self._scale_row_width))
        for t0 in range(0, slots.numel(), step):
            t1 = min(slots.numel(), t0 + step)
            x = self._stack(k[t0:t1], None if v is None else v[t0:t1])
            enc = self.codec.quantize(x, static)
            chunk_rows = rows[t0 * rows_per_token : t1 * rows_per_token]
            data_rows.index_copy_(0, chunk_rows, words(enc.data.reshape(-1, self._row_width)))
            if scale_rows is not None:
                assert enc.token_scales is not None
                scales = enc.token_scales.reshape(-1, self._scale_row_width)
                scale_rows.index_copy_(0, chunk_rows, words(scales))
            self._counters[layer, 0] += enc.num_saturated
            self._counters[layer, 1] += enc.num_nonfinite
        if static is not None and not self._calibrated[layer]:
            assert self.static_scales is not None
            self.static_scales[layer] = static
            self._calibrated[layer] = bool((static > 0).all())

    def _slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row ids, in one layer's row view, of every (token, K/V[, head]) the slots address.

        NHD rows are (page, c, offset) of ``H * D`` elements; HND rows (page, c, h, offset) of
        ``D`` elements. Token scales use the same ids with rows of H (NHD) or 1 (HND).
        """
        C, H, ps = self.spec.num_components, self.spec.num_heads, self.spec.page_size
        page = torch.div(slots, ps, rounding_mode="floor")
        offset = slots - page * ps
        base = page[:, None] * C + torch.arange(C, device=slots.device)  # [T, C]
        if self._nhd:
            rows = base * ps + offset[:, None]
        else:
            heads = torch.arange(H, device=slots.device)
            rows = (base[:, :, None] * H + heads) * ps + offset[:, None, None]
        return rows.reshape(-1)

    def _stack(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """An owned [T, C, H, D] copy of the input, in fp32 for fp8 pages (one pass each)."""
        dtype = torch.float32 if self.format.quantized else k.dtype
        x = torch.empty(
            (k.shape[0], self.spec.num_components, self.spec.num_heads, self.spec.width),
            dtype=dtype,
            device=self.device,
        )
        if v is None:
            x[:, 0, 0] = k
        else:
            x[:, 0] = k
            x[:, 1] = v
        return x

    def check_slots(self, slot_mapping: IndexLike) -> None:
        """Raise unless every slot is -1 or in ``[0, num_slots)`` and none appears twice."""
        check_slot_values(index_tensor(slot_mapping, "slot_mapping", self.device), self.spec)

    # -- read -----------------------------------------------------------------------------------

    @torch.no_grad()
    def gather(
        self, layer: int, page_ids: IndexLike, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Dequantize whole pages of one layer.

        Parameters
        ----------
        layer : int
        page_ids : [n], integer
        dtype : output dtype, default ``compute_dtype``

        Returns
        -------
        [n, C, page_size, H, D], dtype (a transposed view for HND pools)
        """
        self._check_layer(layer)
        out_dtype = read_dtype(dtype, self.compute_dtype)
        ids = index_tensor(page_ids, "page_ids", self.device)
        check_range(ids, self.spec.num_pages, "page_ids", "page")
        pages = self.data[layer]
        raw = words(pages.view(pages.shape[0], -1)).index_select(0, ids)
        raw = raw.view(pages.dtype).view(ids.numel(), *pages.shape[1:])
        scale: torch.Tensor | None = None
        if self.token_scales is not None:
            scale = self.token_scales[layer].index_select(0, ids).unsqueeze(-1)
        elif self.static_scales is not None:
            s = self.static_scales[layer]  # [C, Hs]
            C, Hs = s.shape
            scale = s.view(1, C, 1, Hs, 1) if self._nhd else s.view(1, C, Hs, 1, 1)
        out = self.codec.dequantize(raw, scale, out_dtype)
        return out if self._nhd else out.transpose(2, 3)

    def read(
        self, layer: int, page_ids: IndexLike, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Keys and values of whole pages, dequantized.

        Returns
        -------
        MHA/GQA: (k, v), each [n, page_size, num_kv_heads, head_dim] in ``dtype`` (default
        ``compute_dtype``); MLA: latent [n, page_size, kv_lora_rank + qk_rope_head_dim].
        """
        kv = self.gather(layer, page_ids, dtype)
        if self.spec.attention == "gqa":
            return kv[:, 0], kv[:, 1]
        return kv[:, 0, :, 0]

    # -- copies and tags ------------------------------------------------------------------------

    @torch.no_grad()
    def copy_pages(self, src_page_ids: IndexLike, dst_page_ids: IndexLike) -> None:
        """Copy pages (every layer, data and scales together, bit for bit), e.g. copy-on-write.

        All sources are read before any destination is written. Destinations must be distinct.
        """
        src = index_tensor(src_page_ids, "src_page_ids", self.device)
        dst = index_tensor(dst_page_ids, "dst_page_ids", self.device)
        if src.shape != dst.shape:
            raise ArgumentError(
                f"copy_pages got {src.numel()} sources and {dst.numel()} destinations; give one "
                "destination per source. Nothing was copied."
            )
        check_range(src, self.spec.num_pages, "src_page_ids", "page")
        check_range(dst, self.spec.num_pages, "dst_page_ids", "page")
        if torch.unique(dst).numel() != dst.numel():
            raise ArgumentError(
                "dst_page_ids names a destination page twice; give distinct destinations. "
                "Nothing was copied."
            )
        if src.numel() == 0:
            return
        raw = words(self.page_bytes)
        raw[:, dst] = raw[:, src]
        if self.token_scales is not None:
            self.token_scales[:, dst] = self.token_scales[:, src]

    def claim_tags(self) -> object:
        """Make the caller the only writer of :attr:`tags` (a ``KVCacheManager`` claims the pool
        it manages: its tags are namespace-qualified, see ``kvmem.integrity``). Returns the key
        to pass to :meth:`update_tags`; every other write of the mirror is refused."""
        if self._tag_key is not None:
            raise ArgumentError(
                "this pool's tag mirror is already claimed (by the KVCacheManager that manages "
                "it); give each manager a pool of its own"
            )
        self._tag_key = object()
        return self._tag_key

    def _require_unclaimed(self, what: str, key: object = None) -> None:
        if self._tag_key is not None and key is not self._tag_key:
            raise KVMemError(
                f"{what} refused: this pool's tags are written by the KVCacheManager that "
                "manages it (namespace-qualified tags; two writers would disagree). Let the "
                "manager keep them current; nothing changed."
            )

    def update_tags(self, page_ids: IndexLike, tags: IndexLike, *, key: object = None) -> None:
        """Set the device mirror of page tags for the pages that changed.

        Parameters
        ----------
        page_ids : [n], integer, distinct
        tags : [n], int64 (the new tags of those pages)
        key : the key from :meth:`claim_tags`, when the pool is claimed
        """
        self._require_unclaimed("update_tags", key)
        ids = index_tensor(page_ids, "page_ids", self.device)
        values = index_tensor(tags, "tags", self.device)
        if ids.shape != values.shape:
            raise ArgumentError(
                f"update_tags got {ids.numel()} pages and {values.numel()} tags; give one tag "
                "per page. No tag changed."
            )
        check_range(ids, self.spec.num_pages, "page_ids", "page")
        check_range(values, _TAG_BOUND, "tags", "tag")
        if torch.unique(ids).numel() != ids.numel():
            raise ArgumentError("update_tags names a page twice; no tag changed.")
        self.tags[ids] = values

    def sync_tags(self, allocator: _TagSource) -> int:
        """Bring the mirror up to date with an allocator: only pages whose tag changed move.

        ``allocator`` is anything with ``pop_changed_pages() -> int array`` and a ``tags``
        array, as :class:`kvmem.PageAllocator` has. Returns how many pages were updated.
        Refused on a pool a manager claimed (the manager keeps its tags current).
        """
        self._require_unclaimed("sync_tags")
        tags = getattr(allocator, "tags", None)
        if not callable(getattr(allocator, "pop_changed_pages", None)) or not isinstance(
            tags, np.ndarray
        ):
            raise ArgumentTypeError(
                f"allocator={show(allocator)}: expected an allocator with a tags array and "
                "pop_changed_pages(), such as kvmem.PageAllocator."
            )
        if tags.shape != (self.spec.num_pages,):
            raise ArgumentError(
                f"the allocator has {tags.size} pages but this pool has {self.spec.num_pages}; "
                "a pool mirrors the tags of the allocator that owns its pages. No tag changed."
            )
        changed = np.asarray(allocator.pop_changed_pages())
        if changed.size:
            self.update_tags(changed, tags[changed])
        return int(changed.size)

    def load_tags(self, tags: IndexLike) -> None:
        """Replace the whole tag mirror (e.g. at start-up): ``tags`` [num_pages], int64."""
        self._require_unclaimed("load_tags")
        values = index_tensor(tags, "tags", self.device)
        if values.shape != self.tags.shape:
            raise ArgumentError(
                f"load_tags needs {self.spec.num_pages} tags, one per page; got "
                f"{values.numel()}. No tag changed."
            )
        check_range(values, _TAG_BOUND, "tags", "tag")
        self.tags.copy_(values)

    # -- counters -------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """Saturated and NaN/inf input elements written so far (a frozen snapshot)."""
        per_layer = self._counters.cpu().tolist()
        sat = tuple(int(r[0]) for r in per_layer)
        bad = tuple(int(r[1]) for r in per_layer)
        return PoolStats(sum(sat), sum(bad), sat, bad)

    @property
    def num_saturated(self) -> int:
        """Elements clamped to the format's range beyond ordinary rounding, all layers."""
        return int(self._counters[:, 0].sum())

    @property
    def num_nonfinite(self) -> int:
        """NaN/inf input elements (stored as 0), all layers."""
        return int(self._counters[:, 1].sum())

    def reset_stats(self) -> None:
        """Zero the saturation and NaN/inf counters."""
        self._counters.zero_()

    # -- input checks (the others: _checks.py) --------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        integer(layer, "layer", minimum=0, maximum=self.spec.num_layers - 1)
