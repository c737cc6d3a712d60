"""What a conformance stream is (:class:`StreamSpec`: a scheduler configuration and its
requests), what a run of one records (:class:`StreamStep`, :class:`StreamResult`), the synthetic
model's tokens (:func:`token_at`) and random streams (:func:`random_stream`). No vLLM needed."""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvmem._validate import INT32_MAX, choice, flag, integer, is_integer_like, real, show
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError

__all__ = [
    "SPEC_METHODS",
    "STOP_TOKEN",
    "VOCAB",
    "SchedulerSpec",
    "SpecMethod",
    "StreamRequest",
    "StreamResult",
    "StreamSpec",
    "StreamStep",
    "accepts_draft",
    "draft_at",
    "random_stream",
    "token_at",
]

STOP_TOKEN = 7
VOCAB = 997
MAX_MODEL_LEN = 1 << 20  # the synthetic model's max_position_embeddings
#: Speculative decoding as vLLM's scheduler sees it: n-gram (no lookahead slots, a varying
#: number of drafts), a draft model (as many lookahead slots as drafts), EAGLE (lookahead
#: slots, and a prefix hit drops its last block: vLLM's ``use_eagle``).
SpecMethod = Literal["ngram", "draft_model", "eagle"]
SPEC_METHODS: tuple[SpecMethod, ...] = ("ngram", "draft_model", "eagle")


def _check(spec: str, checks: list[Callable[[], object]]) -> None:
    """Run every field check of ``spec``; raise one error naming every bad field
    (``ArgumentTypeError`` if a field has the wrong type, else ``ConfigError``), as kvmem's
    specs do. A spec is checked when built, before vLLM sees it."""
    problems: list[str] = []
    wrong_type = False
    for check in checks:
        try:
            check()
        except ArgumentError as e:
            problems.append(str(e))
        except ArgumentTypeError as e:
            problems.append(str(e))
            wrong_type = True
    if problems:
        kind = ArgumentTypeError if wrong_type else ConfigError
        raise kind(f"invalid {spec}: {' '.join(problems)}")


def _at_least(value: Any, name: str, minimum: int, why: str) -> None:
    if is_integer_like(value) and 1 <= value < minimum:  # (below 1: the range check says it)
        raise ArgumentError(f"{name}={int(value)}: expected at least {minimum} ({why}).")


def _below_one(value: Any, name: str) -> None:
    real(value, name, minimum=0.0)
    if value >= 1.0:
        raise ArgumentError(f"{name}={float(value)!r}: expected a fraction in [0.0, 1.0).")


@dataclass(frozen=True)
class SchedulerSpec:
    """The scheduler's configuration (what a stream varies)."""

    num_blocks: int = 64
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 256
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    async_scheduling: bool = False
    kv_events: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    paranoid: bool = False  # kvmem: verify the workers' block tables (every entry) each step
    spec_method: SpecMethod | None = None  # speculative decoding
    num_spec_tokens: int = 0  # drafts per step (at least 1 with a spec_method)
    draft_acceptance: float = 0.7  # the synthetic verifier accepts a draft this often
    # The scheduler's encoder budget and cache, in tokens (0: none; requests with multimodal
    # inputs need one at least as long as their longest input)
    encoder_cache_size: int = 0
    max_loras: int = 0  # vLLM's lora_config.max_loras (0: no lora_config)
    # A KV connector (kvmem.integrations.vllm._connector_script.ScriptedConnector): what each
    # request finds outside the GPU cache is its StreamRequest's ``external``.
    connector: bool = False
    load_failure_policy: Literal["recompute", "fail"] = "recompute"  # vLLM's policy

    def __post_init__(self) -> None:
        _check("SchedulerSpec", [
            lambda: integer(self.num_blocks, "num_blocks", minimum=2, maximum=INT32_MAX),
            lambda: integer(self.block_size, "block_size", minimum=1, maximum=1 << 16),
            lambda: integer(self.max_num_seqs, "max_num_seqs", minimum=1, maximum=1 << 24),
            lambda: integer(self.max_num_batched_tokens, "max_num_batched_tokens", minimum=1),
            lambda: _at_least(self.max_num_batched_tokens, "max_num_batched_tokens",
                              self.max_num_seqs if is_integer_like(self.max_num_seqs) else 1,
                              "vLLM: at least max_num_seqs"),
            lambda: integer(self.max_model_len, "max_model_len", minimum=1,
                            maximum=MAX_MODEL_LEN),
            lambda: integer(self.long_prefill_token_threshold, "long_prefill_token_threshold",
                            minimum=0),
            self._check_threshold,
            lambda: _below_one(self.watermark, "watermark"),
            lambda: choice(self.policy, "policy", ("fcfs", "priority")),
            *(lambda name=name: flag(getattr(self, name), name) for name in (
                "enable_prefix_caching", "async_scheduling", "kv_events", "paranoid",
                "connector")),
            lambda: choice(self.load_failure_policy, "load_failure_policy",
                           ("recompute", "fail")),
            self._check_spec,
            lambda: real(self.draft_acceptance, "draft_acceptance", minimum=0.0, maximum=1.0),
            lambda: integer(self.encoder_cache_size, "encoder_cache_size", minimum=0),
            lambda: integer(self.max_loras, "max_loras", minimum=0, maximum=1 << 16),
        ])

    def _check_spec(self) -> None:
        if self.spec_method is None:
            integer(self.num_spec_tokens, "num_spec_tokens", minimum=0, maximum=0)
            return
        choice(self.spec_method, "spec_method", SPEC_METHODS)
        integer(self.num_spec_tokens, "num_spec_tokens", minimum=1, maximum=64)

    def _check_threshold(self) -> None:
        threshold, length = self.long_prefill_token_threshold, self.max_model_len
        if is_integer_like(threshold) and is_integer_like(length) and threshold > length >= 1:
            raise ArgumentError(f"long_prefill_token_threshold={int(threshold)}: expected at most "
                                f"max_model_len={int(length)} (vLLM's limit).")


@dataclass(frozen=True)
class StreamRequest:
    """One request: arrives before step ``arrival`` is scheduled, aborted before step
    ``abort_at`` (if given and it is still unfinished). ``lora``: the name of its LoRA adapter
    (path ``/loras/NAME``); ``mm``: its multimodal inputs, ``(identifier, offset, length)``
    each, sorted by offset, within the prompt and not overlapping."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0
    salt: str | None = None
    abort_at: int | None = None
    priority: int = 0
    lora: str | None = None
    mm: tuple[tuple[str, int, int], ...] = ()
    # With a connector (SchedulerSpec.connector): the prompt tokens it finds outside the GPU
    # cache, whether it loads them asynchronously, whether it keeps reading the request's
    # blocks after it finished (a delayed free), and the load's failure (None: it succeeds;
    # -1: the whole load; k: the load of the request's block k).
    external: int = 0
    load_async: bool = False
    delay_free: bool = False
    load_fails: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list):  # a replay typed by hand: the tuple it stands for
            object.__setattr__(self, "prompt", tuple(self.prompt))
        _check(f"StreamRequest {self.rid!r}", [
            lambda: _of_type(self.rid, "rid", str, "a str"),
            self._check_prompt,
            lambda: integer(self.max_tokens, "max_tokens", minimum=1),
            lambda: integer(self.arrival, "arrival", minimum=0),
            lambda: _of_type(self.salt, "salt", (str, type(None)), "None or a str"),
            self._check_abort_at,
            lambda: integer(self.priority, "priority"),
            lambda: _of_type(self.lora, "lora", (str, type(None)), "None or a str"),
            self._check_mm,
            lambda: integer(self.external, "external", minimum=0),
            lambda: flag(self.load_async, "load_async"),
            lambda: flag(self.delay_free, "delay_free"),
            lambda: None if self.load_fails is None else integer(
                self.load_fails, "load_fails", minimum=-1),
        ])

    def _check_mm(self) -> None:
        mm = self.mm
        if not isinstance(mm, tuple) or not all(
                isinstance(m, tuple) and len(m) == 3 and isinstance(m[0], str)
                and is_integer_like(m[1]) and is_integer_like(m[2]) for m in mm):
            raise ArgumentTypeError(f"mm={show(mm)}: expected a tuple of (identifier: str, "
                                    "offset: int, length: int).")
        end = 0
        for _, offset, length in mm:
            if offset < end or length < 1:
                raise ArgumentError(f"mm={show(mm)}: expected inputs of length >= 1, sorted by "
                                    "offset and not overlapping (as vLLM assumes).")
            end = offset + length
        if isinstance(self.prompt, tuple) and end > len(self.prompt):
            raise ArgumentError(f"mm={show(mm)}: an input ends past the prompt "
                                f"({len(self.prompt)} tokens).")

    def _check_abort_at(self) -> None:
        if self.abort_at is not None:  # an abort before the arrival would never happen
            integer(self.abort_at, "abort_at",
                    minimum=self.arrival if is_integer_like(self.arrival) else 0)

    def _check_prompt(self) -> None:
        prompt = self.prompt
        if not isinstance(prompt, tuple) or not all(map(is_integer_like, prompt)):
            raise ArgumentTypeError(f"prompt={show(prompt)}: expected a tuple of token ids "
                                    "(ints).")
        if not prompt or min(prompt) < 0 or max(prompt) > INT32_MAX:
            raise ArgumentError(f"prompt={show(prompt)}: expected at least one token id, each "
                                f"in 0..{INT32_MAX}.")


@dataclass(frozen=True)
class StreamSpec:
    """A stream: ``run_stream(StreamSpec(...))`` replays it exactly."""

    sched: SchedulerSpec
    requests: tuple[StreamRequest, ...]
    max_steps: int = 400
    seed: int = 0
    pipeline: int = 1  # steps scheduled before the oldest one's output is handed back

    def __post_init__(self) -> None:
        if isinstance(self.requests, list):
            object.__setattr__(self, "requests", tuple(self.requests))
        _check("StreamSpec", [
            lambda: _of_type(self.sched, "sched", SchedulerSpec, "a SchedulerSpec"),
            self._check_requests,
            lambda: integer(self.max_steps, "max_steps", minimum=1),
            lambda: integer(self.seed, "seed"),
            lambda: integer(self.pipeline, "pipeline", minimum=1),
        ])

    def _check_requests(self) -> None:
        reqs = self.requests
        if not isinstance(reqs, tuple) or not all(isinstance(r, StreamRequest) for r in reqs):
            raise ArgumentTypeError(f"requests={show(reqs)}: expected a tuple of StreamRequest.")
        rids = [r.rid for r in reqs]
        twice = sorted({rid for rid in rids if rids.count(rid) > 1})
        if twice:
            raise ArgumentError(f"requests: ids {twice} are given twice; a request id names one "
                                "request (vLLM refuses a duplicate)")
        if isinstance(self.sched, SchedulerSpec):
            scripted = [r.rid for r in reqs if r.external or r.delay_free
                        or r.load_fails is not None]
            if scripted and not self.sched.connector:
                raise ArgumentError(
                    f"requests {scripted[:4]}: external tokens, delayed frees or load "
                    "failures need a connector (SchedulerSpec(connector=True))")
            long = [r.rid for r in reqs if len(r.prompt) > self.sched.max_model_len]
            if long:
                raise ArgumentError(
                    f"requests {long[:4]}: a prompt longer than max_model_len="
                    f"{self.sched.max_model_len} (vLLM's engine refuses it before its scheduler)")
            budget = self.sched.encoder_cache_size
            wide = [r.rid for r in reqs if any(length > budget for _, _, length in r.mm)]
            if wide:
                raise ArgumentError(
                    f"requests {wide[:4]}: a multimodal input longer than encoder_cache_size="
                    f"{budget} (vLLM's scheduler would never schedule it)")


def _of_type(value: Any, name: str, kind: type | tuple[type, ...], want: str) -> None:
    if not isinstance(value, kind):
        raise ArgumentTypeError(f"{name}={show(value)}: expected {want}.")


@dataclass
class StreamStep:
    """What one step scheduled, in a form both managers must agree on."""

    new: list[tuple[str, int]]  # (request id, prefix-hit num_computed_tokens), in order
    cached: list[str]  # running or resumed requests, in order
    resumed: list[str]
    num_scheduled: dict[str, int]
    preempted: list[str]
    finished: list[str]
    sharing: list[tuple[str, int, int]]  # (request, position, first (req, pos) with its block)
    usage: float  # the scheduler's KV cache usage after the step was scheduled
    events: Counter[tuple[Any, ...]] = field(default_factory=Counter)
    # the running or resumed requests' num_computed_tokens as the step hands them to the
    # workers (after the previous step's rejected drafts were rolled back), in order
    computed: list[int] = field(default_factory=list)
    drafts: dict[str, int] = field(default_factory=dict)  # draft tokens scheduled per request
    waiting_for_kv: list[str] = field(default_factory=list)  # asynchronous loads in flight

    def key(self) -> tuple[Any, ...]:
        return (self.new, self.cached, self.resumed, sorted(self.num_scheduled.items()),
                self.preempted, self.finished, self.sharing, self.usage,
                sorted(self.events.items()), self.computed, sorted(self.drafts.items()),
                self.waiting_for_kv)


@dataclass
class StreamResult:
    steps: list[StreamStep]
    outputs: dict[str, tuple[int, ...]]  # every request's final output tokens
    finish: dict[str, str]  # finish reason per request
    step_us: list[float]  # schedule() + update_from_output() per step
    verify_failures: int = 0  # requests kvmem's integrity check aborted (kvmem only)
    table_mismatches: int = 0  # handed-out block ids that differ from kvmem's pages


def token_at(rid: str, position: int, seed: int = 0) -> int:
    """The synthetic model's sampled token for request ``rid`` at ``position`` (deterministic;
    the stop token about one time in 24)."""
    h = zlib.crc32(f"{seed}:{rid}:{position}".encode())
    return STOP_TOKEN if h % 24 == 0 else 10 + h % (VOCAB - 10)


def accepts_draft(rid: str, position: int, seed: int, acceptance: float) -> bool:
    """Whether the synthetic drafter guesses the synthetic model's token at ``position``
    (deterministic; true for about ``acceptance`` of the positions)."""
    h = zlib.crc32(f"draft:{seed}:{rid}:{position}".encode())
    return h % 1000 < acceptance * 1000


def draft_at(rid: str, position: int, seed: int, acceptance: float) -> int:
    """The synthetic drafter's token for ``position``: the model's (``token_at``) when
    :func:`accepts_draft`, another one otherwise (which the verifier rejects)."""
    token = token_at(rid, position, seed)
    if accepts_draft(rid, position, seed, acceptance):
        return token
    return 10 + (token - 10 + 1) % (VOCAB - 10)


def random_stream(rng: random.Random, *, max_requests: int = 10,
                  speculative: bool | None = None,
                  spec_methods: tuple[SpecMethod, ...] = SPEC_METHODS,
                  keys: bool | None = None, connector: bool = False) -> StreamSpec:
    """A stream that exercises prefix sharing at several depths, several salts, chunked
    prefill, aborts, (often) a pool small enough to preempt, (in 40% of the streams, or
    every one with ``speculative=True``, none with False) speculative decoding by one of
    ``spec_methods``: 1-4 or ``block_size + 1`` drafts a step, accepted at a random rate
    (0, 0.5, 0.8 or 1), and (in 30%, or every one with ``keys=True``, none with False or
    with a connector unless ``keys=True``) requests with LoRA adapters and images, which
    change block keys; and, with ``connector=True``, a KV connector instead of speculative
    decoding: half the requests find part or all of their prompt outside the GPU cache,
    loaded synchronously or asynchronously, some keep their blocks with the connector after
    they finish, some loads fail (under either of vLLM's policies). Same rng state, same
    stream. ``rng``: a ``random.Random``; ``max_requests``: at least 1."""
    if not isinstance(rng, random.Random):
        raise ArgumentTypeError(f"rng={show(rng)}: expected a random.Random (e.g. "
                                "random.Random(seed)).")
    integer(max_requests, "max_requests", minimum=1)
    if speculative is not None:
        flag(speculative, "speculative")
    if keys is not None:
        flag(keys, "keys")
    flag(connector, "connector")
    if (not isinstance(spec_methods, tuple) or not spec_methods
            or not set(spec_methods) <= set(SPEC_METHODS)):
        raise ArgumentError(f"spec_methods={show(spec_methods)}: expected a non-empty tuple of "
                            f"{SPEC_METHODS}.")
    block_size = rng.choice((2, 4, 8, 16))
    num_requests = rng.randint(1, max_requests)
    salts = [None, "tenant-a", "tenant-b"]
    roots = [tuple(rng.randrange(10, VOCAB) for _ in range(block_size * rng.randint(1, 5) + 3))
             for _ in range(rng.randint(1, 3))]
    priority = rng.random() < 0.2  # the priority policy preempts requests already scheduled
    requests = []
    arrival = 0
    longest = 1
    for i in range(num_requests):
        root = rng.choice(roots)
        depth = min(len(root), rng.choice((0, block_size - 1, block_size, block_size + 1,
                                           2 * block_size, len(root))))
        suffix = tuple(rng.randrange(10, VOCAB) for _ in range(rng.randint(0, 3 * block_size)))
        prompt = root[:depth] + suffix
        if not prompt:
            prompt = (rng.randrange(10, VOCAB),)
        max_tokens = rng.randint(1, 3 * block_size)
        arrival += rng.choice((0, 0, 1, 2, 5))
        abort_at = arrival + rng.randint(0, 30) if rng.random() < 0.15 else None
        salt = rng.choice(salts) if rng.random() < 0.5 else None
        requests.append(StreamRequest(f"r{i}", prompt, max_tokens, arrival, salt, abort_at,
                                    rng.randint(0, 3) if priority else 0))
        longest = max(longest, len(prompt) + max_tokens)
    # Every request must fit alone (vLLM reserves the whole sequence on admission); a tight
    # pool preempts.
    need = -(-longest // block_size) + 1
    num_blocks = need + rng.choice((0, 1, 2, 4, need, 4 * need))
    max_num_seqs = rng.choice((2, 4, 8, 16))
    sched = SchedulerSpec(
        num_blocks=min(num_blocks, 500), block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(rng.choice((8, 16, 32, 64, 256)), max_num_seqs),
        max_model_len=max(256, longest + block_size),
        enable_prefix_caching=rng.random() < 0.8,
        long_prefill_token_threshold=rng.choice((0, 0, 0, 5)),
        watermark=rng.choice((0.0, 0.0, 0.05)),
        async_scheduling=rng.random() < 0.25, policy="priority" if priority else "fcfs",
        paranoid=rng.random() < 0.3)
    # Steps in flight: an async engine schedules step t + 1 before step t's output is back
    # (placeholders, caching after the output); a sync one with pipeline parallelism too.
    pipeline = 2 if rng.random() < (0.6 if sched.async_scheduling else 0.1) else 1
    seed = rng.randrange(1 << 16)
    # Speculative decoding, drawn last: the draws above make the same streams as before.
    drawn = rng.random() < 0.4
    if drawn if speculative is None else speculative:
        method = rng.choice(spec_methods)
        k = rng.choice((1, 2, 3, 4, block_size + 1))
        # Drafts widen a decode step to 1 + k tokens: a request must still fit alone.
        need = -(-(longest + 2 * k + 2) // block_size) + 1
        sched = replace(sched, spec_method=method, num_spec_tokens=k,
                        draft_acceptance=rng.choice((0.0, 0.5, 0.8, 1.0)),
                        num_blocks=min(max(sched.num_blocks, need), 500),
                        max_model_len=max(sched.max_model_len, longest + 2 * k + block_size),
                        max_num_batched_tokens=max(sched.max_num_batched_tokens, 2 * (k + 1)))
        if not sched.async_scheduling:
            # A synchronous engine hands the drafts of a step over with its output: it never
            # has a step in flight when it asks the scheduler for the next one.
            pipeline = 1
    # LoRA adapters and images, drawn after everything above (which then makes the same
    # streams as before).
    if keys is None and connector:
        keys = False  # (a connector's streams draw no keys unless asked)
    if (rng.random() < 0.3) if keys is None else keys:
        requests, sched = _with_keys(rng, requests, sched)
    # A KV connector, drawn after everything above (the same streams as before otherwise).
    if connector:
        # (no drafts with a connector: vLLM's own scheduler trips on a synchronous load
        # that leaves a speculating request fewer tokens than its drafts)
        sched = replace(sched, connector=True, spec_method=None, num_spec_tokens=0,
                        load_failure_policy=rng.choice(("recompute", "fail")))
        scripted = []
        for r in requests:
            if rng.random() < 0.5:
                n = len(r.prompt)
                external = min(n, rng.choice((block_size, 2 * block_size, n - 1, n)))
                load_async = rng.random() < 0.5
                # (a synchronous load's failed blocks under "recompute": kvmem takes them out
                # of its prefix cache, vLLM keeps them cached; the streams differ by design,
                # tests/test_vllm_scheduler.py compares those runs)
                fails = ((None, None, None, -1, 0, 1)
                         if load_async or sched.load_failure_policy == "fail" else (None,))
                r = replace(r, external=max(external, 0), load_async=load_async,
                            delay_free=rng.random() < 0.3, load_fails=rng.choice(fails))
            scripted.append(r)
        requests = scripted
    return StreamSpec(sched, tuple(requests), max_steps=400, seed=seed, pipeline=pipeline)


def _with_keys(rng: random.Random, requests: list[StreamRequest], sched: SchedulerSpec
               ) -> tuple[list[StreamRequest], SchedulerSpec]:
    """The requests with LoRA adapters (two, or none) and images (three, each of one length,
    as vLLM requires of an identifier) drawn in, and a scheduler with an encoder budget and
    (sometimes) a LoRA limit. Prompts that start alike (one root) mostly get the root's
    images, so that they share them; the others get images of their own. KV events are off
    when there are images (kvmem refuses the two together)."""
    p = sched.block_size
    lengths = {f"img{k}": rng.randint(1, 2 * p + 1) for k in range(3)}

    def layout() -> list[tuple[str, int, int]]:
        mm, at = [], rng.choice((0, 1, p - 1, p))
        for ident in rng.sample(sorted(lengths), rng.choice((0, 1, 1, 2))):
            mm.append((ident, at, lengths[ident]))
            at += lengths[ident] + rng.choice((0, 1, p))
        return mm

    of_root: dict[int, list[tuple[str, int, int]]] = {}
    out = []
    for r in requests:
        lora = rng.choice((None, None, "x", "y"))
        drawn = (of_root.setdefault(r.prompt[0], layout()) if rng.random() < 0.7
                 else layout())
        mm = tuple(m for m in drawn if m[1] + m[2] <= len(r.prompt))
        out.append(replace(r, lora=lora, mm=mm))
    widest = max(lengths.values())
    return out, replace(sched, encoder_cache_size=2 * widest, max_loras=rng.choice((0, 1, 2)),
                        max_num_batched_tokens=max(sched.max_num_batched_tokens, widest),
                        kv_events=sched.kv_events and not any(r.mm for r in out))
