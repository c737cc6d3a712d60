"""The public names are exactly the intended ones; the lower layers import without torch."""

from __future__ import annotations

import subprocess
import sys

import kvmem

EXPECTED = {
    "PAD",
    "AllocatorStats",
    "CSRMetadata",
    "CheckingTracker",
    "ConfigError",
    "GrowResult",
    "IntegrityError",
    "IntegrityReport",
    "InvalidFreeError",
    "KVMemError",
    "NoOpTracker",
    "OutOfPagesError",
    "PageAllocator",
    "PageTable",
    "Tracker",
    "__version__",
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
