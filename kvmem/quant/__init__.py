"""KV codecs: page data types, fp8 quantization with scales, and the fast CPU fp8 decode.

Names are imported on first use, so ``kvmem.quant.int4``'s byte arithmetic (which the capacity
planner uses) imports without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmem.quant._codec import Encoded, FP8Codec, KVCodec, PlainCodec, make_codec
    from kvmem.quant._formats import (
        FORMATS,
        PageDType,
        PageFormat,
        ScaleGranularity,
        page_format,
    )
    from kvmem.quant._fp8 import fp8_to_float

_LAZY = {
    "Encoded": "kvmem.quant._codec",
    "FP8Codec": "kvmem.quant._codec",
    "KVCodec": "kvmem.quant._codec",
    "PlainCodec": "kvmem.quant._codec",
    "make_codec": "kvmem.quant._codec",
    "FORMATS": "kvmem.quant._formats",
    "PageDType": "kvmem.quant._formats",
    "PageFormat": "kvmem.quant._formats",
    "ScaleGranularity": "kvmem.quant._formats",
    "page_format": "kvmem.quant._formats",
    "fp8_to_float": "kvmem.quant._fp8",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmem.quant' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "FORMATS",
    "Encoded",
    "FP8Codec",
    "KVCodec",
    "PageDType",
    "PageFormat",
    "PlainCodec",
    "ScaleGranularity",
    "fp8_to_float",
    "make_codec",
    "page_format",
]
