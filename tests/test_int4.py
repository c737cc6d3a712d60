"""The reference INT4 weight codec: layout, exactness, and the bytes the planner uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.planning import WeightFormat
from kvmem.quant.int4 import (
    Int4Weight,
    dequantize_int4,
    int4_bytes_per_param,
    pack_int4,
    quantize_int4,
    unpack_int4,
)


def test_bytes_per_param_at_group_32_and_128() -> None:
    assert int4_bytes_per_param(32) == 0.5625
    assert int4_bytes_per_param(128) == 0.515625
    assert int4_bytes_per_param(32, "float32") == 0.625
    assert int4_bytes_per_param(32, zero_point=True) == 0.5625 + 0.5 / 32


def test_planner_uses_the_codec_bytes() -> None:
    for group in (32, 64, 128):
        fmt = WeightFormat(kind="int4", group_size=group)
        assert fmt.bytes_per_param() == int4_bytes_per_param(group)


def test_pack_order_is_compressed_tensors() -> None:
    # Column 8j+i lands in bits 4i..4i+3 of word j, stored as value + 8.
    values = torch.arange(-8, 8, dtype=torch.int8).reshape(2, 8)
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert int(packed[0, 0]) == 0x76543210
    assert int(packed[1, 0]) & 0xFFFFFFFF == 0xFEDCBA98
    assert int(pack_int4(torch.full((1, 8), 7, dtype=torch.int8))[0, 0]) == -1


def test_every_value_and_every_word_roundtrips() -> None:
    values = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # [3, 64]
    assert torch.equal(unpack_int4(pack_int4(values)), values)
    words = torch.tensor([[0, -1, 2**31 - 1, -(2**31), 0x12345678, -0x789ABCDF]], dtype=torch.int32)
    assert torch.equal(pack_int4(unpack_int4(words)), words)


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), words=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_exact(rows: int, words: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (rows, words * 8), generator=gen, dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.shape == (rows, words)
    assert torch.equal(unpack_int4(packed), values)


def test_quantize_shapes_dtypes_and_bytes() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q = quantize_int4(w, group_size=32)
    assert isinstance(q, Int4Weight)
    assert q.packed.shape == (64, 32) and q.packed.dtype == torch.int32
    assert q.scales.shape == (64, 8) and q.scales.dtype == torch.bfloat16
    assert q.nbytes == w.numel() * int4_bytes_per_param(32)


def test_representable_weights_roundtrip_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(-7, 8, (16, 64), generator=gen).to(torch.float32)
    values[:, ::32] = 7.0  # every group reaches +7 so its scale is exactly the one below
    scales = torch.tensor([0.5, 0.25], dtype=torch.float32).repeat(16, 1)  # bf16-exact
    w = (values.reshape(16, 2, 32) * scales.unsqueeze(-1)).reshape(16, 64)
    q = quantize_int4(w, group_size=32)
    assert torch.equal(dequantize_int4(q), w)


def test_quantization_error_is_at_most_half_a_step() -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) * 3
    q = quantize_int4(w, group_size=32)
    err = (dequantize_int4(q) - w).abs().reshape(32, 4, 32)
    step = q.scales.to(torch.float32).unsqueeze(-1)
    assert bool((err <= step / 2 + 1e-6).all())
    assert float(err.max()) > 0  # it is lossy, and the check above could fail


def test_all_zero_group_stays_zero() -> None:
    w = torch.zeros(2, 32)
    assert torch.equal(dequantize_int4(quantize_int4(w)), w)


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ArgumentError, match="multiple of 8"):
        int4_bytes_per_param(30)
    with pytest.raises(ArgumentError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    with pytest.raises(ArgumentError, match="divisible by 8"):
        pack_int4(torch.zeros(1, 7, dtype=torch.int8))
    with pytest.raises(ArgumentTypeError, match="integer"):
        pack_int4(torch.zeros(1, 8))
    with pytest.raises(ArgumentError, match="NaN"):
        quantize_int4(torch.tensor([[float("nan")] * 32]))
    with pytest.raises(ArgumentError, match="multiple of group_size"):
        quantize_int4(torch.zeros(1, 48), group_size=32)
    with pytest.raises(ArgumentError, match="scale dtype"):
        int4_bytes_per_param(32, "int8")
