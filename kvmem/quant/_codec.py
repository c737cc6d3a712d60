"""KV codecs: how float keys and values become page bytes, and back.

One small interface, two implementations::

    codec = make_codec("fp8_e4m3", "token_head")
    codec.static_scale_shape(num_components, num_heads)   # per-layer fixed scales, or None
    codec.token_scales                                     # True: one fp32 per (token, K/V, head)
    scale = codec.calibrate(x, static_scale)               # fill unset per-layer scales
    enc = codec.quantize(x, scale)                         # x [T, C, H, D] -> Encoded
    y = codec.dequantize(data, scale, torch.bfloat16)      # [..., D] bytes -> [..., D] floats

``C`` is 2 (K and V) for MHA/GQA and 1 for an MLA latent; ``H`` the KV heads (1 for MLA).

Policies every codec follows:

- NaN and +-inf inputs are counted and stored as 0 (a pool may instead refuse them; see
  ``PoolSpec.nonfinite``); they never reach a page.
- Values beyond the format's range are clamped before the cast (torch versions differ on what
  an fp8 cast does with them) and counted when they lie beyond ordinary rounding
  (``PageFormat.saturation_threshold``).
- ``token_head`` scales are ``amax / max_finite`` of each (token, K/V, head) row, computed once
  from that token alone: a token's bytes never change as its page fills. An all-zero row, or
  one so small (below ~6e-43) that ``amax / max_finite`` is 0 in fp32, gets scale 1.
- ``tensor`` and ``head`` scales are fixed per layer: given (e.g. a checkpoint's k_scale /
  v_scale) or, when not given, set from the first write that has a non-zero value for them
  (``amax / max_finite`` over that write) and never changed after. A scale of 0 means "not
  calibrated yet"; such a scale's values are all zero.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from kvmem._validate import show
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.quant._formats import PageFormat, ScaleGranularity, page_format
from kvmem.quant._fp8 import fp8_to_float

__all__ = ["Encoded", "FP8Codec", "KVCodec", "PlainCodec", "make_codec"]


class Encoded(NamedTuple):
    """What :meth:`KVCodec.quantize` produces for T tokens."""

    data: torch.Tensor  # [T, C, H, D], the format's storage dtype (uint8 for fp8)
    token_scales: torch.Tensor | None  # [T, C, H] float32, token_head only
    num_saturated: torch.Tensor  # int64, 0-dim, on x's device
    num_nonfinite: torch.Tensor  # int64, 0-dim, on x's device


class KVCodec(ABC):
    """Quantize K/V rows into stored values and dequantize pages back."""

    format: PageFormat
    granularity: ScaleGranularity | None
    token_scales: bool

    def static_scale_shape(self, num_components: int, num_heads: int) -> tuple[int, int] | None:
        """Shape of one layer's fixed scales: ``(C, 1)`` for tensor, ``(C, H)`` for head."""
        if self.granularity == "tensor":
            return (num_components, 1)
        if self.granularity == "head":
            return (num_components, num_heads)
        return None

    def calibrate(self, x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor | None:
        """``static_scale`` [C, Hs] with its unset (0) entries set from ``x``'s amax.

        x : [T, C, H, D]; NaN/inf are ignored. Entries whose values are all zero stay 0.
        Codecs without per-layer scales return ``static_scale`` unchanged.
        """
        _check_rows(x)
        _check_scale(static_scale, x)
        return static_scale

    @abstractmethod
    def quantize(self, x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Encoded:
        """Encode T tokens.

        Parameters
        ----------
        x : [T, C, H, D], float32 / bfloat16 / float16
            Rows to store. The codec may overwrite ``x``: pass a tensor you own.
        static_scale : [C, Hs], float32, optional
            The layer's fixed scales (tensor/head granularity); 0 marks "not calibrated"
            (such entries hold only zeros).
        """

    @abstractmethod
    def dequantize(
        self,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode stored values ``[..., D]``, times ``scale`` (broadcastable to ``[..., 1]``)."""


def _zero_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Set NaN/+-inf entries of ``x`` (owned) to 0 in place; return how many there were."""
    if x.numel() == 0 or (x.device.type == "cpu" and bool(torch.isfinite(x.sum()))):
        # One fast reduction proves the common case on CPU; a finite sum means no NaN/inf.
        return torch.zeros((), dtype=torch.int64, device=x.device)
    bad = ~torch.isfinite(x)
    x.masked_fill_(bad, 0)
    return bad.sum()


def _clamp_counting(q: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """Clamp ``q`` (owned, finite) into the format's range in place; count true saturations."""
    limit = fmt.max_finite
    if q.numel() and q.device.type == "cpu":
        lo, hi = torch.aminmax(q)
        peak = max(-float(lo), float(hi))
        if peak <= fmt.saturation_threshold:
            if peak > limit:
                q.clamp_(-limit, limit)  # ordinary rounding onto the maximum
            return torch.zeros((), dtype=torch.int64)
    count = (q.abs() > fmt.saturation_threshold).sum()
    q.clamp_(-limit, limit)
    return count


class PlainCodec(KVCodec):
    """fp32, bf16 and fp16 pages: a cast, with NaN/inf and (fp16) overflow counted."""

    token_scales = False

    def __init__(self, dtype: str) -> None:
        fmt = page_format(dtype)
        if fmt.quantized:
            raise ConfigError(f"PlainCodec stores fp32/bf16/fp16; use FP8Codec for {dtype!r}.")
        self.format = fmt
        self.granularity = None

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Encoded:
        _check_rows(x)
        num_nonfinite = _zero_nonfinite(x)
        if torch.finfo(x.dtype).max > self.format.max_finite:
            # Clamp in fp32, where the target's maximum is exact (bf16 rounds 65504 to 65536).
            x = x.float()
            num_saturated = _clamp_counting(x, self.format)
        else:
            num_saturated = torch.zeros((), dtype=torch.int64, device=x.device)
        return Encoded(x.to(self.format.dtype), None, num_saturated, num_nonfinite)

    def dequantize(
        self,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_decode(data, self.format.dtype, scale, out_dtype, out)
        value = data if scale is None else data.float() * scale
        if out is None:
            return value.to(out_dtype)
        return out.copy_(value)


class FP8Codec(KVCodec):
    """fp8 e4m3fn / e5m2 pages with tensor, head or token_head scales (fp32)."""

    def __init__(self, dtype: str, granularity: ScaleGranularity) -> None:
        fmt = page_format(dtype)
        if not fmt.quantized:
            raise ConfigError(f"FP8Codec stores fp8_e4m3/fp8_e5m2; got {dtype!r}.")
        if not isinstance(granularity, str):
            raise ArgumentTypeError(
                f"granularity={show(granularity)}: expected 'tensor', 'head' or 'token_head'."
            )
        if granularity not in ("tensor", "head", "token_head"):
            raise ConfigError(
                f"unknown scale granularity {granularity!r}; use tensor, head or token_head."
            )
        self.format = fmt
        self.granularity = granularity
        self.token_scales = granularity == "token_head"

    def calibrate(self, x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor | None:
        _check_rows(x)
        _check_scale(static_scale, x)
        if self.token_scales or static_scale is None or x.numel() == 0:
            return static_scale
        magnitude = x.abs()
        magnitude.masked_fill_(~torch.isfinite(magnitude), 0)  # NaN/inf are not data
        amax = magnitude.amax(dim=(0, 3)).float()  # [C, H]
        if self.granularity == "tensor":
            amax = amax.amax(dim=1, keepdim=True)
        return torch.where(static_scale > 0, static_scale, amax / self.format.max_finite)

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, static_scale: torch.Tensor | None = None) -> Encoded:
        _check_rows(x)
        _check_scale(static_scale, x)
        xf = x if x.dtype == torch.float32 else x.float()
        num_nonfinite = _zero_nonfinite(xf)
        fmax = self.format.max_finite
        if self.token_scales:
            scale = xf.abs().amax(dim=-1) / fmax  # [T, C, H]
            # 0 for an all-zero row, and for one so small the division underflows (0 / 0 = NaN)
            scale = torch.where(scale > 0, scale, 1.0)
            xf.div_(scale.unsqueeze(-1))
            xf.clamp_(-fmax, fmax)  # amax/scale may round a hair above max: not a saturation
            data = xf.to(self.format.dtype).view(torch.uint8)
            zero = torch.zeros((), dtype=torch.int64, device=x.device)
            return Encoded(data, scale, zero, num_nonfinite)

        if static_scale is None:
            raise ConfigError(
                f"{self.granularity!r} scales are per layer: pass the layer's static_scale."
            )
        usable = torch.where(static_scale > 0, static_scale, 1.0)  # 0: all values are 0 anyway
        xf.div_(usable[None, :, :, None])
        num_saturated = _clamp_counting(xf, self.format)
        data = xf.to(self.format.dtype).view(torch.uint8)
        return Encoded(data, None, num_saturated, num_nonfinite)

    def dequantize(
        self,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fp8_to_float(data, self.format.name, scale, out_dtype, out)


def make_codec(dtype: str, scales: ScaleGranularity | None = None) -> KVCodec:
    """The codec for a page dtype (and, for fp8, a scale granularity; default ``tensor``)."""
    if scales is not None and not isinstance(scales, str):
        raise ArgumentTypeError(
            f"scales={show(scales)}: expected None, 'tensor', 'head' or 'token_head'."
        )
    if page_format(dtype).quantized:
        return FP8Codec(dtype, "tensor" if scales is None else scales)
    if scales is not None:
        raise ConfigError(
            f"scales={scales!r} apply to fp8 pages only; {dtype!r} pages are stored as is. "
            "Drop scales or pick fp8_e4m3/fp8_e5m2."
        )
    return PlainCodec(dtype)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_OUT_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_rows(x: torch.Tensor) -> None:
    """``x`` must be a ``[T, C, H, D]`` float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"x={show(x)}: expected a [T, C, H, D] float tensor.")
    if x.dtype not in _FLOATS:
        raise ArgumentTypeError(f"x has dtype {x.dtype}; pass float32, bfloat16 or float16.")
    if x.dim() != 4 or x.shape[3] == 0:
        raise ArgumentError(f"x has shape {tuple(x.shape)}; expected [T, C, H, D] with D >= 1.")


def _check_scale(scale: torch.Tensor | None, x: torch.Tensor) -> None:
    """``scale`` must be None or a float32 [C, 1] / [C, H] tensor on ``x``'s device whose
    entries are finite and >= 0 (0: not calibrated yet)."""
    if scale is None:
        return
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ArgumentTypeError(
            f"static_scale={show(scale)}: expected None or a float32 tensor of shape [C, Hs]."
        )
    if scale.device != x.device:
        raise ArgumentError(f"static_scale is on {scale.device} but x is on {x.device}.")
    if scale.dim() != 2 or scale.shape[0] != x.shape[1] or scale.shape[1] not in (1, x.shape[2]):
        raise ArgumentError(
            f"static_scale has shape {tuple(scale.shape)}; for x of shape "
            f"{tuple(x.shape)} it must be [C, 1] (tensor) or [C, H] (head) = "
            f"[{x.shape[1]}, 1] or [{x.shape[1]}, {x.shape[2]}]."
        )
    # A NaN, inf or negative scale would be stored as if it were 1 (or as 0) and decode wrong.
    if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise ArgumentError(
            f"static_scale holds {scale.flatten().tolist()[:8]}: every entry must be finite and "
            ">= 0 (0 marks a scale not calibrated yet)."
        )


def _check_decode(
    data: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != dtype:
        got = data.dtype if isinstance(data, torch.Tensor) else show(data)
        raise ArgumentTypeError(f"data={got}: expected a {dtype} tensor.")
    if scale is not None and (
        not isinstance(scale, torch.Tensor) or not scale.dtype.is_floating_point
    ):
        got = scale.dtype if isinstance(scale, torch.Tensor) else show(scale)
        raise ArgumentTypeError(f"scale={got}: expected None or a float32 tensor.")
    rows = (*data.shape[:-1], 1)
    if scale is not None and not _broadcasts(scale.shape, rows):
        raise ArgumentError(
            f"scale of shape {tuple(scale.shape)} does not broadcast to the rows {rows} of the "
            "data; give one scale per row or fewer."
        )
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _OUT_FLOATS:
        raise ArgumentTypeError(
            f"out_dtype={show(out_dtype)}: expected torch.float32, bfloat16, float16 or float64."
        )
    if out is not None and (
        not isinstance(out, torch.Tensor) or out.shape != data.shape or out.dtype != out_dtype
    ):
        raise ArgumentError(
            f"out must be a {out_dtype} tensor of shape {tuple(data.shape)}; got {show(out)}."
        )


def _broadcasts(shape: torch.Size, target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without changing it."""
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == target
    except RuntimeError:
        return False
