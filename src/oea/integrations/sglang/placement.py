"""EP-aware OEA in SGLang (``OEA_POLICY=ep``): each MoE layer's ``ExpertPlacement`` from SGLang's own EP layout.

SGLang keeps one ``ExpertLocationMetadata`` per process (``get_global_expert_location_metadata``): the EP size,
``physical_to_logical_map`` [layers, physical slots] (slot p lives on EP rank ``p // num_local_physical_experts``)
and, with static dispatch, ``logical_to_rank_dispatch_physical_map`` [layers, logical]: the replica this rank
sends each logical expert to. ``read_layer_placement`` turns one layer's rows into an ``ExpertPlacement`` over
logical experts (``oea.integrations.placement.placement_from_slots``: every logical expert placed, each
replicated one on the device of the replica this rank uses, or its first replica without static dispatch).

Each layer's placement is read at its first decode routing call, on the router logits' device. SGLang runs
every decode graph's forward twice eagerly before capturing it, so that call is never inside a capture and
the captured graph reads the placement tensor without a host copy (a layer first met during a capture keeps
plain OEA, with a warning). ``ExpertLocationMetadata.update`` (an EPLB rebalance) is wrapped by ``install``:
the placements are reread right after it and copied into the same tensors, which captured graphs see; new
metadata (SGLang replacing the object) is read again at the next eager call. A layer whose placement cannot
be read, or a run without expert parallelism, keeps plain OEA with one warning per reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import replace
from typing import Any

from oea.integrations.placement import EPLayerConfigs, describe_placement, placement_from_slots
from oea.integrations.runtime import call_after, graph_capturing
from oea.integrations.sglang.router_state import RouterState
from oea.integrations.sglang.state import STATE, log, warn_once
from oea.routing import EPOEAConfig, ExpertPlacement, OEAConfig
from oea.routing.layered import EP_IGNORES_MAX_EXPERTS

LOCATION_MODULE = "sglang.srt.eplb.expert_location"



class _LayerField(MutableMapping[Any, Any]):
    """Layer id -> one field of its ``RouterState`` (layers where it is set): the storage of ``EPLayerConfigs``,
    which then keeps nothing of its own."""

    def __init__(self, name: str, unset: Any) -> None:
        self.name, self.unset = name, unset

    def __getitem__(self, layer_id: Any) -> Any:
        state = STATE.routers.get(layer_id)
        value = self.unset if state is None else getattr(state, self.name)
        if value is self.unset or value == self.unset:
            raise KeyError(layer_id)
        return value

    def __setitem__(self, layer_id: Any, value: Any) -> None:
        setattr(STATE.routers[layer_id], self.name, value)  # a layer's placement is read for its state

    def __delitem__(self, layer_id: Any) -> None:
        self[layer_id]  # KeyError when unset
        setattr(STATE.routers[layer_id], self.name, self.unset)

    def __iter__(self) -> Iterator[Any]:
        return iter([key for key, state in STATE.routers.items() if getattr(state, self.name) != self.unset])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def read_layer_placement(layer_id: Any) -> tuple[ExpertPlacement | None, str]:
    """``(placement, description)`` of one SGLang MoE layer (by ``layer_id``), or ``(None, why)``."""
    meta = importlib.import_module(LOCATION_MODULE).get_global_expert_location_metadata()
    if meta is None:
        return None, "SGLang has no expert location metadata (no expert parallelism for this model)"
    if int(meta.ep_size) <= 1:
        return None, "SGLang runs without expert parallelism (ep_size 1)"
    local = _local_dp_routing()
    if local:
        return None, local
    if not isinstance(layer_id, int) or not 0 <= layer_id < meta.num_layers:
        return None, f"layer_id {layer_id!r} is not in SGLang's expert location metadata ({meta.num_layers} layers)"
    slots = meta.physical_to_logical_map_cpu[layer_id].tolist()
    per_device = meta.num_local_physical_experts
    dispatch = meta.logical_to_rank_dispatch_physical_map
    serving = None if dispatch is None else dict(enumerate(dispatch[layer_id].cpu().tolist()))
    try:
        placement = placement_from_slots([slot // per_device for slot in range(len(slots))], slots,
                                         meta.num_logical_experts, int(meta.ep_size), serving)
    except ValueError as err:
        return None, str(err)
    replicated = len(slots) - len(set(slots))
    how = "static dispatch of this rank" if dispatch is not None else "first replica (no static dispatch)"
    return placement, f"{describe_placement(placement, replicated)}; SGLang EP layout, replicas: {how}"


def _local_dp_routing() -> str | None:
    """Why EP-aware OEA cannot run when DP-attention ranks route their own rows (an all-to-all MoE backend);
    None when the routing call sees every rank's rows (no DP attention, or tokens gathered before the MoE)."""
    try:
        from sglang.srt.runtime_context import get_exec, get_parallel

        dp, a2a = int(getattr(get_parallel(), "attn_dp_size", 1) or 1), get_exec().moe.moe_a2a_backend
    except Exception as exc:  # an SGLang without these settings (older than runtime_context), or none published
        warn_once("ep-dp-unread", f"OEA_POLICY=ep: cannot read SGLang's DP-attention settings ({exc!r}); EP-aware "
                                  "OEA assumes each routing call sees the whole step's rows")
        return None
    if dp > 1 and a2a not in (None, "none"):
        return (f"{dp} DP-attention ranks route their own rows (moe_a2a_backend={a2a}): each would fill the same "
                "idle EP ranks, so the busiest one could grow (see oea simulate --dp --ep)")
    return None


CONFIGS = EPLayerConfigs(read_layer_placement, log, configs=_LayerField("ep", None),
                         details=_LayerField("ep_detail", ""))
refresh = CONFIGS.refresh  # reread the placements after SGLang updated its metadata (EPLB); logs what changed


def ep_config(state: RouterState, cfg: OEAConfig, device: Any = None) -> OEAConfig | EPOEAConfig:
    """The layer's base config under ``OEA_POLICY=ep``: ``cfg`` (``OEA_K0``'s) as ``EPOEAConfig`` on the layer's
    placement (read on ``device`` at the layer's first eager call, kept on its ``RouterState``), or ``cfg`` itself
    (plain OEA) when the layer has no usable placement. The layer's k0 (``OEA_LAYER_K0_FILE``) is composed on it
    by ``oea.routing.LayerConfigs.config``, as in vLLM."""
    layer_id = state.layer_id
    capturing = graph_capturing()
    meta = importlib.import_module(LOCATION_MODULE).get_global_expert_location_metadata()
    if meta is not state.ep_metadata and not capturing:  # first call, or SGLang replaced its metadata
        state.ep_metadata, state.ep, state.ep_detail = meta, None, ""
    if state.ep is None and not state.ep_detail:
        if capturing:
            warn_once(f"ep-capture:{layer_id}", f"OEA_POLICY=ep: layer {layer_id} was first met inside a CUDA-graph "
                                                "capture, where its placement cannot be read; plain OEA there")
            return cfg
        result = CONFIGS.build(layer_id, cfg)
        if isinstance(result, str):
            warn_once(f"ep:{result}", f"OEA_POLICY=ep: layer {layer_id} keeps plain OEA: {result}")
        else:
            placement = result.placement
            if device is not None:  # the captured graphs read it where the logits are, without a host copy
                placement = ExpertPlacement(placement.device_of_expert.to(device), placement.num_devices)
                state.ep = replace(result, placement=placement)
            log.info("oea: EP-aware OEA on layer %s: %s", layer_id, state.ep_detail)
    built = state.ep
    if built is None:
        return cfg
    if built.placement.device_of_expert.numel() != state.num_experts:
        warn_once(f"ep-size:{layer_id}", f"OEA_POLICY=ep: layer {layer_id} routes {state.num_experts} experts but "
                                         f"its placement has {built.placement.device_of_expert.numel()}; plain OEA")
        return cfg
    return built


def install() -> list[str]:
    """``OEA_POLICY=ep``: wrap ``ExpertLocationMetadata.update`` so that an EPLB rebalance rereads the placements."""
    settings = STATE.settings
    if settings is None or settings.policy != "ep":
        return []
    if settings.oea is not None and settings.max_experts is not None:
        warn_once("ep-max-experts", EP_IGNORES_MAX_EXPERTS)
    try:
        metadata = importlib.import_module(LOCATION_MODULE).ExpertLocationMetadata
    except (ImportError, AttributeError) as err:
        warn_once("ep-import", f"OEA_POLICY=ep: SGLang's expert location metadata is missing ({err}); every layer "
                               "keeps plain OEA")
        return []
    return ["ExpertLocationMetadata.update"] if call_after(metadata, "update", CONFIGS.refresh_if_built) else []



def doctor_placement() -> str:
    """``oea doctor sglang``: that SGLang's ``ExpertLocationMetadata`` has what the plugin reads, and the placement
    the plugin would build from an SGLang EP = 8 layout (256 experts + 8 redundant slots, 33 per rank)."""
    metadata = importlib.import_module(LOCATION_MODULE).ExpertLocationMetadata
    fields = set(getattr(metadata, "__dataclass_fields__", {}))
    needed = {"physical_to_logical_map_cpu", "logical_to_rank_dispatch_physical_map", "ep_size"}
    missing = sorted(needed - fields) + [name for name in ("num_local_physical_experts", "num_logical_experts",
                                                           "update") if not hasattr(metadata, name)]
    if missing:
        raise RuntimeError(f"SGLang's ExpertLocationMetadata lacks {missing}: OEA_POLICY=ep would keep plain OEA")
    slots = list(range(256)) + list(range(8))
    example = placement_from_slots([slot // 33 for slot in range(len(slots))], slots, 256, 8)
    policy = STATE.settings.policy if STATE.settings is not None else "oea"
    return (f"OEA_POLICY={policy}; reads ExpertLocationMetadata ({', '.join(sorted(needed))}); EP=8 example: "
            f"{describe_placement(example, 8)}; a server logs each layer's placement at its first decode call")
