"""Promises of docs/data_types.md and the codec/pool docstrings, held against adversarial input.

Each test here failed before the fix it names: the pool, the codecs, int4 and the tag mirror
either broke a documented promise (no silent NaN, inputs accepted on the pool's device, scales
within range) or answered bad input with something other than a clear kvmem error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError

GQA: dict[str, Any] = {
    "num_layers": 1,
    "num_pages": 4,
    "page_size": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
}


def _pool(**kw: Any) -> PagePool:
    return PagePool(PoolSpec(**{**GQA, "device": "cpu", **kw}))


def _snapshot(pool: PagePool) -> dict[str, torch.Tensor]:
    state = {name: t.clone() for name, t in pool.storage_tensors().items()}
    state["tags"] = pool.tags.clone()
    state["counters"] = pool._counters.clone()
    return state


# -- the pool's device ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1"])
def test_a_pool_on_an_indexed_cpu_device_takes_tensors_from_that_device(device: str) -> None:
    """``PoolSpec(device="cpu:0")`` is accepted; its pool must then take CPU tensors (it used to
    refuse every one: "k is on cpu but the pool is on cpu:0; move it first"). The same mismatch
    made a ``device="cuda"`` pool refuse tensors on cuda:0."""
    pool = PagePool(PoolSpec(**GQA, device=device))
    assert pool.device == pool.data.device == torch.device("cpu")
    k = torch.randn(3, 2, 8)
    pool.write(0, torch.tensor([0, 1, 5]), k, -k)
    keys, values = pool.read(0, torch.tensor([0]), torch.float32)
    assert torch.allclose(keys[0, :2], k[:2], rtol=1e-2, atol=1e-2)
    assert torch.allclose(values[0, :2], -k[:2], rtol=1e-2, atol=1e-2)
    pool.copy_pages(torch.tensor([0]), torch.tensor([3]))
    pool.update_tags(torch.tensor([2]), torch.tensor([7]))
    assert int(pool.tags[2]) == 7


# -- static scales -------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e39, -1e39, 1e-50, float("nan")])
def test_static_scales_a_float32_cannot_hold_are_refused(scale: float) -> None:
    """The pool stores static scales as float32. 1e39 passed the spec's "finite and > 0" check
    in float64 and became inf (every read then returned 0 * inf = NaN); 1e-50 became 0 (every
    read returned 0)."""
    with pytest.raises(ArgumentError, match="static_scales must be finite and > 0"):
        PoolSpec(**GQA, dtype="fp8_e4m3", static_scales=scale)
    with pytest.raises(ArgumentError, match="static_scales must be finite and > 0"):
        PoolSpec(**GQA, dtype="fp8_e4m3", scales="head", static_scales=[[[1.0, scale]] * 2])


def test_static_scales_at_the_float32_limits_read_back_finite() -> None:
    for scale in (3e38, 1e-44):
        pool = _pool(dtype="fp8_e4m3", static_scales=scale)
        assert pool.static_scales is not None and bool((pool.static_scales > 0).all())
        assert bool(torch.isfinite(pool.static_scales).all())
        k = torch.randn(2, 2, 8)
        pool.write(0, [0, 1], k, k)
        keys, values = pool.read(0, [0], torch.float32)
        assert bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())


# -- the fast fp8 decode -------------------------------------------------------------------------


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


# -- token_head scales ---------------------------------------------------------------------------

_FP8_NAN_BYTES = {"fp8_e4m3": (0x7F, 0xFF), "fp8_e5m2": (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF)}


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_token_whose_scale_underflows_is_stored_without_nan(dtype: str) -> None:
    """A (token, head) row of fp32 values below ~6e-43 has ``amax / max_finite`` == 0 in fp32:
    the row was divided by 0 and its zeros (0 / 0) were stored as fp8 NaN bytes, with scale 0.
    e5m2 pages then read back NaN, silently. Such a row gets scale 1, as an all-zero row does."""
    pool = _pool(dtype=dtype, scales="token_head")
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


# -- codec arguments -----------------------------------------------------------------------------


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


# -- int4 ----------------------------------------------------------------------------------------


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
    from kvmem.errors import ArgumentTypeError, ConfigError
    from kvmem.quant.int4 import int4_bytes_per_param, quantize_int4

    w = torch.randn(2, 32)
    for call in (lambda d: quantize_int4(w, 32, d), lambda d: int4_bytes_per_param(32, d)):
        with pytest.raises(ArgumentTypeError, match="scale_dtype=5"):
            call(5)
        with pytest.raises(ConfigError, match="'int8' is not supported"):
            call("int8")


# -- the tag mirror ------------------------------------------------------------------------------


def test_the_tag_mirror_takes_every_non_negative_int64() -> None:
    """Tags are non-negative int64; the largest, 2**63 - 1, was refused ("valid tags are
    0..2**63 - 2")."""
    import numpy as np

    pool = _pool()
    top = 2**63 - 1
    pool.update_tags([1], [top])
    assert int(pool.tags[1]) == top
    pool.load_tags(np.full(4, top, dtype=np.int64))
    assert pool.tags.tolist() == [top] * 4
    before = pool.tags.clone()
    with pytest.raises(ArgumentError):
        pool.update_tags([0], np.array([2**63], dtype=np.uint64))
    with pytest.raises(ArgumentError, match="tags from -1"):
        pool.update_tags([0], [-1])
    assert torch.equal(pool.tags, before)


# -- byte accounting, as docs/data_types.md writes it --------------------------------------------


def _doc_formulas() -> dict[str, str]:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "data_types.md").read_text()
    block = text.split("## Byte accounting", 1)[1].split("```", 2)[1]
    out = {}
    for line in block.splitlines():
        name, sep, rhs = line.partition("=")
        if sep and name.strip() in ("bytes_per_page", "fixed_nbytes", "nbytes"):
            out[name.strip()] = rhs.split("   ")[0].strip()  # drop the trailing note
    return out


@pytest.mark.parametrize(
    ("dtype", "scales"),
    [("bf16", None), ("fp32", None), ("fp8_e4m3", "tensor"), ("fp8_e5m2", "head"),
     ("fp8_e4m3", "token_head")],
)
def test_the_byte_formulas_in_the_doc_evaluate_to_the_spec(dtype: str, scales: str | None) -> None:
    """The doc's bytes_per_page read, as written, ``(D * itemsize + 4 if token_head else 0)``:
    0 bytes for every page without token_head scales. Evaluated as written, each formula must
    give the spec's figure."""
    from kvmem.quant import page_format

    formulas = _doc_formulas()
    assert set(formulas) == {"bytes_per_page", "fixed_nbytes", "nbytes"}
    spec = PoolSpec(**GQA, dtype=dtype, scales=scales)
    names: dict[str, Any] = {
        "num_layers": spec.num_layers,
        "C": spec.num_components,
        "page_size": spec.page_size,
        "H": spec.num_heads,
        "D": spec.width,
        "itemsize": page_format(dtype).itemsize,
        "token_head": scales == "token_head",
        "head": scales == "head",
        "num_pages": spec.num_pages,
    }
    bytes_per_page = eval(formulas["bytes_per_page"], {}, names)  # the doc's text, as written
    assert bytes_per_page == spec.bytes_per_page
    fixed = eval(formulas["fixed_nbytes"], {}, names) if scales in ("tensor", "head") else 0
    assert fixed == spec.fixed_nbytes
    names.update(bytes_per_page=bytes_per_page, fixed_nbytes=fixed)
    nbytes = eval(formulas["nbytes"], {}, names)
    assert nbytes == spec.nbytes == _pool(dtype=dtype, scales=scales).nbytes


# -- tensors that require grad -------------------------------------------------------------------


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


# -- a spec pydantic built without validating it -------------------------------------------------


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"num_pages": 0}, "num_pages"),
        ({"static_scales": 1e39}, "static_scales"),
        ({"dtype": "int8"}, "dtype"),
        ({"head_dim": None}, "head_dim"),
    ],
)
def test_model_copy_checks_the_updated_spec_as_a_new_one(
    update: dict[str, Any], match: str
) -> None:
    """pydantic's ``spec.model_copy(update=...)`` skips validation (PagePool built a pool of 0
    pages, or a bf16 pool with scales, from such a spec); a spec's own checks its fields."""
    spec = PoolSpec(**GQA, device="cpu")
    with pytest.raises(ArgumentError, match=match):
        spec.model_copy(update=update)
    with pytest.raises(ArgumentError, match="not a field"):
        spec.model_copy(update={"pages": 3})
    assert spec.model_copy(update={"num_pages": 8}).num_pages == 8
    assert spec.model_copy() == spec


def test_a_pool_of_a_model_copied_fp8_spec_reports_the_bytes_it_allocates() -> None:
    """An fp8 spec made by model_copy has no ``scales``; the pool stores tensor scales, and its
    spec must say so, or ``spec.nbytes`` (documented to equal what the pool allocates) is off."""
    spec = PoolSpec(**GQA, device="cpu").model_copy(update={"dtype": "fp8_e4m3"})
    pool = PagePool(spec)
    assert pool.spec.scales == "tensor"
    assert pool.nbytes == pool.spec.nbytes
