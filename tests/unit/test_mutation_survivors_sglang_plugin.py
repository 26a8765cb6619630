"""What the generated mutants of ``oea/integrations/sglang/placement.py`` (``OEA_POLICY=ep``: each MoE layer's
placement read from SGLang's ``ExpertLocationMetadata``) and ``plugin.py`` (``register``, ``install``, the
direct patching of SGLang < 0.5.12) found unguarded (docs/testing.md, "Generated mutants"), with stand-ins for
SGLang's ``expert_location`` and ``runtime_context`` modules (no SGLang, no accelerator: PyTorch's lazy device
stands in for the logits' device).

Placement: the reasons a layer keeps plain OEA, word for word (no metadata, EP 1, DP-attention ranks routing their
own rows, a layer outside the metadata, a layout that misses an expert); the DP-attention settings read as SGLang
publishes them (an unset or missing ``attn_dp_size`` is one rank; ``moe_a2a_backend`` ``None``/``"none"`` gathers
the rows); the placement and its description from the slots, with and without static dispatch; the per-layer
fields the configs are kept in; ``ep_config``: read once at a layer's first eager call, onto the logits' device,
never inside a capture, again when SGLang replaces its metadata, and refused when its size is not the layer's;
``install`` (the rebalance rereads the placements) and ``doctor_placement``."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import test_mutation_survivors_sglang_devices as devices
import torch
from sglang_stand_ins import fresh_state, stand_in_module

import oea.integrations.sglang.placement as placement
import oea.integrations.sglang.plugin as plugin_entry
import oea.integrations.sglang.targets as sglang_targets
from oea.config import settings_from_env
from oea.integrations.sglang.state import STATE
from oea.routing import EPOEAConfig, OEAConfig
from oea.routing.layered import EP_IGNORES_MAX_EXPERTS

torch.set_num_threads(1)
LOGGER = "oea.integrations.sglang"
RUNTIME = "sglang.srt.runtime_context"
lazy = devices.lazy  # the lazy device, an accelerator stand-in (a fixture, found by this name)


@pytest.fixture(autouse=True)
def fresh_plugin_state(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh_state(monkeypatch)
    _runtime(monkeypatch, SimpleNamespace(attn_dp_size=1), None)  # SGLang's settings published: no DP attention


def _meta(slots: list[list[int]], ep: int = 2, logical: int = 4, dispatch: list[list[int]] | None = None,
          **overrides: Any) -> SimpleNamespace:
    """SGLang's ``ExpertLocationMetadata``: ``slots`` [layers, physical slots] of logical experts, an equal block
    of slots per EP rank."""
    fields = dict(ep_size=ep, num_layers=len(slots), num_local_physical_experts=len(slots[0]) // ep,
                  num_logical_experts=logical, physical_to_logical_map_cpu=torch.tensor(slots),
                  logical_to_rank_dispatch_physical_map=None if dispatch is None else torch.tensor(dispatch))
    return SimpleNamespace(**(fields | overrides))


class _Location:
    """The ``expert_location`` stand-in: the current metadata (replaceable) and how often it was asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, meta: Any) -> None:
        self.meta, self.reads = meta, 0
        self.module = types.ModuleType(placement.LOCATION_MODULE)
        self.module.get_global_expert_location_metadata = self.get
        self.module.ExpertLocationMetadata = type("ExpertLocationMetadata", (), {"update": lambda self: "updated"})
        monkeypatch.setitem(sys.modules, placement.LOCATION_MODULE, self.module)

    def get(self) -> Any:
        self.reads += 1
        return self.meta


def _runtime(monkeypatch: pytest.MonkeyPatch, parallel: Any, a2a: Any) -> None:
    """SGLang's published ``runtime_context``: ``get_parallel()`` and ``get_exec().moe.moe_a2a_backend``."""
    for name in ("sglang", "sglang.srt"):
        stand_in_module(monkeypatch, name)
    module = stand_in_module(monkeypatch, RUNTIME)
    module.get_parallel = lambda: parallel
    module.get_exec = lambda: SimpleNamespace(moe=SimpleNamespace(moe_a2a_backend=a2a))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# -- read_layer_placement ------------------------------------------------------------------------------------------

TWO_RANKS = [[0, 1, 2, 3], [3, 2, 1, 0]]  # EP 2, 2 slots per rank, no replica


def test_a_layer_without_metadata_or_expert_parallelism_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    location = _Location(monkeypatch, None)
    assert placement.read_layer_placement(0) == (
        None, "SGLang has no expert location metadata (no expert parallelism for this model)")
    location.meta = _meta(TWO_RANKS, ep=1)
    assert placement.read_layer_placement(0) == (None, "SGLang runs without expert parallelism (ep_size 1)")


def test_two_ep_ranks_named_as_text_are_expert_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS, ep=2))
    got, _ = placement.read_layer_placement(1)
    assert got is not None and got.num_devices == 2
    assert got.device_of_expert.tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("layer_id", [-1, 2, "0", 0.0])
def test_a_layer_outside_the_metadata_keeps_plain_oea_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                                layer_id: Any) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    assert placement.read_layer_placement(layer_id) == (
        None, f"layer_id {layer_id!r} is not in SGLang's expert location metadata (2 layers)")


def test_the_placement_without_static_dispatch_is_each_experts_first_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """EP 2, 3 slots per rank: expert 0 on rank 0, replicated on rank 1 (slot 5), every other expert once."""
    _Location(monkeypatch, _meta([[0, 1, 2, 3, 4, 0]], logical=5))
    got, detail = placement.read_layer_placement(0)
    assert got.device_of_expert.tolist() == [0, 0, 0, 1, 1] and got.num_devices == 2
    assert detail == ("5 experts on 2 EP devices (2-3 each, engine map, 1 replicated); SGLang EP layout, replicas: "
                      "first replica (no static dispatch)")


def test_static_dispatch_places_each_expert_on_the_replica_this_rank_sends_it_to(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _Location(monkeypatch, _meta([[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 0]], logical=5,
                                 dispatch=[[0, 1, 2, 3, 4], [5, 1, 2, 3, 4]]))
    first, _ = placement.read_layer_placement(0)
    got, detail = placement.read_layer_placement(1)
    assert first.device_of_expert.tolist() == [0, 0, 0, 1, 1]
    assert got.device_of_expert.tolist() == [1, 0, 0, 1, 1]
    assert detail == ("5 experts on 2 EP devices (2-3 each, engine map, 1 replicated); SGLang EP layout, replicas: "
                      "static dispatch of this rank")


def test_a_layout_missing_an_expert_keeps_plain_oea_saying_which(monkeypatch: pytest.MonkeyPatch) -> None:
    _Location(monkeypatch, _meta([[0, 1, 2, -1]], logical=4))
    assert placement.read_layer_placement(0) == (None, "placement does not cover every expert: missing experts [3]")


# -- DP attention --------------------------------------------------------------------------------------------------

def test_dp_attention_ranks_routing_their_own_rows_keep_plain_oea(monkeypatch: pytest.MonkeyPatch) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    _runtime(monkeypatch, SimpleNamespace(attn_dp_size=2), "deepep")
    assert placement.read_layer_placement(0) == (None, (
        "2 DP-attention ranks route their own rows (moe_a2a_backend=deepep): each would fill the same idle EP "
        "ranks, so the busiest one could grow (see oea simulate --dp --ep)"))


@pytest.mark.parametrize(("parallel", "a2a"), [
    (SimpleNamespace(attn_dp_size=2), None),  # rows gathered before the MoE
    (SimpleNamespace(attn_dp_size=2), "none"),
    (SimpleNamespace(attn_dp_size=1), "deepep"),  # no DP attention
    (SimpleNamespace(attn_dp_size=None), "deepep"),  # unset: one rank
    (SimpleNamespace(), "deepep"),  # a parallel config without the field: one rank
])
def test_a_routing_call_that_sees_every_ranks_rows_reads_its_placement(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture,
                                                                       parallel: Any, a2a: Any) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    _runtime(monkeypatch, parallel, a2a)
    with caplog.at_level(logging.WARNING):
        got, _ = placement.read_layer_placement(0)
    assert got.device_of_expert.tolist() == [0, 0, 1, 1]
    assert _warnings(caplog) == []


def test_unreadable_dp_settings_are_said_once_and_assume_the_whole_step(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    monkeypatch.setitem(sys.modules, RUNTIME, None)  # an SGLang older than runtime_context
    with caplog.at_level(logging.WARNING):
        first, _ = placement.read_layer_placement(0)
        again, _ = placement.read_layer_placement(1)
    assert first is not None and again is not None
    [said] = _warnings(caplog)
    assert said.startswith("oea: OEA_POLICY=ep: cannot read SGLang's DP-attention settings (")
    assert said.endswith("); EP-aware OEA assumes each routing call sees the whole step's rows")


# -- the per-layer fields of EPLayerConfigs ------------------------------------------------------------------------

def _router(layer_id: Any, num_experts: int = 4, **fields: Any) -> SimpleNamespace:
    state = SimpleNamespace(layer_id=layer_id, num_experts=num_experts, ep=None, ep_detail="", ep_metadata=None)
    state.__dict__.update(fields)
    STATE.routers[layer_id] = state
    return state


def test_a_layer_field_holds_only_the_layers_where_it_is_set() -> None:
    field = placement._LayerField("ep_detail", "")
    set_a, _ = _router(0, ep_detail="read"), _router(1)
    with pytest.raises(KeyError) as unset:
        field[1]
    assert unset.value.args == (1,)  # the missing key, as a mapping names it
    with pytest.raises(KeyError) as missing:
        field[7]  # no such layer
    assert missing.value.args == (7,) and field.get(7, "default") == "default" and 1 not in field
    assert field[0] == "read" and list(field) == [0] and len(field) == 1
    field[1] = "why not"
    assert STATE.routers[1].ep_detail == "why not" and list(field) == [0, 1] and len(field) == 2
    del field[0]
    assert set_a.ep_detail == "" and list(field) == [1]
    with pytest.raises(KeyError):
        del field[0]
    assert set_a.ep_detail == ""


# -- ep_config -----------------------------------------------------------------------------------------------------

CFG = OEAConfig(2, min_batch=3)


def _capturing(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    monkeypatch.setattr(placement, "graph_capturing", lambda: value)


def test_a_layers_placement_is_read_once_at_its_first_eager_call(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    location = _Location(monkeypatch, _meta(TWO_RANKS))
    state = _router(1)
    reads = []
    monkeypatch.setattr(placement.CONFIGS, "read", lambda key: reads.append(key) or placement.read_layer_placement(key))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = placement.ep_config(state, CFG)
        again = placement.ep_config(state, CFG)
    assert isinstance(got, EPOEAConfig) and again is got and state.ep is got and reads == [1]
    assert (got.k0, got.min_batch, got.placement.device_of_expert.tolist()) == (2, 3, [1, 1, 0, 0])
    assert got.placement.device_of_expert.device.type == "cpu"
    assert state.ep_metadata is location.meta
    assert state.ep_detail == ("4 experts on 2 EP devices (2 each, engine map); SGLang EP layout, replicas: "
                               "first replica (no static dispatch)")
    assert [r.getMessage() for r in caplog.records] == [f"oea: EP-aware OEA on layer 1: {state.ep_detail}"]


def test_the_placement_is_kept_on_the_logits_device(monkeypatch: pytest.MonkeyPatch, lazy: torch.device) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    state = _router(0)
    got = placement.ep_config(state, CFG, lazy)
    assert state.ep is got and got.placement.device_of_expert.device == lazy
    assert got.placement.device_of_expert.cpu().tolist() == [0, 0, 1, 1]
    assert got.placement.num_devices == 2 and (got.k0, got.min_batch) == (2, 3)
    assert placement.ep_config(state, CFG, lazy) is got


def test_a_layer_first_met_in_a_capture_keeps_plain_oea_until_an_eager_call(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    state = _router(0)
    _capturing(monkeypatch, True)
    with caplog.at_level(logging.WARNING):
        assert placement.ep_config(state, CFG) is CFG
        assert placement.ep_config(state, CFG) is CFG
    assert (state.ep, state.ep_detail, state.ep_metadata) == (None, "", None)
    assert _warnings(caplog) == ["oea: OEA_POLICY=ep: layer 0 was first met inside a CUDA-graph capture, where its "
                                 "placement cannot be read; plain OEA there"]
    _capturing(monkeypatch, False)
    assert isinstance(placement.ep_config(state, CFG), EPOEAConfig)


def test_new_metadata_is_read_again_at_the_next_eager_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    location = _Location(monkeypatch, _meta(TWO_RANKS))
    state = _router(0)
    first = placement.ep_config(state, CFG)
    location.meta = _meta([[1, 0, 3, 2], [1, 0, 3, 2]])
    _capturing(monkeypatch, True)
    assert placement.ep_config(state, CFG) is first  # inside a capture: the placement it was built with
    _capturing(monkeypatch, False)
    second = placement.ep_config(state, CFG)
    assert second is not first and second.placement.device_of_expert.tolist() == [0, 0, 1, 1]
    assert state.ep_metadata is location.meta


def test_a_layer_without_a_placement_keeps_plain_oea_saying_why_once(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS, ep=1))
    state = _router(0)
    reads = []
    monkeypatch.setattr(placement.CONFIGS, "read", lambda key: reads.append(key) or placement.read_layer_placement(key))
    with caplog.at_level(logging.WARNING):
        assert placement.ep_config(state, CFG) is CFG
        assert placement.ep_config(state, CFG) is CFG
    assert reads == [0] and state.ep is None
    assert _warnings(caplog) == ["oea: OEA_POLICY=ep: layer 0 keeps plain OEA: SGLang runs without expert "
                                 "parallelism (ep_size 1)"]


def test_a_placement_of_another_size_than_the_layer_keeps_plain_oea(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    state = _router(0, num_experts=6)
    with caplog.at_level(logging.WARNING):
        assert placement.ep_config(state, CFG) is CFG
    assert isinstance(state.ep, EPOEAConfig)
    assert _warnings(caplog) == ["oea: OEA_POLICY=ep: layer 0 routes 6 experts but its placement has 4; plain OEA"]


# -- install and doctor_placement ----------------------------------------------------------------------------------

def test_install_wraps_the_rebalance_only_under_the_ep_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    location = _Location(monkeypatch, _meta(TWO_RANKS))
    update = location.module.ExpertLocationMetadata.update
    assert placement.install() == []  # no settings
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    assert placement.install() == []
    assert location.module.ExpertLocationMetadata.update is update
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_POLICY": "ep"})
    assert placement.install() == ["ExpertLocationMetadata.update"]
    assert placement.install() == []  # wrapped once


def test_a_rebalance_rereads_the_placements_into_the_same_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    location = _Location(monkeypatch, _meta(TWO_RANKS))
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_POLICY": "ep"})
    placement.install()
    state = _router(0)
    built = placement.ep_config(state, CFG)
    tensor = built.placement.device_of_expert
    location.meta.physical_to_logical_map_cpu = torch.tensor([[3, 2, 1, 0], [3, 2, 1, 0]])
    assert location.module.ExpertLocationMetadata().update() == "updated"
    assert built.placement.device_of_expert is tensor and tensor.tolist() == [1, 1, 0, 0]


def test_max_experts_under_ep_is_said_once_and_only_with_oea(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    _Location(monkeypatch, _meta(TWO_RANKS))
    with caplog.at_level(logging.WARNING):
        STATE.settings = settings_from_env({"OEA_POLICY": "ep", "OEA_MAX_EXPERTS": "4"})
        placement.install()
        assert _warnings(caplog) == []
        STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_POLICY": "ep"})
        placement.install()
        assert _warnings(caplog) == []
        STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_POLICY": "ep", "OEA_MAX_EXPERTS": "4"})
        placement.install()
    assert _warnings(caplog) == [f"oea: {EP_IGNORES_MAX_EXPERTS}"]


@pytest.mark.parametrize("module", [None, types.ModuleType(placement.LOCATION_MODULE)])
def test_install_without_sglangs_metadata_class_keeps_plain_oea_saying_so(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture,
                                                                          module: Any) -> None:
    monkeypatch.setitem(sys.modules, placement.LOCATION_MODULE, module)
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_POLICY": "ep"})
    with caplog.at_level(logging.WARNING):
        assert placement.install() == []
    [said] = _warnings(caplog)
    assert said.startswith("oea: OEA_POLICY=ep: SGLang's expert location metadata is missing (")
    assert said.endswith("); every layer keeps plain OEA")


@dataclasses.dataclass
class _Metadata:
    physical_to_logical_map_cpu: Any = None
    logical_to_rank_dispatch_physical_map: Any = None
    ep_size: int = 8
    num_local_physical_experts = 33
    num_logical_experts = 256

    def update(self) -> None:
        pass


def _doctor_module(monkeypatch: pytest.MonkeyPatch, metadata: type) -> None:
    module = types.ModuleType(placement.LOCATION_MODULE)
    module.ExpertLocationMetadata = metadata
    monkeypatch.setitem(sys.modules, placement.LOCATION_MODULE, module)


@pytest.mark.parametrize(("policy", "env"), [("oea", None), ("ep", {"OEA_K0": "2", "OEA_POLICY": "ep"})])
def test_the_doctor_names_what_it_reads_and_the_ep8_example(monkeypatch: pytest.MonkeyPatch, policy: str,
                                                            env: Any) -> None:
    _doctor_module(monkeypatch, _Metadata)
    STATE.settings = None if env is None else settings_from_env(env)
    assert placement.doctor_placement() == (
        f"OEA_POLICY={policy}; reads ExpertLocationMetadata (ep_size, logical_to_rank_dispatch_physical_map, "
        "physical_to_logical_map_cpu); EP=8 example: 256 experts on 8 EP devices (25-33 each, engine map, "
        "8 replicated); a server logs each layer's placement at its first decode call")


def test_the_doctor_fails_naming_what_sglangs_metadata_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    lacking = dataclasses.make_dataclass("Lacking", [("ep_size", int), ("physical_to_logical_map_cpu", Any)])
    lacking.num_logical_experts = 256
    _doctor_module(monkeypatch, lacking)
    with pytest.raises(RuntimeError) as err:
        placement.doctor_placement()
    assert str(err.value) == ("SGLang's ExpertLocationMetadata lacks ['logical_to_rank_dispatch_physical_map', "
                              "'num_local_physical_experts', 'update']: OEA_POLICY=ep would keep plain OEA")
    _doctor_module(monkeypatch, type("NotADataclass", (), {}))
    with pytest.raises(RuntimeError, match=r"lacks \['ep_size', 'logical_to_rank_dispatch_physical_map', "
                                           r"'physical_to_logical_map_cpu', 'num_local_physical_experts', "
                                           r"'num_logical_experts', 'update'\]"):
        placement.doctor_placement()


def test_each_layer_met_in_a_capture_or_of_another_size_is_said_and_one_reason_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A capture or a size mismatch is warned per layer; a reason to keep plain OEA once, at the first layer."""
    location = _Location(monkeypatch, _meta(TWO_RANKS))
    _capturing(monkeypatch, True)
    with caplog.at_level(logging.WARNING):
        for layer in (0, 1):
            assert placement.ep_config(_router(layer), CFG) is CFG
        _capturing(monkeypatch, False)
        for layer in (0, 1):
            assert placement.ep_config(_router(layer, num_experts=6), CFG) is CFG
        location.meta = _meta(TWO_RANKS, ep=1)
        for layer in (2, 3):
            assert placement.ep_config(_router(layer), CFG) is CFG
        location.meta = _meta(TWO_RANKS)
        for layer in (5, 6):  # outside the metadata: a reason of its own each
            assert placement.ep_config(_router(layer), CFG) is CFG
    assert [w.removeprefix("oea: OEA_POLICY=ep: layer ").split(" ", 2)[:2] for w in _warnings(caplog)] == [
        ["0", "was"], ["1", "was"], ["0", "routes"], ["1", "routes"], ["2", "keeps"], ["5", "keeps"], ["6", "keeps"]]


# -- plugin.py -----------------------------------------------------------------------------------------------------

def test_the_routing_forwards_are_forward_and_every_forward_star_method_sorted() -> None:
    topk = type("TopK", (), {"forward_cuda": None, "forward": None, "forwarding": None, "_forward_x": None,
                             "forward_": None, "backward": None})
    assert plugin_entry.routing_forwards(topk) == ("forward", "forward_", "forward_cuda")


def test_an_out_of_tree_forward_for_a_topk_class_is_a_bypass_naming_its_platform(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = stand_in_module(monkeypatch, sglang_targets.TOPK_MODULE)

    def forward_npu(self: Any) -> None:
        pass

    module.TopK = type("TopK", (), {"forward": lambda self: None, "forward_cuda": lambda self: None,
                                    "__module__": sglang_targets.TOPK_MODULE})
    other = type("Other", (), {})
    module.TopK._oot_forward_registry = {"npu": {module.TopK: forward_npu, other: forward_npu, "x": forward_npu},
                                         "cpu": "not a table"}
    found, looked_at = plugin_entry.topk_bypasses()
    assert [(b.router, b.method, b.hook) for b in found] == [
        (f"{sglang_targets.TOPK_MODULE}.TopK", "forward", f"{sglang_targets.TOPK_MODULE}.TopK.forward")]
    assert found[0].found == (f"{forward_npu.__qualname__}, an out-of-tree forward for platform 'npu'")
    assert looked_at.startswith("forward and 1 forward_* methods of ")
    module.TopK._oot_forward_registry = ["not a dict"]
    assert plugin_entry.topk_bypasses()[0] == []


@pytest.mark.parametrize(("value", "on"), [("1", True), (" Yes ", True), ("anything", True), ("", False),
                                           ("0", False), ("FALSE", False), ("no", False), (" off ", False)])
def test_an_sglang_flag_is_on_unless_empty_0_false_no_or_off(monkeypatch: pytest.MonkeyPatch, value: str,
                                                             on: bool) -> None:
    monkeypatch.setenv("OEA_TEST_FLAG", value)
    assert plugin_entry._env_flag("OEA_TEST_FLAG") is on
    monkeypatch.delenv("OEA_TEST_FLAG")
    assert plugin_entry._env_flag("OEA_TEST_FLAG") is False


def test_sglangs_simulated_routing_keeps_oea_out_naming_the_variables(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    for name in sglang_targets.SIMULATION_VARIABLES:
        monkeypatch.setenv(name, "1")
    with caplog.at_level(logging.WARNING):
        assert plugin_entry.install(settings_from_env({"OEA_K0": "2"})) == []
    assert STATE.settings is None
    assert _warnings(caplog) == [f"oea: {', '.join(sglang_targets.SIMULATION_VARIABLES)} overrides routing; OEA is "
                                 "not installed"]


def test_an_sglang_without_the_hook_registry_serves_without_oea_saying_so(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    for name in sglang_targets.SIMULATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", None)
    with caplog.at_level(logging.WARNING):
        assert plugin_entry.install(settings_from_env({"OEA_K0": "2"})) == []
    [said] = _warnings(caplog)
    assert said.startswith("oea: SGLang has no plugin HookRegistry (")
    assert said.endswith(f"); supported versions: {sglang_targets.SUPPORTED_VERSIONS}. Serving without OEA.")
    assert STATE.settings.oea.k0 == 2 and STATE.installed_targets == ()


@pytest.mark.parametrize(("value", "flag"), [("true", True), (" YES ", True), ("y", True), ("1", True),
                                             ("", False), ("false", False), ("0", False), ("n", False),
                                             ("No", False)])
def test_deterministic_inference_is_read_as_sglangs_envbool(monkeypatch: pytest.MonkeyPatch, value: str,
                                                            flag: bool) -> None:
    monkeypatch.setenv(sglang_targets.DETERMINISTIC_VARIABLE, value)
    assert plugin_entry.deterministic_setting() == (sglang_targets.DETERMINISTIC_FLAG if flag else None)


def test_a_deterministic_value_sglang_cannot_parse_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sglang_targets.DETERMINISTIC_VARIABLE, " Maybe ")
    with pytest.raises(ValueError) as err:
        plugin_entry.deterministic_setting()
    assert str(err.value) == (f"{sglang_targets.DETERMINISTIC_VARIABLE} must be a boolean as SGLang reads it "
                              "(true/1/yes/y or false/0/no/n), got 'maybe'")


@pytest.mark.parametrize("enabled", [True, False])
def test_deterministic_inference_published_by_sglang_is_read_first(monkeypatch: pytest.MonkeyPatch,
                                                                   enabled: bool) -> None:
    monkeypatch.setenv(sglang_targets.DETERMINISTIC_VARIABLE, "maybe")  # never read: SGLang published its setting
    _runtime(monkeypatch, SimpleNamespace(attn_dp_size=1), None)
    sys.modules[RUNTIME].get_exec = lambda: SimpleNamespace(
        deterministic=SimpleNamespace(enable_deterministic_inference=enabled))
    assert plugin_entry.deterministic_setting() == (sglang_targets.DETERMINISTIC_FLAG if enabled else None)


def test_sglangs_own_deterministic_flag_is_read_before_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sglang_targets.DETERMINISTIC_VARIABLE, "maybe")
    environ = stand_in_module(monkeypatch, "sglang.srt.environ")
    environ.envs = SimpleNamespace(SGLANG_ENABLE_DETERMINISTIC_INFERENCE=SimpleNamespace(get=lambda: True))
    assert plugin_entry.deterministic_setting() == sglang_targets.DETERMINISTIC_FLAG
    environ.envs = SimpleNamespace(SGLANG_ENABLE_DETERMINISTIC_INFERENCE=SimpleNamespace(get=lambda: False))
    assert plugin_entry.deterministic_setting() is None


def test_an_around_patch_hands_the_hook_the_original_and_every_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    source = stand_in_module(monkeypatch, "oea_test_around_source")
    source.compute = lambda x, y=1: x * 10 + y

    def around(original: Any, *args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs) + 1000

    plugin_entry._patch("oea_test_around_source.compute", around, "AROUND")
    assert source.compute(3, y=4) == 1034 and source.compute.__wrapped__(3) == 31


def test_a_before_hook_returning_none_keeps_the_call_and_a_class_is_patched_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    source = stand_in_module(monkeypatch, "oea_test_before_source")
    seen = []
    source.Owner = type("Owner", (), {"compute": lambda self, x: x + 1})
    plugin_entry._patch("oea_test_before_source.Owner.compute", lambda *a, **k: seen.append((a[1:], k)), "BEFORE")
    assert source.Owner().compute(x=2) == 3 and seen == [((), {"x": 2})]


def _registry(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, Any]]:
    """SGLang's ``HookRegistry`` (0.5.12+): what ``install`` registers."""
    registered: list[tuple[str, Any, Any]] = []
    module = stand_in_module(monkeypatch, "sglang.srt.plugins.hook_registry")
    stand_in_module(monkeypatch, "sglang.srt.plugins")
    module.HookType = SimpleNamespace(BEFORE="BEFORE", AROUND="AROUND", AFTER="AFTER", REPLACE="REPLACE")
    module.HookRegistry = SimpleNamespace(register=lambda *args: registered.append(args))
    return registered


@pytest.mark.parametrize(("env", "what"), [
    ({"OEA_K0": "2", "OEA_MIN_BATCH": "3"}, "OEA k0=2 min_batch=3"),
    ({"OEA_METRICS_FILE": "/dev/null"}, "observe (SGLang's routing, recorded or counted)"),
])
def test_install_says_what_it_registered_where(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                               env: dict[str, str], what: str) -> None:
    for name in sglang_targets.SIMULATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    registered = _registry(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        targets = plugin_entry.install(settings_from_env(env))
    assert targets == [target for target, _, _ in registered] and STATE.layers is not None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"oea: {what} registered on {', '.join(targets)}"]


def test_register_without_anything_to_do_says_sglangs_routing_is_unchanged(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    for name in ("OEA_METRICS_FILE", "OEA_TIMING", sglang_targets.DETERMINISTIC_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        plugin_entry.register()
    assert STATE.settings is None
    assert [r.getMessage() for r in caplog.records] == ["oea: OEA_K0 unset; SGLang routing unchanged"]


def test_deterministic_inference_keeps_sglangs_routing_in_every_entry_point(monkeypatch: pytest.MonkeyPatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    for name in sglang_targets.SIMULATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(sglang_targets.DETERMINISTIC_VARIABLE, "1")
    monkeypatch.setenv("OEA_K0", "2")
    _registry(monkeypatch)
    with caplog.at_level(logging.WARNING):
        plugin_entry.register()
        assert STATE.settings is None  # nothing else to do: not installed
        plugin_entry.install(settings_from_env({"OEA_K0": "2"}))
        assert STATE.settings.oea is None
    assert len([w for w in _warnings(caplog) if sglang_targets.DETERMINISTIC_FLAG in w]) == 1


def test_a_topk_without_an_out_of_tree_registry_and_a_forward_without_a_qualname(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = stand_in_module(monkeypatch, sglang_targets.TOPK_MODULE)
    module.TopK = type("TopK", (), {"forward": lambda self: None, "__module__": sglang_targets.TOPK_MODULE})
    assert plugin_entry.topk_bypasses()[0] == []  # an SGLang before register_oot_forward
    forward = functools.partial(print)
    module.TopK._oot_forward_registry = {"npu": {module.TopK: forward}}
    [found] = plugin_entry.topk_bypasses()[0]
    assert found.found == f"{forward!r}, an out-of-tree forward for platform 'npu'"


def test_a_layer_file_that_cannot_be_read_leaves_no_layer_configs(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Any) -> None:
    for name in sglang_targets.SIMULATION_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    STATE.layers = object()
    bad = tmp_path / "k0.json"
    bad.write_text("{")
    with pytest.raises(ValueError):
        plugin_entry.install(settings_from_env({"OEA_K0": "2", "OEA_LAYER_K0_FILE": str(bad)}))
    assert STATE.layers is None


@pytest.mark.parametrize(("env", "loaded", "warned"), [
    ({"OEA_K0": "2"}, True, True),
    ({"OEA_K0": "2"}, False, False),  # no TopK module yet: no subclass of it either
    ({"OEA_METRICS_FILE": "/dev/null"}, True, False),  # observing only: SGLang's routing is what is observed
])
def test_register_installs_and_warns_of_a_substituted_topk_only_with_oea(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str], loaded: bool,
        warned: bool) -> None:
    for name in (*sglang_targets.SIMULATION_VARIABLES, "OEA_METRICS_FILE", "OEA_TIMING",
                 sglang_targets.DETERMINISTIC_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    registered = _registry(monkeypatch)
    if loaded:
        module = stand_in_module(monkeypatch, sglang_targets.TOPK_MODULE)
        module.TopK = type("TopK", (), {"forward": lambda self: None, "__module__": sglang_targets.TOPK_MODULE})
        module.MyTopK = type("MyTopK", (module.TopK,), {"forward": lambda self: None,  # kept: a live subclass
                                                        "__module__": "oea_test_substitute"})
    else:
        monkeypatch.delitem(sys.modules, sglang_targets.TOPK_MODULE, raising=False)
    with caplog.at_level(logging.WARNING):
        plugin_entry.register()
    assert registered and STATE.installed_targets
    assert any("oea_test_substitute.MyTopK" in w for w in _warnings(caplog)) is warned


def test_register_says_an_unknown_oea_variable_in_sglangs_log(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    import oea.config.unknown as unknown

    monkeypatch.setattr(unknown, "_warned", set())
    monkeypatch.setenv("OEA_K00", "3")
    with caplog.at_level(logging.WARNING):
        plugin_entry.register()
    assert any("OEA_K00" in w for w in _warnings(caplog))


def test_a_patch_skips_modules_without_a_namespace_and_leaves_the_owners_aliases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    source = stand_in_module(monkeypatch, "oea_test_alias_source")
    source.compute = source.alias = lambda x: x + 1
    monkeypatch.setitem(sys.modules, "oea_test_blocked", None)  # a module import blocked: no __dict__
    plugin_entry._patch("oea_test_alias_source.compute", lambda x: ((2 * x,), {}), "BEFORE")
    assert source.compute(3) == 7 and source.alias(3) == 4


def test_direct_patching_keeps_sglangs_routing_under_deterministic_inference_and_records_its_targets(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from test_sglang_decode_detection import fake_sglang

    fake_sglang(monkeypatch, "0.5.23")
    monkeypatch.setenv(sglang_targets.DETERMINISTIC_VARIABLE, "1")
    with caplog.at_level(logging.WARNING):
        patched = plugin_entry.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert patched and STATE.installed_targets == tuple(patched) and STATE.settings.oea is None
    assert len([w for w in _warnings(caplog) if sglang_targets.DETERMINISTIC_FLAG in w]) == 1


@pytest.mark.parametrize("apply_to_verify", ["0", "1"])
def test_direct_patching_records_the_trace_and_verify_forwards_as_the_settings_say(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, apply_to_verify: str) -> None:
    """``python -m oea.launch.sglang`` (direct patching, no plugin system) hands the recorder ``OEA_TRACE_FILE`` and
    ``OEA_APPLY_TO_VERIFY`` as ``register`` does: a verify forward is recorded exactly when it is 1."""
    from test_sglang_decode_detection import fake_sglang

    import oea.integrations.sglang.recording as recording

    for field, value in (("settings", None), ("verify", False), ("checked", False)):
        monkeypatch.setattr(recording.TRACE, field, value)  # restored after the test
    fake_sglang(monkeypatch, "0.5.23")
    trace = tmp_path / "direct.safetensors"
    monkeypatch.setenv("OEA_TRACE_FILE", str(trace))  # the process's own settings, read at install
    settings = settings_from_env({"OEA_K0": "2", "OEA_APPLY_TO_VERIFY": apply_to_verify})
    assert plugin_entry.install_without_registry(settings)
    assert recording.TRACE.settings is not None and str(recording.TRACE.settings.path) == str(trace)
    assert recording.TRACE.verify is (apply_to_verify == "1")


def test_direct_patching_of_an_sglang_without_post_process_keeps_decode_detection_and_wraps_select_experts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang whose TopK has no ``_post_process_topk_ids``: the decode-detection hooks are installed as on any
    version, ``select_experts`` gets the legacy AROUND rewrite in place of its BEFORE hook, and nothing is hooked on
    the missing post-processing."""
    from test_sglang_decode_detection import fake_sglang

    from oea.integrations.sglang import hooks as plugin_hooks
    from oea.integrations.sglang.hooks import select_experts_before
    from oea.integrations.sglang.routing import select_experts_around_legacy

    fake_sglang(monkeypatch, "0.5.14-0.5.22")
    topk = sys.modules[sglang_targets.TOPK_MODULE]
    monkeypatch.delattr(topk, "_post_process_topk_ids")
    patched = plugin_entry.install_without_registry(settings_from_env({"OEA_K0": "2"}))
    assert sglang_targets.MODEL_RUNNER_FORWARD_TARGET in patched and sglang_targets.SELECT_EXPERTS_TARGET in patched
    assert sglang_targets.POST_PROCESS_TARGET not in patched
    assert plugin_hooks.has_hook(topk.select_experts, select_experts_around_legacy)
    assert not plugin_hooks.has_hook(topk.select_experts, select_experts_before)


def test_each_target_that_cannot_be_patched_is_warned_once_in_its_own_words(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from test_sglang_decode_detection import fake_sglang

    fake_sglang(monkeypatch, "0.5.14-0.5.22")
    runner = sys.modules[f"{sglang_targets.MODEL_EXECUTOR}.model_runner"].ModelRunner
    monkeypatch.delattr(runner, "forward")
    monkeypatch.delattr(sys.modules[sglang_targets.TOPK_MODULE], "_post_process_topk_ids")
    monkeypatch.setattr(plugin_entry, "hook_plan", lambda: [
        (sglang_targets.MODEL_RUNNER_FORWARD_TARGET, lambda original, *a, **k: original(*a, **k), "AROUND"),
        (sglang_targets.CPU_GRAPH_CAPTURE_TARGET + "_gone", lambda *a, **k: None, "BEFORE")])
    with caplog.at_level(logging.WARNING):
        patched = plugin_entry.install_without_registry(settings_from_env({"OEA_K0": "2"}))
        plugin_entry.install_without_registry(settings_from_env({"OEA_K0": "2"}))  # again: no second warning
    failed = [sglang_targets.MODEL_RUNNER_FORWARD_TARGET, sglang_targets.CPU_GRAPH_CAPTURE_TARGET + "_gone"]
    warnings = [w for w in _warnings(caplog) if w.startswith("oea: cannot hook ")]
    assert [w.split(" (", 1)[0] for w in warnings] == [f"oea: cannot hook {target}" for target in failed]
    assert all(w.endswith(f"); supported versions: {sglang_targets.SUPPORTED_VERSIONS}") for w in warnings)
    assert patched == [sglang_targets.SELECT_EXPERTS_TARGET]
