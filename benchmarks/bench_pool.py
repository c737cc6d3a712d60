"""PagePool write (quantize + scatter) and read (gather + dequantize) per page dtype. Prints JSON.

One layer of ``--tokens`` tokens (``--heads`` x ``--head-dim``, bf16 input) is written into
shuffled pages and read back as bf16. Every rate counts the same logical bytes, the K/V in bf16
(tokens x 2 x heads x head_dim x 2 B), so dtypes compare directly, and each is divided by a
plain bf16 copy of those bytes (``dst.copy_(src)``) measured in the same run. Medians over
``--repeat`` runs. Writes run with ``check=False`` (the engine checks a step's slot mapping once).

    python benchmarks/bench_pool.py [--device cuda|cpu] [--tokens 16384] [--repeat 7]

JSON: ``copy_gbps`` at the top; per page dtype ``write_gbps``, ``read_gbps``,
``write_ratio_to_copy``, ``read_ratio_to_copy`` (fp8 with tensor scales; token_head scales as
``<dtype>_token_head``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import torch

from kvmem.cli.args import Parser, number
from kvmem.cuda import PagePool, PoolSpec

CASES = [
    ("fp32", "fp32", None),
    ("bf16", "bf16", None),
    ("fp16", "fp16", None),
    ("fp8_e4m3", "fp8_e4m3", "tensor"),
    ("fp8_e5m2", "fp8_e5m2", "tensor"),
    ("fp8_e4m3_token_head", "fp8_e4m3", "token_head"),
]


def median_seconds(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeat // 2]


def _device(text: str) -> torch.device:
    """An argparse ``type=``: a device torch can use here (one line when it is not)."""
    try:
        device = torch.device(text)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device torch can use here ({e})"
                                         .splitlines()[0]) from None
    return device


def main() -> None:
    ap = Parser(prog="bench_pool.py", description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=_device,
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=number(int, 1), default=16384)
    ap.add_argument("--heads", type=number(int, 1), default=8)
    ap.add_argument("--head-dim", type=number(int, 1), default=128)
    ap.add_argument("--page-size", type=number(int, 1), default=16)
    ap.add_argument("--repeat", type=number(int, 1), default=7)
    args = ap.parse_args()
    device = args.device
    num_pages = -(-args.tokens // args.page_size)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(args.tokens, args.heads, args.head_dim, generator=g).bfloat16().to(device)
    v = torch.randn(args.tokens, args.heads, args.head_dim, generator=g).bfloat16().to(device)
    pages = torch.randperm(num_pages, generator=g)
    pos = torch.arange(args.tokens)
    slots = (pages[pos // args.page_size] * args.page_size + pos % args.page_size).to(device)
    read_pages = pages.to(device)
    logical = args.tokens * 2 * args.heads * args.head_dim * 2

    src = torch.stack((k, v), dim=1)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), args.repeat, device)
    copy_gbps = logical / copy_s / 1e9
    report: dict = {
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "tokens": args.tokens,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "logical_bytes": logical,
        "copy_gbps": copy_gbps,
    }
    for name, dtype, scales in CASES:
        spec = PoolSpec(
            num_layers=1,
            num_pages=num_pages,
            page_size=args.page_size,
            num_kv_heads=args.heads,
            head_dim=args.head_dim,
            dtype=dtype,
            scales=scales,
            device=str(device),
            compute_dtype="bf16",
        )
        pool = PagePool(spec)
        write_s = median_seconds(
            lambda p=pool: p.write(0, slots, k, v, check=False), args.repeat, device
        )
        read_s = median_seconds(lambda p=pool: p.gather(0, read_pages), args.repeat, device)
        write_gbps, read_gbps = logical / write_s / 1e9, logical / read_s / 1e9
        report[name] = {
            "write_gbps": write_gbps,
            "read_gbps": read_gbps,
            "write_ratio_to_copy": write_gbps / copy_gbps,
            "read_ratio_to_copy": read_gbps / copy_gbps,
            "pool_bytes_per_token": spec.bytes_per_token,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
