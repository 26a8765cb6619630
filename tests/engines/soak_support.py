"""What the soak and chaos modules on real servers share (``test_vllm_soak.py``, ``test_sglang_soak.py``).

``Soak`` runs the parts of a module's fixture against started servers (name -> ``Server``, each logging to
``<work>/<name>.log``): an arm's soak, the idle checks of its metrics and trace, a kill mid-burst, a trace
folder removed mid-soak; a part that fails is kept for the tests that read it, the others still run.
``small_disk`` mounts the tmpfs of the full-disk fault. The ``check_*`` functions are the tests' bodies that do
not depend on the engine; each engine's module passes what does (how its log shows a warning of OEA's, how its
trace numbers steps: ``oea.soak.session.trace_numbered``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from folder_removal import remove_folder_under_writer

from oea.soak.checks import across_arms, arm_checks, metrics_checks, read_metrics, trace_checks
from oea.soak.client import run_phases
from oea.soak.mix import Phase, SoakRequest
from oea.soak.monitor import group_pids, identify
from oea.soak.runner import SoakConfig, soak_server
from oea.soak.session import trace_numbered

BURST_TIMEOUT_S = 20.0
REFUSAL_KINDS = {"prompt_too_long", "negative_max_tokens", "malformed_json"}


def router_shape() -> tuple[int, int]:
    """(routed experts, top_k) of the embedded model, from its config.json."""
    from oea.models import embedded_model_dir
    from oea.soak.servers import router_shape as shape_of

    shape = shape_of(str(embedded_model_dir()))
    assert shape is not None, "the embedded model's config.json names no expert count / top_k"
    return shape


def recording(work: Path, name: str, k0: int) -> dict[str, str]:
    """An arm's variables: ``OEA_K0`` with its metrics and trace in ``work``."""
    return {"OEA_K0": str(k0), "OEA_METRICS_FILE": str(work / f"{name}.jsonl"),
            "OEA_TRACE_FILE": str(work / f"{name}.safetensors")}


def fault_arms(work: Path, tmpfs: Path, k0: int, chaos: Path, raising: dict[str, str]) -> dict[str, dict[str, str]]:
    """The arms of the faults: ``full`` (the trace on ``tmpfs``, ``chaos`` on ``PYTHONPATH`` with the
    ``raising`` switch: one layer's OEA routing raises) and ``removed`` (the trace in ``work/removed``, made here
    and removed mid-soak by ``Soak.remove_mid_soak``; ``OEA_METRICS_FILE`` in a folder that does not exist)."""
    (work / "removed").mkdir()
    return {
        "full": {"OEA_K0": str(k0), "OEA_TRACE_FILE": str(tmpfs / "full.safetensors"),
                 "OEA_METRICS_FILE": str(work / "full.jsonl"), **raising,
                 "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(chaos))))},
        "removed": {"OEA_K0": str(k0), "OEA_TRACE_FILE": str(work / "removed" / "removed.safetensors"),
                    "OEA_METRICS_FILE": str(work / "missing" / "removed.jsonl")},
    }


@contextlib.contextmanager
def small_disk(path: Path, size: int, out: dict[str, Any]) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``path`` for the full-disk fault (mounting needs root, as on this project's
    machines and CI). On leaving, what it holds is copied next to it as ``tmpfs-<name>`` (the names in
    ``out["tmpfs_files"]``) and it is unmounted."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot mount a tmpfs for the full-disk fault (needs root): {proc.stderr}"
    try:
        yield path
    finally:
        out["tmpfs_files"] = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        for held in path.iterdir() if path.is_dir() else []:
            shutil.copy(held, path.parent / f"tmpfs-{held.name}")
        subprocess.run(["umount", str(path)], capture_output=True)


def burst(base_url: str, model: str = "m", count: int = 32, max_tokens: int = 400) -> threading.Thread:
    """Long greedy requests, all at once, in a background thread (they fail when the server is killed; a
    SIGTERMed API server may wait for its open connections, so they give up after ``BURST_TIMEOUT_S``)."""
    requests = tuple(SoakRequest(i, "complete", {"model": model, "prompt": [100 + i, 200, 300],
                                                 "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
                     for i in range(count))
    thread = threading.Thread(target=lambda: asyncio.run(run_phases(base_url, [Phase(requests, count)],
                                                                    time.monotonic() + 60, BURST_TIMEOUT_S)),
                              daemon=True)
    thread.start()
    return thread


def wait_for_more_decode_steps(metrics: Path, more: int, timeout: float = 120) -> None:
    start = sum(r["decode"] for r in read_metrics(metrics))
    deadline = time.monotonic() + timeout
    while sum(r["decode"] for r in read_metrics(metrics)) < start + more:
        assert time.monotonic() < deadline, f"fewer than {more} decode steps in {timeout} s"
        time.sleep(0.2)


def steps_recorded(trace: str | Path) -> int:
    """Steps the trace's sidecar describes now (its last checkpoint), 0 before the first."""
    try:
        return int(json.loads(Path(trace).with_suffix(".json").read_text())["steps_recorded"])
    except (OSError, ValueError, KeyError):
        return 0


class Soak:
    """The parts of a soak module's fixture, run one after the other against ``servers`` (started, healthy);
    what they find goes to ``out`` (the fixture's value)."""

    def __init__(self, work: Path, arms: dict[str, dict[str, str]], servers: dict[str, Any], engine: str) -> None:
        self.work, self.arms, self.servers, self.engine = work, arms, servers, engine
        self.out: dict[str, Any] = {"work": work, "arms": arms, "reports": {}, "checks": {}, "errors": {},
                                    "served_logs": {}, "engine": engine}

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")

    def phase(self, name: str, run: Callable[[], None]) -> None:
        """Run one part; a failure is kept for the tests that need it (the others still run). Its wall time goes to
        stderr (pytest shows it with ``-s`` or on a failure)."""
        started = time.monotonic()
        try:
            run()
        except Exception:  # reported by the tests that read this part
            self.out["errors"][name] = traceback.format_exc(limit=8)
        print(f"{self.engine} soak part {name}: {time.monotonic() - started:.0f} s", file=sys.stderr)

    def together(self, *chains: Sequence[tuple[str, Callable[[], None]]]) -> None:
        """Run each chain of parts in a thread of its own, its parts in order (``phase(name, run)`` each), and
        wait for all: the servers serve on one core each (one compute thread; SGLang's scheduler, vLLM's worker),
        so parts of different servers share the wall time. Each part's failure is kept as ``phase`` keeps it and
        the chain goes on, as it would one part after the other."""
        def run(parts: Sequence[tuple[str, Callable[[], None]]]) -> None:
            for name, part in parts:
                self.phase(name, part)

        threads = [threading.Thread(target=run, args=(parts,), name=f"soak-{parts[0][0]}") for parts in chains]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def soak_arm(self, name: str, cfg: SoakConfig) -> None:
        server = self.servers[name]
        self.out["reports"][name] = soak_server(identify(server.base_url), cfg, os.getpgid(server.process.pid))
        self.out["served_logs"][name] = self.log(name)  # before the server is stopped (it logs its shutdown)

    def check_idle(self, name: str, k0: int) -> None:
        """The arm's metrics and trace of its soak, while the server is idle."""
        experts, top_k = router_shape()
        rows = read_metrics(self.arms[name]["OEA_METRICS_FILE"])
        self.out["checks"][name] = (metrics_checks(name, rows, k0, top_k, experts)
                                    + trace_checks(name, self.arms[name]["OEA_TRACE_FILE"],
                                                   trace_numbered(rows, self.engine), k0))
        self.out["idle_steps"] = sum(bool(r["decode"]) for r in rows)

    def kill_mid_burst(self, name: str, kill: Callable[[int], None]) -> None:
        """Kill (``kill(pid)`` of the server's main process) once the burst's steps are being recorded: in the
        metrics and in the trace's last checkpoint. ``out[name + "_exit"]``: the main process's exit code;
        ``out[name + "_left"]``: the processes of its group still there 30 s after it exited."""
        server = self.servers[name]
        info = identify(server.base_url)
        pgid = os.getpgid(server.process.pid)
        load = burst(server.base_url, info.model, max_tokens=min(400, info.total_limit - 3))
        recorded = steps_recorded(self.arms[name]["OEA_TRACE_FILE"])
        wait_for_more_decode_steps(Path(self.arms[name]["OEA_METRICS_FILE"]), 50)
        deadline = time.monotonic() + 60
        while steps_recorded(self.arms[name]["OEA_TRACE_FILE"]) <= recorded and time.monotonic() < deadline:
            time.sleep(0.1)
        kill(server.process.pid)
        self.out[f"{name}_exit"] = server.process.wait(timeout=BURST_TIMEOUT_S + 60)
        load.join(BURST_TIMEOUT_S + 30)
        deadline = time.monotonic() + 30  # the engine's other processes follow the main one
        while group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.out[f"{name}_left"] = group_pids(pgid)
        self.out["served_logs"][name] = self.log(name)

    def remove_mid_soak(self, name: str, folder: Path, cfg: SoakConfig, after_s: float = 8.0) -> None:
        """The arm's soak, with ``folder`` removed ``after_s`` seconds into it (``remove_folder_under_writer``);
        the removal's own error, if any, fails the part."""
        failed: list[BaseException] = []

        def remove() -> None:
            try:
                remove_folder_under_writer(folder)
            except BaseException as err:  # re-raised below, in the test's thread
                failed.append(err)

        remover = threading.Timer(after_s, remove)
        remover.start()
        try:
            self.soak_arm(name, cfg)
        finally:
            remover.join()
        if failed:
            raise RuntimeError(f"removing {folder} mid-soak failed") from failed[0]



def part(soak: dict[str, Any], *names: str) -> None:
    """Fail with the fixture's error when a part this test reads did not run through."""
    errors = [f"{name}:\n{soak['errors'][name]}" for name in names if name in soak["errors"]]
    assert not errors, "\n".join(errors)


def assert_held(checks) -> None:  # type: ignore[no-untyped-def]
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.held]
    assert not failed, failed


def left_behind(soak: dict[str, Any], name: str, trace: Any) -> tuple[set[int], dict[int, int]]:
    """The trace's steps and the metrics' decode steps (step -> rows, numbered as the trace numbers them) of
    the arm's server, after checking that every step both hold has the same rows and that the trace holds no
    step the metrics file has not flushed, except past its last line (the file is flushed every 0.5 s, the
    trace checkpointed every second)."""
    rows = trace_numbered(read_metrics(soak["arms"][name]["OEA_METRICS_FILE"]), soak["engine"])
    decode = {r["step"]: r["rows"] for r in rows if r["decode"]}
    steps = set(trace.step_ids.tolist())
    assert steps, "the trace holds no step"
    assert all(s > max(decode) for s in steps - set(decode)), sorted(steps - set(decode))[:5]
    assert all(int((trace.step_ids == s).sum()) == decode[s] for s in steps & set(decode)), "rows differ"
    return steps, decode


def check_soak_arm(soak: dict[str, Any], arm: str, cfg: SoakConfig, checks: Callable[[str, Any], list[Any]]
                   ) -> None:
    """The arm sent all of ``cfg``'s requests and ``checks(arm, report)`` held; its line to stderr."""
    part(soak, arm)
    report = soak["reports"][arm]
    assert report["sent"] == cfg.requests >= 100 and report["unsent"] == 0
    assert_held(checks(arm, report))
    print(f"\nsoak {arm}: {report['sent']} sent, {report['completed']} completed, {report['refused']} refused "
          f"{report['refused_by_status']}, {report['aborted']} aborted, {report['failed']} failed, RSS "
          f"{report['memory_after_warmup']['rss_mib']:.0f} -> {report['memory_end']['rss_mib']:.0f} MiB "
          f"({report['rss_growth_mib']:+.1f}), {report['soak_s']:.0f} s", file=sys.stderr)


def check_refusals(soak: dict[str, Any]) -> list[Any]:
    """OEA off's soak met every kind of refusal, and ``across_arms`` held for off and oea (returned)."""
    part(soak, "off", "oea")
    reports = {name: soak["reports"][name] for name in ("off", "oea")}
    kinds = {o["refusal"] for o in reports["off"]["outcomes"] if o["outcome"] == "refused"}
    assert kinds == REFUSAL_KINDS
    checks = across_arms("off", reports, off="off")  # OEA's growth judged against OEA off's
    assert_held(checks)
    return checks


def check_metrics_and_trace(soak: dict[str, Any], name: str = "oea") -> None:
    """The idle checks of the arm's metrics and trace (``Soak.check_idle``) held; each to stderr."""
    part(soak, name)
    assert_held(soak["checks"][name])
    for check in soak["checks"][name]:
        print(f"\n{check.name}: {check.detail}", file=sys.stderr)


def check_killed(soak: dict[str, Any], name: str, kill: str) -> tuple[Any, set[int], dict[int, int]]:
    """The arm's server, killed mid-burst (part ``kill``), exited and left a trace that loads and validates
    and holds only steps the engine ran, with their rows: (trace, steps, decode)."""
    from oea.traces import load_trace

    part(soak, kill)
    assert soak[f"{name}_exit"] is not None
    trace = load_trace(soak["arms"][name]["OEA_TRACE_FILE"])
    steps, decode = left_behind(soak, name, trace)
    return trace, steps, decode


def check_sigkill(soak: dict[str, Any]) -> None:
    """SIGKILL of oea's process group mid-burst: the trace holds the soak's steps and some of the burst's."""
    part(soak, "oea")
    trace, steps, decode = check_killed(soak, "oea", "sigkill")
    assert len(steps) >= soak["idle_steps"] + 1, "the trace holds no step of the burst, or lost earlier ones"
    assert trace.meta["stopped"].startswith("interrupted"), trace.meta["stopped"]
    print(f"\nchaos SIGKILL: the trace holds {len(steps)} decode steps of the {len(decode)} the metrics counted "
          f"({soak['idle_steps']} before the burst)", file=sys.stderr)


def check_sigterm(soak: dict[str, Any], name: str) -> None:
    """SIGTERM of the arm's main process mid-burst: it stopped, left a valid trace and no temporary sidecar."""
    trace, steps, decode = check_killed(soak, name, "sigterm")
    assert not Path(soak["arms"][name]["OEA_TRACE_FILE"]).with_suffix(".json.tmp").exists()
    print(f"\nchaos SIGTERM: server exit {soak[f'{name}_exit']}; the trace holds {len(steps)} of {len(decode)} "
          f"decode steps; stopped: {trace.meta['stopped'][:60]}", file=sys.stderr)


def check_full_disk(soak: dict[str, Any], warnings: Callable[[str], list[str]], raised: str) -> None:
    """The full arm's trace filled its tmpfs: one warning, every request served, no restart, the steps written
    before load, no ``.tmp`` left, and no warning of OEA's but this and the raising layer's (``raised``)."""
    from oea.traces import load_trace

    part(soak, "full")
    report, log = soak["reports"]["full"], soak["served_logs"]["full"]
    assert_held(arm_checks("full", report)[:2])  # every request served, no restart
    stops = [line for line in warnings(log) if "stops: writing failed" in line]
    assert len(stops) == 1 and "No space left on device" in stops[0] and "serving continues" in stops[0], stops
    trace = load_trace(str(soak["work"] / "tmpfs-full.safetensors"))
    steps, decode = left_behind(soak, "full", trace)
    assert len(steps) < len(decode), "the disk filled before the end"
    assert not [name for name in soak["tmpfs_files"] if name.endswith(".tmp")]
    assert len(warnings(log)) == len(stops) + sum(raised in line for line in warnings(log)), \
        "one warning per fault, nothing else"
    print(f"\nchaos full disk: {stops[0].split('stops: ')[1][:200]}", file=sys.stderr)


def check_removed(soak: dict[str, Any], warnings: Callable[[str], list[str]]) -> None:
    """The removed arm's trace folder vanished mid-soak: one warning, every request served, no restart."""
    part(soak, "removed")
    report, log = soak["reports"]["removed"], soak["served_logs"]["removed"]
    assert_held(arm_checks("removed", report)[:2])
    stops = [line for line in warnings(log) if "recording to" in line]
    assert len(stops) == 1 and "stops: writing failed" in stops[0] and "serving continues" in stops[0], stops
    assert not (soak["work"] / "removed").exists()
    assert "Traceback" not in log


def check_unwritable_metrics(soak: dict[str, Any], warnings: Callable[[str], list[str]]) -> None:
    """The removed arm's ``OEA_METRICS_FILE`` lies in a folder that does not exist: one warning, serving goes
    on without metrics."""
    part(soak, "removed")
    report, log = soak["reports"]["removed"], soak["served_logs"]["removed"]
    path = soak["arms"]["removed"]["OEA_METRICS_FILE"]
    found = [line for line in warnings(log) if "OEA_METRICS_FILE" in line]
    assert len(found) == 1 and f"OEA_METRICS_FILE={path} cannot be written" in found[0], found
    assert "serving without metrics" in found[0] and not Path(path).parent.exists()
    assert report["failed"] == 0 and report["completed"] > 0 and "Exception in thread" not in log
