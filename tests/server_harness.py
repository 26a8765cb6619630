"""What the tests that start real servers share: a free loopback port, and a block that stops every server it
holds when it is left, by a return, an exception or SIGTERM.

SIGTERM is what a CI runner sends to cancel a job; Python's default handler ends the process at once, so a
``finally`` would not run and the servers (each in its own process group) would outlive the test run. Inside
``stopping_servers`` SIGTERM raises ``KeyboardInterrupt`` instead, the block unwinds, and each server is stopped
by ``oea.launch.server_process.stop_server`` (SIGTERM to its group, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oea.launch.server_process import Server


_GIVEN: set[int] = set()  # ports handed out in this test run


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


@contextlib.contextmanager
def stopping_servers() -> Iterator[dict[str, Server]]:
    """A dict (name -> started ``Server``) for the block to fill; every server still in it is stopped on leaving.

    A server the block stops itself can stay in the dict (stopping twice is harmless) or be popped from it.
    """
    from oea.launch.server_process import stop_server

    servers: dict[str, Server] = {}

    def stop_on_sigterm(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        yield servers
    finally:
        try:
            for server in servers.values():
                stop_server(server)
        finally:
            signal.signal(signal.SIGTERM, previous)
