"""PoolSpec: what a page pool holds, validated, with its exact byte accounting.

Byte accounting (every figure equals the ``nbytes`` of tensors a :class:`PagePool` allocates)::

    C = 2 (K and V) for MHA/GQA, 1 for an MLA latent;  H = num_kv_heads (1 for MLA)
    D = head_dim (MHA/GQA) or kv_lora_rank + qk_rope_head_dim (MLA)

    data per page      num_layers * C * page_size * H * D * itemsize      (itemsize 4/2/2/1/1)
    token_head scales  num_layers * C * page_size * H * 4                 (fp32, beside the data)
    bytes_per_page     data + token_head scales
    bytes_per_token    bytes_per_page / page_size                         (always whole)
    fixed_nbytes       num_layers * C * Hs * 4   tensor (Hs = 1) / head (Hs = H) fp8 scales
    nbytes             num_pages * bytes_per_page + fixed_nbytes

``tensor`` and ``head`` scales cost nothing per token: a byte budget for pages holds exactly
twice as many fp8 tokens as bf16 tokens. ``token_head`` adds ``4 / D`` (3.1% at D = 128) on top
of fp8's one byte per element. The pool's tag mirror (``tag_nbytes``, int64 per page) is
allocator metadata and is reported apart from the KV bytes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from annotated_types import Le
from pydantic import BeforeValidator, model_validator
from pydantic_core import PydanticCustomError

from kvmem._specs import NonNegativeInt, PositiveInt, SpecModel
from kvmem._validate import integer, is_integer_like
from kvmem.quant import PageDType, ScaleGranularity, page_format

__all__ = ["PoolSpec"]

SCALE_BYTES = 4  # scales are float32
_MAX_PAGES = 2**31 - 1  # page ids are int32
_MAX_LAYERS_OR_HEADS = 1024
_MAX_WIDTH = 1 << 16
TAG_BYTES = 8  # the device mirror of allocator tags is int64


def _static_scales(value: Any) -> Any:
    """Numbers or nested lists of numbers (no bools, no strings), as floats."""
    if isinstance(value, (list, tuple)):
        return [_static_scales(v) for v in value]
    if isinstance(value, (bool, np.bool_)) or not (
        is_integer_like(value) or isinstance(value, (float, np.floating))
    ):
        raise PydanticCustomError(
            "real_type", "expected a number or a nested list of numbers (not bool or str)"
        )
    return float(value)


StaticScales = Annotated[
    float | list[float] | list[list[float]] | list[list[list[float]]],
    BeforeValidator(_static_scales),
]


class PoolSpec(SpecModel):
    """The shape, data type and placement of a page pool.

    Parameters
    ----------
    num_layers, num_pages, page_size : int
        ``page_size`` token slots per page (default 16), for every layer.
    attention : "gqa" | "mha" | "mla"
        "mha" is stored as "gqa" (MHA is GQA with as many KV heads as query heads).
        GQA needs ``num_kv_heads`` and ``head_dim``; MLA needs ``kv_lora_rank`` and
        ``qk_rope_head_dim`` and caches one latent of their sum per token.
    dtype : "fp32" | "bf16" | "fp16" | "fp8_e4m3" | "fp8_e5m2"
        Page data type (default bf16).
    scales : "tensor" | "head" | "token_head", fp8 only
        Scale granularity; default "tensor" for fp8. MLA has no heads: "tensor" or "token_head".
    static_scales : float or nested list, optional (tensor/head only)
        Fixed dequantization scales, e.g. a checkpoint's k_scale/v_scale: one float for all, or
        ``[num_layers][C]`` (tensor) / ``[num_layers][C][num_kv_heads]`` (head). Stored
        normalized to ``[num_layers][C][Hs]``. Without them, each layer's scales are set from
        its first write.
    layout : "NHD" | "HND"
        Order of (slot, head) inside a page: ``[num_pages, 2, page_size, H, D]`` (NHD) or
        ``[num_pages, 2, H, page_size, D]`` (HND). MLA pages are ``[num_pages, page_size, D]``.
    device : str, optional
        None resolves to "cuda" when available, else "cpu", when the pool is built.
    compute_dtype : "fp32" | "bf16" | "fp16", optional
        What reads return; default fp32 for fp32 pages, else bf16.
    nonfinite : "zero" | "raise"
        NaN/inf inputs: counted and stored as 0 (default), or rejected before any byte changes.
    """

    # Bounds: page ids are int32; no model has more than a thousand layers or KV heads, and
    # these bound the per-layer scale tables a spec stores.
    num_layers: Annotated[PositiveInt, Le(_MAX_LAYERS_OR_HEADS)]
    num_pages: Annotated[PositiveInt, Le(_MAX_PAGES)]
    page_size: Annotated[PositiveInt, Le(_MAX_WIDTH)] = 16
    attention: Literal["gqa", "mha", "mla"] = "gqa"
    num_kv_heads: Annotated[PositiveInt, Le(_MAX_LAYERS_OR_HEADS)] | None = None
    head_dim: Annotated[PositiveInt, Le(_MAX_WIDTH)] | None = None
    kv_lora_rank: Annotated[PositiveInt, Le(_MAX_WIDTH)] | None = None
    qk_rope_head_dim: Annotated[NonNegativeInt, Le(_MAX_WIDTH)] | None = None
    dtype: PageDType = "bf16"
    scales: ScaleGranularity | None = None
    static_scales: StaticScales | None = None
    layout: Literal["NHD", "HND"] = "NHD"
    device: str | None = None
    compute_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    nonfinite: Literal["zero", "raise"] = "zero"

    def __init__(self, *args: Any, **data: Any) -> None:  # typed loosely: checked at run time
        super().__init__(*args, **data)

    @classmethod
    def from_json(cls, text: str | bytes) -> PoolSpec:
        """Parse a spec written by ``model_dump_json``; bad input raises ``ConfigError``."""
        spec: PoolSpec = super().from_json(text)
        return spec

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("attention") == "mha":
            data["attention"] = "gqa"
        dtype = data.get("dtype", "bf16")
        if dtype in ("fp8_e4m3", "fp8_e5m2") and data.get("scales") is None:
            data["scales"] = "tensor"
        return data

    @model_validator(mode="after")
    def _check(self) -> PoolSpec:
        if self.attention == "gqa":
            if self.num_kv_heads is None or self.head_dim is None:
                raise ValueError(
                    "GQA/MHA pools need num_kv_heads and head_dim; got "
                    f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}."
                )
            if self.kv_lora_rank is not None or self.qk_rope_head_dim is not None:
                raise ValueError(
                    "kv_lora_rank/qk_rope_head_dim are MLA fields; use attention='mla'."
                )
        else:
            if self.kv_lora_rank is None or self.qk_rope_head_dim is None:
                raise ValueError(
                    "MLA pools need kv_lora_rank and qk_rope_head_dim; got "
                    f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}."
                )
            if self.num_kv_heads is not None or self.head_dim is not None:
                raise ValueError(
                    "MLA caches one latent per token: leave num_kv_heads/head_dim unset."
                )
            if self.layout != "NHD":
                raise ValueError("MLA pages have no heads to reorder: use layout='NHD'.")
            if self.scales == "head":
                raise ValueError("MLA has no KV heads: use scales='tensor' or 'token_head'.")
        quantized = page_format(self.dtype).quantized
        if not quantized and self.scales is not None:
            raise ValueError(
                f"scales={self.scales!r} apply to fp8 pages only; {self.dtype} pages have none."
            )
        if self.static_scales is not None:
            if self.scales not in ("tensor", "head"):
                raise ValueError(
                    "static_scales need scales='tensor' or 'head' (fp8); token_head scales are "
                    "computed per token."
                )
            normalized = self._normalized_static_scales(self.static_scales)
            object.__setattr__(self, "static_scales", normalized)
        return self

    def _normalized_static_scales(self, value: StaticScales) -> list[list[list[float]]]:
        target = (self.num_layers, self.num_components, self.num_scale_heads)
        wanted = target if self.scales == "head" else target[:2]
        arr = np.asarray(value, dtype=np.float64)
        if arr.shape not in ((), wanted, target):
            raise ValueError(
                f"static_scales of shape {arr.shape} do not fit {self.scales!r} scales for "
                f"{self.num_layers} layers: give one float or a nested list of shape {wanted}."
            )
        # The pool keeps them as float32: 1e39 would become inf (reads 0 * inf = NaN), 1e-50 zero.
        with np.errstate(over="ignore"):
            as_f32 = arr.astype(np.float32)
        if not np.all(np.isfinite(as_f32)) or not np.all(as_f32 > 0):
            raise ValueError(
                "static_scales must be finite and > 0 as float32 (about 1.4e-45 to 3.4e38); got "
                f"values from {arr.min():g} to {arr.max():g}."
            )
        full = np.broadcast_to(arr.reshape(arr.shape + (1,) * (3 - arr.ndim)), target)
        return [[[float(s) for s in row] for row in comp] for comp in full]

    # -- shapes ---------------------------------------------------------------------------------

    @property
    def num_components(self) -> int:
        """2 (K and V) for MHA/GQA, 1 for an MLA latent."""
        return 2 if self.attention == "gqa" else 1

    @property
    def num_heads(self) -> int:
        """KV heads per token (1 for MLA)."""
        return self.num_kv_heads if self.num_kv_heads is not None else 1

    @property
    def width(self) -> int:
        """Elements per (token, component, head): head_dim, or kv_lora_rank + qk_rope_head_dim."""
        if self.head_dim is not None:
            return self.head_dim
        assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_scale_heads(self) -> int:
        """Hs: heads per fixed scale row (H for 'head', else 1)."""
        return self.num_heads if self.scales == "head" else 1

    @property
    def num_slots(self) -> int:
        """Token slots in the pool: num_pages * page_size."""
        return self.num_pages * self.page_size

    # -- bytes ----------------------------------------------------------------------------------

    @property
    def token_scale_bytes_per_page(self) -> int:
        """fp32 token_head scales per page, all layers (0 for other granularities)."""
        if self.scales != "token_head":
            return 0
        return self.num_layers * self.num_components * self.page_size * self.num_heads * SCALE_BYTES

    @property
    def data_bytes_per_page(self) -> int:
        """Page data per page, all layers, scales excluded."""
        itemsize = page_format(self.dtype).itemsize
        per_layer = self.num_components * self.page_size * self.num_heads * self.width * itemsize
        return self.num_layers * per_layer

    @property
    def bytes_per_page(self) -> int:
        """Data plus token_head scales of one page, all layers."""
        return self.data_bytes_per_page + self.token_scale_bytes_per_page

    @property
    def bytes_per_token(self) -> int:
        """bytes_per_page / page_size (exact)."""
        return self.bytes_per_page // self.page_size

    @property
    def fixed_nbytes(self) -> int:
        """Per-layer tensor/head fp8 scales: a fixed cost, independent of num_pages."""
        if self.scales not in ("tensor", "head"):
            return 0
        return self.num_layers * self.num_components * self.num_scale_heads * SCALE_BYTES

    @property
    def nbytes(self) -> int:
        """All KV storage the pool allocates: pages, their scales and the fixed scales."""
        return self.num_pages * self.bytes_per_page + self.fixed_nbytes

    @property
    def tag_nbytes(self) -> int:
        """The int64 device mirror of allocator tags (metadata, not part of ``nbytes``)."""
        return self.num_pages * TAG_BYTES

    @property
    def scale_overhead(self) -> float:
        """Per-token scale bytes as a fraction of the data bytes (token_head: 4 / D)."""
        return self.token_scale_bytes_per_page / self.data_bytes_per_page

    def num_pages_for_budget(self, page_budget_bytes: int) -> int:
        """Pages whose data and per-page scales fit in ``page_budget_bytes``.

        The budget is for pages, as a capacity planner counts it; ``fixed_nbytes`` (a few
        hundred bytes of per-layer scales) is allocated beside it.
        """
        budget = integer(page_budget_bytes, "page_budget_bytes", minimum=0)
        return budget // self.bytes_per_page

    def with_num_pages(self, num_pages: int) -> PoolSpec:
        """The same spec with another page count."""
        return PoolSpec(**{**self.model_dump(), "num_pages": num_pages})

    def resolved_device(self) -> str:
        """``device``, or "cuda" when available and "cpu" otherwise."""
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def describe(self) -> str:
        """One line for logs: layout, dtype, scales and sizes."""
        shape = (
            f"{self.num_kv_heads}x{self.head_dim} KV heads"
            if self.attention == "gqa"
            else f"MLA latent {self.width}"
        )
        scales = f" ({self.scales} scales)" if self.scales else ""
        return (
            f"{self.num_layers} layers x {self.num_pages} pages x {self.page_size} slots, {shape}, "
            f"{self.dtype}{scales}, {self.bytes_per_token} B/token, "
            f"{self.nbytes / 2**20:.1f} MiB"
        )
