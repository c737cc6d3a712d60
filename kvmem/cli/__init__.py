"""The ``kvmem`` command line.

::

    kvmem --version
    kvmem plan MODEL --gpu h200 --tp 8 --kv-dtype fp8_e4m3 [--weights int4-g32]
               [--context 32768] [--concurrency 64] [--compare bf16,fp8_e4m3]
               [--json] [--plot FILE.png]
    kvmem simulate MODEL [--compare bf16,fp8_e4m3] [--requests 1000] [--concurrency 64] ...
    kvmem fuzz [--engine manager] [--minutes 1 | --moves N] [--faults [NAME ...]] ...

``MODEL`` is a preset name (``kvmem plan --list`` shows them) or the path of a Hugging Face
``config.json`` (or its folder). Every option is checked before any work starts; an error
(an unknown name, a count of 0, a number that is not one) prints one line to stderr and exits
with status 2, never a traceback. ``kvmem plan`` imports neither torch nor the manager.

One module per command (``_plan``, ``_simulate``, ``_fuzz``), each importing what it drives
only when it runs; :mod:`kvmem.cli.args` holds the parser and option types they share, which
``python -m kvmem.integrations.vllm`` and the benchmarks use as well.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvmem import __version__
from kvmem.cli._fuzz import add_fuzz_parser
from kvmem.cli._plan import add_plan_parser
from kvmem.cli._simulate import add_simulate_parser
from kvmem.cli.args import EXIT_ERROR, Parser
from kvmem.errors import KVMemError

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    """The argument parser, one subcommand per tool."""
    parser = Parser(
        prog="kvmem",
        description="Paged KV-cache memory manager: capacity planning and simulation tools.",
    )
    parser.add_argument(
        "--version", action="version", version=f"kvmem {__version__}",
        help="print the kvmem version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_plan_parser(sub)
    add_simulate_parser(sub)
    add_fuzz_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 on success, 2 on bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return int(exc.code or 0)
    try:
        status: int = args.func(args)
    except KVMemError as exc:
        print(f"kvmem {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except MemoryError as exc:  # e.g. `kvmem simulate --requests 2000000000`
        print(f"kvmem {args.command}: error: out of memory ({_one_line(exc) or 'MemoryError'}); "
              "ask for less (fewer --requests, a smaller --config)", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `kvmem plan ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it
    return status


def _one_line(exc: BaseException) -> str:
    """pydantic's multi-line validation errors folded into one line."""
    return " ".join(str(exc).split())
