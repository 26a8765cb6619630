"""Sending the soak's requests (``httpx``, async) and judging what came back.

Each request ends in one of four outcomes:

* ``completed``: HTTP 200 and a well-formed answer: ``n`` choices, each finished (``length`` or ``stop``),
  no more tokens than ``max_tokens`` (exactly ``max_tokens`` when nothing could stop it early, and whenever
  it finished by ``length``), the usage's completion tokens equal to the tokens received, logprobs where
  asked; a stream ends with ``[DONE]``;
* ``refused``: a request planned as a refusal answered 4xx with the engine's error body (status and message
  kept, to compare arms);
* ``aborted``: the client disconnected as planned before the answer was complete;
* ``failed``: anything else: a refusal of a well-formed request, an accepted refusal, 5xx, a broken or
  incomplete stream, a connection error, a time-out. The reason is kept.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from oea.soak.mix import Phase, SoakRequest

OUTCOMES = ("completed", "refused", "aborted", "failed")
# vLLM's and SGLang's uvicorn close a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
# SGLANG_TIMEOUT_KEEP_ALIVE); httpx keeps one for 5 s too, so a request sent on a connection idle for just under
# 5 s can meet the server's close and fail with ReadError without the server having seen it (observed on a
# CPU-starved soak). The client drops its idle connections well before: a request after a longer idle opens a
# new one.
SERVER_KEEP_ALIVE_S = 5.0
KEEPALIVE_S = 2.0


@dataclass
class Outcome:
    """What one request got; ``token_ids`` (per choice) only when the server returned them."""

    index: int
    plan: str
    outcome: str = "failed"
    status: int | None = None
    error: str = ""
    refusal: str | None = None
    tokens: int = 0
    chunks: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    token_ids: list[list[int]] | None = field(default=None, repr=False)

    def as_row(self, keep_tokens: bool = False) -> dict[str, Any]:
        row = {k: v for k, v in self.__dict__.items() if k != "token_ids"}
        if keep_tokens:
            row["token_ids"] = self.token_ids
        return row


def _error_message(text: str) -> str:
    """The engine's error message from its JSON error body (vLLM and SGLang: ``{"error": {"message": ...}}``,
    or ``{"message": ...}``, or ``{"detail": ...}``), else the body's first 300 characters."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:300]
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and ("message" in inner or "detail" in inner):
            return str(inner.get("message", inner.get("detail")))
        if isinstance(inner, str):
            return inner
    return text[:300]


class _Choices:
    """Per-choice tokens and finish reasons, filled from a whole answer or stream chunks."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.counts: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}
        self.logprobs: dict[int, int] = {}
        self.has_ids = True

    def add(self, choice: dict[str, Any], whole: bool) -> None:
        index = int(choice.get("index", 0))
        ids = choice.get("token_ids")
        self.counts.setdefault(index, 0)
        self.tokens.setdefault(index, [])
        if isinstance(ids, list):
            self.tokens[index] += [int(t) for t in ids]
            self.counts[index] += len(ids)
        else:
            self.has_ids = False
            if not whole and (choice.get("text") or choice.get("finish_reason") is None):
                self.counts[index] += 1  # one chunk per token, as vLLM and SGLang stream
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
            self.logprobs[index] = self.logprobs.get(index, 0) + len(logprobs["tokens"])
        if choice.get("finish_reason") is not None or index not in self.finish:
            self.finish[index] = choice.get("finish_reason")


def judge(request: SoakRequest, choices: _Choices, usage: dict[str, Any] | None) -> str:
    """Why a 200 answer is not a valid completion of ``request`` ('' when it is)."""
    body = request.body
    n, max_tokens = request.n, int(body["max_tokens"])
    if sorted(choices.finish) != list(range(n)):
        return f"choices {sorted(choices.finish)}, expected indices 0..{n - 1}"
    for index in range(n):
        reason, count = choices.finish[index], choices.counts[index]
        if reason not in ("length", "stop"):
            return f"choice {index} finish_reason {reason!r}"
        if choices.has_ids and count > max_tokens:
            return f"choice {index}: {count} tokens > max_tokens {max_tokens}"
        if choices.has_ids and reason == "length" and count != max_tokens:
            return f"choice {index} finished by length after {count} of max_tokens {max_tokens} tokens"
        if request.expected_tokens is not None and (reason != "length" or (choices.has_ids and count !=
                                                    request.expected_tokens)):
            return (f"choice {index}: {count} tokens ({reason}), expected {request.expected_tokens} (ignore_eos, "
                    "no stop string)")
        if body.get("logprobs") is not None and count and not choices.logprobs.get(index):
            return f"choice {index}: logprobs asked for and missing"
    if usage is not None and choices.has_ids:
        total = sum(choices.counts.values())
        if int(usage.get("completion_tokens", -1)) != total:
            return f"usage.completion_tokens {usage.get('completion_tokens')} != {total} tokens received"
    return ""


async def send(client: Any, url: str, request: SoakRequest, timeout_s: float) -> Outcome:
    """Send one request and judge the answer; never raises for what the server or the network do."""
    import httpx

    out = Outcome(request.index, request.plan, refusal=request.refusal)
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    try:
        if request.stream:
            await _stream(client, url, request, out, headers, start, timeout_s)
        else:
            call = client.post(url, content=request.payload(), headers=headers, timeout=timeout_s)
            if request.abort_after_s is not None:
                try:
                    resp = await asyncio.wait_for(call, request.abort_after_s)
                except asyncio.TimeoutError:
                    out.outcome = "aborted"
                    return out
            else:
                resp = await call
            out.status = resp.status_code
            if resp.status_code == 200:
                _finish_whole(request, out, resp.text)
            else:
                _refused_or_failed(request, out, resp.status_code, resp.text)
    except (httpx.HTTPError, OSError) as err:
        out.outcome, out.error = "failed", f"{type(err).__name__}: {err}"[:300]
    finally:
        out.latency_s = time.perf_counter() - start
    return out


def _refused_or_failed(request: SoakRequest, out: Outcome, status: int, text: str) -> None:
    out.error = _error_message(text)
    if request.plan == "refuse" and 400 <= status < 500:
        out.outcome = "refused"
    else:
        out.outcome = "failed"
        out.error = f"HTTP {status}: {out.error}"[:300]


def _accepted_a_refusal(request: SoakRequest, out: Outcome) -> bool:
    """True (and ``out`` failed) when the engine accepted a request it must refuse: called on a 200 answer."""
    if request.plan != "refuse":
        return False
    out.outcome, out.error = "failed", f"accepted a request the engine must refuse ({request.refusal})"
    return True


def _json_object(text: str, what: str, out: Outcome) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object; None (and ``out`` failed, naming ``what``) when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    out.outcome, out.error = "failed", f"{what} is not a JSON object: {text[:200]}"
    return None


def _finish_whole(request: SoakRequest, out: Outcome, text: str) -> None:
    if _accepted_a_refusal(request, out):
        return
    body = _json_object(text, "answer", out)
    if body is None:
        return
    choices = _Choices()
    for choice in body.get("choices") or []:
        choices.add(choice, whole=True)
    if not choices.has_ids:  # no token ids: the usage is the only count
        usage = body.get("usage") or {}
        per = int(usage.get("completion_tokens", 0)) // max(1, request.n)
        choices.counts = {i: per for i in choices.counts}
    _settle(request, out, choices, body.get("usage"))


def _settle(request: SoakRequest, out: Outcome, choices: _Choices, usage: dict[str, Any] | None) -> None:
    problem = judge(request, choices, usage)
    out.tokens = sum(choices.counts.values())
    out.token_ids = [choices.tokens[i] for i in sorted(choices.tokens)] if choices.has_ids else None
    out.outcome, out.error = ("failed", problem) if problem else ("completed", "")


async def _stream(client: Any, url: str, request: SoakRequest, out: Outcome, headers: dict[str, str],
                  start: float, timeout_s: float) -> None:
    from oea.bench.serve.client import STREAM_DONE, stream_data

    choices, usage, done = _Choices(), None, False
    async with client.stream("POST", url, content=request.payload(), headers=headers, timeout=timeout_s) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            _refused_or_failed(request, out, resp.status_code, (await resp.aread()).decode(errors="replace"))
            return
        if _accepted_a_refusal(request, out):
            return
        if request.abort_after == 0:
            out.outcome = "aborted"  # hang up right after the headers: the request may still be queued
            return
        async for data in stream_data(resp.aiter_lines()):
            if data == STREAM_DONE:
                done = True
                break
            event = _json_object(data, "stream chunk", out)
            if event is None:
                return
            if "error" in event:
                out.outcome, out.error = "failed", f"error in the stream: {_error_message(data)}"[:300]
                return
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                choices.add(choice, whole=False)
                out.chunks += 1
            if request.abort_after is not None and out.chunks >= request.abort_after:
                out.outcome, out.tokens = "aborted", sum(choices.counts.values())
                return  # leaving the block closes the connection mid-stream
    if not done:
        out.outcome, out.error = "failed", f"the stream ended without [DONE] after {out.chunks} chunks"
        return
    _settle(request, out, choices, usage)


async def run_phases(base_url: str, phases: Sequence[Phase], deadline: float, timeout_s: float,
                     on_outcome: Callable[[Outcome], None] | None = None) -> tuple[list[Outcome], int]:
    """Send every phase in order (the next starts when the previous drained); stop launching requests once
    ``time.monotonic()`` passes ``deadline``. Returns (outcomes in sending order, requests left unsent)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    widest = max((p.concurrency for p in phases), default=1)
    limits = httpx.Limits(max_connections=widest, max_keepalive_connections=widest, keepalive_expiry=KEEPALIVE_S)
    outcomes: list[Outcome] = []
    unsent = 0
    async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=httpx.Timeout(timeout_s, connect=10.0)
                                 ) as client:
        for phase in phases:
            if time.monotonic() >= deadline:
                unsent += len(phase.requests)
                continue
            if phase.idle_s:
                await asyncio.sleep(phase.idle_s)
            gate = asyncio.Semaphore(phase.concurrency)

            async def one(request: SoakRequest, gate: asyncio.Semaphore = gate) -> Outcome | None:
                async with gate:
                    if time.monotonic() >= deadline:
                        return None
                    result = await send(client, url, request, timeout_s)
                if on_outcome is not None:
                    on_outcome(result)
                return result

            results = await asyncio.gather(*(one(r) for r in phase.requests))
            outcomes += [r for r in results if r is not None]
            unsent += sum(r is None for r in results)
    return outcomes, unsent


def tally(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts per outcome, refusals by (kind, status), and the first reasons of failures."""
    counts = {name: sum(o.outcome == name for o in outcomes) for name in OUTCOMES}
    refused: dict[str, int] = {}
    for o in outcomes:
        if o.outcome == "refused":
            key = f"{o.refusal} {o.status}"
            refused[key] = refused.get(key, 0) + 1
    failures = [f"#{o.index} ({o.plan}): {o.error}" for o in outcomes if o.outcome == "failed"][:10]
    return {"sent": len(outcomes), **counts, "refused_by_status": refused, "failures": failures,
            "tokens": sum(o.tokens for o in outcomes)}
