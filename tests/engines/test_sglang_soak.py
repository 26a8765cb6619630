"""Soak and chaos on real SGLang CPU servers (SGLang 0.5.23 in .venv-sglang, the embedded model, the plugin loaded
through SGLang's own entry point, the ``sgl_kernel`` stand-in), driven by ``oea soak``'s library (``oea.soak``);
docs/reliability.md says what each test promises. ``tests/engines/test_vllm_soak.py`` is the same on vLLM.

Five servers on 127.0.0.1 (``sglang_server.start_all``: each in its own process group, ``--sleep-on-idle``) are
started together (start-up dominates on two cores), then used in two rounds, the parts of different servers at the
same time (one SGLang scheduler serving alone leaves most of the second core idle; each soak measures its own
server's process group, and the growth of ``oea`` is compared with that of ``off`` under the same load): ``off``'s
soak, ``oea``'s parts and ``term``'s; then ``full``'s and ``removed``'s. Each server is stopped by its process group
in ``finally`` (SIGTERM of this process included):

* ``off``: OEA off, the soak's baseline (the seeded mix, 100 requests after the warm-up: a short soak;
  ``make soak`` runs 2,000 per arm);
* ``oea``: ``OEA_K0=3`` with ``OEA_METRICS_FILE`` and ``OEA_TRACE_FILE``: the same soak; once it is idle its
  metrics and trace are checked; then a burst of long requests and, mid-burst, SIGKILL of the whole process
  group (``chaos``): the trace left behind must load and validate;
* ``term``: the same variables; a burst and, mid-burst, SIGTERM of the server's main process (``chaos``);
* ``full``: ``OEA_K0=3``, the trace on a 512 KiB tmpfs mounted for the test (it fills mid-run) and layer 1's
  OEA routing raising inside the hook (``tests/engines/sglang_chaos/sitecustomize.py``, a test-support switch);
* ``removed``: ``OEA_K0=3``, the trace's folder removed mid-run, ``OEA_METRICS_FILE`` in a folder that does
  not exist.

The servers serve ``--context-length 256`` (the soak's lengths follow the served ones, ``oea.soak.monitor``):
SGLang's torch-native CPU path is slow, and shorter requests keep the module within a few minutes. SGLang's
trace numbers its decode forwards 1, 2, ... and its metrics every forward: the checks map the n-th decode row
of the metrics to trace step n (``oea.soak.session.trace_numbered``). Every server runs with oneDNN's primitive
cache off (``oea.soak.servers.LEAK_CHECK_ENV``, as ``oea soak`` starts them): it fills with every new matmul
shape, so with it on the memory bound would measure the cache rather than a leak (docs/reliability.md). SGLang's
scheduler still grows with it off, OEA off too, so the memory promise checked here is the growth within OEA
off's plus the bound (``across_arms``), not the absolute bound.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import soak_support as shared
from server_harness import SGLANG_SLOTS, stopping_servers
from sglang_server import Arm, start_all

from oea.soak.checks import arm_checks, read_metrics
from oea.soak.runner import SoakConfig
from oea.soak.servers import LEAK_CHECK_ENV

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]

K0 = 3
CONTEXT = "256"
CHAOS = Path(__file__).resolve().parent / "sglang_chaos"
RAISING_LAYER = 1
TMPFS_BYTES = 2**19
SOAK = SoakConfig(requests=100, duration_s=600, warmup=32, seed=0, max_concurrency=32, probe=False)
SHORT = SoakConfig(requests=60, duration_s=300, warmup=8, seed=7, max_concurrency=32, probe=False)
RAISED = "routing rewrite failed"
ABSOLUTE_MEMORY = "RSS growth after warm-up within"  # arm_checks' absolute bound: SGLang's scheduler misses it alone


def _engine_checks(name: str, report: dict[str, Any]) -> list[Any]:
    """``arm_checks`` without the absolute memory bound: SGLang's scheduler grows past it with OEA off too, the
    primitive cache off included (+134 MiB over 200 requests, docs/reliability.md); the growth against OEA off's
    is checked by ``across_arms``."""
    return [c for c in arm_checks(name, report) if ABSOLUTE_MEMORY not in c.name]


def _oea_warnings(log: str) -> list[str]:
    """The plugin's warnings in an SGLang log (SGLang's log lines carry no level; the plugin's info lines say
    what it registered and records)."""
    infos = ("registered on", "recording 100%", "OEA_K0 unset", "finished: the trace keeps")
    return [line for line in log.splitlines() if "oea: " in line and not any(i in line for i in infos)]


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("sglang-soak")
    tmpfs = work / "tmpfs"
    arms = {"off": {}, "oea": shared.recording(work, "oea", K0), "term": shared.recording(work, "term", K0),
            **shared.fault_arms(work, tmpfs, K0, CHAOS, {"TEST_OEA_RAISE_IN_LAYER": str(RAISING_LAYER)})}
    arms = {name: {**LEAK_CHECK_ENV, **env} for name, env in arms.items()}  # as oea soak starts servers
    started = time.monotonic()
    out: dict[str, Any] = {}
    with (shared.small_disk(tmpfs, TMPFS_BYTES, out),  # the servers are stopped before the unmount
          stopping_servers(slots=SGLANG_SLOTS * len(arms), what="sglang soak") as held):
        live = start_all([Arm(name, env, args=("--context-length", CONTEXT)) for name, env in arms.items()], work)
        held.update({name: server.server for name, server in live.items()})
        print(f"\nsoak: five SGLang servers healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)
        run = shared.Soak(work, arms, dict(held), "sglang")
        run.together([("off", lambda: run.soak_arm("off", SOAK))],
                     [("oea", lambda: run.soak_arm("oea", SOAK)), ("oea", lambda: run.check_idle("oea", K0)),
                      ("sigkill", lambda: run.kill_mid_burst("oea", lambda pid: os.killpg(pid, signal.SIGKILL)))],
                     [("sigterm", lambda: run.kill_mid_burst("term", lambda pid: os.kill(pid, signal.SIGTERM)))])
        run.together([("full", lambda: run.soak_arm("full", SHORT))],
                     [("removed", lambda: run.remove_mid_soak("removed", work / "removed", SHORT))])
    print(f"soak: done after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return {**run.out, **out}


@pytest.mark.parametrize("arm", ["off", "oea"])
def test_sglang_soak_serves_every_request_without_restart(soak: dict[str, Any], arm: str) -> None:
    shared.check_soak_arm(soak, arm, SOAK, _engine_checks)


def test_sglang_soak_refusals_are_the_engines_own_and_growth_as_with_oea_off(soak: dict[str, Any]) -> None:
    checks = shared.check_refusals(soak)
    assert [c.name for c in checks if "RSS growth within off's" in c.name] == [checks[-1].name]
    for check in checks:
        print(f"\n{check.name}: {check.detail}", file=sys.stderr)


def test_sglang_soak_metrics_rows_are_consistent_and_the_trace_replays_them(soak: dict[str, Any]) -> None:
    shared.check_metrics_and_trace(soak)


def test_sglang_chaos_sigkill_mid_recording_leaves_a_valid_trace(soak: dict[str, Any]) -> None:
    shared.check_sigkill(soak)
    assert not soak["oea_left"], f"processes of the group left: {soak['oea_left']}"


def test_sglang_chaos_sigterm_mid_recording_stops_the_server_and_leaves_a_valid_trace(soak: dict[str, Any]) -> None:
    shared.check_sigterm(soak, "term")
    assert not soak["term_left"], f"the main process exited, these processes of its group did not: {soak['term_left']}"
    assert not _oea_warnings(soak["served_logs"]["term"]), "no warning of OEA's"


def test_sglang_chaos_a_full_disk_stops_recording_once_and_serving_goes_on(soak: dict[str, Any]) -> None:
    shared.check_full_disk(soak, _oea_warnings, raised=RAISED)


def test_sglang_chaos_a_layer_whose_routing_raises_keeps_stock_routing_and_serving_goes_on(
        soak: dict[str, Any]) -> None:
    shared.part(soak, "full")
    log = soak["served_logs"]["full"]
    raised = [line for line in _oea_warnings(log) if RAISED in line]
    assert len(raised) == 1 and f"on layer {RAISING_LAYER};" in raised[0] and "passing through" in raised[0], raised
    assert log.count("Traceback") == 1 and f"OEA's routing of layer {RAISING_LAYER} raises" in log, \
        "one traceback (the warning's own), nothing raised into SGLang"
    rows = [r for r in read_metrics(soak["arms"]["full"]["OEA_METRICS_FILE"]) if r["decode"] and r["rows"] >= 2]
    assert rows and all(r["layers"] == len(r["active"]) == len(r["active_stock"]) for r in rows)
    assert all(r["active"][RAISING_LAYER] == r["active_stock"][RAISING_LAYER] for r in rows), "stock routing there"
    assert any(r["active"][0] < r["active_stock"][0] for r in rows), "the other layers keep OEA"


def test_sglang_chaos_a_removed_trace_folder_stops_recording_once_and_serving_goes_on(soak: dict[str, Any]) -> None:
    shared.check_removed(soak, _oea_warnings)


def test_sglang_chaos_an_unwritable_metrics_path_is_one_warning_and_serving_goes_on(soak: dict[str, Any]) -> None:
    shared.check_unwritable_metrics(soak, _oea_warnings)
    assert len(_oea_warnings(soak["served_logs"]["removed"])) == 2, "one warning per fault (this, the removed folder)"
