"""What ``kvmem simulate`` runs: a :class:`Workload` of requests with lengths drawn from
:class:`LengthDist`, and :class:`Arrivals`, the requests it makes (importable from
:mod:`kvmem.simulate`)."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from kvmem._specs import NonNegativeInt, NonNegativeReal, PositiveInt, PositiveReal, SpecModel
from kvmem._validate import INT32_MAX, show
from kvmem.errors import ArgumentTypeError, ConfigError

__all__ = ["Arrivals", "LengthDist", "Workload"]

# The most requests a Workload holds: each one's first token id is 100_000 + its index.
MAX_REQUESTS = INT32_MAX - 100_000


class LengthDist(SpecModel):
    """A token-length distribution: ``fixed`` (``a``), ``uniform`` on ``[a, b]``, or
    ``lognormal`` with median ``a`` and log-sigma ``b`` (clipped to ``[1, max_len]``).

    Fixed and uniform lengths are token counts: whole numbers up to ``max_len``, never
    truncated or clipped (a fixed length takes no ``b``)."""

    kind: Literal["fixed", "uniform", "lognormal"] = "uniform"
    a: PositiveReal
    b: NonNegativeReal = 0.0
    max_len: PositiveInt = 1 << 20

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.kind == "lognormal":
            return self
        counts = {"a": self.a} if self.kind == "fixed" else {"a": self.a, "b": self.b}
        for name, value in counts.items():
            if value != int(value) or value > self.max_len:
                raise ConfigError(
                    f"a {self.kind} length's {name}={value:.15g} is not a token count in "
                    f"1..{self.max_len:,} (max_len); give a whole number of tokens up to max_len "
                    "(LengthDist(max_len=...) raises it)."
                )
        if self.kind == "fixed" and self.b:
            raise ConfigError(
                f"a fixed length takes only a (the length); got b={self.b:g} as well. Use "
                "kind='uniform' for a range."
            )
        if self.kind == "uniform" and self.b < self.a:
            raise ConfigError(f"a uniform length needs b >= a; got [{self.a}, {self.b}].")
        return self

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``"512"``, ``"10000-18000"`` or ``"lognormal:1000,0.6"``."""
        if not isinstance(text, str):
            raise ArgumentTypeError(f"text={show(text)}: expected a str such as '10000-18000'.")
        t = text.strip().lower()
        try:
            if t.startswith("lognormal:"):
                median, sigma = t.split(":", 1)[1].split(",")
                return cls(kind="lognormal", a=float(median), b=float(sigma))
            if "-" in t:
                lo, hi = t.split("-", 1)
                return cls(kind="uniform", a=int(lo), b=int(hi))  # token counts: integers
            return cls(kind="fixed", a=int(t))
        except ValueError as exc:
            why = f" ({exc})" if isinstance(exc, ConfigError) else ""
            raise ConfigError(
                f"cannot read the length {text!r}{why}; use N, LO-HI or lognormal:MEDIAN,SIGMA."
            ) from exc

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b + 1, n)
        else:
            x = rng.lognormal(math.log(self.a), self.b, n)
        return np.clip(np.floor(x), 1, self.max_len).astype(np.int64)

    def high(self) -> float:
        """A length no sample exceeds (lognormal: the clip, or median * e^(5 sigma))."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return self.b
        if 5 * self.b >= math.log(self.max_len / self.a):  # also where exp() would overflow
            return self.max_len
        return self.a * math.exp(5 * self.b)


class Workload(SpecModel):
    """Who asks for what.

    Arrivals are either closed-loop (``concurrency`` clients, each sending its next request when
    the previous one finishes) or open-loop Poisson at ``rate`` requests/s. ``prompt_len``
    includes the shared prefix: a fraction ``prefix_fraction`` of requests starts with one of
    ``num_prefixes`` shared prefixes of ``prefix_len`` tokens (chosen uniformly).
    """

    num_requests: PositiveInt = Field(le=MAX_REQUESTS)
    concurrency: PositiveInt | None = None
    rate: PositiveReal | None = None
    prompt_len: LengthDist
    output_len: LengthDist
    num_prefixes: NonNegativeInt = 0
    prefix_len: NonNegativeInt = 0
    prefix_fraction: NonNegativeReal = Field(default=1.0, le=1)
    namespaces: PositiveInt = 1
    seed: NonNegativeInt = 0

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if (self.concurrency is None) == (self.rate is None):
            raise ConfigError(
                "a workload needs exactly one of concurrency (closed loop) or rate (Poisson)."
            )
        if self.num_prefixes and not self.prefix_len:
            raise ConfigError("num_prefixes > 0 needs prefix_len > 0.")
        if self.num_prefixes > self.num_requests:  # each prefix is built up front
            raise ConfigError(
                f"num_prefixes={self.num_prefixes} exceeds num_requests={self.num_requests}: "
                "no more prefixes can be used than there are requests; give at most "
                "num_requests.")
        if self.prefix_len >= self.prompt_len.max_len:
            raise ConfigError(
                f"prefix_len={self.prefix_len}: a prompt holds its prefix and at least one "
                f"token of its own, at most {self.prompt_len.max_len:,} tokens "
                "(prompt_len.max_len); give a shorter prefix.")
        if not self.num_prefixes and (self.prefix_len or self.prefix_fraction != 1.0):
            raise ConfigError("prefix_len and prefix_fraction describe shared prefixes, and "
                              "num_prefixes is 0: set num_prefixes, or leave them unset.")
        return self


_M = 100_000  # token ids of the simulated prompts are below 2 * _M (+ the request count)


class Arrivals:
    """Request lengths and token ids, generated lazily in blocks (a million prompts of
    thousands of tokens would not fit in memory)."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.rng = np.random.default_rng(w.seed)
        self.prompt = w.prompt_len.sample(self.rng, w.num_requests)
        self.output = w.output_len.sample(self.rng, w.num_requests)
        self.prefix_id = np.full(w.num_requests, -1, dtype=np.int64)
        if w.num_prefixes:
            use = self.rng.random(w.num_requests) < w.prefix_fraction
            self.prefix_id[use] = self.rng.integers(0, w.num_prefixes, int(use.sum()))
            self.prompt[use] = np.maximum(self.prompt[use], w.prefix_len + 1)
        self.namespace = self.rng.integers(0, w.namespaces, w.num_requests)
        if w.rate is not None:
            with np.errstate(over="ignore"):  # a rate near 0: the simulation's clock refuses inf
                self.times = np.cumsum(self.rng.exponential(1.0 / w.rate, w.num_requests))
        else:
            self.times = np.zeros(w.num_requests)
        prefix_rng = np.random.default_rng(w.seed + 1)
        self.prefixes = [
            prefix_rng.integers(0, 100_000, w.prefix_len).astype(np.int64)
            for _ in range(w.num_prefixes)
        ]
        # Request i's own tokens are (7919 j + i) mod M, j = 0, 1, ...: since 7919 is invertible
        # mod M, that is the sequence (7919 j) mod M read from j = i / 7919 mod M, so every
        # request's tokens are one slice of this table (see tokens()).
        longest = int(self.prompt.max()) if w.num_requests else 0
        self._own = (np.arange(_M + longest, dtype=np.int64) * 7919) % _M
        self._start = (np.arange(w.num_requests, dtype=np.int64) * pow(7919, -1, _M)) % _M
        self._prompt_list = self.prompt.tolist()
        self._prefix_list = self.prefix_id.tolist()

    def tokens(self, i: int) -> npt.NDArray[np.int64]:
        """Request ``i``'s prompt: its prefix, then tokens no other request shares (the first
        one encodes ``i``), so the only prefix hits are the intended ones: the own tokens are
        ``(7919 j + i) % 100_000`` for ``j = 0, 1, ...``, the first one ``100_000 + i``."""
        n = self._prompt_list[i]
        p = self._prefix_list[i]
        out = np.empty(n, dtype=np.int64)
        h = self.prefixes[p].size if p >= 0 else 0
        if h:
            out[:h] = self.prefixes[p]
        start = int(self._start[i])
        out[h:] = self._own[start : start + n - h]
        out[h] = 100_000 + i  # unique per request
        return out
