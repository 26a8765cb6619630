"""Report section 3: held-out cross-entropy of the embedded model under each policy (``oea.eval``)."""

from __future__ import annotations

import inspect
import time

from oea.report.context import CORE_POLICIES, ReportContext, md_table


def section_quality(ctx: ReportContext) -> str:
    from oea.report import plots

    lines = ["## 3. Quality (held-out cross-entropy of the embedded model)", ""]
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
    ctx.results["quality"] = {"available": True, "rows": rows, "seconds": seconds}
    lines += [
        f"`oea.eval.evaluate(model=None, batch_sizes={list(s.eval_batch_sizes)}, k0s={list(s.eval_k0s)}, "
        f"policies={list(CORE_POLICIES)}{''.join(f', {k}={v}' for k, v in options.items())})`: teacher-forced "
        f"lock-step decode of held-out documents; {seconds:.0f} s. Verdict: the paper's standard-error rule.",
        "",
        md_table(["policy", "k0", "B", "cross-entropy", "stderr", "Δ vs vanilla", "paired SE", "T", "verdict"],
                 [[r.get("policy"), r.get("k0"), r.get("batch_size"), r.get("cross_entropy"), r.get("stderr"),
                   _signed(r.get("delta_ce")), _signed(r.get("delta_stderr")), r.get("mean_active_experts"),
                   r.get("verdict")] for r in rows]),
        "",
    ]
    if rows and all("mean_active_experts" in r and "cross_entropy" in r for r in rows):
        lines.append(ctx.plot(plots.quality_pareto(rows, ctx.out / "quality_pareto.png")))
    return "\n".join(lines)


def _signed(value: float | None) -> str | None:
    return None if value is None else f"{value:+.3f}"
