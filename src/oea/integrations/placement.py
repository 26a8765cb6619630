"""Expert placements read from an engine (``OEA_POLICY=ep``), shared by the vLLM and SGLang adapters.

Engines place *physical* expert slots on expert-parallel devices and map each slot to a *logical* expert
(the router's column); with EPLB a logical expert may have several slots (replicas). OEA routes on logical
ids, before the engine's logical->physical remap, so EP-aware OEA needs one device per logical expert:
the device of the replica that serves it (the engine's own choice where it has one, such as SGLang's
static dispatch map for this rank; otherwise its first replica). ``placement_from_slots`` builds that
``ExpertPlacement`` and validates it (every logical expert placed, every replica's device known), and
``EPLayerConfigs`` keeps one ``EPOEAConfig`` per layer whose placement tensor is updated in place when the
engine rebalances, so captured graphs keep reading the current placement.

Engine-free: the adapters read the engine's tensors and call these functions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oea.routing import EPOEAConfig, ExpertPlacement, OEAConfig


def placement_from_slots(
    device_of_slot: Sequence[int], logical_of_slot: Sequence[int], num_logical: int, num_devices: int,
    serving_slot: Mapping[int, int] | None = None,
) -> ExpertPlacement:
    """The logical experts' placement from an engine's physical slots.

    Args:
        device_of_slot: [P] the EP device (rank) holding each physical slot.
        logical_of_slot: [P] the logical expert in each slot (-1: an empty slot).
        num_logical: N, logical experts (router columns).
        num_devices: D, expert-parallel devices.
        serving_slot: logical expert -> the slot that serves it when it has several (default: its first).

    Raises:
        ValueError: naming the logical experts no slot holds, a slot on a device outside 0..D-1, or a
            serving slot that does not hold its expert.
    """
    if len(device_of_slot) != len(logical_of_slot):
        raise ValueError(f"{len(device_of_slot)} slot devices but {len(logical_of_slot)} slot experts")
    bad = sorted({d for d in device_of_slot if not 0 <= d < num_devices})
    if bad:
        raise ValueError(f"slots on devices {bad}, outside 0..{num_devices - 1}")
    slots: dict[int, list[int]] = {}
    per_device: list[list[int]] = [[] for _ in range(num_devices)]
    for slot, (device, expert) in enumerate(zip(device_of_slot, logical_of_slot, strict=True)):
        if expert >= 0:
            slots.setdefault(expert, []).append(slot)
            per_device[device].append(expert)
    missing = [e for e in range(num_logical) if e not in slots]
    if missing:
        raise ValueError(f"placement does not cover every expert: missing experts {missing}")
    replica_map: dict[int, int] = {}
    for expert, held in slots.items():
        chosen = (serving_slot or {}).get(expert, held[0])
        if chosen not in held:
            raise ValueError(f"logical expert {expert} is served by slot {chosen}, which holds expert "
                             f"{logical_of_slot[chosen] if 0 <= chosen < len(logical_of_slot) else 'none'}")
        if len({device_of_slot[s] for s in held}) > 1:
            replica_map[expert] = device_of_slot[chosen]
    return ExpertPlacement.from_devices(per_device, num_logical, replica_map)


def contiguous_slots(num_slots: int, num_devices: int) -> list[int]:
    """[P] device of each slot when each device holds a contiguous, equal block of slots."""
    if num_devices < 1 or num_slots % num_devices:
        raise ValueError(f"{num_slots} expert slots do not split evenly over {num_devices} devices")
    return [slot // (num_slots // num_devices) for slot in range(num_slots)]


def describe_placement(placement: ExpertPlacement, replicated: int = 0) -> str:
    """One line: devices, experts per device (busiest / least) and whether the layout is contiguous."""
    device = placement.device_of_expert.cpu()
    counts = torch.bincount(device, minlength=placement.num_devices).tolist()
    n = device.numel()
    contiguous = n % placement.num_devices == 0 and torch.equal(
        device, torch.arange(n) // (n // placement.num_devices))
    layout = "contiguous blocks" if contiguous else "engine map"
    spread = f"{counts[0]}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
    extra = f", {replicated} replicated" if replicated else ""
    return f"{n} experts on {placement.num_devices} EP devices ({spread} each, {layout}{extra})"


@dataclass
class EPLayerConfigs:
    """One ``EPOEAConfig`` per MoE layer (by the adapter's layer key), built from ``OEAConfig`` and each
    layer's placement; ``refresh`` rereads every placement and updates the tensors in place.

    ``read`` maps a layer key to ``(placement or None, detail)``: the placement the engine uses for that
    layer, or why there is none (the layer then keeps plain OEA).
    """

    read: Callable[[Any], tuple[ExpertPlacement | None, str]]
    log: logging.Logger | None = None  # where ``refresh`` says what changed
    # layer key -> its config / the placement read (or why none): a dict, or the adapter's view of its own
    # per-layer objects (vLLM keeps both on each router's state)
    configs: MutableMapping[Any, EPOEAConfig] = field(default_factory=dict)
    details: MutableMapping[Any, str] = field(default_factory=dict)

    def build(self, key: Any, cfg: OEAConfig) -> EPOEAConfig | str:
        """The layer's EP-aware config, or the reason it keeps plain OEA (the detail of ``read``)."""
        placement, detail = self.read(key)
        self.details[key] = detail
        if placement is None:
            return detail
        ep_cfg = EPOEAConfig(cfg.k0, placement, min_batch=cfg.min_batch, group_fill=cfg.group_fill)
        self.configs[key] = ep_cfg
        return ep_cfg

    def refresh(self) -> list[str]:
        """Reread every layer's placement (after the engine rebalanced); returns the layers that changed.

        A placement with the same number of devices is copied into the existing tensor (graphs captured
        with it read the new one); a layer whose placement can no longer be read keeps its last one and
        the reason is returned with it.
        """
        changed = []
        for key, cfg in self.configs.items():
            placement, detail = self.read(key)
            self.details[key] = detail
            if placement is None:
                changed.append(f"{key}: kept the last placement ({detail})")
                continue
            current = cfg.placement
            new = placement.device_of_expert.to(current.device_of_expert.device)
            if placement.num_devices != current.num_devices or new.shape != current.device_of_expert.shape:
                changed.append(f"{key}: the number of devices or experts changed; kept the last placement")
                continue
            if not torch.equal(new, current.device_of_expert):
                current.device_of_expert.copy_(new)
                changed.append(str(key))
        if changed and self.log is not None:
            self.log.info("oea: EPLB rebalanced; EP-aware OEA placements updated: %s", ", ".join(changed))
        return changed

    def refresh_if_built(self) -> None:
        """``refresh`` when some layer has an EP-aware config (what runs after the engine's rebalance)."""
        if self.configs:
            self.refresh()
