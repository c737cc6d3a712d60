"""A text corpus that every machine already has: docstrings of Python standard-library modules.

Perplexity needs real prose that no download provides offline. The docstrings of pure-Python
standard-library modules are English technical writing, ship with every interpreter, and are
read from source with :mod:`ast` (nothing is imported, so no module runs any code). The text
changes slightly between Python versions; record ``sys.version`` beside any figure made from it.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence

from kvmem.errors import ConfigError

__all__ = ["STDLIB_MODULES", "stdlib_docstrings"]

# Pure-Python modules with long, stable docstrings; about 55K SmolLM2 tokens in all (Python 3.11).
STDLIB_MODULES: tuple[str, ...] = (
    "textwrap",
    "heapq",
    "functools",
    "contextlib",
    "dataclasses",
    "fractions",
    "statistics",
    "difflib",
    "shutil",
    "json.decoder",
    "json.encoder",
    "base64",
    "argparse",
    "enum",
    "ipaddress",
    "queue",
    "random",
    "tempfile",
    "typing",
    "zipfile",
    "calendar",
    "bisect",
    "copy",
    "pprint",
    "sched",
)


def _module_docstrings(name: str) -> list[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise ConfigError(
            f"stdlib corpus: module {name!r} has no Python source here (found {spec!r}); "
            "pass modules that are pure Python in this interpreter"
        )
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    docs = []
    # ast.walk is breadth-first and deterministic: module, then classes/functions, then methods.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                docs.append(doc)
    return docs


def stdlib_docstrings(modules: Sequence[str] = STDLIB_MODULES) -> str:
    """Concatenate the docstrings of ``modules``, read from their source files.

    Parameters
    ----------
    modules:
        Importable names of pure-Python standard-library modules, in the order they appear in
        the text.

    Returns
    -------
    str
        Module, class and function docstrings (cleaned by :func:`ast.get_docstring`), separated
        by blank lines.

    Raises
    ------
    ConfigError
        A module has no ``.py`` source in this interpreter (a C extension or a missing name).
    """
    return "\n\n".join(doc for name in modules for doc in _module_docstrings(name))
