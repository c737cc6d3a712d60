"""The menagerie of bad arguments the contract tests draw from (hypothesis strategies), and the
contract they check: a call succeeds, or raises a KVMemError of the right kind with nothing
changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvmem import ArgumentError, ArgumentTypeError, KVMemError

# Kept small enough for CI (a clean 2-core machine): the menagerie is drawn afresh each run.
SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


NOT_INTEGERS = st.one_of(
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.sampled_from([np.bool_(True), np.float32(1.0), np.float64(2.0), b"1", 1j]),
)


SCALARS = st.one_of(
    NOT_INTEGERS,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(
        [np.int64(-1), np.int64(2**40), np.uint64(2**63 + 5), np.int8(3), np.int32(-2**31)]
    ),
    st.sampled_from([None, object(), {}, (), [], ...]),
)


TENSORS = st.sampled_from(
    [
        torch.zeros(3),
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(2, 2, dtype=torch.int64),
        torch.tensor([-1, 0]),
        torch.tensor([0, 2**40]),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(3, 2, 8),
        torch.zeros(3, 2, 8, dtype=torch.float64),
        torch.zeros(3, 2, 8, dtype=torch.int32),
        torch.zeros(1, 1, 1, 1),
    ]
)


ARRAYS = st.sampled_from(
    [
        np.array([1.5]),
        np.array([True, False]),
        np.array([[0, 1]]),
        np.array([-1]),
        np.array([2**63 + 5], dtype=np.uint64),
        np.array(["a"]),
        np.zeros(0),
    ]
)


LISTS = st.lists(SCALARS, max_size=4)


BAD = st.one_of(SCALARS, TENSORS, ARRAYS, LISTS)


def contracted(fn: Callable[[], Any], snapshot: Callable[[], Any] | None = None) -> Any:
    """Run ``fn``: it succeeds, or raises a KVMemError of the right kind with nothing changed.

    Returns the exception (None on success).
    """
    before = snapshot() if snapshot else None
    try:
        fn()
    except KVMemError as exc:
        if isinstance(exc, (ArgumentError, ArgumentTypeError)):
            assert isinstance(exc, (ValueError, TypeError))
        assert str(exc), "an error says what was asked, found and expected"
        if snapshot is not None:
            assert_same(before, snapshot())
        return exc
    return None


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def is_not_integer(value: Any) -> bool:
    """Values the contract refuses wherever an integer is expected."""
    return isinstance(value, (bool, np.bool_, float, np.floating, str, bytes, complex))
