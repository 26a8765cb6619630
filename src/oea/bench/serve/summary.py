"""A/B summary of ``oea bench serve`` rows: per concurrency and arm, medians over rounds with 95% CIs,
ratios to a baseline arm with paired CIs, engine-side figures (means over rounds), a table and a PNG.

Rounds are the unit: each (arm, concurrency, round) row is one server run of the same prompts as the
other arms' rows of that round, so arm-vs-baseline ratios are paired by round (``oea.stats``:
ratio of medians, whole rounds resampled). Per-round values are the row's own medians over its requests
(``median_tpot_ms``, ``median_itl_ms``) or its totals (``output_throughput``). A ratio resting on fewer than
two common rounds has no interval (``None``, and a note saying why): one pair cannot be resampled, and an
unpaired bootstrap of rounds that ran at different times would pass the machine's drift off as precision.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

AB_METRICS: tuple[str, ...] = ("median_tpot_ms", "median_itl_ms", "output_throughput", "mean_tpot_ms",
                               "spec_acceptance_rate", "spec_mean_accepted_length")
DIFF_METRICS: tuple[str, ...] = ("spec_acceptance_rate",)  # also as a paired difference to the baseline
ENGINE_FIELDS: tuple[str, ...] = ("engine_active_experts", "engine_active_experts_stock", "engine_routing_us_per_call",
                                  "engine_step_ms_median", "engine_routing_share_call", "engine_routing_share_step",
                                  "engine_mean_tokens_per_request")
COUNT_FIELDS: tuple[str, ...] = ("engine_decode_steps", "engine_verify_steps", "engine_verify_steps_rewritten",
                                 "engine_decode_steps_rewritten")  # summed over rounds
ENGINE_STATISTIC = "mean"  # of ENGINE_FIELDS over an arm's rounds, as docs/benchmarks-serving.md says
MIN_PAIRS = 2  # common rounds a ratio's interval needs (fewer: no interval)


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def no_interval_note(common: int, baseline: str) -> str:
    """Why a ratio has no interval: it rests on ``common`` (< ``MIN_PAIRS``) rounds shared with ``baseline``."""
    shared = f"{common} round" if common == 1 else f"{common} rounds"
    return (f"no interval: {shared} in common with {baseline!r} ({MIN_PAIRS} needed); the ratio is of all "
            "rounds' medians, unpaired")


def _unpaired_ratio(own: Sequence[float], base: Sequence[float], what: str) -> float:
    """median(own) / median(base), the point estimate of a ratio without enough pairs for an interval."""
    denominator = statistics.median(base)
    if denominator == 0:
        raise ValueError(f"{what}: the baseline's median is 0; the ratio is undefined")
    return statistics.median(own) / denominator


def _by_round(rows: Sequence[dict[str, Any]], key: str) -> dict[int, float]:
    return {int(r["round"]): float(r[key]) for r in rows if r.get(key) is not None and not math.isnan(float(r[key]))}


def ab_summary(rows: Sequence[dict[str, Any]], baseline: str | None = None, seed: int = 0,
               metrics: Sequence[str] = AB_METRICS) -> list[dict[str, Any]]:
    """One entry per (max_concurrency, arm): ``rounds``, and for each metric M ``M`` (median over rounds),
    ``M_ci`` (bootstrap 95% CI of that median), ``M_rounds`` (per-round values), and for arms other than
    the baseline ``M_ratio`` / ``M_ratio_ci`` (median(arm) / median(baseline) over the rounds both have,
    resampled in pairs; ``M_ratio_pairs`` of them); with fewer than two common rounds ``M_ratio`` is
    median(arm) / median(baseline) over all their rounds, unpaired, ``M_ratio_ci`` is ``None`` (no interval),
    ``M_ratio_pairs`` 0 and ``M_ratio_note`` says why (``no_interval_note``); for the acceptance rate also
    ``M_diff`` / ``M_diff_ci`` (mean per-round difference arm − baseline, paired t interval; two common rounds
    at least). Engine fields (``ENGINE_FIELDS``) are means over rounds (``ENGINE_STATISTIC``), step counts
    (``COUNT_FIELDS``) sums. Metrics a row lacks (``spec_*`` without speculation) are left out. ``baseline``
    defaults to the first arm seen; ``ValueError`` names ``--baseline-arm`` when it is not an arm."""
    from oea.stats import median_interval, paired_difference, ratio_of_medians_interval

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    if not arms:
        return []
    baseline = arms[0] if baseline is None else baseline
    if baseline not in arms:
        raise ValueError(f"--baseline-arm must be one of {arms}, got {baseline!r}")
    rng = np.random.default_rng(seed)
    out = []
    for concurrency in sorted({int(r["max_concurrency"]) for r in rows}):
        cell = {arm: [r for r in rows if r["arm"] == arm and int(r["max_concurrency"]) == concurrency] for arm in arms}
        for arm in arms:
            if not cell[arm]:
                continue
            entry: dict[str, Any] = {"arm": arm, "max_concurrency": concurrency, "rounds": len(cell[arm]),
                                     "baseline": baseline}
            for metric in metrics:
                own = _by_round(cell[arm], metric)
                if not own:
                    continue
                values = [own[k] for k in sorted(own)]
                interval = median_interval(values, rng)
                entry.update({metric: interval.estimate, f"{metric}_ci": interval.as_list(),
                              f"{metric}_rounds": values})
                base = _by_round(cell[baseline], metric)
                if arm == baseline or not base:
                    continue
                common = sorted(set(own) & set(base))
                if len(common) >= MIN_PAIRS:
                    ratio = ratio_of_medians_interval([own[k] for k in common], [base[k] for k in common], rng,
                                                      paired=True)
                    entry.update({f"{metric}_ratio": ratio.estimate, f"{metric}_ratio_ci": ratio.as_list(),
                                  f"{metric}_ratio_pairs": len(common)})
                else:  # a point estimate only: see the module docstring
                    estimate = _unpaired_ratio(values, [base[k] for k in sorted(base)],
                                               f"{metric} at max_concurrency {concurrency} ({arm!r} / {baseline!r})")
                    note = no_interval_note(len(common), baseline)
                    entry.update({f"{metric}_ratio": estimate, f"{metric}_ratio_ci": None,
                                  f"{metric}_ratio_pairs": 0, f"{metric}_ratio_note": note})
                if metric in DIFF_METRICS and len(common) >= MIN_PAIRS:
                    diff = paired_difference([own[k] for k in common], [base[k] for k in common])
                    entry.update({f"{metric}_diff": diff.mean, f"{metric}_diff_ci": diff.ci.as_list()})
            for field in ENGINE_FIELDS:  # means, not medians: the documented statistic (ENGINE_STATISTIC)
                values = _finite(r.get(field) for r in cell[arm])
                if values:
                    entry[field] = statistics.mean(values)
            for field in COUNT_FIELDS:
                if any(field in r for r in cell[arm]):
                    entry[field] = int(sum(r.get(field, 0) for r in cell[arm]))
            loads = _finite(r["loadavg"][0] for r in cell[arm] if r.get("loadavg"))
            if loads:
                entry["loadavg_1m_range"] = [min(loads), max(loads)]
            out.append(entry)
    return out


def print_ab_table(summary: Sequence[dict[str, Any]]) -> None:
    """The A/B summary as a rich table on stdout; each ratio says how many rounds it pairs (``pairs``), a ratio
    without an interval says so (``(no CI)``, and a caption), engine columns are means over rounds."""
    from rich.console import Console
    from rich.table import Table

    several = len({e["arm"] for e in summary}) > 1
    engine = f"engine columns: {ENGINE_STATISTIC}s over rounds"
    table = Table(title=f"serving A/B (medians over rounds, 95% CI; ratios vs '{summary[0]['baseline']}', paired by "
                        f"round; {engine})" if several else f"serving (medians over rounds, 95% CI; {engine})")
    speculating = any("spec_acceptance_rate" in e for e in summary)
    columns = ["c", "arm", "rounds", "median TPOT ms", "TPOT ratio", "pairs", "median ITL ms", "out tok/s",
               "tok/s ratio"]
    if speculating:
        columns += ["acceptance", "Δ acceptance", "mean acc. length", "verify steps (rewritten)"]
    for column in (*columns, "active experts", "routing µs/call", "step ms", "routing share/step"):
        table.add_column(column, justify="right")

    def cell(entry: dict[str, Any], key: str, fmt: str) -> str:
        if key not in entry:
            return "–"
        if entry[f"{key}_ci"] is None:  # fewer than two common rounds (``M_ratio_note``)
            return f"{entry[key]:{fmt}} (no CI)"
        lo, hi = entry[f"{key}_ci"]
        return f"{entry[key]:{fmt}} [{lo:{fmt}}–{hi:{fmt}}]"

    def pairs(entry: dict[str, Any]) -> str:  # the rounds both this arm and the baseline have
        count = entry.get("median_tpot_ms_ratio_pairs")
        return "–" if count is None else f"{count} rounds" if count else "0 (unpaired)"

    for e in summary:
        active = f"{e['engine_active_experts']:.1f}" if "engine_active_experts" in e else "–"
        if "engine_active_experts_stock" in e:
            active += f" ({e['engine_active_experts_stock']:.1f})"
        spec = []
        if speculating:
            diff = cell(e, "spec_acceptance_rate_diff", "+.3f")
            verify = (f"{e['engine_verify_steps']} ({e.get('engine_verify_steps_rewritten', 0)})"
                      if "engine_verify_steps" in e else "–")
            spec = [cell(e, "spec_acceptance_rate", ".3f"), diff, cell(e, "spec_mean_accepted_length", ".2f"), verify]
        table.add_row(
            str(e["max_concurrency"]), e["arm"], str(e["rounds"]), cell(e, "median_tpot_ms", ".1f"),
            cell(e, "median_tpot_ms_ratio", ".3f"), pairs(e), cell(e, "median_itl_ms", ".1f"),
            cell(e, "output_throughput", ".1f"), cell(e, "output_throughput_ratio", ".3f"), *spec, active,
            f"{e['engine_routing_us_per_call']:.0f}" if "engine_routing_us_per_call" in e else "–",
            f"{e['engine_step_ms_median']:.1f}" if "engine_step_ms_median" in e else "–",
            f"{e['engine_routing_share_step']:.2%}" if "engine_routing_share_step" in e else "–",
        )
    if any(key.endswith("_ratio_note") for e in summary for key in e):
        table.caption = (f"(no CI): fewer than {MIN_PAIRS} rounds in common with the baseline arm, so no interval; "
                         "that ratio is of all rounds' medians, unpaired")
    Console(width=200).print(table)


def plot_ab(summary: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """PNG, panels against max concurrency, one line per arm: median TPOT, output tok/s (medians over rounds,
    bars: 95% CI) and, with more than one arm, TPOT / baseline TPOT (bars: paired 95% CI; none where a ratio
    has no interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("median_tpot_ms", "median TPOT (ms)"), ("output_throughput", "output throughput (tok/s)")]
    if any("median_tpot_ms_ratio" in e for e in summary):  # a single arm has no ratio panel
        panels.append(("median_tpot_ms_ratio", "TPOT / baseline TPOT"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for index, arm in enumerate(dict.fromkeys(e["arm"] for e in summary)):  # one colour per arm in every panel
        for ax, (key, _label) in zip(axes, panels, strict=True):
            points = [e for e in summary if e["arm"] == arm and key in e]
            if not points:
                continue
            mid = np.array([e[key] for e in points])
            bounds = [e[f"{key}_ci"] or [m, m] for m, e in zip(mid, points, strict=True)]  # no interval: no bar
            err = np.array([[m - lo for m, (lo, _) in zip(mid, bounds, strict=True)],
                            [hi - m for m, (_, hi) in zip(mid, bounds, strict=True)]])
            ax.errorbar([e["max_concurrency"] for e in points], mid, yerr=err, marker="o", capsize=3, label=arm,
                        color=f"C{index % 10}")
    for ax, (_key, label) in zip(axes, panels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if len(panels) == 3:
        axes[2].axhline(1.0, color="grey", lw=0.8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (arm, max_concurrency): median and min..max over rounds of output tok/s and mean TPOT."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["arm"], int(row["max_concurrency"])), []).append(row)
    out = []
    for (arm, conc), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        tput = [float(g["output_throughput"]) for g in group]
        tpot = [float(g["mean_tpot_ms"]) for g in group if not math.isnan(float(g["mean_tpot_ms"]))]
        out.append({
            "arm": arm,
            "max_concurrency": conc,
            "rounds": len(group),
            "output_throughput_median": statistics.median(tput),
            "output_throughput_min": min(tput),
            "output_throughput_max": max(tput),
            "mean_tpot_ms_median": statistics.median(tpot) if tpot else math.nan,
            "mean_tpot_ms_min": min(tpot) if tpot else math.nan,
            "mean_tpot_ms_max": max(tpot) if tpot else math.nan,
            "mean_ttft_ms_median": statistics.median(float(g["mean_ttft_ms"]) for g in group),
        })
    return out
