"""The ΔCE versions of the policy comparisons, measured with ``oea eval`` on a real model.

* ``matched_t_quality``: OEA and pruned at each k0, then budget and subtractive with OEA's measured
  mean T as their target, all teacher-forced on held-out text at one batch size.
* ``adaptive_quality``: OEA at every k0 and batch size, then fixed-k0 and calibrated k0(B) schedules
  compared as points (mean ΔCE, mean T) averaged over the batch sizes; no extra runs are needed
  because a schedule applies OEA(k0(B)) at each B. Each point's interval combines the per-batch-size
  intervals (``oea.stats.mean_of_estimates``); dominance compares the point estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oea.routing import BudgetConfig, SubtractiveConfig
from oea.stats import mean_of_estimates, t_quantile
from oea.tuning.calibrate import adaptive_schedule_from_eval


def matched_t_quality(
    model: Any = None, batch_size: int = 16, k0s: Sequence[int] = (2, 3, 4, 5), **eval_options: Any
) -> list[dict[str, Any]]:
    """Rows of ``oea.eval.evaluate`` for vanilla, pruned, OEA, budget and subtractive at matched T."""
    from oea.eval import evaluate

    rows = evaluate(model, batch_sizes=[batch_size], k0s=list(k0s), policies=["vanilla", "pruned", "oea"],
                    **eval_options)
    extra: list[tuple[str, BudgetConfig | SubtractiveConfig]] = []
    for row in rows:
        if row["policy"] == "oea":
            target = max(1, round(row["mean_active_experts"]))
            extra += [("budget", BudgetConfig(target)), ("subtractive", SubtractiveConfig(target))]
    more = evaluate(model, batch_sizes=[batch_size], k0s=[], policies=["vanilla"], extra_policies=extra,
                    **eval_options)
    for (_, cfg), row in zip(extra, [r for r in more if r["policy"] != "vanilla"], strict=True):
        row["target_T"] = cfg.expert_count
        rows.append(row)
    return rows


def _t_stderr(row: dict[str, Any]) -> float:
    """T's standard error from its 95% t interval over ``decode_steps`` steps (0 without an interval)."""
    if row["mean_active_experts_ci"] is None:
        return 0.0
    low, high = row["mean_active_experts_ci"]
    return (high - low) / 2 / t_quantile(0.975, row["decode_steps"] - 1)


def _mean_point(rows_by_b: dict[int, dict[int, dict]], k0_of_b: dict[int, int]) -> dict[str, Any]:
    """Mean ΔCE and mean T over the batch sizes, each with its combined 95% interval."""
    picks = [rows_by_b[b][k0_of_b[b]] for b in rows_by_b]
    delta = mean_of_estimates([r["delta_ce"] for r in picks], [r["delta_stderr"] for r in picks],
                              [r["documents"] - 1 for r in picks])
    active = mean_of_estimates([r["mean_active_experts"] for r in picks], [_t_stderr(r) for r in picks],
                               [max(1, r["decode_steps"] - 1) for r in picks])
    return {"delta_ce": delta.estimate, "delta_ce_ci": delta.as_list(),
            "mean_active_experts": active.estimate, "mean_active_experts_ci": active.as_list()}


def adaptive_quality(
    model: Any = None,
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    tolerances: Sequence[float] = (0.005, 0.01, 0.02, 0.05, 0.1),
    top_k: int = 8,
    **eval_options: Any,
) -> dict[str, Any]:
    """Fixed k0 = 1..top_k against calibrated k0(B) schedules on (mean ΔCE, mean T) over ``batch_sizes``."""
    from oea.eval import evaluate

    rows = evaluate(model, batch_sizes=list(batch_sizes), k0s=list(range(1, top_k + 1)),
                    policies=["vanilla", "oea"], **eval_options)
    by_b: dict[int, dict[int, dict]] = {}
    for r in rows:
        if r["policy"] == "oea":
            by_b.setdefault(r["batch_size"], {})[r["k0"]] = r
    fixed = {k0: _mean_point(by_b, {b: k0 for b in by_b}) for k0 in range(1, top_k + 1)}
    adaptive = {}
    for tolerance in tolerances:
        cfg = adaptive_schedule_from_eval(rows, tolerance, top_k)
        point = _mean_point(by_b, {b: cfg.k0_for(b) for b in by_b})
        d, t = point["delta_ce"], point["mean_active_experts"]
        dominates = [k0 for k0, f in fixed.items() if f["delta_ce"] >= d and f["mean_active_experts"] >= t
                     and (f["delta_ce"], f["mean_active_experts"]) != (d, t)]
        dominated_by = [k0 for k0, f in fixed.items() if f["delta_ce"] <= d and f["mean_active_experts"] <= t
                        and (f["delta_ce"], f["mean_active_experts"]) != (d, t)]
        adaptive[tolerance] = {"schedule": [list(e) for e in cfg.schedule], **point,
                               "dominates_fixed_k0": dominates, "dominated_by_fixed_k0": dominated_by}
    return {"batch_sizes": list(batch_sizes), "rows": rows, "fixed": fixed, "adaptive": adaptive}
