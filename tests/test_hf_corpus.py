from __future__ import annotations

import sys

import pytest

from kvmem.errors import ConfigError
from kvmem.integrations.corpus import STDLIB_MODULES, stdlib_docstrings


def test_corpus_is_docstrings_in_module_order() -> None:
    text = stdlib_docstrings(("textwrap", "heapq"))
    # The textwrap module docstring opens the text; heapq's comes after all of textwrap's.
    assert text.startswith("Text wrapping and filling.")
    assert text.index("Heap queue algorithm") > text.index("Text wrapping and filling.")
    assert text == stdlib_docstrings(("textwrap", "heapq"))


def test_default_corpus_is_large_enough() -> None:
    text = stdlib_docstrings()
    # >= 8192 SmolLM2 tokens needs well over 32 KB of English; the default gives ~200 KB.
    assert len(text) > 100_000, (len(text), sys.version)
    assert len(STDLIB_MODULES) == len(set(STDLIB_MODULES))


@pytest.mark.parametrize("name", ["math", "no_such_module_kvmem"])
def test_module_without_python_source_is_rejected(name: str) -> None:
    # math is a C extension (or builtin): it has no docstrings in a .py file to read.
    with pytest.raises(ConfigError, match=name):
        stdlib_docstrings((name,))
