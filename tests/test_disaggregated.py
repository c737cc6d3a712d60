"""Prefill in one process, decode in another, over NIXL: ``examples/disaggregated.py`` with
SmolLM2 generates exactly the tokens of the same steps run in one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from model_fixtures import example, model_threads, smollm2  # noqa: F401 (fixtures)

pytest.importorskip("nixl._api", reason="nixl not installed: pip install 'kvmem[transfer]'")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def prefill_side(model_threads: int) -> Iterator[Any]:  # noqa: F811
    """The example's prefill process (torch threads as this one's: model_threads), its model
    loaded once for every test here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))  # the spawned process imports the example
        ex = example("disaggregated")
        with ex.start_prefill_process() as peer:
            yield peer
            peer.send(None)


@pytest.mark.parametrize(("round_", "kv_dtype", "decode_kv_dtype"),
                         [(0, "bf16", "bf16"), (1, "fp32", "fp32"), (2, "bf16", "fp8_e4m3")])
def test_two_processes_generate_the_single_process_tokens(
        smollm2: tuple[Any, Any], prefill_side: Any, round_: int,  # noqa: F811
        kv_dtype: str, decode_kv_dtype: str) -> None:
    """The prefill process computes the prompts' full pages on ``kv_dtype`` pages and offers
    them; this process reads them over NIXL into ``decode_kv_dtype`` pages (fp8: converted on
    arrival), checks and commits them, and decodes. Its tokens are those of one process that
    computes the same pages and writes their K/V straight into a ``decode_kv_dtype`` pool."""
    model, tokenizer = smollm2
    ex = example("disaggregated")
    prompts = ex.chat_prompts(tokenizer)
    moved = ex.disaggregated(model, prompts, prefill_side, kv_dtype, decode_kv_dtype, 8, 60.0,
                             round_)
    alone = ex.single_process(model, prompts, kv_dtype, decode_kv_dtype, 8)
    assert moved["tokens"] == alone and all(len(t) == 8 for t in alone)
    assert moved["transport"] == "nixl" and moved["sender_counts"]["stale"] == 0
    # Every full page moved once at most: the prompts share a system prompt, whose pages a
    # later load finds in the receiver's cache when an earlier one has committed them.
    lm, _manager = ex.build(model, kv_dtype)
    per_page = lm.pool.spec.nbytes // lm.pool.spec.num_pages
    full = [len(p) // ex.PAGE_SIZE for p in prompts]
    shared = min(_common(prompts[0], p) for p in prompts[1:]) // ex.PAGE_SIZE
    assert moved["bytes_moved"] % per_page == 0
    assert sum(full) - 2 * shared <= moved["bytes_moved"] // per_page <= sum(full)
