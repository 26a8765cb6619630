"""A whole soak: every arm in turn (its server started, soaked and stopped, or a running server attached
to), then what must hold across the arms and in each arm's metrics and trace.

Returns ``{"arms": {name: report}, "checks": [check, ...], "off": arm or None, "held": bool}`` (``held``: every
check of the verdict held; ``off``: the OEA-off arm memory growth is judged against); with ``out_dir`` each
arm's report (every request's outcome included) goes to ``<arm>.json`` and the summary to ``soak.json``.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oea.soak.checks import Check, across_arms, arm_checks, metrics_checks, off_arm, read_metrics, trace_checks
from oea.soak.monitor import SoakError, identify
from oea.soak.runner import SoakConfig, soak_server
from oea.soak.servers import Arm, model_arg, process_group, router_shape, start, stop, wait


def trace_numbered(rows: Sequence[dict[str, Any]], engine: str) -> list[dict[str, Any]]:
    """The metrics rows with each decode row's ``step`` as the trace numbers it.

    vLLM's plugin numbers the metrics and the trace with the same engine step. SGLang's numbers every forward
    of a scheduler process in its metrics (prefill EXTEND forwards included) and only the decode forwards in
    its trace (1, 2, ...): there the n-th decode row of a process is the trace's step n."""
    if engine != "sglang":
        return list(rows)
    counts: dict[Any, int] = {}
    out = []
    for row in rows:
        if row.get("decode"):
            key = (row.get("pid"), row.get("rank", 0))
            counts[key] = counts.get(key, 0) + 1
            row = {**row, "step": counts[key]}
        out.append(row)
    return out


def engine_checks(arm: Arm, shape: tuple[int, int] | None, engine: str = "vllm") -> list[Check]:
    """The checks of the arm's ``OEA_METRICS_FILE`` and ``OEA_TRACE_FILE`` (none when it wrote neither)."""
    checks: list[Check] = []
    rows = read_metrics(arm.env["OEA_METRICS_FILE"]) if arm.env.get("OEA_METRICS_FILE") else []
    if arm.env.get("OEA_METRICS_FILE"):
        if shape is None:
            checks.append(Check(f"{arm.name}: metrics rows consistent", bool(rows),
                                f"{len(rows)} steps; expert bounds not checked (no config.json gives N and top_k)"))
        else:
            checks += metrics_checks(arm.name, rows, arm.k0, top_k=shape[1], num_experts=shape[0])
    if arm.env.get("OEA_TRACE_FILE"):
        checks += trace_checks(arm.name, arm.env["OEA_TRACE_FILE"], trace_numbered(rows, engine), arm.k0)
    return checks


def check_outputs(arms: Sequence[Arm], out_dir: Path | None) -> None:
    """``SoakError`` when a file the soak writes into ``out_dir`` (``<arm>.json``, ``soak.json``) is an arm's
    trace sidecar (``OEA_TRACE_FILE`` with ``.json``): the report would overwrite what the trace needs."""
    if out_dir is None:
        return
    from oea.trace_schema import sidecar_path

    written = {(out_dir / f"{a.name}.json").resolve() for a in arms} | {(out_dir / "soak.json").resolve()}
    for arm in arms:
        trace = arm.env.get("OEA_TRACE_FILE")
        sidecar = sidecar_path(Path(trace)) if trace else None
        if sidecar is not None and sidecar.resolve() in written:
            raise SoakError(f"--arm {arm.name}: OEA_TRACE_FILE={trace} keeps its description in {sidecar}, a file "
                            f"--out {out_dir} writes a report to; name the trace otherwise (e.g. "
                            f"{Path(trace).with_name(Path(trace).stem + '-trace' + Path(trace).suffix)})")


def _stop_on_sigterm() -> Any:
    def handler(signum: int, _frame: object) -> None:  # the finally blocks stop the servers
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def run(arms: Sequence[Arm], cfg: SoakConfig, engine_args: Sequence[str] | None = None, python: str | None = None,
        out_dir: Path | None = None, baseline: str | None = None, identical: Sequence[str] = (),
        health_timeout_s: float = 900.0, pgids: dict[str, int] | None = None,
        say: Callable[[str], None] = lambda _line: None, engine: str = "vllm", nice: int | None = None,
        keep_engine_caches: bool = False) -> dict[str, Any]:
    """Soak every arm one after the other and check what must hold.

    Arms with a ``base_url`` are attached to (``pgids`` may name their process groups, for memory and
    restarts); the others get an ``engine`` server (``vllm`` or ``sglang``) started with ``engine_args`` (its
    server arguments) and stopped by its process group afterwards, also on an error or SIGTERM. A server that
    says it is another engine than the one started is a ``SoakError``. ``nice``: the started servers'
    scheduling priority (their sessions' autogroups included, ``oea.launch.priority``). Started servers run
    with the engine's shape caches off (``servers.LEAK_CHECK_ENV``) unless ``keep_engine_caches``; each report
    records the variables that added (``leak_check_env``)."""
    names = [a.name for a in arms]
    baseline = baseline or names[0]
    for name in [baseline, *identical]:
        if name not in names:
            raise ValueError(f"--baseline / --identical-outputs name {name!r} is not an arm ({names})")
    check_outputs(arms, out_dir)
    # An OEA-off arm whose memory is watched: each OEA arm's growth is judged against its growth (the engine's own).
    off = off_arm([(a.name, a.env) for a in arms if a.base_url is None or a.name in (pgids or {})], baseline)
    log_dir = out_dir or Path.cwd() / "oea-soak"
    reports: dict[str, dict[str, Any]] = {}
    checks: list[Check] = []
    shape = router_shape(model_arg(engine_args))
    previous = _stop_on_sigterm()
    try:
        for arm in arms:
            started = time.monotonic()
            leak_check: dict[str, str] = {}
            if arm.base_url is None:
                say(f"{arm.name}: starting the server ({' '.join(f'{k}={v}' for k, v in arm.env.items()) or 'no OEA'})")
                leak_check = start(arm, engine_args or [], python, log_dir, nice=nice, engine=engine,
                                   keep_engine_caches=keep_engine_caches)
            try:
                if arm.server is not None:
                    try:
                        wait(arm, health_timeout_s)
                    except RuntimeError as err:  # it exited or never answered: its log says why
                        raise SoakError(f"{arm.name}: {str(err).splitlines()[0].removesuffix('; log tail:')} "
                                        f"(its log: {log_dir / (arm.name + '.log')}; the arms before it are in "
                                        f"{log_dir})") from None
                info = identify(arm.base_url)  # type: ignore[arg-type]
                if arm.server is not None and info.engine != engine:
                    raise SoakError(f"{arm.name}: started a {engine} server, but {info.base_url} says it is "
                                    f"{info.engine} (GET /v1/models owned_by)")
                shape = shape or router_shape(info.root)
                pgid = process_group(arm) if arm.server is not None else (pgids or {}).get(arm.name)
                say(f"{arm.name}: {info.engine} {info.version} at {info.base_url} ready after "
                    f"{time.monotonic() - started:.0f} s; soaking {cfg.requests} requests")
                report = soak_server(info, cfg, pgid)
            finally:
                if arm.server is not None:
                    stop(arm)
            report["env"] = dict(arm.env)
            report["leak_check_env"] = leak_check
            reports[arm.name] = report
            checks += arm_checks(arm.name, report, memory_verdict=off is None)
            checks += engine_checks(arm, shape, info.engine)
            say(f"{arm.name}: {report['sent']} sent, {report['completed']} completed, {report['refused']} refused, "
                f"{report['aborted']} aborted, {report['failed']} failed in {report['soak_s']:.0f} s")
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / f"{arm.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
    checks += across_arms(baseline, reports, identical, off) if len(reports) > 1 or identical else []
    summary = {"arms": {name: _summary(r) for name, r in reports.items()}, "baseline": baseline, "off": off,
               "checks": [c.as_dict() for c in checks], "held": all(c.held for c in checks if c.verdict)}
    if out_dir is not None:
        (out_dir / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    return {**summary, "reports": reports}


SUMMARY_FIELDS = ("sent", "completed", "refused", "aborted", "failed", "refused_by_status", "unsent", "stopped",
                  "soak_s", "time_s", "tokens", "health", "restarts", "rss_growth_mib", "rss_growth_second_half_mib",
                  "pss_growth_mib", "anon_growth_mib", "file_growth_mib", "warmup", "leak_check_env")


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    out = {k: report[k] for k in SUMMARY_FIELDS if k in report}
    if "memory_after_warmup" in report:
        out["rss_after_warmup_mib"] = report["memory_after_warmup"]["rss_mib"]
        out["rss_end_mib"] = report["memory_end"]["rss_mib"]
    out["server"] = report["server"]
    return out
