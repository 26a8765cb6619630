"""``oea doctor sglang`` in .venv-sglang, run as a user runs it: the venv's ``oea`` console script,
no test code in the process, nothing stubbed (real SGLang 0.5.23 on CPU and the dependencies
scripts/install_sglang_cpu.sh installs, torchvision included)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sglang_venv import run_oea, run_raw

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CHECKS_BEFORE_SELF_TEST = (
    "version", "environment", "entry point registered", "entry point loads", "imports", "plugin system",
)


def _sglang(report: dict[str, Any]) -> dict[str, Any]:
    assert [e["name"] for e in report["engines"]] == ["sglang"]
    return report["engines"][0]


def test_doctor_passes_as_a_user_runs_it() -> None:
    proc = run_oea(["doctor", "sglang"])  # OEA off: the self-test still routes through select_experts
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "sglang 0.5.23: OK", proc.stdout
    assert lines[-1] == "oea doctor: all installed engines OK", proc.stdout
    assert not [line for line in lines if "[FAIL]" in line], proc.stdout
    assert any(line.startswith("  [ok] hooks live: OEA off") for line in lines), proc.stdout
    assert any(line.startswith("  [ok] self-test select_experts:") and "equal to oea.route" in line
               for line in lines), proc.stdout
    assert any(line.startswith("  [ok] cuda-graph padding: OEA off; with OEA_K0 set, OEA's replay count "
                               "(DecodeCudaGraphRunner.load_batch, CPUGraphRunner.prepare_replay)")
               for line in lines), proc.stdout


def test_doctor_shows_hook_live_with_oea_on() -> None:
    proc = run_oea(["doctor", "sglang", "--json"], {"OEA_K0": "3"})
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"exit {proc.returncode}, no JSON on stdout\nstdout: {proc.stdout[-2000:]}\n"
                    f"stderr: {proc.stderr[-4000:]}")
    engine = _sglang(report)
    checks = {c["name"]: c for c in engine["checks"]}
    assert proc.returncode == 0 and report["ok"] and engine["ok"], engine
    assert engine["version"] == "0.5.23"
    for name in (*CHECKS_BEFORE_SELF_TEST, "hooks live", "self-test select_experts"):
        assert checks[name]["ok"], checks[name]
    assert "k0=3" in checks["environment"]["detail"]
    assert "equal to oea.route" in checks["self-test select_experts"]["detail"]
    assert any(name.startswith("hook target") and "_post_process_topk_ids" in name for name in checks)
    padding = checks["cuda-graph padding"]  # which mechanism bounds CUDA-graph padding rows here
    assert padding["ok"] and padding["detail"].startswith("OEA's replay count (DecodeCudaGraphRunner.load_batch, "
                                                          "CPUGraphRunner.prepare_replay hooked)"), padding
    assert "num_token_non_padded" in padding["detail"], padding


def test_malformed_k0_stops_sglang_plugin_loading() -> None:
    proc = run_raw("bad-env", {"SGLANG_OEA_K0": "three"})
    assert proc.returncode != 0, proc.stdout
    assert "started" not in proc.stdout
    assert "SGLANG_OEA_K0 must be an integer" in proc.stderr, proc.stderr[-2000:]
