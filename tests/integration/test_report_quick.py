"""``oea report --quick`` end to end: files, sections, plots, and visible notes on missing parts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("report")
    done = subprocess.run(
        [sys.executable, "-m", "oea", "report", "--quick", "--out", str(out), "--threads", "1"],
        capture_output=True, text=True, timeout=600,
    )
    return out, done


def test_report_writes_markdown_plots_and_results(quick_report) -> None:
    out, done = quick_report
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "report.md").read_text()
    for heading in ("# OEA what-if report", "## 2. Simulated active experts", "## 3. Quality",
                    "## 4. Predicted MoE-layer latency", "## 5. Roofline", "## 6. Beyond the paper", "## 7. Caveats"):
        assert heading in text  # numbered by the driver, in order, no gaps
    assert "± = 95% interval" in text and "paired t-test" in text
    for plot in ("t_vs_batch_qwen3.png", "t_vs_k0_qwen3.png", "latency_vs_batch.png"):
        assert (out / plot).stat().st_size > 1000, plot
        assert f"({plot})" in text
    results = json.loads((out / "results.json").read_text())
    rows = results["results"]["simulation"]["qwen3-30b-a3b/mixed"]
    by = {(r["policy"], r["k0"], r["batch_size"]): r for r in rows}
    assert by[("oea", 2, 16)]["mean_active_experts"] == by[("pruned", 2, 16)]["mean_active_experts"]
    assert by[("oea", 2, 16)]["mean_active_experts"] < by[("vanilla", None, 16)]["mean_active_experts"]
    assert "wrote" in done.stdout and "Qwen3-30B-A3B trace" in done.stdout


def test_report_shows_the_whole_decode_step_beside_the_moe_layer(quick_report) -> None:
    out, done = quick_report
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "report.md").read_text()
    step = text[text.index("### 4.1 The whole decode step (qwen3-30b-a3b on h100-sxm)"):text.index("## 5. Roofline")]
    assert "2048 cached tokens per request" in step and "upper bounds" in step
    rows = {r["batch_size"]: r for r in json.loads((out / "results.json").read_text())["results"]["latency_step"]}
    assert sorted(rows) == [1, 4, 16]  # the quick sizes
    r = rows[16]
    assert (r["model"], r["gpu"], r["tp"]) == ("qwen3-30b-a3b", "h100-sxm", 1)
    assert 0.5 < r["moe_share_of_step"] < 1 and 0 < r["predicted_step_gain_k0_3"] < r["predicted_gain_k0_3"]
    assert f"| 16 | {r['step_attention_us']:.0f} |" in step and f"{100 * r['moe_share_of_step']:.0f}%" in step


def test_report_states_missing_capture_or_quality_visibly(quick_report) -> None:
    out, _ = quick_report
    text = (out / "report.md").read_text()
    results = json.loads((out / "results.json").read_text())["results"]
    if not results["capture"]["available"]:
        assert "**Not captured**" in text
    else:
        assert "embedded-trace.safetensors" in text and (out / "embedded-trace.safetensors").is_file()
    if not results["quality"]["available"]:
        assert "**Not evaluated**" in text or "**Evaluation failed**" in text
        assert results["quality"]["reason"] in text
    else:
        assert "cross-entropy" in text


def test_registered_sections_run_in_order_and_failures_show_in_the_report(tmp_path: pathlib.Path) -> None:
    from oea.report import build

    saved = list(build.SECTIONS)
    try:
        build.SECTIONS[:] = [(n, f) for n, f in saved if n == "overview"]
        build.register_section("extra", lambda ctx: "## Extra test section\n\nhello")
        build.register_section("broken", lambda ctx: 1 / 0, before="extra")
        ctx = build.build_report(tmp_path, quick=True)
    finally:
        build.SECTIONS[:] = saved
    text = (tmp_path / "report.md").read_text()
    # the failed section's heading is numbered 1, the extra one 2: the driver numbers every section in order
    assert text.index("# OEA what-if report") < text.index("## 1. broken") < text.index("ZeroDivisionError") < \
        text.index("## 2. Extra test section")
    assert "**This section failed**" in text
    assert ctx.results["section_errors"] == ["broken: ZeroDivisionError: division by zero"]
    with pytest.raises(ValueError, match="before must be one of"):
        build.register_section("x", lambda ctx: "", before="nope")
    with pytest.raises(ValueError, match="already registered"):
        build.register_section("overview", lambda ctx: "")


def test_report_compares_every_policy_at_matched_t_and_under_ep(quick_report) -> None:
    out, done = quick_report
    assert done.returncode == 0, done.stderr[-3000:]
    text = (out / "report.md").read_text()
    assert "## 6. Beyond the paper" in text and "### 6.4 Batch-size-adaptive k0" in text
    assert (out / "policies_qwen3-30b-a3b.png").stat().st_size > 1000
    beyond = json.loads((out / "results.json").read_text())["results"]["beyond"]
    rows = beyond["qwen3-30b-a3b"]
    assert {r["policy"] for r in rows} >= {"vanilla", "pruned", "oea", "ep-oea", "budget", "subtractive"}
    by = {(r["policy"], r["setting"]): r for r in rows}
    plain, ep_aware = by[("oea", "k0=2")], by[("ep-oea", "k0=2")]
    assert ep_aware["max_device_active_experts"] == plain["max_device_active_experts"]
    assert plain["proxy"] == "lost_topk_share"  # the Qwen3 trace records ids only
    assert ep_aware["lost_topk_share"] <= plain["lost_topk_share"]
    assert beyond["adaptive"]["fixed"]  # fixed-k0 points were measured
