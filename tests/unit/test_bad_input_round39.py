"""Issue 39's library cases: configuration bounds chosen once, numpy / 0-d torch integers, expert ids out of
range, and unknown ``OEA_*`` names warned about by the adapters."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch

import oea
from oea.config import settings_from_env
from oea.config.unknown import forget_warned, warn_unknown_variables
from oea.integrations.doctor.env import check_environment

HUGE = 2**63


def test_a_min_batch_beyond_the_kernels_range_is_refused_once_for_every_entry_point() -> None:
    logits = torch.randn(4, 8)
    spec = oea.RouterSpec(8, 2)
    with pytest.raises(ValueError, match=r"min_batch must be an integer in 0\.\.2147483647, got 9223372036854775808"):
        oea.OEAConfig(2, min_batch=HUGE)
    env = {"OEA_K0": "2", "OEA_MIN_BATCH": "100000000000000000000"}
    with pytest.raises(ValueError, match=r"OEA_MIN_BATCH must be an integer in 0\.\.2147483647"):
        settings_from_env(env)
    with pytest.raises(ValueError, match="OEA_MIN_BATCH"):
        oea.maybe_attach(torch.nn.Linear(2, 2), env=env)
    [bad] = [c for c in check_environment(env) if c.name == "OEA_MIN_BATCH"]
    assert not bad.ok and "0..2147483647" in bad.detail
    with pytest.raises(ValueError, match=r"min_batch must be an integer in 0\.\.2147483647"):
        oea.routing.LayerK0Schedule(8, 2, 1, (1,), min_batch=HUGE)  # a per-layer k0 file's min_batch
    # the largest allowed value routes through the kernel as through the reference: vanilla routing
    cfg = oea.OEAConfig(2, min_batch=2**31 - 1)
    fast, slow = oea.route_fast(logits, spec, cfg), oea.route(logits, spec, cfg)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[0], oea.route(logits, spec, None)[0])


def test_integer_valued_numpy_and_0d_torch_values_are_accepted_where_an_int_is() -> None:
    cfg = oea.OEAConfig(np.int64(2), max_experts=torch.tensor(2), min_batch=np.int32(3), max_rank=np.uint8(6))
    assert (cfg.k0, cfg.max_experts, cfg.min_batch, cfg.max_rank) == (2, 2, 3, 6)
    assert all(type(v) is int for v in (cfg.k0, cfg.max_experts, cfg.min_batch, cfg.max_rank))
    spec = oea.RouterSpec(np.int64(8), torch.tensor(2, dtype=torch.int32))
    assert (spec.num_experts, spec.top_k) == (8, 2) and type(spec.num_experts) is int
    assert oea.PrunedConfig(np.int16(1)).k0 == 1
    assert hash(cfg) == hash(oea.OEAConfig(2, max_experts=2, min_batch=3, max_rank=6))
    ids, _ = oea.route_fast(torch.randn(4, 8), spec, cfg)
    assert ids.shape == (4, 2)
    for bad in (np.float64(2.0), torch.tensor(2.0), torch.tensor([2]), np.bool_(True), True, 2.0):
        with pytest.raises(ValueError, match=r"k0 must be an integer >= 1, got"):
            oea.OEAConfig(bad)  # type: ignore[arg-type]


def test_a_numpy_correction_bias_is_refused_as_a_type_not_a_shape() -> None:
    with pytest.raises(TypeError, match=r"correction_bias must be a torch\.Tensor of shape \[num_experts\]=\[8\], "
                                        r"got numpy\.ndarray; convert it first"):
        oea.RouterSpec(8, 2, "sigmoid", correction_bias=np.zeros(8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape \[num_experts\]=\[8\], got \(4,\)"):
        oea.RouterSpec(8, 2, "sigmoid", correction_bias=torch.zeros(4))


def test_expert_ids_outside_the_experts_are_refused_by_the_counting_functions() -> None:
    weights = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"ids must hold expert ids >= 0 .* got -1 in 1 slots"):
        oea.active_experts(torch.tensor([[0, -1]]), weights)
    with pytest.raises(ValueError, match=r"ids in 0\.\.7 \(num_experts=8\) .* got 9 in 1 slots"):
        oea.active_experts(torch.tensor([[0, 9]]), weights, num_experts=8)
    with pytest.raises(ValueError, match=r"ids in 0\.\.7 \(num_experts=8\) .* got 8, 9 in 2 slots"):
        oea.expert_load(torch.tensor([[8, 9]]), weights, 8)
    with pytest.raises(ValueError, match=r"got -3 in 1 slots"):
        oea.expert_load(torch.tensor([[-3, 1]]), weights, 8)
    # an id in a zero-weight slot or an invalid (padding) row is not counted, so it is not checked either
    assert int(oea.active_experts(torch.tensor([[3, -1]]), torch.tensor([[1.0, 0.0]]))) == 1
    valid = torch.tensor([True, False])
    both = torch.tensor([[1, 2], [-1, -1]])
    assert int(oea.active_experts(both, torch.ones(2, 2), valid)) == 2
    assert oea.expert_load(both, torch.ones(2, 2), 4, valid).tolist() == [0, 1, 1, 0]


@pytest.fixture
def fresh_warnings() -> None:
    forget_warned()
    yield
    forget_warned()


def test_maybe_attach_warns_once_about_an_unknown_variable_with_the_closest_name(fresh_warnings: None) -> None:
    env = {"OEA_K00": "3", "OEA_FOO": "1", "OEA_MIN_BATCH": "2"}
    with pytest.warns(RuntimeWarning, match=r"unknown variables OEA_FOO .*, OEA_K00 \(did you mean OEA_K0\?\): "
                                            r"not read by OEA"):
        assert oea.maybe_attach(torch.nn.Linear(2, 2), env=env) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert oea.maybe_attach(torch.nn.Linear(2, 2), env=env) is None  # once per name and process
        assert oea.maybe_attach(torch.nn.Linear(2, 2), env={"OEA_MIN_BATCH": "2"}) is None


def test_the_engine_plugins_warn_about_an_unknown_variable(fresh_warnings: None, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from oea.integrations.sglang import plugin as sglang_plugin
    from oea.integrations.vllm import plugin as vllm_plugin

    for name in [n for n in __import__("os").environ if n.startswith(("OEA_", "SGLANG_OEA_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OEA_K00", "3")
    caplog.set_level(logging.WARNING)
    vllm_plugin.register()  # OEA off: nothing installed, but the typo is said
    assert "OEA_K00 (did you mean OEA_K0?)" in caplog.text
    caplog.clear()
    forget_warned()
    monkeypatch.setattr(sglang_plugin.recording, "configure", lambda *args: None)
    monkeypatch.setattr(sglang_plugin.metrics, "configure", lambda *args: None)
    sglang_plugin.register()
    assert "OEA_K00 (did you mean OEA_K0?)" in caplog.text


def test_warn_unknown_variables_names_nothing_for_known_names(fresh_warnings: None) -> None:
    said: list[str] = []
    known = {"OEA_K0": "2", "SGLANG_OEA_MIN_BATCH": "2", "OEA_VLLM_VENV": "/x", "HOME": "/root"}
    assert warn_unknown_variables(known, warn=said.append) == "" and said == []


def test_doctor_says_what_a_max_experts_above_every_preset_top_k_does() -> None:
    [check] = [c for c in check_environment({"OEA_K0": "2", "OEA_MAX_EXPERTS": "99"}) if c.name == "OEA_MAX_EXPERTS"]
    assert check.detail.startswith("max_experts = 99: no model preset has top_k >= 99 (the largest is 8): a model "
                                   "whose top_k is below 99 is refused at load")
    [fine] = [c for c in check_environment({"OEA_K0": "2", "OEA_MAX_EXPERTS": "4"}) if c.name == "OEA_MAX_EXPERTS"]
    assert fine.detail == "max_experts = 4"
