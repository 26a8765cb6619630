"""``scripts/gpu_check.sh`` cannot rot: its CPU dry run end to end (doctor first, every step, one JSON whose
top-level fields are the documented ones), its device-time estimate at the default settings within 8 minutes
on one H100/H200 (estimated from its own step counts with ``gpu_check_budget.UNIT_COSTS``, assumed, not
measured: no GPU here), and a failing step named with a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from project_scripts import load_script

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


def _sh(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_gpu_check_sh_dry_run_on_cpu_writes_every_documented_field(tmp_path: Path) -> None:
    proc = _sh(tmp_path, "--device", "cpu", "--dry-run", "--threads", "1", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("oea doctor gpu: no CUDA here") and "accepted (--allow-cpu)" in lines[0]
    assert lines[1].startswith("estimated device time at these settings: ")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    fields = load_script("gpu_check").JSON_FIELDS
    assert list(report) == [f for f in fields if f in report] and set(report) == set(fields)
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert [f for f in fields if f"| `{f}` |" not in docs] == []
    assert report["ok"] and report["failed_steps"] == [] and report["doctor"]["cuda"] is False
    assert list(report["steps"]) == ["0 fast routing", "1 graph vs eager", "2 layer benchmark", "3 decode benchmark"]
    assert all(step["ok"] and step["wall_s"] >= 0 for step in report["steps"].values())
    assert report["estimate"]["steps"]["0 fast routing"]["counts"]["cases"] == 50


def test_gpu_check_sh_without_cuda_fails_at_the_doctor_step(tmp_path: Path) -> None:
    proc = _sh(tmp_path)
    assert proc.returncode == 1
    assert "gpu_check: FAILED step doctor: oea doctor gpu exited 1" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_gpu_check_default_device_time_fits_8_minutes_on_one_h100() -> None:
    gpu_check, budget, routing = (load_script(name) for name in ("gpu_check", "gpu_check_budget", "gpu_check_routing"))
    estimate = budget.estimate(gpu_check.parse_args([]), gpu_check, routing)
    assert estimate["fits"] and estimate["total_s"] <= 480.0 == estimate["budget_s"], budget.summary_line(estimate)
    counts = {name: step["counts"] for name, step in estimate["steps"].items()}
    assert counts["0 fast routing"]["cases"] == 10000 and counts["0 fast routing"]["specialisations"] >= 20
    assert counts["2 layer benchmark"]["runs"] == 3 and counts["3 decode benchmark"]["captures"] == 12
    longer = budget.estimate(gpu_check.parse_args(["--repeats", "5000", "--fast-cases", "200"]), gpu_check, routing)
    assert longer["steps"]["2 layer benchmark"]["counts"]["calls"] > 20 * counts["2 layer benchmark"]["calls"]
    assert longer["steps"]["0 fast routing"]["counts"]["cases"] == 200
    assert not longer["fits"] and "EXCEEDS the 480 s budget" in budget.summary_line(longer)


def test_a_failing_step_is_named_and_the_exit_is_non_zero(tmp_path, monkeypatch, capsys) -> None:
    gpu_check = load_script("gpu_check")

    def broken(device):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(gpu_check, "check_graph_routing", broken)
    monkeypatch.setattr(gpu_check, "bench_runs", lambda *a: [])  # steps 2 and 3 have their own tests
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--device", "cpu", "--dry-run", "--threads", "1", "--repeats", "1", "--skip-decode"]) == 1
    err = capsys.readouterr().err
    assert ("gpu_check: FAILED step 1 graph vs eager: RuntimeError: CUDA error: operation not permitted when stream "
            "is capturing") in err
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed_steps"] == ["1 graph vs eager"] and not report["ok"]
    assert report["steps"]["0 fast routing"]["ok"] and report["steps"]["2 layer benchmark"]["ok"]
