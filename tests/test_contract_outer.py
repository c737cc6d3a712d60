"""The error contract (docs/errors.md) over the outer public entry points: pools and specs,
codecs, int4, paged attention, planning, the simulator's specs, and the CLI.

For each entry point a valid call is built, then one argument is replaced by a value drawn
from a menagerie of bad ones (bools, floats, strings, numpy scalars, negative and huge
integers, wrong shapes and dtypes, lists where arrays are expected, None, objects). Whatever
the value, the call either succeeds or raises a :class:`~kvmem.KVMemError` whose argument
errors are also ``ValueError`` or ``TypeError``; no other exception escapes, and after a
refused call the state (pool bytes, scales, tags, counters, calibration) is exactly what it
was. Values that the contract names (a bool, float or string where an integer is expected;
one id where a list of ids is) must be refused, with a message naming the argument.

The manager, allocator, page table and trackers: tests/test_contract_manager_todo.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.attention import paged_attention
from kvmem.cli import main as cli_main
from kvmem.cuda import PagePool, PoolSpec
from kvmem.errors import ArgumentError, ArgumentTypeError, ConfigError, KVMemError
from kvmem.planning import (
    FixedReserve,
    GPUSpec,
    MemoryFraction,
    SGLangPolicy,
    ThroughputModel,
    decode_bytes_per_step,
    expected_active_experts,
    fit_throughput,
    get_gpu,
    get_model,
    kv_heads_per_rank,
    kv_layout,
    layer_kv_bytes_per_token,
    load_hf_config,
    model_from_hf_config,
    param_counts,
    plan_capacity,
    sglang_mem_fraction_static,
    tokens_freed,
    weight_bytes,
    weight_scheme,
)
from kvmem.quant import fp8_to_float, make_codec, page_format
from kvmem.quant.int4 import (
    Int4Weight,
    dequantize_int4,
    int4_bytes_per_param,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

# Kept small enough for CI (a clean 2-core machine): the menagerie is drawn afresh each run.
SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# -- the menagerie of bad values ----------------------------------------------------------------

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


def _contracted(fn: Callable[[], Any], snapshot: Callable[[], Any] | None = None) -> Any:
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
            _assert_same(before, snapshot())
        return exc
    return None


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _is_not_integer(value: Any) -> bool:
    """Values the contract refuses wherever an integer is expected."""
    return isinstance(value, (bool, np.bool_, float, np.floating, str, bytes, complex))


# -- pools --------------------------------------------------------------------------------------

POOL_KINDS = [  # per-layer scales set by a first write, and per-token scales
    {"dtype": "fp8_e4m3", "scales": "tensor"},
    {"dtype": "fp8_e5m2", "scales": "token_head"},
]


def _pool(**kw: Any) -> PagePool:
    spec = PoolSpec(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8,
                    device="cpu", **kw)
    pool = PagePool(spec)
    k = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(0))
    pool.write(0, [0, 1, 2, 5, 9, 30], k, -k)  # calibrates layer 0's tensor scales
    pool.load_tags(np.arange(8) * 3)
    return pool


def _pool_state(pool: PagePool) -> Callable[[], dict[str, Any]]:
    def snap() -> dict[str, Any]:
        state: dict[str, Any] = {n: t.clone() for n, t in pool.storage_tensors().items()}
        state["tags"] = pool.tags.clone()
        state["stats"] = pool.stats()
        state["calibrated"] = list(pool._calibrated)
        return state

    return snap


def _pool_calls(pool: PagePool) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Each public pool method with valid arguments: name -> (method, kwargs)."""
    k = torch.randn(2, 2, 8)
    return {
        "write": (pool.write, {"layer": 1, "slot_mapping": [3, 7], "k": k, "v": k.clone(),
                               "check": True}),
        "check_slots": (pool.check_slots, {"slot_mapping": [3, -1]}),
        "gather": (pool.gather, {"layer": 0, "page_ids": [0, 2], "dtype": None}),
        "read": (pool.read, {"layer": 0, "page_ids": np.array([1]), "dtype": torch.float32}),
        "copy_pages": (pool.copy_pages, {"src_page_ids": [0], "dst_page_ids": [3]}),
        "update_tags": (pool.update_tags, {"page_ids": [1, 2], "tags": [7, 8]}),
        "load_tags": (pool.load_tags, {"tags": list(range(8))}),
        "kv_cache": (pool.kv_cache, {"layer": 1}),
        "sync_tags": (pool.sync_tags, {"allocator": _Alloc(8)}),
    }


class _Alloc:
    """What sync_tags needs from an allocator."""

    def __init__(self, n: int) -> None:
        self.tags = np.arange(n, dtype=np.int64) + 100
        self.changed = np.array([1, 3])

    def pop_changed_pages(self) -> np.ndarray:
        out, self.changed = self.changed, np.zeros(0, dtype=np.int64)
        return out


POOL_PARAMS = [
    (method, param)
    for method, (_, kwargs) in _pool_calls(_pool(dtype="bf16")).items()
    for param in kwargs
]
INTEGER_PARAMS = {"layer"}
ID_LIST_PARAMS = {"slot_mapping", "page_ids", "src_page_ids", "dst_page_ids", "tags"}


@pytest.mark.parametrize("kind", POOL_KINDS, ids=lambda k: k["dtype"])
@pytest.mark.parametrize(("method", "param"), POOL_PARAMS)
@SETTINGS
@given(bad=BAD)
def test_pool_methods_refuse_bad_arguments_and_change_nothing(
    kind: dict[str, Any], method: str, param: str, bad: Any
) -> None:
    pool = _pool(**kind)
    fn, kwargs = _pool_calls(pool)[method]
    exc = _contracted(lambda: fn(**{**kwargs, param: bad}), _pool_state(pool))
    if param in INTEGER_PARAMS and _is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and param in str(exc), (bad, exc)
    if param in ID_LIST_PARAMS and not isinstance(bad, (list, tuple, np.ndarray, torch.Tensor)):
        assert exc is not None, f"one value {bad!r} passed as {param} was accepted"


@pytest.mark.parametrize("kind", [{"dtype": "bf16"}, *POOL_KINDS], ids=lambda k: k["dtype"])
def test_pool_valid_calls_succeed(kind: dict[str, Any]) -> None:
    """The calls the property test corrupts are valid as built."""
    pool = _pool(**kind)
    for fn, kwargs in _pool_calls(pool).values():
        fn(**kwargs)


def test_page_ids_never_wrap_or_index_from_the_end() -> None:
    pool = _pool(dtype="bf16")
    snap = _pool_state(pool)
    before = snap()
    for ids in ([-1], np.array([-8]), torch.tensor([-1]), [8], [2**32 + 1],
                np.array([2**32 + 1], dtype=np.int64), [np.int64(2**63 - 1)]):
        with pytest.raises(ArgumentError, match=r"pages? from"):
            pool.copy_pages([0], ids)
        with pytest.raises(ArgumentError, match=r"pages? from"):
            pool.gather(0, ids)
    for ids in ([1.7], [True], [1, True], np.array([1.0]), 1, np.int64(1), "1"):
        with pytest.raises(ArgumentTypeError):
            pool.copy_pages([0], ids)
    _assert_same(before, snap())


def test_a_write_that_fails_late_changes_nothing() -> None:
    """NaN input with nonfinite='raise' is refused after every shape check passed."""
    pool = PagePool(PoolSpec(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1,
                             head_dim=4, dtype="fp8_e4m3", device="cpu", nonfinite="raise"))
    snap = _pool_state(pool)
    before = snap()
    k = torch.ones(2, 1, 4)
    k[1, 0, 0] = float("nan")
    with pytest.raises(ArgumentError, match="NaN"):
        pool.write(0, [0, 1], k, k)
    _assert_same(before, snap())
    assert pool._calibrated == [False]  # the refused write did not set the layer's scales


# -- specs --------------------------------------------------------------------------------------

SPEC_FIELDS = {
    "num_layers": 2, "num_pages": 8, "page_size": 4, "num_kv_heads": 2, "head_dim": 8,
    "dtype": "fp8_e4m3", "scales": "head", "static_scales": 0.5, "layout": "HND",
    "device": "cpu", "compute_dtype": "fp32", "nonfinite": "zero",
}
SPEC_INTEGER_FIELDS = ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim")


@pytest.mark.parametrize("field", list(SPEC_FIELDS))
@SETTINGS
@given(bad=BAD)
def test_pool_spec_fields(field: str, bad: Any) -> None:
    def build() -> None:
        spec = PoolSpec(**{**SPEC_FIELDS, field: bad})
        if spec.nbytes <= 1 << 24:  # a valid spec of many GiB would really be allocated
            PagePool(spec)

    exc = _contracted(build)
    if field in SPEC_INTEGER_FIELDS and _is_not_integer(bad):
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
        _contracted(call)
    with pytest.raises(ArgumentTypeError):
        spec.num_pages = 3  # frozen


# -- codecs, fp8 decode, int4 ---------------------------------------------------------------


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
    _contracted(calls[which])
    _contracted(lambda: fp8_to_float(bad, "fp8_e4m3"))
    _contracted(lambda: fp8_to_float(data, bad))
    _contracted(lambda: fp8_to_float(data, "fp8_e5m2", out=bad))


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
        exc = _contracted(call)
        del exc
    if _is_not_integer(bad):
        with pytest.raises(ArgumentTypeError, match="group_size"):
            int4_bytes_per_param(bad)


# -- paged attention ----------------------------------------------------------------------------


def _attention_call(pool: PagePool) -> dict[str, Any]:
    return {
        "q": torch.randn(3, 4, 8),
        "qo_indptr": [0, 2, 3],
        "pool": pool,
        "layer": 0,
        "kv_indptr": np.array([0, 1, 3], dtype=np.int32),
        "kv_indices": torch.tensor([0, 1, 2], dtype=torch.int32),
        "kv_last_page_len": [3, 2],
        "sm_scale": 0.3,
        "causal": True,
    }


@pytest.mark.parametrize("param", list(_attention_call(_pool(dtype="bf16"))))
@SETTINGS
@given(bad=BAD)
def test_paged_attention(param: str, bad: Any) -> None:
    pool = _pool(dtype="fp8_e4m3", scales="tensor")
    kwargs = _attention_call(pool)
    paged_attention(**kwargs)  # valid as built
    exc = _contracted(lambda: paged_attention(**{**kwargs, param: bad}), _pool_state(pool))
    if param == "layer" and _is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and "layer" in str(exc)


# -- planning -----------------------------------------------------------------------------------

PLAN_ARGS: dict[str, Any] = {
    "model": "llama-3.1-8b", "gpu": "h100-80g", "tp": 2, "dp": 2, "kv_dtype": "fp8_e4m3",
    "kv_scale_layout": "head", "weights": "int4-g32", "policy": FixedReserve(reserve_gib=4),
    "page_size": 16, "context_len": 4096, "concurrency": 8, "use_mtp": False,
}
PLAN_INTEGERS = ("tp", "dp", "page_size", "context_len", "concurrency")


@pytest.mark.parametrize("param", list(PLAN_ARGS))
@SETTINGS
@given(bad=BAD)
def test_plan_capacity(param: str, bad: Any) -> None:
    args = dict(PLAN_ARGS)
    model, gpu = args.pop("model"), args.pop("gpu")
    plan_capacity(model, gpu, **args)  # valid as built
    call = {"model": model, "gpu": gpu, **args, param: bad}
    exc = _contracted(lambda: plan_capacity(**call))
    if param in PLAN_INTEGERS and _is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and param in str(exc), (bad, exc)


@SETTINGS
@given(bad=BAD)
def test_planning_functions(bad: Any) -> None:
    plan = plan_capacity("llama-3.1-8b", "h100-80g", 1, context_len=1024)
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100-80g")
    fit = fit_throughput(plan, [(1, 50.0), (8, 300.0)], context_len=1024)
    calls = [
        lambda: get_model(bad),
        lambda: get_gpu(bad),
        lambda: weight_scheme(bad, model),
        lambda: weight_scheme("int4-g32", bad),
        lambda: plan.concurrency_at(bad),
        lambda: plan.sequence_bytes(bad),
        lambda: decode_bytes_per_step(plan, bad, 1024),
        lambda: decode_bytes_per_step(plan, 8, bad),
        lambda: decode_bytes_per_step(bad, 8, 1024),
        lambda: expected_active_experts(bad, 8, 16),
        lambda: expected_active_experts(64, bad, 16),
        lambda: expected_active_experts(64, 8, bad),
        lambda: fit_throughput(plan, bad),
        lambda: fit_throughput(plan, [(1, 50.0), bad]),
        lambda: fit_throughput(plan, [(1, 50.0), (8, bad)], context_len=1024),
        lambda: fit_throughput(plan, [(1, 50.0), (8, 300.0)], context_len=bad),
        lambda: fit.tokens_per_s(plan, bad),
        lambda: fit.step_seconds(plan, 8, bad),
        lambda: kv_layout(model, bad),
        lambda: kv_layout(model, "fp8_e4m3", bad),
        lambda: kv_layout(model, "bf16", "tensor", bad),
        lambda: kv_layout(bad, "bf16"),
        lambda: layer_kv_bytes_per_token(model.attention, "bf16", "tensor", bad),
        lambda: kv_heads_per_rank(model.attention, bad),
        lambda: kv_heads_per_rank(bad, 1),
        lambda: param_counts(model, bad),
        lambda: param_counts(model, 1, bad),
        lambda: weight_bytes(model, bad),
        lambda: weight_bytes(model, None, 1, bad),
        lambda: sglang_mem_fraction_static(gpu, bad),
        lambda: sglang_mem_fraction_static(bad, 1),
        lambda: tokens_freed(plan, bad),
        lambda: model_from_hf_config(bad),
        lambda: model_from_hf_config({"model_type": "llama", "num_hidden_layers": bad,
                                      "hidden_size": 64, "num_attention_heads": 4,
                                      "intermediate_size": 128, "vocab_size": 100}),
        lambda: load_hf_config(bad) if not isinstance(bad, str) else None,
    ]
    for call in calls:
        _contracted(call)


SPEC_CASES: list[tuple[Callable[..., Any], dict[str, Any]]] = [
    (GPUSpec, {"name": "x", "memory_mib": 1024, "bandwidth_gbs": 100.0}),
    (FixedReserve, {"reserve_gib": 2.0}),
    (MemoryFraction, {"fraction": 0.5}),
    (SGLangPolicy, {"mem_fraction_static": 0.8, "chunked_prefill_size": 4096, "pp": 1,
                    "dp_attention": False, "dp_size": 1, "vlm_adjust": True,
                    "runtime_overhead_gib": 0.0}),
    (ThroughputModel, {"t0_s": 0.005, "efficiency": 0.7, "context_len": 4096}),
]


@pytest.mark.parametrize(
    ("cls", "field"),
    [(cls, field) for cls, fields in SPEC_CASES for field in fields],
    ids=lambda v: getattr(v, "__name__", v),
)
@SETTINGS
@given(bad=BAD)
def test_planning_specs(cls: Callable[..., Any], field: str, bad: Any) -> None:
    fields = dict(next(f for c, f in SPEC_CASES if c is cls))
    cls(**fields)  # valid as built
    exc = _contracted(lambda: cls(**{**fields, field: bad}))
    if isinstance(bad, (str, bytes)) and field != "name":
        assert isinstance(exc, ArgumentTypeError) and field in str(exc), (bad, exc)


def test_model_spec_from_bad_config_dicts(tmp_path: Any) -> None:
    path = tmp_path / "config.json"
    for text in ("[1, 2]", "{", '{"model_type": "llama", "num_hidden_layers": "x"}',
                 '{"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": [64]}'):
        path.write_text(text)
        with pytest.raises(KVMemError):
            load_hf_config(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(KVMemError):
        load_hf_config(tmp_path)


# -- the simulator's specs ----------------------------------------------------------------------


@SETTINGS
@given(bad=BAD, field=st.sampled_from(["num_requests", "concurrency", "num_prefixes",
                                       "prefix_len", "prefix_fraction", "namespaces", "seed"]))
def test_workload_fields(bad: Any, field: str) -> None:
    from kvmem.simulate import LengthDist, Workload

    fields: dict[str, Any] = {
        "num_requests": 4, "concurrency": 2, "prompt_len": LengthDist.parse("8-16"),
        "output_len": LengthDist.parse("4"), "num_prefixes": 1, "prefix_len": 4,
        "prefix_fraction": 0.5, "namespaces": 1, "seed": 3,
    }
    Workload(**fields)
    exc = _contracted(lambda: Workload(**{**fields, field: bad}))
    if field != "prefix_fraction" and _is_not_integer(bad):
        assert isinstance(exc, ArgumentTypeError) and field in str(exc)
    _contracted(lambda: LengthDist.parse(bad))
    _contracted(lambda: LengthDist(kind="uniform", a=bad, b=10))


def test_simulate_arguments() -> None:
    from kvmem.planning import GPUSpec
    from kvmem.simulate import LengthDist, Workload, simulate

    plan = plan_capacity("smollm2-135m", GPUSpec(name="t", memory_mib=1024, bandwidth_gbs=1000),
                         1, policy=FixedReserve(reserve_gib=0.5))
    w = Workload(num_requests=3, concurrency=2, prompt_len=LengthDist.parse("8"),
                 output_len=LengthDist.parse("4"))
    assert simulate(w, plan).num_completed == 3
    for kwargs in ({"chunk": 0}, {"chunk": 1.5}, {"max_running": True},
                   {"prefill_tokens_per_s": 0}, {"prefill_tokens_per_s": float("nan")},
                   {"sample_every": -1.0}, {"prefix_cache": 1}, {"progress": 3}):
        with pytest.raises((ArgumentError, ArgumentTypeError)):
            simulate(w, plan, **kwargs)
    with pytest.raises(ArgumentTypeError):
        simulate({"num_requests": 3}, plan)  # type: ignore[arg-type]


# -- the CLI ------------------------------------------------------------------------------------

PLAN_OPTIONS = ["--gpu", "--gpu-memory-gib", "--gpu-bandwidth-gbs", "--tp", "--dp", "--kv-dtype",
                "--kv-scales", "--compare", "--weights", "--context", "--concurrency",
                "--page-size", "--reserve-gib", "--mem-fraction", "--runtime-overhead-gib"]
WORDS = st.one_of(
    st.sampled_from(["0", "-1", "1", "2", "1.5", "nan", "inf", "-inf", "1e999", "", "abc",
                     "bf16", "fp8_e4m3", "head", "custom", "h200", "int4-g7", "int4-g32",
                     "8", "3", "0.5", "64", "9" * 30]),
    st.text(max_size=6),
)


CLI_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@CLI_SETTINGS
@given(model=st.sampled_from(["llama-3.1-8b", "kimi-k2.6", "smollm2-135m", "nope", ""]),
       options=st.lists(st.tuples(st.sampled_from(PLAN_OPTIONS), WORDS), max_size=4))
def test_cli_plan_never_escapes(
    model: str, options: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Any `kvmem plan` command line ends with status 0 or with one line on stderr and 2."""
    capsys.readouterr()  # the fixture is shared by the examples: start each one empty
    argv = ["plan", model, *(x for pair in options for x in pair)]
    status = cli_main(argv)
    out, err = capsys.readouterr()
    assert status in (0, 2), (argv, status)
    if status == 2:
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


SIMULATE_NUMERIC = ["--tp", "--page-size", "--requests", "--concurrency", "--rate", "--prefixes",
                    "--prefix-len", "--prefix-fraction", "--max-running", "--chunk",
                    "--prefill-tps", "--t0-ms", "--efficiency", "--seed"]


@CLI_SETTINGS
@given(option=st.sampled_from(SIMULATE_NUMERIC),
       value=st.sampled_from(["-1", "-0.5", "abc", "nan", "inf", "", "1e999", "--", "0x10"]))
def test_cli_simulate_refuses_bad_numbers(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    status = cli_main(["simulate", "llama-3.1-8b", f"{option}={value}"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1, (option, value, err)
    assert option in err
