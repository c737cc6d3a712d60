"""PoolSpec: its fields, sizes and bytes, fp8 scales, copies of a spec."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from adversarial import (  # the shared menagerie of bad arguments
    BAD,
    SETTINGS,
    contracted,
    is_not_integer,
)
from hypothesis import given
from pool_fixtures import DTYPES, GQA, MLA, SMALL_GQA, small_pool

from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError
from kvmem.quant import page_format

SPEC_FIELDS = {
    "num_layers": 2, "num_pages": 8, "page_size": 4, "num_kv_heads": 2, "head_dim": 8,
    "dtype": "fp8_e4m3", "scales": "head", "static_scales": 0.5, "layout": "HND",
    "device": "cpu", "compute_dtype": "fp32", "nonfinite": "zero",
}


SPEC_INTEGER_FIELDS = ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim")




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




@pytest.mark.parametrize("field", list(SPEC_FIELDS))
@SETTINGS
@given(bad=BAD)
def test_pool_spec_fields(field: str, bad: Any) -> None:
    def build() -> None:
        spec = PoolSpec(**{**SPEC_FIELDS, field: bad})
        if spec.nbytes <= 1 << 24:  # a valid spec of many GiB would really be allocated
            PagePool(spec)

    exc = contracted(build)
    if field in SPEC_INTEGER_FIELDS and is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and field in str(exc), (bad, exc)


def test_a_pool_larger_than_memory_is_refused_before_allocating() -> None:
    spec = PoolSpec(**{**SPEC_FIELDS, "num_layers": 1024, "num_pages": 2**31 - 1})
    with pytest.raises(ConfigError, match="GiB"):
        PagePool(spec)
    with pytest.raises(ConfigError, match="device"):
        PagePool(PoolSpec(**{**SPEC_FIELDS, "device": "meta"}))
    with pytest.raises(ConfigError, match="device"):
        PagePool(PoolSpec(**{**SPEC_FIELDS, "device": "not-a-device"}))


def test_pool_spec_valid_and_numpy_integers_accepted() -> None:
    spec = PoolSpec(**{**SPEC_FIELDS, "num_pages": np.int64(8), "head_dim": np.int32(8)})
    assert spec.num_pages == 8 and type(spec.num_pages) is int
    assert PagePool(spec).nbytes == spec.nbytes


@SETTINGS
@given(bad=BAD)
def test_pool_spec_methods(bad: Any) -> None:
    spec = PoolSpec(**SPEC_FIELDS)
    for call in (
        lambda: spec.num_pages_for_budget(bad),
        lambda: spec.with_num_pages(bad),
        lambda: PoolSpec.from_json(bad),
        lambda: PoolSpec.from_json(json.dumps({**SPEC_FIELDS, "num_pages": bad}, default=str)),
        lambda: PagePool(bad),
    ):
        contracted(call)
    with pytest.raises(ArgumentTypeError):
        spec.num_pages = 3  # frozen


def test_fp8_pool_spec_scales_default_to_tensor_and_bf16_has_none() -> None:
    from kvmem import PoolSpec
    from kvmem.integrations.hf import DEFAULT_FP8_SCALES

    shape = dict(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
    assert PoolSpec(**shape, dtype="fp8_e4m3").scales == "tensor"
    assert PoolSpec(**shape, dtype="bf16").scales is None
    assert DEFAULT_FP8_SCALES == "token_head"


@pytest.mark.parametrize("scales, ratio", [("tensor", 2.0), ("head", 2.0),
                                           ("token_head", 2.0 / (1 + 4 / 128))])
def test_an_fp8_pool_holds_twice_the_tokens_of_bf16_up_to_page_rounding(scales: str,
                                                                         ratio: float) -> None:
    from kvmem import PoolSpec

    shape = dict(num_layers=32, num_pages=4, page_size=16, num_kv_heads=8, head_dim=128)
    bf16 = PoolSpec(**shape, dtype="bf16")
    fp8 = PoolSpec(**shape, dtype="fp8_e4m3", scales=scales)
    budget = 1000 * bf16.bytes_per_page  # a whole number of bf16 pages
    assert fp8.num_pages_for_budget(budget) == int(ratio * 1000)
    assert fp8.num_pages_for_budget(budget + bf16.bytes_per_page - 1) <= int(ratio * 1001)


@pytest.mark.parametrize(
    ("dtype", "scales"),
    [("bf16", None), ("fp32", None), ("fp8_e4m3", "tensor"), ("fp8_e5m2", "head"),
     ("fp8_e4m3", "token_head")],
)
def test_the_byte_formulas_in_the_doc_evaluate_to_the_spec(dtype: str, scales: str | None) -> None:
    """The doc's bytes_per_page read, as written, ``(D * itemsize + 4 if token_head else 0)``:
    0 bytes for every page without token_head scales. Evaluated as written, each formula must
    give the spec's figure."""

    formulas = _doc_formulas()
    assert set(formulas) == {"bytes_per_page", "fixed_nbytes", "nbytes"}
    spec = PoolSpec(**SMALL_GQA, dtype=dtype, scales=scales)
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
    assert nbytes == spec.nbytes == small_pool(dtype=dtype, scales=scales).nbytes


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
    spec = PoolSpec(**SMALL_GQA, device="cpu")
    with pytest.raises(ArgumentError, match=match):
        spec.model_copy(update=update)
    with pytest.raises(ArgumentError, match="not a field"):
        spec.model_copy(update={"pages": 3})
    assert spec.model_copy(update={"num_pages": 8}).num_pages == 8
    assert spec.model_copy() == spec


def test_a_pool_of_a_model_copied_fp8_spec_reports_the_bytes_it_allocates() -> None:
    """An fp8 spec made by model_copy has no ``scales``; the pool stores tensor scales, and its
    spec must say so, or ``spec.nbytes`` (documented to equal what the pool allocates) is off."""
    spec = PoolSpec(**SMALL_GQA, device="cpu").model_copy(update={"dtype": "fp8_e4m3"})
    pool = PagePool(spec)
    assert pool.spec.scales == "tensor"
    assert pool.nbytes == pool.spec.nbytes


def test_spec_defaults_aliases_and_json_round_trip() -> None:
    spec = PoolSpec(**GQA, attention="mha", dtype="fp8_e4m3")
    assert spec.attention == "gqa" and spec.scales == "tensor" and spec.layout == "NHD"
    assert PoolSpec(**GQA).dtype == "bf16" and PoolSpec(**GQA).scales is None
    for s in (
        spec,
        PoolSpec(**MLA, dtype="fp8_e5m2", scales="token_head"),
        PoolSpec(**GQA, dtype="fp8_e4m3", scales="head", static_scales=0.5, layout="HND"),
        PoolSpec(**GQA, device="cpu", compute_dtype="fp32", nonfinite="raise"),
    ):
        assert PoolSpec.from_json(s.model_dump_json()) == s
        assert PoolSpec.model_validate_json(s.model_dump_json()) == s


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({**GQA, "head_dim": None}, "num_kv_heads and head_dim"),
        ({**GQA, "kv_lora_rank": 8}, "MLA fields"),
        ({**MLA, "kv_lora_rank": None}, "kv_lora_rank and qk_rope_head_dim"),
        ({**MLA, "num_kv_heads": 2}, "one latent"),
        ({**MLA, "layout": "HND"}, "NHD"),
        ({**MLA, "dtype": "fp8_e4m3", "scales": "head"}, "no KV heads"),
        ({**GQA, "scales": "tensor"}, "fp8 pages only"),
        ({**GQA, "dtype": "fp8_e4m3", "scales": "token_head", "static_scales": 1.0}, "token_head"),
        ({**GQA, "dtype": "fp8_e4m3", "static_scales": [1.0, 2.0]}, "shape"),
        ({**GQA, "dtype": "fp8_e4m3", "static_scales": [[1.0, 0.0], [1.0, 1.0]]}, "> 0"),
        ({**GQA, "num_pages": 0}, "num_pages"),
        ({**GQA, "dtype": "int8"}, "dtype"),
        ({**GQA, "blocks": 3}, "blocks"),
    ],
)
def test_spec_rejects_bad_configs(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ArgumentError, match=match):
        PoolSpec(**kw)


def test_spec_bad_json_is_a_config_error() -> None:
    with pytest.raises(ArgumentError):
        PoolSpec.from_json('{"num_layers": 1}')


@pytest.mark.parametrize(("dtype", "scales"), DTYPES)
@pytest.mark.parametrize("base", [GQA, {**GQA, "layout": "HND"}, MLA])
def test_spec_bytes_equal_allocated_tensors(
    base: dict[str, Any], dtype: str, scales: str | None
) -> None:
    if base is MLA and scales == "head":
        pytest.skip("MLA has no heads")
    spec = PoolSpec(**base, dtype=dtype, scales=scales, device="cpu")
    pool = PagePool(spec)
    allocated = sum(t.nbytes for t in pool.storage_tensors().values())
    assert spec.nbytes == pool.nbytes == allocated
    per_page = pool.data.nbytes + (0 if pool.token_scales is None else pool.token_scales.nbytes)
    assert spec.bytes_per_page * spec.num_pages == per_page
    assert spec.bytes_per_token * spec.page_size == spec.bytes_per_page
    fixed = 0 if pool.static_scales is None else pool.static_scales.nbytes
    assert spec.fixed_nbytes == fixed
    assert spec.tag_nbytes == pool.tags.nbytes
    assert pool.page_bytes.shape[:2] == (spec.num_layers, spec.num_pages)
    assert pool.page_bytes.nbytes == pool.data.nbytes
