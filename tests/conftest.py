from __future__ import annotations

from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny() -> Any:
    """A tiny random Llama (model_fixtures.tiny_llama; needs transformers, the hf extra)."""
    from model_fixtures import tiny_llama

    return tiny_llama()
