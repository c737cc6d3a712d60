"""The metadata a ``verify`` checks: what the kernels of a step will read, in any of the forms
an engine may hand it (a ``StepMetadata``, the CSR alone, a mapping of arrays or tensors with
the CSR or a vLLM block table), resolved into one :class:`Metadata` whose shapes and dtypes
are checked (a malformed field is refused with :class:`~kvmem.errors.MetadataError`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from kvmem._validate import show
from kvmem.errors import ArgumentError, ArgumentTypeError, MetadataError
from kvmem.integrity._check import require_int_array, require_one_kind, validate_block_table
from kvmem.integrity._step_checks import validate_step_fields

__all__ = ["Metadata", "resolve_metadata"]

# The fields verify reads, by StepMetadata.tensors' names.
_FIELDS = ("kv_indptr", "kv_indices", "block_table", "slot_mapping", "qo_indptr",
           "kv_last_page_len", "seq_lens", "num_new_tokens")


class Metadata(NamedTuple):
    """What the kernels of a step will read, shapes and dtypes checked
    (:func:`~kvmem.integrity.require_int_array`): the CSR (``indptr``, ``indices``) or a
    ``block_table``, and the step's other fields by ``StepMetadata.tensors`` names (None when
    only the page lists were given). numpy arrays or torch tensors. The verifier checks the
    values that make it well formed (:func:`~kvmem.integrity.validate_csr`, the slot count)
    unless they are reserve's own."""

    indptr: Any
    indices: Any
    block_table: Any
    fields: Mapping[str, Any] | None
    is_numpy_csr: bool  # a CSR, every array a numpy array (the fast paths' domain)

    @classmethod
    def of(cls, indptr: Any, indices: Any, block_table: Any,
           fields: Mapping[str, Any] | None) -> Metadata:
        numpy = indices is not None and type(indptr) is np.ndarray and type(
            indices) is np.ndarray and (fields is None or all(
                type(v) is np.ndarray for v in fields.values() if v is not None))
        return cls(indptr, indices, block_table, fields, numpy)



def resolve_metadata(size: int, step: Any, kv_indptr: Any, kv_indices: Any,
                     metadata: Mapping[str, Any] | None, own_step: Any,
                     table_csr: Callable[[], tuple[Any, Any]]) -> Metadata:
    """The :class:`Metadata` of ``verify``'s arguments for a batch of ``size`` requests.

    ``step``: a ``StepMetadata`` (its ``fields()``); ``kv_indptr``/``kv_indices``: the CSR
    alone; ``metadata``: a mapping by ``StepMetadata.tensors`` names with ``slot_mapping`` and
    the CSR or a ``block_table``; none: ``table_csr()``, fresh from the page table.
    ``own_step``: the latest reserve's own ``StepMetadata`` (its arrays' types and shapes are
    reserve's: only their values are checked). Raises ArgumentError for a wrong combination,
    MetadataError for a malformed field."""
    if metadata is not None:
        if step is not None or kv_indptr is not None or kv_indices is not None:
            raise ArgumentError("verify() takes metadata= alone, without step or "
                                "kv_indptr/kv_indices")
        if not isinstance(metadata, Mapping):
            raise ArgumentError(f"metadata must be a mapping of field names to arrays, got "
                                f"{type(metadata).__name__}")
        fields = dict(metadata)
        has_csr = fields.get("kv_indptr") is not None and fields.get("kv_indices") is not None
        if fields.get("slot_mapping") is None or not (
                has_csr or fields.get("block_table") is not None):
            raise ArgumentError(
                f"verify(metadata=...) got {sorted(fields)}; it needs slot_mapping and either "
                "kv_indptr + kv_indices or block_table (the names of step.tensors(device))")
    elif kv_indptr is not None or kv_indices is not None:
        if kv_indptr is None or kv_indices is None:
            raise ArgumentError("verify() needs both kv_indptr and kv_indices, or neither")
        fields, has_csr = {"kv_indptr": kv_indptr, "kv_indices": kv_indices}, True
    elif step is not None:
        if not hasattr(step, "fields"):
            raise ArgumentTypeError(f"step={show(step)}: expected the StepMetadata the batch's "
                                    "reserve returned (or None)")
        if getattr(step, "batch_size", None) != size:
            raise ArgumentError(
                f"verify() got {size} requests and a step of "
                f"{getattr(step, 'batch_size', type(step).__name__)}; pass the StepMetadata "
                "the batch's reserve returned")
        fields, has_csr = step.fields(), True
        if step is own_step:  # made by reserve: its arrays' types and shapes are reserve's
            return Metadata(step.kv_indptr, step.kv_indices, None, fields, True)
    else:
        indptr, indices = table_csr()
        return Metadata(indptr, indices, None, None, True)
    if has_csr:
        require_int_array("kv_indptr", fields["kv_indptr"], (size + 1,))
        require_int_array("kv_indices", fields["kv_indices"], (None,))
    else:
        validate_block_table(fields["block_table"], size)
    _require_one_kind(fields)
    step_fields = None
    if fields.get("slot_mapping") is not None:
        validate_step_fields(fields, size)
        step_fields = fields
    if has_csr:
        return Metadata.of(fields["kv_indptr"], fields["kv_indices"], None, step_fields)
    return Metadata.of(None, None, fields["block_table"], step_fields)


def _require_one_kind(fields: Mapping[str, Any]) -> None:
    """Refuse (MetadataError, nothing checked) fields that mix numpy arrays with torch tensors,
    tensors on different devices, or a uint64 array (no page id or slot lies beyond int64):
    the kernels of one step read one kind of metadata, and the check reads it as they do."""
    given = {k: fields[k] for k in _FIELDS if fields.get(k) is not None}
    require_one_kind(given)
    for k, v in given.items():
        if isinstance(v, np.ndarray) and v.dtype == np.uint64:
            raise MetadataError(
                f"{k} has dtype uint64: expected int32 or int64 (the dtypes kernels read). "
                "Nothing was checked or changed")
