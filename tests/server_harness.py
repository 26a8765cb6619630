"""What the tests that start real servers share: a free loopback port, a block that stops every server it
holds when it is left, by a return, an exception or SIGTERM, and the machine's server slots.

SIGTERM is what a CI runner sends to cancel a job; Python's default handler ends the process at once, so a
``finally`` would not run and the servers (each in its own process group) would outlive the test run. Inside
``stopping_servers`` SIGTERM raises ``KeyboardInterrupt`` instead, the block unwinds, and each server is stopped
by ``oea.launch.server_process.stop_server`` (SIGTERM to its group, then SIGKILL).

Server slots: with ``ENGINE_XDIST="-n 2 --dist loadscope"`` the engine tests run in two pytest-xdist workers (one per
engine, ``tests/conftest.py``; ``make test`` runs them in one process), so two modules' servers may run at once, and
the machine has 24 GiB. A slot is about 1.5 GiB: an SGLang server of the embedded model takes one (launcher,
scheduler, detokenizer: 1.5 GiB PSS measured), a vLLM server two (API server, engine core, worker and its 1 GiB KV
cache: 2.8 GiB PSS measured), a vLLM TP = 2 server three; the workers share ``SERVER_SLOTS`` (18 GiB, leaving the rest
to pytest, check scripts and the page cache). A block that would start servers first waits until its slots are free,
or until it would be alone (a block larger than the machine's slots still runs, by itself). The slots live in a JSON
file of the test run (``PYTEST_XDIST_TESTRUNUID``) under an exclusive ``flock``; a holder that died is dropped.
Outside xdist the slots are not counted: one process starts one module's servers at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oea.launch.server_process import Server


_GIVEN: set[int] = set()  # ports handed out in this test run
SERVER_SLOTS = 12  # ~1.5 GiB each: what the servers of both xdist workers may hold at once
SGLANG_SLOTS = 1  # one SGLang server of the embedded model
VLLM_SLOTS = 2  # one vLLM server (TP = 1)
VLLM_TP2_SLOTS = 3  # one vLLM server with tensor parallelism 2 (two workers)
SLOT_POLL_S = 2.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (servers in tests bind loopback only), never one handed out before in this
    run: servers started together bind only later, and a port just released can come back from the kernel."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def port_of(server: Server) -> int:
    """The port a started server listens on (from its base URL)."""
    return int(server.base_url.rsplit(":", 1)[1])


def _slots_file() -> Path | None:
    """The slot file shared by this run's xdist workers; None outside xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"oea-test-server-slots-{run}.json" if run else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerSlots:
    """``count`` of the machine's server slots, held by this process from ``acquire`` to ``release``."""

    def __init__(self, count: int, what: str) -> None:
        self.count, self.what, self.held = count, what, False

    def _update(self, change: int) -> bool:
        """Under the file's lock: take ``change`` slots for this process if they fit and no earlier waiter of
        another process would be kept out by it (first come, first served), else queue as a waiter; a release
        (``change`` < 0) always succeeds. Whether the slots changed."""
        path = _slots_file()
        assert path is not None
        me = os.getpid()
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read()
            state = json.loads(text) if text.strip() else {}
            holders = {int(pid): n for pid, n in state.get("held", {}).items() if _alive(int(pid))}
            waiting = [(int(pid), n) for pid, n in state.get("waiting", []) if _alive(int(pid))]
            mine = holders.pop(me, 0)
            others = sum(holders.values())
            granted = True
            if change > 0:
                if me not in [pid for pid, _ in waiting]:
                    waiting.append((me, change))
                ahead = sum(n for _, n in waiting[:[pid for pid, _ in waiting].index(me)])
                granted = (not others and not ahead) or others + mine + change + ahead <= SERVER_SLOTS
                if granted:
                    waiting = [(pid, n) for pid, n in waiting if pid != me]
            now = mine + change if granted else mine
            if now > 0:
                holders[me] = now
            f.seek(0)
            f.truncate()
            json.dump({"held": {str(pid): n for pid, n in holders.items()},
                       "waiting": [[pid, n] for pid, n in waiting]}, f)
            return granted

    def acquire(self) -> ServerSlots:
        """Wait until this block's servers fit beside the other worker's (no time limit of its own: the test's
        pytest-timeout bounds it, and the other worker's servers are stopped by their own blocks)."""
        if _slots_file() is None or self.count <= 0 or self.held:
            return self
        waited = time.monotonic()
        while not self._update(self.count):
            time.sleep(SLOT_POLL_S)
        if time.monotonic() - waited > SLOT_POLL_S:
            print(f"{self.what}: waited {time.monotonic() - waited:.0f} s for {self.count} server slots",
                  file=sys.stderr)
        self.held = True
        return self

    def release(self) -> None:
        if self.held:
            self._update(-self.count)
            self.held = False


@contextlib.contextmanager
def stopping_servers(slots: int = 0, what: str = "servers") -> Iterator[dict[str, Server]]:
    """A dict (name -> started ``Server``) for the block to fill; every server still in it is stopped on leaving.

    ``slots``: the server slots of the servers the block will start (``VLLM_SLOTS`` per vLLM server, ...): it waits
    for them first, and frees them once its servers are stopped. A server the block stops itself can stay in the dict
    (stopping twice is harmless) or be popped from it.
    """
    from oea.launch.server_process import stop_servers

    servers: dict[str, Server] = {}

    def stop_on_sigterm(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    held = ServerSlots(slots, what)
    try:
        held.acquire()
        yield servers
    finally:
        try:
            stop_servers(list(servers.values()))  # at once: one grace period for all, not one each
        finally:
            held.release()
            signal.signal(signal.SIGTERM, previous)
