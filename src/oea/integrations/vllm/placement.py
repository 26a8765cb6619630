"""EP-aware OEA in vLLM (``OEA_POLICY=ep``): each MoE layer's ``ExpertPlacement`` from vLLM's own EP layout.

At model load (``plugin._after_load`` calls ``setup``) every rewritable router gets an ``EPOEAConfig`` whose
placement is read from its layer (``read_layer_placement``):

* the layer's ``expert_map_manager`` gives the EP size and placement strategy (``linear`` or
  ``round_robin``) over its physical slots, and vLLM's own ``determine_expert_map`` says which rank holds
  each slot;
* with EPLB the router's ``eplb_state.logical_to_physical_map`` [logical, replicas] maps logical experts to
  slots; a replicated expert counts on the device of its first replica (vLLM picks a replica per token);
* ``oea.integrations.placement.placement_from_slots`` validates it: a layer whose placement misses experts
  (named in the warning) or cannot be read keeps plain OEA, one warning per reason.

Without expert parallelism (EP size 1), and with several data-parallel ranks (each routes its own rows, so
the ranks would all fill the same idle EP ranks and the busiest one could grow), every layer keeps plain OEA
with one warning. When EPLB rebalances
(``EplbState.rearrange`` / ``update_mapping``, wrapped by ``install_rebalance_hook``) the placements are
reread right after it, between steps, and updated in place. Each router's EP-aware config and the placement's
description are kept on its ``router_state.RouterState`` (``ep``, ``ep_detail``); ``CONFIGS`` reads and writes
them there by router id, and ``config_for(router_id)`` is the router's base config.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from oea.integrations.placement import EPLayerConfigs, describe_placement, placement_from_slots
from oea.integrations.runtime import call_after
from oea.integrations.vllm.router_state import router_state
from oea.integrations.vllm.state import STATE, log, warn_once
from oea.routing import EPOEAConfig, ExpertPlacement, OEAConfig, RouterSpec, max_device_active_experts, route
from oea.routing.layered import EP_IGNORES_MAX_EXPERTS

EPLB_HOOKS = ("rearrange", "update_mapping")  # EplbState methods that change the logical->physical map


class _RouterField(MutableMapping[int, Any]):
    """Router id -> one field of the numbered routers' ``RouterState`` (routers where it is set): the storage of
    ``EPLayerConfigs``, which then keeps nothing of its own."""

    def __init__(self, name: str, unset: Any) -> None:
        self.name, self.unset = name, unset

    def __getitem__(self, router_id: int) -> Any:
        if not 0 <= router_id < len(STATE.routers):
            raise KeyError(router_id)
        value = getattr(router_state(router_id), self.name)
        if value == self.unset:
            raise KeyError(router_id)
        return value

    def __setitem__(self, router_id: int, value: Any) -> None:
        setattr(router_state(router_id), self.name, value)

    def __delitem__(self, router_id: int) -> None:
        self[router_id]  # KeyError when unset
        setattr(router_state(router_id), self.name, self.unset)

    def __iter__(self) -> Iterator[int]:
        return iter([i for i in range(len(STATE.routers)) if getattr(router_state(i), self.name) != self.unset])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def read_layer_placement(layer: Any, router: Any) -> tuple[ExpertPlacement | None, str]:
    """``(placement, description)`` of one vLLM MoE layer, or ``(None, why)`` when it has none."""
    manager = getattr(layer, "expert_map_manager", None)
    if manager is None:
        return None, "the layer has no expert map (not a vLLM MoE runner)"
    ep_size = int(getattr(manager, "ep_size", 1) or 1)
    if not getattr(manager, "use_ep", False) or ep_size <= 1:
        return None, "vLLM runs this layer without expert parallelism (EP size 1)"
    dp_size = int(getattr(getattr(manager, "moe_parallel_config", None), "dp_size", 1) or 1)
    if dp_size > 1:
        return None, (f"{dp_size} data-parallel ranks route separately: each would fill the same idle EP ranks, "
                      "so the busiest one could grow (see oea simulate --dp --ep)")
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    num_slots = int(manager.global_num_experts)
    strategy = manager.placement_strategy
    device_of_slot = [-1] * num_slots
    for rank in range(ep_size):
        _, expert_map, _ = determine_expert_map(ep_size, rank, num_slots, strategy)
        if expert_map is None:
            return None, f"vLLM gave no expert map for EP rank {rank}"
        for slot in (expert_map[:num_slots] >= 0).nonzero().flatten().tolist():
            device_of_slot[slot] = rank
    eplb = getattr(router, "eplb_state", None)
    logical_to_physical = getattr(eplb, "logical_to_physical_map", None)
    if logical_to_physical is None:
        logical_of_slot, num_logical, how = list(range(num_slots)), num_slots, ""
    else:
        table = logical_to_physical.detach().cpu().tolist()  # [logical, replicas], -1 where unused
        num_logical, logical_of_slot = len(table), [-1] * num_slots
        for expert, replicas in enumerate(table):
            for slot in replicas:
                if 0 <= slot < num_slots:
                    logical_of_slot[slot] = expert
        how = f", EPLB map of {num_slots} slots"
    try:
        placement = placement_from_slots(device_of_slot, logical_of_slot, num_logical, ep_size)
    except ValueError as err:
        return None, str(err)
    replicated = num_slots - len({e for e in logical_of_slot if e >= 0}) if how else 0
    return placement, f"{describe_placement(placement, replicated)}; vLLM {strategy} placement{how}"


def setup(routers: list[tuple[int, Any, Any]]) -> None:
    """``OEA_POLICY=ep``: an ``EPOEAConfig`` for every ``(router id, layer, router)`` whose placement reads."""
    settings = STATE.settings
    if settings is None or settings.oea is None or settings.policy != "ep":
        return
    if settings.max_experts is not None:
        warn_once("ep-max-experts", EP_IGNORES_MAX_EXPERTS)
    for router_id, layer, router in routers:
        router_state(router_id).layer = layer
        built = CONFIGS.build(router_id, settings.oea)
        name = getattr(router, "_oea_layer", router_id)
        if isinstance(built, str):
            warn_once(f"ep:{built}", f"OEA_POLICY=ep: layer {name} keeps plain OEA: {built}")
        else:
            log.info("oea: EP-aware OEA on layer %s: %s", name, CONFIGS.details[router_id])
    install_rebalance_hook()


def config_for(router_id: int) -> Any:
    """The routing config of a router: its ``EPOEAConfig`` under ``OEA_POLICY=ep``, else ``OEA_K0``'s."""
    return router_state(router_id).base_config()


def install_rebalance_hook() -> list[str]:
    """Wrap vLLM's EPLB map updates so that the placements are reread right after each one."""
    try:
        from vllm.distributed.eplb.eplb_state import EplbState
    except ImportError as err:
        warn_once("eplb-import", f"vLLM's EplbState not found ({err}); EP placements are read once at load")
        return []
    return [f"EplbState.{name}" for name in EPLB_HOOKS if call_after(EplbState, name, CONFIGS.refresh_if_built)]


def _read(router_id: int) -> tuple[ExpertPlacement | None, str]:
    return read_layer_placement(router_state(router_id).layer, STATE.routers[router_id])


CONFIGS = EPLayerConfigs(_read, log, configs=_RouterField("ep", None), details=_RouterField("ep_detail", ""))
refresh = CONFIGS.refresh  # reread every EP layer's placement (vLLM rebalanced); logs what changed


def doctor_placement() -> str:
    """``oea doctor vllm``: the placement the plugin reads from vLLM's own expert map (an EP = 8 layer of 128
    experts, as a server's worker would see it) and a routing self-test on it; raises ``RuntimeError``."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    policy = STATE.settings.policy if STATE.settings is not None else "oea"
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=8, tp_rank=0, pcp_rank=0, dp_rank=0,
                                      ep_rank=0, sp_size=1, use_ep=True, all2all_backend="naive", enable_eplb=False)
    manager = ExpertMapManager(max_num_batched_tokens=16, top_k=8, global_num_experts=128, num_redundant_experts=0,
                               num_expert_group=None, moe_parallel_config=parallel, placement_strategy="linear",
                               enable_eplb=False)
    layer = type("MoELayer", (), {"expert_map_manager": manager})()
    placement, detail = read_layer_placement(layer, router=None)
    if placement is None:
        raise RuntimeError(f"cannot read vLLM's expert map: {detail}")
    logits = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * 2
    spec = RouterSpec(128, 8)
    ep_ids, ep_w = route(logits, spec, EPOEAConfig(2, placement))
    ids, w = route(logits, spec, OEAConfig(2))
    ep_max, plain_max = (int(max_device_active_experts(i, x, placement)) for i, x in ((ep_ids, ep_w), (ids, w)))
    if ep_max > plain_max:
        raise RuntimeError(f"EP-aware OEA raised the busiest device: {plain_max} -> {ep_max}")
    where = "each server layer's placement is logged at load" if policy == "ep" else "used with OEA_POLICY=ep"
    return (f"OEA_POLICY={policy}; from vLLM's expert map (EP=8 example): {detail}; k0=2 self-test: busiest "
            f"device {plain_max} -> {ep_max} (never more), {where}")
