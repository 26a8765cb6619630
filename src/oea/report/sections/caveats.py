"""The report's closing section: what the figures above do not show."""

from __future__ import annotations

from oea.report.context import ReportContext


def section_caveats(ctx: ReportContext) -> str:
    return "\n".join([
        "## Caveats",
        "",
        "- The Qwen3 trace is prefill of about 4 ShareGPT prompts (ids only): mixed batches from it are less "
        "diverse than 16 independent requests, so its vanilla T (≈ 65 at B = 16) is a lower bound; OEA there "
        "can piggyback only within each token's recorded top-8 (the paper's conservative max_rank = k "
        "variant), so its experts-per-token is an underestimate.",
        "- FLAME-MoE is a small, nearly load-balanced research model: its T is close to uniform routing.",
        "- Predicted latencies use datasheet peaks and a fixed per-layer overhead fitted to the paper's H100 "
        "table; absolute values are optimistic, ratios are the robust output. The CPU preset is used only "
        "when the layer benchmark has written its measured fit.",
        "- Licences and sources of every bundled trace: `oea traces NAME` and `traces/SOURCES.md` of the "
        "oea-lab-data package (`packages/oea-lab-data/src/oea_lab_data/`).",
    ])
