"""Report section, beyond the paper: every policy at matched T, under EP = 8, and adaptive k0 (``oea.tuning``)."""

from __future__ import annotations

from typing import Any

from oea.console import format_interval
from oea.report.context import ReportContext, md_table

EP = 8
BATCH = 16
ADAPTIVE_BATCHES = (1, 4, 16, 64)


def _traces(ctx: ReportContext) -> list[Any]:
    from oea.traces import load_trace

    traces = []
    if ctx.results.get("embedded_trace") is not None:
        traces.append(ctx.results["embedded_trace"])
    traces.append(load_trace("qwen3-30b-a3b"))
    return traces


def _adaptive_vs_fixed(ctx: ReportContext, trace: Any) -> tuple[str, dict]:
    """Fixed k0 = 1..k against calibrated k0(B) schedules, each averaged over ``ADAPTIVE_BATCHES``, with
    intervals combined over the batch sizes (``oea.stats.mean_of_estimates``)."""
    from oea.stats import mean_of_estimates, standard_error
    from oea.tuning.calibrate import ProxyPoint, adaptive_schedule
    from oea.tuning.compare import proxy_of
    from oea.tuning.recommend import measure_samples

    k = trace.spec.top_k
    sizes = [b for b in ADAPTIVE_BATCHES if b <= trace.num_tokens]
    num_batches = 2 if ctx.quick else 8
    samples = {s.batch_size: s for s in measure_samples(trace, sizes, list(range(1, k + 1)), num_batches, ctx.seed)}
    points = [ProxyPoint(b, k0, None, float(s.loss[k0].mean()), float(s.active[k0].mean()))
              for b, s in samples.items() for k0 in range(1, k + 1)]

    def averaged(k0_of: dict[int, int]) -> tuple[Any, Any]:
        per_batch = {name: [getattr(samples[b], name)[k0_of[b]].mean(0) for b in sizes] for name in ("loss", "active")}
        return tuple(mean_of_estimates([float(v.mean()) for v in values], [standard_error(v) for v in values],
                                       [v.size - 1 for v in values]) for values in per_batch.values())

    fixed = {k0: averaged({b: k0 for b in sizes}) for k0 in range(1, k + 1)}
    adaptive = {}
    for tolerance in (0.02, 0.05, 0.1, 0.2):
        cfg = adaptive_schedule(points, tolerance, k)
        adaptive[tolerance] = (cfg, averaged({b: cfg.k0_for(b) for b in sizes}))
    rows, dominated_fixed = [], 0
    for tolerance, (cfg, (loss, t)) in adaptive.items():
        beaten = [k0 for k0, (f_loss, f_t) in fixed.items() if f_loss.estimate >= loss.estimate
                  and f_t.estimate >= t.estimate]
        beaten_by = [k0 for k0, (f_loss, f_t) in fixed.items() if f_loss.estimate <= loss.estimate
                     and f_t.estimate <= t.estimate and (f_loss.estimate, f_t.estimate) != (loss.estimate, t.estimate)]
        dominated_fixed += len(beaten)
        schedule = " ".join(f"≤{b}:{k0}" for b, k0 in cfg.schedule)
        rows.append([f"adaptive (tol {tolerance})", schedule, format_interval(t.estimate, t.as_list()),
                     format_interval(loss.estimate, loss.as_list(), 4),
                     ", ".join(map(str, beaten)) or "—", ", ".join(map(str, beaten_by)) or "none"])
    for k0, (loss, t) in fixed.items():
        rows.append([f"fixed k0={k0}", "-", format_interval(t.estimate, t.as_list()),
                     format_interval(loss.estimate, loss.as_list(), 4), "", ""])
    proxy = proxy_of(trace)
    table = md_table(["policy", "schedule (B ≤ max: k0)", f"mean T over B∈{list(sizes)}", f"{proxy} (proxy)",
                      "dominates fixed k0", "dominated by fixed k0"], rows)

    def record(pair: tuple[Any, Any]) -> dict[str, Any]:
        return {proxy: pair[0].estimate, f"{proxy}_ci": pair[0].as_list(), "mean_active_experts": pair[1].estimate,
                "mean_active_experts_ci": pair[1].as_list()}

    return table, {"batch_sizes": sizes, "proxy": proxy, "fixed": {k0: record(v) for k0, v in fixed.items()},
                   "adaptive": {str(t): record(v[1]) for t, v in adaptive.items()},
                   "fixed_points_dominated": dominated_fixed}


def _matched_t_quality(ctx: ReportContext, results: dict[str, Any]) -> list[str]:
    """ΔCE of every policy at matched T on the embedded model (``oea compare-quality matched-t``)."""
    from oea.report import plots
    from oea.tuning.quality import matched_t_quality

    k0s = (3,) if ctx.quick else (2, 3, 4, 5)
    options = {"positions": 4, "num_batches": 1} if ctx.quick else {"positions": 32}
    lines = [f"### ΔCE at matched T (embedded model, B = {BATCH})", ""]
    try:
        rows = matched_t_quality(None, BATCH, k0s, generate_tokens=0, **options)
    except (ImportError, FileNotFoundError, ValueError, RuntimeError, OSError) as err:
        results["matched_t_quality"] = {"available": False, "reason": f"{type(err).__name__}: {err}"}
        return [*lines, f"**Not evaluated**: {type(err).__name__}: {err}", ""]
    results["matched_t_quality"] = rows
    path = plots.quality_pareto(rows, ctx.out / "policies_quality_pareto.png")
    return [
        *lines,
        "`oea compare-quality matched-t`: teacher-forced lock-step decode of held-out documents; budget and "
        "subtractive get OEA's measured T as their target. ΔCE is paired per document: ± is its 95% interval "
        "and the verdict the paired t-test (as in the quality section).",
        "",
        md_table(["policy", "k0 / target T", "T", "ΔCE vs vanilla", "verdict (paired)"],
                 [[r["policy"], r["k0"] if r.get("target_T") is None else f"T={r['target_T']}",
                   format_interval(r["mean_active_experts"], r["mean_active_experts_ci"]),
                   format_interval(r["delta_ce"], r["delta_ce_ci"], 4, signed=True), r["verdict"]] for r in rows]),
        "",
        ctx.plot(path),
        "",
    ]


def section_beyond(ctx: ReportContext) -> str:
    """Policies side by side at matched mean T (EP-aware OEA, budget, subtractive) and adaptive k0."""
    from oea.tuning.compare import DISAGREEMENT, PROXIES, compare_policies, pareto_front, plot_comparison

    lines = [
        "## Beyond the paper: every policy at matched T, expert parallelism, adaptive k0",
        "",
        "Budget (XShare-like) and subtractive (Lynx-like) are re-implementations from the papers' "
        "descriptions, given OEA's measured mean T at each k0 as their target (matched T). EP-aware OEA fills "
        f"each of {EP} devices up to the busiest device's count with experts tokens want (`oea.routing.ep`). "
        f"Quality proxy, lower is better: `lost_router_mass` = {PROXIES['lost_router_mass'][1]}; "
        f"`lost_topk_share` = {PROXIES['lost_topk_share'][1]}. Note: {DISAGREEMENT} (the ΔCE table below). "
        f"Mixed batches of B = {BATCH}; ± = 95% interval over batches.",
        "",
    ]
    results: dict[str, Any] = {}
    k0s = (2, 3) if ctx.quick else (1, 2, 3, 4, 5, 6, 7)
    traces = _traces(ctx)
    for trace in traces:
        layers = None if trace.num_layers <= 8 else list(range(0, trace.num_layers, trace.num_layers // 8))
        rows = compare_policies(trace, BATCH, k0s, EP, 2 if ctx.quick else 12, layers, seed=ctx.seed)
        front = {id(r) for r in pareto_front(rows, "max_device_active_experts")}
        path = ctx.out / f"policies_{trace.name}.png"
        plot_comparison(rows, str(path), EP)
        results[trace.name] = [r.as_dict() for r in rows]
        lines += [
            f"### {trace.name}" + ("" if layers is None else f" (layers {layers})"),
            "",
            md_table(["policy", "setting", "T", f"max T per device (EP={EP})", f"{rows[0].proxy} (proxy)",
                      "experts/token", "Pareto (device T)"],
                     [[r.policy, r.setting, format_interval(r.mean_active_experts, r.ci("mean_active_experts")),
                       format_interval(r.max_device_active_experts, r.ci("max_device_active_experts"), 2),
                       format_interval(r.proxy_loss, r.ci("proxy_loss"), 4),
                       format_interval(r.mean_experts_per_token, r.ci("mean_experts_per_token"), 2),
                       "★" if id(r) in front else ""] for r in rows]),
            "",
            ctx.plot(path),
            "",
        ]
    lines += _matched_t_quality(ctx, results)
    trace = traces[0]
    table, adaptive = _adaptive_vs_fixed(ctx, trace)
    results["adaptive"] = adaptive
    lines += [
        f"### Batch-size-adaptive k0 ({trace.name})",
        "",
        "Schedules calibrated with `oea calibrate adaptive` (smallest k0 within a proxy-loss tolerance at each "
        f"B), against fixed k0; each point averages B ∈ {adaptive['batch_sizes']} (batch sizes the trace's "
        "token pool allows), with its 95% interval combined over the batch sizes. A schedule dominates a fixed "
        "k0 when its mean T and proxy loss are both lower or equal (point estimates).",
        "",
        table,
        "",
    ]
    ctx.results["beyond"] = results
    return "\n".join(lines)
