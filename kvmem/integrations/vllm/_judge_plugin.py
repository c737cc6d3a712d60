"""pytest plugin of the judge (:mod:`kvmem.integrations.vllm.judge`): records what each of vLLM's
tests did and, with ``--kvmem-judge-swap``, runs them on kvmem's scheduler classes.

    pytest -p kvmem.integrations.vllm._judge_plugin --kvmem-judge-out=OUT.json \\
        [--kvmem-judge-swap] tests/v1/core

The swap happens in ``pytest_configure``, before collection: ``Scheduler`` in
``vllm.v1.core.sched.scheduler`` and ``AsyncScheduler`` in ``vllm.v1.core.sched.async_scheduler``
become :class:`~kvmem.integrations.vllm.KVMemScheduler` and
:class:`~kvmem.integrations.vllm.KVMemAsyncScheduler`, so a test module's
``from vllm.v1.core.sched.scheduler import Scheduler`` (and vLLM's own
``SchedulerConfig.get_scheduler_cls``) get kvmem's. vLLM's other scheduler modules are imported
first, so their subclasses (``DiffusionScheduler``) keep vLLM's base.

``OUT.json``, written at the end of the session::

    {"swap": bool,
     "tests": {nodeid: {"outcome": "passed" | "failed" | "skipped",
                        "schedulers": [class names whose __init__ the test entered],
                        "error": null | {"type", "module", "message", "kvmem_error",
                                         "attribute", "attribute_of", "raised_in", "raised_at",
                                         "phase"},
                        "integrity_failures": int,  # kvmem's aborts, on kvmem
                        "seconds": float}},
     "collect_errors": {nodeid: message}}

``attribute`` and ``attribute_of`` (``module.Class`` of the object) are an ``AttributeError``'s.

``raised_at`` is the module whose code raised the exception (the innermost traceback frame),
``raised_in`` whose code that is: ``"test"`` (vLLM's tests), ``"vllm"``, ``"kvmem"`` or
``"other"``.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

import pytest

_SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler",
                      "vllm.v1.core.sched.diffusion_scheduler")

_tests: dict[str, dict[str, Any]] = {}
_collect_errors: dict[str, str] = {}
_current: list[str] = []  # names of the scheduler classes built by the running test
_built: list[Any] = []  # the schedulers it built (until its teardown)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvmem-judge")
    group.addoption("--kvmem-judge-out", default=None, help="where to write the record (JSON)")
    group.addoption("--kvmem-judge-swap", action="store_true",
                    help="swap in kvmem's Scheduler and AsyncScheduler")


def _record_init(cls: type) -> None:
    """Wrap ``cls.__init__`` to note, on entry, the class being built (before any refusal)."""
    init = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        name = type(self).__qualname__
        if name not in _current:
            _current.append(name)
        init(self, *args, **kwargs)
        if not any(built is self for built in _built):
            _built.append(self)

    cls.__init__ = __init__  # type: ignore[misc]


def swap_schedulers() -> None:
    """Put kvmem's classes where the tests import vLLM's from."""
    for name in _SCHEDULER_MODULES:  # vLLM's own subclasses bind vLLM's classes first
        importlib.import_module(name)
    from kvmem.integrations.vllm import KVMemAsyncScheduler, KVMemScheduler

    sched = importlib.import_module("vllm.v1.core.sched.scheduler")
    async_sched = importlib.import_module("vllm.v1.core.sched.async_scheduler")
    sched.Scheduler = KVMemScheduler  # type: ignore[attr-defined]
    async_sched.AsyncScheduler = KVMemAsyncScheduler  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    for name in _SCHEDULER_MODULES:
        importlib.import_module(name)
    from vllm.v1.core.sched.scheduler import Scheduler

    # Every scheduler, vLLM's or a test's subclass, reaches Scheduler.__init__; kvmem's check
    # their configuration before that, so they are wrapped too.
    _record_init(Scheduler)
    if config.getoption("--kvmem-judge-swap"):
        swap_schedulers()
        from kvmem.integrations.vllm import KVMemAsyncScheduler, KVMemScheduler

        _record_init(KVMemScheduler)
        _record_init(KVMemAsyncScheduler)


def side_of(module: str) -> str:
    """Whose code a module is: ``"test"`` (vLLM's tests), ``"kvmem"``, ``"vllm"`` or
    ``"other"``."""
    for side, package in (("test", "tests"), ("kvmem", "kvmem"), ("vllm", "vllm")):
        if module == package or module.startswith(f"{package}."):
            return side
    return "other"


def describe_error(exc: BaseException, raised_at: str) -> dict[str, Any]:
    """What the judge needs of an exception to classify it."""
    from kvmem.errors import KVMemError

    attribute = attribute_of = None
    if isinstance(exc, AttributeError):
        attribute = getattr(exc, "name", None)
        obj = getattr(exc, "obj", None)
        attribute_of = None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"
    return {"type": type(exc).__qualname__, "module": type(exc).__module__,
            "message": " ".join(str(exc).split())[:1000],
            "kvmem_error": isinstance(exc, KVMemError), "attribute": attribute,
            "attribute_of": attribute_of,
            "raised_in": side_of(raised_at), "raised_at": raised_at}


def _innermost_module(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """The module whose code raised (the innermost traceback frame's ``__name__``)."""
    tb = excinfo.tb
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", ""))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    entry = _tests.setdefault(item.nodeid, {"outcome": "passed", "schedulers": [],
                                             "error": None, "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 4)
    if report.failed and entry["outcome"] != "failed":
        entry["outcome"] = "failed"
        if call.excinfo is not None:
            entry["error"] = describe_error(call.excinfo.value, _innermost_module(call.excinfo))
            entry["error"]["phase"] = call.when
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    if call.when == "teardown":
        entry["schedulers"] = sorted(_current)
        # kvmem's integrity aborts in this test (a scheduler on kvmem has a manager, unless the
        # test replaced its kv_cache_manager, with a Mock for one)
        from kvmem import KVCacheManager

        managers = [m for m in (getattr(b, "kvmem", None) for b in _built)
                    if isinstance(m, KVCacheManager)]
        entry["integrity_failures"] = sum(m.stats().num_integrity_failures for m in managers)
        _built.clear()
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _current.clear()
    _built.clear()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _collect_errors[report.nodeid] = " ".join(str(report.longrepr).split())[-1000:]


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = session.config.getoption("--kvmem-judge-out")
    if out:
        with open(out, "w") as f:
            json.dump({"swap": bool(session.config.getoption("--kvmem-judge-swap")),
                       "tests": _tests, "collect_errors": _collect_errors}, f, indent=1)
