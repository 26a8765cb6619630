"""Report sections: predicted MoE-layer latency of several deployments, the whole decode step of the report's
default model, and the roofline."""

from __future__ import annotations

from typing import Any

from oea.console import format_interval
from oea.report.context import ReportContext, md_table

# (model preset, gpu preset, tp, ep) deployments whose latency the report predicts
DEPLOYMENTS: tuple[tuple[str, str, int, int], ...] = (
    ("qwen3-30b-a3b", "h100-sxm", 1, 1),
    ("qwen3-235b-a22b", "h100-sxm", 8, 1),
    ("glm-5", "rtx-pro-6000", 8, 1),
    ("deepseek-v3", "h200", 1, 8),
)
STEP_DEPLOYMENT: tuple[str, str, int, int] = DEPLOYMENTS[0]
"""The report's default model (the bundled trace's) on its accelerator: the one whose whole decode step is shown."""


def section_latency(ctx: ReportContext) -> str:
    from oea.presets import get_gpu_preset
    from oea.report import plots
    from oea.sim.roofline import TraceRef, roofline_from_table, table_from_rows

    s = ctx.sizes
    rows = ctx.results["simulation"]["qwen3-30b-a3b/mixed"]
    table = table_from_rows(rows)
    ref = TraceRef("qwen3-30b-a3b", 128, 8)
    k0s = list(s.curve_k0s)
    lines = [
        "## Predicted MoE-layer latency",
        "",
        "Cost model (paper §3.1): per layer `fixed + b·T + a·(token slots)`, b = expert bytes / memory bandwidth, "
        "a = expert FLOPs per token / tensor-core peak (datasheet peaks; tensor parallel adds an all-reduce, "
        "expert parallel follows the busiest device). T comes from the Qwen3 trace above; for models with "
        "another N or k it is scaled as T_uniform(model) × T_trace / T_uniform(trace). Against the paper's "
        "own measurements (Qwen3-30B-A3B on H100: 175.7 µs vanilla, 106.8 µs OEA k0=3) the model predicts "
        "the slope b within 5%.",
        "",
    ]
    deployments = list(DEPLOYMENTS)
    cpu = get_gpu_preset("cpu")
    if cpu.measured and cpu.fit is not None:
        deployments.append((cpu.fit.preset, "cpu", 1, 1))  # the model the CPU fit was measured on
        lines += [f"CPU (this machine): {cpu.source}.", ""]
    else:
        lines += [f"CPU (this machine): {cpu.source}.", ""]
    summary, curves, all_rows = [], {}, []
    for model, gpu, tp, ep in deployments:
        roof = roofline_from_table(model, gpu, tp, ep, s.batch_sizes, k0s, table, ref)
        all_rows += roof
        title = f"{model} on {gpu}" + (f" TP{tp}" if tp > 1 else "") + (f" EP{ep}" if ep > 1 else "")
        curve = {"vanilla": [(r["batch_size"], r["latency_vanilla_us"]) for r in roof]}
        for k0 in k0s:
            curve[f"oea k0={k0}"] = [(r["batch_size"], r[f"latency_oea_k0_{k0}_us"]) for r in roof
                                     if r[f"latency_oea_k0_{k0}_us"] is not None]
        curves[title] = curve
        for r in roof:
            if r["batch_size"] in (16, 64) or r["batch_size"] == s.batch_sizes[-1]:
                vanilla_t = format_interval(r["trace_vanilla_active_experts"], r["trace_vanilla_active_experts_ci"])
                summary.append([title, r["batch_size"], r["bound"], vanilla_t,
                                format_interval(r["latency_vanilla_us"], r["latency_vanilla_us_ci"])]
                               + [v for k0 in k0s for v in (
                                   format_interval(r[f"latency_oea_k0_{k0}_us"], r[f"latency_oea_k0_{k0}_us_ci"]),
                                   _pct(r[f"predicted_gain_k0_{k0}"], r[f"predicted_gain_k0_{k0}_ci"]))])
    ctx.results["latency"] = all_rows
    lines += [
        "± / [...] = 95% interval from the trace's T (over simulated batches); under EP the busiest device's "
        "T has no interval here. The cost model itself has none: it is a prediction, not a measurement.",
        "",
        md_table(["deployment", "B", "bound", "T vanilla", "vanilla µs"]
                 + [h for k0 in k0s for h in (f"OEA k0={k0} µs", f"gain k0={k0}")], _dedupe(summary)),
        "",
        ctx.plot(plots.latency_vs_batch(curves, ctx.out / "latency_vs_batch.png")),
        "",
    ]
    model, gpu, tp, ep = STEP_DEPLOYMENT
    step_rows = [r for r in all_rows if (r["model"], r["gpu"], r["tp"], r["ep"]) == (model, gpu, tp, ep)]
    ctx.results["latency_step"] = step_rows
    lines += step_lines(step_rows, k0s)
    return "\n".join(lines)


def step_lines(rows: list[dict[str, Any]], k0s: list[int]) -> list[str]:
    """Markdown: the whole decode step (``oea.sim.step``'s ``step_*`` fields of ``roofline_from_table`` rows of
    one deployment) beside the MoE layer's latency and gain, with the step model's assumptions."""
    first = rows[0]
    title = f"{first['model']} on {first['gpu']}" + (f" TP{first['tp']}" if first["tp"] > 1 else "")
    lines = [f"### The whole decode step ({title})", ""]
    if first["step_note"] is not None:
        return [*lines, f"{first['step_note']}.", ""]
    link = (f"the all-reduce over {first['interconnect']} ({first['interconnect_GBps']:g} GB/s, "
            f"{first['interconnect_latency_us']:g} µs per all-reduce)" if first["tp"] > 1 else "no all-reduce (TP1)")
    lines += [
        "OEA shrinks only the routed experts' weight reads; what a TPOT measurement sees is the whole decode step "
        "(`oea.sim.step`, the figures of `oea roofline`): per TP rank, summed over the layers, "
        "step = L·(attention + KV cache) + L_dense·dense MLP + L_moe·(shared + routed experts) + 2·L·all-reduce "
        "+ lm_head, so the step gain is about the routed experts' share of the step times the layer gain. "
        f"Assumptions: {first['context_len']} cached tokens per request, {link}, datasheet peaks, memory and "
        "compute times added (no overlap), a fixed per-layer cost for the routed experts only; norms, rotary, the "
        "router's gate, sampling and the embedding lookup are not counted. Every one of these makes the rest of "
        "the step shorter than on a real server, so the MoE share and the step gain are upper bounds.",
        "",
    ]
    headers = ["B", "attention µs", "KV cache µs", "dense+shared MLP µs", "all-reduce µs", "lm_head µs",
               "routed experts µs", "step µs (vanilla)", "MoE share"]
    for k0 in k0s:
        headers += [f"layer gain k0={k0}", f"step µs OEA k0={k0}", f"step gain k0={k0}"]
    table = []
    for r in rows:
        cells: list[Any] = [r["batch_size"], f"{r['step_attention_us']:.0f}", f"{r['step_kv_cache_us']:.0f}",
                            f"{r['step_dense_mlp_us'] + r['step_shared_experts_us']:.0f}",
                            f"{r['step_all_reduce_us']:.0f}", f"{r['step_lm_head_us']:.0f}",
                            f"{r['step_routed_experts_vanilla_us']:.0f}",
                            format_interval(r["step_latency_vanilla_us"], r["step_latency_vanilla_us_ci"], 0),
                            f"{100 * r['moe_share_of_step']:.0f}%"]
        for k0 in k0s:
            step_oea = r[f"step_latency_oea_k0_{k0}_us"]
            cells += [_pct(r[f"predicted_gain_k0_{k0}"], r[f"predicted_gain_k0_{k0}_ci"]),
                      None if step_oea is None else
                      format_interval(step_oea, r[f"step_latency_oea_k0_{k0}_us_ci"], 0),
                      _pct(r[f"predicted_step_gain_k0_{k0}"], r[f"predicted_step_gain_k0_{k0}_ci"])]
        table.append(cells)
    return [*lines, md_table(headers, table), ""]


def _pct(value: float | None, ci: list[float] | None = None) -> str | None:
    if value is None:
        return None
    return format_interval(100 * value, None if ci is None else [100 * c for c in ci], 0) + "%"


def _dedupe(rows: list[list[Any]]) -> list[list[Any]]:
    seen, out = set(), []
    for row in rows:
        key = (row[0], row[1])
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def section_roofline(ctx: ReportContext) -> str:
    from oea.sim.roofline import TraceRef, roofline_from_table, table_from_rows

    table = table_from_rows(ctx.results["simulation"]["qwen3-30b-a3b/mixed"])
    ref = TraceRef("qwen3-30b-a3b", 128, 8)
    sizes = [*ctx.sizes.batch_sizes, 1024, 8192]
    rows = roofline_from_table("glm-5", "rtx-pro-6000", 8, 1, sizes, (), table, ref)
    ctx.results["roofline"] = rows
    first = rows[0]
    return "\n".join([
        "## Roofline: when does OEA help? (GLM-5, NVFP4, 8× RTX PRO 6000, TP8)",
        "",
        f"Ridge point {first['ridge_point_flops_per_byte']:.0f} FLOP/byte; loading one expert share costs "
        f"b = {first['expert_load_us']:.2f} µs, one token slot a = {first['token_compute_us']:.4f} µs. "
        f"MoE decode stays memory-bound until the arithmetic intensity 2·B·k/(T·bytes per weight) reaches the "
        f"ridge point, so the gain follows T. (`oea roofline --model glm-5 --gpu rtx-pro-6000 --tp 8` prints "
        f"the full table with OEA T.)",
        "",
        md_table(["B", "T uniform", "T trace (scaled)", "FLOP/byte", "bound", "memory µs", "compute µs"],
                 [[r["batch_size"], r["uniform_active_experts"],
                   format_interval(r["trace_vanilla_active_experts"], r["trace_vanilla_active_experts_ci"]),
                   r["arithmetic_intensity"], r["bound"], r["memory_us"], r["compute_us"]] for r in rows]),
    ])
