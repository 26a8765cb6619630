"""Calibrate batch-size-adaptive and per-layer k0 from a routing trace (or from ``oea eval`` rows).

The quality proxy on a trace is the router mass OEA keeps relative to vanilla top-k (``kept_mass``,
1.0 = no change) where the trace records logits or scores, and the share of the original top-k kept
(``kept_topk_share``) for id-only traces. A tolerance is the largest acceptable mean loss
``1 - proxy``. With ``oea eval`` rows, the proxy is ΔCE against vanilla at the same batch size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

import oea
from oea.routing import AdaptiveK0Config, LayerK0Schedule, OEAConfig
from oea.sim.simulate import LayerBatches, core_metrics, make_batches, route_batches, router_inputs
from oea.traces import Trace

K = TypeVar("K")


@dataclass(frozen=True)
class ProxyPoint:
    """Mean quality loss and active experts of OEA(k0) at one batch size (and layer, or all)."""

    batch_size: int
    k0: int
    layer: int | None
    loss: float
    active_experts: float


def proxy_name(trace: Trace) -> str:
    """``kept_mass`` where the trace has logits or scores, else ``kept_topk_share``."""
    return "kept_mass" if trace.logits is not None or trace.scores is not None else "kept_topk_share"


def measure_proxy(
    trace: Trace,
    batch_sizes: Sequence[int],
    k0s: Sequence[int],
    layers: Sequence[int] | None = None,
    num_batches: int = 32,
    seed: int = 0,
) -> list[ProxyPoint]:
    """Quality loss (1 - proxy) and T of OEA(k0), per layer, for each batch size (``mixed`` batches)."""
    metric = proxy_name(trace)
    layers = list(range(trace.num_layers)) if layers is None else list(layers)
    points = []
    for batch_size in batch_sizes:
        batches = make_batches(trace, batch_size, "mixed", num_batches, torch.Generator().manual_seed(seed))
        for layer in layers:
            logits, spec, mass = router_inputs(trace, layer)
            max_rank = None if trace.logits is not None else spec.top_k
            vanilla_ids = oea.route(logits, spec)[0][batches]
            for k0 in k0s:
                cfg = OEAConfig(k0, max_rank=max_rank, min_batch=1)
                ids, weights = route_batches(logits, spec, cfg, batches)
                sample = LayerBatches(layer, ids, weights, vanilla_ids,
                                      None if mass is None else mass[batches], spec.num_experts)
                values = core_metrics(sample)
                points.append(ProxyPoint(batch_size, k0, layer, 1.0 - float(values[metric].mean()),
                                         float(values["active_experts"].mean())))
    return points


def _smallest_k0(points: Iterable[ProxyPoint], tolerance: float, top_k: int) -> int:
    ok = sorted(p.k0 for p in points if p.loss <= tolerance)
    return ok[0] if ok else top_k


def average_over_layers(points: Sequence[ProxyPoint]) -> list[ProxyPoint]:
    """Mean loss and T over layers for each (batch size, k0)."""
    keys = sorted({(p.batch_size, p.k0) for p in points})
    out = []
    for b, k0 in keys:
        group = [p for p in points if p.batch_size == b and p.k0 == k0]
        out.append(ProxyPoint(b, k0, None, sum(p.loss for p in group) / len(group),
                              sum(p.active_experts for p in group) / len(group)))
    return out


def adaptive_schedule(points: Sequence[ProxyPoint], tolerance: float, top_k: int) -> AdaptiveK0Config:
    """For each measured batch size, the smallest k0 whose layer-mean loss <= tolerance.

    A measured size covers the batches up to the next measured size (larger batches lose less, so
    this errs on the safe side); batches below the smallest measured size were not calibrated and
    get k0 = top_k (vanilla routing).
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    mean = average_over_layers(points)
    sizes = sorted({p.batch_size for p in mean})
    if not sizes:
        raise ValueError("no calibration points: measure at least one batch size")
    chosen = {b: _smallest_k0((p for p in mean if p.batch_size == b), tolerance, top_k) for b in sizes}
    return AdaptiveK0Config(tuple(range_entries(chosen, top_k)))


def range_entries(chosen: dict[int, K], vanilla: K) -> list[tuple[int, K]]:
    """``{calibrated batch size: k0}`` -> ``[(max_batch, k0), ...]`` as in ``AdaptiveK0Config``.

    A calibrated size covers the batches up to the next calibrated size - 1, the largest size every
    batch beyond; batches below the smallest size get ``vanilla``. Neighbours with equal k0 collapse.
    ``k0`` may be an int or a per-layer tuple.
    """
    sizes = sorted(chosen)
    entries = [(sizes[0] - 1, vanilla)] if sizes[0] > 1 else []
    entries += [(sizes[i + 1] - 1 if i + 1 < len(sizes) else b, chosen[b]) for i, b in enumerate(sizes)]
    merged: list[tuple[int, K]] = []
    for upper, k0 in entries:
        if merged and merged[-1][1] == k0:
            merged[-1] = (upper, k0)
        else:
            merged.append((upper, k0))
    return merged


def adaptive_schedule_from_eval(
    rows: Sequence[dict], tolerance_ce: float, top_k: int, min_batch: int = 2
) -> AdaptiveK0Config:
    """The same from ``oea eval`` rows: smallest OEA k0 with ΔCE <= ``tolerance_ce`` at each batch size.

    Batch sizes below ``min_batch`` are skipped: OEA leaves them vanilla, so they say nothing about k0.
    """
    points = []
    vanilla = {r["batch_size"]: r["cross_entropy"] for r in rows if r["policy"] == "vanilla"}
    for r in rows:
        if r["policy"] == "oea" and r["batch_size"] in vanilla and r["batch_size"] >= min_batch:
            points.append(ProxyPoint(r["batch_size"], r["k0"], None, r["cross_entropy"] - vanilla[r["batch_size"]],
                                     r["mean_active_experts"]))
    if not points:
        raise ValueError("eval rows hold no 'oea' rows with a matching 'vanilla' row at the same batch_size "
                         f">= min_batch={min_batch}")
    return adaptive_schedule(points, tolerance_ce, top_k)


def layer_schedule(
    trace: Trace, points: Sequence[ProxyPoint], tolerance: float, batch_size: int, model: str = ""
) -> LayerK0Schedule:
    """Per layer, the smallest k0 whose loss at ``batch_size`` <= tolerance."""
    k0 = tuple(
        _smallest_k0((p for p in points if p.layer == layer and p.batch_size == batch_size), tolerance,
                     trace.spec.top_k)
        for layer in range(trace.num_layers)
    )
    return LayerK0Schedule(
        num_experts=trace.spec.num_experts,
        top_k=trace.spec.top_k,
        num_layers=trace.num_layers,
        k0=k0,
        model=model or trace.name,
        calibration={"trace": trace.name, "proxy": proxy_name(trace), "tolerance": tolerance,
                     "batch_size": batch_size},
    )
