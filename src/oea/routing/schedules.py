"""k0 that depends on the batch size or on the layer (beyond the paper).

* ``AdaptiveK0Config``: k0(B) from a schedule — small batches, where OEA degrades most and saves
  least, get a safer (larger) k0. The batch size is the router call's row count M, a static shape
  per captured CUDA graph or compiled graph, so the choice is made at trace time: graph-safe.
* ``LayerK0Schedule``: one k0 per MoE layer, stored as a small JSON file that ``oea.attach`` and the
  engine plugins load (``OEA_LAYER_K0_FILE``). It records the router it was calibrated for, and
  loading it for another model fails with the mismatch named.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from oea.routing.policies import oea_policy, register_policy
from oea.routing.scores import RouterScores
from oea.routing.spec import GroupFill, OEAConfig, RouterSpec


@dataclass(frozen=True)
class AdaptiveK0Config:
    """OEA whose k0 is looked up from the batch size.

    Attributes:
        schedule: ``((max_batch, k0), ...)`` with increasing ``max_batch``; a batch of M rows uses
            the first entry with M <= max_batch, and the last entry beyond it.
        min_batch, group_fill: as in ``OEAConfig``.
    """

    schedule: tuple[tuple[int, int], ...]
    min_batch: int = 2
    group_fill: GroupFill = "in"

    def __post_init__(self) -> None:
        if not self.schedule:
            raise ValueError("schedule must hold at least one (max_batch, k0) entry, got ()")
        bounds = [b for b, _ in self.schedule]
        if bounds != sorted(set(bounds)) or bounds[0] < 1:
            raise ValueError(f"schedule max_batch values must be increasing and >= 1, got {bounds}")
        for _, k0 in self.schedule:
            OEAConfig(k0, min_batch=self.min_batch, group_fill=self.group_fill)

    def k0_for(self, batch_size: int) -> int:
        """The k0 used for a router call of ``batch_size`` rows."""
        for max_batch, k0 in self.schedule:
            if batch_size <= max_batch:
                return k0
        return self.schedule[-1][1]

    def check(self, spec: RouterSpec) -> None:
        """Every scheduled k0 must be in 1..top_k."""
        for _, k0 in self.schedule:
            OEAConfig(k0).check(spec)


@register_policy(AdaptiveK0Config)
def adaptive_policy(
    scores: RouterScores,
    vanilla_ids: torch.Tensor,
    spec: RouterSpec,
    cfg: AdaptiveK0Config,
    valid: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OEA with k0 = schedule(M)."""
    k0 = cfg.k0_for(vanilla_ids.shape[0])
    return oea_policy(scores, vanilla_ids, spec, OEAConfig(k0, group_fill=cfg.group_fill), valid)


@dataclass(frozen=True)
class LayerK0Schedule:
    """Per-layer k0 for one model (JSON-serialisable).

    Attributes:
        num_experts, top_k, num_layers: the router it was calibrated for.
        k0: one k0 per MoE layer, in layer order.
        min_batch: as in ``OEAConfig``.
        model: a free-form model name; ``calibration``: how it was made (trace, proxy, tolerance).
        layer_ids: the engine's decoder-layer index of each MoE layer, where it differs from
            0..num_layers-1 (e.g. DeepSeek/GLM models whose first layers are dense).
    """

    num_experts: int
    top_k: int
    num_layers: int
    k0: tuple[int, ...]
    min_batch: int = 2
    model: str = ""
    calibration: dict = field(default_factory=dict)
    layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_ids is not None and len(self.layer_ids) != self.num_layers:
            raise ValueError(f"layer_ids must list one id per layer, got {len(self.layer_ids)} ids and "
                             f"num_layers={self.num_layers}")
        if len(self.k0) != self.num_layers:
            raise ValueError(f"k0 must list one value per layer, got {len(self.k0)} values and "
                             f"num_layers={self.num_layers}")
        bad = [(i, k) for i, k in enumerate(self.k0) if not 1 <= k <= self.top_k]
        if bad:
            raise ValueError(f"k0 values must be in 1..top_k={self.top_k}, got (layer, k0) {bad}")

    def check_model(self, num_experts: int, top_k: int, num_layers: int) -> None:
        """Raise ``ValueError`` naming every field that disagrees with the model."""
        mismatches = [
            f"{name}: file has {mine}, model has {theirs}"
            for name, mine, theirs in (
                ("num_experts", self.num_experts, num_experts),
                ("top_k", self.top_k, top_k),
                ("num_layers", self.num_layers, num_layers),
            )
            if mine != theirs
        ]
        if mismatches:
            raise ValueError(f"per-layer k0 file was calibrated for another model ({'; '.join(mismatches)})")

    def index_of_layer_id(self, layer_id: int) -> int | None:
        """Position in ``k0`` of the engine's decoder layer ``layer_id`` (None when not listed)."""
        if self.layer_ids is not None:
            return self.layer_ids.index(layer_id) if layer_id in self.layer_ids else None
        return layer_id if 0 <= layer_id < self.num_layers else None

    def config_for_layer(self, layer: int) -> OEAConfig:
        """The ``OEAConfig`` of MoE layer ``layer`` (0-based, in model order)."""
        return OEAConfig(self.k0[layer], min_batch=self.min_batch)

    def save(self, path: str | Path) -> None:
        """Write the schedule as JSON."""
        data = asdict(self)
        data["k0"] = list(self.k0)
        if self.layer_ids is None:
            del data["layer_ids"]
        else:
            data["layer_ids"] = list(self.layer_ids)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> LayerK0Schedule:
        """Read a schedule written by ``save``; a missing file or field is a clear error."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"per-layer k0 file not found: {path}")
        data = json.loads(path.read_text())
        required = {"num_experts", "top_k", "num_layers", "k0"}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"per-layer k0 file {path} lacks fields {missing}")
        data["k0"] = tuple(data["k0"])
        if data.get("layer_ids") is not None:
            data["layer_ids"] = tuple(data["layer_ids"])
        known = {f for f in LayerK0Schedule.__dataclass_fields__}
        return LayerK0Schedule(**{key: value for key, value in data.items() if key in known})
