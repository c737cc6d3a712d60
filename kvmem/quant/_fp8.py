"""FP8 bytes -> float, fast on CPU.

torch's own ``float8 -> bfloat16/float32`` cast runs at ~0.1 G elements/s on the CPUs kvmem is
tested on: a CPU engine reading FP8 pages would spend its time there. The fast path never
touches an fp8 type. It widens each byte, as a signed int8, into the 16-bit pattern of an IEEE
half that holds exactly the same value scaled by a power of two, and lets one fp32 multiply
(which we need anyway for the page scale) undo the power of two::

    e4m3fn   s eeee mmm        ->  half  s 0eeee mmm0000000   = value * 2**-8   (normals and
                                                               subnormals alike: both formats
                                                               keep 1 + 3 bits apart by 8 in
                                                               the exponent)
    e5m2     s eeeee mm        ->  half  s eeeee mm00000000   = value           (e5m2 is the top
                                                               byte of a half)

    int8 b * 128 (int16) puts the byte at bits 7..14; the sign of a negative byte also sets
    bit 14, so e4m3 clears it with a mask (0xBF80). e5m2 is int8 b * 256, no mask.

A few passes over buffers that stay in cache (widen+shift, mask, half -> fp32, the scale
multiply, the output cast), done in chunks sized for torch's thread count. The result is
bit-identical to ``(data.view(fp8).float() * scale).to(out_dtype)``, except that the e4m3fn NaN
bytes 0x7F/0xFF decode to +-480 instead of NaN: kvmem never writes them
(see :mod:`kvmem.quant._codec`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvmem._validate import real, show
from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.quant._formats import page_format

__all__ = ["fp8_to_float"]

# Elements per chunk with one torch thread: just under torch's parallel grain (32768), so ops
# run inline. With more threads: 256K elements (0.5 MiB of int16 scratch, 1 MiB of fp32) per
# op, large enough to split across threads, small enough to stay in L2. Both measured best on
# the 2-core CI machine (benchmarks/bench_fp8.py).
_CHUNK_ELEMS = 32767
_THREADED_CHUNK_ELEMS = 1 << 18
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_E4M3_MASK = -16512  # 0xBF80 as int16: keep sign, exponent and mantissa; drop the sign's echo
_WIDEN = {  # int8 -> int16 multiplier that places the byte, and the factor the half is off by
    "fp8_e4m3": (128, 256.0),
    "fp8_e5m2": (256, 1.0),
}


@torch.no_grad()
def fp8_to_float(
    data: torch.Tensor,
    fmt: str,
    scale: torch.Tensor | float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode FP8 bytes and multiply by their scale.

    Parameters
    ----------
    data : [..., D], uint8 (or the matching float8 dtype)
        Raw FP8 bytes; contiguous.
    fmt : "fp8_e4m3" or "fp8_e5m2"
    scale : None, a float, or float32 tensor broadcastable to ``[..., 1]`` (data.shape[:-1] + (1,))
        Dequantization scale: the result is ``value * scale``.
    out_dtype : torch.float32, torch.bfloat16 or torch.float16
    out : [..., D], out_dtype, optional
        Contiguous tensor to write into (saves an allocation on hot paths).

    Returns
    -------
    [..., D], out_dtype
    """
    _check_args(data, fmt, scale, out_dtype)
    out = _output(data, out_dtype, out)
    if data.numel() == 0:
        return out
    if data.device.type != "cpu":
        # Accelerators cast fp8 natively at full bandwidth; the bit trick is a CPU remedy.
        value = data.view(page_format(fmt).dtype).float()
        if scale is not None:
            value = value * scale
        return out.copy_(value)

    multiplier, undo = _WIDEN[fmt]
    width = data.shape[-1]
    rows = data.numel() // width
    src = data.view(torch.int8).reshape(rows, width)
    mult = _row_multipliers(scale, data.shape[:-1], rows, undo)
    if undo != 1 and not bool(torch.isfinite(mult).all()):
        # scale * 256 overflowed fp32 (a scale above 1.3e36), and 0 * inf would decode a zero
        # byte as NaN: such scales take torch's cast.
        per_row = _row_multipliers(scale, data.shape[:-1], rows, 1.0)
        out.view(rows, width).copy_(src.view(page_format(fmt).dtype).float() * per_row)
        return out
    _decode_rows(src, out.view(rows, width), mult, multiplier, fmt == "fp8_e4m3")
    return out


def _check_args(
    data: torch.Tensor, fmt: str, scale: torch.Tensor | float | None, out_dtype: torch.dtype
) -> None:
    """Refuse a format, bytes, scale or output dtype :func:`fp8_to_float` cannot decode."""
    if not isinstance(fmt, str):
        raise ArgumentTypeError(f"fmt={show(fmt)}: expected 'fp8_e4m3' or 'fp8_e5m2'.")
    if fmt not in _WIDEN:
        raise ArgumentError(f"fmt={fmt!r}: fp8_to_float decodes fp8_e4m3 or fp8_e5m2.")
    if not isinstance(data, torch.Tensor):
        raise ArgumentTypeError(f"data={show(data)}: expected a uint8 tensor of FP8 bytes.")
    if data.dtype not in (torch.uint8, page_format(fmt).dtype):
        raise ArgumentTypeError(
            f"fp8_to_float needs uint8 (or {page_format(fmt).dtype}) bytes; got {data.dtype}."
        )
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in _OUT_DTYPES:
        raise ArgumentTypeError(
            f"out_dtype={show(out_dtype)}: expected torch.float32, bfloat16, float16 or float64."
        )
    if scale is not None and not isinstance(scale, torch.Tensor):
        real(scale, "scale")
    elif isinstance(scale, torch.Tensor) and not scale.dtype.is_floating_point:
        raise ArgumentTypeError(f"scale has dtype {scale.dtype}: expected a float tensor.")
    if data.dim() == 0 or not data.is_contiguous():
        raise ArgumentError(
            f"fp8_to_float needs a contiguous tensor of at least one dimension; got shape "
            f"{tuple(data.shape)} (contiguous={data.is_contiguous()}). Call .contiguous() first."
        )


def _output(data: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, checked against ``data``, or a new tensor of its shape."""
    if out is None:
        return torch.empty(data.shape, dtype=out_dtype, device=data.device)
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != data.shape
        or out.dtype != out_dtype
        or not out.is_contiguous()
    ):
        raise ArgumentError(
            f"out must be a contiguous {out_dtype} tensor of shape {tuple(data.shape)}; got "
            f"{show(out) if not isinstance(out, torch.Tensor) else (out.dtype, tuple(out.shape))}."
        )
    return out


def _decode_rows(
    src: torch.Tensor, dst: torch.Tensor, mult: torch.Tensor, multiplier: int, mask: bool
) -> None:
    """Decode int8 rows ``src`` [R, W] into ``dst`` [R, W], one cache-sized chunk at a time.

    With several torch threads, chunks are large enough for each op to run on all of them
    (integer steps in torch). With one, chunks stay under torch's parallel grain and the
    integer steps run in numpy, whose per-call cost is lower.
    """
    rows, width = src.shape
    threaded = torch.get_num_threads() > 1
    step = max(1, (_THREADED_CHUNK_ELEMS if threaded else _CHUNK_ELEMS) // width)
    step = min(step, rows)
    scratch = torch.empty((step, width), dtype=torch.int16)
    halves = scratch.view(torch.float16)
    wide = torch.empty((step, width), dtype=torch.float32)
    widen = torch.tensor([multiplier], dtype=torch.int16)
    src_np, scratch_np, widen_np = src.numpy(), scratch.numpy(), np.int16(multiplier)
    direct = dst.dtype == torch.float32
    outs = dst.split(step)
    mults = mult.split(step) if mult.shape[0] > 1 else [mult] * len(outs)
    for i, (out, m) in enumerate(zip(outs, mults)):
        a = i * step
        n = out.shape[0]
        bits, half, f32 = (
            (scratch, halves, wide) if n == step else (scratch[:n], halves[:n], wide[:n])
        )
        if threaded:
            torch.mul(src[a : a + n], widen, out=bits)
            if mask:
                bits.bitwise_and_(_E4M3_MASK)
        else:
            np.multiply(src_np[a : a + n], widen_np, out=scratch_np[:n], dtype=np.int16)
            if mask:
                np.bitwise_and(scratch_np[:n], _E4M3_MASK, out=scratch_np[:n])
        # half -> fp32 is exact; one fp32 multiply; then one rounding into dst's dtype.
        if direct:
            out.copy_(half)
            out.mul_(m)
        else:
            f32.copy_(half)
            f32.mul_(m)
            out.copy_(f32)


def _row_multipliers(
    scale: torch.Tensor | float | None, lead_shape: torch.Size, rows: int, undo: float
) -> torch.Tensor:
    """float32 [rows, 1] (or [1, 1] when one value serves all): scale times the widening's undo."""
    if scale is None:
        return torch.tensor([[undo]], dtype=torch.float32)
    if not isinstance(scale, torch.Tensor):
        return torch.tensor([[float(scale) * undo]], dtype=torch.float32)
    s = scale.to(dtype=torch.float32, device="cpu")
    if s.numel() == 1:
        return s.reshape(1, 1) * undo
    try:
        s = s.expand(*lead_shape, 1)
    except RuntimeError as e:
        raise ArgumentError(
            f"scale of shape {tuple(scale.shape)} does not broadcast to the rows "
            f"{(*lead_shape, 1)} of the data; give one scale per row or fewer."
        ) from e
    return s.reshape(rows, 1) * undo
