"""Every policy side by side on one trace: a quality proxy against T and against the busiest EP device.

Budget (XShare-like, here without XShare's optional per-token floor: ``BudgetConfig.floor`` 0, XShare's
default) and subtractive (Lynx-like) comparators are given OEA's measured mean T at each k0 as their
target, so the comparison is at matched mean T (``oea compare-quality matched-t`` adds the floor).

The quality proxy (``PROXIES``) is not a quality measurement: it is how much of its own router choice a
token loses, averaged over tokens, layers and batches —

* ``lost_router_mass`` = 1 − (router probability of the experts a token is routed to) / (router
  probability of its vanilla top-k), where the trace records logits or scores;
* ``lost_topk_share`` = 1 − (share of the token's vanilla top-k it keeps), for id-only traces.

A proxy and the real quality loss (ΔCE, ``oea compare-quality`` on a model) can rank policies
differently (``DISAGREEMENT``): subtractive routing drops the batch's least-wanted experts, so at a
given T most tokens keep most of their own choice and it wins on the proxy (the bundled Qwen3 trace);
OEA instead guarantees every token its own top-k0 and fills the rest with experts already loaded,
which loses more of the proxy but less cross-entropy (on the embedded model ``oea compare-quality
matched-t`` measures OEA's ΔCE at about a quarter of subtractive's at matched T). Use the proxy to rank
settings of one policy on a trace, and ΔCE to compare policies.

Every mean carries its 95% t interval over the batches (``*_ci``; the per-batch value is the mean over layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import oea
from oea.routing import AdaptiveK0Config, BudgetConfig, EPOEAConfig, ExpertPlacement, SubtractiveConfig
from oea.sim.simulate import LayerBatches, batch_expert_load, core_metrics, make_batches, route_batches, router_inputs
from oea.stats import mean_interval
from oea.traces import Trace
from oea.tuning.calibrate import proxy_name

# proxy field name -> (trace metric it is 1 - of, definition shown with the figures)
PROXIES: dict[str, tuple[str, str]] = {
    "lost_router_mass": ("kept_mass", "1 − router probability mass kept, relative to vanilla top-k"),
    "lost_topk_share": ("kept_topk_share", "1 − share of the token's vanilla top-k kept (id-only trace)"),
}


DISAGREEMENT = ("the proxy is not ΔCE and can rank policies differently: subtractive keeps the most of the "
                "tokens' own choice at a given T and can win here, while on a real model (`oea compare-quality "
                "matched-t`, embedded model) OEA's ΔCE at matched T is below subtractive's and the budget alone's, "
                "and level with the budget given XShare's per-token floor; compare policies by ΔCE")


def proxy_of(trace: Trace) -> str:
    """The proxy a comparison on ``trace`` reports: ``lost_router_mass`` or ``lost_topk_share``."""
    return "lost_router_mass" if proxy_name(trace) == "kept_mass" else "lost_topk_share"


@dataclass(frozen=True)
class ComparisonRow:
    """One policy setting at one batch size, averaged over layers and batches, with 95% intervals.

    ``proxy`` names the quality proxy (a key of ``PROXIES``) and ``proxy_loss`` is its value.
    """

    policy: str
    setting: str
    batch_size: int
    mean_active_experts: float
    max_device_active_experts: float
    proxy: str
    proxy_loss: float
    mean_experts_per_token: float
    intervals: tuple[tuple[str, tuple[float, float]], ...] = ()

    def ci(self, name: str) -> list[float] | None:
        """``[low, high]`` of ``mean_active_experts``, ``max_device_active_experts``, ``proxy_loss`` or
        ``mean_experts_per_token``."""
        found = dict(self.intervals).get(name)
        return None if found is None else list(found)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the proxy's value under its own name (e.g. ``lost_router_mass``), each mean with ``*_ci``."""
        out: dict[str, Any] = {"policy": self.policy, "setting": self.setting, "batch_size": self.batch_size}
        for name in ("mean_active_experts", "max_device_active_experts", "mean_experts_per_token"):
            out[name], out[f"{name}_ci"] = getattr(self, name), self.ci(name)
        out["proxy"] = self.proxy
        out[self.proxy], out[f"{self.proxy}_ci"] = self.proxy_loss, self.ci("proxy_loss")
        return out


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
              placement: ExpertPlacement) -> dict[str, torch.Tensor]:
    """Per batch ([nb] each, averaged over layers): T, busiest device's T, proxy loss, experts per token."""
    sums: dict[str, torch.Tensor] = {}
    for x in inputs:
        ids, weights = route_batches(x.logits, x.spec, cfg, batches)
        values = core_metrics(LayerBatches(x.layer, ids, weights, x.vanilla_ids, x.mass, x.spec.num_experts))
        load = batch_expert_load(ids, weights, x.spec.num_experts)
        layer = {"mean_active_experts": values["active_experts"],
                 "max_device_active_experts": placement.device_counts(load > 0).max(-1).values.double(),
                 "proxy_loss": (1.0 - values[metric]).clamp_min(0.0),
                 "mean_experts_per_token": values["experts_per_token"]}
        for name, value in layer.items():
            sums[name] = sums.get(name, 0.0) + value.double()
    return {name: total / len(inputs) for name, total in sums.items()}


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
    """Vanilla, pruned, OEA, EP-aware OEA (per k0), budget and subtractive (at OEA's T), adaptive.

    Raises ``ValueError`` naming the argument for layers outside the trace (or repeated), k0 outside
    1..top_k, ``num_batches`` < 2 (an interval needs two batches), or ``ep`` not dividing N.
    """
    spec = trace.spec
    placement = ExpertPlacement.contiguous(spec.num_experts, ep)
    layers = check_compare_arguments(trace, k0s, num_batches, layers)
    batches = make_batches(trace, batch_size, "mixed", num_batches, torch.Generator().manual_seed(seed))
    max_rank = None if trace.logits is not None else spec.top_k  # id-only traces: piggyback within top-k
    inputs = _layer_inputs(trace, layers, batches)
    metric = proxy_name(trace)
    proxy = proxy_of(trace)
    rows: list[ComparisonRow] = []

    def add(policy: str, setting: str, cfg: object | None) -> ComparisonRow:
        per_batch = _evaluate(cfg, batches, inputs, metric, placement)
        intervals = {name: mean_interval(values.numpy()) for name, values in per_batch.items()}
        row = ComparisonRow(policy, setting, batch_size, intervals["mean_active_experts"].estimate,
                            intervals["max_device_active_experts"].estimate, proxy,
                            intervals["proxy_loss"].estimate, intervals["mean_experts_per_token"].estimate,
                            tuple((name, iv.bounds) for name, iv in intervals.items()))
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


def check_compare_arguments(
    trace: Trace, k0s: Sequence[int], num_batches: int, layers: Sequence[int] | None
) -> list[int]:
    """The layer list (default: all); ``ValueError`` naming the flag for bad layers, k0 or num_batches."""
    top = trace.num_layers - 1
    chosen = list(range(trace.num_layers)) if layers is None else list(layers)
    bad = [layer for layer in chosen if not isinstance(layer, int) or not 0 <= layer <= top]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"--layers must be distinct MoE layer indices in 0..{top} (trace {trace.name!r} has "
                         f"{trace.num_layers}), got {list(chosen)}")
    bad = [k0 for k0 in k0s if not isinstance(k0, int) or not 1 <= k0 <= trace.spec.top_k]
    if bad or len(set(k0s)) != len(k0s):
        raise ValueError(f"--k0 must be distinct integers in 1..{trace.spec.top_k} (the trace's top_k), got "
                         f"{list(k0s)}")
    if not isinstance(num_batches, int) or num_batches < 2:
        raise ValueError(f"--num-batches must be an integer >= 2 (an interval needs two batches), got {num_batches!r}")
    return chosen


def pareto_front(rows: Sequence[ComparisonRow], x: str = "mean_active_experts") -> list[ComparisonRow]:
    """Rows not dominated in (``x``, proxy_loss), lower being better in both."""
    front = []
    for r in rows:
        dominated = any(
            getattr(o, x) <= getattr(r, x) and o.proxy_loss <= r.proxy_loss
            and (getattr(o, x) < getattr(r, x) or o.proxy_loss < r.proxy_loss)
            for o in rows
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: getattr(r, x))


def plot_comparison(rows: Sequence[ComparisonRow], path: str, ep: int) -> None:
    """Two panels: the quality proxy vs mean T, and vs the busiest device's T at EP = ``ep``."""
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
                ax.plot([getattr(r, x) for r in pts], [r.proxy_loss for r in pts], marker=markers[policy],
                        linestyle="-" if len(pts) > 1 else "none", label=policy)
        ax.set_xlabel(label)
        proxy = rows[0].proxy if rows else "lost_router_mass"
        ax.set_ylabel(f"quality proxy {proxy} ({PROXIES[proxy][1]})", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    batch = rows[0].batch_size if rows else "?"
    fig.suptitle(f"Policies at matched T, B = {batch} (budget / subtractive targets = OEA's T)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
