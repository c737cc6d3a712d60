"""KV codecs: formats, the fast fp8 decode, round-trip error, saturation and NaN/inf policy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvmem.errors import ArgumentError, ArgumentTypeError
from kvmem.quant import (
    FORMATS,
    FP8Codec,
    KVCodec,
    PlainCodec,
    _fp8,
    fp8_to_float,
    make_codec,
    page_format,
)

FP8 = [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _all_bytes(fmt: str) -> torch.Tensor:
    """Every byte value except e4m3fn's two NaN encodings (kvmem never writes them)."""
    b = torch.arange(256, dtype=torch.uint8)
    if fmt == "fp8_e4m3":
        b = b[(b & 0x7F) != 0x7F]
    return b


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values, NaN included (e5m2 has NaN and inf encodings)."""
    same = (a == b) | (a.isnan() & b.isnan())
    return a.dtype == b.dtype and a.shape == b.shape and bool(same.all())


def _rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- formats -------------------------------------------------------------------------------------


def test_format_table() -> None:
    assert set(FORMATS) == {"fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}
    e4m3 = page_format("fp8_e4m3")
    assert (e4m3.itemsize, e4m3.max_finite, e4m3.saturation_threshold) == (1, 448.0, 464.0)
    assert e4m3.storage_dtype == torch.uint8 and e4m3.quantized
    assert page_format("fp8_e5m2").saturation_threshold == 61440.0
    assert page_format("fp16").saturation_threshold == 65520.0
    assert page_format("bf16").storage_dtype == torch.bfloat16 and not page_format("bf16").quantized
    with pytest.raises(ArgumentError, match="fp8_e4m3"):
        page_format("int8")


# -- fast decode ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "dtype"), FP8)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_fp8_decode_matches_torch_cast_for_every_byte(
    fmt: str, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    b = _all_bytes(fmt)
    want = b.view(dtype).float().to(out_dtype)
    got = fp8_to_float(b.reshape(1, -1), fmt, out_dtype=out_dtype).reshape(-1)
    assert _same(got, want)


@pytest.mark.parametrize(("fmt", "dtype"), FP8)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_fp8_decode_with_scales_is_bit_identical_to_reference(
    fmt: str, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    b = _all_bytes(fmt)
    data = b[torch.randint(0, b.numel(), (40, 3, 64), generator=g)]
    scale = torch.rand(40, 3, 1, generator=g) * 3 + 0.01  # one per row
    want = (data.view(dtype).float() * scale).to(out_dtype)
    assert _same(fp8_to_float(data, fmt, scale, out_dtype), want)
    # one scale for everything, as a float and as a one-element tensor
    want1 = (data.view(dtype).float() * 0.37).to(out_dtype)
    assert _same(fp8_to_float(data, fmt, 0.37, out_dtype), want1)
    assert _same(fp8_to_float(data, fmt, torch.tensor([0.37]), out_dtype), want1)
    # a per-head scale broadcast over rows
    head = torch.tensor([[0.5], [2.0], [8.0]])
    want_h = (data.view(dtype).float() * head).to(out_dtype)
    assert _same(fp8_to_float(data, fmt, head, out_dtype), want_h)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run under 1 and 2 torch threads: the decode picks its chunking and integer path by it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("fmt", "dtype"), FP8)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_decode_many_chunks(
    fmt: str,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_fp8, "_CHUNK_ELEMS", 1000)  # many chunks, the last one short
    monkeypatch.setattr(_fp8, "_THREADED_CHUNK_ELEMS", 4096)
    b = _all_bytes(fmt)
    g = torch.Generator().manual_seed(1)
    data = b[torch.randint(0, b.numel(), (3001, 96), generator=g)]
    scale = torch.rand(3001, 1, generator=g)
    out = torch.empty(3001, 96, dtype=out_dtype)
    got = fp8_to_float(data, fmt, scale, out_dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert _same(got, (data.view(dtype).float() * scale).to(out_dtype))


def test_fp8_decode_accepts_float8_view_and_empty() -> None:
    x = torch.tensor([[1.0, -2.5, 448.0]]).to(torch.float8_e4m3fn)
    assert fp8_to_float(x, "fp8_e4m3", out_dtype=torch.float32).tolist() == [[1.0, -2.5, 448.0]]
    empty = torch.empty(0, 8, dtype=torch.uint8)
    assert fp8_to_float(empty, "fp8_e4m3").shape == (0, 8)


def test_fp8_decode_bad_input() -> None:
    data = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ArgumentError, match="fp8_e4m3 or fp8_e5m2"):
        fp8_to_float(data, "bf16")
    with pytest.raises(ArgumentTypeError, match="uint8"):
        fp8_to_float(data.float(), "fp8_e4m3")
    with pytest.raises(ArgumentError, match="contiguous"):
        fp8_to_float(data.t(), "fp8_e4m3")
    with pytest.raises(ArgumentError, match="out must be"):
        fp8_to_float(data, "fp8_e4m3", out=torch.empty(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ArgumentError, match="broadcast"):
        fp8_to_float(data, "fp8_e4m3", torch.ones(3, 1))


# -- codecs: round trips -------------------------------------------------------------------------


def _roundtrip(codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
    static = None
    shape = codec.static_scale_shape(x.shape[1], x.shape[2])
    if shape is not None:
        static = codec.calibrate(x, torch.zeros(shape))
    enc = codec.quantize(x.clone(), static)
    if enc.token_scales is not None:
        scale = enc.token_scales.unsqueeze(-1)
    elif static is not None:
        scale = static[None, :, :, None]
    else:
        scale = None
    return codec.dequantize(enc.data.contiguous(), scale, torch.float32)


@pytest.mark.parametrize(
    ("dtype", "scales", "bound", "half_ulp"),
    [
        ("fp8_e4m3", "tensor", 0.03, 2.0**-4),
        ("fp8_e4m3", "head", 0.03, 2.0**-4),
        ("fp8_e4m3", "token_head", 0.03, 2.0**-4),
        ("fp8_e5m2", "tensor", 0.06, 2.0**-3),
        ("fp8_e5m2", "token_head", 0.06, 2.0**-3),
        ("bf16", None, 0.002, 2.0**-8),
    ],
)
def test_roundtrip_error_per_element(
    dtype: str, scales: str | None, bound: float, half_ulp: float
) -> None:
    """RMS of per-element error relative to the data within the issue's bounds; every element
    within half an ulp of the format (relative), away from the subnormal range."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 2, 4, 64, generator=g) * torch.tensor([1.0, 3.0, 0.2, 10.0])[:, None]
    y = _roundtrip(make_codec(dtype, scales), x)  # type: ignore[arg-type]
    assert _rms_rel(y, x) <= bound
    normal = x.abs() > x.abs().amax() * 2.0**-6 / 16  # well inside every format's normal range
    rel = ((y - x).abs() / x.abs())[normal]
    assert float(rel.max()) <= half_ulp * (1 + 1e-6)


def test_fp16_and_fp32_pages_roundtrip() -> None:
    x = torch.randn(64, 2, 2, 32)
    assert torch.equal(_roundtrip(make_codec("fp32"), x), x)
    assert _rms_rel(_roundtrip(make_codec("fp16"), x), x) < 5e-4


# -- codecs: NaN/inf, saturation, scales ---------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "scales"),
    [
        ("fp8_e4m3", "token_head"),
        ("fp8_e5m2", "tensor"),
        ("bf16", None),
        ("fp16", None),
        ("fp32", None),
    ],
)
def test_nonfinite_inputs_are_counted_and_stored_as_zero(dtype: str, scales: str | None) -> None:
    codec = make_codec(dtype, scales)  # type: ignore[arg-type]
    x = torch.randn(8, 2, 2, 16)
    x[0, 0, 0, 0] = float("nan")
    x[3, 1, 1, 5] = float("inf")
    x[7, 0, 1, 2] = float("-inf")
    y = _roundtrip(codec, x)
    assert bool(torch.isfinite(y).all())
    assert y[0, 0, 0, 0] == 0 and y[3, 1, 1, 5] == 0 and y[7, 0, 1, 2] == 0
    static = None if codec.static_scale_shape(2, 2) is None else torch.zeros(2, 1)
    static = codec.calibrate(x, static)
    assert static is None or bool(torch.isfinite(static).all())  # NaN/inf ignored
    enc = codec.quantize(x.clone(), static)
    assert int(enc.num_nonfinite) == 3
    clean = codec.quantize(torch.randn(8, 2, 2, 16), static)
    assert int(clean.num_nonfinite) == 0


def test_static_scale_one_flags_values_beyond_448() -> None:
    codec = FP8Codec("fp8_e4m3", "tensor")
    one = torch.ones(2, 1)
    x = torch.randn(16, 2, 2, 8) * 50
    x[0, 0, 0, :3] = torch.tensor([500.0, -1000.0, 5000.0])
    enc = codec.quantize(x.clone(), one)
    assert int(enc.num_saturated) == 3
    decoded = fp8_to_float(enc.data.contiguous(), "fp8_e4m3", None, torch.float32)
    assert decoded[0, 0, 0, :3].tolist() == [448.0, -448.0, 448.0]  # clamped, never NaN

    quiet = torch.randn(16, 2, 2, 8) * 50
    quiet[0, 0, 0, 0] = 460.0  # beyond 448 but rounds there anyway: not a saturation
    assert int(codec.quantize(quiet, one).num_saturated) == 0


def test_fp16_pages_count_overflow() -> None:
    codec = PlainCodec("fp16")
    x = torch.zeros(2, 2, 1, 4)
    x[0, 0, 0, 0] = 1e6
    x[1, 1, 0, 3] = -7e4
    enc = codec.quantize(x.clone())
    assert int(enc.num_saturated) == 2
    assert enc.data[0, 0, 0, 0] == 65504 and enc.data[1, 1, 0, 3] == -65504
    assert int(codec.quantize(torch.randn(2, 2, 1, 4)).num_saturated) == 0
    from_bf16 = codec.quantize(x.bfloat16())  # bf16 cannot hold 65504: clamp must not round up
    assert int(from_bf16.num_saturated) == 2 and from_bf16.data[0, 0, 0, 0] == 65504


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_dynamic_scales_take_huge_inputs(dtype: str) -> None:
    x = torch.randn(32, 2, 2, 16) * 1e6
    for scales in ("tensor", "head", "token_head"):
        y = _roundtrip(make_codec(dtype, scales), x)  # type: ignore[arg-type]
        assert bool(torch.isfinite(y).all())
        assert _rms_rel(y, x) < 0.06


def test_token_head_scales_are_per_row_amax() -> None:
    codec = FP8Codec("fp8_e4m3", "token_head")
    x = torch.randn(5, 2, 3, 16)
    x[2, 1, 0] = 0.0
    enc = codec.quantize(x.clone())
    assert enc.token_scales is not None and enc.token_scales.shape == (5, 2, 3)
    want = x.abs().amax(-1) / 448.0
    want[2, 1, 0] = 1.0  # an all-zero row gets scale 1
    assert torch.equal(enc.token_scales, want)


def test_calibration_fills_only_unset_scales() -> None:
    codec = FP8Codec("fp8_e4m3", "head")
    x = torch.randn(10, 2, 3, 8)
    x[:, 1, 2] = 0.0  # V of head 2 is all zero: stays uncalibrated
    x[4, 0, 1, 3] = float("inf")  # not data: ignored by calibration
    preset = torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    scale = codec.calibrate(x, preset)
    assert scale is not None
    finite = x.clone()
    finite[4, 0, 1, 3] = 0.0
    amax = finite.abs().amax(dim=(0, 3))
    assert scale[0, 0] == 0.5  # given: kept
    assert scale[0, 1] == amax[0, 1] / 448.0
    assert scale[1, 2] == 0.0
    tensor = FP8Codec("fp8_e4m3", "tensor").calibrate(finite, torch.zeros(2, 1))
    assert tensor is not None and torch.equal(tensor[:, 0], amax.amax(dim=1) / 448.0)
    assert FP8Codec("fp8_e4m3", "token_head").calibrate(x, None) is None
    assert PlainCodec("bf16").calibrate(x, None) is None


def test_make_codec_choices_and_errors() -> None:
    assert isinstance(make_codec("bf16"), PlainCodec)
    fp8 = make_codec("fp8_e5m2")
    assert isinstance(fp8, FP8Codec) and fp8.granularity == "tensor"
    assert fp8.static_scale_shape(2, 8) == (2, 1)
    assert make_codec("fp8_e4m3", "head").static_scale_shape(2, 8) == (2, 8)
    token = make_codec("fp8_e4m3", "token_head")
    assert token.token_scales and token.static_scale_shape(2, 8) is None
    with pytest.raises(ArgumentError, match="fp8 pages only"):
        make_codec("bf16", "tensor")
    with pytest.raises(ArgumentError, match="granularity"):
        FP8Codec("fp8_e4m3", "channel")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="static_scale"):
        FP8Codec("fp8_e4m3", "tensor").quantize(torch.randn(2, 2, 1, 4))
