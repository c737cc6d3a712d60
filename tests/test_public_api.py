"""The public names are exactly the intended ones; the lower layers import without torch."""

from __future__ import annotations

import subprocess
import sys

import kvmem

EXPECTED = {
    "PAD",
    "AdmitResult",
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
    for name in ("ConfigError", "IntegrityError", "InvalidFreeError", "OutOfPagesError"):
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


def test_unknown_attribute_raises() -> None:
    import pytest

    with pytest.raises(AttributeError):
        kvmem.NoSuchThing  # noqa: B018
