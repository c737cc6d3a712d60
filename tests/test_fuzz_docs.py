"""docs/fuzzing.md's tutorial is examples/fuzz_tutorial.py, and the example finds its bug."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tutorial_code_in_the_docs_is_the_example_verbatim() -> None:
    doc = (ROOT / "docs" / "fuzzing.md").read_text()
    example = (ROOT / "examples" / "fuzz_tutorial.py").read_text()
    tutorial = doc[doc.index("## Tutorial") :]
    blocks = re.findall(r"```python\n(.*?)```", tutorial, flags=re.S)
    assert len(blocks) >= 3
    for block in blocks:
        assert block.strip() in example, block[:200]
    adapter = example[example.index("class MiniServeAdapter") : example.index("class Fixed")]
    assert len([ln for ln in adapter.splitlines() if ln.strip()]) < 100


def load_tutorial() -> Any:
    """examples/fuzz_tutorial.py as a module (also used by test_fuzz_promises.py)."""
    spec = importlib.util.spec_from_file_location("fuzz_tutorial",
                                                  ROOT / "examples" / "fuzz_tutorial.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_tutorial"] = module  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["fuzz_tutorial"]
    return module


def test_the_tutorial_finds_the_planted_race_and_its_fix_runs_clean(
        capsys: pytest.CaptureFixture[str]) -> None:
    load_tutorial().main()
    out = capsys.readouterr().out
    assert "MiniServe: happens_before" in out and "no oracle fired" in out
