"""``oea.launch.server_process``, the launcher every engine's server goes through, at the edges the generated mutants
of ``make mutation`` found unguarded (docs/testing.md, "Generated mutants"): ``stop_servers``' one grace period for
all servers (each wait gets what is left of it, never less than nothing), the default of 20 s, the SIGKILL to every
group whether or not its leader exited, the last wait for a leader that outlived the grace, a server that does not
lead its group, a group already gone.

The processes, their groups and the clock are stood in (every wait's timeout and every signal recorded, in order),
and one real child in its own process group that ignores SIGTERM shows the grace is waited out before SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from fake_servers import QuietHandler, serving
from server_harness import free_port

from oea.launch import server_process
from oea.launch.server_process import Server, signal_server, start_process, stop_server, stop_servers


class Stage:
    """Stand-ins for the processes' groups (``os.getpgid``, ``os.killpg``) and the clock ``stop_servers`` reads;
    ``events`` records every signal, terminate and wait, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, clock: list[float], groups: dict[int, int],
                 gone: frozenset[int] = frozenset()) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.groups = groups  # pid -> its process group; a pid not in it has exited and been reaped
        self.gone = gone  # groups with no process left: killpg raises
        self.clock = clock
        monkeypatch.setattr(os, "getpgid", self.getpgid)
        monkeypatch.setattr(os, "killpg", self.killpg)
        monkeypatch.setattr(server_process, "time", SimpleNamespace(monotonic=lambda: self.clock.pop(0)))

    def getpgid(self, pid: int) -> int:
        if pid not in self.groups:
            raise ProcessLookupError(pid)
        return self.groups[pid]

    def killpg(self, pgid: int, sig: int) -> None:
        self.events.append(("killpg", pgid, sig))
        if pgid in self.gone:
            raise ProcessLookupError(pgid)

    def server(self, pid: int, exits: list[int | None], running: bool = True) -> Server:
        return Server(FakeProcess(self, pid, exits, running), f"http://127.0.0.1:9/{pid}", None,  # type: ignore[arg-type]
                      f"server {pid}")


class FakeProcess:
    """A stand-in ``subprocess.Popen``: ``exits`` is what each ``wait`` does in turn (an exit code, or None: the
    wait runs out); ``running`` is what ``poll`` sees before any wait."""

    def __init__(self, stage: Stage, pid: int, exits: list[int | None], running: bool) -> None:
        self.stage, self.pid, self.exits, self.running = stage, pid, list(exits), running
        self.returncode: int | None = None if running else 0

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.stage.events.append(("terminate", self.pid))

    def wait(self, timeout: float | None = None) -> int:
        self.stage.events.append(("wait", self.pid, timeout))
        code = self.exits.pop(0)
        if code is None:
            raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
        self.returncode = code
        return code


TERM, KILL = signal.SIGTERM, signal.SIGKILL


def test_the_default_grace_is_twenty_seconds_then_twenty_more_after_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, [50.0, 50.0, 80.0, 80.0], {7: 7})
    assert stop_server(stage.server(7, [None, -9])) == -9
    assert stop_servers([stage.server(7, [None, -9])]) == [-9]
    one = [("killpg", 7, TERM), ("wait", 7, 20.0), ("killpg", 7, KILL), ("wait", 7, 20.0)]
    assert stage.events == one + one
    stage.clock[:] = [0.0, 0.0]
    stage.events.clear()
    assert stop_server(stage.server(7, [None, -9]), grace=3.0) == -9  # stop_server hands its grace on
    assert stage.events == [("killpg", 7, TERM), ("wait", 7, 3.0), ("killpg", 7, KILL), ("wait", 7, 3.0)]


def test_all_servers_share_one_grace_period_and_each_group_is_killed_after_its_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM to every group, then each wait gets what is left of the one grace period (0 once it is over: a
    leader that has exited is still reaped at once), SIGKILL to each group right after its wait, also when its
    leader exited; a leader that outlived the grace gets one more ``grace`` to be reaped."""
    stage = Stage(monkeypatch, [100.0, 103.5, 112.0, 112.0], {10: 10, 20: 20, 30: 30})
    servers = [stage.server(10, [0]), stage.server(20, [None, -9]), stage.server(30, [1])]
    assert stop_servers(servers, grace=10.0) == [0, -9, 1]
    assert stage.events == [
        ("killpg", 10, TERM), ("killpg", 20, TERM), ("killpg", 30, TERM),
        ("wait", 10, 6.5), ("killpg", 10, KILL),
        ("wait", 20, 0.0), ("killpg", 20, KILL),
        ("wait", 30, 0.0), ("killpg", 30, KILL),
        ("wait", 20, 10.0),
    ]


def test_a_leader_that_cannot_be_reaped_is_none_and_the_others_keep_their_codes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, [0.0, 1.0, 2.0], {5: 5, 6: 6})
    assert stop_servers([stage.server(5, [None, None]), stage.server(6, [3])], grace=4.0) == [None, 3]
    assert [e for e in stage.events if e[0] == "wait"] == [("wait", 5, 3.0), ("wait", 6, 2.0), ("wait", 5, 4.0)]


def test_a_server_outside_its_own_group_is_terminated_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader-less server (its group led by another process) is terminated while it runs, left alone once it
    has exited; no group is signalled for it, before or after the wait; a process already reaped (no group to
    look up) is treated the same."""
    stage = Stage(monkeypatch, [0.0, 0.0, 0.0, 0.0], {40: 1, 41: 1})
    servers = [stage.server(40, [None, -15]), stage.server(41, [0], running=False), stage.server(42, [2])]
    assert stop_servers(servers, grace=3.0) == [-15, 0, 2]
    assert stage.events == [("terminate", 40), ("terminate", 42), ("wait", 40, 3.0), ("wait", 41, 3.0),
                            ("wait", 42, 3.0), ("wait", 40, 3.0)]


def test_a_group_already_gone_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, [0.0, 0.0], {8: 8}, gone=frozenset({8}))
    assert stop_servers([stage.server(8, [0])], grace=1.0) == [0]
    assert stage.events == [("killpg", 8, TERM), ("wait", 8, 1.0), ("killpg", 8, KILL)]
    signal_server(stage.server(8, []), signal.SIGINT)
    assert stage.events[-1] == ("killpg", 8, signal.SIGINT)


def test_signal_server_signals_the_leaders_whole_group(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, [], {})
    signal_server(stage.server(77, []), signal.SIGUSR1)
    assert stage.events == [("killpg", 77, signal.SIGUSR1)]


_IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def test_a_real_server_that_ignores_sigterm_is_killed_once_the_grace_is_over(tmp_path: Path) -> None:
    server = start_process([sys.executable, "-c", _IGNORES_SIGTERM], {"PATH": os.environ.get("PATH", "/usr/bin")},
                           f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "log", name="stubborn")
    try:
        deadline = time.monotonic() + 60
        while "ready" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.getpgid(server.process.pid) == server.process.pid  # it leads its own group
        started = time.monotonic()
        assert stop_servers([server], grace=0.4) == [-signal.SIGKILL]
        assert time.monotonic() - started >= 0.39  # the grace was waited out before SIGKILL
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=10)


# ---------------------------------------------------------------- the rest of the launcher


def test_a_log_tail_is_the_last_lines_of_the_log_or_nothing(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(50)) + b"bad \xff byte")
    server = Server(None, "u", log)  # type: ignore[arg-type]
    assert server.name == "server"
    assert server.log_tail() == "\n".join([f"line {i}" for i in range(11, 50)] + ["bad \ufffd byte"])
    assert server.log_tail(2) == "line 49\nbad \ufffd byte"
    assert Server(None, "u", tmp_path / "missing.log").log_tail() == ""  # type: ignore[arg-type]
    assert Server(None, "u", None).log_tail() == ""  # type: ignore[arg-type]


def test_strip_separator_drops_one_leading_double_dash_only() -> None:
    assert server_process.strip_separator(("--", "--port", "--")) == ["--port", "--"]
    assert server_process.strip_separator(["--"]) == []
    assert server_process.strip_separator(["--port", "--", "x"]) == ["--port", "--", "x"]
    assert server_process.strip_separator([]) == []


def test_oea_env_sets_or_removes_the_oea_variables_of_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"OEA_K0": "9", "SGLANG_OEA_K0": "9", "OEA_MIN_BATCH": "4", "KEEP": "1"}
    assert server_process.oea_env(None, None, base) == {"OEA_MIN_BATCH": "4", "KEEP": "1"}
    assert server_process.oea_env(1, 0, base) == {"OEA_K0": "1", "OEA_MIN_BATCH": "0", "KEEP": "1"}
    assert base == {"OEA_K0": "9", "SGLANG_OEA_K0": "9", "OEA_MIN_BATCH": "4", "KEEP": "1"}  # never changed
    monkeypatch.setenv("SGLANG_OEA_K0", "2")
    monkeypatch.setenv("OEA_PROBE_VAR", "here")
    env = server_process.oea_env(k0=5)
    assert env["OEA_K0"] == "5" and "SGLANG_OEA_K0" not in env and env["OEA_PROBE_VAR"] == "here"
    assert os.environ["SGLANG_OEA_K0"] == "2"  # this process's environment is left as it was
    with pytest.raises(ValueError) as refused:
        server_process.oea_env(0, None, {})
    assert str(refused.value) == "--k0 must be an integer >= 1, got 0"
    with pytest.raises(ValueError) as refused:
        server_process.oea_env(None, -1, {})
    assert str(refused.value) == "--min-batch must be an integer >= 0, got -1"


def test_option_takes_a_value_only_where_there_is_one() -> None:
    assert server_process.option(["--port"], "--port") is None  # a flag without its value
    assert server_process.option(["--host", "h", "--port", "1"], "--port") == "1"  # a value that is the last arg
    assert server_process.option(["--port", "1", "--port"], "--port") == "1"
    assert server_process.option(["--url=http://h/?a=b"], "--url") == "http://h/?a=b"


class RecordingPopen:
    """A stand-in ``subprocess.Popen`` that records how it was called (``raises``: what it raises instead)."""

    calls: ClassVar[list[dict[str, Any]]] = []
    raises: ClassVar[BaseException | None] = None

    def __init__(self, args: list[str], **kwargs: Any) -> None:
        if self.raises is not None:
            raise self.raises
        stdout = kwargs["stdout"]
        type(self).calls.append({"args": args, **kwargs, "stdout": None if stdout is None else stdout.name,
                                 "stdout_closed_after": stdout})
        self.pid = 4242


def test_start_process_runs_the_command_in_a_new_session_with_exactly_its_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(RecordingPopen, "calls", [])
    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    priorities: list[tuple[int, str]] = []
    monkeypatch.setattr("oea.launch.priority.set_priority", lambda nice, flag: priorities.append((nice, flag)))
    log = tmp_path / "deep" / "er" / "server.log"
    log.parent.mkdir(parents=True)
    log.write_text("an old run's log")
    server = start_process(("python", "-m", "x"), {"A": "1"}, "http://h:1", log_path=str(log), cwd=tmp_path,
                           nice=19, name="Fake server")
    assert (server.base_url, server.log_path, server.name, server.process.pid) == ("http://h:1", log,
                                                                                     "Fake server", 4242)
    assert log.read_text() == ""  # truncated
    call = RecordingPopen.calls[0]
    assert call["args"] == ["python", "-m", "x"] and call["env"] == {"A": "1"} and call["cwd"] == str(tmp_path)
    assert call["stdin"] == subprocess.DEVNULL and call["stdout"] == str(log) and call["stderr"] == subprocess.STDOUT
    assert call["start_new_session"] is True and call["stdout_closed_after"].closed
    call["preexec_fn"]()
    assert priorities == [(19, "--server-nice")]
    fresh = start_process(["x"], {}, "http://h:2", log_path=tmp_path / "new" / "dirs" / "s.log", nice=-20)
    assert fresh.log_path == tmp_path / "new" / "dirs" / "s.log" and fresh.log_path.exists()
    RecordingPopen.calls[1]["preexec_fn"]()
    assert priorities[-1] == (-20, "--server-nice")
    bare = start_process(["x"], {}, "http://h:3")
    assert bare.log_path is None and bare.name == "server"
    call = RecordingPopen.calls[2]
    assert call["stdout"] is None and call["stderr"] is None and call["cwd"] is None and call["preexec_fn"] is None


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_priority_out_of_range_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                   nice: int) -> None:
    monkeypatch.setattr(RecordingPopen, "calls", [])
    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    with pytest.raises(ValueError) as refused:
        start_process(["x"], {}, "u", nice=nice)
    assert str(refused.value) == f"--server-nice must be in -20..19, got {nice}"
    assert RecordingPopen.calls == []


def test_a_priority_the_system_refuses_is_a_one_line_error_naming_the_flag(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    monkeypatch.setattr(RecordingPopen, "raises", subprocess.SubprocessError("Exception occurred in preexec_fn."))
    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    with pytest.raises(ValueError) as refused:
        start_process(["x"], {}, "u", log_path=tmp_path / "s.log", nice=-5)
    assert str(refused.value) == ("cannot start the server with priority -5 (--server-nice; below 0 needs root or "
                                  "CAP_SYS_NICE): Exception occurred in preexec_fn.")
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def _health(status: int) -> type[QuietHandler]:
    class Health(QuietHandler):
        def do_GET(self) -> None:
            self.send_body(b"", status=status if self.path == "/health" else 404)

    return Health


def test_healthy_means_health_answers_200_only() -> None:
    with serving(_health(200)) as url:
        assert server_process.is_healthy(url) is True
    for status in (204, 503):
        with serving(_health(status)) as url:
            assert server_process.is_healthy(url) is False
    assert server_process.is_healthy(f"http://127.0.0.1:{free_port()}") is False


def test_the_health_probe_waits_two_seconds_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, float]] = []

    def urlopen(url: str, timeout: float) -> Any:
        asked.append((url, timeout))
        raise OSError("nothing there")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    assert server_process.is_healthy("http://h:1") is False
    assert asked == [("http://h:1/health", 2.0)]


class Starting:
    """A server starting up: ``poll`` is None until ``exits_after`` polls (then its code), ``is_healthy`` true from
    the ``healthy_after``-th probe; the clock moves ``step`` s at each sleep."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, healthy_after: int | None = None,
                 exits_after: int | None = None) -> None:
        self.now = 0.0
        self.polls = self.probes = 0
        self.sleeps: list[float] = []
        self.healthy_after, self.exits_after = healthy_after, exits_after
        self.returncode: int | None = None
        monkeypatch.setattr(server_process, "time", SimpleNamespace(monotonic=lambda: self.now, sleep=self.sleep))
        monkeypatch.setattr(server_process, "is_healthy", self.is_healthy)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def is_healthy(self, base_url: str) -> bool:
        self.probes += 1
        return self.healthy_after is not None and self.probes >= self.healthy_after

    def poll(self) -> int | None:
        self.polls += 1
        if self.exits_after is not None and self.polls >= self.exits_after:
            self.returncode = 3
        return self.returncode


def test_wait_healthy_polls_every_second_for_600_seconds_by_default(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    stage = Starting(monkeypatch)
    log = tmp_path / "log"
    log.write_text("loading\nstill loading\n")
    with pytest.raises(RuntimeError) as late:
        server_process.wait_healthy(Server(stage, "http://h:1", log, "Fake server"))  # type: ignore[arg-type]
    assert str(late.value) == "Fake server at http://h:1 not healthy after 600 s; log tail:\nloading\nstill loading"
    assert stage.sleeps == [1.0] * 600 and stage.probes == 600
    ready = Starting(monkeypatch, healthy_after=3)
    server_process.wait_healthy(Server(ready, "u", None), timeout=10.0, poll=0.25)  # type: ignore[arg-type]
    assert ready.sleeps == [0.25, 0.25] and ready.probes == 3


def test_a_timeout_is_named_and_rounded_in_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Starting(monkeypatch)
    with pytest.raises(RuntimeError) as late:
        server_process.wait_healthy(Server(stage, "u", None, "S"), timeout=2.6, poll=1.0,  # type: ignore[arg-type]
                                    timeout_name="OEA_X")
    assert str(late.value) == "S at u not healthy after 3 s (OEA_X); log tail:\n"
    assert stage.sleeps == [1.0, 1.0, 1.0]  # until the deadline is reached, not past it


def test_a_server_that_exits_during_start_up_fails_at_once_with_its_code(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    stage = Starting(monkeypatch, exits_after=3)
    log = tmp_path / "log"
    log.write_text("Traceback: out of memory\n")
    with pytest.raises(RuntimeError) as died:
        server_process.wait_healthy(Server(stage, "http://h:1", log, "Fake"), timeout=100.0)  # type: ignore[arg-type]
    assert str(died.value) == ("Fake exited with code 3 before http://h:1/health answered; log tail:\n"
                               "Traceback: out of memory")
    assert stage.probes == 2 and stage.sleeps == [1.0, 1.0]
