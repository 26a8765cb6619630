"""Run ``sglang_cpu_checks.py`` or the ``oea`` command inside .venv-sglang (shared by the SGLang engine tests)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from engine_venvs import ROOT, VENVS, engine_python

SGLANG_PYTHON = VENVS["sglang"][0]
SGLANG_OEA = SGLANG_PYTHON.parent / "oea"
CHECKS = ROOT / "tests" / "engines" / "sglang_cpu_checks.py"
SGLANG_VERSION = "0.5.23"  # the release the checks scripts drive (scripts/install_sglang_cpu.sh installs it)


def _run(argv: list[str], extra_env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    """``argv`` with a clean ``OEA_*``/``SGLANG_*`` environment (a missing .venv-sglang: ``engine_python``)."""
    engine_python("sglang")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OEA_", "SGLANG_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    env.update(extra_env or {})
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def run_raw(mode: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``sglang_cpu_checks.py <mode>`` in .venv-sglang."""
    return _run([str(SGLANG_PYTHON), str(CHECKS), mode], extra_env)


def run_oea(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``oea`` console script of .venv-sglang, as a user runs it there (no test code in the process)."""
    return _run([str(SGLANG_OEA), *args], extra_env)


def run_checks(mode: str, extra_env: dict[str, str] | None = None) -> tuple[int, Any]:
    """``sglang_cpu_checks.py <mode>`` in .venv-sglang -> (exit code, parsed stdout JSON)."""
    proc = run_raw(mode, extra_env)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{mode}: exit {proc.returncode}, no JSON on stdout\nstdout: {proc.stdout[-2000:]}\n"
                    f"stderr: {proc.stderr[-4000:]}")


def passed_checks(mode: str) -> dict[str, Any]:
    """The report of ``run_checks(mode)``, failing the test when the checks script did not exit 0."""
    code, report = run_checks(mode)
    assert code == 0, report
    return report


def check(report: dict[str, Any], name: str) -> dict[str, Any]:
    """The check called ``name`` in a checks script's report (a test failure naming the ones that ran if absent)."""
    found = [c for c in report["checks"] if c["name"] == name]
    assert found, f"check {name!r} did not run; ran: {[c['name'] for c in report['checks']]}"
    return found[0]


def run_script_json(script: Path, args: list[str], extra_env: dict[str, str] | None = None
                    ) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Another check script of tests/engines in .venv-sglang -> (the process, its parsed stdout JSON or None)."""
    proc = _run([str(SGLANG_PYTHON), str(script), *args], extra_env)
    try:
        return proc, json.loads(proc.stdout)
    except json.JSONDecodeError:
        return proc, None


def checks_fixture(mode: str, name: str | None = None) -> Any:
    """A module-scoped fixture (called ``name``, default ``mode``): the report of ``passed_checks(mode)``, so that
    each checks script runs once per test module."""

    def report() -> dict[str, Any]:
        return passed_checks(mode)

    return pytest.fixture(scope="module", name=name or mode)(report)


def assert_every_check_passed(report: dict[str, Any]) -> None:
    """No check of ``report`` failed, and the checks ran on ``SGLANG_VERSION``."""
    failed = [c for c in report["checks"] if not c["ok"]]
    assert not failed, failed
    assert report["sglang_version"] == SGLANG_VERSION
