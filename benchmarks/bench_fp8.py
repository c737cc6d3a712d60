"""FP8 -> bf16/fp32 decode on the CPU, next to torch's own cast and a plain bf16 copy. Prints JSON.

Each case decodes ``--elements`` fp8 bytes (rows of ``--width``, one fp32 scale per row, as
token_head pages have) into a preallocated output; the bf16 copy moves the same number of
elements bf16 -> bf16. Figures are medians over ``--repeat`` runs:

    gbps          fp8 bytes decoded per second of wall time (= G elements/s; copy: elements too)
    out_gbps      output bytes written per second
    cpu_gbps      the same rate over process CPU time (what the cores did, whatever else runs)
    ratio_to_copy elements/s over the bf16 copy's elements/s, same run

    python benchmarks/bench_fp8.py [--elements 16777216] [--width 128] [--repeat 9]
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable

import torch

from kvmem.cli.args import Parser, number
from kvmem.quant import fp8_to_float

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
OUT = {"bf16": torch.bfloat16, "fp32": torch.float32}


def median_times(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of ``fn`` after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return sorted(wall)[repeat // 2], sorted(cpu)[repeat // 2]


def case(n: int, out_bytes: int, wall: float, cpu: float, copy_rate: float | None) -> dict:
    row = {
        "seconds": wall,
        "gbps": n / wall / 1e9,
        "out_gbps": n * out_bytes / wall / 1e9,
        "cpu_gbps": n / cpu / 1e9 if cpu > 0 else None,
    }
    if copy_rate is not None:
        row["ratio_to_copy"] = (n / wall) / copy_rate
    return row


def main() -> None:
    ap = Parser(prog="bench_fp8.py", description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=number(int, 1), default=1 << 24)
    ap.add_argument("--width", type=number(int, 1), default=128)
    ap.add_argument("--repeat", type=number(int, 1), default=9)
    ap.add_argument("--threads", type=number(int, 1), default=None,
                    help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = args.elements // args.width
    n = rows * args.width
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (rows, args.width), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0  # no e4m3fn NaN bytes, as in a pool
    scale = torch.rand(rows, 1, generator=g) + 0.5

    src = torch.randn(rows, args.width, generator=g).bfloat16()
    dst = torch.empty_like(src)
    wall, cpu = median_times(lambda: dst.copy_(src), args.repeat)
    copy_rate = n / wall
    report: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "elements": n,
        "width": args.width,
        "bf16_copy": case(n, 2, wall, cpu, None),
    }
    for fmt, fp8_dtype in FP8.items():
        for out_name, out_dtype in OUT.items():
            out = torch.empty(rows, args.width, dtype=out_dtype)
            typed = raw.view(fp8_dtype)
            wall, cpu = median_times(lambda t=typed, o=out: o.copy_(t), max(3, args.repeat // 3))
            report[f"torch_cast_{fmt}_to_{out_name}"] = case(
                n, out.element_size(), wall, cpu, copy_rate
            )
            wall, cpu = median_times(
                lambda f=fmt, o=out, d=out_dtype: fp8_to_float(raw, f, scale, d, out=o),
                args.repeat,
            )
            report[f"kvmem_{fmt}_to_{out_name}"] = case(n, out.element_size(), wall, cpu, copy_rate)
            want = (typed.float() * scale).to(out_dtype)
            report[f"kvmem_{fmt}_to_{out_name}"]["bit_identical_to_torch"] = bool(
                ((out == want) | (out.isnan() & want.isnan())).all()
            )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
