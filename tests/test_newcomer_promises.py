"""The newcomer's path: what README.md, docs/transformers.md and the examples promise.

The tests without the ``model`` marker run the integration's error paths on a tiny random
Llama (no weights); the ``model`` ones run the real SmolLM2 (the session fixture of
model_fixtures.py, loaded once) through the doc's code block, the tour and the perplexity
claims.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from model_fixtures import TINY_VOCAB, model_threads, smollm2  # noqa: E402, F401

from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError, KVMemError  # noqa: E402
from kvmem.integrations.engine import Engine, Request  # noqa: E402
from kvmem.integrations.hf import (  # noqa: E402
    KVBatch,
    PagedCausalLM,
    hf_perplexity,
    paged_logits,
    paged_perplexity,
)
from kvmem.manager import KVCacheManager  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VOCAB = TINY_VOCAB



def _paged(model: Any, num_pages: int = 16, **manager_kw: Any) -> tuple[Any, KVCacheManager]:
    lm = PagedCausalLM.build(model, num_pages, "fp32", page_size=4, device="cpu")
    manager_kw.setdefault("prefix_cache", None)
    return lm, KVCacheManager(num_pages, page_size=4, pool=lm.pool, **manager_kw)


def _untouched(lm: Any, mgr: KVCacheManager) -> None:
    assert mgr.allocator.num_free == mgr.num_pages and not mgr.running
    mgr.check()


# -- hf_perplexity: "with the model's own attention" -----------------------------------------


def test_hf_perplexity_after_a_paged_forward_is_the_models_own_and_switches_back(
        tiny: Any) -> None:
    """PagedCausalLM switches the model to "kvmem"; the reference perplexity still runs (it
    raised ConfigError: no kvmem_batch) and equals the one taken before any paged forward."""
    tiny.set_attn_implementation("sdpa")
    ids = np.random.default_rng(3).integers(1, VOCAB, 20).tolist()
    before = hf_perplexity(tiny, ids, window=8)
    lm, mgr = _paged(tiny)
    paged_logits(lm, mgr, ids[:6])
    assert tiny.config._attn_implementation == "kvmem"
    assert hf_perplexity(tiny, ids, window=8) == before
    assert tiny.config._attn_implementation == "kvmem"  # switched back for the paged path
    fp32 = paged_perplexity(lm, mgr, ids, window=8, chunk_size=3)
    assert fp32[1] == before[1] and abs(fp32[0] / before[0] - 1) < 1e-4
    tiny.set_attn_implementation("sdpa")


def test_perplexity_progress_ends_at_its_total(tiny: Any) -> None:
    """A trailing window of one token is dropped, so it is not counted among the windows: the
    last progress call says n of n (it said 2 of 3, leaving a progress line unfinished)."""
    ids = list(range(1, 10))  # windows of 4: [4, 4, 1]; the last scores nothing
    calls: list[tuple[int, int]] = []
    _, n = hf_perplexity(tiny, ids, window=4, progress=lambda d, t: calls.append((d, t)))
    assert n == 6 and calls == [(1, 2), (2, 2)]
    lm, mgr = _paged(tiny)
    calls.clear()
    _, n = paged_perplexity(lm, mgr, ids, window=4, chunk_size=3,
                            progress=lambda d, t: calls.append((d, t)))
    assert n == 6 and calls == [(1, 2), (2, 2)]
    calls.clear()
    hf_perplexity(tiny, list(range(1, 11)), window=4, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(1, 3), (2, 3), (3, 3)]  # a last window of 2 tokens scores one


@pytest.mark.parametrize(("num_tokens", "window", "chunk_size"), [(10, 5, 4), (13, 8, 4)])
def test_a_last_chunk_of_one_token_is_scored_like_any_other(tiny: Any, num_tokens: int,
                                                            window: int, chunk_size: int
                                                            ) -> None:
    """A window whose length is one more than a multiple of chunk_size (e.g. perplexity.py's
    last window of 257 tokens in 256-token chunks) crashed: its last chunk has no target."""
    tiny.set_attn_implementation("sdpa")
    ids = np.random.default_rng(5).integers(1, VOCAB, num_tokens).tolist()
    ref, n = hf_perplexity(tiny, ids, window=window)
    lm, mgr = _paged(tiny)
    ppl, count = paged_perplexity(lm, mgr, ids, window=window, chunk_size=chunk_size)
    assert count == n == num_tokens - -(-num_tokens // window) and abs(ppl / ref - 1) < 1e-4
    _untouched(lm, mgr)
    tiny.set_attn_implementation("sdpa")


# -- bad token ids and mismatched pages: KVMemErrors up front, nothing admitted --------------


@pytest.mark.parametrize("call", ["paged_logits", "paged_perplexity", "hf_perplexity"])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_page(tiny: Any,
                                                                      call: str) -> None:
    """An id the embedding has no row for was an IndexError from inside the forward."""
    lm, mgr = _paged(tiny)
    ids = [1, 2, VOCAB, 3]
    with pytest.raises(ArgumentError, match=r"vocabulary has ids 0\.\.96") as info:
        if call == "paged_logits":
            paged_logits(lm, mgr, ids)
        elif call == "paged_perplexity":
            paged_perplexity(lm, mgr, ids, window=4)
        else:
            hf_perplexity(tiny, ids, window=4)
    assert isinstance(info.value, ValueError) and "token_ids holds ids from 1 to 97" in str(
        info.value)
    _untouched(lm, mgr)
    tiny.set_attn_implementation("sdpa")


@pytest.mark.parametrize(("num_pages", "page_size"), [(16, 8), (64, 4)])
def test_teacher_forcing_refuses_a_manager_over_other_pages(tiny: Any, num_pages: int,
                                                           page_size: int) -> None:
    """A manager whose page size differs (was a misleading kv_last_page_len error from the
    pool) or that has more pages than the pool (the kernels would index past it)."""
    lm = PagedCausalLM.build(tiny, 16, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(num_pages, page_size=page_size, prefix_cache=None)
    for call in (lambda: paged_logits(lm, mgr, list(range(1, 20))),
                 lambda: paged_perplexity(lm, mgr, list(range(1, 20)), window=8)):
        with pytest.raises(ConfigError, match=rf"page_size={page_size}\).*not fit the model's"):
            call()
    assert mgr.allocator.num_free == num_pages and not mgr.running


def _one_step(tiny: Any) -> tuple[Any, KVBatch]:
    lm, mgr = _paged(tiny)
    mgr.admit("r", [1, 2, 3])
    st = mgr.reserve(["r"], 3)
    return lm, KVBatch.from_arrays(lm.pool, st.slot_mapping, st.qo_indptr, st.kv_indptr,
                                   st.kv_indices, st.kv_last_page_len)


@pytest.mark.parametrize(("input_ids", "logits_indices", "kind", "message"), [
    (torch.tensor([1, 2]), None, ArgumentError, "input_ids has 2 tokens but the batch"),
    (torch.tensor([1.0, 2.0, 3.0]), None, ArgumentTypeError, "integer token ids"),
    (torch.tensor([1, 2, VOCAB]), None, ArgumentError, "vocabulary has ids 0..96"),
    (torch.tensor([1, -2, 3]), None, ArgumentError, "ids from -2 to 3"),
    (torch.tensor([1, 2, 3]), torch.tensor([3]), ArgumentError, "the step has tokens 0..2"),
    (torch.tensor([1, 2, 3]), torch.tensor([-1]), ArgumentError, "the step has tokens 0..2"),
    (torch.tensor([1, 2, 3]), [2], ArgumentTypeError, "logits_indices=[2]"),
    (torch.tensor([1, 2, 3]), torch.tensor([0.5]), ArgumentTypeError, "1-D integer tensor"),
])
def test_forward_refuses_malformed_inputs_and_writes_no_page(
        tiny: Any, input_ids: Any, logits_indices: Any, kind: type, message: str) -> None:
    """The documented shapes are checked: each of these was a RuntimeError, IndexError or
    AttributeError from inside the model, after the earlier layers had written pages."""
    lm, batch = _one_step(tiny)
    data = lm.pool.data.clone()
    with pytest.raises(kind) as info:
        lm.forward(input_ids, batch, logits_indices)
    assert message in str(info.value) and isinstance(info.value, KVMemError)
    assert torch.equal(lm.pool.data, data)
    out = lm.forward(torch.tensor([1, 2, 3]), batch, torch.tensor([2]))
    assert out.shape == (1, VOCAB) and out.dtype == torch.float32


# -- the engine: a bad request is refused when added, with nothing queued or allocated -------


@pytest.mark.parametrize(("request_", "kind", "message"), [
    (Request("x", [1, VOCAB + 5], max_new_tokens=2), ArgumentError,
     "prompt_ids holds ids from 1 to 102"),
    (Request("x", [1, 2], max_new_tokens=2, stop_token_ids=5), ArgumentTypeError,  # type: ignore[arg-type]
     "stop_token_ids=5"),
    (Request("x", [1, 2], max_new_tokens=2, stop_token_ids=None), ArgumentTypeError,  # type: ignore[arg-type]
     "stop_token_ids=None"),
    (Request("x", [1, 2], max_new_tokens=2, namespace=["tenant"]), ArgumentTypeError,
     "namespace must be None, str, int, bytes"),
])
@pytest.mark.parametrize("how", ["add_request", "run"])
def test_a_request_the_loop_would_fail_on_is_refused_up_front(
        tiny: Any, request_: Request, kind: type, message: str, how: str) -> None:
    """Each was accepted and then failed inside a step: an out-of-vocabulary prompt with an
    IndexError after its pages were reserved (the request left running, a page held), a bad
    namespace at admission (the request left waiting), stop_token_ids with a TypeError."""
    lm, mgr = _paged(tiny)
    engine = Engine(lm, mgr)
    with pytest.raises(kind, match=re.escape(message)):
        if how == "run":
            engine.run({0: [request_]})
        else:
            engine.add_request(request_)
    assert not engine.has_work() and not engine.done and not engine.timings
    _untouched(lm, mgr)


def test_a_request_that_already_ran_is_refused(tiny: Any) -> None:
    """Queuing a finished Request again generated after its old output (it stopped at once
    with max_new_tokens + 1 tokens, the new one appended to the old)."""
    lm, mgr = _paged(tiny)
    engine = Engine(lm, mgr)
    r = Request("z", [1, 2, 3], max_new_tokens=2)
    engine.run({0: [r]})
    assert r.status == "finished" and len(r.output_ids) == 2
    for call in (lambda: engine.add_request(r), lambda: engine.run({0: [r]})):
        with pytest.raises(ArgumentError, match=r"has already run.*queue a new Request"):
            call()
    assert len(r.output_ids) == 2 and not engine.has_work()
    again = engine.run({0: [Request("z", [1, 2, 3], max_new_tokens=2)]})  # a new one is fine
    assert again[-1].output_ids == r.output_ids


def test_run_refuses_a_before_step_that_cannot_be_called(tiny: Any) -> None:
    lm, mgr = _paged(tiny)
    engine = Engine(lm, mgr)
    with pytest.raises(ArgumentTypeError, match="before_step=5"):
        engine.run({0: [Request("a", [1, 2], max_new_tokens=2)]}, 5)  # type: ignore[arg-type]
    assert not engine.has_work()  # it had queued the request, then raised a TypeError
    _untouched(lm, mgr)


# -- examples/perplexity.py --table: the README's columns ---------------------------------


def _readme_ppl_rows() -> dict[tuple[str, str], int]:
    """(KV pages, scales) -> bytes/token of docs/benchmarks.md's perplexity table."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text[text.index("| KV pages"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        if cells[2] != "-":
            rows[(cells[0], cells[1].split("*")[0].strip())] = int(cells[2].replace(",", ""))
    return rows


def test_the_readme_bytes_per_token_column_is_smollm2s_pool_spec() -> None:
    from kvmem.cuda import PoolSpec

    rows = _readme_ppl_rows()
    assert len(rows) == 8
    for (dtype, scales), size in rows.items():
        spec = PoolSpec(num_layers=30, num_pages=1, attention="gqa", num_kv_heads=3, head_dim=64,
                        dtype=dtype, scales=None if scales == "-" else scales, device="cpu")
        assert spec.bytes_per_token == size, (dtype, scales)


def test_perplexity_table_reports_bytes_per_token(tiny: Any) -> None:
    """The README's table (`python examples/perplexity.py --table`) has a bytes/token column;
    the script measured it nowhere (its rows had no such field)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import perplexity
    finally:
        sys.path.remove(str(ROOT / "examples"))
    ids = list(range(1, 21))
    rows = {d: perplexity.measure(tiny, ids, d, None, 8, 4) for d in ("hf", "bf16", "fp8_e4m3")}
    assert rows["hf"]["bytes_per_token"] is None
    assert rows["bf16"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # layers, K/V, heads, dim, B
    assert rows["fp8_e4m3"]["bytes_per_token"] == 2 * 2 * 2 * (16 + 4)  # + a scale per head
    assert rows["fp8_e4m3"]["scales"] == "token_head" and rows["fp8_e4m3"]["tokens"] == 17
    tiny.set_attn_implementation("sdpa")


# -- the real model: the doc's code block, the tour, the perplexity claims -------------------


def _doc_block(path: str, heading: str | None = None) -> str:
    text = (ROOT / path).read_text()
    if heading is not None:
        text = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]


@pytest.mark.model
def test_the_transformers_doc_code_block_runs_as_written(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """docs/transformers.md's first code block, with the session's model for load_smollm2()
    (the same offline load, done once) and two chat prompts for prompt_a / prompt_b."""
    import kvmem.integrations.hf as hf

    model, tokenizer = smollm2
    monkeypatch.setattr(hf, "load_smollm2", lambda: smollm2)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from serve_smollm2 import chat_prompts
    finally:
        sys.path.remove(str(ROOT / "examples"))
    prompt_a, prompt_b = chat_prompts(tokenizer, ("What is a page?", "What is a cache?"))
    ns: dict[str, Any] = {"prompt_a": prompt_a, "prompt_b": prompt_b}
    exec(compile(_doc_block("docs/transformers.md"), "transformers.md", "exec"), ns)
    lm, manager, engine = ns["lm"], ns["manager"], ns["engine"]
    assert lm.pool.spec.dtype == "fp8_e4m3" and lm.pool.spec.scales == "token_head"
    done = {r.request_id: r for r in engine.done}
    assert sorted(done) == ["a", "b"]
    assert all(r.status == "finished" and len(r.output_ids) == 64 for r in done.values())
    assert done["a"].num_cached_tokens == 0 and done["b"].num_cached_tokens == 32  # system prompt
    assert manager.stats().num_used == 0 and manager.stats().num_integrity_failures == 0
    manager.check()
    model.set_attn_implementation("sdpa")


@pytest.mark.model
def test_the_tour_plans_kimi_serves_on_fp8_and_catches_the_drill(
        smollm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """README's first command ends in `python examples/tour.py`: the plan's figures, six
    requests on fp8 pages, exactly the victim aborted with docs/transformers.md's reason, and
    the example's own check against the fault-free run."""
    import kvmem.integrations.hf as hf

    monkeypatch.setattr(hf, "load_smollm2", lambda: smollm2)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import tour

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = tour.main()
        import serve_smollm2

        with contextlib.redirect_stdout(io.StringIO()) as js, \
                contextlib.redirect_stderr(io.StringIO()):
            json_status = serve_smollm2.main(["--max-new-tokens", "3", "--json"])
    finally:
        sys.path.remove(str(ROOT / "examples"))
    text = out.getvalue()
    assert status == 0, text
    assert re.search(r"KV bytes / token / GPU\s+70,272\s+35,136", text)
    assert re.search(r"KV tokens / replica\s+653,125\s+1,306,251", text)
    assert len(re.findall(r"^--- req-\d ", text, re.M)) == 6
    assert len(re.findall(r": finished$", text, re.M)) == 5
    assert ("--- req-1 (54 prompt tokens, 0 from the prefix cache): aborted\n    aborted: page "
            "was reallocated to another lifetime (tag changed) (expected tag 16, found 18): "
            "position 4, page 15") in text  # the reason docs/transformers.md prints
    assert "fp8_e4m3 (token_head scales) pages take 12240 bytes per token (bf16: 23040)" in text
    assert "integrity failures: 1" in text and "now 40 free, 24 cached, 0 used" in text
    assert "drill: 5 of 5 other requests generated exactly the tokens of the fault-free run" \
        in text
    assert "req-1 aborted (page was reallocated" in err.getvalue()  # progress on stderr
    rows = json.loads(js.getvalue())
    assert json_status == 0 and [r["id"] for r in rows] == [f"req-{i}" for i in range(6)]
    assert all(set(r) == {"id", "status", "reason", "token_ids"} for r in rows)
    assert all(r["status"] == "finished" and len(r["token_ids"]) <= 3 for r in rows)
    smollm2[0].set_attn_implementation("sdpa")


@pytest.mark.model
def test_fp32_pages_reproduce_transformers_and_e4m3_token_head_stays_near_bf16(
        smollm2: tuple[Any, Any]) -> None:  # noqa: F811
    """docs/transformers.md, FP8 accuracy, on two 512-token windows of the same corpus (the
    doc's figures use nine of 1024): fp32 pages give transformers' perplexity; e4m3 with the
    default token_head scales (what build gives fp8 pages) is within 1% of bf16 pages; e5m2 is
    worse than e4m3 at the same granularity."""
    from kvmem.integrations.corpus import stdlib_docstrings

    model, tokenizer = smollm2
    ids = tokenizer(stdlib_docstrings()).input_ids[:1024]
    model.set_attn_implementation("sdpa")
    ref, n = hf_perplexity(model, ids, window=512)
    assert n == 1022
    ppl = {}
    for dtype in ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2"):
        lm = PagedCausalLM.build(model, 32, dtype)
        assert lm.pool.spec.scales == (None if dtype in ("fp32", "bf16") else "token_head")
        mgr = KVCacheManager(32, page_size=16, max_seqs=1, prefix_cache=None, pool=lm.pool)
        ppl[dtype], count = paged_perplexity(lm, mgr, ids, window=512, chunk_size=256)
        assert count == n
    assert abs(ppl["fp32"] / ref - 1) < 1e-4, (ppl, ref)
    assert abs(ppl["fp8_e4m3"] / ppl["bf16"] - 1) < 0.01, ppl
    assert ppl["fp8_e5m2"] > ppl["fp8_e4m3"], ppl
    model.set_attn_implementation("sdpa")
