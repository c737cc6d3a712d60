"""The architecture's rules, checked on kvmem's own source (AST).

* One writer per array: a ``PageTable``'s arrays change only in ``kvmem/allocator/_page_table.py``
  (through its methods) and a tracker's only in ``kvmem/integrity/_tracker.py``.
* No module outside ``kvmem/integrity`` asks what kind of tracker it holds (``isinstance``,
  ``type(...) is``, ``getattr``/``hasattr`` on a tracker): it calls ``kvmem.integrity.Recorder``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvmem

ROOT = Path(kvmem.__file__).parent

# PageTable's arrays and counters (kvmem/allocator/_page_table.py)
TABLE_OWNER = "allocator/_page_table.py"
TABLE_ARRAYS = {"pages", "_flat_pages", "num_pages", "num_tokens", "num_committed", "write_from",
                "namespace_ids", "prefix_keys", "forked", "generation", "_live", "_row_marks"}
TABLE_COUNTERS = {"num_forked", "epoch"}
# A tracker's arrays, and the read-only views others keep of them (writes through any of
# these names are writes into the tracker's arrays)
TRACKER_OWNER = "integrity/_tracker.py"
TRACKER_ARRAYS = {"expected_tags", "_expected", "_flat", "versions", "_versions",
                  "expected_flat"}
TRACKER_TYPES = {"CheckingTracker", "NoOpTracker", "Tracker"}

_VIEWS = {"reshape", "ravel", "view", "T", "flat", "real", "imag", "base"}
_WRITING_FUNCS = {"copyto", "put", "place", "putmask", "put_along_axis", "fill_diagonal"}
_WRITING_METHODS = {"fill", "put", "sort", "itemset", "resize", "partition", "setflags",
                    "setfield", "byteswap"}


def _array_attr(node: ast.AST) -> ast.Attribute | None:
    """The attribute an expression indexes or views (``t.pages.reshape(-1)[at]`` ->
    ``t.pages``), or None."""
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in _VIEWS):
            node = node.func.value
        elif isinstance(node, ast.Attribute) and node.attr in _VIEWS:
            node = node.value
        else:
            return node if isinstance(node, ast.Attribute) else None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _written(tree: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(expression written into, the statement or call) for every in-place write."""
    out: list[tuple[ast.AST, ast.AST]] = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            else:
                out.append((t, node))
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(
                f, ast.Name) else ""
            if name in _WRITING_FUNCS and node.args:
                out.append((ast.Subscript(node.args[0], ast.Constant(0)), node))
            if name == "at" and node.args:  # np.add.at(a, ...)
                out.append((ast.Subscript(node.args[0], ast.Constant(0)), node))
            if name in _WRITING_METHODS and isinstance(f, ast.Attribute):
                out.append((ast.Subscript(f.value, ast.Constant(0)), node))
            out.extend((ast.Subscript(k.value, ast.Constant(0)), node)
                       for k in node.keywords if k.arg == "out")
    return out


def array_writes(source: str, rel: str) -> list[str]:
    """Writes in ``source`` (the module at ``rel`` under kvmem/) into a page table's or a
    tracker's arrays by a module that does not own them."""
    found = []
    for target, stmt in _written(ast.parse(source)):
        line = getattr(stmt, "lineno", "?")
        if isinstance(target, ast.Attribute):  # t.num_forked = ..., t.epoch += 1
            if target.attr in TABLE_COUNTERS and not _is_self(target.value) and (
                    rel != TABLE_OWNER):
                found.append(f"{rel}:{line} sets {ast.unparse(target)}")
            continue
        if not isinstance(target, ast.Subscript):
            continue
        attr = _array_attr(target)
        if attr is None:
            continue
        table = attr.attr in TABLE_ARRAYS and rel != TABLE_OWNER and not _is_self(attr.value)
        if table or (attr.attr in TRACKER_ARRAYS and rel != TRACKER_OWNER):
            found.append(f"{rel}:{line} writes into {ast.unparse(attr)}")
    return found


def tracker_sniffing(source: str, rel: str) -> list[str]:
    """``isinstance``/``type() is``/``getattr``/``hasattr`` on trackers outside integrity."""
    if rel.startswith("integrity/"):
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn, args = node.func.id, node.args
            if fn in ("isinstance", "issubclass") and len(args) == 2 and any(
                    isinstance(n, (ast.Name, ast.Attribute)) and (
                        getattr(n, "id", None) or getattr(n, "attr", None)) in TRACKER_TYPES
                    for n in ast.walk(args[1])):
                found.append(f"{rel}:{line} {ast.unparse(node)}")
            if fn in ("getattr", "hasattr") and args and "tracker" in ast.unparse(
                    args[0]).lower():
                found.append(f"{rel}:{line} {ast.unparse(node)}")
        if isinstance(node, ast.Compare) and any(
                isinstance(n, ast.Name) and n.id in TRACKER_TYPES
                for n in [node.left, *node.comparators]):
            found.append(f"{rel}:{line} {ast.unparse(node)}")
    return found


def _modules() -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in sorted(ROOT.rglob("*.py"))]


def test_page_table_and_tracker_arrays_have_one_writer() -> None:
    offenders = [w for rel, src in _modules() for w in array_writes(src, rel)]
    assert not offenders, offenders


def test_no_module_outside_integrity_asks_what_a_tracker_is() -> None:
    offenders = [w for rel, src in _modules() for w in tracker_sniffing(src, rel)]
    assert not offenders, offenders


@pytest.mark.parametrize("line", [
    "t.pages[row, 3] = page",
    "self.table.num_committed[rows] = end",
    "t.pages.reshape(-1)[at] = new",
    "mgr.table.write_from[r] += 1",
    "a, t.num_tokens[rows] = 1, 2",
    "np.copyto(self.table.prefix_keys, keys)",
    "np.add.at(t.generation, rows, 1)",
    "t.forked.fill(False)",
    "np.cumsum(x, out=t.num_pages[:3])",
    "t.num_forked = 0",
    "t.epoch += 1",
    "self._expected[row] = 0",
    "self.expected_flat[at] = tags",
    "tracker.expected_tags.setflags(write=True)",
])
def test_the_writer_check_fires(line: str) -> None:
    assert array_writes(line, "manager.py"), line


@pytest.mark.parametrize("line", [
    "self.namespace_ids[pages] = -1",  # another object's own array of the same name
    "x = t.pages[rows, cols]",
    "t.append_pages(rows, at, cols, new)",
])
def test_the_writer_check_passes_reads_and_method_calls(line: str) -> None:
    assert not array_writes(line, "manager.py"), line


@pytest.mark.parametrize("line", [
    "isinstance(self.tracker, CheckingTracker)",
    "isinstance(t, (NoOpTracker, int))",
    "type(tracker) is CheckingTracker",
    "getattr(self.tracker, 'expected_tags', None)",
    "hasattr(spec_tracker, 'paranoid')",
])
def test_the_sniffing_check_fires(line: str) -> None:
    assert tracker_sniffing(line, "allocator/_reserve.py"), line
    assert not tracker_sniffing(line, "integrity/_recorder.py"), line
