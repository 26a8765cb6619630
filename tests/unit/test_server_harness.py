"""``tests/server_harness.py``, the block every real-server test starts its servers in: SIGTERM to the test
process (a cancelled CI job) stops every server it holds, process group and all, and the previous handler is
back once the block is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from server_harness import free_port, port_of, stopping_servers

from oea.launch.server_process import start_process

TESTS = Path(__file__).resolve().parents[1]

# A test process that starts a "server" (a sleeping Python with a sleeping child in its group) inside the block,
# writes the server's pid, then waits for SIGTERM.
CHILD = """
import os, sys, time
from server_harness import stopping_servers
from oea.launch.server_process import start_process
code = ("import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)")
with stopping_servers() as servers:
    servers["s"] = start_process([sys.executable, "-c", code], dict(os.environ), "http://127.0.0.1:1")
    open(sys.argv[1], "w").write(str(servers["s"].process.pid))
    time.sleep(300)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_test_process_stops_every_server_of_the_block(tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    test_process = subprocess.Popen([sys.executable, "-c", CHILD, str(pid_file)], env=env,
                                    stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert test_process.poll() is None, test_process.stderr.read() if test_process.stderr else ""
            time.sleep(0.05)
        server_group = int(pid_file.read_text())
        time.sleep(0.5)  # the server's own child is started
        assert _group_alive(server_group)
        test_process.send_signal(signal.SIGTERM)
        _, stderr = test_process.communicate(timeout=60)
        assert "KeyboardInterrupt: signal 15" in stderr, stderr[-2000:]
        deadline = time.monotonic() + 10
        while _group_alive(server_group) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(server_group), "the server's process group outlived the test process"
    finally:
        if test_process.poll() is None:
            test_process.kill()
            test_process.wait()


def test_the_block_restores_the_sigterm_handler_and_stops_what_it_holds(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    port = free_port()
    with stopping_servers() as servers:
        assert signal.getsignal(signal.SIGTERM) is not before
        servers["s"] = start_process([sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ),
                                     f"http://127.0.0.1:{port}")
        assert port_of(servers["s"]) == port
    assert servers["s"].process.poll() is not None
    assert signal.getsignal(signal.SIGTERM) is before


def test_free_port_never_hands_out_a_port_twice(monkeypatch) -> None:
    """Servers started together bind only later, so a port the kernel gives again must be skipped."""
    import socket

    import server_harness

    kernel = iter([40001, 40001, 40002, 40001, 40003])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(kernel)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(server_harness, "_GIVEN", set())
    monkeypatch.setattr(socket, "socket", Socket)
    assert [free_port(), free_port(), free_port()] == [40001, 40002, 40003]
