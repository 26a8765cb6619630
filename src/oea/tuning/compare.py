"""Every policy side by side on one trace: quality proxy against T and against the busiest EP device.

Budget (XShare-like) and subtractive (Lynx-like) comparators are given OEA's measured mean T at each
k0 as their target, so the comparison is at matched mean T. The quality proxy is ``1 - kept_mass``
(``1 - kept_topk_share`` for id-only traces); ``oea eval`` gives the ΔCE version on a real model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

import oea
from oea.routing import AdaptiveK0Config, BudgetConfig, EPOEAConfig, ExpertPlacement, SubtractiveConfig
from oea.sim.simulate import LayerBatches, batch_expert_load, core_metrics, make_batches, route_batches, router_inputs
from oea.traces import Trace
from oea.tuning.calibrate import proxy_name


@dataclass(frozen=True)
class ComparisonRow:
    """One policy setting at one batch size, averaged over layers and batches."""

    policy: str
    setting: str
    batch_size: int
    mean_active_experts: float
    max_device_active_experts: float
    quality_loss: float
    mean_experts_per_token: float

    def as_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)


@dataclass(frozen=True)
class _LayerInputs:
    """One layer's router inputs and vanilla routing over the compared batches (computed once)."""

    layer: int
    logits: torch.Tensor  # [T, N]
    spec: oea.RouterSpec
    vanilla_ids: torch.Tensor  # [nb, B, k]
    mass: torch.Tensor | None  # [nb, B, N]


def _layer_inputs(trace: Trace, layers: Sequence[int], batches: torch.Tensor) -> list[_LayerInputs]:
    inputs = []
    for layer in layers:
        logits, spec, mass = router_inputs(trace, layer)
        inputs.append(_LayerInputs(layer, logits, spec, oea.route(logits, spec)[0][batches],
                                   None if mass is None else mass[batches]))
    return inputs


def _evaluate(cfg: object | None, batches: torch.Tensor, inputs: Sequence[_LayerInputs], metric: str,
              placement: ExpertPlacement) -> tuple[float, float, float, float]:
    t, dev, loss, per_token = [], [], [], []
    for x in inputs:
        ids, weights = route_batches(x.logits, x.spec, cfg, batches)
        values = core_metrics(LayerBatches(x.layer, ids, weights, x.vanilla_ids, x.mass, x.spec.num_experts))
        load = batch_expert_load(ids, weights, x.spec.num_experts)
        dev.append(float(placement.device_counts(load > 0).max(-1).values.double().mean()))
        t.append(float(values["active_experts"].mean()))
        loss.append(1.0 - float(values[metric].mean()))
        per_token.append(float(values["experts_per_token"].mean()))
    n = len(inputs)
    return sum(t) / n, sum(dev) / n, sum(loss) / n, sum(per_token) / n


def compare_policies(
    trace: Trace,
    batch_size: int = 16,
    k0s: Sequence[int] = (1, 2, 3, 4, 5, 6, 7),
    ep: int = 8,
    num_batches: int = 16,
    layers: Sequence[int] | None = None,
    adaptive: AdaptiveK0Config | None = None,
    seed: int = 0,
) -> list[ComparisonRow]:
    """Vanilla, pruned, OEA, EP-aware OEA (per k0), budget and subtractive (at OEA's T), adaptive."""
    spec = trace.spec
    placement = ExpertPlacement.contiguous(spec.num_experts, ep)
    layers = list(range(trace.num_layers)) if layers is None else list(layers)
    batches = make_batches(trace, batch_size, "mixed", num_batches, torch.Generator().manual_seed(seed))
    max_rank = None if trace.logits is not None else spec.top_k  # id-only traces: piggyback within top-k
    inputs = _layer_inputs(trace, layers, batches)
    metric = proxy_name(trace)
    rows: list[ComparisonRow] = []

    def add(policy: str, setting: str, cfg: object | None) -> ComparisonRow:
        t, dev, loss, per_token = _evaluate(cfg, batches, inputs, metric, placement)
        row = ComparisonRow(policy, setting, batch_size, t, dev, max(loss, 0.0), per_token)
        rows.append(row)
        return row

    add("vanilla", "-", None)
    for k0 in k0s:
        add("pruned", f"k0={k0}", oea.PrunedConfig(k0))
        matched = add("oea", f"k0={k0}", oea.OEAConfig(k0, max_rank=max_rank, min_batch=1))
        add("ep-oea", f"k0={k0}", EPOEAConfig(k0, placement, min_batch=1))
        target = max(1, round(matched.mean_active_experts))
        add("budget", f"T={target}", BudgetConfig(target, min_batch=1))
        add("subtractive", f"T={target}", SubtractiveConfig(target, min_batch=1))
    if adaptive is not None:
        add("adaptive", f"k0={adaptive.k0_for(batch_size)}", adaptive)
    return rows


def pareto_front(rows: Sequence[ComparisonRow], x: str = "mean_active_experts") -> list[ComparisonRow]:
    """Rows not dominated in (``x``, quality_loss), lower being better in both."""
    front = []
    for r in rows:
        dominated = any(
            getattr(o, x) <= getattr(r, x) and o.quality_loss <= r.quality_loss
            and (getattr(o, x) < getattr(r, x) or o.quality_loss < r.quality_loss)
            for o in rows
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: getattr(r, x))


def plot_comparison(rows: Sequence[ComparisonRow], path: str, ep: int) -> None:
    """Two panels: quality loss vs mean T, and vs the busiest device's T at EP = ``ep``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"vanilla": "*", "pruned": "v", "oea": "o", "ep-oea": "D", "budget": "s", "subtractive": "^",
               "adaptive": "P"}
    for ax, x, label in ((axes[0], "mean_active_experts", "mean active experts T"),
                         (axes[1], "max_device_active_experts", f"max active experts on one device (EP={ep})")):
        for policy in markers:
            pts = [r for r in rows if r.policy == policy]
            if pts:
                ax.plot([getattr(r, x) for r in pts], [r.quality_loss for r in pts], marker=markers[policy],
                        linestyle="-" if len(pts) > 1 else "none", label=policy)
        ax.set_xlabel(label)
        ax.set_ylabel("quality loss (1 − kept router mass)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    batch = rows[0].batch_size if rows else "?"
    fig.suptitle(f"Policies at matched T, B = {batch} (budget / subtractive targets = OEA's T)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
