"""``kvmem plan``: how many KV tokens and requests fit on a set of GPUs.

::

    kvmem plan MODEL --gpu h200 --tp 8 --kv-dtype fp8_e4m3 [--weights int4-g32]
               [--context 32768] [--concurrency 64] [--compare bf16,fp8_e4m3]
               [--offload-gib 512] [--groups [--padded-compare]] [--json] [--plot FILE.png]

Imports neither torch nor the manager: planning is pure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvmem.cli.args import (
    FRACTION,
    KV_DTYPES,
    NONNEG,
    POSITIVE,
    POSITIVE_INT,
    Parser,
    dtype_list,
    dtypes_asked,
    resolve_model,
)

__all__ = ["add_plan_parser", "format_groups", "format_plans", "run_plan"]

_SCALES = ("tensor", "head", "token_head")


def add_plan_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    """Register ``kvmem plan`` on the command line's subparsers."""
    p = sub.add_parser(
        "plan",
        help="how many KV tokens and requests fit on a set of GPUs",
        description=(
            "Plan KV capacity for MODEL (a preset name or a Hugging Face config.json) on TP x DP "
            "GPUs. Sizes are GiB (2**30 bytes); GPU memory is what the driver reports."
        ),
    )
    p.add_argument("model", nargs="?", help="preset name or path to config.json / its folder")
    p.add_argument("--list", action="store_true", help="list preset models and GPUs and exit")
    p.add_argument("--gpu", default="h200", help="GPU preset name, or 'custom' (default h200)")
    p.add_argument("--gpu-memory-gib", type=POSITIVE, help="custom GPU memory in GiB (> 0)")
    p.add_argument("--gpu-bandwidth-gbs", type=POSITIVE,
                   help="custom GPU bandwidth in GB/s (> 0)")
    p.add_argument("--tp", type=POSITIVE_INT, default=1,
                   help="tensor-parallel GPUs per replica (default 1)")
    p.add_argument("--dp", type=POSITIVE_INT, default=1,
                   help="replicas, data parallel (default 1)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, help="KV dtype (default bf16)")
    p.add_argument("--kv-scales", choices=_SCALES,
                   help="FP8 scales per tensor (default), head or token_head; fp8 KV only")
    p.add_argument("--compare", type=dtype_list,
                   help="comma-separated KV dtypes to put side by side, e.g. bf16,fp8_e4m3")
    p.add_argument("--weights", default="native",
                   help="native, bf16, fp8, int4-g<N> (e.g. int4-g32) or mxfp4 (default native)")
    p.add_argument("--context", type=POSITIVE_INT,
                   help="tokens per request, for the max concurrency row")
    p.add_argument("--concurrency", type=POSITIVE_INT,
                   help="requests per decode step, for the tok/s bound (needs --context)")
    p.add_argument("--page-size", type=POSITIVE_INT, default=16,
                   help="tokens per KV page (default 16)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--reserve-gib", type=NONNEG,
                       help="fixed reserve per GPU in GiB instead of SGLang's")
    group.add_argument("--mem-fraction", type=FRACTION,
                       help="weights + KV fraction of GPU memory, in (0, 1]")
    p.add_argument("--runtime-overhead-gib", type=NONNEG,
                   help="CUDA context etc. to take off the SGLang-like budget (default 0; not "
                        "with --reserve-gib or --mem-fraction)")
    p.add_argument("--use-mtp", action="store_true", help="load the MTP layers (speculative)")
    p.add_argument("--offload-gib", type=POSITIVE,
                   help="host memory of a host KV tier per replica in GiB, over its TP ranks "
                        "(> 0): the tokens it holds")
    p.add_argument("--groups", action="store_true",
                   help="per KV cache group (full attention, sliding window, state, indexer): "
                        "page size, bytes per token or state, pages and bytes per request of "
                        "--context tokens (default 4096), what fits")
    p.add_argument("--padded-compare", action="store_true",
                   help="with the groups, the same workload with the layers grouped and padded "
                        "to one page size as vLLM does, side by side (implies --groups)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also plot max concurrency against context into FILE.png (matplotlib)")
    p.set_defaults(func=run_plan)


def _resolve_gpu(args: argparse.Namespace) -> Any:
    from kvmem.errors import ConfigError
    from kvmem.planning import GPUSpec, get_gpu

    if args.gpu.lower() == "custom" or args.gpu_memory_gib or args.gpu_bandwidth_gbs:
        base = None if args.gpu.lower() == "custom" else get_gpu(args.gpu)
        mem = args.gpu_memory_gib if args.gpu_memory_gib else (base.memory_gib if base else None)
        bw = args.gpu_bandwidth_gbs or (base.bandwidth_gbs if base else None)
        if mem is None or bw is None:
            raise ConfigError(
                "a custom GPU needs --gpu-memory-gib and --gpu-bandwidth-gbs, e.g. "
                "--gpu custom --gpu-memory-gib 96 --gpu-bandwidth-gbs 4000."
            )
        return GPUSpec(name=args.gpu.lower(), memory_mib=int(mem * 1024), bandwidth_gbs=bw)
    return get_gpu(args.gpu)


def _policy(args: argparse.Namespace) -> Any:
    from kvmem.errors import ConfigError
    from kvmem.planning import FixedReserve, MemoryFraction, SGLangPolicy

    overhead = args.runtime_overhead_gib
    chosen = "--reserve-gib" if args.reserve_gib is not None else (
        "--mem-fraction" if args.mem_fraction is not None else None)
    if chosen and overhead is not None:
        raise ConfigError(
            f"--runtime-overhead-gib {overhead:g} applies to the SGLang-like reserve only, and "
            f"{chosen} replaces it; fold the overhead into {chosen}, or drop one of them."
        )
    if args.reserve_gib is not None:
        return FixedReserve(reserve_gib=args.reserve_gib)
    if args.mem_fraction is not None:
        return MemoryFraction(fraction=args.mem_fraction)
    return SGLangPolicy(runtime_overhead_gib=overhead or 0.0)


def run_plan(args: argparse.Namespace) -> int:
    """``kvmem plan``: one plan per KV dtype, as a table or JSON, and the plot if asked."""
    from kvmem.errors import ConfigError
    from kvmem.planning import GPU_PRESETS, MODEL_PRESETS

    if args.list:
        print("models: " + ", ".join(MODEL_PRESETS))
        print(
            "gpus:   "
            + ", ".join(f"{g.name} ({g.memory_gib:.1f} GiB)" for g in GPU_PRESETS.values())
        )
        return 0
    if not args.model:
        raise ConfigError("kvmem plan needs a MODEL (a preset name or a config.json path).")
    dtypes = dtypes_asked(args)
    if args.kv_scales and not any(d.startswith("fp8") for d in dtypes):
        raise ConfigError(
            f"--kv-scales {args.kv_scales} applies to fp8 KV only, and no fp8 dtype was asked "
            f"for ({', '.join(dtypes)}); drop --kv-scales or pick --kv-dtype fp8_e4m3."
        )
    if args.plot is not None:
        _check_plot_path(args.plot)
    model = resolve_model(args.model)
    gpu = _resolve_gpu(args)
    policy = _policy(args)
    plans = _plans(args, model, gpu, policy, dtypes)
    if args.groups or args.padded_compare:
        return _print_groups(args, model, plans)
    if args.json:
        if len(plans) == 1:
            print(json.dumps(plans[0].to_json_dict(), indent=2))
        else:
            print(json.dumps({"compare": [p.to_json_dict() for p in plans]}, indent=2))
    else:
        print(format_plans(plans))
    if args.plot:
        if len(dtypes) == 1:  # the plot compares: add bf16 and fp8_e4m3
            dtypes = sorted({dtypes[0], "bf16", "fp8_e4m3"})
            plans = _plans(args, model, gpu, policy, dtypes)
        _plot(plans, args.plot)
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0


DEFAULT_GROUP_CONTEXT = 4096


def _print_groups(args: argparse.Namespace, model: Any, plans: Sequence[Any]) -> int:
    """``--groups`` / ``--padded-compare``: one group plan per KV dtype, as tables or JSON."""
    from kvmem.errors import ConfigError
    from kvmem.planning import plan_groups

    if args.plot:
        raise ConfigError("--plot draws the single-group plan; drop --groups/--padded-compare "
                          "or --plot.")
    context = args.context or DEFAULT_GROUP_CONTEXT
    group_plans = [plan_groups(model, plan, context) for plan in plans]
    if args.json:
        dumped = [{"plan": p.to_json_dict(), "groups": g.to_json_dict()}
                  for p, g in zip(plans, group_plans)]
        print(json.dumps(dumped[0] if len(dumped) == 1 else {"compare": dumped}, indent=2))
        return 0
    print("\n\n".join(format_groups(g, padded=args.padded_compare) for g in group_plans))
    return 0


def format_groups(plan: Any, padded: bool = True) -> str:
    """A :class:`~kvmem.planning.GroupPlan` as a table: one row per group of each layout."""
    from kvmem.planning import GroupPlan

    assert isinstance(plan, GroupPlan)
    header = ("layout", "group", "kind", "page tok", "bytes/token", "bytes/state", "page bytes",
              "pages/req", "bytes/req", "GiB at capacity")
    rows: list[tuple[str, ...]] = [header]
    layouts = [plan.kvmem, plan.padded] if padded else [plan.kvmem]
    for lay in layouts:
        for g in lay.groups:
            rows.append((lay.layout, g.name, g.kind, f"{g.page_size:,}" if g.page_size else "-",
                         f"{g.bytes_per_token:,}" if g.bytes_per_token else "-",
                         f"{g.bytes_per_state:,}" if g.bytes_per_state else "-",
                         f"{g.page_bytes:,}", f"{g.pages_per_request:,}",
                         f"{g.bytes_per_request:,}", f"{g.bytes_at_capacity / 2**30:,.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        f"{plan.model}, KV {plan.kv_dtype}, TP {plan.tp}: KV cache groups for requests of "
        f"{plan.context_len:,} tokens, per GPU (KV budget "
        f"{plan.kv_budget_bytes_per_gpu / 2**30:,.2f} GiB)",
        "",
    ]
    lines += ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))) for r in rows]
    lines.append("")
    for lay in layouts:
        lines.append(f"{lay.layout:<7} {lay.bytes_per_request:,} bytes per request; "
                     f"{lay.requests_fit:,} requests fit, {lay.tokens_fit:,} tokens; "
                     f"{lay.tokens_per_gib:,.0f} tokens per GiB")
    if padded:
        lines.append(f"kvmem holds {plan.gain:.3f}x the tokens per GiB of the padded layout "
                     f"({plan.padded.page_size:,}-token pages)")
    return "\n".join(lines)


def format_plans(plans: Sequence[object]) -> str:
    """A readable table: one column per plan (KV dtype), one row per figure."""
    from kvmem.planning import CapacityPlan

    ps = [p for p in plans if isinstance(p, CapacityPlan)]
    first = ps[0]
    lines = [
        f"{first.model} on {first.num_gpus} x {first.gpu} ({first.gpu_memory_gib:.1f} GiB each), "
        f"TP {first.tp} x DP {first.dp}",
        f"weights: {first.weights}",
        f"reserve: {first.policy}"
        + (
            f" (mem_fraction_static {first.mem_fraction_static:.4f})"
            if first.mem_fraction_static is not None
            else ""
        ),
        "",
    ]
    rows: list[tuple[str, Callable[[CapacityPlan], str]]] = [
        (
            "KV dtype",
            lambda p: (
                p.kv_dtype + ("" if p.kv_dtype in ("bf16", "fp16") else f"/{p.kv_scale_layout}")
            ),
        ),
        ("KV bytes / token / GPU", lambda p: f"{p.kv_bytes_per_token_per_gpu:,}"),
        (
            f"KV bytes / page ({first.page_size} tok) / GPU",
            lambda p: f"{p.kv_bytes_per_page_per_gpu:,}",
        ),
        ("weights, whole checkpoint (GiB)", lambda p: f"{p.weights_gib_total:,.2f}"),
        ("weights / GPU (GiB)", lambda p: f"{p.weights_gib_per_gpu:,.2f}"),
        ("  of which replicated (GiB)", lambda p: f"{p.weights_gib_replicated_per_gpu:,.2f}"),
        ("reserve / GPU (GiB)", lambda p: f"{p.reserve_gib_per_gpu:,.2f}"),
        ("KV budget / GPU (GiB)", lambda p: f"{p.kv_budget_gib_per_gpu:,.2f}"),
        ("KV tokens / replica", lambda p: f"{p.kv_tokens_per_gpu:,}"),
        ("KV pages / GPU", lambda p: f"{p.kv_pages_per_gpu:,}"),
    ]
    if first.dp > 1:
        rows.append(("KV tokens, all replicas", lambda p: f"{p.kv_tokens_total:,}"))
    if first.context_len is not None:
        rows.append(
            (f"max concurrency @ {first.context_len:,} tok", lambda p: f"{p.max_concurrency:,}")
        )
        if first.dp > 1:
            rows.append(("  all replicas", lambda p: f"{p.max_concurrency_total:,}"))
    if first.decode_concurrency is not None:
        rows.append(
            (
                f"decode tok/s bound @ {first.decode_concurrency}",
                lambda p: f"{p.decode_tokens_per_s_bound:,.0f}",
            )
        )
    if first.offload_gib is not None:
        rows += [
            (f"host tier pages / GPU ({first.offload_gib:g} GiB / replica)",
             lambda p: f"{p.offload_pages_per_gpu:,}"),
            ("host tier tokens / replica", lambda p: f"{p.offload_tokens:,}"),
        ]
        if first.dp > 1:
            rows.append(("host tier tokens, all replicas", lambda p: f"{p.offload_tokens_total:,}"))
    width = max(len(label) for label, _ in rows) + 2
    col = max(14, *(len(fmt(p)) + 2 for _, fmt in rows for p in ps))
    for label, fmt in rows:
        lines.append(label.ljust(width) + "".join(fmt(p).rjust(col) for p in ps))
    return "\n".join(lines)


def _plans(
    args: argparse.Namespace, model: Any, gpu: Any, policy: Any, dtypes: Sequence[str]
) -> list[Any]:
    """One CapacityPlan per KV dtype, from the ``kvmem plan`` arguments."""
    from kvmem.planning import plan_capacity

    return [
        plan_capacity(
            model,
            gpu,
            args.tp,
            dp=args.dp,
            kv_dtype=dtype,
            kv_scale_layout=args.kv_scales if dtype.startswith("fp8") else None,
            weights=args.weights,
            policy=policy,
            page_size=args.page_size,
            context_len=args.context,
            concurrency=args.concurrency,
            use_mtp=args.use_mtp,
            offload_gib=args.offload_gib,
        )
        for dtype in dtypes
    ]


def _check_plot_path(path: str) -> None:
    """Refuse a --plot target that cannot be written (no matplotlib, an empty name, a missing
    folder, a folder, a format matplotlib does not write), before any work is done."""
    from kvmem.errors import ConfigError

    if not path:
        raise ConfigError("--plot needs a file name such as conc.png; got ''.")
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise ConfigError(
            f"--plot {path}: the folder {str(folder)!r} does not exist; create it first or "
            "pick another path."
        )
    if target.is_dir():
        raise ConfigError(f"--plot {path} is a folder; give a file name such as conc.png.")
    plt = _pyplot()
    fig = plt.figure()
    formats = fig.canvas.get_supported_filetypes()
    plt.close(fig)
    suffix = target.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        raise ConfigError(
            f"--plot {path}: matplotlib cannot write .{suffix} files; use one of "
            f"{', '.join(sorted(formats))} (e.g. conc.png)."
        )


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a one-line error saying how to install it."""
    from kvmem.errors import ConfigError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'kvmem[plot]' (or pip install matplotlib)."
        ) from exc
    return plt


def _plot(plans: Sequence[Any], path: str) -> dict[str, list[int]]:
    """Draw max concurrency against context length, one line per plan (KV dtype), into
    ``path``; returns the plotted series by dtype."""
    from kvmem.errors import ConfigError

    plt = _pyplot()
    contexts = [2**k for k in range(10, 21)]  # 1K .. 1M tokens
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[int]] = {}
    for plan in plans:
        series[plan.kv_dtype] = [plan.concurrency_at(c) * plan.dp for c in contexts]
        ax.plot(contexts, series[plan.kv_dtype], marker="o", label=plan.kv_dtype)
    p = plans[0]
    title = f"{p.model}, {p.num_gpus} x {p.gpu}, TP {p.tp}, {p.weights}"
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("max concurrent requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="KV dtype")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--plot {path}: cannot write the plot ({exc}).") from None
    finally:
        plt.close(fig)
    return series
