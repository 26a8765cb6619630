"""The ΔCE versions of the policy comparisons, measured with ``oea eval`` on a real model.

* ``matched_t_quality``: OEA and pruned at each k0, then budget and subtractive with OEA's measured
  mean T as their target, all teacher-forced on held-out text at one batch size. The budget comparator
  runs as XShare publishes it: with no per-token floor (its default) and with each floor in ``floors``
  below k0; a floor adds experts on top of the budget (XShare's ``top_per_token``), so its budget is
  found by bisection until the measured mean T is the nearest to OEA's.
* ``adaptive_quality``: OEA at every k0 and batch size, then fixed-k0 and calibrated k0(B) schedules
  compared as points (mean ΔCE, mean T) averaged over the batch sizes; no extra runs are needed
  because a schedule applies OEA(k0(B)) at each B. Each point's interval combines the per-batch-size
  intervals (``oea.stats.mean_of_estimates``); dominance compares the point estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from oea.routing import BudgetConfig, SubtractiveConfig
from oea.stats import mean_of_estimates, t_quantile
from oea.tuning.calibrate import adaptive_schedule_from_eval


def matched_t_quality(
    model: Any = None,
    batch_size: int = 16,
    k0s: Sequence[int] = (2, 3, 4, 5),
    floors: Sequence[int] = (0, 1, 2),
    **eval_options: Any,
) -> list[dict[str, Any]]:
    """Rows of ``oea.eval.evaluate`` for vanilla, pruned, OEA, budget and subtractive at matched T.

    ``floors``: the XShare per-token floors to compare (``BudgetConfig.floor``). Floor 0 (XShare's default, the
    budget alone) gets OEA's rounded T as its budget, as subtractive does, and keeps the row label ``budget``; a
    floor f >= 1 is evaluated where f < k0 (at f = k0 the floors alone are OEA's whole union, nothing is left to
    share), labelled ``budget floor=f``, at the budget whose mean T is nearest OEA's (``_budget_at_matched_t``).
    Every comparator row carries ``target_T`` (OEA's rounded T), ``budget`` and ``floor`` where they apply.
    """
    from oea.eval import evaluate

    for floor in floors:
        if not isinstance(floor, int) or isinstance(floor, bool) or floor < 0:
            raise ValueError(f"floors must be integers >= 0, got {list(floors)}")
    rows = evaluate(model, batch_sizes=[batch_size], k0s=list(k0s), policies=["vanilla", "pruned", "oea"],
                    **eval_options)
    oea_rows = [row for row in rows if row["policy"] == "oea"]
    extra: list[tuple[str, BudgetConfig | SubtractiveConfig]] = []
    for row in oea_rows:
        target = max(1, round(row["mean_active_experts"]))
        if 0 in floors:
            extra.append(("budget", BudgetConfig(target)))
        extra.append(("subtractive", SubtractiveConfig(target)))
    more = evaluate(model, batch_sizes=[batch_size], k0s=[], policies=["vanilla"], extra_policies=extra,
                    **eval_options)
    for (_, cfg), row in zip(extra, [r for r in more if r["policy"] != "vanilla"], strict=True):
        row["target_T"] = cfg.expert_count
        if isinstance(cfg, BudgetConfig):
            row.update(budget=cfg.budget, floor=cfg.floor)
        rows.append(row)
    for row in oea_rows:
        for floor in sorted(f for f in set(floors) if 0 < f < row["k0"]):
            found = _budget_at_matched_t(model, batch_size, row["mean_active_experts"], floor, **eval_options)
            found["target_T"] = max(1, round(row["mean_active_experts"]))
            rows.append(found)
    return rows


def _budget_at_matched_t(
    model: Any, batch_size: int, target: float, floor: int, **eval_options: Any
) -> dict[str, Any]:
    """The row of ``BudgetConfig(b, floor=floor)`` whose measured mean T is nearest ``target`` (ties: the smaller b).

    The floor's experts come on top of the budget, so T is not b: bisect b in 1..ceil(target) for the largest b
    whose mean T is at most ``target`` (T grows with b), then take b or b + 1, whichever T is nearer. Each trial is
    one ``evaluate`` run of the same held-out batches (its vanilla rows are the paired reference).
    """
    from oea.eval import evaluate

    label = f"budget floor={floor}"
    tried: dict[int, dict[str, Any]] = {}

    def run(budget: int) -> dict[str, Any]:
        if budget not in tried:
            found = evaluate(model, batch_sizes=[batch_size], k0s=[], policies=["vanilla"],
                             extra_policies=[(label, BudgetConfig(budget, floor=floor))], **eval_options)
            tried[budget] = next(r for r in found if r["policy"] == label)
            tried[budget].update(budget=budget, floor=floor)
        return tried[budget]

    # Every bought expert is some real token's own top-k pick, so T >= b: the largest useful b is ceil(target).
    top = max(1, math.ceil(target))
    low, high = 1, top
    while low < high:  # invariant: T(low) <= target, or low == 1
        middle = (low + high + 1) // 2
        if run(middle)["mean_active_experts"] <= target:
            low = middle
        else:
            high = middle - 1
    candidates = [run(low)] + ([run(low + 1)] if run(low)["mean_active_experts"] < target and low < top else [])
    return min(candidates, key=lambda r: (abs(r["mean_active_experts"] - target), r["budget"]))


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
