"""Reserve policies: how much of a GPU's memory stays out of the KV pool.

A fixed number of GiB (:class:`FixedReserve`), a fraction of memory for weights + KV
(:class:`MemoryFraction`, ``--mem-fraction-static`` / ``gpu_memory_utilization`` style), or
:class:`SGLangPolicy`, which recomputes SGLang's documented default ``mem_fraction_static``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool

from kvmem._specs import NonNegativeReal, PositiveInt, PositiveReal, SpecModel
from kvmem._validate import integer, show
from kvmem.errors import ArgumentTypeError
from kvmem.planning._spec import GPUSpec, VisionSpec

__all__ = [
    "FixedReserve",
    "MemoryFraction",
    "ReservePolicy",
    "SGLangPolicy",
    "sglang_mem_fraction_static",
]


class FixedReserve(SpecModel):
    """Keep ``reserve_gib`` per GPU out of the KV pool (activations, graphs, CUDA context)."""

    kind: Literal["fixed"] = "fixed"
    reserve_gib: NonNegativeReal = 8.0
    positional_fields = ("reserve_gib",)  # FixedReserve(8)

    def describe(self) -> str:
        return f"fixed reserve {self.reserve_gib:g} GiB"


class MemoryFraction(SpecModel):
    """Weights plus KV pool take ``fraction`` of GPU memory; the rest is reserve."""

    kind: Literal["fraction"] = "fraction"
    fraction: PositiveReal = Field(default=0.9, le=1)
    positional_fields = ("fraction",)  # MemoryFraction(0.9)

    def describe(self) -> str:
        return f"memory fraction {self.fraction:g}"


class SGLangPolicy(SpecModel):
    """SGLang's default ``mem_fraction_static`` heuristic, as its server_args documents it.

    SGLang picks ``chunked_prefill_size`` and ``cuda_graph_max_bs`` from the GPU's memory
    (H100/H200: 8192 and 256, or 512 at TP >= 4; B200/MI300X: 16384 and 512) and reserves, in MiB::

        512 + 1.5 * max(chunked_prefill_size, 2048) + 2 * cuda_graph_max_bs + 1024 * tp * pp / 8
            [+ 3 * cuda_graph_max_bs * dp (+1.5 * ... above bs 300) with DP attention]
            at least 10240 on GPUs over 60 GiB; + 2048 for EAGLE/MTP drafts, + 6144 standalone

    ``mem_fraction_static = round((memory - reserved) / memory, 3)``, then, for a model with a
    vision tower, times ``0.95 * clamp(1 - 0.1 * (L * H^2 / (24 * 1024^2) - 1), 0.8, 1.05)``
    (L, H: the tower's layers and width). The KV pool is ``memory * mem_fraction_static - weights``
    less ``runtime_overhead_gib`` (CUDA context and NCCL buffers, which SGLang measures rather
    than predicts; 0 by default).
    """

    kind: Literal["sglang"] = "sglang"
    mem_fraction_static: PositiveReal | None = Field(default=None, le=1)
    chunked_prefill_size: PositiveInt | None = None
    cuda_graph_max_bs: PositiveInt | None = None
    pp: PositiveInt = 1
    dp_attention: StrictBool = False
    dp_size: PositiveInt = 1
    speculative: Literal["eagle", "standalone", "ngram"] | None = None
    vlm_adjust: StrictBool = True
    runtime_overhead_gib: NonNegativeReal = 0.0

    def describe(self) -> str:
        return (
            "sglang defaults"
            if self.mem_fraction_static is None
            else (f"sglang mem_fraction_static={self.mem_fraction_static:g}")
        )


ReservePolicy = Annotated[FixedReserve | MemoryFraction | SGLangPolicy, Field(discriminator="kind")]


def sglang_mem_fraction_static(
    gpu: GPUSpec, tp: int, policy: SGLangPolicy | None = None, vision: VisionSpec | None = None
) -> float:
    """SGLang's default ``mem_fraction_static`` on ``gpu`` at ``tp`` (:class:`SGLangPolicy`)."""
    if not isinstance(gpu, GPUSpec):
        raise ArgumentTypeError(f"gpu={show(gpu)}: expected a GPUSpec (get_gpu('h200')).")
    tp = integer(tp, "tp", minimum=1)
    if policy is not None and not isinstance(policy, SGLangPolicy):
        raise ArgumentTypeError(f"policy={show(policy)}: expected None or an SGLangPolicy.")
    if vision is not None and not isinstance(vision, VisionSpec):
        raise ArgumentTypeError(f"vision={show(vision)}: expected None or a VisionSpec.")
    policy = policy or SGLangPolicy()
    if policy.mem_fraction_static is not None:
        return policy.mem_fraction_static
    mem = gpu.memory_mib
    small_tp = tp < 4
    if mem < 20 * 1024:
        chunk, bs = 2048, 8
    elif mem < 35 * 1024:
        chunk, bs = 2048, 24 if small_tp else 80
    elif mem < 60 * 1024:
        chunk, bs = 4096, 32 if small_tp else 160
    elif mem < 160 * 1024:
        chunk, bs = 8192, 256 if small_tp else 512
    else:
        chunk, bs = 16384, 512
    chunk = policy.chunked_prefill_size or chunk
    bs = policy.cuda_graph_max_bs or bs
    reserved = 512 + max(chunk, 2048) * 1.5 + bs * 2 + tp * policy.pp / 8 * 1024
    if policy.dp_attention:
        reserved += bs * policy.dp_size * 3
        if bs > 300:
            reserved += bs * policy.dp_size * 1.5
    if mem > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    if policy.speculative == "standalone":
        reserved += 6 * 1024
    elif policy.speculative == "eagle":
        reserved += 2 * 1024
    fraction = round((mem - reserved) / mem, 3)
    if vision is not None and policy.vlm_adjust:
        ratio = vision.num_layers * vision.hidden_size**2 / (24 * 1024**2)
        factor = max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))
        fraction *= 0.95 * factor
    return fraction
