"""Report section: held-out cross-entropy of the embedded model under each policy (``oea.eval``)."""

from __future__ import annotations

import inspect
import time

from oea.console import format_interval, format_p_value
from oea.report.context import CORE_POLICIES, ReportContext, md_table


def section_quality(ctx: ReportContext) -> str:
    from oea.report import plots

    lines = ["## Quality (held-out cross-entropy of the embedded model)", ""]
    try:
        from oea.eval import evaluate
    except ImportError as err:
        ctx.results["quality"] = {"available": False, "reason": f"ImportError: {err}"}
        lines.append(f"**Not evaluated**: `oea.eval.evaluate` is not importable ({err}). Without it this "
                     f"report shows routing statistics and predicted latency only, no quality numbers.")
        return "\n".join(lines)
    s = ctx.sizes
    accepted = inspect.signature(evaluate).parameters
    options = {key: value for key, value in s.eval_options if key in accepted}
    started = time.perf_counter()
    try:
        rows = evaluate(model=None, batch_sizes=list(s.eval_batch_sizes), k0s=list(s.eval_k0s),
                        policies=list(CORE_POLICIES), **options)
    except (ValueError, FileNotFoundError, RuntimeError, OSError, TypeError) as err:
        ctx.results["quality"] = {"available": False, "reason": f"{type(err).__name__}: {err}"}
        lines.append(f"**Evaluation failed**: {type(err).__name__}: {err}")
        return "\n".join(lines)
    seconds = time.perf_counter() - started
    from oea.eval.summary import PAPER_RULE, VERDICT_RULE

    ctx.results["quality"] = {"available": True, "rows": rows, "seconds": seconds}
    lines += [
        f"`oea.eval.evaluate(model=None, batch_sizes={list(s.eval_batch_sizes)}, k0s={list(s.eval_k0s)}, "
        f"policies={list(CORE_POLICIES)}{''.join(f', {k}={v}' for k, v in options.items())})`: teacher-forced "
        f"lock-step decode of held-out documents; {seconds:.0f} s. ± = 95% interval: cross-entropy over "
        f"documents, ΔCE over per-document differences to vanilla (paired), T over decode steps.",
        "",
        f"Verdict: {VERDICT_RULE}; \"worse\" or \"better\" when the interval of ΔCE excludes 0, else \"no "
        f"significant difference\" (\"identical\" where every document's CE equals vanilla's: no test). "
        f"The paper's rule is shown beside it for comparison ({PAPER_RULE}): it "
        f"ignores that both policies see the same documents and cannot detect losses smaller than the "
        f"document-to-document spread.",
        "",
        md_table(["policy", "k0", "B", "cross-entropy", "ΔCE vs vanilla", "p", "verdict (paired)", "paper rule",
                  "T", "T / vanilla"],
                 [[r["policy"], r["k0"], r["batch_size"], format_interval(r["cross_entropy"], r["cross_entropy_ci"], 3),
                   format_interval(r["delta_ce"], r["delta_ce_ci"], 3, signed=True), format_p_value(r["delta_p_value"]),
                   r["verdict"], r["paper_verdict"],
                   format_interval(r["mean_active_experts"], r["mean_active_experts_ci"]),
                   format_interval(r["active_vs_vanilla"], r["active_vs_vanilla_ci"], 2)] for r in rows]),
        "",
    ]
    if rows and all("mean_active_experts" in r and "cross_entropy" in r for r in rows):
        lines.append(ctx.plot(plots.quality_pareto(rows, ctx.out / "quality_pareto.png")))
    return "\n".join(lines)
