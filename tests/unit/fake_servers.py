"""Stand-in OpenAI-compatible servers for the client and launcher tests, all on 127.0.0.1.

``serving(handler)`` runs a handler class in this process; ``fake_engine(root, module, source)`` writes a fake
engine module (``vllm.entrypoints.openai.api_server``, ``sglang.launch_server``) that a launcher starts in a
subprocess, with this file beside it so that the fake can ``from fake_servers import serve_completions``. A free
port: ``server_harness.free_port``.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar


class QuietHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, no request log (pytest output stays readable), and one way to answer."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def send_body(self, body: bytes, content_type: str = "application/json", status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, obj: object, status: int = 200) -> None:
        self.send_body(json.dumps(obj).encode(), status=status)

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


def completion_stream(body: dict) -> bytes:
    """The server-sent events of a streamed /v1/completions answer: one ``x`` per ``max_tokens``, the usage, DONE."""
    chunks = [f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n" for _ in range(body["max_tokens"])]
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
    chunks.append(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n")
    return "".join(chunks).encode()


class CompletionsHandler(QuietHandler):
    """/health, /v1/models naming ``model`` and streamed /v1/completions (``completion_stream``)."""

    model: ClassVar[dict] = {"id": "m"}

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_body(b"")
        elif self.path == "/v1/models":
            self.send_json({"data": [self.model]})
        else:
            self.send_body(b"", status=404)

    def do_POST(self) -> None:
        self.send_body(completion_stream(self.read_json()), "text/event-stream")


def completions_handler(model: dict) -> type[CompletionsHandler]:
    return type("Completions", (CompletionsHandler,), {"model": model})


def serve_completions(host: str, port: int, model: dict) -> None:
    """Serve ``CompletionsHandler`` for ``model`` until killed (the body of a fake engine's server process)."""
    ThreadingHTTPServer((host, port), completions_handler(model)).serve_forever()


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free port of 127.0.0.1 in a thread; yields the base URL; shut down on exit."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def fake_engine(root: Path, module: str, source: str) -> Path:
    """Write ``source`` as the dotted ``module`` (its packages made) under ``root/fake``, with this file beside
    them; returns ``root/fake``, the folder to put on the server's PYTHONPATH."""
    fake = root / "fake"
    *packages, name = module.split(".")
    folder = fake.joinpath(*packages)
    folder.mkdir(parents=True)
    for depth in range(1, len(packages) + 1):
        (fake.joinpath(*packages[:depth]) / "__init__.py").write_text("")
    (folder / f"{name}.py").write_text(source)
    shutil.copy(Path(__file__), fake / "fake_servers.py")
    return fake
