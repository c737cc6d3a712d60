"""KV codecs: page data types, fp8 quantization with scales, and the fast CPU fp8 decode."""

from __future__ import annotations

from kvmem.quant._codec import Encoded, FP8Codec, KVCodec, PlainCodec, make_codec
from kvmem.quant._formats import FORMATS, PageDType, PageFormat, ScaleGranularity, page_format
from kvmem.quant._fp8 import fp8_to_float

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
