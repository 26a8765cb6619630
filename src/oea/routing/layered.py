"""The routing config of every MoE layer of one model, for every router call: one rule for all engines.

Shape legend: M = rows of one router call (padding rows included: the call's static shape), L = MoE
layers of the model, in model order.

``LayerConfigs`` answers "which config routes MoE layer ``index`` in a call of M rows":

* without a per-layer file: the ``OEA_K0`` config (``default``) in every layer and at every M;
* with one (``LayerK0Schedule``, ``OEA_LAYER_K0_FILE``): the layer's k0 — looked up from M in the
  file's ``batch_k0`` ranges when it has them, else its ``k0`` — with ``min_batch`` from the
  environment when it is set (``OEA_MIN_BATCH``), else the file's, and ``max_experts`` /
  ``group_fill`` from ``default`` (``OEA_MAX_EXPERTS``, ``OEA_GROUP_FILL``);
* OEA off (``default`` is None): None everywhere; the file alone does not turn OEA on.

An adapter's own config for a layer (EP-aware OEA on the engine's placement: ``base``) takes the layer's
k0 and ``min_batch`` the same way, composed here once for every engine (``LayerConfigs.config(index, rows,
base)``, ``with_layer_k0``): each adapter builds the layer's base (``OEA_K0``'s config, or its ``EPOEAConfig``
on the placement) and asks for the call's config; none replaces fields itself. EP-aware OEA has no
``max_experts``: an adapter under ``OEA_POLICY=ep`` warns once with ``EP_IGNORES_MAX_EXPERTS``.
The file's entry for a layer is found by the engine's decoder-layer id when the file lists ``layer_ids``, else
by the layer's position among the model's MoE layers (an engine that only knows the decoder-layer id passes it
as the position: the two agree on models whose every layer is MoE).

``check_model`` says whether the settings fit a model, in the words every adapter reports
(``k0_error`` and the messages below): an adapter that sees the model before serving stops there; one
that meets layers one at a time keeps the engine's own routing in a layer that does not fit and warns with
the same message. Configs are built once per (layer, k0) and reused, so the hot path does a dict lookup.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from oea.routing.schedules import AdaptiveK0Config, LayerK0Schedule
from oea.routing.spec import GroupFill, OEAConfig, RouterSpec

LAYER_FILE_VARIABLE = "OEA_LAYER_K0_FILE"
EP_IGNORES_MAX_EXPERTS = "OEA_MAX_EXPERTS is not used by EP-aware OEA (OEA_POLICY=ep)"  # every adapter's words


def k0_error(variable: str, k0: int, top_k: int) -> str:
    """The message for a k0 the model cannot take (every adapter reports these words)."""
    return f"{variable} must be in 1..{top_k} (the model's top_k), got {k0}"


def unsupported_layer_message(layer: object, reason: str) -> str:
    """The warning for a layer whose router OEA cannot rebuild (every adapter reports these words)."""
    return f"layer {layer} keeps the engine's own routing: {reason}"


class LayerConfigs:
    """The per-layer, per-batch-size routing configs of one model (see the module docstring).

    Args:
        default: ``OEA_K0``'s config (None: OEA off).
        schedule: the per-layer k0 file's contents, or None.
        min_batch: ``OEA_MIN_BATCH`` when it is set (None: the file's ``min_batch``).
        max_experts, group_fill: ``OEA_MAX_EXPERTS``, ``OEA_GROUP_FILL`` (default: ``default``'s).
        where: how messages name the file (``OEA_LAYER_K0_FILE='k0.json'``).
        k0_variable: how messages name ``default.k0`` (``OEA_K0`` or its alias).
    """

    def __init__(self, default: OEAConfig | None, schedule: LayerK0Schedule | None = None, *,
                 min_batch: int | None = None, max_experts: int | None = None, group_fill: GroupFill | None = None,
                 where: str = LAYER_FILE_VARIABLE, k0_variable: str = "OEA_K0") -> None:
        self.default = default
        self.schedule = schedule
        self.min_batch = min_batch
        self.max_experts = max_experts if max_experts is not None or default is None else default.max_experts
        self.group_fill: GroupFill = group_fill or (default.group_fill if default is not None else "in")
        self.where = where
        self.k0_variable = k0_variable
        self._layers: dict[int, OEAConfig | AdaptiveK0Config] = {}
        self._built: dict[tuple[int, int, int], tuple[Any, Any]] = {}  # (index, k0, id(base)) -> (base, config)

    # -- start-up: does it fit the model ------------------------------------------------------
    def check_model(self, num_experts: int, top_k: int, num_layers: int | None = None) -> None:
        """Raise ``ValueError`` (the words of every adapter) when the settings do not fit a model.

        ``num_layers``: the model's MoE layers (None: unknown, e.g. an engine that meets layers one at a
        time; then only the router's size is compared with the file).
        """
        cfg = self.default
        if cfg is not None and cfg.k0 > top_k:
            raise ValueError(k0_error(self.k0_variable, cfg.k0, top_k))
        if cfg is not None and cfg.max_experts is not None and cfg.max_experts > top_k:
            raise ValueError(f"OEA_MAX_EXPERTS must be in {cfg.k0}..{top_k} (the model's top_k), got {cfg.max_experts}")
        schedule = self.schedule
        if schedule is None:
            return
        try:
            schedule.check_model(num_experts, top_k, schedule.num_layers if num_layers is None else num_layers)
        except ValueError as err:
            raise ValueError(f"{self.where}: {err}") from None
        for index in range(schedule.num_layers):
            self.layer(index)

    def check_router(self, spec: RouterSpec) -> None:
        """``check_model`` for one router met on its own (the model's number of MoE layers unknown)."""
        self.check_model(spec.num_experts, spec.top_k)

    # -- which entry of the file ---------------------------------------------------------------
    def index(self, layer_id: int | None = None, position: int | None = None) -> int | None:
        """The file's entry for a MoE layer (None without a file); raises ``ValueError`` naming the file and
        the layer when the file has no entry for it.

        ``layer_id``: the engine's decoder-layer number; ``position``: the layer's place among the model's
        MoE layers (0-based). One of them is enough (see the module docstring).
        """
        schedule = self.schedule
        if schedule is None:
            return None
        if schedule.layer_ids is not None and layer_id is not None:
            found = schedule.index_of_layer_id(int(layer_id))
            listed = f"its layer_ids are {list(schedule.layer_ids)}"
        else:
            at = position if position is not None else layer_id
            found = at if at is not None and 0 <= int(at) < schedule.num_layers else None
            listed = f"it has {schedule.num_layers} layers"
        if found is None:
            name = layer_id if layer_id is not None else position
            raise ValueError(f"{self.where}: MoE layer {name} is not in the file ({listed})")
        return int(found)

    def layer(self, index: int) -> OEAConfig | AdaptiveK0Config:
        """The file's config of entry ``index``: ``OEAConfig``, or ``AdaptiveK0Config`` with ``batch_k0``."""
        cached = self._layers.get(index)
        if cached is None:
            assert self.schedule is not None
            try:
                cached = self.schedule.config_for_layer(index, min_batch=self.min_batch, max_experts=self.max_experts,
                                                        group_fill=self.group_fill)
            except ValueError as err:
                where = f"{self.where} with OEA_MAX_EXPERTS={self.max_experts}"
                raise ValueError(f"{where}: layer {index}: {err}") from None
            self._layers[index] = cached
        return cached

    # -- every router call ----------------------------------------------------------------------
    def config(self, index: int | None, rows: int, base: Any = None) -> Any:
        """The config of one router call of ``rows`` rows in the layer with file entry ``index``.

        ``base``: the adapter's config for the layer (default: ``default``); it takes the layer's k0 and
        ``min_batch``. Without a file, or for ``index`` None, ``base`` itself; None when OEA is off.
        """
        base = self.default if base is None else base
        if self.default is None or base is None or self.schedule is None or index is None:
            return base
        policy = self.layer(index)
        k0 = policy.k0_for(rows) if isinstance(policy, AdaptiveK0Config) else policy.k0
        key = (index, k0, id(base))
        cached = self._built.get(key)
        if cached is None or cached[0] is not base:
            own = policy.config(k0) if isinstance(policy, AdaptiveK0Config) else policy
            cached = self._built[key] = (base, own if base is self.default else with_layer_k0(base, own))
        return cached[1]

    def layers(self) -> list[OEAConfig | AdaptiveK0Config]:
        """Every entry's config, in file order (empty without a file)."""
        return [] if self.schedule is None else [self.layer(index) for index in range(self.schedule.num_layers)]

    def describe(self) -> str:
        """One line: each layer's k0, or its k0 per batch-size range (for start-up logs)."""
        if self.schedule is None:
            return "no per-layer k0"
        parts = []
        for index in range(self.schedule.num_layers):
            policy = self.layer(index)
            if isinstance(policy, AdaptiveK0Config):
                parts.append("/".join(f"{k0}(<={b})" for b, k0 in policy.schedule))
            else:
                parts.append(str(policy.k0))
        return "k0 per layer " + " ".join(parts)


def with_layer_k0(base: Any, layer: OEAConfig) -> Any:
    """``base`` (a policy with a k0, e.g. ``EPOEAConfig``) with the layer's k0, ``min_batch`` and ``group_fill``;
    a ``boost_rank`` below the new k0 is raised to it."""
    changes: dict[str, Any] = {"k0": layer.k0, "min_batch": layer.min_batch}
    fields = {f.name for f in dataclasses.fields(base)}
    if "group_fill" in fields:
        changes["group_fill"] = layer.group_fill
    if getattr(base, "boost_rank", None) is not None:
        changes["boost_rank"] = max(base.boost_rank, layer.k0)
    return dataclasses.replace(base, **changes)
