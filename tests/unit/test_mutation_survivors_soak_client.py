"""``oea soak``'s request client (``oea.soak.client``) at the edges the generated mutants of ``make mutation``
found unguarded (docs/testing.md, "Generated mutants"): the engine's error message taken from each shape of
error body; how choices are counted from whole answers and stream chunks; each reason ``judge`` gives, in its
words; what ``send`` sends and makes of every answer (whole or streamed, refused, accepted when it must be
refused, aborted, broken, cut short, a network error); the tally; ``run_phases``' URL, connection limits,
deadline, idle gaps and callback.

The server is ``httpx.MockTransport`` (each request recorded, answered by a function): no socket, no timing
but the one abort that waits on a server that never answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from oea.soak import client
from oea.soak.client import Outcome, _Choices, _error_message, judge, run_phases, send, tally
from oea.soak.mix import Phase, SoakRequest

URL = "http://127.0.0.1:1/v1/completions"


def _request(index: int = 0, plan: str = "complete", n: int = 1, max_tokens: int = 3, stream: bool = False,
             **extra: Any) -> SoakRequest:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": max_tokens, "n": n, "stream": stream,
            **extra.pop("body", {})}
    return SoakRequest(index, plan, body, **extra)


# -- the engine's error message -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "message"), [
    ('{"error": {"message": "too long", "detail": "d"}}', "too long"),
    ('{"error": {"detail": "bad field"}}', "bad field"),
    ('{"message": "SGLang says no"}', "SGLang says no"),
    ('{"detail": "not found"}', "not found"),
    ('{"error": "plain words"}', "plain words"),
    ('{"error": {"message": 12}}', "12"),
    ('{"error": {"code": 400}}', '{"error": {"code": 400}}'),
    ('{"error": 5}', '{"error": 5}'),
    ("[1, 2]", "[1, 2]"),
    ("Internal Server Error", "Internal Server Error"),
])
def test_the_engines_message_is_read_from_each_shape_of_error_body(text: str, message: str) -> None:
    assert _error_message(text) == message


def test_a_body_without_a_message_is_cut_to_300_characters() -> None:
    assert _error_message("x" * 400) == "x" * 300
    long_json = json.dumps({"other": "y" * 400})
    assert _error_message(long_json) == long_json[:300]


# -- counting choices ---------------------------------------------------------------------------------------------

def test_whole_choices_count_their_token_ids_and_logprobs() -> None:
    choices = _Choices()
    choices.add({"index": 1, "token_ids": [4, "5"], "finish_reason": "stop",
                 "logprobs": {"tokens": ["a", "b"]}}, whole=True)
    choices.add({"token_ids": [7], "finish_reason": "length", "logprobs": {"tokens": "ab"}}, whole=True)
    assert choices.tokens == {1: [4, 5], 0: [7]} and choices.counts == {1: 2, 0: 1}
    assert choices.finish == {1: "stop", 0: "length"} and choices.logprobs == {1: 2} and choices.has_ids


def test_stream_chunks_without_ids_count_one_token_each_until_the_finish() -> None:
    choices = _Choices()
    for chunk in ({"index": 0, "text": "a", "finish_reason": None, "logprobs": {"tokens": ["a"]}},
                  {"index": 0, "text": "", "finish_reason": None, "logprobs": {"tokens": ["b"]}},
                  {"index": 0, "text": "", "finish_reason": "stop"},
                  {"index": 0, "text": "", "finish_reason": None}):
        choices.add(chunk, whole=False)
    assert not choices.has_ids and choices.counts == {0: 3} and choices.tokens == {0: []}
    assert choices.finish == {0: "stop"}  # a later chunk without a reason keeps the one seen
    assert choices.logprobs == {0: 2}
    whole = _Choices()
    whole.add({"index": 0, "text": "abc", "finish_reason": None}, whole=True)
    assert whole.counts == {0: 0} and whole.finish == {0: None}  # a whole answer is counted from its usage


def test_a_choice_with_text_and_a_finish_still_counts_its_token() -> None:
    choices = _Choices()
    choices.add({"index": 2, "text": "z", "finish_reason": "length"}, whole=False)
    assert choices.counts == {2: 1} and choices.finish == {2: "length"}


# -- judging a 200 answer -----------------------------------------------------------------------------------------

def _choices(*finished: tuple[str | None, int], ids: bool = True, logprobs: bool = False) -> _Choices:
    choices = _Choices()
    for index, (reason, count) in enumerate(finished):
        choice: dict[str, Any] = {"index": index, "finish_reason": reason}
        if ids:
            choice["token_ids"] = list(range(count))
        if logprobs:
            choice["logprobs"] = {"tokens": ["t"] * count}
        choices.add(choice, whole=True)
        if not ids:
            choices.counts[index] = count
    return choices


@pytest.mark.parametrize(("request_", "choices", "usage", "reason"), [
    (_request(n=2), _choices(("length", 3)), None, "choices [0], expected indices 0..1"),
    (_request(), _choices(("abort", 3)), None, "choice 0 finish_reason 'abort'"),
    (_request(), _choices((None, 3)), None, "choice 0 finish_reason None"),
    (_request(), _choices(("stop", 4)), None, "choice 0: 4 tokens > max_tokens 3"),
    (_request(), _choices(("length", 2)), None, "choice 0 finished by length after 2 of max_tokens 3 tokens"),
    (_request(expected_tokens=3), _choices(("stop", 3)), None,
     "choice 0: 3 tokens (stop), expected 3 (ignore_eos, no stop string)"),
    (_request(max_tokens=5, expected_tokens=3), _choices(("length", 5)), None,
     "choice 0: 5 tokens (length), expected 3 (ignore_eos, no stop string)"),
    (_request(body={"logprobs": 0}), _choices(("length", 3)), None, "choice 0: logprobs asked for and missing"),
    (_request(), _choices(("length", 3)), {"completion_tokens": 2}, "usage.completion_tokens 2 != 3 tokens received"),
    (_request(), _choices(("length", 3)), {}, "usage.completion_tokens None != 3 tokens received"),
    (_request(n=2), _choices(("length", 3), ("stop", 1)), {"completion_tokens": 3},
     "usage.completion_tokens 3 != 4 tokens received"),
])
def test_each_reason_an_answer_is_not_a_completion_is_said(request_: SoakRequest, choices: _Choices,
                                                          usage: dict[str, Any] | None, reason: str) -> None:
    assert judge(request_, choices, usage) == reason


@pytest.mark.parametrize(("request_", "choices", "usage"), [
    (_request(), _choices(("length", 3)), {"completion_tokens": 3}),
    (_request(), _choices(("stop", 0)), {"completion_tokens": 0}),
    (_request(), _choices(("stop", 3)), None),
    (_request(n=2), _choices(("stop", 1), ("length", 3)), {"completion_tokens": 4}),
    (_request(body={"logprobs": 1}), _choices(("stop", 0)), None),  # no token: no logprobs to ask for
    (_request(body={"logprobs": 1}), _choices(("length", 3), logprobs=True), None),
    (_request(expected_tokens=3), _choices(("length", 3)), None),
    # without token ids the counts are the usage's share: neither the bound nor the usage can be checked
    (_request(), _choices(("stop", 9), ids=False), {"completion_tokens": 1}),
    (_request(), _choices(("length", 2), ids=False), None),
    (_request(max_tokens=5, expected_tokens=3), _choices(("length", 5), ids=False), None),
])
def test_a_complete_answer_has_no_reason(request_: SoakRequest, choices: _Choices,
                                         usage: dict[str, Any] | None) -> None:
    assert judge(request_, choices, usage) == ""


# -- sending ------------------------------------------------------------------------------------------------------

Handler = Callable[[httpx.Request], Any]


def _send(request: SoakRequest, answer: Handler, seen: list[httpx.Request] | None = None,
          timeout_s: float = 7.0) -> Outcome:
    async def handler(req: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(req)
        result = answer(req)
        return await result if asyncio.iscoroutine(result) else result

    async def go() -> Outcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send(http, URL, request, timeout_s)

    return asyncio.run(go())


def _whole(*choices: dict[str, Any], usage: dict[str, Any] | None = None, status: int = 200) -> Handler:
    body: dict[str, Any] = {"choices": list(choices)}
    if usage is not None:
        body["usage"] = usage
    return lambda _req: httpx.Response(status, json=body)


def _events(*events: Any, done: bool = True, status: int = 200) -> Handler:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return lambda _req: httpx.Response(status, content="".join(lines).encode(),
                                       headers={"Content-Type": "text/event-stream"})


def test_a_whole_answer_is_posted_as_json_and_completed() -> None:
    seen: list[httpx.Request] = []
    request = _request(n=2, max_tokens=2)
    out = _send(request, _whole({"index": 1, "token_ids": [5, 6], "finish_reason": "length"},
                                {"index": 0, "token_ids": [3], "finish_reason": "stop"},
                                usage={"completion_tokens": 3}), seen, timeout_s=7.5)
    assert (out.outcome, out.error, out.status, out.tokens, out.token_ids) == ("completed", "", 200, 3, [[3], [5, 6]])
    assert (out.index, out.plan, out.refusal, out.chunks, out.ttft_s) == (0, "complete", None, 0, None)
    assert out.latency_s > 0
    [req] = seen
    assert req.method == "POST" and str(req.url) == URL and req.content == request.payload()
    assert req.headers["Content-Type"] == "application/json"
    assert req.extensions["timeout"] == {"connect": 7.5, "read": 7.5, "write": 7.5, "pool": 7.5}


def test_a_whole_answer_without_ids_shares_the_usage_among_its_choices() -> None:
    out = _send(_request(n=2, max_tokens=4), _whole({"index": 0, "text": "ab", "finish_reason": "length"},
                                                    {"index": 1, "text": "cd", "finish_reason": "length"},
                                                    usage={"completion_tokens": 9}))
    assert (out.outcome, out.tokens, out.token_ids) == ("completed", 8, None)  # 9 // 2 each
    bare = _send(_request(max_tokens=4), _whole({"index": 0, "text": "ab", "finish_reason": "stop"}))
    assert (bare.outcome, bare.tokens) == ("completed", 0)  # no usage: nothing counted


def test_a_whole_answer_without_choices_fails_naming_the_indices() -> None:
    out = _send(_request(), lambda _req: httpx.Response(200, json={"choices": None}))
    assert (out.outcome, out.error) == ("failed", "choices [], expected indices 0..0")


def test_a_whole_answer_that_is_not_a_json_object_fails_quoting_it() -> None:
    out = _send(_request(), lambda _req: httpx.Response(200, text="<" + "h" * 300))
    assert (out.outcome, out.error) == ("failed", "answer is not a JSON object: <" + "h" * 199)


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_is_refused_with_its_status_and_the_engines_message(stream: bool) -> None:
    request = _request(plan="refuse", stream=stream, refusal="negative_max_tokens")
    out = _send(request, lambda _req: httpx.Response(422, json={"error": {"message": "max_tokens < 1"}}))
    assert (out.outcome, out.status, out.error, out.refusal) == ("refused", 422, "max_tokens < 1",
                                                                 "negative_max_tokens")


@pytest.mark.parametrize(("stream", "plan", "status"), [(False, "complete", 400), (True, "complete", 400),
                                                        (False, "refuse", 500), (True, "refuse", 399)])
def test_any_other_error_answer_fails_with_its_status(stream: bool, plan: str, status: int) -> None:
    out = _send(_request(plan=plan, stream=stream), lambda _req: httpx.Response(status, text="x" * 400))
    assert (out.outcome, out.status) == ("failed", status)
    assert out.error == f"HTTP {status}: {'x' * 300}"[:300]


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_answered_200_fails_naming_the_refusal(stream: bool) -> None:
    out = _send(_request(plan="refuse", stream=stream, refusal="prompt_too_long"),
                _events({"choices": []}) if stream else _whole())
    assert (out.outcome, out.status, out.error) == ("failed", 200,
                                                    "accepted a request the engine must refuse (prompt_too_long)")


@pytest.mark.parametrize("stream", [False, True])
def test_a_network_error_fails_with_its_type_and_words(stream: bool) -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused " + "r" * 400, request=req)

    out = _send(_request(stream=stream), refuse)
    assert out.outcome == "failed" and out.error == ("ConnectError: refused " + "r" * 400)[:300]
    assert out.status is None and out.latency_s > 0


def test_a_non_streamed_abort_gives_up_after_its_seconds() -> None:
    async def never(_req: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    out = _send(_request(plan="abort", abort_after_s=0.05), never)
    assert (out.outcome, out.error, out.status) == ("aborted", "", None) and out.latency_s >= 0.05


def test_a_non_streamed_abort_answered_in_time_is_judged() -> None:
    out = _send(_request(plan="abort", abort_after_s=30.0),
                _whole({"index": 0, "token_ids": [1, 2, 3], "finish_reason": "length"}))
    assert (out.outcome, out.tokens) == ("completed", 3)


def _chunk(index: int, token: int | None, reason: str | None = None, text: str = "x") -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": reason}
    if token is not None:
        choice["token_ids"] = [token]
    return {"choices": [choice]}


def test_a_stream_is_completed_with_its_chunks_tokens_and_first_token_time() -> None:
    seen: list[httpx.Request] = []
    request = _request(n=2, max_tokens=2, stream=True)
    out = _send(request, _events(_chunk(0, 4), _chunk(1, 6), _chunk(0, 5, "length"),
                                 _chunk(1, 7, "stop"), {"choices": [], "usage": {"completion_tokens": 4}},
                                 {"choices": []}), seen)
    assert (out.outcome, out.error, out.status, out.chunks, out.tokens) == ("completed", "", 200, 4, 4)
    assert out.token_ids == [[4, 5], [6, 7]] and out.ttft_s is not None and 0 < out.ttft_s <= out.latency_s
    [req] = seen
    assert req.content == request.payload() and req.headers["Content-Type"] == "application/json"
    assert req.extensions["timeout"]["read"] == 7.0


def test_a_streams_usage_is_checked_against_the_tokens_received() -> None:
    out = _send(_request(max_tokens=2, stream=True), _events(_chunk(0, 1), _chunk(0, 2, "length"),
                                                              {"choices": [], "usage": {"completion_tokens": 5}}))
    assert (out.outcome, out.error) == ("failed", "usage.completion_tokens 5 != 2 tokens received")


def test_a_stream_without_ids_counts_its_chunks() -> None:
    out = _send(_request(max_tokens=3, stream=True),
                _events(_chunk(0, None), _chunk(0, None), _chunk(0, None, "length", text="")))
    assert (out.outcome, out.tokens, out.token_ids, out.chunks) == ("completed", 2, None, 3)


def test_a_stream_without_done_fails_counting_its_chunks() -> None:
    out = _send(_request(max_tokens=2, stream=True), _events(_chunk(0, 1), _chunk(0, 2, "length"), done=False))
    assert (out.outcome, out.error, out.tokens) == ("failed", "the stream ended without [DONE] after 2 chunks", 0)


def test_an_error_in_the_stream_fails_with_the_engines_message() -> None:
    out = _send(_request(stream=True), _events(_chunk(0, 1), {"error": {"message": "engine died " + "e" * 400}}))
    assert out.outcome == "failed" and out.error == ("error in the stream: engine died " + "e" * 400)[:300]
    assert out.chunks == 1


def test_a_stream_chunk_that_is_not_an_object_fails_quoting_it() -> None:
    out = _send(_request(stream=True), _events(_chunk(0, 1), "[2]", _chunk(0, 2, "length")))
    assert (out.outcome, out.error, out.chunks) == ("failed", "stream chunk is not a JSON object: [2]", 1)


@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_streamed_abort_hangs_up_after_its_chunks_counting_the_tokens(after: int) -> None:
    out = _send(_request(plan="abort", stream=True, max_tokens=3, abort_after=after),
                _events(_chunk(0, 1), _chunk(0, 2), _chunk(0, 3, "length")))
    assert (out.outcome, out.error, out.chunks, out.tokens, out.status) == ("aborted", "", after, after, 200)
    assert out.ttft_s is None if after == 0 else out.ttft_s is not None


# -- the tally ----------------------------------------------------------------------------------------------------

def test_the_tally_counts_outcomes_refusals_by_status_the_first_ten_failures_and_tokens() -> None:
    outcomes = [Outcome(0, "complete", "completed", tokens=5), Outcome(1, "abort", "aborted", tokens=2),
                Outcome(2, "refuse", "refused", status=400, refusal="bad_json"),
                Outcome(3, "refuse", "refused", status=400, refusal="bad_json"),
                Outcome(4, "refuse", "refused", status=422, refusal="bad_json"),
                *(Outcome(10 + i, "complete", "failed", error=f"e{i}", tokens=1) for i in range(12))]
    assert tally(outcomes) == {
        "sent": 17, "completed": 1, "refused": 3, "aborted": 1, "failed": 12,
        "refused_by_status": {"bad_json 400": 2, "bad_json 422": 1},
        "failures": [f"#{10 + i} (complete): e{i}" for i in range(10)], "tokens": 19}
    assert tally([]) == {"sent": 0, "completed": 0, "refused": 0, "aborted": 0, "failed": 0,
                         "refused_by_status": {}, "failures": [], "tokens": 0}


def test_an_outcome_row_leaves_its_token_ids_out_unless_kept() -> None:
    out = Outcome(3, "complete", "completed", token_ids=[[1]])
    assert "token_ids" not in out.as_row() and out.as_row(keep_tokens=True)["token_ids"] == [[1]]
    assert set(out.as_row()) == {"index", "plan", "outcome", "status", "error", "refusal", "tokens", "chunks",
                                 "latency_s", "ttft_s"}
    assert Outcome(0, "x").outcome == "failed"  # not judged yet: a failure


# -- run_phases ---------------------------------------------------------------------------------------------------

class _Clients:
    """``httpx.AsyncClient`` for ``run_phases``: its own arguments recorded, a ``MockTransport`` answering each
    request with one token (its index as the id), the requests' indices recorded in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kwargs: list[dict[str, Any]] = []
        self.urls: list[str] = []
        self.sent: list[int] = []
        real = httpx.AsyncClient

        def make(**kwargs: Any) -> httpx.AsyncClient:
            self.kwargs.append(kwargs)
            return real(transport=httpx.MockTransport(self.answer), **kwargs)

        monkeypatch.setattr(httpx, "AsyncClient", make)

    def answer(self, req: httpx.Request) -> httpx.Response:
        self.urls.append(str(req.url))
        body = json.loads(req.content)
        self.sent.append(body["prompt"][0])
        return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}],
                                         "usage": {"completion_tokens": 1}})


def _plain(index: int) -> SoakRequest:
    return SoakRequest(index, "complete", {"model": "m", "prompt": [index], "max_tokens": 1})


def test_run_phases_posts_every_phase_in_order_to_the_completions_path(monkeypatch: pytest.MonkeyPatch) -> None:
    clients = _Clients(monkeypatch)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(client, "asyncio", type("Asyncio", (), {
        "sleep": staticmethod(sleep), "Semaphore": asyncio.Semaphore, "gather": asyncio.gather,
        "wait_for": asyncio.wait_for, "TimeoutError": asyncio.TimeoutError}))
    phases = [Phase((_plain(0),), 1), Phase((_plain(1), _plain(2)), 2, burst=True, idle_s=0.25),
              Phase((_plain(3), _plain(4), _plain(5)), 3)]
    answered: list[int] = []
    outcomes, unsent = asyncio.run(run_phases("http://127.0.0.1:1/", phases, deadline=float("inf"), timeout_s=9.0,
                                              on_outcome=lambda o: answered.append(o.index)))
    assert unsent == 0 and [o.index for o in outcomes] == [0, 1, 2, 3, 4, 5]
    assert all(o.outcome == "completed" for o in outcomes) and sorted(answered) == [0, 1, 2, 3, 4, 5]
    assert set(clients.urls) == {"http://127.0.0.1:1/v1/completions"} and clients.sent[0] == 0
    assert sorted(clients.sent[1:3]) == [1, 2] and sorted(clients.sent[3:]) == [3, 4, 5]
    assert slept == [0.25]
    [kwargs] = clients.kwargs
    limits, timeout = kwargs["limits"], kwargs["timeout"]
    assert (limits.max_connections, limits.max_keepalive_connections, limits.keepalive_expiry) == (3, 3, 2.0)
    assert kwargs["trust_env"] is False
    assert (timeout.read, timeout.write, timeout.pool, timeout.connect) == (9.0, 9.0, 9.0, 10.0)


def test_run_phases_without_phases_opens_one_connection_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    clients = _Clients(monkeypatch)
    assert asyncio.run(run_phases("http://127.0.0.1:1", [], deadline=float("inf"), timeout_s=1.0)) == ([], 0)
    assert clients.kwargs[0]["limits"].max_connections == 1


def test_run_phases_sends_nothing_once_the_deadline_is_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    clients = _Clients(monkeypatch)
    now = [10.0]
    monkeypatch.setattr(client, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0]),
                                                           "perf_counter": staticmethod(lambda: 0.0)}))
    phases = [Phase((_plain(0), _plain(1)), 2), Phase((_plain(2),), 1)]
    assert asyncio.run(run_phases("http://127.0.0.1:1", phases, deadline=10.0, timeout_s=1.0)) == ([], 3)
    now[0] = 9.0
    outcomes, unsent = asyncio.run(run_phases("http://127.0.0.1:1", phases, deadline=10.0, timeout_s=1.0))
    assert [o.index for o in outcomes] == [0, 1, 2] and unsent == 0 and clients.sent == [0, 1, 2]


def test_run_phases_counts_every_request_the_deadline_stopped_in_each_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is reached exactly (``>=``) when each phase's one request is about to go: neither is sent,
    both are counted; a phase skipped at its start does not sleep its idle gap."""
    clients = _Clients(monkeypatch)
    times = iter([9.0, 10.0, 9.0, 10.0, 10.0])
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(client, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(times)),
                                                           "perf_counter": staticmethod(lambda: 0.0)}))
    monkeypatch.setattr(client, "asyncio", type("Asyncio", (), {
        "sleep": staticmethod(sleep), "Semaphore": asyncio.Semaphore, "gather": asyncio.gather,
        "wait_for": asyncio.wait_for, "TimeoutError": asyncio.TimeoutError}))
    phases = [Phase((_plain(0),), 1), Phase((_plain(1),), 1), Phase((_plain(2),), 1, burst=True, idle_s=0.5)]
    assert asyncio.run(run_phases("http://127.0.0.1:1", phases, deadline=10.0, timeout_s=1.0)) == ([], 3)
    assert clients.sent == [] and slept == []


def test_run_phases_hands_each_request_its_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    clients = _Clients(monkeypatch)
    seen: list[Any] = []
    answer = clients.answer
    monkeypatch.setattr(clients, "answer", lambda req: seen.append(req.extensions["timeout"]) or answer(req))
    asyncio.run(run_phases("http://127.0.0.1:1", [Phase((_plain(0),), 1)], deadline=float("inf"), timeout_s=4.5))
    assert seen == [{"connect": 4.5, "read": 4.5, "write": 4.5, "pool": 4.5}]


def test_a_whole_answer_is_checked_against_its_usage() -> None:
    out = _send(_request(max_tokens=2), _whole({"index": 0, "token_ids": [1, 2], "finish_reason": "length"},
                                               usage={"completion_tokens": 3}))
    assert (out.outcome, out.error) == ("failed", "usage.completion_tokens 3 != 2 tokens received")


def test_one_choice_without_ids_takes_the_whole_usage() -> None:
    out = _send(_request(max_tokens=4), _whole({"index": 0, "text": "abc", "finish_reason": "stop"},
                                               usage={"completion_tokens": 3}))
    assert (out.outcome, out.tokens) == ("completed", 3)


def test_a_usage_without_its_count_never_matches_the_tokens_received() -> None:
    assert judge(_request(max_tokens=1), _choices(("length", 1)), {}) == "usage.completion_tokens None != 1 tokens " \
                                                                         "received"


def test_a_streamed_error_body_that_is_not_utf8_is_read_with_replacements() -> None:
    out = _send(_request(stream=True), lambda _req: httpx.Response(500, content=b"\xffbad \xfe"))
    assert (out.outcome, out.status, out.error) == ("failed", 500, "HTTP 500: \ufffdbad \ufffd")


def test_the_latency_is_the_time_from_sending_to_the_judged_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([100.0, 100.25])
    monkeypatch.setattr(client, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(ticks))}))
    out = _send(_request(max_tokens=1), _whole({"index": 0, "token_ids": [1], "finish_reason": "length"}))
    assert (out.outcome, out.latency_s) == ("completed", 0.25)
