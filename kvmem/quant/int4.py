"""Reference INT4 weight codec: symmetric, group-wise, packed 8 per int32.

The layout is the one compressed-tensors calls ``pack-quantized`` (the format Kimi K2.x ships its
routed experts in)::

    weight            [out_features, in_features]            bf16/fp16/fp32
    weight_packed     [out_features, in_features // 8]       int32
    weight_scale      [out_features, in_features // group]   bf16 (one scale per group of inputs)
    weight_shape      [2]                                    int32 (the unpacked shape)

Each int4 value ``q`` in ``[-8, 7]`` is stored as the nibble ``q + 8``; the 8 nibbles of one int32
hold 8 consecutive input columns, column ``8*j + i`` in bits ``4*i .. 4*i+3`` (lowest bits first).
The scale of a group is ``max|w| / 7`` so every weight maps into ``[-7, 7]`` without clipping;
dequantization is ``q * scale``.

Bytes per parameter are ``0.5 + scale_bytes / group_size`` (+ ``0.5 / group_size`` for packed
zero points): 0.5625 at group 32 and 0.515625 at group 128 with bf16 scales. The capacity planner
uses :func:`int4_bytes_per_param` for its weight arithmetic, so the two cannot disagree.

This module imports torch only inside the functions that need it, so that ``kvmem.planning``
(which imports this module) stays importable and fast without touching torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvmem._validate import flag, integer, show
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "INT4_PACK_FACTOR",
    "Int4Weight",
    "dequantize_int4",
    "int4_bytes_per_param",
    "pack_int4",
    "quantize_int4",
    "unpack_int4",
]

INT4_PACK_FACTOR = 8  # int4 values per int32
_QMAX = 7
_SCALE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


def int4_bytes_per_param(
    group_size: int = 32, scale_dtype: str = "bfloat16", zero_point: bool = False
) -> float:
    """Bytes one parameter costs in the packed INT4 format, scales (and zero points) included.

    Parameters
    ----------
    group_size : int
        Input columns that share one scale; must be a positive multiple of 8.
    scale_dtype : str
        ``"bfloat16"``, ``"float16"`` or ``"float32"`` (short forms ``bf16``/``fp16``/``fp32``).
    zero_point : bool
        Asymmetric quantization: one int4 zero point per group, packed like the values.

    Returns
    -------
    float
        ``0.5 + scale_bytes / group_size (+ 0.5 / group_size)``: 0.5625 for group 32 with bf16
        scales, 0.515625 for group 128.
    """
    _check_group_size(group_size)
    zero_point = flag(zero_point, "zero_point")
    if not isinstance(scale_dtype, str):
        raise ArgumentTypeError(
            f"scale_dtype={show(scale_dtype)}: expected one of {sorted(set(_SCALE_BYTES))}."
        )
    if scale_dtype not in _SCALE_BYTES:
        raise ConfigError(
            f"INT4 scale dtype {scale_dtype!r} is not supported; use one of "
            f"{sorted(set(_SCALE_BYTES))}."
        )
    per_group = _SCALE_BYTES[scale_dtype] + (0.5 if zero_point else 0.0)
    return 0.5 + per_group / group_size


class Int4Weight(NamedTuple):
    """A weight matrix in the packed INT4 format.

    Attributes
    ----------
    packed : torch.Tensor
        ``[out_features, in_features // 8]``, int32.
    scales : torch.Tensor
        ``[out_features, in_features // group_size]``, the scale dtype (bf16 by default).
    shape : tuple[int, int]
        ``(out_features, in_features)`` of the unpacked weight.
    group_size : int
        Input columns per scale.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes of ``packed`` plus ``scales`` (the ``weight_shape`` tensor is not counted)."""
        return int(
            self.packed.numel() * self.packed.element_size()
            + self.scales.numel() * self.scales.element_size()
        )


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int4 values, 8 per int32, in the compressed-tensors order.

    Parameters
    ----------
    values : torch.Tensor
        ``[rows, cols]``, any integer dtype, every value in ``[-8, 7]``; ``cols % 8 == 0``.

    Returns
    -------
    torch.Tensor
        ``[rows, cols // 8]``, int32: column ``8*j + i`` of ``values`` in bits ``4*i..4*i+3``
        of column ``j``, stored as ``value + 8``.
    """
    import torch

    if not isinstance(values, torch.Tensor):
        raise ArgumentTypeError(f"values={show(values)}: expected a 2-D integer tensor.")
    if values.dim() != 2:
        raise ArgumentError(f"pack_int4 takes a 2-D tensor; got shape {tuple(values.shape)}.")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ArgumentTypeError(
            f"pack_int4 takes integer values in [-8, 7]; got dtype {values.dtype}. "
            "Quantize first (quantize_int4)."
        )
    rows, cols = values.shape
    if cols % INT4_PACK_FACTOR:
        raise ArgumentError(
            f"pack_int4 needs a column count divisible by {INT4_PACK_FACTOR}; got {cols}. "
            "Pad the input features first."
        )
    if values.numel() and (int(values.min()) < -8 or int(values.max()) > 7):
        raise ArgumentError(
            f"pack_int4 values must lie in [-8, 7]; found [{int(values.min())}, "
            f"{int(values.max())}]."
        )
    nibbles = (values.to(torch.int64) + 8).reshape(rows, cols // INT4_PACK_FACTOR, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (nibbles << shifts).sum(dim=2)  # in [0, 2**32): reinterpret as signed int32
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`.

    Parameters
    ----------
    packed : torch.Tensor
        ``[rows, cols // 8]``, int32.

    Returns
    -------
    torch.Tensor
        ``[rows, cols]``, int8, every value in ``[-8, 7]``.
    """
    import torch

    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise ArgumentTypeError(
            f"packed={show(packed) if not isinstance(packed, torch.Tensor) else packed.dtype}: "
            "expected a 2-D int32 tensor."
        )
    if packed.dim() != 2:
        raise ArgumentError(
            f"unpack_int4 takes a 2-D int32 tensor; got shape {tuple(packed.shape)} dtype "
            f"{packed.dtype}."
        )
    rows, words = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    unsigned = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (unsigned.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).reshape(rows, words * INT4_PACK_FACTOR)


def quantize_int4(
    weight: torch.Tensor, group_size: int = 32, scale_dtype: str = "bfloat16"
) -> Int4Weight:
    """Quantize a weight matrix to symmetric group-wise INT4 and pack it.

    Parameters
    ----------
    weight : torch.Tensor
        ``[out_features, in_features]``, floating point, finite; ``in_features`` a multiple of
        ``group_size``.
    group_size : int
        Input columns per scale (a positive multiple of 8).
    scale_dtype : str
        Dtype of the stored scales (``"bfloat16"`` by default).

    Returns
    -------
    Int4Weight
        Packed values and scales. The scale is rounded to ``scale_dtype`` before the values are
        computed, so ``dequantize_int4`` reproduces exactly what a kernel would. A group whose
        scale rounds to 0 there (fp16 below ~6e-8) is stored as 0.

    Raises
    ------
    ArgumentError
        NaN/inf in the weight, or a scale ``max|w| / 7`` beyond ``scale_dtype``'s range
        (float16: 65504, so ``|w|`` above 458,528).
    """
    import torch

    _check_group_size(group_size)
    _torch_dtype(scale_dtype)
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
        raise ArgumentTypeError(
            f"weight={show(weight) if not isinstance(weight, torch.Tensor) else weight.dtype}: "
            "expected a 2-D floating-point tensor."
        )
    if weight.dim() != 2:
        raise ArgumentError(
            f"quantize_int4 takes a 2-D floating-point weight; got shape {tuple(weight.shape)} "
            f"dtype {weight.dtype}."
        )
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ArgumentError(
            f"in_features {in_features} is not a multiple of group_size {group_size}; pad the "
            "weight or pick a group size that divides it."
        )
    w = weight.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ArgumentError("quantize_int4 got NaN or inf in the weight; nothing was quantized.")
    groups = w.reshape(out_features, in_features // group_size, group_size)
    amax = groups.abs().amax(dim=2)
    # An all-zero group gets scale 1 so the division below is defined; its values stay 0.
    scales = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax)).to(
        _torch_dtype(scale_dtype)
    )
    if not bool(torch.isfinite(scales).all()):  # fp16 scales end at 65504: inf, and 0 * inf = NaN
        raise ArgumentError(
            f"a group's scale max|w| / 7 = {float(amax.max()) / _QMAX:g} does not fit "
            f"{scale_dtype} scales; use bfloat16 or float32 scales. Nothing was quantized."
        )
    # A scale that underflowed to 0 dequantizes its group to 0: divide by 1 (no 0 / 0 = NaN).
    divisor = scales.to(torch.float32)
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    q = torch.round(groups / divisor.unsqueeze(-1)).clamp_(-8, 7)
    values = q.to(torch.int8).reshape(out_features, in_features)
    return Int4Weight(pack_int4(values), scales, (out_features, in_features), group_size)


def dequantize_int4(q: Int4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpack and rescale: ``value * scale`` for every weight.

    Parameters
    ----------
    q : Int4Weight
        The packed weight.
    dtype : torch.dtype, optional
        Output dtype; float32 by default.

    Returns
    -------
    torch.Tensor
        ``[out_features, in_features]``.
    """
    import torch

    if not isinstance(q, Int4Weight):
        raise ArgumentTypeError(f"q={show(q)}: expected an Int4Weight (from quantize_int4).")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ArgumentTypeError(f"dtype={show(dtype)}: expected None or a float torch.dtype.")
    if not isinstance(q.scales, torch.Tensor) or not q.scales.dtype.is_floating_point:
        raise ArgumentTypeError(f"q.scales={show(q.scales)}: expected a float tensor.")
    out_features, in_features = (integer(n, "q.shape", minimum=0) for n in q.shape)
    group = integer(q.group_size, "q.group_size", minimum=1)
    values = unpack_int4(q.packed).to(torch.float32)
    if values.shape != (out_features, in_features) or in_features % group:
        raise ArgumentError(
            f"packed weight unpacks to {tuple(values.shape)} but its shape says "
            f"{(out_features, in_features)} in groups of {group}; they must agree."
        )
    if tuple(q.scales.shape) != (out_features, in_features // group):
        raise ArgumentError(
            f"q.scales has shape {tuple(q.scales.shape)}; a {out_features} x {in_features} "
            f"weight in groups of {group} needs {(out_features, in_features // group)}."
        )
    groups = values.reshape(out_features, in_features // group, group)
    w = (groups * q.scales.to(torch.float32).unsqueeze(-1)).reshape(out_features, in_features)
    return w.to(dtype or torch.float32)


def _check_group_size(group_size: int) -> None:
    integer(group_size, "group_size")
    if group_size <= 0 or group_size % INT4_PACK_FACTOR:
        raise ArgumentError(
            f"INT4 group size must be a positive multiple of {INT4_PACK_FACTOR}; got {group_size}."
        )


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float32": torch.float32,
        "fp32": torch.float32,
    }
    if not isinstance(name, str):
        raise ArgumentTypeError(f"scale_dtype={show(name)}: expected one of {sorted(table)}.")
    if name not in table:
        raise ConfigError(
            f"INT4 scale dtype {name!r} is not supported; use one of {sorted(table)}."
        )
    return table[name]
