"""PNG plots of the report (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: pathlib.Path) -> pathlib.Path:
    """Lay out, write the PNG, release the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(row: dict[str, Any]) -> str:
    return row["policy"] if row["k0"] is None else f"{row['policy']} k0={row['k0']}"


def active_vs_batch(rows: Sequence[dict[str, Any]], k0s: Sequence[int], title: str, path: pathlib.Path,
                    uniform: dict[int, float] | None = None) -> pathlib.Path:
    """Mean active experts T against batch size, one line per (policy, k0 in ``k0s``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["k0"] is None or row["k0"] in k0s:
            series.setdefault(_label(row), []).append((row["batch_size"], row["mean_active_experts"]))
    for label, points in sorted(series.items()):
        points.sort()
        style = "-" if label.startswith("oea") else ("--" if label.startswith("pruned") else "-")
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
    if uniform:
        xs = sorted(uniform)
        ax.plot(xs, [uniform[x] for x in xs], ":", color="grey", label="uniform routing (vanilla)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("mean active experts T per layer")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def active_vs_k0(rows: Sequence[dict[str, Any]], batch_size: int, title: str, path: pathlib.Path) -> pathlib.Path:
    """T (left) and experts per token (right) against k0 at one batch size, per policy."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    chosen = [r for r in rows if r["batch_size"] == batch_size]
    policies = sorted({r["policy"] for r in chosen if r["k0"] is not None})
    for policy in policies:
        points = sorted((r["k0"], r["mean_active_experts"], r["mean_experts_per_token"])
                        for r in chosen if r["policy"] == policy)
        left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        right.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=policy)
    for row in chosen:
        if row["policy"] == "vanilla":
            left.axhline(row["mean_active_experts"], color="grey", ls=":", label="vanilla")
            right.axhline(row["mean_experts_per_token"], color="grey", ls=":", label="vanilla")
    left.set_ylabel("mean active experts T")
    right.set_ylabel("experts per token")
    for ax in (left, right):
        ax.set_xlabel("k0")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title} (B = {batch_size})")
    return _save(plt, fig, path)


def quality_pareto(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path:
    """Cross-entropy (or its paired difference to vanilla, ``delta_ce``, when the rows carry it) against
    mean active experts, one series per (policy, batch size)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    delta = all(r.get("delta_ce") is not None for r in rows if r["policy"] != "vanilla")
    value = "delta_ce" if delta else "cross_entropy"
    keys = sorted({(r["policy"], r["batch_size"]) for r in rows})
    for policy, batch in keys:
        points = []
        for r in rows:
            if r["policy"] == policy and r["batch_size"] == batch:
                y = r.get(value) or 0.0
                low, high = r.get(f"{value}_ci") or (y, y)
                points.append((r["mean_active_experts"], y, y - low, high - y))
        points.sort()
        ax.errorbar([p[0] for p in points], [p[1] for p in points],
                    yerr=[[p[2] for p in points], [p[3] for p in points]], marker="o", capsize=2,
                    label=f"{policy} B={batch}")
    ax.set_xlabel("mean active experts T")
    ax.set_ylabel("Δ cross-entropy vs vanilla (nats/token, paired 95% interval)" if delta
                  else "held-out cross-entropy (nats/token, 95% interval)")
    ax.set_title("quality vs active experts (lower-left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def latency_vs_batch(curves: dict[str, dict[str, list[tuple[int, float]]]], path: pathlib.Path) -> pathlib.Path:
    """Predicted MoE-layer latency against batch size: one panel per deployment, one line per policy."""
    plt = _pyplot()
    panels = list(curves.items())
    columns = min(2, len(panels))
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for label, points in sorted(lines.items()):
            points = sorted(points)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("predicted MoE layer latency (µs)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)
