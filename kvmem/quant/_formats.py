"""The page data types kvmem stores, as numbers: width, finite range, where saturation starts.

::

    name       bytes  max finite      saturates above (max + ulp/2)   scales
    fp32         4    3.40e38         never (fp32 input)              no
    bf16         2    3.39e38         3.40e38 (fp32 input only)       no
    fp16         2    65504           65520                           no
    fp8_e4m3     1    448             464                             yes (e4m3fn: no inf)
    fp8_e5m2     1    57344           61440                           yes

"Saturates above" is the magnitude beyond which ordinary round-to-nearest would not have landed
on the largest finite value; values there are clamped and counted. A value between the maximum
and that threshold is an ordinary rounding, not a saturation.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

from kvmem._validate import show
from kvmem.errors import ArgumentTypeError, ConfigError

__all__ = [
    "FORMATS",
    "PageDType",
    "PageFormat",
    "ScaleGranularity",
    "page_format",
]

PageDType = Literal["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
ScaleGranularity = Literal["tensor", "head", "token_head"]


class PageFormat(NamedTuple):
    """One page data type: how it is stored and what range it holds."""

    name: str
    itemsize: int  # bytes per stored element
    max_finite: float
    saturation_threshold: float  # |x| above this is clamped and counted (inf: never)
    quantized: bool  # fp8: stored with scales
    dtype: torch.dtype  # the element type a kernel sees
    storage_dtype: torch.dtype  # what the pool tensor holds (uint8 for fp8)


def _fmt(name: str, dtype: torch.dtype, max_finite: float, ulp_at_max: float) -> PageFormat:
    quantized = dtype.itemsize == 1
    return PageFormat(
        name=name,
        itemsize=dtype.itemsize,
        max_finite=max_finite,
        saturation_threshold=max_finite + ulp_at_max / 2,
        quantized=quantized,
        dtype=dtype,
        storage_dtype=torch.uint8 if quantized else dtype,
    )


FORMATS: dict[str, PageFormat] = {
    "fp32": _fmt("fp32", torch.float32, torch.finfo(torch.float32).max, float("inf")),
    "bf16": _fmt("bf16", torch.bfloat16, torch.finfo(torch.bfloat16).max, 2.0**120),
    "fp16": _fmt("fp16", torch.float16, 65504.0, 32.0),
    "fp8_e4m3": _fmt("fp8_e4m3", torch.float8_e4m3fn, 448.0, 32.0),
    "fp8_e5m2": _fmt("fp8_e5m2", torch.float8_e5m2, 57344.0, 8192.0),
}
assert set(FORMATS) == set(get_args(PageDType))


def page_format(name: str) -> PageFormat:
    """The :class:`PageFormat` called ``name``; raises ``ConfigError`` listing the known ones."""
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"page dtype {show(name)}: expected one of {', '.join(FORMATS)} (a str)."
        )
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(
            f"unknown page dtype {name!r}; use one of {', '.join(FORMATS)}."
        ) from None
