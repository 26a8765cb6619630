"""``tests/server_harness.py``, the block every real-server test starts its servers in: SIGTERM to the test
process (a cancelled CI job) stops every server it holds, process group and all, and the previous handler is
back once the block is left; and the server slots that keep two xdist workers' servers within the machine's
memory."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from server_harness import free_port, port_of, stopping_servers

from oea.launch.server_process import start_process

TESTS = Path(__file__).resolve().parents[1]

# A test process that starts a "server" (a sleeping Python with a sleeping child in its group) inside the block,
# prints the server's pid, then waits for SIGTERM.
CHILD = """
import os, sys, time
from server_harness import stopping_servers
from oea.launch.server_process import start_process
code = ("import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)")
with stopping_servers() as servers:
    servers["s"] = start_process([sys.executable, "-c", code], dict(os.environ), "http://127.0.0.1:1")
    print(servers["s"].process.pid, flush=True)
    time.sleep(300)
"""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_test_process_stops_every_server_of_the_block() -> None:
    # No step waits on the clock (the suite's pytest-timeout is the hang guard): on a loaded machine the child's
    # imports alone can take minutes.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    test_process = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    try:
        assert test_process.stdout is not None
        line = test_process.stdout.readline()  # the server has started (or the child died: "")
        assert line.strip(), test_process.stderr.read() if test_process.stderr else ""
        server_group = int(line)
        assert _group_alive(server_group)
        test_process.send_signal(signal.SIGTERM)
        _, stderr = test_process.communicate()
        assert "KeyboardInterrupt: signal 15" in stderr, stderr[-2000:]
        while _group_alive(server_group):  # its members are gone; the last zombie is being reaped
            time.sleep(0.05)
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


# A process of another xdist worker: holds ``argv[1]`` server slots until a line arrives on stdin (or it is killed).
HOLDER = """
import sys
from server_harness import ServerSlots
slots = ServerSlots(int(sys.argv[1]), "holder").acquire()
print("held", flush=True)
sys.stdin.readline()
slots.release()
print("released", flush=True)
"""


def _holder(count: int, run_id: str, wait: bool = True) -> subprocess.Popen[str]:
    """A process holding ``count`` slots (``wait``: once it said so)."""
    env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run_id,
           "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(count)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    if wait:
        assert _says_held(holder, 120), "the holder never got its slots"
    return holder


def _says_held(holder: subprocess.Popen[str], timeout: float) -> bool:
    assert holder.stdout is not None
    ready, _, _ = select.select([holder.stdout], [], [], timeout)
    return bool(ready) and holder.stdout.readline().strip() == "held"


def _release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "released"
    holder.wait(timeout=60)


def _acquire_in_thread(count: int) -> tuple[Any, threading.Event]:
    import server_harness

    got = threading.Event()
    slots = server_harness.ServerSlots(count, "test")

    def take() -> None:
        slots.acquire()
        got.set()

    threading.Thread(target=take, daemon=True).start()
    return slots, got


def test_server_slots_wait_for_another_workers_servers_in_turn_and_drop_a_dead_holder(monkeypatch: Any) -> None:
    import server_harness

    run_id = f"test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run_id)
    monkeypatch.setattr(server_harness, "SLOT_POLL_S", 0.05)
    path = server_harness._slots_file()
    assert path is not None
    try:
        first = _holder(server_harness.SERVER_SLOTS - 3, run_id)  # 9 of 12 held by the other worker
        small, got_small = _acquire_in_thread(3)
        assert got_small.wait(60), "3 slots fit beside 9 of 12"
        small.release()
        large, got_large = _acquire_in_thread(4)
        assert not got_large.wait(1.0), "4 slots do not fit beside 9 of 12: the block must wait"
        late = _holder(3, run_id, wait=False)  # fits beside the 9, but the 4 asked first
        assert not _says_held(late, 1.0), "a later block went before the waiting one"
        _release(first)
        assert got_large.wait(60), "the other worker's servers stopped: the slots are free"
        assert _says_held(late, 120), "3 slots fit beside the 4 now held"
        _release(late)
        large.release()

        second = _holder(2, run_id)
        alone, got_alone = _acquire_in_thread(server_harness.SERVER_SLOTS)
        assert not got_alone.wait(1.0), "a block as large as the machine's slots waits until it is alone"
        second.kill()  # a worker that died holding slots
        second.wait(timeout=60)
        assert got_alone.wait(60), "a dead holder's slots are dropped"
        assert json.loads(path.read_text()) == {"held": {str(os.getpid()): server_harness.SERVER_SLOTS},
                                                "waiting": []}
        alone.release()
        assert json.loads(path.read_text()) == {"held": {}, "waiting": []}
    finally:
        path.unlink(missing_ok=True)


def test_server_slots_are_not_counted_outside_xdist(monkeypatch: Any) -> None:
    import server_harness

    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    slots = server_harness.ServerSlots(100, "test").acquire()
    assert not slots.held and server_harness._slots_file() is None
