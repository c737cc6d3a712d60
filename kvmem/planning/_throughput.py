"""A decode throughput model, fitted to measurements and used to predict other points.

One decode step of ``c`` sequences of ``L`` tokens takes::

    t_step = t0 + bytes_read(c, L) / (bandwidth * efficiency)

``bytes_read`` is what one GPU reads (:func:`decode_bytes_per_step`: dense weights, the routed
experts the batch activates, every sequence's KV); ``t0`` is the part that does not scale with
bytes (kernel launches, TP all-reduces, sampling); ``efficiency`` the fraction of peak bandwidth
achieved. Throughput is ``c / t_step`` tokens/s. For a given ``L`` both unknowns enter linearly,
so measured ``(concurrency, tokens/s)`` points give them by least squares. When the context of
the measurement is not known, ``L`` is fitted too (the one whose linear fit leaves the smallest
relative error): the curvature of throughput against concurrency tells KV reads (linear in ``c``)
from expert reads (saturating in ``c``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmem._specs import NonNegativeReal, PositiveInt, PositiveReal, SpecModel
from kvmem._validate import integer, real, show
from kvmem.errors import ArgumentTypeError, ConfigError
from kvmem.planning._plan import CapacityPlan, decode_bytes_per_step

__all__ = ["ThroughputModel", "fit_throughput"]


class ThroughputModel(SpecModel):
    """``t_step = t0_s + bytes_read / (bandwidth * efficiency)`` at ``context_len`` tokens."""

    t0_s: NonNegativeReal
    efficiency: PositiveReal
    context_len: PositiveInt
    rms_relative_error: NonNegativeReal = 0.0

    def step_seconds(
        self, plan: CapacityPlan, concurrency: int, context_len: int | None = None
    ) -> float:
        """Seconds of one decode step of ``concurrency`` sequences (the fitted context unless
        one is given)."""
        if context_len is None:
            context_len = self.context_len
        nbytes = decode_bytes_per_step(plan, concurrency, context_len)
        return self.t0_s + nbytes / (plan.gpu_bandwidth_gbs * 1e9 * self.efficiency)

    def tokens_per_s(
        self, plan: CapacityPlan, concurrency: int, context_len: int | None = None
    ) -> float:
        """Predicted decode tokens/s of one replica (the fitted context unless one is given)."""
        return concurrency / self.step_seconds(plan, concurrency, context_len)


def _fit_at(
    plan: CapacityPlan, points: Sequence[tuple[int, float]], context_len: int
) -> ThroughputModel:
    xs = [
        decode_bytes_per_step(plan, c, context_len) / (plan.gpu_bandwidth_gbs * 1e9)
        for c, _ in points
    ]
    ys = [c / tok_s for c, tok_s in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) * (x - mx) for x in xs)  # `** 2` raises OverflowError, `*` gives inf
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0
    t0 = my - slope * mx
    if t0 < 0 or slope <= 0:  # refit through t0 = 0
        t0 = max(t0, 0.0)
        slope = sum(x * (y - t0) for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if slope <= 0:
        raise ConfigError(
            f"measurements {list(points)} do not slow down with bytes read; cannot fit a "
            "bandwidth model to them."
        )
    rel = [(t0 + slope * x) / y - 1.0 for x, y in zip(xs, ys, strict=True)]
    rms = math.sqrt(sum(r * r for r in rel) / n)
    if not all(map(math.isfinite, (t0, slope, rms))):
        raise ConfigError(
            f"measurements {list(points)} at context {context_len} give no finite fit: their "
            "step times or bytes read are beyond a float; check the units (concurrency in "
            "requests, decode tokens/s of one replica)."
        )
    return ThroughputModel(
        t0_s=t0, efficiency=1.0 / slope, context_len=context_len, rms_relative_error=rms
    )


def fit_throughput(
    plan: CapacityPlan, points: Sequence[tuple[int, float]], context_len: int | None = None
) -> ThroughputModel:
    """Fit ``t0`` and ``efficiency`` (and, if not given, the context) to measured points.

    Parameters
    ----------
    plan : CapacityPlan
        The configuration the points were measured on (its weights and KV dtype decide the bytes).
    points : sequence of (int, float)
        ``(concurrency, decode tokens/s)`` at two or more concurrencies (three or more to fit the
        context as well).
    context_len : int, optional
        Tokens of context per sequence during the measurement; fitted over 256 .. 262144 when
        omitted.

    Returns
    -------
    ThroughputModel
    """
    if not isinstance(plan, CapacityPlan):
        raise ArgumentTypeError(f"plan={show(plan)}: expected a CapacityPlan.")
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence):
        raise ArgumentTypeError(
            f"points={show(points)}: expected a sequence of (concurrency, tokens/s) pairs."
        )
    checked = []
    for i, point in enumerate(points):
        if not isinstance(point, (tuple, list)) or len(point) != 2:
            raise ArgumentTypeError(
                f"points[{i}]={show(point)}: expected a (concurrency, tokens/s) pair."
            )
        checked.append(
            (
                integer(point[0], f"points[{i}] concurrency", minimum=1),
                real(point[1], f"points[{i}] tokens/s", minimum=0, exclusive_minimum=True),
            )
        )
    points = checked
    if context_len is not None:
        context_len = integer(context_len, "context_len", minimum=1)
    if len({c for c, _ in points}) < 2:
        raise ConfigError(
            f"fitting needs measurements at two or more concurrencies; got {list(points)}."
        )
    for concurrency, tok_s in points:
        if concurrency <= 0 or tok_s <= 0:
            raise ConfigError(
                f"measurements need positive concurrency and tokens/s; got {(concurrency, tok_s)}."
            )
    if context_len is not None:
        return _fit_at(plan, points, context_len)
    if len({c for c, _ in points}) < 3:
        raise ConfigError(
            "fitting the context as well needs three or more concurrencies; pass context_len."
        )
    grid = [int(256 * 2 ** (i / 4)) for i in range(41)]  # 256 .. 262144, 4 steps per doubling
    fits = [_fit_at(plan, points, ctx) for ctx in grid]
    return min(fits, key=lambda m: m.rms_relative_error)
