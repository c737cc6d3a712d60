"""The argument parser and option types every kvmem command line shares.

:class:`Parser` is argparse with kvmem's error contract (a usage error is one line on stderr and
exit status 2, never a traceback), and :func:`number` makes an argparse ``type=`` that takes an
int or a finite float within bounds. The ``kvmem`` subcommands, ``python -m
kvmem.integrations.vllm`` and the scripts in ``benchmarks/`` build their options from them::

    from kvmem.cli.args import Parser, number

    parser = Parser(prog="bench.py", description="...")
    parser.add_argument("--steps", type=number(int, 1), default=1000)

Also here: the option types and checks that ``kvmem plan`` and ``kvmem simulate`` share (KV
dtypes, ``--compare``, ``MODEL``). This module imports no command, so a command can import it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvmem.errors import ConfigError

__all__ = [
    "EXIT_ERROR",
    "FRACTION",
    "KV_DTYPES",
    "NONNEG",
    "NONNEG_INT",
    "POSITIVE",
    "POSITIVE_INT",
    "Parser",
    "dtype_list",
    "dtypes_asked",
    "number",
    "resolve_model",
]

EXIT_ERROR = 2
"""The exit status of every usage or input error."""

KV_DTYPES = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
"""The KV dtypes the commands accept (``--kv-dtype``, ``--compare``)."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2), like every other
    kvmem error: ``kvmem plan: error: argument --tp: expected an integer >= 1, got '0'``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        # argparse drops a "--" given as an option's value (`--tp=--`) and stores [] without
        # calling the option's type: refuse it like any other bad value.
        for action in self._actions:
            value = getattr(parsed, action.dest, None)
            if action.nargs is None and action.option_strings and value == []:
                self.error(f"argument {'/'.join(action.option_strings)}: expected a value, "
                           "got '--'")
        return parsed, extras


def number(kind: type, minimum: float | None = None, *, above: bool = False,
           maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type=``: an int or a finite float within bounds, with a one-line error.

    ``number(int, 1)`` takes integers >= 1; ``number(float, 0, above=True, maximum=1)`` takes
    numbers in (0, 1]."""
    low = "" if minimum is None else f" {'>' if above else '>='} {minimum:g}"
    high = "" if maximum is None else f"{' and' if low else ''} <= {maximum:g}"
    want = f"{'an integer' if kind is int else 'a number'}{low}{high}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        if minimum is not None and (value <= minimum if above else value < minimum):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = want  # argparse names the type in some messages
    return parse


POSITIVE_INT = number(int, 1)
NONNEG_INT = number(int, 0)
POSITIVE = number(float, 0, above=True)
NONNEG = number(float, 0)
FRACTION = number(float, 0, above=True, maximum=1)


def dtype_list(text: str) -> list[str]:
    """``--compare``: comma-separated KV dtypes, each known, none twice."""
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in KV_DTYPES]
    if not dtypes or bad:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated KV dtypes from {', '.join(KV_DTYPES)}, got {text!r}"
        )
    if len(set(dtypes)) < len(dtypes):
        raise argparse.ArgumentTypeError(f"{text!r} names a dtype twice; name each once")
    return dtypes


def dtypes_asked(args: argparse.Namespace) -> list[str]:
    """The KV dtypes of ``--compare``, else ``--kv-dtype`` (default bf16); never both."""
    if args.compare and args.kv_dtype:
        raise ConfigError(f"--kv-dtype {args.kv_dtype} and --compare {','.join(args.compare)} "
                          "both choose the KV dtype; give one of them.")
    return args.compare or [args.kv_dtype or "bf16"]


def resolve_model(name: str) -> Any:
    """``MODEL``: the path of a Hugging Face ``config.json`` (or its folder), else a preset."""
    from kvmem.planning import get_model, load_hf_config

    path = Path(name)
    if path.exists():
        return load_hf_config(path)
    return get_model(name)
