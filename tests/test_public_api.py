"""The public names are exactly the intended ones; the lower layers import without torch."""

from __future__ import annotations

import subprocess
import sys

import kvmem

EXPECTED = {
    "PAD",
    "AdmitResult",
    "AllocatorStats",
    "ArgumentError",
    "ArgumentTypeError",
    "CSRMetadata",
    "CapacityPlan",
    "CheckingTracker",
    "ConcurrentUseError",
    "ConfigError",
    "GPUSpec",
    "GrowResult",
    "HashedPrefixCache",
    "HookError",
    "HybridManager",
    "IncompatibleCacheError",
    "IntegrityError",
    "IntegrityReport",
    "InvalidFreeError",
    "KVCacheManager",
    "KVMemError",
    "ManagerStats",
    "MetadataError",
    "ModelSpec",
    "NoOpTracker",
    "OutOfPagesError",
    "PageAllocator",
    "PagePool",
    "PageTable",
    "PoolSpec",
    "PoolStats",
    "PrefixCache",
    "SGLangPolicy",
    "StepFences",
    "StepHandle",
    "StepMetadata",
    "Tracker",
    "VerifierStats",
    "VerifyReport",
    "__version__",
    "fit_throughput",
    "get_gpu",
    "get_model",
    "paged_attention",
    "plan_capacity",
}


def test_public_names_are_pinned() -> None:
    assert set(kvmem.__all__) == EXPECTED
    for name in kvmem.__all__:
        assert hasattr(kvmem, name), name


def test_errors_share_one_root() -> None:
    for name in ("ConfigError", "IntegrityError", "InvalidFreeError", "OutOfPagesError",
                 "MetadataError", "ConcurrentUseError", "ArgumentError", "ArgumentTypeError",
                 "HookError", "IncompatibleCacheError"):
        assert issubclass(getattr(kvmem, name), kvmem.KVMemError)
    for name in ("ConfigError", "MetadataError", "ArgumentError"):
        assert issubclass(getattr(kvmem, name), ValueError)
    assert issubclass(kvmem.ArgumentTypeError, TypeError)
    assert issubclass(kvmem.ConfigError, kvmem.ArgumentError)


LAYERS = ("allocator", "integrity", "quant", "cuda", "planning", "integrations", "testing", "cli",
          "simulate", "transfer")


SHARED = ("kvmem.errors", "kvmem._validate", "kvmem._specs")  # the root every layer uses


def _layer(module: str) -> str:
    """``kvmem.allocator._pages`` -> ``allocator``; top-level modules are the manager's."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else "manager"


def test_no_module_imports_a_private_module_of_another_layer() -> None:
    import ast
    from pathlib import Path

    root = Path(kvmem.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        module = "kvmem." + ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                private = any(p.startswith("_") for p in name.split(".")[1:])
                if (name.startswith("kvmem.") and private and name not in SHARED
                        and _layer(name) != _layer(module)):
                    offenders.append(f"{module} imports {name}")
    assert not offenders, offenders


def test_allocator_and_integrity_import_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        "import kvmem.allocator, kvmem.integrity\n"
        "a = kvmem.allocator.PageAllocator(4); a.allocate(2); a.check()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_manager_and_planning_import_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import kvmem\n"
        "from kvmem import KVCacheManager, plan_capacity\n"
        "m = KVCacheManager(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=4)\n"
        "m.admit('a', [1, 2, 3])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_planning_is_pure() -> None:
    """Planning (an int4 model included) loads neither torch nor the manager (issue 11: the
    simulator, which drives the manager, lives above it in kvmem.simulate)."""
    code = (
        "import sys\n"
        "import kvmem.planning\n"
        "plan = kvmem.planning.plan_capacity('glm-5.2', 'h200', 8, weights='int4-g32')\n"
        "assert plan.weights_gib_total > 0\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')\n"
        "             or m in ('kvmem.manager', 'kvmem.simulate'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_errors_contract_classes() -> None:
    from kvmem.errors import ArgumentError, ArgumentTypeError

    assert issubclass(ArgumentError, kvmem.KVMemError) and issubclass(ArgumentError, ValueError)
    assert issubclass(ArgumentTypeError, kvmem.KVMemError)
    assert issubclass(ArgumentTypeError, TypeError)
    assert issubclass(kvmem.ConfigError, ArgumentError)


def test_unknown_attribute_raises() -> None:
    import pytest

    with pytest.raises(AttributeError):
        kvmem.NoSuchThing  # noqa: B018
