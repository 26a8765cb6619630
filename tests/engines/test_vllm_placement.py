"""``OEA_POLICY=ep`` against vLLM's own EP objects, in .venv-vllm (no server): placements read from real
``ExpertMapManager`` / ``EplbLayerState`` objects (linear, round-robin, EPLB replicas, a map missing experts,
no EP), refreshed in place when EPLB rebalances; the plugin's CPU op routes with ``EPOEAConfig``; on the
bundled traces at EP = 8 its busiest device equals ``oea simulate``'s; data-parallel guards (gathered
logits, routing outside an engine step)."""

from __future__ import annotations

import pytest
from vllm_env import checks_fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow]


CHECKS = r'''
import json, logging, os
import torch
torch.set_num_threads(1)
for var in [v for v in os.environ if v.startswith("OEA_")]:
    os.environ.pop(var)
from vllm.config.parallel import ParallelConfig  # noqa: F401  (vLLM's config import order)
from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbState, compute_logical_maps
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
import oea
import oea.integrations.vllm.placement as placement
import oea.integrations.vllm.routing as routing
from oea.config import settings_from_env
from oea.integrations.vllm.state import STATE
from oea.routing import EPOEAConfig, ExpertPlacement, max_device_active_experts

warnings = []
class Collect(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("vllm.oea").addHandler(Collect(level=logging.WARNING))

def manager(num_slots, ep, strategy="linear", groups=None, rank=0, dp=1):
    cfg = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=dp, ep_size=ep, tp_rank=0, pcp_rank=0, dp_rank=0,
                                 ep_rank=rank, sp_size=1, use_ep=ep > 1, all2all_backend="naive", enable_eplb=False)
    return ExpertMapManager(max_num_batched_tokens=64, top_k=8, global_num_experts=num_slots, num_redundant_experts=0,
                            num_expert_group=groups, moe_parallel_config=cfg, placement_strategy=strategy,
                            enable_eplb=False)

class Layer:  # the attributes of vLLM's MoERunner that the plugin reads
    def __init__(self, mgr):
        self.expert_map_manager = mgr

def eplb_router(slot_to_logical, num_logical):
    l2p, count = compute_logical_maps(torch.tensor(slot_to_logical), num_logical)
    router = CPURouter(top_k=8, global_num_experts=len(slot_to_logical), renormalize=True)
    router.eplb_state = EplbLayerState(logical_to_physical_map=l2p, logical_replica_count=count)
    return router

out = {}
plain = CPURouter(top_k=8, global_num_experts=128, renormalize=True)
p, detail = placement.read_layer_placement(Layer(manager(128, 8)), plain)
out["linear"] = {"device": p.device_of_expert.tolist(), "detail": detail}
p, detail = placement.read_layer_placement(Layer(manager(128, 8, "round_robin", groups=8)), plain)
out["round_robin"] = {"device": p.device_of_expert.tolist(), "detail": detail}
slots = EplbState.build_initial_global_physical_to_logical_map(128, 8)  # 136 slots, experts 0..7 twice
p, detail = placement.read_layer_placement(Layer(manager(136, 8)), eplb_router(slots, 128))
out["eplb"] = {"device": p.device_of_expert.tolist(), "detail": detail}
holes = [e if e not in (5, 9) else 0 for e in range(128)]  # experts 5 and 9 held by no slot
out["missing"] = placement.read_layer_placement(Layer(manager(128, 8)), eplb_router(holes, 128))[1]
out["no_ep"] = placement.read_layer_placement(Layer(manager(128, 1)), plain)[1]
out["dp_ep"] = placement.read_layer_placement(Layer(manager(128, 8, dp=2)), plain)[1]

# The plugin as register() + Worker.load_model set it up, OEA_K0=3 OEA_POLICY=ep, three layers:
# EP 8 (read), a map missing experts (plain OEA, warned), no EP (plain OEA, warned).
STATE.settings = settings_from_env({"OEA_K0": "3", "OEA_POLICY": "ep"})
STATE.mode = "oea"
STATE.originals["CPURouter"] = CPURouter.__dict__["_compute_routing"]
routing.define_cpu_op()
routers = [CPURouter(top_k=8, global_num_experts=128, renormalize=True), eplb_router(holes, 128),
           CPURouter(top_k=8, global_num_experts=128, renormalize=True)]
layers = [Layer(manager(128, 8)), Layer(manager(128, 8)), Layer(manager(128, 1))]
for i, router in enumerate(routers):
    router._oea_router_id, router._oea_layer = i, f"model.layers.{i}.mlp.experts"
    STATE.routers.append(router)
    STATE.specs.append(oea.integrations.vllm.router_spec(router)[0])
placement.setup([(i, layer, router) for i, (layer, router) in enumerate(zip(layers, routers))])
out["configs"] = [type(placement.config_for(i)).__name__ for i in range(3)]
out["warnings"] = warnings

logits = (torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
stock_w, stock_ids = STATE.originals["CPURouter"](routers[0], None, logits, None)
STATE.decode = True
w, ids = routing.cpu_route_body(logits, stock_w, stock_ids, 0)
want_ids, want_w = oea.route(logits, STATE.specs[0], placement.config_for(0))
out["ep_route_equal"] = torch.equal(ids.long(), want_ids) and torch.equal(w, want_w)
plain_ids, plain_w = oea.route(logits, STATE.specs[0], oea.OEAConfig(3))
dev = placement.config_for(0).placement
out["busiest"] = {"ep": int(max_device_active_experts(ids.long(), w, dev)),
                  "plain": int(max_device_active_experts(plain_ids, plain_w, dev)),
                  "T_ep": int(oea.active_experts(ids.long(), w)),
                  "T_plain": int(oea.active_experts(plain_ids, plain_w))}
STATE.decode = False  # a forward outside execute_model (DP dummy batch, warm-up): stock routing
w, ids = routing.cpu_route_body(logits, stock_w, stock_ids, 0)
out["outside_step_stock"] = torch.equal(w, stock_w) and torch.equal(ids, stock_ids)

# EPLB rebalances: the wrapped EplbState method rereads the placement into the same tensor.
before = placement.config_for(0).placement.device_of_expert
layers[0].expert_map_manager = manager(128, 8, "round_robin", groups=8)  # the engine's map changes
# vLLM's own rearrange needs a running engine: the wrapper calls a stand-in for it (in place of the original it
# keeps as __wrapped__), so what is tested is that the wrapper rereads the placements after the original returns.
placement.install_rebalance_hook()
changed_log = []
hooked = EplbState.__dict__["rearrange"]
vllms_rearrange, hooked.__wrapped__ = hooked.__wrapped__, lambda self: changed_log.append("rearranged")
hooked(object())
hooked.__wrapped__ = vllms_rearrange
changed = changed_log
out["refresh"] = {"same_tensor": placement.config_for(0).placement.device_of_expert is before,
                  "device": placement.config_for(0).placement.device_of_expert.tolist(), "calls": changed,
                  "hook_wrapped": [n for n in placement.EPLB_HOOKS
                                   if getattr(EplbState.__dict__.get(n), "_oea_wrapped", False)]}

# Busiest device at EP = 8 on bundled traces: the plugin's op on each batch against oea simulate.
from oea.sim.simulate import make_batches, router_inputs
from oea.traces import load_trace
figures = {}
for name, layer in (("qwen3-30b-a3b", 0), ("qwen3-30b-a3b", 24), ("flame-moe-290m", 3), ("olmoe-1b-7b-decode", 8)):
    trace = load_trace(name)
    x, spec, _ = router_inputs(trace, layer)
    n = spec.num_experts
    router = CPURouter(top_k=spec.top_k, global_num_experts=n, renormalize=spec.renormalize)
    STATE.routers[:], STATE.specs[:] = [router], [spec]
    STATE.routers[0]._oea_router_id = 0
    placement.CONFIGS.configs.clear()
    placement.setup([(0, Layer(manager(n, 8)), STATE.routers[0])])
    batches = make_batches(trace, 16, "mixed", 24, torch.Generator().manual_seed(5))
    busiest = []
    STATE.decode = True
    for batch in batches:
        sw, sids = STATE.originals["CPURouter"](STATE.routers[0], None, x[batch], None)
        w, ids = routing.cpu_route_body(x[batch], sw, sids, 0)
        busiest.append(int(max_device_active_experts(ids.long(), w, placement.config_for(0).placement)))
    figures[f"{name}:{layer}"] = sum(busiest) / len(busiest)
out["ep8_traces"] = figures
print("RESULT" + json.dumps(out))
'''


result = checks_fixture(CHECKS)


def test_linear_and_round_robin_placements_are_vllms_own(result: dict) -> None:
    assert result["linear"]["device"] == [e // 16 for e in range(128)]
    assert "128 experts on 8 EP devices (16 each, contiguous blocks); vLLM linear placement" in result["linear"][
        "detail"]
    assert result["round_robin"]["device"] == [e % 8 for e in range(128)]
    assert "engine map" in result["round_robin"]["detail"]


def test_eplb_replicas_count_on_their_first_replicas_device(result: dict) -> None:
    device = result["eplb"]["device"]  # 136 slots, 17 per rank; slots 128..135 hold experts 0..7 again
    assert device == [slot // 17 for slot in range(128)]
    assert "8 replicated" in result["eplb"]["detail"] and "EPLB map of 136 slots" in result["eplb"]["detail"]


def test_bad_placements_keep_plain_oea_and_say_why(result: dict) -> None:
    assert result["missing"] == "placement does not cover every expert: missing experts [5, 9]"
    assert result["no_ep"] == "vLLM runs this layer without expert parallelism (EP size 1)"
    assert result["dp_ep"].startswith("2 data-parallel ranks route separately: each would fill the same idle EP")
    assert result["configs"] == ["EPOEAConfig", "OEAConfig", "OEAConfig"]
    named = [w for w in result["warnings"] if "missing experts [5, 9]" in w]
    assert named and "model.layers.1.mlp.experts keeps plain OEA" in named[0]
    assert any("without expert parallelism" in w and "keeps plain OEA" in w for w in result["warnings"])


def test_cpu_op_routes_with_the_ep_config(result: dict) -> None:
    assert result["ep_route_equal"]
    busiest = result["busiest"]
    assert busiest["ep"] == busiest["plain"], "EP-aware OEA never raises the busiest device's count"
    assert busiest["T_ep"] >= busiest["T_plain"]
    assert result["outside_step_stock"]


def test_rebalance_updates_the_placement_in_place(result: dict) -> None:
    refresh = result["refresh"]
    assert refresh["same_tensor"] and refresh["device"] == [e % 8 for e in range(128)]
    assert refresh["calls"] == ["rearranged"]
    assert set(refresh["hook_wrapped"]) == {"rearrange", "update_mapping"}


def test_busiest_device_at_ep8_equals_the_simulator_on_bundled_traces(result: dict) -> None:
    """The plugin's CPU op (in .venv-vllm) against ``oea simulate`` (here) on the same 24 batches of 16 tokens."""
    from oea.sim import simulate

    for key, plugin in result["ep8_traces"].items():
        name, layer = key.split(":")
        row = simulate(name, policies=["ep-oea"], k0s=[3], batch_sizes=[16], num_batches=24, seed=5, ep=8,
                       layers=[int(layer)])[0]
        assert plugin == pytest.approx(row["max_device_active_experts"], rel=0.05), key
        print(f"{key}: busiest of 8 EP devices, plugin {plugin:.3f} vs oea simulate "
              f"{row['max_device_active_experts']:.3f}")
