"""The KV codecs: fp8 and int4 quantization, scales and their limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from adversarial import (  # the shared menagerie of bad arguments
    BAD,
    SETTINGS,
    contracted,
    is_not_integer,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from pool_fixtures import SMALL_GQA, small_pool

from kvmem.cuda import PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.planning import (
    WeightFormat,
)
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
from kvmem.quant.int4 import (
    Int4Weight,
    dequantize_int4,
    int4_bytes_per_param,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

_FP8_NAN_BYTES = {"fp8_e4m3": (0x7F, 0xFF), "fp8_e5m2": (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)}


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


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run under 1 and 2 torch threads: the decode picks its chunking and integer path by it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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


@SETTINGS
@given(bad=BAD, which=st.integers(0, 8))
def test_codecs_and_fp8_decode(bad: Any, which: int) -> None:
    x = torch.randn(3, 2, 2, 8)
    data = torch.zeros(3, 8, dtype=torch.uint8)
    codec = make_codec("fp8_e4m3", "head")
    plain = make_codec("bf16")
    scale = torch.ones(2, 2)
    calls = [
        lambda: make_codec(bad),
        lambda: make_codec("fp8_e4m3", bad),
        lambda: page_format(bad),
        lambda: codec.quantize(bad, scale),
        lambda: codec.quantize(x.clone(), bad),
        lambda: codec.calibrate(bad, scale),
        lambda: plain.dequantize(bad, None, torch.float32),
        lambda: fp8_to_float(data, "fp8_e4m3", bad),
        lambda: fp8_to_float(data, "fp8_e4m3", None, bad),
    ]
    contracted(calls[which])
    contracted(lambda: fp8_to_float(bad, "fp8_e4m3"))
    contracted(lambda: fp8_to_float(data, bad))
    contracted(lambda: fp8_to_float(data, "fp8_e5m2", out=bad))


@SETTINGS
@given(bad=BAD)
def test_int4(bad: Any) -> None:
    w = torch.randn(4, 32)
    q = quantize_int4(w)
    for call in (
        lambda: int4_bytes_per_param(bad),
        lambda: int4_bytes_per_param(32, bad),
        lambda: int4_bytes_per_param(32, "bf16", bad),
        lambda: pack_int4(bad),
        lambda: unpack_int4(bad),
        lambda: quantize_int4(bad),
        lambda: quantize_int4(w, bad),
        lambda: quantize_int4(w, 32, bad),
        lambda: dequantize_int4(bad),
        lambda: dequantize_int4(q, bad),
        lambda: dequantize_int4(Int4Weight(q.packed, q.scales, (4, 32), bad)),
        lambda: dequantize_int4(Int4Weight(q.packed, bad, (4, 32), 32)),
    ):
        exc = contracted(call)
        del exc
    if is_not_integer(bad):
        with pytest.raises(ArgumentTypeError, match="group_size"):
            int4_bytes_per_param(bad)


@pytest.mark.parametrize("scale", [1e39, -1e39, 1e-50, float("nan")])
def test_static_scales_a_float32_cannot_hold_are_refused(scale: float) -> None:
    """The pool stores static scales as float32. 1e39 passed the spec's "finite and > 0" check
    in float64 and became inf (every read then returned 0 * inf = NaN); 1e-50 became 0 (every
    read returned 0)."""
    with pytest.raises(ArgumentError, match="static_scales must be finite and > 0"):
        PoolSpec(**SMALL_GQA, dtype="fp8_e4m3", static_scales=scale)
    with pytest.raises(ArgumentError, match="static_scales must be finite and > 0"):
        PoolSpec(**SMALL_GQA, dtype="fp8_e4m3", scales="head", static_scales=[[[1.0, scale]] * 2])


def test_static_scales_at_the_float32_limits_read_back_finite() -> None:
    for scale in (3e38, 1e-44):
        pool = small_pool(dtype="fp8_e4m3", static_scales=scale)
        assert pool.static_scales is not None and bool((pool.static_scales > 0).all())
        assert bool(torch.isfinite(pool.static_scales).all())
        k = torch.randn(2, 2, 8)
        pool.write(0, [0, 1], k, k)
        keys, values = pool.read(0, [0], torch.float32)
        assert bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("big", [2e36, 3e38])
def test_fp8_decode_is_bit_identical_to_torch_for_scales_up_to_float32_max(
    fmt: str, big: float
) -> None:
    """docs/data_types.md: the fast decode is bit-identical to
    ``(data.view(fp8).float() * scale).to(out_dtype)`` for every byte but e4m3fn's NaNs. The
    e4m3 trick multiplies the scale by 256 first: above 1.3e36 that overflowed to inf and a
    zero byte decoded as NaN (0 * inf)."""
    from kvmem.quant import fp8_to_float, page_format

    fp8 = page_format(fmt).dtype
    data = torch.arange(256, dtype=torch.uint8)
    if fmt == "fp8_e4m3":
        data = data[(data & 0x7F) != 0x7F]
    data = data.reshape(1, -1)
    for scale in (big, torch.tensor([[big]]), torch.tensor([[big]] * 1)):
        for out_dtype in (torch.float32, torch.bfloat16):
            got = fp8_to_float(data, fmt, scale, out_dtype)
            s = scale if isinstance(scale, float) else scale.float()
            want = (data.view(fp8).float() * s).to(out_dtype)
            same = (got == want) | (got.isnan() & want.isnan())
            assert bool(same.all()), (scale, out_dtype)
            assert not bool(got[0, 0].isnan())  # byte 0 is +0: it decodes to 0
    rows = torch.tensor([[1.0], [big]])  # one row's multiplier overflows, the other's does not
    two = torch.stack([data[0], data[0]])
    got = fp8_to_float(two, fmt, rows, torch.float32)
    want = two.view(fp8).float() * rows
    assert bool(((got == want) | (got.isnan() & want.isnan())).all())


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_token_whose_scale_underflows_is_stored_without_nan(dtype: str) -> None:
    """A (token, head) row of fp32 values below ~6e-43 has ``amax / max_finite`` == 0 in fp32:
    the row was divided by 0 and its zeros (0 / 0) were stored as fp8 NaN bytes, with scale 0.
    e5m2 pages then read back NaN, silently. Such a row gets scale 1, as an all-zero row does."""
    pool = small_pool(dtype=dtype, scales="token_head")
    k = torch.zeros(2, 2, 8)
    k[0, 0, :3] = torch.tensor([1e-44, -3e-44, 0.0])  # head 0 of token 0: a tiny row
    k[1] = torch.randn(2, 8)  # an ordinary token beside it
    pool.write(0, [0, 1], k, k.clone())
    stored = pool.data[0, 0].flatten().tolist()
    assert not set(stored) & set(_FP8_NAN_BYTES[dtype])
    assert pool.token_scales is not None
    scales = pool.token_scales[0, 0]
    assert bool((scales > 0).all()) and bool(torch.isfinite(scales).all())
    keys, values = pool.read(0, [0], torch.float32)
    assert bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())
    assert torch.allclose(keys[0, 1], k[1], rtol=0.13, atol=1e-3)  # the neighbour is intact
    assert pool.num_nonfinite == 0


def test_token_head_scales_are_amax_over_max_finite_or_one() -> None:
    """The codec's rule, at the edge: amax / 448 where that is > 0, else 1."""
    from kvmem.quant import FP8Codec

    x = torch.zeros(3, 1, 1, 4)
    x[0, 0, 0, 0] = 1e-44  # amax / 448 underflows
    x[1, 0, 0, 0] = 1e-30  # tiny, but its scale is a normal fp32
    enc = FP8Codec("fp8_e4m3", "token_head").quantize(x.clone())
    assert enc.token_scales is not None
    assert enc.token_scales.flatten().tolist() == [1.0, float(torch.tensor(1e-30) / 448), 1.0]
    assert not set(enc.data.flatten().tolist()) & {0x7F, 0xFF}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_a_static_scale_that_is_not_finite_and_non_negative_is_refused(
    bad: float, granularity: str
) -> None:
    """``static_scale``: the layer's fixed scales, 0 = not calibrated. A NaN or negative scale was
    silently used as 1 (the bytes decode to garbage with the scale the caller keeps), an inf one
    stored every value as 0 (and 0 * inf decodes as NaN)."""
    from kvmem.quant import FP8Codec

    codec = FP8Codec("fp8_e4m3", granularity)  # type: ignore[arg-type]
    x = torch.randn(3, 2, 2, 8)
    scale = torch.full((2, 1 if granularity == "tensor" else 2), 0.01)
    scale[1, 0] = bad
    with pytest.raises(ArgumentError, match="finite and >= 0"):
        codec.quantize(x.clone(), scale)
    with pytest.raises(ArgumentError, match="finite and >= 0"):
        codec.calibrate(x, scale)
    scale[1, 0] = 0.0  # "not calibrated yet" is a value, not an error
    assert codec.quantize(x.clone(), scale).data.shape == x.shape


def test_calibrate_checks_the_static_scale_shape_as_quantize_does() -> None:
    """calibrate([T, C, H, D], [5, 5]) raised torch's RuntimeError from a broadcast."""
    from kvmem.quant import FP8Codec

    x = torch.randn(3, 2, 2, 8)
    for granularity in ("tensor", "head"):
        codec = FP8Codec("fp8_e4m3", granularity)  # type: ignore[arg-type]
        for shape in [(5, 5), (2, 3), (2,), (1, 2, 1)]:
            with pytest.raises(ArgumentError, match=r"must be \[C, 1\] \(tensor\) or \[C, H\]"):
                codec.calibrate(x, torch.zeros(shape))


@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head"])
def test_codecs_take_no_tokens_and_refuse_rows_of_no_elements(granularity: str) -> None:
    """calibrate of an empty write raised IndexError (an amax over no tokens): it has nothing
    to calibrate from, so every scale stays as given. Rows of D = 0 elements raised IndexError
    too; they are refused by name."""
    from kvmem.quant import FP8Codec

    codec = FP8Codec("fp8_e4m3", granularity)  # type: ignore[arg-type]
    shape = codec.static_scale_shape(2, 2)
    static = None if shape is None else torch.tensor([[0.5, 0.0][: shape[1]], [0.0] * shape[1]])
    empty = torch.randn(0, 2, 2, 8)
    calibrated = codec.calibrate(empty, static)
    assert calibrated is static or (
        calibrated is not None and static is not None and torch.equal(calibrated, static)
    )
    assert codec.quantize(empty, static).data.shape == (0, 2, 2, 8)
    no_width = torch.randn(3, 2, 2, 0)
    bad_static = None if shape is None else torch.zeros(shape)
    with pytest.raises(ArgumentError, match="D >= 1"):
        codec.calibrate(no_width, bad_static)
    with pytest.raises(ArgumentError, match="D >= 1"):
        codec.quantize(no_width, bad_static)


def test_an_empty_scale_granularity_is_refused_not_read_as_tensor() -> None:
    """make_codec("fp8_e4m3", "") gave a tensor-scale codec (``scales or "tensor"``)."""
    from kvmem.errors import ArgumentTypeError
    from kvmem.quant import FP8Codec, make_codec

    with pytest.raises(ArgumentError, match="granularity"):
        make_codec("fp8_e4m3", "")  # type: ignore[arg-type]
    assert make_codec("fp8_e4m3").granularity == "tensor"  # None still means the default
    with pytest.raises(ArgumentTypeError, match="granularity=5"):
        FP8Codec("fp8_e4m3", 5)  # type: ignore[arg-type]


def test_plain_dequantize_refuses_a_scale_that_does_not_fit_its_rows() -> None:
    """KVCodec.dequantize: ``scale`` broadcastable to ``[..., 1]``. PlainCodec let torch's
    RuntimeError through for [5, 5], and quietly changed the output's shape for a scale with
    more dimensions; it also took an integer tensor."""
    from kvmem.errors import ArgumentTypeError
    from kvmem.quant import PlainCodec

    codec = PlainCodec("bf16")
    data = torch.randn(2, 3, 4).bfloat16()
    for shape in [(5, 5), (2, 3, 4), (1, 2, 3, 1)]:
        with pytest.raises(ArgumentError, match="does not broadcast"):
            codec.dequantize(data, torch.ones(shape), torch.float32)
    with pytest.raises(ArgumentTypeError, match="float32 tensor"):
        codec.dequantize(data, torch.ones(2, 3, 1, dtype=torch.int64), torch.float32)
    for shape in [(2, 3, 1), (3, 1), (1,), ()]:
        out = codec.dequantize(data, torch.full(shape, 2.0), torch.float32)
        assert out.shape == data.shape and torch.equal(out, data.float() * 2)


def test_int4_weights_whose_scale_overflows_the_scale_dtype_are_refused() -> None:
    """A finite weight of 1e6 with float16 scales: max|w| / 7 overflows fp16 to inf, the values
    became 0 and dequantize returned 0 * inf = NaN for the whole group, silently."""
    from kvmem.quant.int4 import dequantize_int4, quantize_int4

    w = torch.randn(4, 32)
    w[2, 5] = 1e6
    with pytest.raises(ArgumentError, match="does not fit float16 scales"):
        quantize_int4(w, scale_dtype="float16")
    for scale_dtype in ("bfloat16", "float32"):
        back = dequantize_int4(quantize_int4(w, scale_dtype=scale_dtype))
        assert bool(torch.isfinite(back).all())
        assert abs(float(back[2, 5]) - 1e6) <= 1e6 / 7 / 2 * 1.01


def test_int4_groups_whose_scale_underflows_dequantize_to_zero_not_garbage() -> None:
    """max|w| / 7 below fp16's smallest subnormal rounds the scale to 0; the group was divided
    by 0 (0 / 0 = NaN cast to int8). It now quantizes to 0 and dequantizes to 0."""
    from kvmem.quant.int4 import dequantize_int4, quantize_int4, unpack_int4

    w = torch.zeros(2, 32)
    w[0, :8] = torch.linspace(-1e-8, 1e-8, 8)  # scale 1.4e-9: 0 in fp16
    w[1] = torch.randn(32)
    q = quantize_int4(w, scale_dtype="float16")
    assert int(q.scales[0, 0]) == 0
    assert bool((unpack_int4(q.packed)[0] == 0).all())
    back = dequantize_int4(q)
    assert torch.equal(back[0], torch.zeros(32))
    assert float((back[1] - w[1]).abs().max()) <= float(q.scales[1, 0]) / 2 * 1.01


def test_int4_scale_dtype_of_the_wrong_type_is_a_type_error_as_in_bytes_per_param() -> None:
    """quantize_int4(scale_dtype=5) was a ValueError while int4_bytes_per_param(32, 5) is a
    TypeError; an unknown name is a ConfigError in both."""
    from kvmem.errors import ArgumentTypeError
    from kvmem.quant.int4 import int4_bytes_per_param, quantize_int4

    w = torch.randn(2, 32)
    for call in (lambda d: quantize_int4(w, 32, d), lambda d: int4_bytes_per_param(32, d)):
        with pytest.raises(ArgumentTypeError, match="scale_dtype=5"):
            call(5)
        with pytest.raises(ConfigError, match="'int8' is not supported"):
            call("int8")


def test_codecs_and_the_fp8_decode_take_tensors_that_require_grad() -> None:
    """Quantizing is storage, not math to differentiate: a leaf K/V or scale that requires grad
    (a model run with grad enabled) made torch raise on the codec's in-place steps."""
    from kvmem.quant import FP8Codec, PlainCodec, fp8_to_float

    x = torch.randn(2, 2, 2, 8, requires_grad=True)
    for codec in (FP8Codec("fp8_e4m3", "token_head"), PlainCodec("bf16")):
        enc = codec.quantize(x)
        assert enc.data.shape == x.shape and not enc.data.requires_grad
    data = torch.randint(0, 120, (4, 8), dtype=torch.uint8)
    scale = torch.rand(4, 1, requires_grad=True)
    got = fp8_to_float(data, "fp8_e4m3", scale, torch.float32)
    want = data.view(torch.float8_e4m3fn).float() * scale.detach()
    assert torch.equal(got, want)


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
