"""The real SmolLM2-135M model on kvmem's pages (marker: model)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from model_fixtures import model_threads, rounded_kv_logits, smollm2  # noqa: F401 (fixtures)

pytestmark = pytest.mark.model


SYSTEM = (
    "You are a helpful assistant for a team of software engineers. Answer precisely, give a "
    "short example when it helps, and say so when you are not sure."
)


QUESTIONS = (
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "What does a compiler do?",
)


ARRIVALS = (0, 0, 5, 9, 14)  # staggered: request i joins before engine step ARRIVALS[i]


# The bf16-vs-fp32 agreement set: QUESTIONS plus these eleven, fixed before any bf16 result on
# them was seen (no prompt is ever swapped for a better-agreeing one).
MORE_QUESTIONS = (
    "How does garbage collection work in Java?",
    "What is a race condition, and how can it be avoided?",
    "Explain the difference between TCP and UDP.",
    "What is recursion? Give an example.",
    "How do I reverse a string in Python?",
    "What is version control used for?",
    "Describe how photosynthesis works.",
    "What are the benefits of unit testing?",
    "Explain what an API is.",
    "Why is the sky blue?",
    "What is the difference between RAM and a hard drive?",
)


AGREEMENT_ARRIVALS = (*ARRIVALS, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58)


NEW_TOKENS = 64


NUM_PAGES = 96


def _chat(tokenizer: Any, question: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def prompts(smollm2: tuple[Any, Any]) -> list[list[int]]:  # noqa: F811
    return [_chat(smollm2[1], q) for q in QUESTIONS]


def _last_page_held_alone(mgr: Any, request_id: Any) -> int:
    """Position, in the request's row, of its last page that no one else maps."""
    alone = mgr.allocator.refcounts[mgr.pages_of(request_id)] == 1
    assert alone.any(), f"request {request_id!r} holds no page alone"
    return int(alone.nonzero()[0][-1])


def _run(
    model: Any,
    prompts: list[list[int]],
    kv_dtype: str,
    *,
    drill_step: int | None = None,
    abort_step: int | None = None,
    victim: int = 1,
    new_tokens: int = NEW_TOKENS,
    arrival_steps: tuple[int, ...] = ARRIVALS,
) -> tuple[list[Any], Any, dict[str, int]]:
    """One continuous batch of every prompt with staggered arrivals (greedy, stop at EOS):
    prompt i joins before engine step ``arrival_steps[i]``.

    ``drill_step``: just before that step, free the last page ``victim`` holds alone behind the
    manager's back (``kvmem.testing.faults``). ``abort_step``: abort ``victim`` cleanly at that
    step instead (``Engine.abort``, which takes effect where the check's aborts do): the
    fault-free run a drill is compared with.
    """
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager
    from kvmem.testing import faults

    lm = PagedCausalLM.build(model, NUM_PAGES, kv_dtype)
    mgr = KVCacheManager(NUM_PAGES, page_size=16, max_seqs=8, pool=lm.pool, tracker="checking")
    # Small budgets so prompts prefill in several chunks packed with other requests' decodes.
    engine = Engine(lm, mgr, max_num_batched_tokens=48, chunk_size=24)
    eos = (model.generation_config.eos_token_id,)
    reqs = [Request(i, p, max_new_tokens=new_tokens, stop_token_ids=eos)
            for i, p in enumerate(prompts)]
    arrivals: dict[int, list[Any]] = {}
    assert len(arrival_steps) == len(reqs)
    for r, s in zip(reqs, arrival_steps):
        arrivals.setdefault(s, []).append(r)
    drilled: dict[str, int] = {}

    def before_step(step: int, eng: Engine) -> None:
        if step == drill_step:
            position = _last_page_held_alone(mgr, victim)
            drilled["page"] = faults.free_behind_back(mgr, victim, position)
            drilled["step"] = step
        if step == abort_step:
            eng.abort(victim, "aborted cleanly (the drill's fault-free reference)")
            drilled["step"] = step

    engine.run(arrivals, before_step)
    return reqs, mgr, drilled


@pytest.fixture(scope="module")
def agreement_prompts(smollm2: tuple[Any, Any], prompts: list[list[int]]) -> list[list[int]]:  # noqa: F811
    """QUESTIONS then MORE_QUESTIONS: the fixed 16-prompt set."""
    return [*prompts, *(_chat(smollm2[1], q) for q in MORE_QUESTIONS)]


@pytest.fixture(scope="module")
def fp32_run(
    smollm2: tuple[Any, Any], agreement_prompts: list[list[int]]  # noqa: F811
) -> tuple[list[Any], Any]:
    """The 16 prompts as one continuous batch on fp32 pages (the first five are QUESTIONS,
    arriving at ARRIVALS); 8 run at once, the rest wait for a free slot."""
    reqs, mgr, _ = _run(smollm2[0], agreement_prompts, "fp32", arrival_steps=AGREEMENT_ARRIVALS)
    return reqs, mgr


@pytest.fixture(scope="module")
def bf16_run(smollm2: tuple[Any, Any], agreement_prompts: list[list[int]]) -> list[Any]:  # noqa: F811
    """The same batch as ``fp32_run`` (same arrivals and budgets) on bf16 pages."""
    return _run(smollm2[0], agreement_prompts, "bf16", arrival_steps=AGREEMENT_ARRIVALS)[0]


def test_fp32_pages_teacher_forced_logits_equal_transformers(smollm2: tuple[Any, Any]) -> None:  # noqa: F811
    """Packed, chunked prefill of three prompts: every position's logits equal HF's own."""
    from kvmem.integrations.hf import KVBatch, PagedCausalLM
    from kvmem.manager import KVCacheManager

    model, tok = smollm2
    texts = [
        "The capital of France is Paris. The capital of Italy is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:",
        "Once upon a time, in a land far away, there lived a dragon who collected old maps "
        "of rivers that no longer existed, and every night it",
    ]
    ids = [tok(t).input_ids for t in texts]
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        want = [model(torch.tensor([i])).logits[0].float() for i in ids]

    lm = PagedCausalLM.build(model, 16, "fp32")
    mgr = KVCacheManager(16, page_size=16, max_seqs=4, pool=lm.pool, prefix_cache=None)
    for b, i in enumerate(ids):
        mgr.admit(b, i)
    got: list[list[torch.Tensor]] = [[] for _ in ids]
    done = [0] * len(ids)
    chunks = (5, 11, 7)  # different chunk sizes per request: steps mix short and long rows
    while any(d < len(i) for d, i in zip(done, ids)):
        batch = [b for b in range(len(ids)) if done[b] < len(ids[b])]
        n = [min(chunks[b], len(ids[b]) - done[b]) for b in batch]
        step = mgr.reserve(batch, n)
        kv = KVBatch.from_arrays(lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr,
                                 step.kv_indices, step.kv_last_page_len)
        feed = [t for b, k in zip(batch, n) for t in ids[b][done[b] : done[b] + k]]
        logits = lm.forward(torch.tensor(feed), kv)
        for j, (b, k) in enumerate(zip(batch, n)):
            got[b].append(logits[int(step.qo_indptr[j]) : int(step.qo_indptr[j + 1])])
            mgr.commit(b, ids[b][done[b] : done[b] + k])
            done[b] += k
    for b in range(len(ids)):
        diff = (torch.cat(got[b]) - want[b]).abs().max().item()
        assert diff <= 1e-3, (b, diff)


def test_fp32_pages_greedy_equals_generate(
    smollm2: tuple[Any, Any],  # noqa: F811
    prompts: list[list[int]],
    fp32_run: tuple[list[Any], Any],
) -> None:
    """The five QUESTIONS' continuations in the 16-request batch equal transformers' own."""
    model, _ = smollm2
    reqs, mgr = fp32_run
    model.set_attn_implementation("sdpa")
    assert all(r.status == "finished" for r in reqs)
    for r, p in zip(reqs, prompts):
        with torch.inference_mode():
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
        want = out[0, len(p):].tolist()
        assert r.output_ids == want, (r.request_id, r.output_ids, want)
    # The set is chosen so that most answers run the full 64 tokens.
    assert sum(len(r.output_ids) == NEW_TOKENS for r in reqs[: len(prompts)]) >= 3
    # Later arrivals reused the system prompt's pages instead of recomputing them.
    assert [r.num_cached_tokens > 0 for r in reqs] == [False, False] + [True] * (len(reqs) - 2)
    stats = mgr.stats()
    assert stats.num_used == 0 and stats.num_integrity_failures == 0
    mgr.check()


def test_bf16_pages_equal_transformers_with_bf16_rounded_kv(
    smollm2: tuple[Any, Any],  # noqa: F811
    prompts: list[list[int]],
    fp32_run: tuple[list[Any], Any],
) -> None:
    """bf16 pages add no error beyond storing K/V in bf16: teacher-forced logits equal HF's
    sdpa forward with its K/V rounded to bf16 (same 24-token chunks), while they differ from
    fp32 pages by far more. Attention math in bf16, a truncating cast or a second rounding
    would each show here (measured: bit-identical; bf16 vs fp32 pages up to 0.38)."""
    from kvmem.integrations.hf import PagedCausalLM, paged_logits
    from kvmem.manager import KVCacheManager

    model = smollm2[0]
    ids = [*prompts[3], *fp32_run[0][3].output_ids]
    got = {}
    for dtype in ("bf16", "fp32"):
        lm = PagedCausalLM.build(model, 16, dtype)
        mgr = KVCacheManager(16, page_size=16, max_seqs=1, pool=lm.pool, prefix_cache=None)
        got[dtype] = paged_logits(lm, mgr, ids, chunk_size=24)
    want = rounded_kv_logits(model, ids, chunk_size=24)
    assert (got["bf16"] - want).abs().max().item() <= 1e-3
    assert (got["bf16"] - got["fp32"]).abs().max().item() >= 0.05  # the check has teeth


def test_bf16_pages_agree_with_fp32_pages(
    smollm2: tuple[Any, Any],  # noqa: F811
    agreement_prompts: list[list[int]],
    fp32_run: tuple[list[Any], Any],
    bf16_run: list[Any],
) -> None:
    """bf16 pages against fp32 pages over the fixed 16-prompt set (docs/transformers.md,
    "bf16 pages vs fp32 pages"), by criteria that the order of fp32 sums cannot move.

    Teacher forced: each fp32 continuation is fed through bf16 pages and through fp32 pages
    (all 16 packed in one forward each); at every position the bf16 argmax must be the fp32
    run's token on at least 95% of the 1024 positions (measured 1017-1018, 99.3-99.4%: one
    near-tie does not change the rest of the text, so the count moves by a token or two).

    Free running (each run generates on its own, tokens compared position by position): no
    percentage, which near-ties decide (93.5% or 84.5% with two threads on two machines, 89.9%
    with one). Every
    answer must equal the fp32 one up to a divergence at a near-tie: at the shared prefix,
    fp32's logits for its own token and for bf16's token (a plain transformers forward) are
    less than ``2 * delta`` apart, where ``delta`` is the largest change bf16 storage makes to
    any logit (the teacher-forced bf16 and fp32 logits above, every position of every
    sequence: measured 0.177). Each of the two logits moves by at most ``delta``, so only such
    a tie can flip; a divergence between tokens further apart would mean the bf16 path read
    something else than rounded K/V (a wrong page, slot or position). The divergences seen
    are 0.0002-0.024 apart, against 2 * 0.177.
    """
    from kvmem.integrations.hf import KVBatch, PagedCausalLM
    from kvmem.manager import KVCacheManager

    model = smollm2[0]
    prompts, ref = agreement_prompts, fp32_run[0]
    assert all(r.status == "finished" for r in [*ref, *bf16_run])

    # Teacher forced, through bf16 pages and fp32 pages alike.
    seqs = [[*p, *f.output_ids] for p, f in zip(prompts, ref)]
    # Logits only where a continuation token is predicted: row len(p) - 1 + j predicts token j.
    logits = {}
    for dtype in ("bf16", "fp32"):
        num_pages = sum(-(-len(s) // 16) for s in seqs) + 16
        lm = PagedCausalLM.build(model, num_pages, dtype)
        mgr = KVCacheManager(num_pages, page_size=16, max_seqs=len(seqs), pool=lm.pool,
                             prefix_cache=None)
        for i, s in enumerate(seqs):
            mgr.admit(i, s)
        step = mgr.reserve(list(range(len(seqs))), [len(s) for s in seqs])
        kv = KVBatch.from_arrays(lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr,
                                 step.kv_indices, step.kv_last_page_len)
        rows = [int(step.qo_indptr[i]) + len(p) - 1 + j
                for i, (p, f) in enumerate(zip(prompts, ref)) for j in range(len(f.output_ids))]
        logits[dtype] = lm.forward(torch.tensor([t for s in seqs for t in s]), kv,
                                   torch.tensor(rows))
    want = torch.tensor([t for f in ref for t in f.output_ids])
    same = int((logits["bf16"].argmax(-1) == want).sum())
    assert same / want.numel() >= 0.95, (same, want.numel())
    delta = (logits["bf16"] - logits["fp32"]).abs().max().item()
    assert 0.01 < delta < 0.5, delta  # bf16 storage moves logits, by well under a unit

    # Free running: every divergence at a near-tie of fp32's own logits.
    model.set_attn_implementation("sdpa")
    for p, f, b in zip(prompts, ref, bf16_run):
        split = next((i for i, (x, y) in enumerate(zip(f.output_ids, b.output_ids)) if x != y),
                     None)
        if split is None:  # the same tokens as far as both go; a run may only stop early at EOS
            shorter = min(len(f.output_ids), len(b.output_ids))
            assert f.output_ids[:shorter] == b.output_ids[:shorter]
            continue
        with torch.inference_mode():
            row = model(torch.tensor([[*p, *f.output_ids[:split]]])).logits[0, -1].float()
        gap = (row[f.output_ids[split]] - row[b.output_ids[split]]).item()
        assert gap < 2 * delta, (f.request_id, split, gap, delta)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_integrity_drill_aborts_only_the_victim_in_every_page_dtype(
    smollm2: tuple[Any, Any],  # noqa: F811
    prompts: list[list[int]],
    kv_dtype: str,
) -> None:
    """A page of request 1 is freed behind the manager's back as request 4 arrives and takes
    it: verification aborts request 1 alone, and every other request, the thief included,
    generates exactly the tokens of the fault-free run, in every page dtype.

    The fault-free run aborts request 1 cleanly at the same step (``Engine.abort``), so both
    runs execute the same batches. Compared with a run where request 1 kept going, other
    requests could differ at a near-tie: their logits depend in the last bits on the other
    rows of the batch (the model's matmuls choose kernels by the batch's shape), and fp8
    rounding turns a last-bit difference of K/V into a whole fp8 step (seen with fp8_e4m3: a
    bystander parted at its 17th token; docs/transformers.md, "the drill").
    """
    drill_step = ARRIVALS[-1]
    model = smollm2[0]
    reqs, mgr, drilled = _run(model, prompts, kv_dtype, drill_step=drill_step, victim=1,
                              new_tokens=32)
    clean, clean_mgr, _ = _run(model, prompts, kv_dtype, abort_step=drill_step, victim=1,
                               new_tokens=32)
    assert drilled["step"] == drill_step
    assert reqs[1].status == "aborted" and clean[1].status == "aborted"
    assert "tag changed" in (reqs[1].abort_reason or "")
    assert f"page {drilled['page']}" in (reqs[1].abort_reason or "")
    assert reqs[1].output_ids == clean[1].output_ids  # aborted at the same point
    for r, c in zip(reqs, clean):
        if r.request_id != 1:
            assert r.status == c.status == "finished", r.request_id
            assert r.output_ids == c.output_ids, (kv_dtype, r.request_id)
    assert sum(len(r.output_ids) for r in reqs) > 4 * 16  # the comparison has tokens to compare
    stats = mgr.stats()
    assert stats.num_integrity_failures == 1 and clean_mgr.stats().num_integrity_failures == 0
    assert stats.num_used == 0
    assert stats.num_free + stats.num_cached == stats.num_pages  # no page leaked
    mgr.check()


def test_drill_without_checking_goes_unnoticed(
    smollm2: tuple[Any, Any],  # noqa: F811
    prompts: list[list[int]],
) -> None:
    """The same fault with the NoOp tracker: nothing is aborted; the victim keeps reading a
    page that now holds the thief's keys (the bug the check exists for)."""
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager
    from kvmem.testing import faults

    lm = PagedCausalLM.build(smollm2[0], NUM_PAGES, "fp32")
    # No prefix cache: its reference on full pages would keep the freed page from the thief.
    mgr = KVCacheManager(NUM_PAGES, page_size=16, max_seqs=8, pool=lm.pool, prefix_cache=None)
    engine = Engine(lm, mgr, max_num_batched_tokens=48, chunk_size=24)
    victim = Request("victim", prompts[0], max_new_tokens=8)
    thief = Request("thief", prompts[1], max_new_tokens=8)
    engine.add_request(victim)
    while victim.num_computed < len(victim.prompt_ids):
        engine.step()
    # Page 2 of the victim (prompt tokens 32..47) is full: the victim never writes it again,
    # so the two requests never write the same slot in one step.
    page = faults.free_behind_back(mgr, "victim", 2)
    engine.add_request(thief)
    engine.step()
    assert mgr.pages_of("thief").tolist()[0] == page  # the thief's prompt went into it
    assert mgr.pages_of("victim").tolist()[2] == page  # and the victim still reads it
    assert victim.status == "running" and mgr.stats().num_integrity_failures == 0
