"""k0 per batch-size range (and per layer) from a recorded or imported trace, with predicted T and latency.

Shape legend: L = MoE layers, nb = simulated batches per batch size, B = batch size.

For each calibrated batch size B the trace is cut into ``nb`` batches (``mixed`` or ``lockstep``, as
``oea simulate``), every layer is routed vanilla and with OEA at each candidate k0, and per batch the
quality proxy (``oea.tuning.calibrate.proxy_name``), T and the token slots are kept. The recommended k0
at B is the smallest whose mean proxy loss is within the tolerance, over all layers (``per_layer=False``)
or for each layer. B's k0 applies to router calls of B .. (next calibrated size - 1) rows, the largest
size's k0 beyond it; batches below the smallest calibrated size (or below ``min_batch``, which OEA
leaves vanilla) keep vanilla routing. The result is a ``LayerK0Schedule`` with ``batch_k0`` (the
``OEA_LAYER_K0_FILE`` the plugins read) and one summary row per calibrated size, each mean with its
95% t interval over the ``nb`` batches (``oea.stats``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oea.routing import LayerK0Schedule, OEAConfig
from oea.sim.simulate import LayerBatches, core_metrics, make_batches, route_batches, router_inputs
from oea.stats import mean_interval
from oea.traces import Trace
from oea.tuning.calibrate import proxy_name, range_entries


@dataclass(frozen=True)
class BatchSamples:
    """Per-batch measurements at one batch size, ``[L, nb]`` float64 arrays.

    Attributes:
        batch_size: B.
        vanilla_active / vanilla_slots: T and token slots of the model's own routing.
        loss / active / slots: ``{k0: [L, nb]}`` for OEA(k0): 1 - proxy, T, token slots.
    """

    batch_size: int
    vanilla_active: np.ndarray
    vanilla_slots: np.ndarray
    loss: dict[int, np.ndarray]
    active: dict[int, np.ndarray]
    slots: dict[int, np.ndarray]


def measure_samples(
    trace: Trace, batch_sizes: Sequence[int], k0s: Sequence[int], num_batches: int = 32, seed: int = 0,
    mode: str = "mixed",
) -> list[BatchSamples]:
    """Vanilla and OEA(k0) per layer and batch at each batch size (the same batches for every k0)."""
    metric = proxy_name(trace)
    inputs = [router_inputs(trace, layer) for layer in range(trace.num_layers)]
    max_rank = None if trace.logits is not None else trace.spec.top_k
    out = []
    for batch_size in batch_sizes:
        batches = make_batches(trace, batch_size, mode, num_batches, torch.Generator().manual_seed(seed))
        vanilla_active, vanilla_slots = [], []
        loss: dict[int, list] = {k0: [] for k0 in k0s}
        active: dict[int, list] = {k0: [] for k0 in k0s}
        slots: dict[int, list] = {k0: [] for k0 in k0s}
        for layer, (logits, spec, mass) in enumerate(inputs):
            vanilla_ids, vanilla_weights = route_batches(logits, spec, None, batches)
            layer_mass = None if mass is None else mass[batches]
            base = core_metrics(LayerBatches(layer, vanilla_ids, vanilla_weights, vanilla_ids, layer_mass,
                                             spec.num_experts))
            vanilla_active.append(base["active_experts"])
            vanilla_slots.append(base["token_slots"])
            for k0 in k0s:
                ids, weights = route_batches(logits, spec, OEAConfig(k0, max_rank=max_rank, min_batch=1), batches)
                values = core_metrics(LayerBatches(layer, ids, weights, vanilla_ids, layer_mass, spec.num_experts))
                loss[k0].append(1.0 - values[metric])
                active[k0].append(values["active_experts"])
                slots[k0].append(values["token_slots"])

        def stack(rows: list) -> np.ndarray:
            return torch.stack(rows).double().numpy()

        out.append(BatchSamples(batch_size, stack(vanilla_active), stack(vanilla_slots),
                                {k: stack(v) for k, v in loss.items()}, {k: stack(v) for k, v in active.items()},
                                {k: stack(v) for k, v in slots.items()}))
    return out


def _choose(samples: BatchSamples, tolerance: float, top_k: int, per_layer: bool) -> tuple[int, ...]:
    """Per layer, the smallest measured k0 whose mean loss (per layer, or over layers) is <= tolerance."""
    layers = next(iter(samples.loss.values())).shape[0]
    candidates = sorted(samples.loss)
    if not per_layer:
        within = [k0 for k0 in candidates if samples.loss[k0].mean() <= tolerance]
        return (within[0] if within else top_k,) * layers
    chosen = []
    for layer in range(layers):
        within = [k0 for k0 in candidates if samples.loss[k0][layer].mean() <= tolerance]
        chosen.append(within[0] if within else top_k)
    return tuple(chosen)


def recommend(
    trace: Trace, samples: Sequence[BatchSamples], tolerance: float, per_layer: bool, min_batch: int = 2,
) -> tuple[LayerK0Schedule, dict[int, tuple[int, ...]]]:
    """The schedule file and the chosen per-layer k0 at each calibrated batch size.

    ``samples`` must be measured at batch sizes >= ``min_batch`` (smaller ones are vanilla in OEA).
    """
    if not samples:
        raise ValueError("no calibration batch sizes: give at least one batch size >= min_batch")
    top_k, layers = trace.spec.top_k, trace.num_layers
    chosen = {s.batch_size: _choose(s, tolerance, top_k, per_layer)
              for s in sorted(samples, key=lambda s: s.batch_size)}
    sizes = sorted(chosen)
    merged = range_entries(chosen, (top_k,) * layers)
    # for readers that ignore batch_k0: the largest k0 among the calibrated ranges (not the vanilla one below)
    calibrated = [k0 for upper, k0 in merged if upper >= sizes[0]]
    safest = tuple(max(k0[layer] for k0 in calibrated) for layer in range(layers))
    layer_ids = trace.meta.get("layer_indices")
    valid_ids = isinstance(layer_ids, list) and len(layer_ids) == layers and all(isinstance(i, int) for i in layer_ids)
    schedule = LayerK0Schedule(
        num_experts=trace.spec.num_experts, top_k=top_k, num_layers=layers, k0=safest, min_batch=min_batch,
        model=str(trace.meta.get("model") or trace.name),
        calibration={"trace": trace.name, "proxy": proxy_name(trace), "tolerance": tolerance,
                     "batch_sizes": sizes, "per_layer": per_layer},
        layer_ids=tuple(layer_ids) if valid_ids else None,
        batch_k0=tuple(merged) if len(merged) > 1 else None,
    )
    return schedule, chosen


def _interval(values: np.ndarray) -> dict[str, Any]:
    interval = mean_interval(values.tolist())
    return {"mean": interval.estimate, "ci": interval.as_list()}


def _latency(cost: Any, active: np.ndarray, slots: np.ndarray, batch_size: int) -> np.ndarray:
    """[L, nb] T and slots -> [nb] predicted latency per MoE layer (mean over layers), µs."""
    per_layer = [[cost.layer_latency_us(float(t), float(s), batch_size) for t, s in zip(ts, ss, strict=True)]
                 for ts, ss in zip(active, slots, strict=True)]
    return np.asarray(per_layer).mean(0)


def range_rows(
    samples: Sequence[BatchSamples], chosen: dict[int, tuple[int, ...]], cost: Any | None = None,
    per_layer: bool = False,
) -> list[dict[str, Any]]:
    """One row per calibrated batch size: its range, k0 (a list per layer when ``per_layer``), proxy loss,
    T and (with ``cost``, a ``CostModel``) the predicted MoE-layer latency and gain, each as
    ``{"mean", "ci"}`` over batches."""
    ordered = sorted(samples, key=lambda s: s.batch_size)
    rows = []
    for i, sample in enumerate(ordered):
        k0 = chosen[sample.batch_size]
        layers = np.arange(len(k0))
        pick = [sample.loss[k][layer] for layer, k in zip(layers, k0, strict=True)]
        loss = np.stack(pick)  # [L, nb]
        active = np.stack([sample.active[k][layer] for layer, k in zip(layers, k0, strict=True)])
        slots = np.stack([sample.slots[k][layer] for layer, k in zip(layers, k0, strict=True)])
        upper = ordered[i + 1].batch_size - 1 if i + 1 < len(ordered) else None
        row: dict[str, Any] = {
            "batch_sizes": [sample.batch_size, upper], "calibrated_at": sample.batch_size,
            "k0": list(k0) if per_layer else k0[0],
            "proxy_loss": _interval(loss.mean(0)),
            "vanilla_active_experts": _interval(sample.vanilla_active.mean(0)),
            "oea_active_experts": _interval(active.mean(0)),
            "active_ratio": _interval(active.mean(0) / sample.vanilla_active.mean(0)),
            "predicted_latency_vanilla_us": None, "predicted_latency_oea_us": None, "latency_gain": None,
        }
        if cost is not None:
            vanilla = _latency(cost, sample.vanilla_active, sample.vanilla_slots, sample.batch_size)
            rerouted = _latency(cost, active, slots, sample.batch_size)
            row["predicted_latency_vanilla_us"] = _interval(vanilla)
            row["predicted_latency_oea_us"] = _interval(rerouted)
            row["latency_gain"] = _interval(1.0 - rerouted / vanilla)
        rows.append(row)
    return rows
