"""The report's first sections: the overview and the trace captured from the embedded model."""

from __future__ import annotations

import datetime
import platform

import torch

from oea.report.context import ReportContext


def section_overview(ctx: ReportContext) -> str:
    from oea import __version__
    from oea.routing import policy_names

    return "\n".join([
        "# OEA what-if report",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by `oea report"
        f"{' --quick' if ctx.quick else ''}` (oea {__version__}, torch {torch.__version__}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads, seed {ctx.seed}).",
        "",
        "Opportunistic Expert Activation (arXiv:2511.02237): each token keeps its own top-k0 experts; the "
        "union over the decode batch (T experts) is loaded; tokens then fill their remaining slots with "
        "experts already loaded. MoE decode is memory-bound, so fewer active experts T means less weight "
        "traffic per step.",
        "",
        f"Registered policies: {', '.join(policy_names())}. Sizes: batch sizes {list(ctx.sizes.batch_sizes)}, "
        f"k0 {list(ctx.sizes.curve_k0s)} at every batch size and {list(ctx.sizes.k0s)} at B = "
        f"{list(ctx.sizes.grid_batch_sizes)}, {ctx.sizes.num_batches} batches per batch size (all layers "
        f"unless stated).",
    ])


def section_capture(ctx: ReportContext) -> str:
    from oea.traces import save_trace
    from oea.traces.capture import capture_embedded

    lines = ["## Trace captured from the embedded model", ""]
    s = ctx.sizes
    try:
        trace = capture_embedded(s.capture_batch, s.capture_prompt_tokens, s.capture_new_tokens, ctx.seed)
    except (ImportError, FileNotFoundError, ValueError, OSError) as err:
        ctx.results["capture"] = {"available": False, "reason": f"{type(err).__name__}: {err}"}
        lines.append(f"**Not captured**: {type(err).__name__}: {err}. The sections below use the bundled "
                     f"real traces only.")
        return "\n".join(lines)
    path = save_trace(trace, ctx.out / "embedded-trace.safetensors")
    ctx.results["embedded_trace"] = trace
    ctx.results["capture"] = {"available": True, "path": str(path), "tokens": trace.num_tokens,
                              "layers": trace.num_layers}
    lines.append(
        f"Lock-step greedy decode of {s.capture_batch} held-out documents together ({s.capture_prompt_tokens} "
        f"prompt tokens each, {s.capture_new_tokens} decode steps recorded): {trace.num_tokens} tokens × "
        f"{trace.num_layers} MoE layers × {trace.spec.num_experts} experts of full router logits, written to "
        f"`{path.name}` (replay it with `oea simulate --trace {path}`)."
    )
    return "\n".join(lines)
