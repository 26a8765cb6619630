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
from typing import Any

from oea.integrations.placement import EPLayerConfigs, describe_placement, placement_from_slots
from oea.integrations.runtime import call_after, graph_capturing
from oea.integrations.sglang.state import STATE, log, warn_once
from oea.routing import EPOEAConfig, ExpertPlacement, OEAConfig
from oea.routing.layered import EP_IGNORES_MAX_EXPERTS

LOCATION_MODULE = "sglang.srt.eplb.expert_location"

_DEVICE: dict[str, Any] = {"device": None, "metadata": None}


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
    device = _DEVICE["device"]
    if device is not None:
        placement = ExpertPlacement(placement.device_of_expert.to(device), placement.num_devices)
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


CONFIGS = EPLayerConfigs(read_layer_placement, log)
refresh = CONFIGS.refresh  # reread the placements after SGLang updated its metadata (EPLB); logs what changed


def ep_config(cfg: OEAConfig, num_experts: int, layer_id: Any, device: Any = None) -> OEAConfig | EPOEAConfig:
    """The layer's base config under ``OEA_POLICY=ep``: ``cfg`` (``OEA_K0``'s) as ``EPOEAConfig`` on the layer's
    placement (read on ``device`` at the layer's first eager call), or ``cfg`` itself (plain OEA) when the policy
    is ``oea`` or the layer has no usable placement. The layer's k0 (``OEA_LAYER_K0_FILE``) is composed on it by
    ``oea.routing.LayerConfigs.config``, as in vLLM."""
    settings = STATE.settings
    if settings is None or settings.policy != "ep":
        return cfg
    capturing = graph_capturing()
    meta = importlib.import_module(LOCATION_MODULE).get_global_expert_location_metadata()
    if meta is not _DEVICE["metadata"] and not capturing:  # first call, or SGLang replaced its metadata
        _DEVICE["metadata"] = meta
        CONFIGS.configs.clear()
        CONFIGS.details.clear()
    built = CONFIGS.configs.get(layer_id)
    if built is None and layer_id not in CONFIGS.details:
        if capturing:
            warn_once(f"ep-capture:{layer_id}", f"OEA_POLICY=ep: layer {layer_id} was first met inside a CUDA-graph "
                                                "capture, where its placement cannot be read; plain OEA there")
            return cfg
        _DEVICE["device"] = device
        result = CONFIGS.build(layer_id, cfg)
        if isinstance(result, str):
            warn_once(f"ep:{result}", f"OEA_POLICY=ep: layer {layer_id} keeps plain OEA: {result}")
        else:
            log.info("oea: EP-aware OEA on layer %s: %s", layer_id, CONFIGS.details[layer_id])
        built = CONFIGS.configs.get(layer_id)
    if built is None:
        return cfg
    if built.placement.device_of_expert.numel() != num_experts:
        warn_once(f"ep-size:{layer_id}", f"OEA_POLICY=ep: layer {layer_id} routes {num_experts} experts but its "
                                         f"placement has {built.placement.device_of_expert.numel()}; plain OEA")
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
