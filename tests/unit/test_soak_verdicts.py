"""``oea soak``'s verdicts, each held on its own: failed warm-ups, refusals (status classes, refusals in common),
the trace check (dropped steps, the lockstep replay on both sides), requests left unsent at the duration limit,
a planned stream abort at its chunk, metrics rows numbered per (process, rank), the reports that may not
overwrite a trace's sidecar, and the memory verdict judged against OEA off's growth when an off arm ran.

No engine: the check functions on hand-made reports, the client against a stand-in server on loopback
(``fake_servers.serving``), and ``session.run`` with the server's answers and the arm's soak stood in."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_servers import QuietHandler, serving

from oea.routing import RouterSpec
from oea.soak import client as soak_client
from oea.soak import session
from oea.soak.checks import across_arms, arm_checks, memory_bound_mib, off_arm, trace_checks
from oea.soak.client import run_phases, send
from oea.soak.mix import Phase, SoakRequest
from oea.soak.monitor import ServerInfo, SoakError
from oea.soak.runner import SoakConfig
from oea.soak.servers import Arm
from oea.soak.session import check_outputs, trace_numbered
from oea.traces import Trace


def _report(**changes: Any) -> dict[str, Any]:
    """An arm's report that passes every arm check; ``changes`` replace its fields."""
    report: dict[str, Any] = {
        "failed": 0, "failures": [], "sent": 10, "completed": 4, "refused": 1, "aborted": 5, "restarts": 0,
        "unsent": 0, "stopped": "requests", "soak_s": 1.0,
        "warmup": {"failed": 0, "sent": 4, "failures": []},
        "health": {"unhealthy": 0, "samples": 3, "longest_silence_s": 0.0},
        "outcomes": [{"index": 3, "plan": "refuse", "status": 400, "error": "too long", "outcome": "refused"}]}
    report.update(changes)
    return report


def _with_memory(growth: float | None, warm: float = 1000.0) -> dict[str, Any]:
    end = warm + (growth or 0.0)
    return _report(memory_after_warmup={"rss_mib": warm, "processes": []},
                   memory_end={"rss_mib": end, "processes": []}, rss_growth_mib=growth, pss_growth_mib=growth or 0.0)


# -- the checks of one arm and across arms -----------------------------------------------------------------------

def test_a_failed_warm_up_request_fails_the_arm() -> None:
    assert arm_checks("a", _report())[0].held
    failed = arm_checks("a", _report(warmup={"failed": 1, "sent": 4, "failures": ["#0 (plain): HTTP 500"]}))[0]
    assert not failed.held and "1 failed" in failed.detail and "HTTP 500" in failed.detail


def _refusal(status: int | None, message: str = "too long", index: int = 3) -> dict[str, Any]:
    return _report(outcomes=[{"index": index, "plan": "refuse", "status": status, "error": message,
                              "outcome": "refused"}])


def _refusal_check(base: dict[str, Any], other: dict[str, Any]) -> Any:
    return next(c for c in across_arms("off", {"off": base, "oea": other}) if c.name.startswith("oea: refusals"))


@pytest.mark.parametrize("status", [400, 422, 499])
def test_the_same_client_error_in_both_arms_is_the_engines_own_refusal(status: int) -> None:
    assert _refusal_check(_refusal(status), _refusal(status)).held


@pytest.mark.parametrize("status", [500, 503, 399, 200, None])
def test_a_refusal_outside_the_4xx_class_is_never_the_engines_own(status: int | None) -> None:
    check = _refusal_check(_refusal(status), _refusal(status))  # the same in both arms, still not a refusal
    assert not check.held and "was not refused by the engine" in check.detail


def test_refusals_with_another_status_differ() -> None:
    check = _refusal_check(_refusal(400), _refusal(422))
    assert not check.held and "request 3" in check.detail


def test_the_refusal_check_needs_refusals_in_common() -> None:
    assert not _refusal_check(_refusal(400, index=3), _refusal(400, index=4)).held
    assert not _refusal_check(_report(outcomes=[]), _report(outcomes=[])).held


# -- what the client calls a refusal, a failure, an abort, an unsent request -------------------------------------

class _Answers(QuietHandler):
    """/v1/completions answering ``status`` (a JSON error) or, for 200, ``chunks`` streamed token chunks."""

    status = 400
    chunks = 10

    def do_POST(self) -> None:
        body = self.read_json()
        if self.status != 200:
            return self.send_json({"error": {"message": "no"}}, status=self.status)
        events = [f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x', 'token_ids': [t]}]})}\n\n"
                  for t in range(self.chunks)]
        events.append("data: [DONE]\n\n")
        del body
        self.send_body("".join(events).encode(), "text/event-stream")


def _send(url: str, request: SoakRequest) -> soak_client.Outcome:
    import httpx

    async def go() -> soak_client.Outcome:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await send(client, url + "/v1/completions", request, timeout_s=30.0)

    return asyncio.run(go())


def _refuse(index: int = 0) -> SoakRequest:
    return SoakRequest(index, "refuse", {"model": "m", "prompt": [1], "max_tokens": -1}, refusal="negative_max_tokens")


@pytest.mark.parametrize(("status", "outcome"), [(400, "refused"), (499, "refused"), (500, "failed"),
                                                 (503, "failed")])
def test_a_planned_refusal_answered_with_a_server_error_is_a_failure(status: int, outcome: str) -> None:
    handler = type("Answers", (_Answers,), {"status": status})
    with serving(handler) as url:
        out = _send(url, _refuse())
    assert (out.outcome, out.status) == (outcome, status)
    assert (f"HTTP {status}" in out.error) == (outcome == "failed")


@pytest.mark.parametrize("planned", [0, 1, 3, 9])
def test_a_planned_stream_abort_happens_at_exactly_its_chunk(planned: int) -> None:
    request = SoakRequest(0, "abort", {"model": "m", "prompt": [1], "max_tokens": 10, "stream": True},
                          abort_after=planned)
    handler = type("Answers", (_Answers,), {"status": 200, "chunks": 10})
    with serving(handler) as url:
        out = _send(url, request)
    assert (out.outcome, out.chunks) == ("aborted", planned)


def test_requests_left_unsent_at_the_duration_limit_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that passes the deadline once the first request is answered: the rest of its phase and the
    next phase are never sent, and each is counted."""
    now = [0.0]
    monkeypatch.setattr(soak_client, "time", types.SimpleNamespace(monotonic=lambda: now[0],
                                                                   perf_counter=time.perf_counter))

    def answered(_outcome: soak_client.Outcome) -> None:
        now[0] = 100.0

    plain = [SoakRequest(i, "plain", {"model": "m", "prompt": [1], "max_tokens": 10, "stream": True})
             for i in range(5)]
    phases = [Phase(tuple(plain[:3]), 1), Phase(tuple(plain[3:]), 1)]
    handler = type("Answers", (_Answers,), {"status": 200, "chunks": 10})
    with serving(handler) as url:
        outcomes, unsent = asyncio.run(run_phases(url, phases, deadline=50.0, timeout_s=30.0, on_outcome=answered))
    assert [o.index for o in outcomes] == [0] and unsent == 4


def test_unsent_requests_are_reported_in_the_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run_session(monkeypatch, {"a": _report(unsent=7, stopped="duration")}, [Arm("a", {})])
    assert result["arms"]["a"]["unsent"] == 7 and result["arms"]["a"]["stopped"] == "duration"


# -- the engine's metrics rows and its trace ---------------------------------------------------------------------

def test_sglang_metrics_rows_are_numbered_per_process_and_rank() -> None:
    rows = [{"pid": 1, "rank": 0, "step": 1, "decode": True}, {"pid": 2, "rank": 0, "step": 1, "decode": True},
            {"pid": 1, "rank": 1, "step": 1, "decode": True}, {"pid": 1, "rank": 0, "step": 2, "decode": False},
            {"pid": 1, "rank": 0, "step": 3, "decode": True}, {"pid": 2, "rank": 0, "step": 2, "decode": True},
            {"pid": 1, "rank": 1, "step": 2, "decode": True}]
    numbered = [(r["pid"], r["rank"], r["step"]) for r in trace_numbered(rows, "sglang") if r["decode"]]
    assert numbered == [(1, 0, 1), (2, 0, 1), (1, 1, 1), (1, 0, 2), (2, 0, 2), (1, 1, 2)]


def _trace(steps: list[int], dropped: int = 0) -> Trace:
    """A recorded trace of ``steps`` (one token per entry: a step's width is how often it appears; 2 MoE layers,
    16 experts, top-4) whose sidecar says ``dropped``."""
    logits = torch.randn(len(steps), 2, 16, generator=torch.Generator().manual_seed(0))
    return Trace(spec=RouterSpec(16, 4), logits=logits, step_ids=torch.tensor(steps), meta={
        "steps_recorded": len(set(steps)), "stopped": None, "steps_dropped": dropped, "queue_peak_steps": 1,
        "queue_bound_steps": 8})


def _fake_trace(monkeypatch: pytest.MonkeyPatch, steps: list[int], dropped: int, replayed: float) -> list[Any]:
    """``load_trace`` gives ``_trace(steps, dropped)``; the lockstep replay gives ``replayed`` mean active experts
    with OEA and the metrics' 6.0 with stock routing. Returns the list each replay's (trace, batch sizes) joins."""
    monkeypatch.setattr("oea.traces.load_trace", lambda _path: _trace(steps, dropped))
    module = importlib.import_module("oea.sim.simulate")  # the package exports a function of the same name
    replays: list[Any] = []

    def simulate(trace: Trace, policies: tuple[str, ...], batch_sizes: tuple[int, ...], **_: Any) -> list[Any]:
        replays.append((trace, batch_sizes))
        return [{"policy": p, "mean_active_experts": replayed if p == "oea" else 6.0} for p in policies]

    monkeypatch.setattr(module, "simulate", simulate)
    return replays


_ROWS = [{"step": s, "decode": True, "rows": 1, "active": [4.0], "active_stock": [6.0]} for s in (1, 2, 3)]


def _trace_check(name: str, monkeypatch: pytest.MonkeyPatch, dropped: int = 0) -> Any:
    _fake_trace(monkeypatch, [1, 2, 3], dropped, 4.0)
    checks = trace_checks("a", "t.safetensors", _ROWS, k0=3)
    assert all(c.held for c in checks if name not in c.name), checks
    return next(c for c in checks if name in c.name)


def test_a_trace_whose_sidecar_reports_dropped_steps_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _trace_check("exactly the decode steps", monkeypatch).held
    check = _trace_check("exactly the decode steps", monkeypatch, dropped=2)
    assert not check.held and "dropped 2" in check.detail


@pytest.mark.parametrize(("replayed", "held"), [(4.0, True), (4.0 * 1.009, True), (4.0 * 0.991, True),
                                                (4.0 * 1.02, False), (4.0 * 0.98, False), (2.0, False), (8.0, False)])
def test_the_lockstep_replay_check_is_two_sided(monkeypatch: pytest.MonkeyPatch, replayed: float,
                                                held: bool) -> None:
    _fake_trace(monkeypatch, [1, 2, 3], 0, replayed)
    replay = next(c for c in trace_checks("a", "t.safetensors", _ROWS, k0=3) if "lockstep" in c.name)
    assert replay.held is held, replay.detail


def _width_rows(steps: list[int], active: float = 4.0, stock: float = 6.0) -> list[dict[str, Any]]:
    return [{"step": s, "decode": True, "rows": steps.count(s), "active": [active], "active_stock": [stock]}
            for s in sorted(set(steps))]


def test_the_replay_takes_the_widest_width_recorded_twice_and_only_its_steps(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """How many requests met in one step depends on timing: the one 4-row step cannot give an interval, so the
    replay is at 3 rows, over the two 3-row steps alone (never 3 rows drawn from the 4-row step)."""
    steps = [1] * 4 + [2] * 3 + [3] * 3 + [4] * 2
    replays = _fake_trace(monkeypatch, steps, 0, 4.0)
    replay = next(c for c in trace_checks("a", "t.safetensors", _width_rows(steps), k0=3) if "lockstep" in c.name)
    assert replay.held and replay.detail.startswith("B = 3 (2 steps)"), replay.detail
    (trace, sizes), = replays
    assert sizes == (3,) and trace.step_ids.tolist() == [2] * 3 + [3] * 3
    assert torch.equal(trace.logits, _trace(steps).logits[4:10])


def test_no_width_recorded_twice_fails_the_replay_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = [1] * 3 + [2] * 2 + [3]
    replays = _fake_trace(monkeypatch, steps, 0, 4.0)
    replay = next(c for c in trace_checks("a", "t.safetensors", _width_rows(steps), k0=3) if "lockstep" in c.name)
    assert not replay.held and "no step width was recorded twice" in replay.detail and not replays


def test_a_unique_widest_step_replays_through_the_real_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``simulate`` over a trace whose widest step is recorded once (it refuses that width, one distinct
    batch): the check replays the two 3-row steps and matches their stock routing exactly."""
    steps = [1] * 4 + [2] * 3 + [3] * 3
    trace = _trace(steps)
    monkeypatch.setattr("oea.traces.load_trace", lambda _path: trace)
    ids = trace.logits.topk(4, dim=-1).indices  # [T, L, k] stock top-4
    stock = {s: [float(ids[trace.step_ids == s][:, layer].unique().numel()) for layer in range(2)] for s in (2, 3)}
    rows = [{"step": s, "decode": True, "rows": steps.count(s), "active": stock.get(s, [0.0, 0.0])}
            for s in (1, 2, 3)]
    replay = next(c for c in trace_checks("a", "t.safetensors", rows, k0=None) if "lockstep" in c.name)
    assert replay.held and replay.detail.startswith("B = 3 (2 steps): vanilla"), replay.detail


def test_soak_json_never_overwrites_an_arms_trace_sidecar(tmp_path: Path) -> None:
    for trace in ("soak.safetensors", "oea.safetensors"):
        with pytest.raises(SoakError, match="OEA_TRACE_FILE"):
            check_outputs([Arm("oea", {"OEA_TRACE_FILE": str(tmp_path / trace)})], tmp_path)
    check_outputs([Arm("oea", {"OEA_TRACE_FILE": str(tmp_path / "oea-trace.safetensors")})], tmp_path)
    check_outputs([Arm("oea", {"OEA_TRACE_FILE": str(tmp_path / "soak.safetensors")})], tmp_path / "elsewhere")


# -- the memory verdict: against OEA off's growth when an off arm ran --------------------------------------------

def _run_session(monkeypatch: pytest.MonkeyPatch, reports: dict[str, dict[str, Any]], arms: list[Arm],
                 baseline: str | None = None) -> dict[str, Any]:
    """``session.run`` over attached arms (each with a watched process group) whose soaks give ``reports``."""
    for arm in arms:
        arm.base_url = f"http://127.0.0.1:9/{arm.name}"

    def identify(url: str) -> ServerInfo:
        return ServerInfo(url, "vllm", "m", 128, version="fake")

    monkeypatch.setattr(session, "identify", identify)
    monkeypatch.setattr(session, "soak_server", lambda info, _cfg, _pgid: dict(
        reports[info.base_url.rsplit("/", 1)[1]], server=info.__dict__))
    return session.run(arms, SoakConfig(requests=10, duration_s=10), baseline=baseline,
                       pgids={a.name: 1 for a in arms})


BOUND = memory_bound_mib(1000.0)


@pytest.mark.parametrize(("oea_growth", "held"), [(300.0 + BOUND, True), (250.0, True),
                                                   (300.0 + BOUND + 1, False), (None, False)])
def test_with_an_off_arm_oea_is_judged_against_its_growth(monkeypatch: pytest.MonkeyPatch,
                                                          oea_growth: float | None, held: bool) -> None:
    """OEA off grows 300 MiB (past the absolute bound, the engine's own): the verdict is OEA's growth within
    OEA off's + the bound; both absolute growths are still reported."""
    reports = {"off": _with_memory(300.0), "oea": _with_memory(oea_growth)}
    result = _run_session(monkeypatch, reports, [Arm("off", {}), Arm("oea", {"OEA_K0": "3"})])
    assert result["off"] == "off" and result["held"] is held, result["checks"]
    absolute = [c for c in result["checks"] if "RSS growth after warm-up" in c["name"]]
    assert [c["verdict"] for c in absolute] == [False, False] and not absolute[0]["held"]
    relative = [c for c in result["checks"] if c["name"].startswith("oea: RSS growth within off's")]
    assert len(relative) == 1 and relative[0]["held"] is held and relative[0]["verdict"]


@pytest.mark.parametrize(("growth", "held"), [(BOUND, True), (BOUND + 1, False)])
def test_without_an_off_arm_the_absolute_bound_is_the_verdict(monkeypatch: pytest.MonkeyPatch, growth: float,
                                                              held: bool) -> None:
    for arms in ([Arm("oea", {"OEA_K0": "3"})], [Arm("oea", {"OEA_K0": "3"}), Arm("topk", {"OEA_K0": "8"})],
                 [Arm("off", {})]):
        result = _run_session(monkeypatch, {a.name: _with_memory(growth) for a in arms}, arms)
        assert result["off"] is None and result["held"] is held, (arms, result["checks"])
        assert not any("within off's" in c["name"] for c in result["checks"])


def test_the_off_arm_is_the_baseline_when_it_runs_with_oea_off() -> None:
    arms = [("oea", {"OEA_K0": "3"}), ("off", {}), ("plain", {"OEA_METRICS_FILE": "m.jsonl"}),
            ("alias", {"SGLANG_OEA_K0": "3"})]
    assert off_arm(arms, "plain") == "plain" and off_arm(arms, "oea") == "off"
    assert off_arm([("oea", {"OEA_K0": "3"}), ("alias", {"SGLANG_OEA_K0": "3"})], "oea") is None
    assert off_arm([("off", {}), ("k0-empty", {"OEA_K0": ""})], "off") is None
