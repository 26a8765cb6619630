"""``oea doctor sglang`` inside .venv-sglang: the hook must show as live (real SGLang 0.5.23, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
from sglang_venv import run_checks, run_raw

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _sglang(report: dict[str, Any]) -> dict[str, Any]:
    assert [e["name"] for e in report["engines"]] == ["sglang"]
    return report["engines"][0]


def test_doctor_shows_hook_live_with_oea_on() -> None:
    code, report = run_checks("doctor", {"OEA_K0": "3"})
    engine = _sglang(report)
    checks = {c["name"]: c for c in engine["checks"]}
    assert code == 0 and report["ok"] and engine["ok"], engine
    assert engine["version"] == "0.5.23"
    for name in ("entry point registered", "entry point loads", "plugin system", "environment", "hooks live",
                 "self-test select_experts"):
        assert checks[name]["ok"], checks[name]
    assert "k0=3" in checks["environment"]["detail"]
    assert "equal to oea.route" in checks["self-test select_experts"]["detail"]
    assert any(name.startswith("hook target") and "_post_process_topk_ids" in name for name in checks)


def test_malformed_k0_stops_sglang_plugin_loading() -> None:
    proc = run_raw("bad-env", {"SGLANG_OEA_K0": "three"})
    assert proc.returncode != 0, proc.stdout
    assert "started" not in proc.stdout
    assert "SGLANG_OEA_K0 must be an integer" in proc.stderr, proc.stderr[-2000:]
