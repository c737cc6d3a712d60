"""Integrity: page tags, trackers, the batched mapping check and the verifier (numpy; torch
forms lazily).

::

    _tags.py         the namespace-qualified tag format, and the tag mirror (host + device)
    _check.py        the full check of a batch's page lists (CSR or block table), validation
    _step_checks.py  the step's writes: one writer per page, slot mapping, lengths
    _tracker.py      NoOpTracker (default), CheckingTracker (expected tags per row, position)
    _metadata.py     the metadata verify checks, in any form, resolved and shape-checked
    _full_check.py   the full check: every entry, the write set, slots and lengths
    _recorder.py     Recorder: a manager's records in its tracker, whichever kind it is
    _splice.py       the spliced fast path's contract: splice(), Splice, SplicedStep
    _verifier.py     the verifier: the full check's verdict, proved incrementally when it can
    _ownership.py    what a request provably holds when its row disagrees with its records
"""

from __future__ import annotations

from kvmem.integrity._check import (
    PAD,
    BadEntries,
    Reason,
    check_block_table,
    check_block_table_torch,
    check_csr,
    check_csr_torch,
    require_int_array,
    validate_block_table,
    validate_csr,
)
from kvmem.integrity._full_check import FullCheck, Verdict
from kvmem.integrity._group_check import check_hybrid_step
from kvmem.integrity._metadata import Metadata, resolve_metadata
from kvmem.integrity._ownership import owned_pages, row_is_own
from kvmem.integrity._recorder import Recorder, tracker_for
from kvmem.integrity._splice import (
    DecodeSlots,
    Splice,
    SplicedStep,
    checked_beside,
    max_spliced_rows,
    splice,
)
from kvmem.integrity._step_checks import validate_step_fields
from kvmem.integrity._tags import (
    MAX_NAMESPACES,
    NS_BITS,
    TagMirror,
    lifetime_of,
    namespace_id_of,
    qualify,
    qualify_live,
)
from kvmem.integrity._tracker import CheckingTracker, IntegrityReport, NoOpTracker, Tracker
from kvmem.integrity._verifier import Verifier, VerifierStats

__all__ = [
    "MAX_NAMESPACES",
    "NS_BITS",
    "PAD",
    "BadEntries",
    "CheckingTracker",
    "DecodeSlots",
    "FullCheck",
    "IntegrityReport",
    "Metadata",
    "NoOpTracker",
    "Reason",
    "Recorder",
    "Splice",
    "SplicedStep",
    "TagMirror",
    "Tracker",
    "Verdict",
    "Verifier",
    "VerifierStats",
    "check_block_table",
    "check_block_table_torch",
    "check_csr",
    "check_csr_torch",
    "check_hybrid_step",
    "checked_beside",
    "lifetime_of",
    "max_spliced_rows",
    "namespace_id_of",
    "owned_pages",
    "qualify",
    "qualify_live",
    "require_int_array",
    "resolve_metadata",
    "row_is_own",
    "splice",
    "tracker_for",
    "validate_block_table",
    "validate_csr",
    "validate_step_fields",
]
