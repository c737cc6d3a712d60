"""The argument checks of :class:`~kvmem.cuda.PagePool`, run before it changes a byte.

Each raises an :class:`~kvmem.errors.ArgumentError` or :class:`~kvmem.errors.ArgumentTypeError`
naming the argument; index inputs come back as 1-D int64 tensors on the pool's device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from kvmem._validate import index_array, show
from kvmem.cuda._spec import PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError

__all__ = [
    "IndexLike",
    "check_finite",
    "check_fits",
    "check_range",
    "check_slot_values",
    "index_tensor",
    "pool_device",
    "read_dtype",
    "words",
    "write_rows",
]

IndexLike = torch.Tensor | np.ndarray | Sequence[int]

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
_READ_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def read_dtype(dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """The dtype a read returns: ``dtype``, or ``default`` (the pool's compute dtype)."""
    if dtype is None:
        return default
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(
            f"dtype={show(dtype)}: expected None or torch.float32, bfloat16, float16 or float64."
        )
    if dtype not in _READ_DTYPES:
        raise ArgumentError(
            f"dtype={dtype}: expected None or torch.float32, bfloat16, float16 or float64."
        )
    return dtype


def write_rows(
    spec: PoolSpec, device: torch.device, k: torch.Tensor, v: torch.Tensor | None
) -> int:
    """Check a write's input: MHA/GQA ``k`` and ``v`` [T, H, D], MLA a latent [T, width] with
    no ``v``. Returns T, the number of tokens."""
    if spec.attention == "mla":
        if v is not None:
            raise ArgumentError(
                "MLA pools store one latent per token: call write(layer, slot_mapping, "
                "latent) without v."
            )
        _check_tensor(k, "latent", (spec.width,), device)
        return k.shape[0]
    if v is None:
        raise ArgumentError("MHA/GQA pools store keys and values: pass both k and v.")
    _check_tensor(k, "k", (spec.num_heads, spec.width), device)
    _check_tensor(v, "v", (spec.num_heads, spec.width), device)
    if k.shape[0] != v.shape[0] or k.dtype != v.dtype:
        raise ArgumentError(
            f"k and v must match in tokens and dtype; got k {tuple(k.shape)} {k.dtype}, "
            f"v {tuple(v.shape)} {v.dtype}."
        )
    return k.shape[0]


def check_finite(layer: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Refuse NaN/inf K/V input (a pool whose policy is ``nonfinite="raise"``)."""
    if not all(bool(torch.isfinite(t).all()) for t in (k, v) if t is not None):
        raise ConfigError(
            f"layer {layer}: K/V input holds NaN or inf and the pool's policy is "
            "nonfinite='raise'; nothing was written. Fix the producer, or use "
            "nonfinite='zero' to store 0 and count them."
        )


def check_slot_values(slots: torch.Tensor, spec: PoolSpec) -> None:
    """Raise unless every slot is -1 or in ``[0, num_slots)`` and none appears twice."""
    if slots.numel() == 0:
        return
    n = spec.num_slots
    lo, hi = (int(t) for t in torch.aminmax(slots))
    if lo < -1 or hi >= n:
        raise ArgumentError(
            f"slot_mapping holds slots from {lo} to {hi}, but this pool has slots "
            f"0..{n - 1} ({spec.num_pages} pages x {spec.page_size}) and -1 for "
            "padding; nothing was written. Check the page table that produced it."
        )
    used = slots[slots >= 0]
    if torch.unique(used).numel() != used.numel():
        raise ArgumentError(
            "slot_mapping names a slot more than once; two tokens cannot share a slot. "
            "Nothing was written."
        )


def _check_tensor(t: torch.Tensor, name: str, tail: tuple[int, ...], device: torch.device) -> None:
    want = ", ".join(["T", *map(str, tail)])
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(
            f"{name}={show(t)}: expected a [{want}] torch.Tensor (float32, bfloat16 or float16)."
        )
    if t.dim() != 1 + len(tail) or tuple(t.shape[1:]) != tail:
        raise ArgumentError(f"{name} has shape {tuple(t.shape)}; this pool expects [{want}].")
    if t.dtype not in _FLOAT_INPUTS:
        raise ArgumentTypeError(f"{name} has dtype {t.dtype}; pass float32, bfloat16 or float16.")
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device} but the pool is on {device}; move it first.")


def index_tensor(value: IndexLike, name: str, device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor on ``device`` from a tensor, numpy array or sequence of
    integer-likes (values are range-checked by the caller)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INDEX_DTYPES:
            raise ArgumentTypeError(
                f"{name} has dtype {value.dtype}: expected an integer tensor (int64, int32, "
                "int16, int8 or uint8)."
            )
        if value.dim() != 1:
            raise ArgumentError(f"{name} has shape {tuple(value.shape)}: expected a 1-D tensor.")
        if value.device != device:
            raise ArgumentError(
                f"{name} is on {value.device} but the pool is on {device}; move it "
                "first (numpy arrays and lists are moved for you)."
            )
        return value.long()
    arr = index_array(value, name, minimum=np.iinfo(np.int64).min)
    return torch.from_numpy(arr).to(device)


def check_range(ids: torch.Tensor, bound: int, name: str, what: str) -> None:
    """Raise unless every id is in ``[0, bound)``."""
    if ids.numel() == 0:
        return
    lo, hi = (int(t) for t in torch.aminmax(ids))
    if lo < 0 or hi >= bound:
        raise ArgumentError(
            f"{name} holds {what}s from {lo} to {hi}; valid {what}s are 0..{bound - 1}. "
            "Nothing was changed."
        )


def pool_device(spec: PoolSpec) -> torch.device:
    """The device a pool of ``spec`` lives on; a ConfigError where torch cannot put it there."""
    try:
        device = torch.device(spec.resolved_device())
    except RuntimeError as e:
        raise ConfigError(
            f"PoolSpec device={spec.device!r} is not a device torch knows ({e}); use 'cpu', "
            "'cuda' or 'cuda:N', or leave device unset."
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"PoolSpec device={spec.device!r}: kvmem pools live on 'cpu' or 'cuda[:N]'."
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"PoolSpec asks for device {spec.device!r} but CUDA is not available; use "
            "device='cpu' or leave device unset."
        )
    # The device torch really puts tensors on ("cuda" -> "cuda:0", "cpu:1" -> "cpu"): inputs are
    # compared with it, and a tensor's device never equals "cuda" without an index.
    try:
        return torch.empty(0, device=device).device
    except RuntimeError as e:
        raise ConfigError(
            f"PoolSpec device={spec.device!r}: torch cannot place a tensor there "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); use 'cpu', 'cuda' or "
            "a 'cuda:N' this machine has."
        ) from None


def check_fits(spec: PoolSpec, device: torch.device, nbytes: int) -> None:
    """Refuse a CPU pool of ``nbytes`` larger than the machine's physical memory."""
    physical = _physical_memory() if device.type == "cpu" else None
    if physical is not None and nbytes > physical:
        raise ConfigError(
            f"this pool needs {nbytes / 2**30:,.1f} GiB ({spec.describe()}) but the machine "
            f"has {physical / 2**30:,.1f} GiB of memory; use fewer pages or layers."
        )


def _physical_memory() -> int | None:
    """Bytes of physical memory, where the OS says (None where it does not)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def words(rows: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous [..., W] tensor as the widest integer words that tile a row.

    Row copies (``index_copy_``, indexed assignment) move one element at a time; moving 8-byte
    words instead of bytes makes them several times faster, and the bits are the same.
    """
    raw = rows.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.shape[-1] % word.itemsize == 0 and raw.storage_offset() % word.itemsize == 0:
            return raw.view(word)
    return raw
