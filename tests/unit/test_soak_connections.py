"""The soak's HTTP connections: the health poller opens a new connection per request, and the request client
drops idle connections before vLLM's and SGLang's servers close them (a request sent on a connection the server
is closing fails with ReadError although the server is healthy)."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from oea.soak import client
from oea.soak.monitor import Health, watch_health


class KeepAliveServer(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive (as uvicorn): ``/health`` answers 200; ``connections`` counts the connections."""

    protocol_version = "HTTP/1.1"
    connections = 0

    def setup(self) -> None:
        type(self).connections += 1
        super().setup()

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_each_health_poll_opens_its_own_connection() -> None:
    KeepAliveServer.connections = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), KeepAliveServer)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    health, stop = Health(), asyncio.Event()

    async def poll() -> None:
        watcher = asyncio.create_task(watch_health(f"http://127.0.0.1:{httpd.server_address[1]}", health, stop,
                                                   interval_s=0.01))
        while len(health.samples) < 5:
            await asyncio.sleep(0.01)
        stop.set()
        await watcher

    try:
        asyncio.run(poll())
    finally:
        httpd.shutdown()
    assert all(s[1] == 200 for s in health.samples)
    assert KeepAliveServer.connections == len(health.samples), "a kept-alive connection was reused"


def test_the_client_drops_idle_connections_before_the_server_closes_them() -> None:
    assert 0 < client.KEEPALIVE_S <= client.SERVER_KEEP_ALIVE_S / 2
