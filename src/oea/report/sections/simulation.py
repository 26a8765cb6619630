"""Report section: active experts T of every registered policy on the bundled and captured traces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oea.console import format_interval
from oea.report.context import CORE_POLICIES, ReportContext, md_table


def _simulate_all(ctx: ReportContext, trace: Any, mode: str, batch_sizes: Sequence[int],
                  layers: Sequence[int] | None, label: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Core policies (the k0 grid at ``grid_batch_sizes``, ``curve_k0s`` elsewhere), other registered
    policies at ``extra_policy_k0s``; failures of an extra policy are returned as messages for the
    report, never hidden. k0 values above the trace's top-k are dropped."""
    from oea.routing import make_policy, policy_names
    from oea.sim import simulate

    s = ctx.sizes
    errors: list[str] = []
    ctx.results.setdefault("policies_needing_options", {})
    with ctx.progress(f"simulating {label}") as update:
        grid = [b for b in batch_sizes if b in s.grid_batch_sizes]
        rest = [b for b in batch_sizes if b not in s.grid_batch_sizes]
        rows = []
        for sizes, k0s in ((grid, s.k0s), (rest, s.curve_k0s)):
            k0s = [k0 for k0 in k0s if k0 <= trace.spec.top_k]
            if sizes:
                rows += simulate(trace, policies=CORE_POLICIES, k0s=k0s, batch_sizes=sizes, mode=mode,
                                 seed=ctx.seed, num_batches=s.num_batches, layers=layers, progress=update)
        rows.sort(key=lambda r: r["batch_size"])
    for name in policy_names():
        if name in CORE_POLICIES:
            continue
        try:
            make_policy(name, min(s.extra_policy_k0s[0], trace.spec.top_k))
        except (ValueError, TypeError) as err:  # needs policy-specific options: listed in the report
            ctx.results["policies_needing_options"][name] = str(err)
            continue
        try:
            with ctx.progress(f"simulating {label}: {name}") as update:
                extra_k0s = [k0 for k0 in s.extra_policy_k0s if k0 <= trace.spec.top_k]
                # with vanilla in the same call, the ratio to vanilla is paired by batch
                extra = simulate(trace, policies=("vanilla", name), k0s=extra_k0s, batch_sizes=batch_sizes,
                                 mode=mode, seed=ctx.seed, num_batches=s.num_batches, layers=layers,
                                 progress=update)
        except (ValueError, TypeError, RuntimeError) as err:
            errors.append(f"policy `{name}` could not be simulated on {label}: {type(err).__name__}: {err}")
            continue
        rows.extend(row for row in extra if row["policy"] != "vanilla")
    return rows, errors


def _t_table(rows: Sequence[dict[str, Any]], batch_size: int) -> str:
    chosen = sorted((r for r in rows if r["batch_size"] == batch_size),
                    key=lambda r: (r["policy"] != "vanilla", r["policy"], r["k0"] or 0))
    return md_table(
        ["policy", "k0", "T mean", "T p50", "T p95", "T / vanilla", "experts/token", "kept top-k", "kept mass"],
        [[r["policy"], r["k0"], format_interval(r["mean_active_experts"], r["mean_active_experts_ci"]),
          r["p50_active_experts"], r["p95_active_experts"],
          format_interval(r["active_ratio_vs_vanilla"], r["active_ratio_vs_vanilla_ci"], 2),
          format_interval(r["mean_experts_per_token"], r["mean_experts_per_token_ci"], 2),
          format_interval(r["kept_topk_share"], r["kept_topk_share_ci"], 2),
          format_interval(r["kept_mass"], r["kept_mass_ci"], 2)]
         for r in chosen],
    ) + f"\n\n± = 95% interval over the {chosen[0]['num_batches'] if chosen else 0} batches (t); T / vanilla: " \
        "ratio of means, bootstrap interval paired by batch."


def section_simulation(ctx: ReportContext) -> str:
    from oea.report import plots
    from oea.sim.costmodel import uniform_active_experts
    from oea.traces import load_trace

    s = ctx.sizes
    lines = ["## Simulated active experts", ""]
    qwen3 = load_trace("qwen3-30b-a3b")
    rows, errors = _simulate_all(ctx, qwen3, "mixed", s.batch_sizes, s.qwen3_layers, "qwen3-30b-a3b")
    ctx.results["simulation"] = {"qwen3-30b-a3b/mixed": rows}
    uniform = {b: uniform_active_experts(128, 8, b) for b in s.batch_sizes}
    layers_text = f"all {qwen3.num_layers}" if s.qwen3_layers is None else str(list(s.qwen3_layers))
    focus = 16 if 16 in s.batch_sizes else s.batch_sizes[-1]
    lines += [
        f"### Real Qwen3-30B-A3B routing (bundled trace, {qwen3.num_tokens} tokens, mixed batches)",
        "",
        f"{rows[0]['note']}. Layers: {layers_text}. "
        f"Uniform routing would give T = {uniform[focus]:.1f} at B = {focus}.",
        "",
        f"At B = {focus}:",
        "",
        _t_table(rows, focus),
        "",
        ctx.plot(plots.active_vs_batch(rows, s.curve_k0s,
                                       "Qwen3-30B-A3B trace: T vs batch size", ctx.out / "t_vs_batch_qwen3.png",
                                       uniform)),
        "",
        ctx.plot(plots.active_vs_k0(rows, focus, "Qwen3-30B-A3B trace", ctx.out / "t_vs_k0_qwen3.png")),
        "",
    ]
    embedded = ctx.results.get("embedded_trace")
    if embedded is not None:
        mixed_sizes = [b for b in s.batch_sizes if b <= embedded.num_tokens]
        lockstep_sizes = [b for b in s.batch_sizes if b <= s.capture_batch]
        emb_mixed, err_mixed = _simulate_all(ctx, embedded, "mixed", mixed_sizes, None, "embedded (mixed)")
        emb_lock, err_lock = _simulate_all(ctx, embedded, "lockstep", lockstep_sizes, None, "embedded (lockstep)")
        errors += err_mixed + err_lock
        ctx.results["simulation"]["embedded/mixed"] = emb_mixed
        ctx.results["simulation"]["embedded/lockstep"] = emb_lock
        lock_focus = max(lockstep_sizes)
        lines += [
            "### Embedded model (captured above, full router logits)",
            "",
            f"Lock-step batches (B requests at the same decode step, the real decode setting), B = {lock_focus}:",
            "",
            _t_table(emb_lock, lock_focus),
            "",
            ctx.plot(plots.active_vs_batch(emb_mixed, s.curve_k0s,
                                           "embedded model (mixed batches): T vs batch size",
                                           ctx.out / "t_vs_batch_embedded.png", uniform)),
            "",
        ]
    else:
        lines += ["### Embedded model", "", "**Skipped**: no captured trace (see the capture section above).", ""]
    flame = load_trace("flame-moe-290m")
    flame_sizes = [b for b in s.batch_sizes if b <= 64]
    flame_rows, flame_errors = _simulate_all(ctx, flame, "lockstep", flame_sizes, None, "flame-moe-290m")
    errors += flame_errors
    ctx.results["simulation"]["flame-moe-290m/lockstep"] = flame_rows
    lines += [
        "### FLAME-MoE-290M (natural 64-sequence batches, top-6 probabilities)",
        "",
        f"{flame_rows[0]['note']}. Nearly uniform expert popularity; the only bundled set with router "
        f"probabilities, hence `kept mass`. B = {min(16, max(flame_sizes))}:",
        "",
        _t_table(flame_rows, min(16, max(flame_sizes))),
        "",
    ]
    needing = ctx.results.get("policies_needing_options", {})
    if needing:
        lines += ["Registered policies not simulated here because they need policy-specific options "
                  "(`oea simulate --policies NAME --policy-option NAME:KEY=VALUE`):", ""]
        lines += [f"- `{name}`: {message}" for name, message in sorted(needing.items())] + [""]
    if errors:
        lines += ["**Policies that failed**:", ""] + [f"- {e}" for e in errors] + [""]
    ctx.results["simulation_errors"] = errors
    return "\n".join(lines)
