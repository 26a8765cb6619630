""""Does it pay": a speed run's TPOT ratio beside a quality run's score difference, per arm and concurrency.

The speed rows are ``oea bench serve``'s (its ``--output-file``), summarised by ``oea.bench.serve.summary.ab_summary``
(median TPOT over rounds, ratio to the baseline arm with its paired bootstrap 95% interval); the quality rows are
``oea eval serve``'s summary rows (``oea.eval.serve_summary``). They meet on (arm, max_concurrency); the quality
row is the one pooled over rounds (``round`` ``"all"``) when there is one, else the single round's. A speed gain
is a TPOT ratio below 1; a quality loss a negative ``delta``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pay_rows(speed_rows: Sequence[dict[str, Any]], quality: Sequence[dict[str, Any]], metric: str | None = None,
             baseline: str | None = None, flag: str = "--speed-file") -> list[dict[str, Any]]:
    """One row per (arm, max_concurrency) found in both, baseline left out: ``tpot_ratio`` / ``tpot_ratio_ci``
    beside ``delta`` / ``delta_ci`` / ``verdict`` of ``metric`` (default: the first metric of the quality rows);
    ``ValueError`` naming ``flag`` (the option that gave the speed rows) when the two runs share no (arm,
    concurrency)."""
    from oea.bench.serve.summary import ab_summary

    speed = {(e["arm"], int(e["max_concurrency"])): e for e in ab_summary(speed_rows, baseline=baseline)}
    metric = metric or next((q["metric"] for q in quality), None)
    chosen: dict[tuple[str, int], dict[str, Any]] = {}
    for q in quality:
        if q["metric"] != metric or q.get("delta") is None:
            continue
        key = (q["arm"], int(q["max_concurrency"]))
        if key not in chosen or q["round"] == "all":
            chosen[key] = q
    out = []
    for key, q in sorted(chosen.items()):
        s = speed.get(key)
        if s is None or "median_tpot_ms_ratio" not in s:
            continue
        out.append({"arm": key[0], "max_concurrency": key[1], "metric": metric, "task": q["task"],
                    "tpot_ratio": s["median_tpot_ms_ratio"], "tpot_ratio_ci": s["median_tpot_ms_ratio_ci"],
                    "speed_rounds": s["rounds"], "delta": q["delta"], "delta_ci": q["delta_ci"],
                    "verdict": q["verdict"], "n_items": q["n_items"]})
    if not out:
        raise ValueError(f"{flag}: its bench serve rows share no (arm, max_concurrency) with the quality rows "
                         "(use the same arm names, baseline and concurrencies in both runs)")
    return out


def plot_pay(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """PNG: speed gain (1 - TPOT ratio, %) against quality change (``delta``, points), one point per arm and
    concurrency, error bars both ways (their 95% intervals; none where a figure has no interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for index, arm in enumerate(dict.fromkeys(r["arm"] for r in rows)):
        for r in (r for r in rows if r["arm"] == arm):
            gain = 100 * (1 - r["tpot_ratio"])
            delta = 100 * r["delta"]
            yerr = xerr = None  # a speed run with fewer than two common rounds has no interval (bench serve's rule)
            if r["tpot_ratio_ci"] is not None:
                gain_ci = sorted(100 * (1 - v) for v in r["tpot_ratio_ci"])
                yerr = [[gain - gain_ci[0]], [gain_ci[1] - gain]]
            if r["delta_ci"] is not None:
                delta_ci = [100 * v for v in r["delta_ci"]]
                xerr = [[delta - delta_ci[0]], [delta_ci[1] - delta]]
            ax.errorbar(delta, gain, xerr=xerr, yerr=yerr, marker="o", capsize=3,
                        color=f"C{index % 10}", label=arm if r is next(x for x in rows if x["arm"] == arm) else None)
            ax.annotate(f"c={r['max_concurrency']}", (delta, gain), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel(f"quality change vs baseline ({rows[0]['metric']}, points; 95% CI)")
    ax.set_ylabel("speed gain: 1 - TPOT ratio (%; 95% CI)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
