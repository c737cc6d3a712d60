"""Reference paged attention over a :class:`~kvmem.cuda.PagePool`, in plain torch.

It reads FlashInfer's CSR page metadata, dequantizes the pages it names and runs
``scaled_dot_product_attention``. It is the ground truth the tests hold kernels and pools to,
and what CPU engines and the examples run; it is not a fast GPU kernel.

Request b of a batch (CSR, as FlashInfer takes it)::

    pages        kv_indices[kv_indptr[b] : kv_indptr[b+1]]        in sequence order
    kv_len       (num_pages - 1) * page_size + kv_last_page_len[b]
    queries      q[qo_indptr[b] : qo_indptr[b+1]]                 the LAST qo_len tokens

    causal mask (qo_len = 3, kv_len = 7; x = attends)::

        key      0 1 2 3 4 5 6
        query 0  x x x x x . .      query i sees keys 0 .. kv_len - qo_len + i
        query 1  x x x x x x .
        query 2  x x x x x x x

Decode batches (every qo_len <= 1) run as one padded call; other requests run one by one.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from kvmem._validate import flag, index_array, integer, real, show
from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError

__all__ = ["paged_attention"]

MetaLike = torch.Tensor | np.ndarray | list[int]

_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def paged_attention(
    q: torch.Tensor,
    qo_indptr: MetaLike,
    pool: PagePool,
    layer: int,
    kv_indptr: MetaLike,
    kv_indices: MetaLike,
    kv_last_page_len: MetaLike,
    sm_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of a packed batch of queries over their requests' pages.

    Parameters
    ----------
    q : [T, num_q_heads, head_dim], on the pool's device
        All requests' query tokens, packed. MLA: [T, H, kv_lora_rank + qk_rope_head_dim]
        (queries already absorbed into the latent space).
    qo_indptr : [B + 1], int32
        Request b's queries are ``q[qo_indptr[b]:qo_indptr[b+1]]``.
    pool : PagePool
    layer : int
    kv_indptr : [B + 1], int32
    kv_indices : [nnz], int32
        Page ids, request by request, in sequence order.
    kv_last_page_len : [B], int32
        Tokens in each request's last page, 1..page_size.
    sm_scale : float, optional
        Softmax scale; default ``1 / sqrt(q.shape[-1])`` (MLA models usually pass their own).
    causal : bool
        Queries are the last ``qo_len`` tokens of the sequence and see only keys up to their
        own position. False: every query sees every key.

    Returns
    -------
    [T, num_q_heads, head_dim] in q's dtype (MLA: [T, H, kv_lora_rank]).
    """
    if not isinstance(pool, PagePool):
        raise ArgumentTypeError(f"pool={show(pool)}: expected a kvmem PagePool.")
    spec = pool.spec
    integer(layer, "layer", minimum=0, maximum=spec.num_layers - 1)
    if sm_scale is not None:
        sm_scale = real(sm_scale, "sm_scale", minimum=0, exclusive_minimum=True)
    causal = flag(causal, "causal")
    meta = _Metadata.parse(q, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, pool)
    out_dim = _output_dim(q, spec)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    compute = torch.promote_types(q.dtype, pool.compute_dtype)
    out = torch.zeros((q.shape[0], q.shape[1], out_dim), dtype=q.dtype, device=q.device)
    if meta.num_tokens == 0:
        return out
    keys, values = _token_rows(pool, layer, meta.kv_indices, compute, out_dim)
    qc = q.to(compute)
    if bool(np.all(meta.qo_len <= 1)):
        _decode(qc, keys, values, meta, scale, out)
    else:
        for b in np.flatnonzero(meta.qo_len):
            _one_request(qc, keys, values, meta, int(b), scale, causal, out)
    return out


def _output_dim(q: torch.Tensor, spec: PoolSpec) -> int:
    """Check q's heads and head size against the pool; return the output's head size
    (``head_dim``; MLA: ``kv_lora_rank``)."""
    num_q_heads = q.shape[1]
    if num_q_heads < 1:
        raise ArgumentError(f"q has shape {tuple(q.shape)}: it needs at least one head.")
    if spec.attention == "gqa":
        if num_q_heads % spec.num_heads:
            raise ArgumentError(
                f"q has {num_q_heads} heads, not a multiple of the pool's {spec.num_heads} KV "
                "heads; GQA needs num_q_heads = k * num_kv_heads."
            )
        out_dim = spec.width
    else:
        assert spec.kv_lora_rank is not None
        out_dim = spec.kv_lora_rank
    if q.shape[2] != spec.width:
        raise ArgumentError(
            f"q has head size {q.shape[2]} but the pool stores {spec.width} per head "
            f"({'head_dim' if spec.attention == 'gqa' else 'kv_lora_rank + qk_rope_head_dim'})."
        )
    return out_dim


def _token_rows(
    pool: PagePool, layer: int, page_ids: npt.NDArray[np.int64], dtype: torch.dtype, out_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every page the batch reads, dequantized once, as token rows: keys [rows, H_kv, D] and
    values [rows, H_kv, Dv], ``rows = nnz * page_size`` (row ``p * page_size + o``: offset ``o``
    of the batch's ``p``-th page)."""
    pages = torch.from_numpy(page_ids).to(pool.device)
    kv = pool.gather(layer, pages, dtype)  # [nnz, C, page_size, H, D]
    nnz, comps, page_size, heads, width = kv.shape
    kv = kv.transpose(1, 2).reshape(nnz * page_size, comps, heads, width)
    if pool.spec.attention == "gqa":
        return kv[:, 0], kv[:, 1]
    latent = kv[:, 0]  # [rows, 1, L + R]: one shared "head"; V is the first L channels
    return latent, latent[..., :out_dim]


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, Hq, Lq, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, Hq, Lq, Dv]."""
    if k.shape[1] != q.shape[1]:
        if _HAS_ENABLE_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True
            )
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal)


def _decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: _Metadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One padded call for a batch where each request has at most one query token."""
    active = np.flatnonzero(meta.qo_len)
    kv_len = meta.kv_len[active]
    width = int(kv_len.max())
    pos = np.arange(width)
    page_of = meta.kv_indptr[active, None] + np.minimum(pos, kv_len[:, None] - 1) // meta.page_size
    rows = torch.from_numpy(page_of * meta.page_size + pos % meta.page_size).to(q.device)
    k = keys[rows].permute(0, 2, 1, 3)  # [B, Hkv, width, D]
    v = values[rows].permute(0, 2, 1, 3)
    mask = torch.from_numpy(pos[None, :] < kv_len[:, None]).to(q.device)[:, None, None, :]
    qi = torch.from_numpy(meta.qo_indptr[active]).to(q.device)
    res = _sdpa(q[qi].unsqueeze(2), k, v, mask, scale)  # [B, Hq, 1, Dv]
    out[qi] = res[:, :, 0].to(out.dtype)


def _one_request(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: _Metadata,
    b: int,
    scale: float,
    causal: bool,
    out: torch.Tensor,
) -> None:
    q0, q1 = int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1])
    kv_len = int(meta.kv_len[b])
    first = int(meta.kv_indptr[b]) * meta.page_size
    k = keys[first : first + kv_len].transpose(0, 1)[None]  # [1, Hkv, S, D]
    v = values[first : first + kv_len].transpose(0, 1)[None]
    qb = q[q0:q1].transpose(0, 1)[None]  # [1, Hq, Lq, D]
    qo_len = q1 - q0
    mask = None
    square_causal = False
    if causal and qo_len > 1:
        if qo_len == kv_len:
            square_causal = True  # plain lower triangle: lets torch use its fused kernel
        else:
            visible = np.arange(kv_len)[None, :] <= (kv_len - qo_len + np.arange(qo_len))[:, None]
            mask = torch.from_numpy(visible).to(q.device)
    res = _sdpa(qb, k, v, mask, scale, causal=square_causal)  # [1, Hq, Lq, Dv]
    out[q0:q1] = res[0].transpose(0, 1).to(out.dtype)


class _Metadata:
    """Host copies of a batch's CSR metadata, validated once."""

    def __init__(
        self,
        qo_indptr: npt.NDArray[np.int64],
        kv_indptr: npt.NDArray[np.int64],
        kv_indices: npt.NDArray[np.int64],
        kv_len: npt.NDArray[np.int64],
        page_size: int,
    ) -> None:
        self.qo_indptr = qo_indptr
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices
        self.kv_len = kv_len
        self.qo_len = np.diff(qo_indptr)
        self.page_size = page_size
        self.num_tokens = int(qo_indptr[-1])

    @classmethod
    def parse(
        cls,
        q: torch.Tensor,
        qo_indptr: MetaLike,
        kv_indptr: MetaLike,
        kv_indices: MetaLike,
        kv_last_page_len: MetaLike,
        pool: PagePool,
    ) -> _Metadata:
        """Check ``q`` and the CSR arrays against each other and the pool; copy them to host."""
        _check_q(q, pool)
        qo = _host(qo_indptr, "qo_indptr")
        indptr = _host(kv_indptr, "kv_indptr")
        indices = _host(kv_indices, "kv_indices")
        last = _host(kv_last_page_len, "kv_last_page_len")
        batch = qo.size - 1
        ps = pool.spec.page_size
        if batch < 0 or indptr.size != batch + 1 or last.size != batch:
            raise ArgumentError(
                f"CSR sizes disagree: qo_indptr has {qo.size} entries, kv_indptr {indptr.size}, "
                f"kv_last_page_len {last.size}; for B requests they must be B+1, B+1 and B."
            )
        if qo[0] != 0 or np.any(np.diff(qo) < 0) or qo[-1] != q.shape[0]:
            raise ArgumentError(
                f"qo_indptr must start at 0, never decrease and end at T = {q.shape[0]}; got "
                f"{qo.tolist()[:8]}{'...' if qo.size > 8 else ''}."
            )
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] > indices.size:
            raise ArgumentError(
                f"kv_indptr must start at 0, never decrease and end within kv_indices "
                f"({indices.size} entries); ends at {int(indptr[-1])}."
            )
        indices = indices[: indptr[-1]]
        if indices.size and (indices.min() < 0 or indices.max() >= pool.spec.num_pages):
            raise ArgumentError(
                f"kv_indices holds pages {int(indices.min())}..{int(indices.max())}; the pool "
                f"has pages 0..{pool.spec.num_pages - 1}."
            )
        num_pages = np.diff(indptr)
        qo_len = np.diff(qo)
        has_pages = num_pages > 0
        if np.any(has_pages & ((last < 1) | (last > ps))):
            raise ArgumentError(
                f"kv_last_page_len must be in 1..{ps} (page_size) for every request with pages; "
                f"got {last.tolist()[:8]}."
            )
        kv_len = np.where(has_pages, (num_pages - 1) * ps + last, 0)
        if np.any(qo_len > kv_len):
            b = int(np.flatnonzero(qo_len > kv_len)[0])
            raise ArgumentError(
                f"request {b} has {int(qo_len[b])} queries but only {int(kv_len[b])} KV tokens; "
                "queries are the last tokens of their sequence, so qo_len <= kv_len."
            )
        return cls(qo, indptr, indices, kv_len, ps)


def _check_q(q: torch.Tensor, pool: PagePool) -> None:
    if not isinstance(q, torch.Tensor):
        raise ArgumentTypeError(
            f"q={show(q)}: expected a [T, num_q_heads, head_dim] float tensor."
        )
    if q.dim() != 3:
        raise ArgumentError(
            f"q must be a [T, num_q_heads, head_dim] tensor; got {tuple(q.shape)}."
        )
    if q.device != pool.device:
        raise ArgumentError(f"q is on {q.device} but the pool is on {pool.device}.")
    if q.dtype not in _Q_DTYPES:
        raise ArgumentTypeError(
            f"q has dtype {q.dtype}: expected float32, bfloat16, float16 or float64."
        )


def _host(value: MetaLike, name: str) -> npt.NDArray[np.int64]:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _INDEX_DTYPES:
            raise ArgumentTypeError(f"{name} has dtype {value.dtype}: expected an int32 tensor.")
        if value.dim() != 1:
            raise ArgumentError(f"{name} has shape {tuple(value.shape)}: expected 1-D.")
        return value.detach().cpu().numpy().astype(np.int64)
    return index_array(value, name, minimum=np.iinfo(np.int64).min, what="value")
