"""The public names are exactly the intended ones; the lower layers import without torch."""

from __future__ import annotations

import subprocess
import sys

import kvmem

EXPECTED = {
    "PAD",
    "AdmitResult",
    "ArgumentError",
    "ArgumentTypeError",
    "AllocatorStats",
    "CSRMetadata",
    "CapacityPlan",
    "CheckingTracker",
    "ConfigError",
    "GPUSpec",
    "GrowResult",
    "IntegrityError",
    "IntegrityReport",
    "InvalidFreeError",
    "KVCacheManager",
    "KVMemError",
    "ManagerStats",
    "ModelSpec",
    "NoOpTracker",
    "OutOfPagesError",
    "PageAllocator",
    "PagePool",
    "PageTable",
    "PoolSpec",
    "PoolStats",
    "SGLangPolicy",
    "StepHandle",
    "StepMetadata",
    "Tracker",
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
    for name in ("ArgumentError", "ArgumentTypeError", "ConfigError", "IntegrityError",
                 "InvalidFreeError", "OutOfPagesError"):
        assert issubclass(getattr(kvmem, name), kvmem.KVMemError)
    assert issubclass(kvmem.ConfigError, ValueError)


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
