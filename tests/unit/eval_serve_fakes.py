"""Stand-in OpenAI-compatible servers for ``oea eval serve``'s tests (127.0.0.1, non-streamed /v1/completions).

``Answers`` finishes a prompt the way a perfect model of the held-out text would: it finds the prompt in the
held-out documents and answers the rest of that line (what the bundled task's target is), one token per
character. Class attributes change what it does: ``model`` (its /v1/models id), ``wrong_every`` (every item whose
prompt length is a multiple of it gets a wrong answer: ``WRONG``), ``fail_every`` (those items answer HTTP 500),
``metrics_file`` / ``rewrites`` (each answer appends an OEA metrics row: a decode step, rewritten or not, with
active experts 3 of stock 6 when rewritten, else 6 of 6). ``serve_from_env`` is the body of a fake engine module
for restart mode: the same server, ``wrong_every`` 3 and rewriting when ``OEA_K0`` is set, metrics into
``OEA_METRICS_FILE``.
"""

from __future__ import annotations

import json
import os
import time
from http.server import ThreadingHTTPServer
from typing import ClassVar

from fake_servers import QuietHandler

WRONG = "zzz"
_DOCS: list[str] = []


def rest_of_line(prompt: str) -> str:
    """The text after ``prompt`` in the held-out documents, up to the end of its line ('' when not found)."""
    if not _DOCS:
        from oea.bench.serve.prompts import heldout_texts

        _DOCS.extend(heldout_texts())
    for doc in _DOCS:
        at = doc.find(prompt)
        if at >= 0:
            return doc[at + len(prompt):].split("\n", 1)[0]
    return ""


class Answers(QuietHandler):
    model: ClassVar[str] = "m"
    wrong_every: ClassVar[int] = 0
    fail_every: ClassVar[int] = 0
    metrics_file: ClassVar[str | None] = None
    rewrites: ClassVar[bool] = False
    requests: ClassVar[list[dict]] = []

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_body(b"")
        elif self.path == "/v1/models":
            self.send_json({"data": [{"id": self.model, "owned_by": "vllm"}]})
        else:
            self.send_body(b"", status=404)

    def do_POST(self) -> None:
        body = self.read_json()
        type(self).requests.append(body)
        prompt = body["prompt"][0] if isinstance(body["prompt"], list) else body["prompt"]
        if self.fail_every and len(prompt) % self.fail_every == 0:
            self.send_json({"error": "stand-in failure"}, status=500)
            return
        text = WRONG if self.wrong_every and len(prompt) % self.wrong_every == 0 else rest_of_line(prompt)
        if self.metrics_file:
            row = {"time": time.time(), "decode": True, "verify": False, "oea": self.rewrites, "rows": 1,
                   "active": [3.0] if self.rewrites else [6.0], "active_stock": [6.0]}
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        self.send_json({"choices": [{"index": 0, "text": text, "logprobs": {"tokens": list(text)}}]})


def answers(**attributes: object) -> type[Answers]:
    """An ``Answers`` subclass with ``attributes`` (and its own request list)."""
    return type("Answers", (Answers,), {"requests": [], **attributes})


def serve_from_env(host: str, port: int, model: str) -> None:
    """Restart mode's fake engine: wrong answers and rewritten steps when ``OEA_K0`` is set."""
    oea = "OEA_K0" in os.environ
    handler = answers(model=model, wrong_every=3 if oea else 0, rewrites=oea,
                      metrics_file=os.environ.get("OEA_METRICS_FILE"))
    ThreadingHTTPServer((host, port), handler).serve_forever()
