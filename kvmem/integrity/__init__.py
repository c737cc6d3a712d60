"""Integrity: page tags, trackers and the batched mapping check (numpy; torch form lazily)."""

from __future__ import annotations

from kvmem.integrity._check import (
    BadEntries,
    Reason,
    check_block_table,
    check_block_table_torch,
    check_csr,
    check_csr_torch,
)
from kvmem.integrity._tracker import CheckingTracker, IntegrityReport, NoOpTracker, Tracker

__all__ = [
    "BadEntries",
    "CheckingTracker",
    "IntegrityReport",
    "NoOpTracker",
    "Reason",
    "Tracker",
    "check_block_table",
    "check_block_table_torch",
    "check_csr",
    "check_csr_torch",
]
