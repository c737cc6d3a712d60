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

A few passes over buffers that stay in cache (widen+shift and mask in numpy, which runs these
integer loops faster than torch here; half -> fp32, the scale multiply and the output cast in
torch), done in chunks, split across threads for large inputs. The result is bit-identical to
``(data.view(fp8).float() * scale).to(out_dtype)``, except that the e4m3fn NaN bytes 0x7F/0xFF
decode to +-480 instead of NaN: kvmem never writes them (see :mod:`kvmem.quant._codec`).
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import torch

from kvmem.errors import ConfigError
from kvmem.quant._formats import page_format

__all__ = ["fp8_to_float"]

# Elements per chunk: just under torch's parallel grain (32768), so each op runs inline, and
# 64 KiB of int16 scratch that stays in L2 next to the chunk's output.
_CHUNK_ELEMS = 32767
# Inputs this large (per worker) are split across threads, up to torch's thread count.
_PARALLEL_ELEMS = 1 << 20
_MAX_WORKERS = max(1, min(8, os.cpu_count() or 1))
_EXECUTOR: ThreadPoolExecutor | None = None
_E4M3_MASK = -16512  # 0xBF80 as int16: keep sign, exponent and mantissa; drop the sign's echo
_WIDEN = {  # int8 -> int16 multiplier that places the byte, and the factor the half is off by
    "fp8_e4m3": (128, 256.0),
    "fp8_e5m2": (256, 1.0),
}


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
    if fmt not in _WIDEN:
        raise ConfigError(f"fp8_to_float decodes fp8_e4m3 or fp8_e5m2; got {fmt!r}.")
    if data.dtype not in (torch.uint8, page_format(fmt).dtype):
        raise ConfigError(
            f"fp8_to_float needs uint8 (or {page_format(fmt).dtype}) bytes; got {data.dtype}."
        )
    if data.dim() == 0 or not data.is_contiguous():
        raise ConfigError(
            f"fp8_to_float needs a contiguous tensor of at least one dimension; got shape "
            f"{tuple(data.shape)} (contiguous={data.is_contiguous()}). Call .contiguous() first."
        )
    if out is None:
        out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    elif out.shape != data.shape or out.dtype != out_dtype or not out.is_contiguous():
        raise ConfigError(
            f"out must be a contiguous {out_dtype} tensor of shape {tuple(data.shape)}; got "
            f"{out.dtype} {tuple(out.shape)}."
        )
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
    src = data.view(torch.int8).reshape(rows, width).numpy()
    dst = out.view(rows, width)
    mult = _row_multipliers(scale, data.shape[:-1], rows, undo)
    workers = min(torch.get_num_threads(), _MAX_WORKERS, max(1, data.numel() // _PARALLEL_ELEMS))
    if workers == 1:
        _decode_rows(src, dst, mult, multiplier, fmt == "fp8_e4m3", 0, rows)
        return out
    bounds = [rows * i // workers for i in range(workers + 1)]
    jobs = [
        _executor().submit(_decode_rows, src, dst, mult, multiplier, fmt == "fp8_e4m3", a, b)
        for a, b in itertools.pairwise(bounds)
    ]
    for job in jobs:
        job.result()
    return out


def _decode_rows(
    src: npt.NDArray[np.int8],
    dst: torch.Tensor,
    mult: torch.Tensor,
    multiplier: int,
    mask: bool,
    r0: int,
    r1: int,
) -> None:
    """Decode rows r0..r1 of ``src`` into ``dst``, one cache-sized chunk at a time.

    Each chunk stays under torch's parallel grain size, so its ops run inline on the calling
    thread: workers split rows among themselves instead of meeting at a barrier per op.
    """
    width = src.shape[1]
    step = max(1, _CHUNK_ELEMS // width)
    scratch = np.empty((min(step, r1 - r0), width), dtype=np.int16)
    halves = torch.from_numpy(scratch).view(torch.float16)
    wide = torch.empty(halves.shape, dtype=torch.float32)
    widen = np.int16(multiplier)
    direct = dst.dtype == torch.float32
    outs = dst[r0:r1].split(step)
    mults = mult[r0:r1].split(step) if mult.shape[0] > 1 else [mult] * len(outs)
    for i, (out, m) in enumerate(zip(outs, mults)):
        a = r0 + i * step
        n = out.shape[0]
        bits, half, f32 = (
            (scratch, halves, wide)
            if n == scratch.shape[0]
            else (scratch[:n], halves[:n], wide[:n])
        )
        np.multiply(src[a : a + n], widen, out=bits, dtype=np.int16)
        if mask:
            np.bitwise_and(bits, _E4M3_MASK, out=bits)
        # half -> fp32 is exact; one fp32 multiply; then one rounding into dst's dtype.
        if direct:
            out.copy_(half)
            out.mul_(m)
        else:
            f32.copy_(half)
            f32.mul_(m)
            out.copy_(f32)


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(_MAX_WORKERS, thread_name_prefix="kvmem-fp8")
    return _EXECUTOR


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
        raise ConfigError(
            f"scale of shape {tuple(scale.shape)} does not broadcast to the rows "
            f"{(*lead_shape, 1)} of the data; give one scale per row or fewer."
        ) from e
    return s.reshape(rows, 1) * undo
