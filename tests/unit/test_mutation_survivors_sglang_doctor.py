"""``oea doctor sglang`` (``oea.integrations.sglang.doctor``) against a whole stand-in SGLang in ``sys.modules``:
the checks a user reads, their words and the order they come in, what each failure says, and the self-test routed
through the stand-in's ``select_experts`` with OEA's hooks applied by a stand-in ``HookRegistry`` (issue 36, the
generated mutants of ``doctor.py`` and ``sglang/__init__.py`` that the existing tests let through).

The stand-in is SGLang's layout as the doctor reads it (``_sglang``): packages with a ``__path__`` (so the doctor's
``_import_target`` walks submodules and attributes as it does on a real installation), ``load_plugins`` running the
plugin's ``register`` and then ``HookRegistry.apply_hooks``, a ``select_experts`` that routes with ``oea.route`` and
hands its ids to ``_post_process_topk_ids`` as SGLang does, the graph runners of 0.5.12-0.5.13 or 0.5.14+, and
``forward_context`` with or without the batch (0.5.23 / 0.5.13-0.5.22).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, topk_config, topk_module

import oea
import oea.integrations.sglang as sglang_package
import oea.integrations.sglang.doctor as doctor
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.plugin as plugin
import oea.integrations.sglang.targets as targets
import oea.kernels.dispatch as dispatch

EXECUTOR = targets.MODEL_EXECUTOR
VERSION = "0.5.23"
SUPPORTED = targets.SUPPORTED_VERSIONS


class HookType(enum.Enum):
    """SGLang's ``HookType``."""

    BEFORE = 1
    AFTER = 2
    AROUND = 3


class _Registry:
    """SGLang's ``HookRegistry``: ``register`` keeps each hook, ``apply_hooks`` wraps the targets (here with the
    plugin's own ``_patch``, which wraps as SGLang does) and, as SGLang, logs a target it cannot hook and goes on."""

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        self.registered: list[tuple[str, Any, HookType]] = []
        self.skip = skip  # targets this SGLang fails to hook (HookRegistry would log each)

    def register(self, target: str, hook: Any, kind: HookType) -> None:
        self.registered.append((target, hook, kind))

    def apply_hooks(self) -> None:
        for target, hook, kind in self.registered:
            if target not in self.skip:
                plugin._patch(target, hook, kind.name)


def _module(monkeypatch: pytest.MonkeyPatch, name: str, package: bool = False) -> types.ModuleType:
    """A stand-in module ``name`` in ``sys.modules`` for this test; a package has a ``__path__`` (empty: nothing
    on disk), so importing a submodule it lacks raises ``ModuleNotFoundError`` naming that submodule."""
    module = types.ModuleType(name)
    if package:
        module.__path__ = []
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _sglang(monkeypatch: pytest.MonkeyPatch, *, forward_context: str | None = "batch", cuda: str | None = "decode",
            cpu: bool = True, post_process: bool = True, registry: bool = True, skip: tuple[str, ...] = (),
            load_plugins: Callable[[], None] | None = None,
            post_process_ids: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
            ) -> SimpleNamespace:
    """A stand-in SGLang (``forward_context``: ``"batch"`` 0.5.23, ``"batchless"`` 0.5.13-0.5.22, None 0.5.12;
    ``cuda``: the CUDA graph runner of 0.5.14+ ``"decode"``, of 0.5.12-0.5.13 ``"legacy"``, or none; ``skip``:
    targets the ``HookRegistry`` fails to hook; ``load_plugins``: what another plugin does when SGLang loads it;
    ``post_process_ids``: SGLang's own post-processing of the logits' routing, in every forward)."""
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe", "sglang.srt.plugins",
                 EXECUTOR, f"{EXECUTOR}.runner"):
        _module(monkeypatch, name, package=True)
    monkeypatch.setattr(doctor, "engine_version", lambda: VERSION)
    monkeypatch.setattr(targets, "engine_version", lambda: VERSION)
    topk = topk_module(monkeypatch, fused=lambda cfg: False)
    output = collections.namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")
    seen: list[dict[str, Any]] = []

    def _post_process_topk_ids(*, topk_ids: Any, topk_weights: Any, topk_config: Any, router_logits: Any,
                               layer_id: Any, num_token_non_padded: Any,
                               expert_location_dispatch_info: Any = None) -> tuple[Any, Any]:
        if post_process_ids is not None:
            ids, weights = post_process_ids(router_logits)
            return ids.to(torch.int32), weights
        return topk_ids, topk_weights

    def select_experts(hidden_states: torch.Tensor, router_logits: torch.Tensor, topk_config: Any, *,
                       layer_id: int | None = None, num_token_non_padded: Any = None) -> Any:
        seen.append({"hidden": tuple(hidden_states.shape), "top_k": topk_config.top_k, "layer_id": layer_id,
                     "compile": not torch._dynamo.config.disable})  # SGLang compiles some routings (torch.compile)
        spec = oea.RouterSpec(router_logits.shape[1], topk_config.top_k, "softmax", topk_config.renormalize)
        ids, weights = oea.route(router_logits, spec)
        if hasattr(topk, "_post_process_topk_ids"):  # looked up at call time, as SGLang does
            ids, weights = topk._post_process_topk_ids(
                topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=topk_config,
                router_logits=router_logits, layer_id=layer_id, num_token_non_padded=num_token_non_padded)
        return output(weights, ids, router_logits)

    class TopK:
        def forward(self, *args: Any) -> None: ...

        def forward_cuda(self, *args: Any) -> None: ...

    if post_process:
        topk._post_process_topk_ids = _post_process_topk_ids
    topk.select_experts = select_experts
    configs: list[dict[str, Any]] = []

    def TopKConfig(**fields: Any) -> Any:  # SGLang's class, as the doctor calls it
        configs.append(fields)
        return topk_config(**fields)

    topk.TopKConfig = TopKConfig
    topk.TopK = TopK
    hook_registry = _Registry(skip)

    def _load_plugins() -> None:  # SGLang's loader: every entry point (ours), then the registered hooks
        sglang_package.register()
        if load_plugins is not None:
            load_plugins()
        hook_registry.apply_hooks()

    sys.modules["sglang.srt.plugins"].load_plugins = _load_plugins
    if registry:
        module = _module(monkeypatch, "sglang.srt.plugins.hook_registry")
        module.HookRegistry, module.HookType = hook_registry, HookType
    _module(monkeypatch, f"{EXECUTOR}.forward_batch_info").ForwardMode = FakeMode
    entered: list[Any] = []
    if forward_context is not None:
        fc = _module(monkeypatch, targets.FORWARD_CONTEXT_MODULE)
        fc.ForwardContext = lambda *args, **kwargs: SimpleNamespace(args=args, kwargs=kwargs)
        if forward_context == "batch":
            @contextlib.contextmanager
            def with_batch(ctx: Any, *, forward_batch: Any = None) -> Iterator[None]:
                entered.append(SimpleNamespace(ctx=ctx, batch=forward_batch))
                yield
            fc.forward_context = with_batch
        else:
            @contextlib.contextmanager
            def batchless(ctx: Any) -> Iterator[None]:
                entered.append(SimpleNamespace(ctx=ctx, batch=None))
                yield
            fc.forward_context = batchless

    class ModelRunner:
        def forward(self, forward_batch: Any, skip_attn_backend_init: bool | None = None) -> Any: ...

    _module(monkeypatch, f"{EXECUTOR}.model_runner").ModelRunner = ModelRunner

    class CudaGraphRunner:  # 0.5.12-0.5.13
        def capture_one_batch_size(self, bs: int, forward: Any, stream_idx: int | None = None) -> Any: ...

        def replay_prepare(self, forward_batch: Any, pp_proxy_tensors: Any = None) -> None: ...

    class DecodeCudaGraphRunner:  # 0.5.14+
        def capture_one_shape(self, size: int, forward: Any, stream_idx: int | None = None) -> Any: ...

        def load_batch(self, forward_batch: Any, **kwargs: Any) -> Any: ...

    class CPUGraphRunner:
        def capture_one_batch_size(self, bs: int, forward: Any, skip_cross_attention: bool = False) -> Any: ...

        def prepare_replay(self, forward_batch: Any) -> Any: ...

    if cuda == "decode":
        _module(monkeypatch, f"{EXECUTOR}.runner.decode_cuda_graph_runner").DecodeCudaGraphRunner = \
            DecodeCudaGraphRunner
    elif cuda == "legacy":
        _module(monkeypatch, f"{EXECUTOR}.cuda_graph_runner").CudaGraphRunner = CudaGraphRunner
    if cpu:
        _module(monkeypatch, f"{EXECUTOR}.cpu_graph_runner").CPUGraphRunner = CPUGraphRunner
    return SimpleNamespace(topk=topk, registry=hook_registry, seen=seen, configs=configs, entered=entered,
                           ModelRunner=ModelRunner, CudaGraphRunner=CudaGraphRunner,
                           DecodeCudaGraphRunner=DecodeCudaGraphRunner, CPUGraphRunner=CPUGraphRunner, TopK=TopK)


@pytest.fixture(autouse=True)
def fresh_plugin_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's state fresh, no ``OEA_*`` setting from outside, and the rewrite on torch: the self-test compares
    with ``oea.route`` whichever kernel reroutes, and numba compiles its kernels at their first use (minutes on a
    loaded machine in a mutation run's fresh tree, past pytest's timeout)."""
    monkeypatch.setattr(dispatch, "numba_available", lambda: False)
    fresh_state(monkeypatch)
    for name in ("OEA_METRICS_FILE", "OEA_POLICY", "OEA_LAYER_K0_FILE", "OEA_MAX_EXPERTS", "OEA_GROUP_FILL",
                 "OEA_APPLY_TO_VERIFY", "PROMETHEUS_MULTIPROC_DIR", "OEA_PROMETHEUS", targets.DETERMINISTIC_VARIABLE,
                 *targets.SIMULATION_VARIABLES):
        monkeypatch.delenv(name, raising=False)


def _checks() -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doctor.doctor_checks()}


def _logits(rows: int, experts: int) -> torch.Tensor:
    """The logits the self-test routes (its own seed), made here again to work out what it must report."""
    return torch.randn(rows, experts, generator=torch.Generator().manual_seed(0)) * 2.0


def _active(top_k: int, k0: int | None) -> tuple[int, int]:
    """Active experts of the self-test's 16 rows over 8 * top_k experts: SGLang's routing and OEA's at ``k0``."""
    logits, spec = _logits(16, 8 * top_k), oea.RouterSpec(8 * top_k, top_k, "softmax", True)
    vanilla = oea.route(logits, spec)
    pruned = oea.route(logits, spec, oea.OEAConfig(k0=k0 or 1))
    return int(oea.active_experts(*vanilla)), int(oea.active_experts(*pruned))


SELECT = targets.SELECT_EXPERTS_TARGET
POST = targets.POST_PROCESS_TARGET
FC = targets.FORWARD_CONTEXT_TARGET
SGLANG_OWN = ("SGLang's own num_token_non_padded is used instead where SGLang keeps one (EP > 1, DP-attention "
              "gathering, a custom all-to-all)")
BATCH_HOW = (f"AROUND {FC}(ctx, *, forward_batch): every forward and graph capture carries its batch's "
             "forward_mode")


def test_every_check_in_order_with_oea_off_and_the_self_test_forced_to_k0_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang 0.5.23 without ``OEA_K0``: every check passes but the EP placement (no ``sglang.srt.eplb`` here), in
    the order the report prints them; the self-test still routes through ``select_experts`` (k0 forced to 1)."""
    sgl = _sglang(monkeypatch)
    checks = doctor.doctor_checks()
    names = [c["name"] for c in checks]
    assert names == ["version", "environment", "deterministic mode", "entry point registered", "entry point loads",
                     "imports", "plugin system", f"hook target {FC}", f"hook target {SELECT}", f"hook target {POST}",
                     "hooks live", "decode detection", "self-test select_experts", "cuda-graph padding",
                     "ep placement", "prometheus export", "router bypass"]
    by_name = {c["name"]: c for c in checks}
    assert [n for n, c in by_name.items() if not c["ok"]] == ["ep placement"], checks
    assert by_name["version"]["detail"] == f"sglang {VERSION}; supported {SUPPORTED}"
    assert by_name["environment"]["detail"] == ("OEA off: OEA_K0 (or SGLANG_OEA_K0) unset; SGLang routing stays "
                                                "unmodified")
    assert by_name["imports"]["detail"] == f"{targets.TOPK_MODULE} and the dependencies it imports"
    assert by_name["plugin system"]["detail"] == "sglang.srt.plugins.load_plugins and HookRegistry available"
    assert by_name[f"hook target {FC}"]["detail"] == f"{FC}(ctx, forward_batch)"
    assert by_name[f"hook target {SELECT}"]["detail"] == (
        f"{SELECT}(hidden_states, router_logits, topk_config, layer_id, num_token_non_padded)")
    assert by_name[f"hook target {POST}"]["detail"] == (
        f"{POST}(topk_ids, topk_weights, topk_config, router_logits, layer_id, num_token_non_padded, "
        "expert_location_dispatch_info)")
    assert by_name["hooks live"]["detail"] == "OEA off: plugin loaded, no hooks installed (set OEA_K0 to enable)"
    assert by_name["decode detection"]["detail"] == f"OEA off; with OEA_K0 set: {BATCH_HOW}"
    vanilla, pruned = _active(8, 1)
    assert vanilla != pruned
    assert by_name["self-test select_experts"]["detail"] == (
        f"DECODE 16 rows, 64 experts, top-8, k0=1: active experts {vanilla} -> {pruned}, equal to oea.route; "
        "EXTEND unchanged (OEA is off here: self-test forced k0=1)")
    assert sgl.seen == [{"hidden": (16, 1), "top_k": 8, "layer_id": 0, "compile": False}] * 2
    # SGLang's torch-native softmax path (the fused default needs a GPU kernel)
    assert sgl.configs == [{"top_k": 8, "renormalize": True, "torch_native": True}]  # one DECODE and one EXTEND call
    assert [(seen.batch.forward_mode, seen.batch.moe_num_token_non_padded) for seen in sgl.entered] == [
        (FakeMode.DECODE, None), (FakeMode.EXTEND, None)]  # through SGLang's forward_context, with the batch
    assert [(seen.ctx.args, seen.ctx.kwargs) for seen in sgl.entered] == [((), {"attn_backend": None})] * 2
    assert by_name["cuda-graph padding"]["detail"] == (
        "OEA off; with OEA_K0 set, OEA's replay count (DecodeCudaGraphRunner.load_batch, "
        "CPUGraphRunner.prepare_replay) keeps the padding rows of graph-replayed decode batches out of the union at "
        f"plain TP; {SGLANG_OWN}")
    assert by_name["ep placement"]["detail"] == "ModuleNotFoundError: No module named 'sglang.srt.eplb'"
    assert by_name["prometheus export"]["detail"] == "off (OEA_K0 unset: no oea_* series)"
    assert by_name["router bypass"]["detail"] == (
        "every router class routes through OEA's hook: forward and 1 forward_* methods of "
        f"{sgl.TopK.__qualname__} (+0 subclasses), after SGLang's load_plugins()")


@pytest.mark.parametrize(("env", "top_k", "words"), [
    ({"OEA_K0": "2"}, 8, "k0=2, min_batch=2, max_experts=top_k, group_fill=in, apply_to_verify=False (OEA_K0=2)"),
    ({"OEA_K0": "10", "OEA_MIN_BATCH": "4"}, 10,
     "k0=10, min_batch=4, max_experts=top_k, group_fill=in, apply_to_verify=False (OEA_K0=10, OEA_MIN_BATCH=4)"),
    ({"OEA_K0": "2", "OEA_MAX_EXPERTS": "12", "OEA_APPLY_TO_VERIFY": "1", "OEA_GROUP_FILL": "cross"}, 12,
     "k0=2, min_batch=2, max_experts=12, group_fill=cross, apply_to_verify=True (OEA_K0=2, OEA_MAX_EXPERTS=12)"),
])
def test_with_oea_on_the_hooks_are_live_and_the_self_test_routes_at_the_configured_k0(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], top_k: int, words: str) -> None:
    """``OEA_K0`` set: the environment as the plugin reads it, the hooks installed by SGLang's own
    ``load_plugins``, and the self-test at the configured k0 over ``max(8, k0, OEA_MAX_EXPERTS)`` slots."""
    sgl = _sglang(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    checks = _checks()
    assert [n for n, c in checks.items() if not c["ok"]] == ["ep placement"], checks
    assert checks["environment"]["detail"] == f"OEA on: {words}"
    assert checks["hooks live"]["detail"] == f"installed on {FC}, {SELECT}, {POST}"
    assert checks["decode detection"]["detail"] == f"live: {BATCH_HOW}"
    k0 = int(env["OEA_K0"])
    vanilla, pruned = _active(top_k, k0)
    assert checks["self-test select_experts"]["detail"] == (
        f"DECODE 16 rows, {8 * top_k} experts, top-{top_k}, k0={k0}: active experts {vanilla} -> {pruned}, equal "
        "to oea.route; EXTEND unchanged")
    assert sgl.seen == [{"hidden": (16, 1), "top_k": top_k, "layer_id": 0, "compile": False}] * 2
    assert checks["cuda-graph padding"]["detail"] == (
        "OEA's replay count (DecodeCudaGraphRunner.load_batch, CPUGraphRunner.prepare_replay hooked): padding rows "
        f"of graph-replayed decode batches stay out of the union at plain TP; {SGLANG_OWN}")


@pytest.mark.parametrize(("found", "ok", "detail"), [
    (None, False, "sglang is not installed"),
    ("0.5.11", False, f"sglang 0.5.11 has no plugin system; supported: {SUPPORTED}"),
    ("0.5.12", True, f"sglang 0.5.12; supported {SUPPORTED}"),
    ("0.5.23rc1", True, f"sglang 0.5.23rc1; supported {SUPPORTED}"),
    ("0.5.24", True, f"sglang 0.5.24 (newer than tested {targets.TESTED_VERSION}); supported {SUPPORTED}"),
    ("0.6.0", True, f"sglang 0.6.0 (newer than tested {targets.TESTED_VERSION}); supported {SUPPORTED}"),
])
def test_the_version_check_names_an_sglang_without_a_plugin_system_and_one_newer_than_tested(
        monkeypatch: pytest.MonkeyPatch, found: str | None, ok: bool, detail: str) -> None:
    """0.5.12 is the first with a plugin system (the bound itself passes); a version past the tested one passes
    with a note; a missing SGLang is said."""
    monkeypatch.setattr(doctor, "engine_version", lambda: found)
    assert doctor.check_call("version", doctor._check_version) == {"name": "version", "ok": ok, "detail": detail}


def test_the_environment_names_the_ep_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OEA_K0", "3")
    monkeypatch.setenv("OEA_POLICY", "ep")
    assert doctor._check_environment() == ("OEA on: k0=3, min_batch=2, max_experts=top_k, group_fill=in, "
                                           "apply_to_verify=False, policy=ep (OEA_K0=3)")
    monkeypatch.setenv("OEA_POLICY", "oea")
    assert ", policy=" not in doctor._check_environment()


def test_a_malformed_variable_fails_each_check_that_needs_the_settings_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``OEA_K0=three``: the environment check names the variable, the self-test is skipped, and the checks that
    still run read the same reason (never a traceback, never SGLang's own routing said to be fine)."""
    _sglang(monkeypatch)
    monkeypatch.setenv("OEA_K0", "three")
    checks = _checks()
    reason = checks["environment"]["detail"]
    assert not checks["environment"]["ok"] and reason.startswith("OEA_K0 must be an integer"), reason
    assert "hooks live" not in checks and "decode detection" not in checks
    assert checks["self-test select_experts"] == {
        "name": "self-test select_experts", "ok": False,
        "detail": "skipped: fix the failed checks above first; until then SGLang serves without OEA"}
    assert checks["cuda-graph padding"] == {"name": "cuda-graph padding", "ok": False, "detail": reason}
    assert checks["deterministic mode"]["detail"] == reason
    bypass = checks["router bypass"]  # SGLang's load_plugins runs register, which refuses the value
    assert not bypass["ok"] and bypass["detail"] == (
        f"could not check the router classes: RuntimeError: SGLang's plugins did not load: oea: invalid OEA "
        f"configuration: {reason}"), bypass
    for settings in (None, ValueError("OEA_MIN_BATCH must be an integer")):
        with pytest.raises(RuntimeError) as raised:
            doctor._readable(settings)
        assert str(raised.value) == (reason if settings is None else "OEA_MIN_BATCH must be an integer")
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert doctor.check_decode_detection() == {"name": "decode detection", "ok": False, "detail": reason}


def test_an_sglang_without_the_hook_registry_fails_the_plugin_system_and_skips_the_self_test(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``hook_registry`` module (an SGLang before 0.5.12): a version problem, said as one; the hook targets
    are still looked at, the self-test is skipped, and the checks after the imports still run."""
    _sglang(monkeypatch, registry=False)
    checks = doctor.doctor_checks()
    by_name = {c["name"]: c for c in checks}
    module = "sglang.srt.plugins.hook_registry"
    assert by_name["plugin system"] == {
        "name": "plugin system", "ok": False,
        "detail": f"{module}: No module named {module!r}; supported SGLang versions: {SUPPORTED}"}
    assert [c["name"] for c in checks][6:] == [
        "plugin system", f"hook target {FC}", f"hook target {SELECT}", f"hook target {POST}",
        "self-test select_experts", "cuda-graph padding", "ep placement", "prometheus export", "router bypass"]
    assert all(by_name[f"hook target {t}"]["ok"] for t in (FC, SELECT, POST))
    assert not by_name["self-test select_experts"]["ok"]


def test_an_sglang_whose_topk_module_cannot_be_imported_is_a_broken_installation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing SGLang's MoE module raises (not a missing module): the imports check says so in one line and only
    the checks that need no SGLang import follow."""
    _sglang(monkeypatch)
    monkeypatch.setitem(sys.modules, targets.TOPK_MODULE, None)  # importing it raises ModuleNotFoundError

    def broken(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == targets.TOPK_MODULE:
            raise RuntimeError("operator torchvision::nms\n does not exist")
        return real(name, *args, **kwargs)

    real = doctor.importlib.import_module
    monkeypatch.setattr(doctor.importlib, "import_module", broken)
    checks = doctor.doctor_checks()
    assert [c["name"] for c in checks] == ["version", "environment", "deterministic mode", "entry point registered",
                                           "entry point loads", "imports", "self-test select_experts"]
    assert checks[5] == {"name": "imports", "ok": False, "detail": (
        f"SGLang could not import {targets.TOPK_MODULE}: RuntimeError: operator torchvision::nms does not exist (a "
        "broken installation of sglang or of one of its dependencies in this interpreter, not an SGLang version "
        "problem)")}


def _failed_target(target: str) -> str:
    with pytest.raises(RuntimeError) as raised:
        doctor._check_target(target)
    return str(raised.value)


def test_a_hook_target_that_is_missing_or_lacks_a_parameter_is_a_version_problem(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sgl = _sglang(monkeypatch, post_process=False)
    assert _failed_target(POST) == (
        f"missing target {POST} (module {targets.TOPK_MODULE!r} has no attribute '_post_process_topk_ids'); "
        f"supported SGLang versions: {SUPPORTED}; SGLang will serve unmodified (HookRegistry logs the failure)")
    checks = _checks()
    assert not checks[f"hook target {POST}"]["ok"] and checks[f"hook target {SELECT}"]["ok"]
    assert "hooks live" not in checks  # an SGLang that cannot be hooked is not said to be live

    def select_experts(hidden_states: Any, router_logits: Any, topk_config: Any) -> None: ...

    sgl.topk.select_experts = select_experts
    assert _failed_target(SELECT) == (f"{SELECT} lacks parameter(s) ['num_token_non_padded']; supported SGLang "
                                      f"versions: {SUPPORTED}")


def test_a_hooked_target_is_read_through_its_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once SGLang's ``HookRegistry`` wrapped a target (``functools.wraps``), the check reads the original's
    parameters, not the wrapper's ``*args, **kwargs``."""
    _sglang(monkeypatch)
    monkeypatch.setenv("OEA_K0", "2")
    sys.modules["sglang.srt.plugins"].load_plugins()
    assert doctor._check_target(SELECT) == (
        f"{SELECT}(hidden_states, router_logits, topk_config, layer_id, num_token_non_padded)")
    checks = _checks()  # a second doctor run in the same process: every target already wrapped
    assert all(c["ok"] for name, c in checks.items() if name != "ep placement"), checks


def _declaring_wrapper(original: Any) -> Any:
    """A decorator's wrapper that declares a signature of its own (``__signature__``: ``*args, **kwargs``) over the
    function it wraps (``__wrapped__``), which ``inspect.signature`` alone would stop at."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    wrapper.__signature__ = inspect.signature(wrapper)  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    assert list(inspect.signature(wrapper).parameters) == ["args", "kwargs"]
    return wrapper


def test_a_target_behind_a_wrapper_declaring_its_own_signature_is_read_as_the_function_it_wraps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook target and the replay hook point are read at the bottom of their ``__wrapped__`` chain: the
    parameters SGLang's call reaches, whatever a wrapper in between declares."""
    sgl = _sglang(monkeypatch)
    sgl.topk.select_experts = _declaring_wrapper(sgl.topk.select_experts)
    assert doctor._check_target(SELECT) == (
        f"{SELECT}(hidden_states, router_logits, topk_config, layer_id, num_token_non_padded)")
    sgl.DecodeCudaGraphRunner.load_batch = _declaring_wrapper(sgl.DecodeCudaGraphRunner.load_batch)
    assert _padding()["ok"], _padding()


def test_a_missing_module_class_or_submodule_on_the_way_to_a_target(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Any) -> None:
    """``_import_target`` imports each package's submodule (letting that module's own import error through) and
    reads attributes past a module."""
    _sglang(monkeypatch, forward_context="batchless", cuda=None, cpu=False)
    runner = targets.MODEL_RUNNER_FORWARD_TARGET
    del sys.modules[f"{EXECUTOR}.model_runner"].ModelRunner
    assert _failed_target(runner) == (
        f"missing target {runner} (module '{EXECUTOR}.model_runner' has no attribute 'ModelRunner'); supported SGLang "
        f"versions: {SUPPORTED}; SGLang will serve unmodified (HookRegistry logs the failure)")
    monkeypatch.delitem(sys.modules, f"{EXECUTOR}.model_runner")
    assert _failed_target(runner) == (
        f"missing target {runner} (module '{EXECUTOR}' has no attribute 'model_runner'); supported SGLang "
        f"versions: {SUPPORTED}; SGLang will serve unmodified (HookRegistry logs the failure)")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # each version of model_runner.py read afresh
    sys.modules[EXECUTOR].__path__ = [str(tmp_path)]  # model_runner.py on disk, importing what it needs
    (tmp_path / "model_runner.py").write_text("import sglang.srt.utils_missing\n")
    doctor.importlib.invalidate_caches()
    assert _failed_target(runner) == (
        f"missing target {runner} (No module named 'sglang.srt.utils_missing'); supported SGLang versions: "
        f"{SUPPORTED}; SGLang will serve unmodified (HookRegistry logs the failure)")
    (tmp_path / "model_runner.py").write_text("import torchvision_missing\n")
    doctor.importlib.invalidate_caches()
    assert _failed_target(runner) == doctor.import_failure(
        ModuleNotFoundError("No module named 'torchvision_missing'", name="torchvision_missing"), runner)
    (tmp_path / "model_runner.py").write_text("raise OSError('libcuda.so:\\n  not found')\n")
    doctor.importlib.invalidate_caches()
    assert _failed_target(runner) == (f"cannot import the module of {runner}: OSError: libcuda.so: not found (an "
                                      "installation problem, not a version mismatch)")
    (tmp_path / "model_runner.py").write_text("class ModelRunner:\n    def forward(self, forward_batch): ...\n")
    doctor.importlib.invalidate_caches()
    assert doctor._check_target(runner) == f"{runner}(self, forward_batch)"
    assert doctor._import_target(runner) is sys.modules[f"{EXECUTOR}.model_runner"].ModelRunner.forward


def test_hooks_installed_without_oea_k0_fail_the_hooks_live_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another entry point that installs the hooks although ``OEA_K0`` is unset (an old launcher in the same
    process): the doctor says so with each target's state."""
    from oea.config import settings_from_env

    _sglang(monkeypatch, load_plugins=lambda: plugin.install_without_registry(settings_from_env({"OEA_K0": "2"})))
    with pytest.raises(RuntimeError) as raised:
        doctor._check_hooks_live(doctor._readable(None))
    status = {FC: True, SELECT: True, POST: True}
    assert str(raised.value) == f"OEA_K0 is unset but hooks are installed: {status}"


def test_a_target_sglang_fails_to_hook_fails_hooks_live_and_decode_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ``HookRegistry`` could not hook ``forward_context`` (it logs why and serves on): both checks name
    the target, the hooks live check only the ones missing, and the self-test says the rewrite is not live."""
    _sglang(monkeypatch, skip=(FC,))
    monkeypatch.setenv("OEA_K0", "2")
    checks = _checks()
    assert checks["hooks live"] == {"name": "hooks live", "ok": False, "detail": (
        f"hooks not installed on [{FC!r}] (HookRegistry logged why); supported SGLang versions: {SUPPORTED}")}
    assert checks["decode detection"] == {"name": "decode detection", "ok": False, "detail": (
        f"not installed on {FC}: decode forwards there keep SGLang's routing (HookRegistry logged why); planned: "
        f"{BATCH_HOW}")}
    assert checks["self-test select_experts"] == {"name": "self-test select_experts", "ok": False, "detail": (
        "DECODE routing through select_experts does not match oea.route: the rewrite hook is not live")}


def test_a_rewrite_outside_decode_fails_the_self_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang whose own post-processing prunes every forward (decode and extend): the DECODE half matches
    ``oea.route`` but the EXTEND half was changed, which OEA must never do."""
    def pruned(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return oea.route(logits, oea.RouterSpec(logits.shape[1], 8, "softmax", True), oea.OEAConfig(k0=2))

    _sglang(monkeypatch, post_process_ids=pruned)
    monkeypatch.setenv("OEA_K0", "2")
    checks = _checks()
    assert checks["hooks live"]["ok"] and checks["decode detection"]["ok"]
    assert checks["self-test select_experts"] == {"name": "self-test select_experts", "ok": False, "detail": (
        "EXTEND routing was changed: OEA must only touch decode steps")}


BATCHLESS_HOW = ("AROUND ModelRunner.forward(self, forward_batch) (eager forwards and graph replays) and the runners' "
                 "capture_forward_mode while graphs are captured ({captures}); {why}")
WITHOUT_BATCH = "its forward_context(ctx) is entered without the batch"


@pytest.mark.parametrize(("layout", "captures", "why"), [
    ({"forward_context": "batchless"}, "DecodeCudaGraphRunner.capture_one_shape, CPUGraphRunner.capture_one_batch_size",
     WITHOUT_BATCH),
    ({"forward_context": None, "cuda": "legacy"},
     "CudaGraphRunner.capture_one_batch_size, CPUGraphRunner.capture_one_batch_size",
     "this SGLang has no forward_context"),
    ({"forward_context": "batchless", "cuda": None, "cpu": False}, "no graph runner found", WITHOUT_BATCH),
])
def test_without_a_batch_in_forward_context_the_doctor_names_the_model_runner_path(
        monkeypatch: pytest.MonkeyPatch, layout: dict[str, Any], captures: str, why: str) -> None:
    """SGLang 0.5.12-0.5.22: decode detection on ``ModelRunner.forward`` and the graph captures, named with the
    reason; the self-test holds the ``ModelRunner.forward`` hook's phase itself (SGLang's ``forward_context`` is
    never entered) and still tells DECODE from EXTEND."""
    sgl = _sglang(monkeypatch, **layout)
    how = BATCHLESS_HOW.format(captures=captures, why=why)
    off = _checks()
    assert off["decode detection"] == {"name": "decode detection", "ok": True,
                                       "detail": f"OEA off; with OEA_K0 set: {how}"}
    assert off["self-test select_experts"]["ok"], off["self-test select_experts"]
    fresh_state(monkeypatch)
    monkeypatch.setenv("OEA_K0", "2")
    on = _checks()
    failed = ["ep placement"] if layout.get("cuda", "decode") else ["cuda-graph padding", "ep placement"]
    assert [n for n, c in on.items() if not c["ok"]] == failed, on
    assert on["decode detection"]["detail"] == f"live: {how}"
    vanilla, pruned = _active(8, 2)
    assert on["self-test select_experts"]["detail"] == (
        f"DECODE 16 rows, 64 experts, top-8, k0=2: active experts {vanilla} -> {pruned}, equal to oea.route; "
        "EXTEND unchanged")
    assert sgl.entered == []


def test_decode_detection_names_every_path_target_not_hooked(monkeypatch: pytest.MonkeyPatch) -> None:
    _sglang(monkeypatch, forward_context="batchless")
    monkeypatch.setenv("OEA_K0", "2")
    captures = "DecodeCudaGraphRunner.capture_one_shape, CPUGraphRunner.capture_one_batch_size"
    how = BATCHLESS_HOW.format(captures=captures, why=WITHOUT_BATCH)
    runner, capture, cpu = (targets.MODEL_RUNNER_FORWARD_TARGET, targets.DECODE_GRAPH_CAPTURE_TARGET,
                            targets.CPU_GRAPH_CAPTURE_TARGET)
    assert doctor.check_decode_detection()["detail"] == (
        f"not installed on {runner}, {capture}, {cpu}: decode forwards there keep SGLang's routing (HookRegistry "
        f"logged why); planned: {how}")
    plugin._patch(runner, dict(doctor.decode_detection())[runner], "AROUND")
    assert doctor.check_decode_detection()["detail"] == (
        f"not installed on {capture}, {cpu}: decode forwards there keep SGLang's routing (HookRegistry "
        f"logged why); planned: {how}")


def _padding(oea_k0: str | None = None) -> dict[str, Any]:
    from oea.config import settings_from_env

    return doctor.check_call("cuda-graph padding",
                             lambda: doctor._check_padding(settings_from_env({"OEA_K0": oea_k0} if oea_k0 else {})))


def _missing(target: str | None) -> str:
    return f"none: {padding.missing_hook_message(target)}"


def test_cuda_graph_padding_names_the_replay_hook_points_this_sglang_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.12-0.5.13 (``CudaGraphRunner.replay_prepare``), with and without the CPU graph runner; with OEA on, a
    CPU replay point not hooked is noted and the CUDA one not hooked fails (padding rows would join the union)."""
    _sglang(monkeypatch, forward_context=None, cuda="legacy")
    assert _padding()["detail"] == (
        "OEA off; with OEA_K0 set, OEA's replay count (CudaGraphRunner.replay_prepare, CPUGraphRunner.prepare_replay) "
        f"keeps the padding rows of graph-replayed decode batches out of the union at plain TP; {SGLANG_OWN}")
    cuda, cpu = padding.LEGACY_REPLAY_TARGET, padding.CPU_REPLAY_TARGET
    assert _padding("2") == {"name": "cuda-graph padding", "ok": False,
                             "detail": f"{_missing(cuda)} (not installed: HookRegistry logged why)"}
    plugin._patch(cuda, padding.replay_around, "AROUND")
    assert _padding("2") == {"name": "cuda-graph padding", "ok": True, "detail": (
        f"OEA's replay count (CudaGraphRunner.replay_prepare, CPUGraphRunner.prepare_replay hooked (CPU graph runner: "
        f"{cpu} not hooked)): padding rows of graph-replayed decode batches stay out of the union at plain TP; "
        f"{SGLANG_OWN}")}
    plugin._patch(cpu, padding.replay_around, "AROUND")
    assert _padding("2")["detail"].startswith(
        "OEA's replay count (CudaGraphRunner.replay_prepare, CPUGraphRunner.prepare_replay hooked): padding rows")
    monkeypatch.delitem(sys.modules, f"{EXECUTOR}.cpu_graph_runner")
    assert _padding("2")["detail"].startswith("OEA's replay count (CudaGraphRunner.replay_prepare hooked): padding")
    assert _padding()["detail"].startswith("OEA off; with OEA_K0 set, OEA's replay count (CudaGraphRunner."
                                           "replay_prepare) keeps")


def test_cuda_graph_padding_fails_without_a_usable_replay_hook_point(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any) -> None:
    """No CUDA graph runner at all, a runner module without its class, a replay preparation without the batch, a
    runner module that cannot be imported: each fails naming what is missing and the workaround."""
    sgl = _sglang(monkeypatch, cuda=None)
    assert _padding() == {"name": "cuda-graph padding", "ok": False, "detail": _missing(None)}
    module = _module(monkeypatch, f"{EXECUTOR}.runner.decode_cuda_graph_runner")
    cuda = padding.DECODE_REPLAY_TARGET
    assert _padding() == {"name": "cuda-graph padding", "ok": False, "detail": _missing(cuda)}

    class DecodeCudaGraphRunner:
        def load_batch(self, batch: Any) -> None: ...

    module.DecodeCudaGraphRunner = DecodeCudaGraphRunner
    assert _padding()["detail"] == (f"none: {cuda} lacks parameter(s) ['forward_batch']; "
                                    f"{padding.missing_hook_message(cuda)}")
    module.DecodeCudaGraphRunner = sgl.DecodeCudaGraphRunner
    assert _padding()["ok"]
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.delitem(sys.modules, f"{EXECUTOR}.runner.decode_cuda_graph_runner")
    monkeypatch.setattr(padding, "_module_file_exists", lambda name: name.endswith(".decode_cuda_graph_runner"))
    sys.modules[f"{EXECUTOR}.runner"].__path__ = [str(tmp_path)]
    for source, detail in (
            ("raise OSError('libcuda.so:\\n  not found')\n", doctor.import_failure(OSError("libcuda.so: not found"),
                                                                                   cuda)),
            ("import torchvision_missing\n", doctor.import_failure(
                ModuleNotFoundError("No module named 'torchvision_missing'", name="torchvision_missing"), cuda)),
            ("import sglang.srt.utils_missing\n", _missing(cuda))):
        (tmp_path / "decode_cuda_graph_runner.py").write_text(source)
        doctor.importlib.invalidate_caches()
        assert _padding() == {"name": "cuda-graph padding", "ok": False, "detail": detail}, source


def test_the_doctor_forward_holds_each_mode_with_a_batch_of_unknown_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the self-test's forwards hand SGLang: a batch in the named mode, without SGLang's padding count."""
    sgl = _sglang(monkeypatch)
    with doctor._doctor_forward("TARGET_VERIFY"):
        pass
    (seen,) = sgl.entered
    assert seen.batch.forward_mode is FakeMode.TARGET_VERIFY and seen.batch.moe_num_token_non_padded is None


def test_a_module_not_found_without_a_name_or_inside_sglang_is_no_missing_dependency() -> None:
    """Only a ``ModuleNotFoundError`` naming a module outside SGLang is a missing dependency; one without a name
    (raised by hand) or any other ``ImportError`` reads as what it is."""
    nameless = ModuleNotFoundError("No module named 'sglang.srt.x'")
    assert doctor.missing_dependency(nameless) is None
    assert doctor.import_failure(nameless, "m") == (
        f"m: No module named 'sglang.srt.x'; supported SGLang versions: {SUPPORTED}")
    assert doctor.missing_dependency(ImportError("cannot import name 'x'", name="torchvision")) is None
    assert doctor.missing_dependency(ModuleNotFoundError("No module named 'sglang'", name="sglang")) is None
    assert doctor.missing_dependency(ModuleNotFoundError("x", name="sglang_router.mini")) == "sglang_router.mini"


def test_the_environment_describes_the_per_layer_k0_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from oea.config import layer_configs, settings_from_env, write_layer_k0_file
    from oea.routing import LayerK0Schedule

    path = tmp_path / "k0.json"
    write_layer_k0_file(LayerK0Schedule(num_experts=64, top_k=8, num_layers=2, k0=(2, 3)), path)
    monkeypatch.setenv("OEA_K0", "2")
    monkeypatch.setenv("OEA_LAYER_K0_FILE", str(path))
    described = layer_configs(settings_from_env()).describe()
    assert doctor._check_environment() == (
        "OEA on: k0=2, min_batch=2, max_experts=top_k, group_fill=in, apply_to_verify=False (OEA_K0=2); k0 per layer "
        f"from {path} (2 MoE layers, 64 experts, top_k 8: {described})")


def test_the_checks_read_the_settings_they_are_handed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_check_environment`` and ``check_decode_detection`` with the doctor's reading of the environment describe
    that reading, not the environment as it is when they run."""
    from oea.config import settings_from_env

    _sglang(monkeypatch)
    handed = settings_from_env({"OEA_K0": "3"})
    assert doctor._check_environment(handed) == ("OEA on: k0=3, min_batch=2, max_experts=top_k, group_fill=in, "
                                                 "apply_to_verify=False (OEA_K0=3)")
    assert doctor.check_decode_detection(handed)["detail"].startswith(f"not installed on {FC}: ")


def _environment_set_by_sglangs_import(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    """SGLang's MoE module sets ``name`` when the imports check imports it (SGLang's modules set variables at
    import; another plugin could at ``load_plugins``)."""
    real = doctor.importlib.import_module

    def import_module(module: str, *args: Any, **kwargs: Any) -> Any:
        if module == targets.TOPK_MODULE:
            monkeypatch.setenv(name, value)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(doctor.importlib, "import_module", import_module)


def test_every_check_reads_the_environment_as_it_was_when_the_doctor_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OEA_K0`` set while the doctor runs (at SGLang's import, before the hooks are loaded): the doctor reports on
    the one reading it started with, as ``register`` reads the environment once. So the plugin, loaded after the
    change, installs hooks that the doctor's OEA-off reading says should not be there."""
    _sglang(monkeypatch)
    _environment_set_by_sglangs_import(monkeypatch, "OEA_K0", "2")
    checks = _checks()
    assert checks["environment"]["detail"].startswith("OEA off")
    assert checks["hooks live"]["detail"].startswith("OEA_K0 is unset but hooks are installed: "), checks["hooks live"]
    assert checks["decode detection"]["detail"] == f"OEA off; with OEA_K0 set: {BATCH_HOW}"
    assert checks["self-test select_experts"]["detail"].endswith(" (OEA is off here: self-test forced k0=1)")
    assert checks["cuda-graph padding"]["detail"].startswith("OEA off; with OEA_K0 set")


def test_a_malformed_environment_stays_the_reason_when_it_is_mended_while_the_doctor_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _sglang(monkeypatch)
    monkeypatch.setenv("OEA_K0", "three")
    _environment_set_by_sglangs_import(monkeypatch, "OEA_K0", "2")
    checks = _checks()
    reason = checks["environment"]["detail"]
    assert reason.startswith("OEA_K0 must be an integer")
    assert checks["cuda-graph padding"] == {"name": "cuda-graph padding", "ok": False, "detail": reason}


def test_without_its_entry_point_the_doctor_says_to_reinstall_oea_where_sglang_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import oea.integrations.doctor.common as common

    _sglang(monkeypatch)
    monkeypatch.setattr(common.metadata, "entry_points", lambda group: [])
    checks = _checks()
    assert checks["entry point registered"] == {"name": "entry point registered", "ok": False, "detail": (
        f"no {targets.ENTRY_POINT_GROUP!r} entry point {targets.ENTRY_POINT_VALUE!r}; reinstall oea (pip install -e . "
        "or pip install oea) in the interpreter that runs SGLang")}
    assert "entry point loads" not in checks and not checks["self-test select_experts"]["ok"]


def test_a_dotted_target_is_read_through_a_module_that_is_no_package() -> None:
    """``_import_target`` imports submodules of packages only; past a plain module each part is an attribute."""
    import math

    assert doctor._import_target("math.sqrt") is math.sqrt
    assert doctor._import_target("inspect.Signature.bind") is inspect.Signature.bind


def test_one_hook_installed_without_oea_k0_fails_the_hooks_live_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any one OEA hook in place without ``OEA_K0`` is reported, not only all of them."""
    from oea.integrations.sglang.routing import select_experts_before

    _sglang(monkeypatch, load_plugins=lambda: plugin._patch(SELECT, select_experts_before, "BEFORE"))
    with pytest.raises(RuntimeError) as raised:
        doctor._check_hooks_live(doctor._readable(None))
    status = {FC: False, SELECT: True, POST: False}
    assert str(raised.value) == f"OEA_K0 is unset but hooks are installed: {status}"
