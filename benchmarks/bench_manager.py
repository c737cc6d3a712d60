"""Manager benchmark: the decode-step trace and a shared-prompt admission trace. Prints JSON.

Decode-step trace (issue 2's): batch 256, page size 16, 2000 steps; every running request gains
one token per step; 1% of requests finish each step and are replaced by one with a
500..2000-token prompt (seeded, random tokens). Per step, as an engine does: ``release`` the
finished requests and ``admit`` + ``reserve`` + ``commit`` their replacements' prompts (one
prefill chunk each), then for the whole batch ``reserve(ids, 1)`` (with the CSR metadata),
``verify(ids, step)`` and ``commit_batch(ids, tokens)``. ``decode_step_us_median`` is that
decode part for the batch (the work vLLM's ``allocate_slots`` loop does per decode step), with
prefix reuse and CheckingTracker on (``..._noop``: NoOpTracker); ``step_total_us_median`` adds
the replacements; ``decode_{reserve,verify,commit}_us_median`` split the decode part.

Shared-prompt trace: 1000 requests sharing a 1024-token system prompt plus 256 own tokens each
(seeded), ~200 running. Per request: ``can_admit`` + ``admit`` (timed together:
``admit_us_median``), then prefill ``reserve`` + ``commit`` (``admit_prefill_us_median`` times
all four) and, later, ``release`` (not timed). Reports the prefix hit rate (cached prompt
tokens / prompt tokens).

If ``import vllm`` works (vLLM 0.33; on a CPU machine see ``setup_vllm_cpu.sh``), the same
traces run through vLLM's KVCacheManager in the same process: ``vllm_decode_step_us_median``
(append the sampled token + ``allocate_slots(req, 1)`` for the 256 requests),
``vllm_admit_us_median`` (``get_computed_blocks`` + ``allocate_slots`` for the prompt; vLLM hashes
the prompt's blocks earlier, in ``Request()``: ``vllm_admit_hash_us_median``, and
``vllm_admit_with_hash_us_median`` is the sum) and the ratios ``*_speedup_vs_vllm`` (vLLM's
median over kvmem's, CheckingTracker: above 1, kvmem is faster). Without vLLM that part is
skipped; if vLLM's internal API does not match, ``vllm_error`` says why.

The contenders of a trace (kvmem with CheckingTracker, kvmem with NoOpTracker, vLLM) run in
lockstep (``"lockstep": true``): all are built and warmed up (the decode trace's initial prompts
admitted) first, then each does its step i (decode trace) or request i (shared-prompt trace)
before any does step i + 1, the first of them rotating each step, so a change in the machine's
speed hits them all alike. ``paired_decode_speedup_vs_vllm`` is the median over steps of vLLM's
decode time over kvmem's (CheckingTracker) for the same step, ``paired_admit_speedup_vs_vllm``
the same per request for the admission.

Timings are wall-clock medians in microseconds on one core; ``load_average_1min`` says how busy
the machine was (other processes inflate every figure).

    python benchmarks/bench_manager.py [--steps 2000] [--batch 256] [--requests 1000]
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvmem.cli.args import Parser, number
from kvmem.manager import KVCacheManager

PAGE_SIZE = 16
clock = time.perf_counter


def decode_trace(seed: int, steps: int, batch: int
                 ) -> tuple[list[np.ndarray], list[tuple[np.ndarray, list[np.ndarray]]]]:
    """Initial prompts, then per step: finishing batch slots and their replacements' prompts."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, size=n).astype(np.int32)
               for n in rng.integers(500, 2001, size=batch)]
    out = []
    for _ in range(steps):
        done = rng.choice(batch, size=rng.binomial(batch, 0.01), replace=False)
        out.append((done, [rng.integers(0, 32000, size=n).astype(np.int32)
                           for n in rng.integers(500, 2001, size=done.size)]))
    return prompts, out


def shared_prompt_trace(seed: int, num_requests: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, size=1024).astype(np.int32)
    return system, [np.concatenate([system, rng.integers(0, 32000, size=256).astype(np.int32)])
                    for _ in range(num_requests)]


def lockstep(runners: list[Any], count: int,
             after: Callable[[int], None] | None = None) -> None:
    """Step i of every runner before step i + 1 of any, the first rotating, then ``after(i)``
    (untimed); at the end, ``finish``."""
    for i in range(count):
        k = i % len(runners)
        for runner in runners[k:] + runners[:k]:
            runner.step(i)
        if after is not None:
            after(i)
    for runner in runners:
        runner.finish()


class KvmemDecode:
    """kvmem on the decode trace; ``__init__`` builds it and admits the initial prompts.
    ``manager`` is the class (another commit's, for ``ab_manager.py``); ``last_step`` is the
    latest decode step's metadata."""

    def __init__(self, prompts: list[np.ndarray], steps: list, tracker: str | None,
                 num_pages: int, manager: type = KVCacheManager) -> None:
        batch = len(prompts)
        self.mgr = manager(num_pages=num_pages, page_size=PAGE_SIZE, max_seqs=batch,
                           max_pages_per_seq=512, prefix_cache="hashed", tracker=tracker)
        self.steps, self.ids, self.next_id = steps, list(range(batch)), batch
        for rid, prompt in zip(self.ids, prompts):
            self.start(rid, prompt)
        self.tokens = np.ones(batch, dtype=np.int32)
        self.times: dict[str, list[float]] = {
            k: [] for k in ("step", "decode", "replace", "reserve", "verify", "commit")}

    def start(self, rid: int, prompt: np.ndarray) -> None:
        res = self.mgr.admit(rid, prompt)
        self.mgr.reserve([rid], prompt.size - res.num_cached_tokens)
        self.mgr.commit(rid, prompt[res.num_cached_tokens:])

    def step(self, i: int) -> None:
        mgr, ids = self.mgr, self.ids
        done, new_prompts = self.steps[i]
        t0 = clock()
        for slot, prompt in zip(done.tolist(), new_prompts):
            mgr.release(ids[slot])
            ids[slot] = self.next_id
            self.start(self.next_id, prompt)
            self.next_id += 1
        t1 = clock()
        step = mgr.reserve(ids, 1)
        t2 = clock()
        report = mgr.verify(ids, step)
        t3 = clock()
        mgr.commit_batch(ids, self.tokens)
        t4 = clock()
        assert report.ok
        self.last_step = step
        for key, us in (("replace", t1 - t0), ("decode", t4 - t1), ("step", t4 - t0),
                        ("reserve", t2 - t1), ("verify", t3 - t2), ("commit", t4 - t3)):
            self.times[key].append(us * 1e6)

    def finish(self) -> None:
        self.mgr.check()


class KvmemShared:
    """kvmem on the shared-prompt trace, ~200 requests running; ``manager`` and ``last_step``
    (the latest prefill's metadata) as in ``KvmemDecode``."""

    def __init__(self, prompts: list[np.ndarray], tracker: str | None,
                 manager: type = KVCacheManager) -> None:
        self.mgr = manager(num_pages=256 * 96, page_size=PAGE_SIZE, max_seqs=256,
                           max_pages_per_seq=128, tracker=tracker)
        self.prompts, self.live = prompts, []
        self.admit_us: list[float] = []
        self.prefill_us: list[float] = []  # can_admit + admit + the prompt's reserve + commit

    def step(self, rid: int) -> None:
        mgr, prompt = self.mgr, self.prompts[rid]
        if len(self.live) == 200:  # keep ~200 running; the oldest finish
            mgr.release(self.live.pop(0))
        t0 = clock()
        ok = mgr.can_admit(prompt)  # an engine asks first, then admits
        res = mgr.admit(rid, prompt)
        t1 = clock()
        assert ok
        self.admit_us.append((t1 - t0) * 1e6)
        step = mgr.reserve([rid], prompt.size - res.num_cached_tokens)
        mgr.commit(rid, prompt[res.num_cached_tokens:])
        self.prefill_us.append((clock() - t0) * 1e6)
        self.last_step = step
        self.live.append(rid)

    def finish(self) -> None:
        self.mgr.check()
        self.hit_rate = self.mgr.stats().prefix_hit_rate


def vllm_api() -> Any:
    """vLLM 0.33's API, used as its scheduler does: prefix caching on, its default
    ``sha256`` block hash, ``get_computed_blocks`` + ``allocate_slots`` per admission and
    ``allocate_slots(req, 1)`` per running request and decode step."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(PAGE_SIZE, sha256)

    def make(num_blocks: int) -> Any:
        spec = FullAttentionSpec(block_size=PAGE_SIZE, num_kv_heads=1, head_size=64,
                                 dtype=torch.float16)
        page = spec.page_size_bytes
        tensor = KVCacheTensor(size=num_blocks * page, layers=["l0"],
                               layer_stride=num_blocks * page, block_stride=page)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor],
                            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        return VllmManager(cfg, max_model_len=512 * PAGE_SIZE, enable_caching=True,
                           scheduler_block_size=PAGE_SIZE, hash_block_size=PAGE_SIZE)

    def request(rid: int, prompt: np.ndarray, hashed: bool = True) -> Any:
        return Request(str(rid), prompt.tolist(), SamplingParams(max_tokens=10**6), None,
                       block_hasher=hasher if hashed else None)

    def start(mgr: Any, req: Any, hits: list[int]) -> float:
        """Admits ``req`` (timed); ``hits`` gains its cached and its prompt tokens."""
        t0 = clock()
        blocks, cached, _ = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - cached, cached, blocks) is not None
        t1 = clock()
        req.num_computed_tokens = req.num_tokens
        hits[0] += cached
        hits[1] += req.num_tokens
        return (t1 - t0) * 1e6

    return SimpleNamespace(make=make, request=request, start=start, hasher=hasher)


class VllmDecode:
    """vLLM on the decode trace: replacements (``free`` + admission) untimed, then the timed
    decode part."""

    def __init__(self, api: Any, prompts: list[np.ndarray], steps: list) -> None:
        self.api, self.steps, self.next_id = api, steps, len(prompts)
        self.mgr = api.make(len(prompts) * 200)
        self.reqs = [api.request(i, p) for i, p in enumerate(prompts)]
        for req in self.reqs:
            api.start(self.mgr, req, [0, 0])
        self.decode: list[float] = []

    def step(self, i: int) -> None:
        api, mgr, reqs = self.api, self.mgr, self.reqs
        done, new_prompts = self.steps[i]
        for slot, prompt in zip(done.tolist(), new_prompts):
            mgr.free(reqs[slot])
            reqs[slot] = api.request(self.next_id, prompt)
            self.next_id += 1
            api.start(mgr, reqs[slot], [0, 0])
        t0 = clock()
        for req in reqs:  # the sampled token (hashed when it fills a block), then its slot
            req.append_output_token_ids(1)
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        self.decode.append((clock() - t0) * 1e6)

    def finish(self) -> None:
        pass


class VllmShared:
    """vLLM on the shared-prompt trace: the prompt's block hashes and the admission, timed apart."""

    def __init__(self, api: Any, prompts: list[np.ndarray]) -> None:
        self.api, self.prompts, self.mgr = api, prompts, api.make(256 * 96)
        self.live: list[Any] = []
        self.hits = [0, 0]  # cached prompt tokens, prompt tokens
        self.admit: list[float] = []
        self.hashing: list[float] = []

    def step(self, rid: int) -> None:
        if len(self.live) == 200:
            self.mgr.free(self.live.pop(0))
        req = self.api.request(rid, self.prompts[rid], hashed=False)
        t0 = clock()  # the prompt's block hashes (vLLM computes them in Request())
        req.block_hashes.extend(self.api.hasher(req))
        self.hashing.append((clock() - t0) * 1e6)
        self.admit.append(self.api.start(self.mgr, req, self.hits))
        self.live.append(req)

    def finish(self) -> None:
        pass


class BestEffort:
    """A vLLM runner, best effort: vLLM's internal API moves between releases, so the first
    error building or stepping one (``error``, reported as ``vllm_error``) is kept instead of
    raised, and from then on the runner sits out."""

    def __init__(self, build: Callable[[], Any], error: str | None = None) -> None:
        self.runner: Any = None
        self.error = error
        self.runner = self._call(build)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.error is None:
            try:
                return fn(*args)
            except Exception as e:  # an internal API this harness does not know
                self.error = f"{type(e).__name__}: {e}"
        return None

    def step(self, i: int) -> None:
        self._call(lambda: self.runner.step(i))

    def finish(self) -> None:
        self._call(lambda: self.runner.finish())


def median(values: list[float]) -> float:
    return round(float(np.median(values)), 2)


def paired(theirs: list[float], ours: list[float]) -> float:
    """Median over steps of their time over ours for the same step (> 1: kvmem is faster)."""
    return round(float(np.median(np.asarray(theirs) / np.asarray(ours))), 2)


def vllm_imports() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # vLLM absent (or broken): no comparison
        return False
    return True


def main() -> None:
    parser = Parser(prog="bench_manager.py",
                    description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--steps", type=number(int, 1), default=2000)
    parser.add_argument("--batch", type=number(int, 1), default=256)
    parser.add_argument("--requests", type=number(int, 1), default=1000)
    parser.add_argument("--seed", type=number(int, 0), default=0)
    args = parser.parse_args()
    prompts, steps = decode_trace(args.seed, args.steps, args.batch)
    _system, shared = shared_prompt_trace(args.seed, args.requests)
    api = BestEffort(vllm_api) if vllm_imports() else None  # None: no vLLM, no comparison
    v_dec = v_sh = None

    # Enough pages for the running batch and a prefix cache that fills up and evicts.
    num_pages = args.batch * 200
    on = KvmemDecode(prompts, steps, "checking", num_pages)
    off = KvmemDecode(prompts, steps, None, num_pages)
    decoders: list[Any] = [on, off]
    if api is not None:
        v_dec = BestEffort(lambda: VllmDecode(api.runner, prompts, steps), api.error)
        decoders.append(v_dec)
    lockstep(decoders, len(steps))

    sp, sp_off = KvmemShared(shared, "checking"), KvmemShared(shared, None)
    admitters: list[Any] = [sp, sp_off]
    if v_dec is not None:
        v_sh = BestEffort(lambda: VllmShared(api.runner, shared), v_dec.error)
        admitters.append(v_sh)
    lockstep(admitters, len(shared))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, numpy {np.__version__}",
        "load_average_1min": load,
        "lockstep": True,
        "batch": args.batch,
        "steps": args.steps,
        "page_size": PAGE_SIZE,
        "decode_step_us_median": median(on.times["decode"]),
        "decode_step_us_median_noop": median(off.times["decode"]),
        "step_total_us_median": median(on.times["step"]),
        "step_total_us_median_noop": median(off.times["step"]),
        "decode_reserve_us_median": median(on.times["reserve"]),
        "decode_verify_us_median": median(on.times["verify"]),
        "decode_commit_us_median": median(on.times["commit"]),
        "replace_us_median": median(on.times["replace"]),
        "admit_us_median": median(sp.admit_us[1:]),
        "admit_us_median_noop": median(sp_off.admit_us[1:]),
        "admit_prefill_us_median": median(sp.prefill_us[1:]),
        "admit_prefill_us_median_noop": median(sp_off.prefill_us[1:]),
        "prefix_hit_rate": round(sp.hit_rate, 4),
        "issue_reference_vllm_decode_step_us": 2700,
        "issue_reference_vllm_admit_us": 145,
    }
    if v_sh is not None and v_sh.error is not None:
        result["vllm_error"] = v_sh.error
    elif v_sh is not None:  # ratios > 1: kvmem is faster
        vd, vs = v_dec.runner, v_sh.runner
        result.update({
            "vllm_decode_step_us_median": median(vd.decode),
            "vllm_admit_us_median": median(vs.admit[1:]),
            "vllm_admit_hash_us_median": median(vs.hashing[1:]),
            "vllm_admit_with_hash_us_median":
                median([a + h for a, h in zip(vs.admit[1:], vs.hashing[1:])]),
            "vllm_prefix_hit_rate": round(vs.hits[0] / vs.hits[1], 4)})
        for key, ours, theirs in (
                ("decode_speedup_vs_vllm", "decode_step_us_median", "vllm_decode_step_us_median"),
                ("admit_speedup_vs_vllm", "admit_us_median", "vllm_admit_us_median"),
                ("admit_prefill_speedup_vs_vllm", "admit_prefill_us_median",
                 "vllm_admit_with_hash_us_median")):
            result[key] = round(result[theirs] / result[ours], 2)
        result["paired_decode_speedup_vs_vllm"] = paired(vd.decode, on.times["decode"])
        result["paired_admit_speedup_vs_vllm"] = paired(vs.admit[1:], sp.admit_us[1:])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
