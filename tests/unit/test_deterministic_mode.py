"""Deterministic / batch-invariant serving (issue 38, item 2): with vLLM's ``VLLM_BATCH_INVARIANT=1`` or SGLang's
``--enable-deterministic-inference`` on, each plugin keeps the engine's routing (OEA off) and says so once, in the
same words (``oea.integrations.deterministic``); ``oea doctor`` reports it in its ``deterministic mode`` check.

Engine stand-ins only (``vllm_stand_ins``, ``sglang_stand_ins``): each engine's flag is read through a stand-in of
the engine's own accessor (``vllm.envs``; SGLang's ``runtime_context`` and ``environ``) and, without it, from the
variable.
"""

from __future__ import annotations

import enum
import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm_stand_ins as vllm_si
from sglang_stand_ins import FakeMode, stand_in_module, topk_config, topk_module
from sglang_stand_ins import fresh_state as fresh_sglang_state

import oea
import oea.integrations.sglang.doctor as sglang_doctor
import oea.integrations.sglang.plugin as sglang_plugin
import oea.integrations.sglang.routing as sglang_routing
import oea.integrations.vllm.doctor as vllm_doctor
import oea.integrations.vllm.plugin as vllm_plugin
import oea.integrations.vllm.routing as vllm_routing
import oea.integrations.vllm.steps as vllm_steps
from oea.config import settings_from_env
from oea.integrations import deterministic
from oea.integrations.sglang.state import STATE as SGLANG_STATE
from oea.integrations.sglang.state import forward_mode
from oea.integrations.vllm.state import State as VllmState

torch.set_num_threads(1)
N = 64
VLLM_FLAG = "VLLM_BATCH_INVARIANT"
SGLANG_VARIABLE = "SGLANG_ENABLE_DETERMINISTIC_INFERENCE"
CLEARED = ("OEA_K0", "SGLANG_OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING", "OEA_TRACE_FILE", "OEA_LAYER_K0_FILE",
           VLLM_FLAG, SGLANG_VARIABLE)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings that say OEA stays off because of a deterministic mode."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "stays off" in r.getMessage()]


# --------------------------------------------------------------------------- the shared rule


def test_the_rule_turns_oea_off_with_one_warning_naming_both_settings() -> None:
    said: list[tuple[str, str]] = []
    settings = settings_from_env({"SGLANG_OEA_K0": "3"})
    kept = deterministic.keep_engine_routing(settings, "--enable-deterministic-inference",
                                             lambda key, text: said.append((key, text)))
    assert kept.oea is None and settings.oea is not None
    assert len(said) == 1 and said[0][0] == deterministic.WARN_KEY
    assert "SGLANG_OEA_K0" in said[0][1] and "--enable-deterministic-inference" in said[0][1]
    assert deterministic.keep_engine_routing(settings, None, lambda *a: said.append(a)) is settings  # mode off
    off = settings_from_env({})
    assert deterministic.keep_engine_routing(off, "VLLM_BATCH_INVARIANT=1", lambda *a: said.append(a)) is off
    assert len(said) == 1  # nothing to say when OEA was not asked for


# --------------------------------------------------------------------------- vLLM


def _vllm_envs(monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    """A stand-in ``vllm.envs`` (vLLM's own reader of its variables) with ``VLLM_BATCH_INVARIANT = value``."""
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_BATCH_INVARIANT = value  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)


def _vllm_decode_step(router: vllm_si.CPURouter, logits: torch.Tensor
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One decode step of ``logits.shape[0]`` requests through the worker hook and the CPU op: (out, stock)."""
    stock = router.route_stock(logits)
    vllm_steps.begin_step(vllm_si.scheduler_output([1] * logits.shape[0]))
    try:
        return vllm_routing.cpu_route_body(logits, stock[0], stock[1], 0), stock
    finally:
        vllm_steps.end_step()


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch-invariant", "off"])
def test_vllm_batch_invariant_mode_keeps_vllms_routing_and_warns_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, batch_invariant: bool) -> None:
    """``register`` (every vLLM process) with ``OEA_K0=2``: batch-invariant mode on -> a decode step hands back vLLM's
    own routing and one warning names both settings, however often ``register`` runs; off -> OEA as before."""
    vllm_si.install_vllm(monkeypatch)
    _vllm_envs(monkeypatch, batch_invariant)
    router = vllm_si.CPURouter()
    vllm_si.fresh_state(monkeypatch, {}, router)  # the router model load numbered, the decode flag
    monkeypatch.setattr(vllm_plugin, "install_hooks", lambda: [])  # the patching itself needs vLLM
    monkeypatch.setenv("OEA_K0", "2")
    monkeypatch.setenv("OEA_TIMING", "1")  # observe mode keeps the step hooks, so the step below runs as served
    with caplog.at_level(logging.WARNING, logger="vllm.oea"):
        vllm_plugin.register()
        vllm_plugin.STATE.installed = False  # a second process-wide call (vLLM loads plugins more than once)
        vllm_plugin.register()
    logits = torch.stack([torch.randperm(N, generator=torch.Generator().manual_seed(s)) for s in range(6)]) / 8.0
    out, stock = _vllm_decode_step(router, logits)
    warned = _warnings(caplog)
    if batch_invariant:
        assert vllm_plugin.STATE.mode == "observe" and vllm_plugin.STATE.settings.oea is None
        assert torch.equal(out[0], stock[0]) and torch.equal(out[1], stock[1])  # vLLM's routing, untouched
        assert len(warned) == 1, warned
        assert "OEA_K0" in warned[0] and "VLLM_BATCH_INVARIANT=1" in warned[0] and "stays off" in warned[0]
    else:
        assert vllm_plugin.STATE.mode == "oea" and vllm_plugin.STATE.settings.oea.k0 == 2
        ids, weights = oea.route(logits, router.spec(), oea.OEAConfig(2))
        torch.testing.assert_close(vllm_si.dense(*out, N), vllm_si.dense(weights, ids, N))
        assert not torch.equal(vllm_si.dense(*out, N), vllm_si.dense(*stock, N))
        assert warned == []


def test_vllm_flag_is_read_through_vllm_envs_before_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 / 0.33 read the mode as ``vllm.envs.VLLM_BATCH_INVARIANT``: that attribute decides where vLLM is
    importable (even against the variable); without it, the variable as vLLM parses it (``bool(int(...))``)."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setenv(VLLM_FLAG, "0")
    _vllm_envs(monkeypatch, True)
    assert vllm_plugin.batch_invariant_setting() == "VLLM_BATCH_INVARIANT=1"
    monkeypatch.setenv(VLLM_FLAG, "1")
    _vllm_envs(monkeypatch, False)
    assert vllm_plugin.batch_invariant_setting() is None
    monkeypatch.delitem(sys.modules, "vllm.envs")  # no vllm.envs: the variable itself
    assert vllm_plugin.batch_invariant_setting() == "VLLM_BATCH_INVARIANT=1"
    monkeypatch.setenv(VLLM_FLAG, "0")
    assert vllm_plugin.batch_invariant_setting() is None
    monkeypatch.delenv(VLLM_FLAG)
    assert vllm_plugin.batch_invariant_setting() is None
    monkeypatch.setenv(VLLM_FLAG, "yes")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT must be an integer .* got 'yes'"):
        vllm_plugin.batch_invariant_setting()


@pytest.mark.parametrize(("flag", "k0", "ok", "words"), [
    (None, "2", True, "off (vllm.envs"),
    ("1", "2", False, "OEA will stay off because of VLLM_BATCH_INVARIANT=1"),
    ("1", None, True, "VLLM_BATCH_INVARIANT=1 is on"),
    ("maybe", "2", False, "VLLM_BATCH_INVARIANT must be an integer"),
])
def test_vllm_doctor_reports_the_batch_invariant_mode(monkeypatch: pytest.MonkeyPatch, flag: str | None,
                                                      k0: str | None, ok: bool, words: str) -> None:
    if flag is not None:
        monkeypatch.setenv(VLLM_FLAG, flag)
    if k0 is not None:
        monkeypatch.setenv("OEA_K0", k0)
    vllm_si.swap_state(monkeypatch, VllmState())
    found = [c for c in vllm_doctor.doctor_checks() if "deterministic" in c["name"]]
    assert len(found) == 1 and found[0]["ok"] is ok and words in found[0]["detail"], found


# --------------------------------------------------------------------------- SGLang


def _sglang_flag(monkeypatch: pytest.MonkeyPatch, env_flag: Any = None, published: Any = None) -> None:
    """Stand-ins of SGLang's readers: ``environ.envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get()`` returning
    ``env_flag`` (None: no ``environ`` module), and ``runtime_context.get_exec()`` with the published server
    argument ``published`` (None: not published yet, SGLang's ``ValueError``)."""
    for name in ("sglang", "sglang.srt"):
        stand_in_module(monkeypatch, name)
    context = stand_in_module(monkeypatch, "sglang.srt.runtime_context")

    def get_exec() -> SimpleNamespace:
        if published is None:
            raise ValueError("config namespace 'exec' not published")
        return SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=published))

    context.get_exec = get_exec  # type: ignore[attr-defined]
    if env_flag is not None:
        environ = stand_in_module(monkeypatch, "sglang.srt.environ")
        environ.envs = SimpleNamespace(  # type: ignore[attr-defined]
            SGLANG_ENABLE_DETERMINISTIC_INFERENCE=SimpleNamespace(get=lambda: env_flag))


def _registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``HookRegistry`` that accepts every hook (``install`` registers the plan with it)."""
    registry = stand_in_module(monkeypatch, "sglang.srt.plugins.hook_registry")
    stand_in_module(monkeypatch, "sglang.srt.plugins")
    registry.HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")  # type: ignore[attr-defined]
    registry.HookRegistry = SimpleNamespace(register=lambda target, hook, kind: None)  # type: ignore[attr-defined]


def _hook_kwargs(rows: int = 6) -> dict[str, Any]:
    cfg = topk_config()
    logits = torch.randn(rows, N, generator=torch.Generator().manual_seed(3))
    ids, weights = oea.route(logits, sglang_plugin_spec(cfg))
    return dict(topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=cfg, router_logits=logits,
                layer_id=5, num_token_non_padded=None, expert_location_dispatch_info=None)


def sglang_plugin_spec(cfg: SimpleNamespace) -> oea.RouterSpec:
    from oea.integrations.sglang.specs import router_spec_from_topk_config

    return router_spec_from_topk_config(cfg, N)


@pytest.mark.parametrize("deterministic_on", [True, False], ids=["deterministic", "off"])
def test_sglang_deterministic_inference_keeps_sglangs_routing_and_warns_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, deterministic_on: bool) -> None:
    """A scheduler's ``register`` (before SGLang publishes its server args: the launcher's variable decides) and the
    hooks it installs: deterministic inference on -> nothing is installed, a DECODE routing call keeps SGLang's
    output, one warning names both settings; off -> OEA rewrites the DECODE call as before."""
    fresh_sglang_state(monkeypatch)
    topk_module(monkeypatch)
    _sglang_flag(monkeypatch, env_flag=deterministic_on)
    _registry(monkeypatch)
    monkeypatch.setenv("OEA_K0", "2")
    with caplog.at_level(logging.WARNING, logger=sglang_plugin.log.name):
        sglang_plugin.register()
        sglang_plugin.install(settings_from_env({"OEA_K0": "2"}))  # a second way in: the same rule, no new warning
    kwargs = _hook_kwargs()
    with forward_mode(FakeMode.DECODE):
        changed = sglang_routing.post_process_before(**kwargs)
    warned = _warnings(caplog)
    if deterministic_on:
        assert SGLANG_STATE.settings is not None and SGLANG_STATE.settings.oea is None
        assert changed is None  # SGLang's own routing
        assert len(warned) == 1, warned
        assert "OEA_K0" in warned[0] and "--enable-deterministic-inference" in warned[0]
    else:
        assert SGLANG_STATE.installed_targets and SGLANG_STATE.settings.oea.k0 == 2
        assert changed is not None
        expected, _ = oea.route(kwargs["router_logits"], sglang_plugin_spec(kwargs["topk_config"]), oea.OEAConfig(2))
        assert torch.equal(changed[1]["topk_ids"].long(), expected)
        assert warned == []


def test_sglang_register_alone_with_deterministic_inference_installs_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fresh_sglang_state(monkeypatch)
    _sglang_flag(monkeypatch, env_flag=True)
    monkeypatch.setenv("SGLANG_OEA_K0", "3")
    with caplog.at_level(logging.WARNING, logger=sglang_plugin.log.name):
        sglang_plugin.register()
        sglang_plugin.register()
    assert SGLANG_STATE.installed_targets == () and SGLANG_STATE.settings is None  # SGLang untouched
    warned = _warnings(caplog)
    assert len(warned) == 1 and "SGLANG_OEA_K0" in warned[0] and "--enable-deterministic-inference" in warned[0]


def test_sglang_flag_is_read_from_published_server_args_then_sglangs_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's published server args decide once published; before (a scheduler's ``register``) SGLang's own
    ``envs`` flag; without SGLang, the variable as SGLang's ``EnvBool`` parses it."""
    flag = "--enable-deterministic-inference"
    _sglang_flag(monkeypatch, env_flag=False, published=True)
    assert sglang_plugin.deterministic_setting() == flag
    _sglang_flag(monkeypatch, env_flag=True, published=False)
    assert sglang_plugin.deterministic_setting() is None
    _sglang_flag(monkeypatch, env_flag=True, published=None)  # not published yet
    assert sglang_plugin.deterministic_setting() == flag
    _sglang_flag(monkeypatch, env_flag=False, published=None)
    assert sglang_plugin.deterministic_setting() is None
    for name in ("sglang.srt.runtime_context", "sglang.srt.environ"):  # no SGLang readers: the variable
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "sglang.srt", types.ModuleType("sglang.srt"))
    for raw, want in (("1", flag), ("yes", flag), ("true", flag), ("0", None), ("", None)):
        monkeypatch.setenv(SGLANG_VARIABLE, raw)
        assert sglang_plugin.deterministic_setting() == want, raw
    monkeypatch.setenv(SGLANG_VARIABLE, "maybe")
    with pytest.raises(ValueError, match="SGLANG_ENABLE_DETERMINISTIC_INFERENCE must be a boolean"):
        sglang_plugin.deterministic_setting()


@pytest.mark.parametrize(("env_flag", "k0", "ok", "words"), [
    (False, "2", True, "off (SGLANG_ENABLE_DETERMINISTIC_INFERENCE"),
    (True, "2", False, "OEA will stay off because of --enable-deterministic-inference"),
    (True, None, True, "--enable-deterministic-inference is on"),
])
def test_sglang_doctor_reports_deterministic_inference(monkeypatch: pytest.MonkeyPatch, env_flag: bool,
                                                       k0: str | None, ok: bool, words: str) -> None:
    fresh_sglang_state(monkeypatch)
    _sglang_flag(monkeypatch, env_flag=env_flag)
    if k0 is not None:
        monkeypatch.setenv("OEA_K0", k0)
    found = [c for c in sglang_doctor.doctor_checks() if "deterministic" in c["name"]]
    assert len(found) == 1 and found[0]["ok"] is ok and words in found[0]["detail"], found
