"""The model examples check their arguments before loading anything: a mistake costs a second,
not a 20-second model load, and reads as one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run_without_transformers(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run an example with transformers made unimportable: loading a model would fail loudly."""
    code = (
        "import runpy, sys\n"
        "sys.modules['transformers'] = None\n"
        f"sys.argv = [{script!r}, *{list(argv)!r}]\n"
        f"runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("perplexity.py", ["--text", "no/such/file.txt"], "no such file"),
        ("perplexity.py", ["--window", "1"], "--window"),
        ("perplexity.py", ["--chunk", "0"], "--chunk"),
        ("perplexity.py", ["--tokens", "x"], "--tokens"),
        ("perplexity.py", ["--kv-dtype", "bf16", "--scales", "head"], "fp8"),
        ("serve_smollm2.py", ["--drill"], "--tracker checking"),
        ("serve_smollm2.py", ["--max-new-tokens", "0"], "--max-new-tokens"),
        ("serve_smollm2.py", ["--kv-dtype", "bf16", "--scales", "head"], "fp8"),
    ],
)
def test_bad_arguments_fail_fast_in_one_line(script: str, argv: list[str], message: str) -> None:
    proc = _run_without_transformers(script, *argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_text_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    proc = _run_without_transformers("perplexity.py", "--text", str(bad))
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr, proc.stderr
