"""Substituted routers (issue 38, item 3): a router class that overrides the method OEA's hook runs through routes
without OEA and raises nothing. The rule (``oea.integrations.bypass``) names such a class; each plugin warns once
per class at start-up (vLLM also keeps such a layer's routing at model load, counted as not rewritable) and
``oea doctor vllm`` / ``oea doctor sglang`` fail their ``router bypass`` check naming it.

Engine stand-ins only (the main venv has neither engine): vLLM's four wrapped router classes and the worker classes
in the modules the plugin imports them from, SGLang's ``TopK``; each ``platform_*`` class below stands in for a
platform's substituted router (vLLM's RFC #51005 ``FusedMoERoutingBackend``, an out-of-tree platform plugin).
``tests/engines/test_bypass_engines.py`` runs the same against the real classes in the engine venvs.
"""

from __future__ import annotations

import enum
import functools
import logging
import sys
import types
from typing import Any, ClassVar

import pytest
import torch
import vllm_stand_ins as vllm_si
from sglang_stand_ins import fresh_state as fresh_sglang_state
from sglang_stand_ins import stand_in_module, topk_module

import oea.integrations.sglang.doctor as sglang_doctor
import oea.integrations.sglang.plugin as sglang_plugin
import oea.integrations.vllm.doctor as vllm_doctor
import oea.integrations.vllm.plugin as vllm_plugin
from oea.config import settings_from_env
from oea.integrations import bypass
from oea.integrations.runtime import WRAPPED
from oea.integrations.vllm.state import State as VllmState

torch.set_num_threads(1)
ROUTERS = "vllm.model_executor.layers.fused_moe.router"
CLEARED = ("OEA_K0", "SGLANG_OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING", "OEA_TRACE_FILE", "OEA_LAYER_K0_FILE",
           "VLLM_BATCH_INVARIANT", "SGLANG_ENABLE_DETERMINISTIC_INFERENCE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)


def _bypass_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "bypass" in r.getMessage()]


# --------------------------------------------------------------------------- the rule, engine-free


class Hooked:
    """Stands in for an engine's router class whose ``route`` the plugin hooks."""

    def route(self) -> str:
        return "engine"


class Inherits(Hooked):
    """A subclass that keeps the hooked ``route``: it routes through the hook."""


class PlatformRouter(Hooked):
    """Stands in for a platform's substituted router: it routes with its own kernel."""

    def route(self) -> str:
        return "platform"


class PlatformHeir(PlatformRouter):
    """Inherits the platform's override: bypasses too, through its parent."""


def test_rule_names_each_override_and_its_heirs_and_passes_the_rest() -> None:
    found = bypass.find_bypasses(Hooked, ("route",))
    assert [(b.router, b.method) for b in found] == [(f"{__name__}.PlatformRouter", "route"),
                                                     (f"{__name__}.PlatformHeir", "route")]
    assert found[0].found == "its own override"
    assert found[1].found == f"the override in {__name__}.PlatformRouter"
    assert all(b.hook == f"{__name__}.Hooked.route" for b in found)
    words = found[0].message
    assert f"router class {__name__}.PlatformRouter bypasses OEA" in words and "super().route" in words
    assert bypass.find_bypasses(Inherits, ("route",)) == []  # nothing below it overrides
    assert bypass.find_bypasses(Hooked, ("absent",)) == []  # the hook-target checks report a missing method


def test_rule_with_the_wrapper_installed_flags_a_replacement_but_not_a_wraps_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the plugin's (marked) wrapper on the hooked class, a later plugin's replacement of it is a bypass of every
    class; a ``functools.wraps`` copy of the wrapper (which calls it) keeps the mark and passes."""
    class Base:
        def route(self) -> str:
            return "engine"

    def ours(self: Any) -> str:
        return "oea"

    setattr(ours, WRAPPED, True)
    monkeypatch.setattr(Base, "route", ours)
    assert bypass.find_bypasses(Base, ("route",), wrapped=True) == []
    monkeypatch.setattr(Base, "route", functools.wraps(ours)(lambda self: ours(self)))
    assert bypass.find_bypasses(Base, ("route",), wrapped=True) == []
    monkeypatch.setattr(Base, "route", lambda self: "replaced")
    found = bypass.find_bypasses(Base, ("route",), wrapped=True)
    assert len(found) == 1 and "replaced after OEA wrapped it" in found[0].found
    assert bypass.find_bypasses(Base, ("route",)) == []  # without the wrapper installed only overrides count


def test_doctor_check_fails_naming_every_class_and_when_it_cannot_look() -> None:
    ok = bypass.doctor_check(lambda: ([], "route of Hooked"))
    assert ok["ok"] and ok["name"] == bypass.CHECK_NAME and "bypass" in ok["name"] and "route of Hooked" in ok["detail"]
    failed = bypass.doctor_check(lambda: (bypass.find_bypasses(Hooked, ("route",)), ""))
    assert not failed["ok"] and "PlatformRouter bypasses OEA" in failed["detail"] and "PlatformHeir" in failed["detail"]

    def broken() -> tuple[list[bypass.Bypass], str]:
        raise ImportError("no module named 'platform_x'")

    unchecked = bypass.doctor_check(broken)
    assert not unchecked["ok"] and "ImportError: no module named 'platform_x'" in unchecked["detail"]


def test_startup_warning_never_raises_and_says_when_it_could_not_look() -> None:
    said: list[tuple[str, str]] = []

    def broken() -> tuple[list[bypass.Bypass], str]:
        raise RuntimeError("boom")

    assert bypass.startup_warning(broken, lambda key, message: said.append((key, message))) == []
    assert len(said) == 1 and "could not check the router classes" in said[0][1] and "boom" in said[0][1]


# --------------------------------------------------------------------------- vLLM


def _vllm_routers(monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    """Stand-ins of vLLM's wrapped router classes (each with its own ``_compute_routing``, vLLM's attribute names)
    in the modules the plugin imports them from, plus the worker and ``FusedMoERouter`` modules ``install_hooks``
    patches; fresh classes per test, so the wrapping never leaks."""
    vllm_si.install_vllm(monkeypatch)

    def _compute_routing(self: Any, hidden_states: Any, router_logits: torch.Tensor, indices_type: Any, *,
                         input_ids: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        return vllm_si.CPURouter.route_stock(self, router_logits)

    classes = {}
    for name, module in vllm_plugin.ROUTER_CLASSES.items():
        cls = type(name, (vllm_si.CPURouter,), {"_compute_routing": _compute_routing,
                                                "__module__": f"{ROUTERS}.{module}"})
        stand_in_module(monkeypatch, f"{ROUTERS}.{module}").__dict__[name] = cls
        classes[name] = cls
    stand_in_module(monkeypatch, f"{ROUTERS}.fused_moe_router").FusedMoERouter = type("FusedMoERouter", (), {})
    stand_in_module(monkeypatch, "vllm.v1.worker.gpu_worker").Worker = type(
        "Worker", (), {"load_model": lambda self: None})
    stand_in_module(monkeypatch, "vllm.v1.worker.worker_base").WorkerWrapperBase = type(
        "WorkerWrapperBase", (), {"execute_model": lambda self, scheduler_output: None})
    monkeypatch.setattr(vllm_plugin, "define_cpu_op", lambda: None)  # a torch custom op, defined once per process
    return classes


def platform_router(base: type, name: str = "") -> type:
    """Stands in for a platform's substituted vLLM router: a subclass of one of vLLM's routers whose
    ``_compute_routing`` runs the platform's own kernel (here: vLLM's routing, so only the path differs), named
    ``name`` (default: ``NPU`` + the base's name) in the platform's module."""
    def _compute_routing(self: Any, hidden_states: Any, router_logits: torch.Tensor, indices_type: Any, *,
                         input_ids: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        return vllm_si.CPURouter.route_stock(self, router_logits)

    return type(name or f"NPU{base.__name__}", (base,), {"_compute_routing": _compute_routing,
                                                         "__module__": "npu_platform"})


class _Layer(torch.nn.Module):
    """A vLLM MoE layer as model load sees it: a parameter (the device) and its router."""

    def __init__(self, router: object) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 64, bias=False)
        self.router = router


@pytest.mark.parametrize("substituted", [True, False], ids=["substituted", "stock"])
def test_vllm_register_warns_once_per_substituted_router(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, substituted: bool) -> None:
    """``register`` (every vLLM process) with ``OEA_K0=2`` after a platform defined its router: one warning naming
    the class and the method, however often ``register`` runs; vLLM's own classes, wrapped, are not named."""
    classes = _vllm_routers(monkeypatch)
    if substituted:
        platform_router(classes["FusedTopKRouter"])
    vllm_si.swap_state(monkeypatch, VllmState())
    monkeypatch.setenv("OEA_K0", "2")
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        vllm_plugin.register()
        vllm_plugin.STATE.installed = False  # a second process-wide call (vLLM loads plugins more than once)
        vllm_plugin.register()
    assert all(getattr(cls.__dict__["_compute_routing"], WRAPPED, False) for cls in classes.values())
    warned = _bypass_warnings(caplog)
    if substituted:
        assert len(warned) == 1, warned
        assert "router class npu_platform.NPUFusedTopKRouter bypasses OEA: its _compute_routing" in warned[0]
        assert f"{ROUTERS}.fused_topk_router.FusedTopKRouter._compute_routing" in warned[0]
    else:
        assert warned == []


@pytest.mark.parametrize("name", ["NPUFusedTopKRouter", "FusedTopKRouter"], ids=["own-name", "vllms-name"])
def test_vllm_model_load_keeps_a_substituted_routers_layers_on_its_routing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str) -> None:
    """``Worker.load_model``'s hook: a layer routed by a substituted class (defined after ``register``; also one that
    keeps vLLM's class name) is not rewritable and is said once, in the bypass check's words; vLLM's own router
    beside it is rewritable."""
    classes = _vllm_routers(monkeypatch)
    vllm_si.swap_state(monkeypatch, VllmState(settings=settings_from_env({"OEA_K0": "2"}), mode="oea"))
    vllm_plugin.install_hooks()
    platform = platform_router(classes["FusedTopKRouter"], name)  # a general plugin that ran after ours
    layers = [classes["FusedTopKRouter"](), platform(), platform()]
    model = torch.nn.Sequential(*(_Layer(router) for router in layers))
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        vllm_plugin._after_load(model)
    state = vllm_plugin.STATE
    assert state.specs[0] is not None and state.specs[1:] == [None, None]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and f"npu_platform.{name} bypasses OEA" in warned[0], warned


def test_vllm_wrapper_replaced_by_a_later_plugin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A platform plugin that runs after ours and patches vLLM's own class (no subclass) replaces the wrapper: every
    layer of that class bypasses OEA, so the class itself is named; before the plugin wrapped anything, vLLM's own
    function there is no bypass."""
    classes = _vllm_routers(monkeypatch)
    vllm_si.swap_state(monkeypatch, VllmState(mode="oea"))
    assert vllm_plugin.router_bypasses()[0] == []  # not wrapped yet: vLLM's own _compute_routing is the path
    vllm_plugin.install_hooks()
    assert vllm_plugin.router_bypasses()[0] == []
    monkeypatch.setattr(classes["CPURouter"], "_compute_routing", lambda self, *args, **kwargs: None)
    found = vllm_plugin.router_bypasses()[0]
    assert [b.router for b in found] == [f"{ROUTERS}.cpu_router.CPURouter"]
    assert "replaced after OEA wrapped it" in found[0].message


def test_vllm_startup_check_that_raises_warns_and_lets_the_server_start(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _vllm_routers(monkeypatch)
    vllm_si.swap_state(monkeypatch, VllmState())

    def broken() -> list[type]:
        raise RuntimeError("a platform module that cannot be imported")

    monkeypatch.setattr(vllm_plugin, "hooked_router_classes", broken)
    monkeypatch.setenv("OEA_K0", "2")
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        vllm_plugin.register()
    assert vllm_plugin.STATE.installed
    warned = _bypass_warnings(caplog)
    assert len(warned) == 1 and "could not check the router classes" in warned[0], warned


@pytest.mark.parametrize("substituted", [True, False], ids=["substituted", "stock"])
def test_vllm_doctor_fails_naming_a_router_a_general_plugin_substitutes(
        monkeypatch: pytest.MonkeyPatch, substituted: bool) -> None:
    """``oea doctor vllm`` looks after running vLLM's general plugins, as a server does: a plugin that defines its
    router there is found."""
    classes = _vllm_routers(monkeypatch)
    vllm_si.swap_state(monkeypatch, VllmState())
    stand_in_module(monkeypatch, "vllm.plugins").load_general_plugins = (
        (lambda: platform_router(classes["GroupedTopKRouter"])) if substituted else (lambda: None))
    monkeypatch.setattr(vllm_doctor, "engine_version", lambda: "0.32.0")
    monkeypatch.setattr(vllm_doctor, "_hook_target_checks", lambda: [])
    monkeypatch.setattr(vllm_doctor, "_self_test", lambda: bypass.check("self-test (CPURouter)", True, ""))
    monkeypatch.setattr(vllm_doctor, "doctor_placement", lambda: "")
    found = [c for c in vllm_doctor.doctor_checks() if "bypass" in c["name"]]
    assert len(found) == 1, found
    if substituted:
        assert not found[0]["ok"] and "npu_platform.NPUGroupedTopKRouter bypasses OEA" in found[0]["detail"]
    else:
        assert found[0]["ok"] and "FusedTopKRouter (+0 subclasses)" in found[0]["detail"], found
        assert "after vLLM's general plugins ran" in found[0]["detail"]


# --------------------------------------------------------------------------- SGLang


def _sglang_topk(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in ``TopK`` in the stand-in ``topk`` module: SGLang's dispatching ``forward`` and platform forwards
    that reach ``select_experts``, and the out-of-tree forward registry of SGLang 0.5.23's ``BaseFusedOp``."""
    module = topk_module(monkeypatch)

    class TopK(torch.nn.Module):
        _oot_forward_registry: ClassVar[dict[str, dict[type, Any]]] = {}

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.forward_cuda(*args, **kwargs)

        def forward_native(self, *args: Any, **kwargs: Any) -> Any:
            return module.select_experts(*args, **kwargs)

        def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
            return module.select_experts(*args, **kwargs)

    TopK.__module__, TopK.__qualname__ = module.__name__, "TopK"
    module.TopK = TopK
    return TopK


def platform_topk(base: type) -> type:
    """Stands in for a platform's substituted SGLang router: a ``TopK`` whose CUDA forward runs its own kernel."""
    return type("NPUTopK", (base,), {"forward_cuda": lambda self, *args, **kwargs: None, "__module__": "npu_platform"})


def _sglang_registry(monkeypatch: pytest.MonkeyPatch, load_plugins: Any = lambda: None) -> None:
    """Stand-ins of SGLang's plugin loader and ``HookRegistry`` (accepts every hook)."""
    stand_in_module(monkeypatch, "sglang.srt.plugins").load_plugins = load_plugins
    registry = stand_in_module(monkeypatch, "sglang.srt.plugins.hook_registry")
    registry.HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")
    registry.HookRegistry = types.SimpleNamespace(register=lambda target, hook, kind: None)


@pytest.mark.parametrize("substituted", [True, False], ids=["substituted", "stock"])
def test_sglang_register_warns_once_per_substituted_router(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, substituted: bool) -> None:
    fresh_sglang_state(monkeypatch)
    topk = _sglang_topk(monkeypatch)
    if substituted:
        platform_topk(topk)
    _sglang_registry(monkeypatch)
    monkeypatch.setenv("OEA_K0", "2")
    with caplog.at_level(logging.WARNING, logger=sglang_plugin.log.name):
        sglang_plugin.register()
        sglang_plugin.register()  # every SGLang process runs it; a second call says nothing new
    warned = _bypass_warnings(caplog)
    if substituted:
        assert len(warned) == 1, warned
        assert "router class npu_platform.NPUTopK bypasses OEA: its forward_cuda is its own override" in warned[0]
    else:
        assert warned == []


def test_sglang_register_without_topk_imported_looks_at_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No ``TopK`` subclass exists before SGLang's topk module is imported, and ``register`` must not import it."""
    fresh_sglang_state(monkeypatch)
    _sglang_registry(monkeypatch)
    monkeypatch.delitem(sys.modules, sglang_plugin.targets.TOPK_MODULE, raising=False)
    monkeypatch.setattr(sglang_plugin, "topk_bypasses", lambda: pytest.fail("looked without SGLang's topk"))
    monkeypatch.setenv("OEA_K0", "2")
    with caplog.at_level(logging.WARNING, logger=sglang_plugin.log.name):
        sglang_plugin.register()
    assert _bypass_warnings(caplog) == []


@pytest.mark.parametrize("how", ["subclass", "out-of-tree forward", "stock"])
def test_sglang_doctor_fails_naming_a_router_a_plugin_substitutes(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``oea doctor sglang`` looks after SGLang's ``load_plugins()``: a plugin that defines a ``TopK`` subclass or
    registers an out-of-tree forward for ``TopK`` there is named."""
    fresh_sglang_state(monkeypatch)
    topk = _sglang_topk(monkeypatch)

    def load_plugins() -> None:
        if how == "subclass":
            platform_topk(topk)
        elif how == "out-of-tree forward":
            topk._oot_forward_registry["npu"] = {topk: lambda self, *args: None}

    monkeypatch.setattr(topk, "_oot_forward_registry", {})
    _sglang_registry(monkeypatch, load_plugins)
    found = [c for c in sglang_doctor.doctor_checks() if "bypass" in c["name"]]
    assert len(found) == 1, found
    detail = found[0]["detail"]
    if how == "subclass":
        assert not found[0]["ok"] and "npu_platform.NPUTopK bypasses OEA: its forward_cuda" in detail
    elif how == "out-of-tree forward":
        assert not found[0]["ok"] and f"{topk.__module__}.{topk.__qualname__} bypasses OEA: its forward" in detail
        assert "out-of-tree forward for platform 'npu'" in detail
    else:
        assert found[0]["ok"] and "forward and 2 forward_* methods of TopK (+0 subclasses)" in detail, detail
