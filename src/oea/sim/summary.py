"""Result rows of ``oea.sim.simulate``: means over batches with 95% intervals, and how many batches to draw.

The independent unit of a simulation is the batch: each is a fresh draw of B trace tokens. A row's
mean of a per-batch quantity (active experts T averaged over the layers, experts per token, kept
top-k share, kept mass, predicted latency, ...) is the mean over its ``nb`` batches, with the Student-t
interval over those ``nb`` values (``oea.stats.mean_interval``; ``*_ci`` fields). Ratios to vanilla are
ratios of means with a bootstrap interval paired by batch (every policy routes the same batches).

By default the simulator draws batches until T's interval is within ``DEFAULT_PRECISION`` (±1%) of
the mean for every row of a batch size (``batches_for_precision``), up to a cap; a row that misses
the target says so (``t_ci_relative_half_width``, ``t_ci_target_met``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from oea.stats import mean_interval, ratio_of_means_interval

DEFAULT_PRECISION = 0.01  # T's 95% interval within ±1% of its mean
PILOT_BATCHES = 32  # first draw per batch size when the count is chosen automatically
MAX_BATCHES = 1024  # cap of the automatic choice
_CORE_KEYS = ("active_experts", "experts_per_token", "kept_topk_share", "kept_mass", "token_slots")
_MEANS = {"experts_per_token": "mean_experts_per_token", "kept_topk_share": "kept_topk_share",
          "kept_mass": "kept_mass"}

Samples = list[dict[str, torch.Tensor]]  # one dict per layer: metric -> [nb] per-batch values


def per_batch(samples: Samples, key: str) -> np.ndarray:
    """[nb] per-batch values of ``key`` averaged over the layers."""
    return torch.stack([values[key] for values in samples]).double().mean(0).numpy()


def relative_half_width(values: np.ndarray) -> float:
    """Half-width of the 95% t interval of the mean, relative to the mean (0 for a zero mean)."""
    interval = mean_interval(values)
    return interval.half_width / abs(interval.estimate) if interval.estimate else 0.0


def batches_for_precision(samples: Mapping[Any, Samples], precision: float, cap: int) -> int:
    """Batches needed so that T's interval is within ``precision`` of its mean for every setting.

    The half-width shrinks as 1/sqrt(nb): with ``nb`` batches and relative half-width h, about
    ``nb * (h / precision)²`` are needed (10% extra for the estimate's own noise), at most ``cap``.
    """
    needed = 0
    for setting_samples in samples.values():
        values = per_batch(setting_samples, "active_experts")
        have = values.size
        needed = max(needed, have)
        h = relative_half_width(values)
        if h > precision:
            needed = max(needed, math.ceil(1.1 * have * (h / precision) ** 2))
    return min(needed, cap)


def extend(samples: Samples, more: Samples) -> Samples:
    """Per layer, ``samples`` followed by ``more`` (same metrics, batches appended)."""
    return [{key: torch.cat([a[key], b[key]]) for key in a} for a, b in zip(samples, more, strict=True)]


def _mean_fields(name: str, values: np.ndarray) -> dict[str, Any]:
    interval = mean_interval(values)
    return {name: interval.estimate, f"{name}_ci": interval.as_list()}


def summarise(
    base: dict[str, Any], samples: Samples, layers: Sequence[int], cost: Any, batch_size: int,
    precision: float | None,
) -> dict[str, Any]:
    """One row from one setting's samples: ``base`` (trace, mode, policy, ...) plus the figures."""
    stacked = {key: torch.stack([values[key] for values in samples]) for key in samples[0]}  # [L, nb]
    active = stacked["active_experts"]
    t_per_batch = active.double().mean(0).numpy()
    row: dict[str, Any] = {
        **base,
        "num_batches": int(active.shape[1]),
        "num_layers": len(layers),
        **_mean_fields("mean_active_experts", t_per_batch),
        "t_ci_relative_half_width": relative_half_width(t_per_batch),
        "p50_active_experts": float(active.flatten().double().quantile(0.5)),
        "p95_active_experts": float(active.flatten().double().quantile(0.95)),
    }
    for key, name in _MEANS.items():
        if key in stacked:
            row.update(_mean_fields(name, stacked[key].double().mean(0).numpy()))
        else:
            row.update({name: None, f"{name}_ci": None})
    row["per_layer_active_experts"] = [round(float(x), 3) for x in active.double().mean(-1)]
    for key, value in stacked.items():
        if key not in _CORE_KEYS:
            row.update(_mean_fields(key, value.double().mean(0).numpy()))
    row["predicted_latency_us"] = row["predicted_latency_us_ci"] = None
    latency = None
    if cost is not None:
        device = stacked.get("max_device_active_experts", active)
        latency = np.array([[cost.layer_latency_us(float(t), float(s), batch_size, float(d))
                             for t, s, d in zip(t_row, s_row, d_row, strict=True)]
                            for t_row, s_row, d_row in zip(active, stacked["token_slots"], device, strict=True)])
        row.update(_mean_fields("predicted_latency_us", latency.mean(0)))
        row["latency_model"] = f"{cost.model.name} on {cost.gpu.name} tp={cost.tp} ep={cost.ep}"
    if precision is not None:
        row["t_ci_target"] = precision
        row["t_ci_target_met"] = bool(row["t_ci_relative_half_width"] <= precision)
    row["_per_batch"] = {"active": t_per_batch, "latency": None if latency is None else latency.mean(0)}
    return row


def add_ratios(rows: list[dict[str, Any]], seed: int = 0) -> None:
    """``active_ratio_vs_vanilla`` (and ``latency_ratio_vs_vanilla``) with intervals paired by batch,
    against the vanilla row of the same batch size; drops the rows' private per-batch samples."""
    vanilla = {r["batch_size"]: r for r in rows if r["policy"] == "vanilla"}
    rng = np.random.default_rng(seed)
    for row in rows:
        base = vanilla.get(row["batch_size"])
        row["active_ratio_vs_vanilla"] = row["active_ratio_vs_vanilla_ci"] = None
        if base is not None and base["mean_active_experts"]:
            row["active_ratio_vs_vanilla"], row["active_ratio_vs_vanilla_ci"] = _ratio(
                row["_per_batch"]["active"], base["_per_batch"]["active"], rng)
        if base is not None and row["predicted_latency_us"] is not None and base["predicted_latency_us"]:
            row["latency_ratio_vs_vanilla"], row["latency_ratio_vs_vanilla_ci"] = _ratio(
                row["_per_batch"]["latency"], base["_per_batch"]["latency"], rng)
    for row in rows:
        del row["_per_batch"]


def _ratio(values: np.ndarray, reference: np.ndarray, rng: np.random.Generator) -> tuple[float, list[float]]:
    interval = ratio_of_means_interval(values, reference, rng, paired=values.size == reference.size)
    return interval.estimate, interval.as_list()
