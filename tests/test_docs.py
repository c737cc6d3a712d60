"""README.md and docs/*.md are reference, not a lab notebook: no commit ids, no load averages,
no "the issue" or "this session". Measured figures, and whatever a figure needs to be read
(the commit it was measured at, the revision an A/B ran against), live in docs/benchmarks.md,
which these checks leave out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# 7-40 hex digits with at least one letter and one digit, not inside a path, URL or word
# (the same pattern as the project's before-stop hook).
COMMIT_ID = re.compile(
    r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
# A measurement diary: the machine's load ("load average 0.9", "load 2.5-3.0", "1-minute load
# 0.85"), the issue or session a figure came from.
DIARY = re.compile(
    r"\bload[ -]average|\bload avg\b|\bload \d|\b(?:the|this) (?:issue|session)\b", re.I)


def reference_docs() -> list[Path]:
    """README.md and every docs/*.md but docs/benchmarks.md."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
    return [ROOT / "README.md", *docs]


def hits(pattern: re.Pattern[str], text: str) -> list[str]:
    """Each match, as 'line N: the match'."""
    return [f"line {n}: {m.group(0)}" for n, line in enumerate(text.splitlines(), 1)
            for m in pattern.finditer(line)]


@pytest.mark.parametrize("path", reference_docs(), ids=lambda p: p.name)
def test_no_commit_id_in_the_docs(path: Path) -> None:
    found = hits(COMMIT_ID, path.read_text())
    assert not found, (f"{path.name} cites commits {found}: history belongs in commit messages, "
                       "figures (with what they were measured at) in docs/benchmarks.md")


@pytest.mark.parametrize("path", reference_docs(), ids=lambda p: p.name)
def test_no_measurement_diary_in_the_docs(path: Path) -> None:
    found = hits(DIARY, path.read_text())
    assert not found, (f"{path.name} reads as a diary {found}: say what kvmem does; put figures "
                       "in docs/benchmarks.md")


def test_the_commit_id_check_fires_on_ids_and_not_on_paths_words_or_numbers() -> None:
    fires = ["One run at commit `49c90a0`: 384 us.", "measured at cc520c1 (quiet)",
             "(d942367, three runs)", "full id 9708d5a1b2c3d4e5f60718293a4b5c6d7e8f9012 here"]
    for line in fires:
        assert hits(COMMIT_ID, line), line
    silent = ["653,125 / 1,306,251 tokens", "2026-12-02", "seeds 1000-1999",
              "the default is 0xdeadbeef", "a sha256 block hash", "see /tmp/ab12cd3ef/x.py",
              "https://github.com/org/repo/commit/49c90a0", "blake2b keys", "abcdefab",
              "1234567", "fp8_e4m3 token_head", "deadbeef12-suffix", "x49c90a0"]
    for line in silent:
        assert not hits(COMMIT_ID, line), line


def test_the_diary_check_fires_on_load_and_issue_phrases_and_not_on_loading() -> None:
    fires = ["(load average 0.9-1.0, nothing else running)", "`f22b7c2`, load 6.5):",
             "three runs started at 1-minute load 0.85-0.94", "On the issue's workload",
             "figures from this session", "Load Average: 2"]
    for line in fires:
        assert hits(DIARY, line), line
    silent = ["`load_tags` and `update_tags` raise", "before they load the model",
              "load_hf_config(path) reads llama", "a loaded pool", "workload of 256 requests",
              "issue and pull-request numbers of the projects named", "download the wheel"]
    for line in silent:
        assert not hits(DIARY, line), line
