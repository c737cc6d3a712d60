"""A second newcomer's audit: error paths and promises test_newcomer_promises.py left open.

The integration tests run on a tiny random Llama (no weights); the CLI tests call
``kvmem.cli.main`` in process, as tests/test_cli.py does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvmem.cli import main
from kvmem.errors import ArgumentError, ArgumentTypeError, KVMemError, OutOfPagesError
from kvmem.simulate import LengthDist, Workload, simulate

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from model_fixtures import TINY_VOCAB  # noqa: E402

from kvmem.integrations.engine import Engine, Request  # noqa: E402
from kvmem.integrations.hf import (  # noqa: E402
    PagedCausalLM,
    hf_perplexity,
    paged_logits,
    paged_perplexity,
)
from kvmem.manager import KVCacheManager  # noqa: E402

VOCAB = TINY_VOCAB
SMALL_SIM = ["simulate", "llama-3.1-8b", "--gpu", "h100-80g", "--tp", "1", "--requests", "3",
             "--prompt-len", "10", "--output-len", "5", "--no-progress"]



def _paged(model: Any, num_pages: int = 16, **manager_kw: Any) -> tuple[Any, KVCacheManager]:
    lm = PagedCausalLM.build(model, num_pages, "fp32", page_size=4, device="cpu")
    return lm, KVCacheManager(num_pages, page_size=4, pool=lm.pool, **manager_kw)


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 2, (status, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- kvmem simulate: every bad number is one line, never a traceback or a hang ---------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--requests", "99999999999999999999", "num_requests"),  # was numpy's ValueError
        ("--chunk", "99999999999999999999", "chunk"),  # was an OverflowError
        ("--prefixes", "99999999999999999999", "num_prefixes"),  # numpy's ValueError
        ("--prefix-len", "99999999999999999999", "prefix_len"),  # an OverflowError
    ],
)
def test_simulate_refuses_counts_beyond_its_arrays_in_one_line(
    capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    extra = {"--prefixes": ["--prefix-len", "5"], "--prefix-len": ["--prefixes", "1"]}
    err = _one_line_error(capsys, [*SMALL_SIM, option, value, *extra.get(option, [])])
    assert err.startswith("kvmem simulate: error:") and message in err


def test_workload_refuses_more_requests_than_token_ids_can_name() -> None:
    # Request i's first token id is 100_000 + i, and token ids are int32.
    with pytest.raises(KVMemError, match="num_requests"):
        Workload(num_requests=2**31, concurrency=1, prompt_len=LengthDist.parse("10"),
                 output_len=LengthDist.parse("5"))


def test_a_slow_prefill_keeps_the_timeline_at_about_200_samples() -> None:
    # simulate()'s default sampling is "about 200 samples over the expected run"; it ignored
    # the prefill time, so a slow --prefill-tps ran for minutes appending millions of samples.
    w = Workload(num_requests=3, concurrency=3, prompt_len=LengthDist.parse("10"),
                 output_len=LengthDist.parse("5"))
    report = simulate(w, model="llama-3.1-8b", gpu="h100-80g", tp=1, prefill_tokens_per_s=0.3)
    assert report.simulated_seconds > 99  # 30 prompt tokens at 0.3 tokens/s
    assert 100 <= len(report.timeline) <= 400


# -- kvmem.integrations.hf ------------------------------------------------------------------


def test_perplexity_refuses_a_progress_it_cannot_call_before_any_work(tiny: Any) -> None:
    lm, mgr = _paged(tiny, prefix_cache=None)
    tokens = list(range(1, 30))
    with pytest.raises(ArgumentTypeError, match="progress"):
        hf_perplexity(tiny, tokens, 8, progress=5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="progress"):
        paged_perplexity(lm, mgr, tokens, 8, 4, progress="yes")  # type: ignore[arg-type]
    assert mgr.allocator.num_free == mgr.num_pages and not mgr.running
    assert lm.pool.stats().num_saturated == 0


def test_paged_logits_of_no_tokens_names_the_argument_not_an_internal_request(tiny: Any) -> None:
    lm, mgr = _paged(tiny, prefix_cache=None)
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


# -- kvmem.integrations.engine -------------------------------------------------------------


def test_stop_token_ids_that_checking_would_use_up_are_refused(tiny: Any) -> None:
    lm, mgr = _paged(tiny)
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
    lm, mgr = _paged(tiny, num_pages=8, prefix_cache=None)
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


# -- the examples ----------------------------------------------------------------------------


def _example(name: str) -> Any:
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parent.parent / "examples")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def test_perplexity_window_longer_than_the_text_sizes_the_pool_for_the_text(tiny: Any) -> None:
    # `perplexity.py --window 100000000` built a pool for the window, not for the text: the
    # pool refused the terabytes (a traceback after the model load).
    perplexity = _example("perplexity")
    ids = list(range(1, 21))
    whole = perplexity.measure(tiny, ids, "bf16", None, len(ids), 4)
    huge = perplexity.measure(tiny, ids, "bf16", None, 10**9, 4)
    assert huge["tokens"] == whole["tokens"] == 19
    assert huge["perplexity"] == whole["perplexity"]
    tiny.set_attn_implementation("sdpa")


@pytest.mark.model
def test_serve_example_makes_room_for_its_max_new_tokens() -> None:
    # `serve_smollm2.py --max-new-tokens 400` ran out of its fixed 64 pages mid-run (the
    # engine does not preempt), a traceback after the model load. The real tokenizer (chat
    # template), a tiny random Llama of its vocabulary for speed.
    from model_fixtures import _require_model_packages

    _require_model_packages()
    from transformers import AutoTokenizer

    from kvmem.integrations.hf import smollm2_gguf_path

    serve = _example("serve_smollm2")
    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                              local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = serve.serve(model, tokenizer, kv_dtype="bf16", max_new_tokens=400)
    assert {r.status for r in out["requests"]} == {"finished"}
    assert out["peak_pages"] > serve.NUM_PAGES  # the six at once needed more than 64 pages
    assert out["stats"].num_pages >= out["peak_pages"]
    assert serve.parse_args([]).max_new_tokens == 48
    with pytest.raises(SystemExit):
        serve.parse_args(["--max-new-tokens", str(serve.MAX_NEW_TOKENS + 1)])


# -- KVBatch: "slot_mapping [T], int64; qo_indptr, kv_indptr, kv_indices, kv_last_page_len int32"


@pytest.mark.parametrize("dtype", ["uint32", "uint16", "int64"])
def test_kvbatch_holds_its_documented_dtypes_whatever_integers_it_is_given(
        tiny: Any, dtype: str) -> None:
    # from_arrays took any integer arrays as they were; unsigned ones then failed inside the
    # forward (NotImplementedError: torch has no arithmetic on uint32).
    import numpy as np

    from kvmem.integrations.hf import KVBatch

    lm, mgr = _paged(tiny, prefix_cache=None)
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


def test_the_loops_size_in_the_transformers_doc_is_the_files() -> None:
    # docs/transformers.md said "It is about 200 lines" of a 549-line engine.py.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    said = re.search(r"It is about (\d+) lines", (root / "docs/transformers.md").read_text())
    assert said is not None
    lines = len((root / "kvmem/integrations/engine.py").read_text().splitlines())
    assert abs(lines - int(said.group(1))) <= 0.15 * lines, (said.group(0), lines)


def test_forward_refuses_a_batch_over_another_pool_and_writes_nowhere(tiny: Any) -> None:
    # It wrote layer 0 into the other pool, then failed at layer 1 ("layer=1: expected an
    # integer in 0..0"): a message about layers, and a pool changed by a refused call.
    from kvmem.cuda import PagePool, PoolSpec
    from kvmem.integrations.hf import KVBatch

    lm, _ = _paged(tiny, prefix_cache=None)
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
    lm, mgr = _paged(tiny, prefix_cache=None, watermark=0.1)  # 1 of 16 pages kept free
    engine = Engine(lm, mgr)
    big = Request("big", list(range(1, 62)), max_new_tokens=2)  # 16 pages: fits no watermark
    with pytest.raises(ArgumentError, match="watermark"):
        engine.run({0: [big]})
    assert not engine.waiting and not engine.running and big.status == "waiting"
    ok = Request("ok", list(range(1, 58)), max_new_tokens=2)  # 15 pages: admitted
    assert [r.status for r in engine.run({0: [ok]})] == ["finished"]


class _NotAPagedModel:
    pool = None  # no PagePool: Engine read lm.pool.spec (an AttributeError)

    def forward(self, *args: Any) -> None:
        raise AssertionError("never called")


def test_engine_refuses_a_model_whose_pool_is_no_page_pool() -> None:
    with pytest.raises(ArgumentTypeError, match="PagePool"):
        Engine(_NotAPagedModel(), KVCacheManager(16, page_size=4))  # type: ignore[arg-type]


def test_attention_metadata_beyond_int64_says_so_in_words() -> None:
    # The message read "kv_indices holds 9223372036854775808: too large for an value."
    import numpy as np

    from kvmem.attention import paged_attention
    from kvmem.cuda import PagePool, PoolSpec

    pool = PagePool(PoolSpec(num_layers=1, num_pages=4, page_size=4, attention="gqa",
                             num_kv_heads=1, head_dim=8, dtype="fp32", device="cpu"))
    with pytest.raises(ArgumentError, match="kv_indices holds 9223372036854775808, beyond int64"):
        paged_attention(torch.randn(1, 1, 8), [0, 1], pool, 0, [0, 1],
                        np.array([2**63], dtype=np.uint64), [1])


def test_arrivals_far_apart_skip_the_idle_steps_but_before_step_sees_every_step(
        tiny: Any) -> None:
    # run({10**12: [r]}) stepped through a trillion idle steps one by one (it never returned).
    lm, mgr = _paged(tiny)
    engine = Engine(lm, mgr)
    done = engine.run({10**12: [Request("far", [1, 2, 3], max_new_tokens=2)]})
    assert [r.request_id for r in done] == ["far"] and len(done[0].output_ids) == 2
    seen: list[int] = []  # with a before_step, every step is still called, idle ones too
    engine.run({3: [Request("near", [1, 2, 3], max_new_tokens=1)]},
               before_step=lambda s, e: seen.append(s))
    assert seen[:4] == [0, 1, 2, 3]
    mgr.check()
