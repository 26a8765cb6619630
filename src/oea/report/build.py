"""``oea report``: one command from routing traces to a Markdown report with plots.

Steps (each a *section*: a function of the shared ``ReportContext`` returning Markdown):

1. capture a lock-step decode trace from the embedded model (``oea.models``), when available;
2. simulate the bundled real Qwen3-30B-A3B trace, the captured trace and the FLAME trace through
   every registered policy over batch sizes and k0;
3. quality from ``oea.eval.evaluate`` when that module is importable (otherwise the report says so);
4. predicted MoE-layer latency for several model × accelerator presets, and the roofline analysis;
5. beyond the paper: every policy at matched T, expert parallelism, adaptive k0 (``oea.tuning``);
6. caveats.

The sections live in ``oea.report.sections`` (one file each); what they share (``ReportContext``,
``md_table``, the registry ``register_section``) in ``oea.report.context``. More sections can be
added with ``register_section``; each runs in order and may read what earlier sections stored in
``ctx.results``. This module is the driver: it runs the registered sections, numbers their ``##`` and
``###`` headings in order (``number_headings``; sections write them without numbers) and writes the files.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import traceback
from typing import Any

import torch

from oea.report.context import (
    CORE_POLICIES,
    FULL,
    QUICK,
    SECTIONS,
    ReportContext,
    ReportSizes,
    md_table,
    register_section,
)
from oea.report.sections import DEFAULT_SECTIONS

for _name, _section in DEFAULT_SECTIONS:
    register_section(_name, _section)


# ------------------------------------------------------------------------------------------------ driver


def check_output_folder(out: pathlib.Path) -> None:
    """``out`` must be a folder that exists or can be created, and accept files (``ValueError`` naming
    ``--out`` otherwise)."""
    from oea.console import check_output_folder as check

    check(out, "--out")


def number_headings(markdown: str) -> str:
    """Number ``## Title`` as ``## 1. Title`` and ``### Sub`` as ``### 1.1 Sub``, in order (not in code blocks)."""
    section = sub = 0
    fenced = False
    lines = []
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            section, sub = section + 1, 0
            line = f"## {section}. {line[3:]}"
        elif not fenced and line.startswith("### ") and section:
            sub += 1
            line = f"### {section}.{sub} {line[4:]}"
        lines.append(line)
    return "\n".join(lines)


def build_report(out: pathlib.Path, quick: bool = False, seed: int = 0, console: Any = None,
                 served: dict[str, Any] | None = None) -> ReportContext:
    """Run every registered section and write ``out/report.md`` and ``out/results.json``; ``served``: the served
    system's rows (``oea.report.sections.served.load_served``), shown in their own section. A section that
    returns "" adds nothing."""
    from rich.console import Console

    check_output_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = ReportContext(out=out, sizes=QUICK if quick else FULL, seed=seed,
                        console=console or Console(stderr=True), quick=quick, served=served)
    parts = []
    for name, section in SECTIONS:
        started = time.perf_counter()
        ctx.console.log(f"report: {name} ...")
        try:
            text = section(ctx)
            if text:
                parts.append(text)
        except Exception as err:  # a broken section must show in the report, not abort the others
            parts.append(f"## {name}\n\n**This section failed**: {type(err).__name__}: {err}\n\n```\n"
                         f"{traceback.format_exc(limit=4)}```")
            ctx.results.setdefault("section_errors", []).append(f"{name}: {type(err).__name__}: {err}")
        ctx.timings[name] = time.perf_counter() - started
    timing = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in ctx.timings.items())
    parts.append(f"---\nSection run times on this machine: {timing}.")
    (out / "report.md").write_text(number_headings("\n\n".join(parts)) + "\n")
    (out / "results.json").write_text(json.dumps(_jsonable(ctx), indent=1, default=str) + "\n")
    return ctx


def _jsonable(ctx: ReportContext) -> dict[str, Any]:
    results = {k: v for k, v in ctx.results.items() if k != "embedded_trace"}
    return {"results": results, "plots": ctx.plots, "timings_s": ctx.timings, "quick": ctx.quick,
            "seed": ctx.seed}


def _summary(ctx: ReportContext) -> None:
    from rich.table import Table

    from oea.console import format_interval, wide_console

    rows = ctx.results.get("simulation", {}).get("qwen3-30b-a3b/mixed", [])
    latency = {(r["batch_size"]): r for r in ctx.results.get("latency", [])
               if r["model"] == "qwen3-30b-a3b" and r["gpu"] == "h100-sxm"}
    focus = 16 if any(r["batch_size"] == 16 for r in rows) else max((r["batch_size"] for r in rows), default=0)
    table = Table(title=f"Qwen3-30B-A3B trace, mixed batches, B = {focus} (± = 95% interval over batches)")
    for column in ("policy", "k0", "T", "T / vanilla", "experts/token", "kept top-k"):
        table.add_column(column, justify="right")
    for r in sorted((r for r in rows if r["batch_size"] == focus),
                    key=lambda r: (r["policy"] != "vanilla", r["policy"], r["k0"] or 0)):
        table.add_row(r["policy"], "-" if r["k0"] is None else str(r["k0"]),
                      format_interval(r["mean_active_experts"], r["mean_active_experts_ci"]),
                      format_interval(r["active_ratio_vs_vanilla"], r["active_ratio_vs_vanilla_ci"], 2),
                      format_interval(r["mean_experts_per_token"], r["mean_experts_per_token_ci"], 2),
                      format_interval(r["kept_topk_share"], r["kept_topk_share_ci"], 2))
    console = wide_console()
    console.print(table)
    if focus in latency:
        r = latency[focus]
        gains = ", ".join(
            f"OEA k0={k0}: {_gain(r, k0)}% faster" for k0 in ctx.sizes.curve_k0s
            if r.get(f"predicted_gain_k0_{k0}") is not None)
        console.print(f"predicted MoE layer latency at B={focus}: vanilla {r['latency_vanilla_us']:.0f} µs; {gains}")
    quality = ctx.results.get("quality", {})
    if not quality.get("available"):
        console.print(f"[yellow]quality not evaluated: {quality.get('reason')}[/]")
    if not ctx.results.get("capture", {}).get("available"):
        console.print(f"[yellow]embedded trace not captured: {ctx.results.get('capture', {}).get('reason')}[/]")
    for error in ctx.results.get("section_errors", []) + ctx.results.get("simulation_errors", []):
        console.print(f"[red]{error}[/]")


def _gain(row: dict[str, Any], k0: int) -> str:
    from oea.console import format_interval

    ci = row[f"predicted_gain_k0_{k0}_ci"]
    return format_interval(100 * row[f"predicted_gain_k0_{k0}"], None if ci is None else [100 * c for c in ci], 0)


def main(args: argparse.Namespace) -> int:
    from oea.report.sections.served import load_served

    out = pathlib.Path(args.out)
    check_output_folder(out)  # before any work, as are the served rows' files (next)
    served = load_served(args.served_quality, args.served_speed)
    torch.set_num_threads(args.threads)
    ctx = build_report(out, quick=args.quick, seed=args.seed, served=served)
    if args.json:
        print(json.dumps(_jsonable(ctx), indent=1, default=str))
    else:
        _summary(ctx)
        print(f"wrote {out / 'report.md'} with {len(ctx.plots)} plots")
    return 1 if ctx.results.get("section_errors") else 0


__all__ = [
    "CORE_POLICIES",
    "FULL",
    "QUICK",
    "SECTIONS",
    "ReportContext",
    "ReportSizes",
    "build_report",
    "main",
    "md_table",
    "register_section",
]
