"""``python -m kvmem.integrations.vllm conformance --streams N --json``, and ``judge``.

Runs ``N`` random request streams (:func:`~kvmem.integrations.vllm.conformance.random_stream`,
seeds ``seed .. seed + N - 1``) through vLLM's ``Scheduler`` on vLLM's own KV cache manager and
on kvmem's, compares them step by step, then times a decode-heavy stream at batch 256 in
lockstep (:func:`~kvmem.integrations.vllm.bench.lockstep`, the synchronous scheduler) and prints
one JSON object. A stream that differs is printed to stderr as a replayable test. Exit status:
0 when every stream agrees, 1 otherwise, 2 when vLLM is not importable (one line says how to
get it) or an option is bad (one line names it; checked before any work: ``--streams`` at
least 1, ``--batch`` 1 to 8192, ``--decode-steps`` at least 0).

``python -m kvmem.integrations.vllm judge [--json] [--list] [--cache-dir DIR]`` runs vLLM
0.33.0's own ``tests/v1/core`` on vLLM's schedulers and on kvmem's
(:mod:`kvmem.integrations.vllm.judge`) and prints the verdicts. Exit status: 0 when no test
fails only on kvmem for a reason of class ``other`` except those named by ``--expect-other``
(and each of those still does), 1 otherwise (one line on stderr per test), 2 when vLLM is not
importable or the setup fails (download, digest, pytest itself).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

from kvmem.cli.args import Parser, number
from kvmem.integrations.vllm import vllm_import_error


def _parser() -> argparse.ArgumentParser:
    # kvmem's parser: a bad option is one line on stderr and exit status 2, before any work.
    p = Parser(prog="python -m kvmem.integrations.vllm",
               description="vLLM's scheduler on kvmem: conformance and speed")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("conformance", help="differential conformance against vLLM's own manager")
    c.add_argument("--streams", type=number(int, 1), default=200,
                   help="random streams to compare (at least 1)")
    c.add_argument("--seed", type=number(int), default=0, help="first stream's seed")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    # The timed stream's scheduler batches 8192 tokens a step, and vLLM needs max_num_seqs
    # (the batch) at most that.
    c.add_argument("--batch", type=number(int, 1, maximum=8192), default=256,
                   help="decode batch of the timed stream (1 to 8192)")
    c.add_argument("--decode-steps", type=number(int, 0), default=100,
                   help="decode steps timed in lockstep (0: no timing)")
    j = sub.add_parser("judge", help="vLLM's own tests/v1/core on vLLM's schedulers and kvmem's")
    j.add_argument("--cache-dir", default=None,
                   help="where vLLM's source distribution and the runs are kept "
                        "(default ~/.cache/kvmem/vllm-judge)")
    j.add_argument("--no-download", action="store_true",
                   help="use the source distribution in the cache folder, never download it")
    j.add_argument("--one-at-a-time", action="store_true",
                   help="run the two pytest sessions one after the other (default: side by side)")
    j.add_argument("--json", action="store_true", help="print one JSON object (every test)")
    j.add_argument("--list", action="store_true",
                   help="list every test that fails only on kvmem, by reason (default: those of "
                        "class other)")
    # default None, not []: kvmem's parser reads an empty list as a "--" given as the value
    j.add_argument("--expect-other", action="append", default=None, metavar="NODEID",
                   help="a test known to fail only on kvmem for a reason of class other "
                        "(repeatable): it does not fail the run, and passing makes it fail")
    return p


def judge(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    from kvmem.integrations.vllm.judge import DEFAULT_CACHE, run, unexpected

    report = run(args.cache_dir or DEFAULT_CACHE, download=not args.no_download,
                 side_by_side=not args.one_at_a_time)
    return report, unexpected(report, args.expect_other or ())


def conformance(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from kvmem.integrations.vllm.conformance import compare, random_stream

    t0 = time.perf_counter()
    streams = steps = mismatched = verify_failures = table_mismatches = 0
    failing: list[dict[str, Any]] = []
    for i in range(args.streams):
        stream = random_stream(random.Random(args.seed + i))
        c = compare(stream)
        streams += 1
        steps += c.steps
        mismatched += len(c.mismatched_steps)
        verify_failures += c.verify_failures
        table_mismatches += c.table_mismatches
        if not c.ok:
            failing.append({"seed": args.seed + i, "first_difference": c.first_difference,
                            "outputs_differ": c.outputs_differ[:8]})
            print(f"# stream seed {args.seed + i} differs: {c.first_difference}\n{c.replay()}",
                  file=sys.stderr)
    result: dict[str, Any] = {
        "streams": streams, "steps": steps, "mismatched_steps": mismatched,
        "failing_streams": failing, "verify_failures": verify_failures,
        "table_mismatches": table_mismatches,
        "conformance_seconds": round(time.perf_counter() - t0, 1),
    }
    timed = ("vllm_step_us_median", "kvmem_step_us_median", "step_speedup",
             "paired_step_speedup", "vllm_kv_us_median", "kvmem_kv_us_median", "kv_speedup")
    # The timing keys are always there (null when --decode-steps 0 timed nothing).
    result.update(dict.fromkeys(timed))
    result["timed_stream"] = None
    if args.decode_steps > 0:
        from kvmem.integrations.vllm.bench import lockstep

        timing = lockstep(num_requests=args.batch, decode_steps=args.decode_steps)
        result.update({k: timing[k] for k in timed})
        result["timed_stream"] = {"batch": args.batch, "decode_steps": args.decode_steps,
                                  "scheduler": timing["scheduler"],
                                  "mismatched_steps": timing["mismatched_steps"]}
        mismatched += timing["mismatched_steps"]
    ok = not mismatched and not verify_failures and not table_mismatches and not failing
    return result, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0, 1, or 2: see the module doc)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option (its one line already printed)
        return int(exc.code or 0)
    # vLLM logs to stdout; the JSON object must be all there is.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    error = vllm_import_error()
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    if args.command == "judge":
        from kvmem.errors import KVMemError
        from kvmem.integrations.vllm.judge import format_report

        try:
            report, problems = judge(args)
        except (KVMemError, OSError, subprocess.SubprocessError) as e:
            print(f"judge: {e}", file=sys.stderr)
            return 2
        print(json.dumps(report, indent=1) if args.json
              else format_report(report, list_tests=args.list))
        for problem in problems:
            print(f"judge: {problem}", file=sys.stderr)
        return 1 if problems else 0
    result, status = conformance(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return status


if __name__ == "__main__":
    sys.exit(main())
