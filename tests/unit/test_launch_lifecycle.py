"""``oea.launch.vllm``'s server lifecycle against fake ``vllm.entrypoints.openai.api_server`` modules:
``stop_server`` stops the whole server (a worker that ignores SIGTERM, as a vLLM worker busy shutting down
may, is killed with the leader's process group, never left holding its memory), and ``wait_healthy`` fails
at once, with the exit code and the log, when the server dies during start-up."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from fake_servers import fake_engine

from oea.launch.vllm import start_server, stop_server, wait_healthy

WORKER = (  # ignores SIGTERM, then reports its pid (so the test never signals it before it ignores SIGTERM)
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(os.environ['FAKE_WORKER_PID'] + '.tmp', 'w').write(str(os.getpid())); "
    "os.rename(os.environ['FAKE_WORKER_PID'] + '.tmp', os.environ['FAKE_WORKER_PID']); time.sleep(120)"
)
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
FAKE_SERVER = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {WORKER!r}])
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_stop_server_kills_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    fake_engine(tmp_path, VLLM_SERVER, FAKE_SERVER)
    pid_file = tmp_path / "worker.pid"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(tmp_path / "fake"),
           "FAKE_WORKER_PID": str(pid_file)}
    server = start_server(["--port", "1"], env, python=sys.executable, log_path=tmp_path / "server.log")
    worker = None
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert _alive(worker)
        stop_server(server, grace=2.0)
        deadline = time.monotonic() + 60  # the orphaned worker is reaped by init once killed
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker), "a worker that ignores SIGTERM survived stop_server"
    finally:
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if server.process.poll() is None:
            server.process.kill()


def test_wait_healthy_reports_a_server_that_dies_during_start_up(tmp_path: Path) -> None:
    dies = "import sys\nprint('CUDA out of memory while loading weights')\nsys.exit(3)\n"
    fake = fake_engine(tmp_path, VLLM_SERVER, dies)
    server = start_server(["--port", "1"], {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(fake)},
                          python=sys.executable, log_path=tmp_path / "server.log")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before .*/health.*CUDA out of memory"):
        wait_healthy(server, timeout=60, poll=0.05)
    assert time.monotonic() - started < 30, "wait_healthy must notice the exit, not wait for its timeout"
