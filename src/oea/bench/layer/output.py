"""Output of ``oea bench layer``: rich tables and a latency-vs-T plot of a result dict."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np


def render_table(result: dict[str, Any], console: Any | None = None) -> None:
    """Print the policy rows, the sweep and the fit as rich tables."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 150))
    title = (f"MoE layer {result['preset']} B={result['batch_size']} {result['dtype']} {result['device']} "
             f"impl={result['impl']} threads={result['threads']} repeats={result['repeats']}")
    for kind, rows in (("policies", result["rows"]), ("T sweep (synthetic, exact T)", result["sweep"])):
        if not rows:
            continue
        table = Table(title=f"{title}: {kind}")
        for column in ("variant", "T", "B·k used", "median µs", "95% CI µs", "p10–p90 µs", "GB/s", "vs vanilla"):
            table.add_column(column, justify="left" if column == "variant" else "right")
        for r in rows:
            ratio = r.get("ratio_vs_vanilla")
            ratio_text = "–" if ratio is None else f"{ratio:.3f} [{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}]"
            table.add_row(
                r["label"], f"{r['mean_active_experts']:.1f}", f"{r['mean_token_slots']:.1f}",
                f"{r['latency_us_median']:.0f}", f"{r['latency_us_ci95'][0]:.0f}–{r['latency_us_ci95'][1]:.0f}",
                f"{r['latency_us_p10']:.0f}–{r['latency_us_p90']:.0f}", f"{r['bandwidth_GBps_median']:.2f}",
                ratio_text,
            )
        console.print(table)
    fit = result.get("fit")
    if fit:
        console.print(
            f"fit: latency = {fit['b_us']:.1f} µs·T + {fit['a_us']:.2f} µs·(B·k) + {fit['c_us']:.1f} µs   "
            f"R² = {fit['r2']:.4f} over {fit['points']} points"
            + (f", R² on the sweep = {fit['r2_sweep']:.4f}" if "r2_sweep" in fit else "")
            + ("" if fit["a_identified"] else "  (a not identified: fixed at 0)")
        )
    console.print(f"routing: {result['routing_note']}; {result['weight_copies']} weight copies of "
                  f"{result['layer_bytes'] / 2**30:.2f} GiB; {result['machine']}")


def plot_result(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """PNG: median latency vs T for the sweep (95% CI bars), the fit line at the sweep's B·k, and
    the policy rows marked at their mean T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = result["sweep"]
    if sweep:
        t = np.array([r["mean_active_experts"] for r in sweep])
        y = np.array([r["latency_us_median"] for r in sweep]) / 1e3
        med = np.array([r["latency_us_median"] for r in sweep])
        err = np.abs(np.array([[r["latency_us_ci95"][0] for r in sweep], [r["latency_us_ci95"][1] for r in sweep]])
                     - med) / 1e3
        ax.errorbar(t, y, yerr=err, fmt="o", color="0.3", capsize=3, label="synthetic routing, exact T")
    fit = result.get("fit")
    if fit:
        xs = np.linspace(0, result["shape"]["num_experts"], 50)
        slots = fit.get("token_slots_of_sweep", result["batch_size"] * result["shape"]["top_k"])
        ax.plot(xs, (fit["b_us"] * xs + fit["a_us"] * slots + fit["c_us"]) / 1e3, "--", color="0.5",
                label=f"fit b·T + a·B·k + c at B·k={slots} (R²={fit['r2']:.3f})")
    markers = {"vanilla": "s", "oea": "*", "pruned": "v"}
    for r in result["rows"]:
        ax.plot(r["mean_active_experts"], r["latency_us_median"] / 1e3, markers.get(r["policy"], "D"), markersize=11,
                label=f"{r['label']} (T̄={r['mean_active_experts']:.1f}, B·k used {r['mean_token_slots']:.0f})")
    ax.set_xlabel("active experts T")
    ax.set_ylabel("MoE layer latency, median (ms)")
    ax.set_title(f"{result['preset']} layer, B={result['batch_size']}, {result['dtype']}, {result['device']} "
                 f"({result['impl']})", fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
