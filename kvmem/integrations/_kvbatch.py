"""The metadata one packed forward hands to every attention layer (no transformers needed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError

if TYPE_CHECKING:
    from kvmem.cuda import PagePool
    from kvmem.manager import KVCacheManager

__all__ = ["KVBatch", "PagedModel", "check_vocab", "require_manager_fits"]


class KVBatch(NamedTuple):
    """What every attention layer of one forward reads: the pool and the step's page metadata.

    All tensors live on the pool's device. ``T`` is the number of tokens in the forward (all
    requests packed), ``B`` the number of requests.

    Attributes
    ----------
    pool:
        The page pool holding every layer's keys and values.
    slot_mapping:
        ``[T]``, int64: where token t's key and value are written (``page * page_size + offset``;
        -1 skips the write).
    qo_indptr:
        ``[B + 1]``, int32: request b's tokens are ``qo_indptr[b]:qo_indptr[b + 1]``.
    kv_indptr, kv_indices, kv_last_page_len:
        FlashInfer CSR, int32 (``[B + 1]``, ``[nnz]``, ``[B]``): each request's pages after this
        step's tokens are written. A request's queries are the last tokens of its sequence.
    """

    pool: PagePool
    slot_mapping: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor

    @classmethod
    def from_arrays(
        cls,
        pool: PagePool,
        slot_mapping: np.ndarray,
        qo_indptr: np.ndarray,
        kv_indptr: np.ndarray,
        kv_indices: np.ndarray,
        kv_last_page_len: np.ndarray,
    ) -> KVBatch:
        """Wrap a step's numpy metadata (e.g. from ``KVCacheManager.reserve``) as tensors on
        the pool's device, in the dtypes above (zero-copy on the CPU when the arrays have them
        already). A page id outside the pool, or a value outside its dtype, is refused
        (ArgumentError): the kernels would index past it."""
        from kvmem._validate import show

        if not hasattr(pool, "spec") or not hasattr(pool, "device"):
            raise ArgumentTypeError(f"pool={show(pool)}: expected a kvmem.cuda.PagePool")
        arrays = (slot_mapping, qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iu"
                   for a in arrays):
            raise ArgumentTypeError("KVBatch.from_arrays takes 1-D integer numpy arrays (a "
                                    "reserved step's slot_mapping, qo_indptr, kv_indptr, "
                                    "kv_indices, kv_last_page_len)")
        num_pages = pool.spec.num_pages
        if kv_indices.size and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= num_pages):
            raise ArgumentError(f"kv_indices holds page ids from {int(kv_indices.min())} to "
                                f"{int(kv_indices.max())}; this pool has pages 0..{num_pages - 1}")
        device = pool.device
        names = ("slot_mapping", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")

        def dev(a: np.ndarray, name: str, dtype: type[np.integer]) -> torch.Tensor:
            # The documented dtypes (torch has no arithmetic on uint16/32/64); zero-copy when
            # the array has them already, as a reserved step's arrays do.
            info = np.iinfo(dtype)
            if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
                raise ArgumentError(f"{name} holds {int(a.min())}..{int(a.max())}, outside "
                                    f"{np.dtype(dtype).name}")
            return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

        dtypes = (np.int64, np.int32, np.int32, np.int32, np.int32)
        return cls(pool, *(dev(a, n, d) for a, n, d in zip(arrays, names, dtypes)))

    def positions(self) -> torch.Tensor:
        """Position of every packed token in its own sequence.

        Returns
        -------
        torch.Tensor
            ``[T]``, int64: request b's queries sit at ``kv_len[b] - qo_len[b] ... kv_len[b] - 1``.
        """
        page_size = self.pool.spec.page_size
        qo_len = (self.qo_indptr[1:] - self.qo_indptr[:-1]).long()
        num_pages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        kv_len = (num_pages - 1) * page_size + self.kv_last_page_len.long()
        start = torch.repeat_interleave(kv_len - qo_len, qo_len)
        first = torch.repeat_interleave(self.qo_indptr[:-1].long(), qo_len)
        return start + torch.arange(int(self.qo_indptr[-1]), device=start.device) - first


class PagedModel(Protocol):
    """What :class:`~kvmem.integrations.engine.Engine` needs from a model on pages
    (:class:`~kvmem.integrations.hf.PagedCausalLM` is one)."""

    pool: PagePool

    def forward(
        self, input_ids: torch.Tensor, batch: KVBatch, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids [T]`` int64 -> logits ``[n, vocab]`` float32 at ``logits_indices``."""
        ...


def require_manager_fits(manager: KVCacheManager, lm: PagedModel, hint: str) -> None:
    """Raise ConfigError unless ``manager`` hands out pages of ``lm.pool`` (the same page size,
    at most its pages); ``hint`` says how to build a manager that fits."""
    spec = lm.pool.spec
    if manager.page_size != spec.page_size or manager.num_pages > spec.num_pages:
        raise ConfigError(
            f"manager (num_pages={manager.num_pages}, page_size={manager.page_size}) does not "
            f"fit the model's pool (num_pages={spec.num_pages}, page_size={spec.page_size}); "
            f"{hint}"
        )


def check_vocab(lowest: int, highest: int, vocab_size: int | None, name: str) -> None:
    """Refuse (ArgumentError) token ids the model's embedding has no row for (``vocab_size``
    None: any id >= 0): they would fail deep inside the forward (an IndexError), after pages
    were reserved. ``name`` says whose ids they are."""
    if lowest < 0 or (vocab_size is not None and highest >= vocab_size):
        top = "" if vocab_size is None else f"..{vocab_size - 1}"
        raise ArgumentError(f"{name} holds ids from {lowest} to {highest}, but the model's "
                            f"vocabulary has ids 0{top}; tokenize with the model's own "
                            "tokenizer")
