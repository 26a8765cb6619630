"""k0 that depends on the batch size or on the layer (beyond the paper).

* ``AdaptiveK0Config``: k0(B) from a schedule — small batches, where OEA degrades most and saves
  least, get a safer (larger) k0. The batch size is the router call's row count M, a static shape
  per captured CUDA graph or compiled graph, so the choice is made at trace time: graph-safe.
* ``LayerK0Schedule``: one k0 per MoE layer, optionally per batch-size range (``batch_k0``), stored as
  a small JSON file that ``oea.attach`` and the engine plugins load (``OEA_LAYER_K0_FILE``, read by
  ``oea.config.layer_configs``; ``oea.routing.LayerConfigs`` routes by it). It records the router it was
  calibrated for, and loading it for another model fails with the mismatch named.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from oea.routing.policies import oea_policy, register_policy
from oea.routing.scores import RouterScores
from oea.routing.spec import MAX_MIN_BATCH, GroupFill, OEAConfig, RouterSpec


@dataclass(frozen=True)
class AdaptiveK0Config:
    """OEA whose k0 is looked up from the batch size.

    Attributes:
        schedule: ``((max_batch, k0), ...)`` with increasing ``max_batch``; a batch of M rows uses
            the first entry with M <= max_batch, and the last entry beyond it.
        min_batch, group_fill, max_experts: as in ``OEAConfig`` (``max_experts`` applies to every entry).
    """

    schedule: tuple[tuple[int, int], ...]
    min_batch: int = 2
    group_fill: GroupFill = "in"
    max_experts: int | None = None

    def __post_init__(self) -> None:
        if not self.schedule:
            raise ValueError("schedule must hold at least one (max_batch, k0) entry, got ()")
        bounds = [b for b, _ in self.schedule]
        if bounds != sorted(set(bounds)) or bounds[0] < 1:
            raise ValueError(f"schedule max_batch values must be increasing and >= 1, got {bounds}")
        for _, k0 in self.schedule:
            self.config(k0)

    def config(self, k0: int) -> OEAConfig:
        """The ``OEAConfig`` used for an entry's ``k0``."""
        return OEAConfig(k0, max_experts=self.max_experts, min_batch=self.min_batch, group_fill=self.group_fill)

    def k0_for(self, batch_size: int) -> int:
        """The k0 used for a router call of ``batch_size`` rows."""
        for max_batch, k0 in self.schedule:
            if batch_size <= max_batch:
                return k0
        return self.schedule[-1][1]

    def check(self, spec: RouterSpec) -> None:
        """Every scheduled k0 must be in 1..top_k."""
        for _, k0 in self.schedule:
            self.config(k0).check(spec)


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
    return oea_policy(scores, vanilla_ids, spec, cfg.config(k0), valid)


@dataclass(frozen=True)
class LayerK0Schedule:
    """Per-layer k0 for one model, optionally per batch-size range (the ``OEA_LAYER_K0_FILE`` JSON).

    Attributes:
        num_experts, top_k, num_layers: the router it was calibrated for.
        k0: one k0 per MoE layer, in layer order. With ``batch_k0``, ``oea calibrate`` writes here the
            per-layer maximum over the calibrated ranges (the safest single value), which readers that
            ignore ``batch_k0`` use at every batch size.
        min_batch: as in ``OEAConfig``.
        model: a free-form model name; ``calibration``: how it was made (trace, proxy, tolerance).
        layer_ids: the engine's decoder-layer index of each MoE layer, where it differs from
            0..num_layers-1 (e.g. DeepSeek/GLM models whose first layers are dense).
        batch_k0: ``((max_batch, (k0 per layer, ...)), ...)`` with increasing ``max_batch``: a router
            call of M rows uses the first entry with M <= max_batch, the last entry beyond it (as
            ``AdaptiveK0Config``); ``None`` = the same k0 at every batch size.
    """

    num_experts: int
    top_k: int
    num_layers: int
    k0: tuple[int, ...]
    min_batch: int = 2
    model: str = ""
    calibration: dict = field(default_factory=dict)
    layer_ids: tuple[int, ...] | None = None
    batch_k0: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("num_experts", 1), ("top_k", 1), ("num_layers", 1), ("min_batch", 0)):
            _require_int(name, getattr(self, name), minimum)
        if self.min_batch > MAX_MIN_BATCH:  # OEAConfig's bound, so the file fails where it is read
            raise ValueError(f"min_batch must be an integer in 0..{MAX_MIN_BATCH}, got {self.min_batch}")
        if self.layer_ids is not None:
            _require_ints("layer_ids", self.layer_ids, 0)
            if len(self.layer_ids) != self.num_layers:
                raise ValueError(f"layer_ids must list one id per layer, got {len(self.layer_ids)} ids and "
                                 f"num_layers={self.num_layers}")
        self._check_k0("k0", self.k0)
        if self.batch_k0 is not None:
            if not self.batch_k0:
                raise ValueError("batch_k0 must hold at least one (max_batch, k0 per layer) entry, or be null")
            bounds = [entry[0] for entry in self.batch_k0]
            _require_ints("batch_k0 max_batch", bounds, 1)
            if bounds != sorted(set(bounds)):
                raise ValueError(f"batch_k0 max_batch values must be increasing, got {bounds}")
            for max_batch, k0 in self.batch_k0:
                self._check_k0(f"batch_k0 entry max_batch={max_batch}: k0", k0)

    def _check_k0(self, name: str, k0: tuple[int, ...]) -> None:
        _require_ints(name, k0, 1)
        if len(k0) != self.num_layers:
            raise ValueError(f"{name} must list one value per layer, got {len(k0)} values and "
                             f"num_layers={self.num_layers}")
        bad = [(i, k) for i, k in enumerate(k0) if not 1 <= k <= self.top_k]
        if bad:
            raise ValueError(f"{name} values must be in 1..top_k={self.top_k}, got (layer, k0) {bad}")

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

    def config_for_layer(
        self, layer: int, min_batch: int | None = None, max_experts: int | None = None, group_fill: GroupFill = "in"
    ) -> OEAConfig | AdaptiveK0Config:
        """The routing config of MoE layer ``layer`` (0-based, in model order).

        ``OEAConfig(k0[layer])`` without ``batch_k0``; with it, an ``AdaptiveK0Config`` whose k0 follows
        the router call's row count. ``min_batch`` (default: the file's), ``max_experts`` and
        ``group_fill`` come from the environment (``OEA_MIN_BATCH``, ``OEA_MAX_EXPERTS``, ``OEA_GROUP_FILL``).
        """
        min_batch = self.min_batch if min_batch is None else min_batch
        if self.batch_k0 is None:
            return OEAConfig(self.k0[layer], max_experts=max_experts, min_batch=min_batch, group_fill=group_fill)
        schedule: list[tuple[int, int]] = []
        for max_batch, k0 in self.batch_k0:  # neighbours with the same k0 for this layer collapse
            if schedule and schedule[-1][1] == k0[layer]:
                schedule[-1] = (max_batch, k0[layer])
            else:
                schedule.append((max_batch, k0[layer]))
        return AdaptiveK0Config(tuple(schedule), min_batch=min_batch, group_fill=group_fill, max_experts=max_experts)

    def describe(self) -> str:
        """One line: the model it was made for, its k0 per layer and its batch-size ranges."""
        k0 = sorted(set(self.k0))
        detail = (f"{self.num_layers} MoE layers, {self.num_experts} experts, top_k {self.top_k}, "
                  + (f"k0 {k0[0]}..{k0[-1]} per layer" if len(k0) > 1 else f"k0 {k0[0]} in every layer"))
        if self.batch_k0 is not None:
            bounds = ", ".join(str(b) for b, _ in self.batch_k0)
            detail += f", batch_k0: k0 by batch size in {len(self.batch_k0)} ranges (max_batch {bounds})"
        return detail + (f", model {self.model!r}" if self.model else "")

    def to_json(self) -> dict:
        """The JSON form (``format``/``version`` first; ``layer_ids`` and ``batch_k0`` only when set)."""
        data = {"format": LAYER_K0_FORMAT, "version": LAYER_K0_VERSION, **asdict(self)}
        data["k0"] = list(self.k0)
        for name in ("layer_ids", "batch_k0"):
            if data[name] is None:
                del data[name]
        if self.layer_ids is not None:
            data["layer_ids"] = list(self.layer_ids)
        if self.batch_k0 is not None:
            data["batch_k0"] = [{"max_batch": b, "k0": list(k0)} for b, k0 in self.batch_k0]
        return data

    @staticmethod
    def from_json(data: object, where: str = "per-layer k0 file") -> LayerK0Schedule:
        """Parse ``to_json``'s form; raises ``ValueError`` naming ``where`` and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object, got {type(data).__name__}")
        if data.get("format", LAYER_K0_FORMAT) != LAYER_K0_FORMAT:
            raise ValueError(f"{where}: field 'format' must be {LAYER_K0_FORMAT!r}, got {data['format']!r}")
        version = data.get("version", 1)
        if version not in LAYER_K0_VERSIONS or isinstance(version, bool):
            raise ValueError(f"{where}: field 'version' must be one of {list(LAYER_K0_VERSIONS)} (this oea reads "
                             f"those), got {version!r}")
        required = {"num_experts", "top_k", "num_layers", "k0"}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"per-layer k0 file {where} lacks fields {missing}")
        known = {f for f in LayerK0Schedule.__dataclass_fields__}
        # A field this oea does not know would be silently dropped (a typo such as 'min_bacth', or a newer
        # file's setting): refused, naming the fields a file may hold.
        unknown = sorted(set(data) - known - {"format", "version"})
        if unknown:
            allowed = ["format", "version", *LayerK0Schedule.__dataclass_fields__]
            raise ValueError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                             f" (allowed: {', '.join(allowed)})")
        values = {key: value for key, value in data.items() if key in known}
        try:
            for name in ("k0", "layer_ids"):
                if values.get(name) is not None:
                    values[name] = tuple(_list(values[name], name))
            if values.get("batch_k0") is not None:
                values["batch_k0"] = tuple(_batch_entry(entry) for entry in _list(values["batch_k0"], "batch_k0"))
            if not isinstance(values.get("calibration", {}), dict):
                raise ValueError(f"calibration must be an object, got {values['calibration']!r}")
            return LayerK0Schedule(**values)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


LAYER_K0_FORMAT = "oea-layer-k0"
LAYER_K0_VERSION = 2  # version 1 files (no format/version/batch_k0 fields) load unchanged
LAYER_K0_VERSIONS = (1, 2)  # the versions this oea reads (a file without 'version' is version 1)


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_ints(name: str, values: object, minimum: int) -> None:
    bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < minimum]  # type: ignore[attr-defined]
    if bad:
        raise ValueError(f"{name} must hold integers >= {minimum}, got {list(values)!r}")  # type: ignore[call-overload]


def _list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return value


def _batch_entry(entry: object) -> tuple[int, tuple[int, ...]]:
    if not isinstance(entry, dict) or set(entry) != {"max_batch", "k0"}:
        raise ValueError(f"batch_k0 entries must be objects with keys max_batch and k0 (one per layer), "
                         f"got {entry!r}")
    return entry["max_batch"], tuple(_list(entry["k0"], "batch_k0 k0"))
