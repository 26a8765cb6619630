"""``oea soak``'s whole session (``oea.soak.session``) and its servers (``oea.soak.servers``) at the edges the
generated mutants of ``make mutation`` found unguarded (docs/testing.md, "Generated mutants"): which arms are
started, waited for, soaked and stopped (by their group, also on an error), with which arguments, environment,
log folder and process group; the engine a started server must say it is; the router shape the checks get; the
SIGTERM handler and its restoration; what is said; each arm's report and the summary written where documented,
never over a trace's sidecar; the checks' verdict; SGLang's numbering of the trace's decode steps.

Everything is stood in (the launcher, the server's answers, the soak of one arm, the checks): no server, no
engine, no network, no timing."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oea.soak import servers, session
from oea.soak.checks import Check
from oea.soak.monitor import ServerInfo, SoakError
from oea.soak.runner import SoakConfig
from oea.soak.servers import Arm
from oea.soak.session import SUMMARY_FIELDS, check_outputs, engine_checks, trace_numbered

CFG = SoakConfig(requests=10, duration_s=10)


def _report(info: ServerInfo, **extra: Any) -> dict[str, Any]:
    return {"sent": 10, "completed": 4, "refused": 1, "aborted": 5, "failed": 0, "soak_s": 2.4,
            "server": info.__dict__, "outcomes": [], **extra}


class Stage:
    """Stand-ins for what ``session.run`` calls: the launcher (``start``/``wait``/``stop``/``process_group``),
    ``identify``, ``soak_server`` and the checks, each call recorded in ``calls`` in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engines: dict[str, str] | None = None,
                 root: str = "", held: dict[str, tuple[bool, bool]] | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.engines = engines or {}  # arm name -> the engine its server says it is (default vllm)
        self.root = root
        self.held = held or {}  # arm name -> (held, verdict) of its one arm check
        self.fail_wait: dict[str, str] = {}
        self.fail_soak: set[str] = set()
        self.handler_in_soak: Any = None
        clock = itertools.count(100.0, 7.4)
        monkeypatch.setattr(session, "time", SimpleNamespace(monotonic=lambda: next(clock)))
        for name in ("start", "wait", "stop", "process_group", "identify", "soak_server", "arm_checks",
                     "across_arms", "metrics_checks", "trace_checks"):
            monkeypatch.setattr(session, name, getattr(self, name))

    def names(self, call: str) -> list[Any]:
        return [c[1] for c in self.calls if c[0] == call]

    def start(self, arm: Arm, engine_args: list[str], python: str | None, log_dir: Path, *, nice: int | None,
              engine: str, keep_engine_caches: bool) -> dict[str, str]:
        self.calls.append(("start", arm.name, engine_args, python, log_dir, nice, engine, keep_engine_caches))
        arm.server = SimpleNamespace(name=arm.name)
        arm.base_url = f"http://127.0.0.1:9/{arm.name}"
        return {"LEAK": arm.name}

    def wait(self, arm: Arm, timeout_s: float) -> None:
        self.calls.append(("wait", arm.name, timeout_s))
        if arm.name in self.fail_wait:
            raise RuntimeError(self.fail_wait[arm.name])

    def stop(self, arm: Arm) -> int:
        self.calls.append(("stop", arm.name, arm.server.name))
        return 0

    def process_group(self, arm: Arm) -> int:
        self.calls.append(("process_group", arm.name))
        return 4000 + len(self.calls)

    def identify(self, url: str) -> ServerInfo:
        name = url.rsplit("/", 1)[1]
        self.calls.append(("identify", name, url))
        return ServerInfo(url, self.engines.get(name, "vllm"), "m", 128, version="1.2", root=self.root)

    def soak_server(self, info: ServerInfo, cfg: SoakConfig, pgid: int | None) -> dict[str, Any]:
        name = info.base_url.rsplit("/", 1)[1]
        self.calls.append(("soak", name, cfg, pgid))
        self.handler_in_soak = signal.getsignal(signal.SIGTERM)
        if name in self.fail_soak:
            raise RuntimeError("soak broke")
        return _report(info, memory_after_warmup={"rss_mib": 1000.0}, memory_end={"rss_mib": 1010.5},
                       rss_growth_mib=10.5, extra_field="kept in the arm's report only")

    def arm_checks(self, name: str, report: dict[str, Any], *, memory_verdict: bool) -> list[Check]:
        self.calls.append(("arm_checks", name, memory_verdict, dict(report)))
        held, verdict = self.held.get(name, (True, True))
        return [Check(f"{name}: arm", held, "d", verdict)]

    def across_arms(self, baseline: str, reports: dict[str, Any], identical: Any, off: str | None) -> list[Check]:
        self.calls.append(("across_arms", baseline, sorted(reports), list(identical), off))
        return [Check("across", True, "x")]

    def metrics_checks(self, name: str, rows: list[Any], k0: int | None, *, top_k: int, num_experts: int
                       ) -> list[Check]:
        self.calls.append(("metrics_checks", name, rows, k0, top_k, num_experts))
        return [Check(f"{name}: metrics", True, "m")]

    def trace_checks(self, name: str, path: str, rows: list[Any], k0: int | None) -> list[Check]:
        self.calls.append(("trace_checks", name, path, rows, k0))
        return [Check(f"{name}: trace", True, "t")]


def _config(folder: Path, experts: int = 16, top_k: int = 4) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"num_experts": experts, "num_experts_per_tok": top_k}))
    return str(folder)


# -- which arms are started, waited for, soaked and stopped, with what -------------------------------------------

def test_started_arms_get_the_arguments_given_and_are_stopped_after_their_soak(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: Path) -> None:
    stage = Stage(monkeypatch, engines={"a": "sglang", "b": "sglang"})
    said: list[str] = []
    arms = [Arm("a", {"OEA_K0": "3", "X": "1"}), Arm("b", {})]
    result = session.run(arms, CFG, ["--port", "1"], python="py", out_dir=tmp_path / "out", health_timeout_s=12.5,
                         say=said.append, engine="sglang", nice=7, keep_engine_caches=True)
    assert [c[0] for c in stage.calls if c[0] in ("start", "wait", "identify", "process_group", "soak", "stop")] == [
        "start", "wait", "identify", "process_group", "soak", "stop"] * 2
    assert stage.calls[0] == ("start", "a", ["--port", "1"], "py", tmp_path / "out", 7, "sglang", True)
    assert ("wait", "a", 12.5) in stage.calls and ("wait", "b", 12.5) in stage.calls
    assert stage.names("identify") == ["a", "b"]
    assert next(c for c in stage.calls if c[0] == "identify")[2] == "http://127.0.0.1:9/a"
    assert [c[2] for c in stage.calls if c[0] == "stop"] == ["a", "b"]  # each by its own server (its group)
    soaks = [c for c in stage.calls if c[0] == "soak"]
    assert [c[2] for c in soaks] == [CFG, CFG]
    groups = [c for c in stage.calls if c[0] == "process_group"]
    assert soaks[0][3] == 4000 + stage.calls.index(groups[0]) + 1  # the group process_group gave
    assert result["reports"]["a"]["env"] == {"OEA_K0": "3", "X": "1"} and result["reports"]["b"]["env"] == {}
    assert result["reports"]["a"]["leak_check_env"] == {"LEAK": "a"}
    assert said == ["a: starting the server (OEA_K0=3 X=1)",
                    "a: sglang 1.2 at http://127.0.0.1:9/a ready after 7 s; soaking 10 requests",
                    "a: 10 sent, 4 completed, 1 refused, 5 aborted, 0 failed in 2 s",
                    "b: starting the server (no OEA)",
                    "b: sglang 1.2 at http://127.0.0.1:9/b ready after 7 s; soaking 10 requests",
                    "b: 10 sent, 4 completed, 1 refused, 5 aborted, 0 failed in 2 s"]


def test_the_defaults_start_vllm_with_no_arguments_and_wait_900_s(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    stage = Stage(monkeypatch)
    monkeypatch.chdir(tmp_path)
    result = session.run([Arm("a", {})], CFG)
    assert stage.calls[0] == ("start", "a", [], None, tmp_path / "oea-soak", None, "vllm", False)
    assert ("wait", "a", 900.0) in stage.calls
    assert result["baseline"] == "a" and result["held"] is True
    assert not (tmp_path / "oea-soak").exists() or not list((tmp_path / "oea-soak").glob("*.json"))


def test_attached_arms_are_neither_started_waited_for_nor_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, engines={"a": "sglang"})
    arms = [Arm("a", {}, base_url="http://127.0.0.1:9/a"), Arm("b", {}, base_url="http://127.0.0.1:9/b")]
    result = session.run(arms, CFG, engine="vllm", pgids={"a": 31})  # an attached server may be any engine
    assert [c[0] for c in stage.calls if c[0] in ("start", "wait", "stop", "process_group")] == []
    assert [c[3] for c in stage.calls if c[0] == "soak"] == [31, None]  # its named group, else none
    assert result["reports"]["a"]["leak_check_env"] == {} and result["reports"]["a"]["env"] == {}
    stage.calls.clear()
    session.run([Arm("c", {}, base_url="http://127.0.0.1:9/c")], CFG)  # no pgids at all
    assert [c[3] for c in stage.calls if c[0] == "soak"] == [None]


def test_a_started_server_of_another_engine_is_refused_and_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, engines={"a": "sglang"})
    with pytest.raises(SoakError) as err:
        session.run([Arm("a", {})], CFG, engine="vllm")
    assert str(err.value) == ("a: started a vllm server, but http://127.0.0.1:9/a says it is sglang "
                              "(GET /v1/models owned_by)")
    assert stage.names("stop") == ["a"] and stage.names("soak") == []


def test_a_server_that_never_answers_is_a_soak_error_naming_its_log(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    stage = Stage(monkeypatch)
    stage.fail_wait["b"] = "server exited with 1; log tail:\nline 1\nline 2"
    with pytest.raises(SoakError) as err:
        session.run([Arm("a", {}), Arm("b", {})], CFG, out_dir=tmp_path)
    assert str(err.value) == (f"b: server exited with 1 (its log: {tmp_path / 'b.log'}; the arms before it are in "
                              f"{tmp_path})")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert stage.names("stop") == ["a", "b"] and stage.names("soak") == ["a"]
    assert (tmp_path / "a.json").exists() and not (tmp_path / "soak.json").exists()


def test_a_soak_that_raises_still_stops_its_server_and_restores_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch)
    stage.fail_soak.add("a")

    def mine(_signum: int, _frame: object) -> None:
        return None

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with pytest.raises(RuntimeError, match="soak broke"):
            session.run([Arm("a", {})], CFG)
        assert stage.names("stop") == ["a"]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_during_the_soak_raises_keyboard_interrupt_and_is_restored_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch)

    def mine(_signum: int, _frame: object) -> None:
        return None

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        session.run([Arm("a", {})], CFG)
        assert signal.getsignal(signal.SIGTERM) is mine
        handler = stage.handler_in_soak
        assert callable(handler) and handler is not mine
        with pytest.raises(KeyboardInterrupt) as err:
            handler(signal.SIGTERM, None)
        assert str(err.value) == f"signal {int(signal.SIGTERM)}"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_on_sigterm_returns_the_handler_it_replaced() -> None:
    def mine(_signum: int, _frame: object) -> None:
        return None

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert session._stop_on_sigterm() is mine
        assert signal.getsignal(signal.SIGTERM) is not mine
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- baseline, OEA off, the verdict ------------------------------------------------------------------------------

def test_the_baseline_and_identical_arms_must_be_arms(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch)
    arms = [Arm("a", {}, base_url="http://127.0.0.1:9/a"), Arm("b", {}, base_url="http://127.0.0.1:9/b")]
    with pytest.raises(ValueError) as err:
        session.run(arms, CFG, baseline="c")
    assert str(err.value) == "--baseline / --identical-outputs name 'c' is not an arm (['a', 'b'])"
    with pytest.raises(ValueError, match="name 'z' is not an arm"):
        session.run(arms, CFG, identical=["a", "z"])
    assert stage.calls == []
    result = session.run(arms, CFG, baseline="b", identical=["a"])
    assert result["baseline"] == "b"
    assert [c for c in stage.calls if c[0] == "across_arms"] == [("across_arms", "b", ["a", "b"], ["a"], None)]


def test_checks_across_arms_run_with_two_arms_or_identical_outputs_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch)
    one = [Arm("a", {}, base_url="http://127.0.0.1:9/a")]
    result = session.run(one, CFG)
    assert stage.names("across_arms") == [] and [c["name"] for c in result["checks"]] == ["a: arm"]
    result = session.run(one, CFG, identical=["a"])
    assert stage.names("across_arms") == ["a"] and [c["name"] for c in result["checks"]] == ["a: arm", "across"]


def test_off_is_judged_only_among_arms_whose_memory_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started arms and attached arms with a named group count; an attached arm without one does not."""
    stage = Stage(monkeypatch)
    oea = {"OEA_K0": "3"}

    def off(arms: list[Arm], pgids: dict[str, int] | None = None) -> tuple[Any, list[bool]]:
        stage.calls.clear()
        result = session.run(arms, CFG, pgids=pgids)
        verdicts = [c[2] for c in stage.calls if c[0] == "arm_checks"]
        return result["off"], verdicts

    assert off([Arm("off", {}), Arm("oea", dict(oea))]) == ("off", [False, False])
    assert off([Arm("off", {}, base_url="http://127.0.0.1:9/off"), Arm("oea", dict(oea))]) == (None, [True, True])
    assert off([Arm("off", {}, base_url="http://127.0.0.1:9/off"), Arm("oea", dict(oea))],
               pgids={"off": 5}) == ("off", [False, False])
    assert off([Arm("off", {}), Arm("oea", dict(oea), base_url="http://127.0.0.1:9/oea")],
               pgids={"x": 5}) == (None, [True, True])
    across = [c for c in stage.calls if c[0] == "across_arms"]
    assert across == [("across_arms", "off", ["oea", "off"], [], None)]


def test_the_baseline_is_the_off_arm_when_it_runs_with_oea_off(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch)
    arms = [Arm("first", {}), Arm("oea", {"OEA_K0": "3"}), Arm("second", {})]
    assert session.run(arms, CFG, baseline="second")["off"] == "second"
    assert [c[4] for c in stage.calls if c[0] == "across_arms"] == ["second"]
    assert session.run([Arm("first", {}), Arm("oea", {"OEA_K0": "3"}), Arm("second", {})], CFG,
                       baseline="oea")["off"] == "first"


def test_the_verdict_counts_only_checks_that_are_part_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    arms = [Arm("a", {}, base_url="http://127.0.0.1:9/a")]
    Stage(monkeypatch, held={"a": (False, False)})
    result = session.run(arms, CFG)
    assert result["held"] is True and result["checks"] == [
        {"name": "a: arm", "held": False, "detail": "d", "verdict": False}]
    Stage(monkeypatch, held={"a": (False, True)})
    assert session.run(arms, CFG)["held"] is False


# -- what is written, and the summary ----------------------------------------------------------------------------

def test_each_arms_report_and_the_summary_are_written_to_out_dir(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    Stage(monkeypatch)
    out = tmp_path / "deep" / "out"
    arms = [Arm("a", {"OEA_K0": "2"}), Arm("b", {}, base_url="http://127.0.0.1:9/b")]
    result = session.run(arms, CFG, out_dir=out, pgids={"b": 9})
    for name in ("a", "b"):
        text = (out / f"{name}.json").read_text()
        assert text == json.dumps(result["reports"][name], indent=1) + "\n"
        assert json.loads(text)["extra_field"] == "kept in the arm's report only"
    summary = {k: v for k, v in result.items() if k != "reports"}
    assert (out / "soak.json").read_text() == json.dumps(summary, indent=1) + "\n"
    assert set(summary) == {"arms", "baseline", "off", "checks", "held"}
    assert summary["off"] == "b" and summary["baseline"] == "a"
    assert summary["checks"] == [{"name": "a: arm", "held": True, "detail": "d", "verdict": True},
                                 {"name": "b: arm", "held": True, "detail": "d", "verdict": True},
                                 {"name": "across", "held": True, "detail": "x", "verdict": True}]
    assert summary["arms"]["a"] == {
        "sent": 10, "completed": 4, "refused": 1, "aborted": 5, "failed": 0, "soak_s": 2.4, "rss_growth_mib": 10.5,
        "leak_check_env": {"LEAK": "a"}, "rss_after_warmup_mib": 1000.0, "rss_end_mib": 1010.5,
        "server": result["reports"]["a"]["server"]}
    assert "extra_field" not in summary["arms"]["a"] and "env" not in summary["arms"]["a"]


def test_the_summary_keeps_every_summary_field_present_and_the_server() -> None:
    report = {k: i for i, k in enumerate(SUMMARY_FIELDS)} | {"server": {"engine": "vllm"}, "other": 1}
    assert session._summary(report) == {k: i for i, k in enumerate(SUMMARY_FIELDS)} | {"server": {"engine": "vllm"}}
    assert session._summary({"server": "s", "sent": 1}) == {"sent": 1, "server": "s"}
    memory = {"server": "s", "memory_after_warmup": {"rss_mib": 1.5}, "memory_end": {"rss_mib": 2.5}}
    assert session._summary(memory) == {"rss_after_warmup_mib": 1.5, "rss_end_mib": 2.5, "server": "s"}


def test_a_trace_sidecar_in_out_dir_is_refused_before_any_server_starts(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    stage = Stage(monkeypatch)
    arms = [Arm("a", {"OEA_TRACE_FILE": str(tmp_path / "b.safetensors")}), Arm("b", {})]
    with pytest.raises(SoakError, match="OEA_TRACE_FILE"):
        session.run(arms, CFG, out_dir=tmp_path)
    assert stage.calls == []


# -- check_outputs -------------------------------------------------------------------------------------------------

def test_a_sidecar_that_a_report_would_overwrite_is_refused_with_a_name_to_use(tmp_path: Path) -> None:
    trace = tmp_path / "soak.safetensors"
    with pytest.raises(SoakError) as err:
        check_outputs([Arm("a", {}), Arm("oea", {"OEA_TRACE_FILE": str(trace)})], tmp_path)
    assert str(err.value) == (f"--arm oea: OEA_TRACE_FILE={trace} keeps its description in {tmp_path / 'soak.json'}, "
                              f"a file --out {tmp_path} writes a report to; name the trace otherwise (e.g. "
                              f"{tmp_path / 'soak-trace.safetensors'})")
    with pytest.raises(SoakError, match="--arm b: "):  # another arm's report
        check_outputs([Arm("a", {}), Arm("b", {"OEA_TRACE_FILE": str(tmp_path / "a.safetensors")})], tmp_path)
    check_outputs([Arm("b", {"OEA_TRACE_FILE": str(tmp_path / "a.safetensors")})], tmp_path)  # no arm a
    check_outputs([Arm("a", {"OEA_TRACE_FILE": str(trace)})], None)  # nothing written
    check_outputs([Arm("a", {"OEA_TRACE_FILE": ""})], tmp_path)  # no trace


def test_a_sidecar_is_compared_with_the_reports_as_resolved_paths(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SoakError):
        check_outputs([Arm("a", {"OEA_TRACE_FILE": "soak.safetensors"})], tmp_path / "x" / "..")
    with pytest.raises(SoakError):
        check_outputs([Arm("a", {"OEA_TRACE_FILE": str(tmp_path / "a.safetensors")})], Path("."))


# -- engine_checks and SGLang's numbering --------------------------------------------------------------------------

def test_engine_checks_read_the_metrics_and_trace_files_the_arm_names(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    stage = Stage(monkeypatch)
    metrics = tmp_path / "m.jsonl"
    rows = [{"pid": 1, "step": 5, "decode": False}, {"pid": 1, "step": 6, "decode": True}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arm = Arm("a", {"OEA_K0": "3", "OEA_METRICS_FILE": str(metrics), "OEA_TRACE_FILE": "t.safetensors"})
    checks = engine_checks(arm, (16, 4))
    assert [c.name for c in checks] == ["a: metrics", "a: trace"]
    assert stage.calls == [("metrics_checks", "a", rows, 3, 4, 16), ("trace_checks", "a", "t.safetensors", rows, 3)]
    stage.calls.clear()
    engine_checks(arm, (16, 4), "sglang")  # the trace gets SGLang's decode numbering
    assert stage.calls[1] == ("trace_checks", "a", "t.safetensors", [rows[0], {**rows[1], "step": 1}], 3)


def test_engine_checks_without_a_shape_or_without_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stage = Stage(monkeypatch)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 1, "decode": True}) + "\n" + json.dumps({"step": 2, "decode": True}))
    assert engine_checks(Arm("a", {"OEA_METRICS_FILE": str(metrics)}), None) == [
        Check("a: metrics rows consistent", True,
              "2 steps; expert bounds not checked (no config.json gives N and top_k)")]
    assert engine_checks(Arm("a", {"OEA_METRICS_FILE": str(tmp_path / "none.jsonl")}), None) == [
        Check("a: metrics rows consistent", False,
              "0 steps; expert bounds not checked (no config.json gives N and top_k)")]
    assert engine_checks(Arm("a", {}), (16, 4)) == [] and stage.calls == []
    assert engine_checks(Arm("a", {"OEA_METRICS_FILE": ""}), (16, 4)) == []
    engine_checks(Arm("a", {"OEA_TRACE_FILE": "t.safetensors"}), None, "sglang")
    assert stage.calls == [("trace_checks", "a", "t.safetensors", [], None)]


def test_the_router_shape_comes_from_the_server_arguments_else_the_served_root(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    args_model = _config(tmp_path / "args", 16, 4)
    root_model = _config(tmp_path / "root", 64, 8)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 1, "decode": True}) + "\n")

    def shapes(engine_args: list[str] | None, root: str) -> list[tuple[int, int]]:
        stage = Stage(monkeypatch, root=root)
        session.run([Arm("a", {"OEA_METRICS_FILE": str(metrics)}, base_url="http://127.0.0.1:9/a")], CFG,
                    engine_args)
        return [(c[5], c[4]) for c in stage.calls if c[0] == "metrics_checks"]

    assert shapes(["--model", args_model], root_model) == [(16, 4)]
    assert shapes(["--port", "1"], root_model) == [(64, 8)]
    assert shapes(None, root_model) == [(64, 8)]


def test_the_engine_the_server_says_numbers_sglangs_trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"pid": 1, "step": 7, "decode": True}) + "\n")
    stage = Stage(monkeypatch, engines={"a": "sglang"})
    session.run([Arm("a", {"OEA_METRICS_FILE": str(metrics), "OEA_TRACE_FILE": "t"},
                     base_url="http://127.0.0.1:9/a")], CFG)
    assert [c[3] for c in stage.calls if c[0] == "trace_checks"] == [[{"pid": 1, "step": 1, "decode": True}]]


def test_sglang_numbering_counts_a_missing_rank_as_rank_0_and_separates_processes() -> None:
    rows = [{"pid": 1, "step": 3, "decode": True}, {"pid": 1, "rank": 0, "step": 4, "decode": True},
            {"pid": 2, "step": 4, "decode": True}, {"step": 9, "decode": True}, {"step": 9, "decode": False},
            {"step": 10, "decode": True}]
    assert [r["step"] for r in trace_numbered(rows, "sglang")] == [1, 2, 1, 1, 9, 2]
    assert rows[0]["step"] == 3  # the caller's rows are left as they are
    numbered = trace_numbered(rows, "vllm")
    assert numbered == rows and numbered is not rows
    assert trace_numbered(rows, "SGLANG") == rows


# -- servers: the arms, the server arguments, the interpreter --------------------------------------------------------

def test_an_arms_k0_is_its_oea_k0_and_its_environment_its_own() -> None:
    assert Arm("a", {"OEA_K0": "3"}).k0 == 3
    assert Arm("a", {"OEA_K0": ""}).k0 is None and Arm("a").k0 is None
    first, second = Arm("a"), Arm("b")
    first.env["X"] = "1"
    assert second.env == {} and (second.server, second.base_url) == (None, None)


def test_arms_are_parsed_with_unique_names_and_a_k0_of_at_least_1() -> None:
    arms = servers.parse_arms(["off=", "oea=OEA_K0=1 OEA_METRICS_FILE=m.jsonl", "wide=OEA_K0=' 12'"])
    assert [(a.name, a.env) for a in arms] == [("off", {}), ("oea", {"OEA_K0": "1", "OEA_METRICS_FILE": "m.jsonl"}),
                                               ("wide", {"OEA_K0": " 12"})]
    with pytest.raises(SoakError) as err:
        servers.parse_arms(["noname"])
    assert str(err.value) == ("--arm must be NAME=ENV (ENV: space-separated VAR=VALUE, may be empty), got 'noname'")
    with pytest.raises(SoakError) as err:
        servers.parse_arms(["a=", "b=", "a=X=1"])
    assert str(err.value) == "--arm names must be unique, got 'a' twice"
    for k0 in ("0", "-1", "x", "", "1.5"):
        with pytest.raises(SoakError) as err:
            servers.parse_arms([f"a=OEA_K0='{k0}'"])
        assert str(err.value) == f"--arm a: OEA_K0 must be an integer >= 1, got {k0!r}"


def test_server_arguments_must_bind_loopback_and_name_a_port() -> None:
    for host in ([], ["--host", "127.0.0.1"], ["--host", "localhost"], ["--host=::1"]):
        servers.check_engine_args([*host, "--port", "1"])
    with pytest.raises(SoakError) as err:
        servers.check_engine_args(["--host", "0.0.0.0", "--port", "1"])
    assert str(err.value) == ("--host 0.0.0.0: the soak's servers bind 127.0.0.1 only (they get malformed and aborted "
                              "requests); drop --host")
    with pytest.raises(SoakError) as err:
        servers.check_engine_args(["--model", "m"])
    assert str(err.value) == "give the server a --port after '--' (e.g. -- --model DIR --port 8077)"


def test_an_unknown_engine_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SoakError) as err:
        servers.engine_of([], "trt")
    assert str(err.value) == "--engine must be one of vllm, sglang, got 'trt'"
    assert servers.engine_of(["--model-path", "m"], "vllm") == "vllm"
    assert servers.engine_of(["--model-path", "m"]) == "sglang"


def test_the_interpreter_is_named_from_any_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert servers.interpreter(None) == sys.executable
    assert servers.interpreter("python3") == "python3"
    assert servers.interpreter(os.path.join("venv", "bin", "python")) == str(tmp_path / "venv" / "bin" / "python")


def test_an_sglang_cpu_server_needs_the_stand_in_when_its_interpreter_lacks_sgl_kernel(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert servers.needs_stand_in(["--device", "cuda"], "/nonexistent/python") is False
    assert servers.needs_stand_in([], "/nonexistent/python") is False
    assert servers.needs_stand_in(["--device", "cpu"], str(tmp_path / "no-python")) is True  # OSError
    has = importlib.util.find_spec("sgl_kernel") is not None
    assert servers.needs_stand_in(["--device", "cpu"], sys.executable) is (not has)
    calls: list[tuple[Any, ...]] = []

    def run(args: list[str], **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        if args[0] == "slow":
            raise subprocess.TimeoutExpired(args, 120)
        return SimpleNamespace(returncode=0 if args[0] == "has" else 1)

    monkeypatch.setattr(servers.subprocess, "run", run)
    assert servers.needs_stand_in(["--device", "cpu"], "has") is False
    assert servers.needs_stand_in(["--device", "cpu"], "lacks") is True
    assert servers.needs_stand_in(["--device", "cpu"], "slow") is True
    assert calls[0] == (["has", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('sgl_kernel') "
                                      "is None)"], {"capture_output": True, "timeout": 120})


# -- servers: start, wait, stop, the process group ------------------------------------------------------------------

class Launcher:
    """``oea.launch``'s start, wait and stop functions stood in, each call recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[Any, ...]] = []
        monkeypatch.setattr("oea.launch.vllm.start_server", self.start_vllm)
        monkeypatch.setattr("oea.launch.sglang_server.start_server", self.start_sglang)
        monkeypatch.setattr("oea.launch.vllm.wait_healthy", self.wait_healthy)
        monkeypatch.setattr("oea.launch.vllm.stop_server", self.stop_server)
        monkeypatch.setattr(servers, "needs_stand_in", lambda args, python: ("stand-in?", tuple(args), python))

    def start_vllm(self, args: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        self.calls.append(("vllm", args, env, kwargs))
        return SimpleNamespace(base_url="http://127.0.0.1:1")

    def start_sglang(self, args: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        self.calls.append(("sglang", args, env, kwargs))
        return SimpleNamespace(base_url="http://127.0.0.1:2")

    def wait_healthy(self, server: Any, **kwargs: Any) -> None:
        self.calls.append(("wait", server, kwargs))

    def stop_server(self, server: Any) -> int:
        self.calls.append(("stop", server))
        return 3


def test_a_started_server_gets_the_arms_variables_on_this_environment_without_oea(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    launcher = Launcher(monkeypatch)
    for name, value in (("OEA_K0", "5"), ("SGLANG_OEA_K0", "5"), ("OEA_METRICS_FILE", "x"), ("KEEP_ME", "1"),
                        ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    arm = Arm("a", {"OEA_K0": "3", "Y": "2"})
    logs = tmp_path / "logs" / "deep"
    leak = servers.start(arm, ["--port", "1"], "bin/py", logs, nice=5)
    assert leak == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"} and logs.is_dir()
    (kind, args, env, kwargs), = launcher.calls
    assert (kind, args) == ("vllm", ["--port", "1"])
    assert kwargs == {"python": str(tmp_path / "bin" / "py"), "log_path": logs / "a.log", "nice": 5}
    assert env["KEEP_ME"] == "1" and env["Y"] == "2" and env["OEA_K0"] == "3"
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert "OEA_METRICS_FILE" not in env and "SGLANG_OEA_K0" not in env
    assert arm.server is not None and arm.base_url == "http://127.0.0.1:1"


def test_the_leak_check_variables_yield_to_the_arms_and_to_keep_engine_caches(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    launcher = Launcher(monkeypatch)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    own = Arm("a", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"})
    assert servers.start(own, ["--port", "1"], None, tmp_path) == {}
    assert launcher.calls[-1][2]["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
    assert launcher.calls[-1][3]["python"] == sys.executable and launcher.calls[-1][3]["nice"] is None
    assert servers.start(Arm("b", {}), ["--port", "1"], None, tmp_path, keep_engine_caches=True) == {}
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in launcher.calls[-1][2]


def test_an_sglang_arm_starts_sglangs_launcher_with_the_stand_in_when_needed(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    launcher = Launcher(monkeypatch)
    arm = Arm("s", {})
    args = ["--port", "1", "--device", "cpu"]
    servers.start(arm, args, "python3", tmp_path, nice=3, engine="sglang")
    (kind, given, _env, kwargs), = launcher.calls
    assert (kind, given) == ("sglang", args) and given is not args
    assert kwargs == {"python": "python3", "log_path": tmp_path / "s.log", "nice": 3,
                      "stand_in": ("stand-in?", tuple(args), "python3")}
    assert arm.base_url == "http://127.0.0.1:2"


def test_a_server_on_a_public_host_is_never_started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    launcher = Launcher(monkeypatch)
    with pytest.raises(SoakError, match="--host"):
        servers.start(Arm("a", {}), ["--host", "0.0.0.0", "--port", "1"], None, tmp_path / "logs")
    assert launcher.calls == [] and not (tmp_path / "logs").exists()


def test_wait_and_stop_hand_the_arms_server_to_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = Launcher(monkeypatch)
    server = SimpleNamespace()
    servers.wait(Arm("a", server=server), 12.5)
    assert servers.stop(Arm("a", server=server)) == 3
    assert servers.stop(Arm("b")) is None
    assert launcher.calls == [("wait", server, {"timeout": 12.5}), ("stop", server)]


def test_the_process_group_is_the_servers_while_it_runs() -> None:
    assert servers.process_group(Arm("a")) is None
    me = Arm("a", server=SimpleNamespace(process=SimpleNamespace(pid=os.getpid())))
    assert servers.process_group(me) == os.getpgid(0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)  # reaped: its pid names no process
    assert servers.process_group(Arm("a", server=SimpleNamespace(process=child))) is None


# -- servers: the model folder and its router shape ----------------------------------------------------------------

def test_the_model_folder_is_vllms_model_or_sglangs_model_path() -> None:
    assert servers.model_arg(["--model", "/m", "--model-path", "/p"]) == "/m"
    assert servers.model_arg(["--model-path", "/p"]) == "/p"
    assert servers.model_arg(None) is None and servers.model_arg([]) is None


def test_the_router_shape_is_read_from_config_json(tmp_path: Path) -> None:
    def shape(config: Any) -> Any:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        return servers.router_shape(str(tmp_path))

    assert shape({"num_experts": 16, "num_experts_per_tok": 4}) == (16, 4)
    assert shape({"num_local_experts": 8, "num_experts_per_tok": 2}) == (8, 2)
    assert shape({"n_routed_experts": 64, "num_experts_per_tok": 6}) == (64, 6)
    every = {"num_experts": 16, "num_local_experts": 8, "n_routed_experts": 4, "num_experts_per_tok": 2}
    assert shape(every) == (16, 2)
    assert shape({"num_local_experts": 8, "n_routed_experts": 4, "num_experts_per_tok": 2}) == (8, 2)
    assert shape({"text_config": {"num_experts": 32, "num_experts_per_tok": 4}, "num_experts": 1}) == (32, 4)
    assert shape({"num_experts": 16}) is None
    assert shape({"num_experts_per_tok": 4}) is None
    assert shape({"num_experts": "16", "num_experts_per_tok": 4}) is None
    assert shape({"num_experts": 16, "num_experts_per_tok": 4.0}) is None
    assert shape("{not json") is None
    assert servers.router_shape(str(tmp_path / "missing")) is None
    assert servers.router_shape(None) is None and servers.router_shape("") is None
