"""``oea.launch.server_process``, the engine-free launcher every engine's server goes through: a health wait that
runs out names the setting that sets it, ``stop_server`` leaves no process of the group behind, and
``stop_servers`` signals every server before it waits for any."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_harness import free_port

from oea.launch.server_process import Server, env_arm, option, start_process, stop_server, stop_servers, wait_healthy


def test_health_timeout_names_its_setting_and_the_group_is_stopped(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    code = ("import os, subprocess, sys, time; print('still loading', flush=True); "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    server = start_process([sys.executable, "-c", code], {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                           f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "log", name="Fake server")
    try:
        # The fake has printed and started its child before the 1 s health wait begins: on a loaded machine the
        # interpreter's start alone can take longer than the wait, and the log tail would then be empty.
        deadline = time.monotonic() + 60
        while not child.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(child.read_text())
        with pytest.raises(RuntimeError, match=r"(?s)^Fake server at .* not healthy after 1 s \(--health-timeout\)"
                                               r".*still loading"):
            wait_healthy(server, timeout=1.0, poll=0.1, timeout_name="--health-timeout")
    finally:
        stop_server(server, grace=5.0)
    assert server.process.poll() is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the server's child outlived stop_server")


def test_option_reads_both_spellings_and_the_last_one_wins_as_argparse_does() -> None:
    assert option(["--port", "1", "--host=h"], "--host") == "h"
    assert option(["--port", "1", "--port=2"], "--port") == "2"
    assert option(["--portx", "1"], "--port") is None


def test_an_env_arm_is_a_name_and_shell_split_assignments_and_its_errors_name_the_flag() -> None:
    assert env_arm("off=", "--arm") == ("off", {})
    assert env_arm("k3=OEA_K0=3 OEA_NOTE='a b' X==y", "--arm") == ("k3", {"OEA_K0": "3", "OEA_NOTE": "a b", "X": "=y"})
    with pytest.raises(ValueError, match=r"^--serve-arm must be NAME=ENV .*got 'noequals'$"):
        env_arm("noequals", "--serve-arm")
    with pytest.raises(ValueError, match=r"^--arm a: expected VAR=VALUE, got '=3'$"):
        env_arm("a==3", "--arm")


# A stand-in server that, once told to stop (SIGTERM), writes its marker and exits with 3 only after the other
# stand-in's marker exists: it can exit in time only if both were signalled before either was waited for.
_WAITS_FOR_THE_OTHER = """
import os, signal, sys, time
mine, other = sys.argv[1], sys.argv[2]
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
print("ready", flush=True)
give_up = time.monotonic() + 600  # a stand-in nobody stops (a broken stop_servers) does not outlive the run
while not stopping and time.monotonic() < give_up:
    time.sleep(0.02)
open(mine, "w").close()
while not os.path.exists(other) and time.monotonic() < give_up:
    time.sleep(0.02)
sys.exit(3)
"""


def test_stop_servers_signals_every_server_before_waiting_for_any(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    a, b = tmp_path / "a", tmp_path / "b"
    servers = [start_process([sys.executable, "-c", _WAITS_FOR_THE_OTHER, str(mine), str(other)], env,
                             f"http://127.0.0.1:{free_port()}", log_path=tmp_path / f"{mine.name}.log", name=mine.name)
               for mine, other in ((a, b), (b, a))]
    try:
        for server in servers:  # both handlers installed before any signal
            deadline = time.monotonic() + 60
            while "ready" not in server.log_tail() and time.monotonic() < deadline:
                time.sleep(0.05)
        codes = stop_servers(servers, grace=30.0)
    finally:  # the groups killed without the code under test, which may be what failed
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=60)
    # one after the other, the first would wait for a marker the second never writes, and be killed (-9)
    assert codes == [3, 3] and a.exists() and b.exists()


def test_a_server_that_does_not_lead_its_group_is_stopped_alone(tmp_path: Path) -> None:
    """A server process inside a group another process leads (started by someone else's launcher): it is
    terminated itself, and the group it belongs to is never signalled."""
    leader = subprocess.Popen(["sleep", "600"], process_group=0)
    member = subprocess.Popen(["sleep", "600"], process_group=leader.pid)
    try:
        server = Server(member, f"http://127.0.0.1:{free_port()}", None, "member")
        assert stop_servers([server], grace=2.0) == [-signal.SIGTERM]
        assert leader.poll() is None, "the group's leader was signalled"
    finally:
        for process in (member, leader):
            process.kill()
            process.wait(timeout=10)
