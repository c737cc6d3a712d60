"""The README's embedding example runs as printed, and the per-layer calls its comments name work
on the step it reserves."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = (Path(__file__).parent.parent / "README.md").read_text()


def _block(heading: str) -> str:
    section = README[README.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_embedding_example_runs_and_its_commented_calls_work() -> None:
    code = _block("## Embedding it in an engine")
    ns: dict = {"prompt_ids": list(range(1, 41)), "batch": ["req-1"]}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["res"].num_prompt_tokens == 40 and ns["report"].aborted == {}
    mgr, pool, step = ns["mgr"], ns["pool"], ns["step"]
    assert mgr.num_tokens("req-1") == 41  # the prompt and the decode step's slot
    assert mgr.num_committed("req-1") == 40
    assert mgr.tokens_of("req-1").tolist() == ns["prompt_ids"]

    # The comment's per-layer calls, on the decode step: write the new token's K/V, attend.
    from kvmem import paged_attention

    t = step.tensors("cpu")
    k = v = torch.randn(1, 3, 64)
    pool.write(0, t["slot_mapping"], k, v)
    q = torch.randn(1, 9, 64)  # 9 query heads over 3 KV heads (GQA)
    out = paged_attention(q, torch.tensor([0, 1]), pool, 0, t["kv_indptr"], t["kv_indices"],
                          t["kv_last_page_len"])
    assert out.shape == (1, 9, 64) and torch.isfinite(out).all()
