"""``oea bench serve``'s client (``oea.bench.serve.client``) at the edges the generated mutants of ``make mutation``
found unguarded (docs/testing.md, "Generated mutants"): the body of a request, how a streamed answer is timed chunk
by chunk (with a stand-in clock: exact TTFT, ITL and latency), what each failure is recorded as, the concurrency
gate, the completions and models paths, the timeouts and proxy settings, the metrics' every field, the
configuration's defaults and refusals, the JSONL rows, and the sweep of ``run_benchmark`` (its warm-up, seeds,
order, counters, hooks and failure) with the requests stood in.

A single request runs through an ``httpx.MockTransport`` (no socket); ``run_requests`` and ``check_reachable``,
which make their own clients, talk to a stand-in server on 127.0.0.1 (``fake_servers.serving``) with bounded
timeouts."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from fake_servers import QuietHandler, serving

from oea.bench.serve import client as serve
from oea.bench.serve.client import Arm, BenchConfig, RequestResult
from oea.bench.serve.prompts import DATASETS, Prompt

URL = "http://stand-in/v1/completions"


def sse(*events: Any) -> bytes:
    """A server-sent event stream of ``events`` (dicts as JSON, strings as they are), each a ``data:`` line."""
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def chunk(text: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text}]}


def stand_in_clock(monkeypatch: pytest.MonkeyPatch, *readings: float) -> list[float]:
    """The client's ``time.perf_counter`` reads ``readings`` in turn (``time.time`` too, from its own copy); returns
    the readings not yet taken, so a test can see how many the client read."""
    left = list(readings)
    wall = itertools.count(1_700_000_000.0, 10.0)
    monkeypatch.setattr(serve, "time", SimpleNamespace(perf_counter=lambda: left.pop(0), time=lambda: next(wall)))
    return left


def send(handler: Callable[[httpx.Request], httpx.Response], prompt: Prompt | None = None,
         extra_body: dict[str, Any] | None = None, model: str = "m") -> RequestResult:
    """``send_request`` of ``prompt`` through a client whose transport is ``handler``."""
    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serve.send_request(client, URL, model, prompt or Prompt([1, 2, 3], 4), extra_body)

    return asyncio.run(go())


def answer(body: bytes, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, content=body)


# ---------------------------------------------------------------- one request


def test_a_request_posts_the_documented_body_and_extra_fields_override_it() -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=sse(chunk("x"), "[DONE]"))

    send(record, Prompt("hello there", 7), model="my-model")
    send(record, Prompt([5, 6], 2), extra_body={"temperature": 0.7, "top_k": 3}, model="other")
    assert [r.method for r in seen] == ["POST", "POST"] and all(str(r.url) == URL for r in seen)
    assert json.loads(seen[0].content) == {
        "model": "my-model", "prompt": "hello there", "max_tokens": 7, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}
    assert json.loads(seen[1].content) == {
        "model": "other", "prompt": [5, 6], "max_tokens": 2, "temperature": 0.7, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "top_k": 3}


def test_a_streamed_answer_is_timed_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """TTFT is the first chunk with choices, each ITL the gap to the previous such chunk, the latency is read after
    the stream ends; a usage-only chunk is not timed, and what follows ``[DONE]`` is never read."""
    left = stand_in_clock(monkeypatch, 10.0, 10.5, 10.75, 11.5, 12.25, 99.0)
    body = sse(chunk("a"), chunk("b"), {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 9}},
               chunk("c"), "[DONE]", "not json", chunk("d"))
    result = send(answer(body))
    assert result == RequestResult(success=True, error="", prompt_len=11, output_len=9, ttft=0.5, latency=2.25,
                                   itl=[0.25, 0.75], text="abc")
    assert left == [99.0]


def test_only_data_lines_count_whatever_their_surrounding_blanks(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_clock(monkeypatch, 0.0, 1.0, 2.0, 4.0)
    body = (b": keep-alive\n\nevent: completion\n  data: " + json.dumps(chunk("a")).encode() + b"  \n\n"
            + b"data:" + json.dumps(chunk("b")).encode() + b"\n\nretry: 10\n\t data:  [DONE] \n\ndata: junk\n\n")
    result = send(answer(body))
    assert result.success and result.text == "ab" and result.itl == [1.0] and result.latency == 4.0


def test_a_stream_that_ends_without_done_keeps_what_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_clock(monkeypatch, 0.0, 1.0, 3.0)
    result = send(answer(sse(chunk("only"))))
    assert result.success and result.text == "only" and result.ttft == 1.0 and result.latency == 3.0
    assert result.itl == []


def test_without_usage_each_chunk_is_a_token_and_a_token_prompt_is_its_length() -> None:
    body = sse(chunk("a"), chunk("b"), chunk("c"), "[DONE]")
    tokens = send(answer(body), Prompt([4, 5, 6, 7, 8], 3))
    assert tokens.success and (tokens.prompt_len, tokens.output_len) == (5, 3)
    text = send(answer(body), Prompt("five words in a prompt", 3))
    assert text.success and (text.prompt_len, text.output_len) == (0, 3)
    # usage that names no count (None, 0) is the same as no usage
    nulls = sse(chunk("a"), chunk("b"), {"choices": [], "usage": {"prompt_tokens": None, "completion_tokens": 0}},
                "[DONE]")
    assert (lambda r: (r.prompt_len, r.output_len))(send(answer(nulls), Prompt([1, 2], 2))) == (2, 2)
    # usage that does count wins over the prompt's length and the chunks
    counted = sse(chunk("a"), {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 7}}, "[DONE]")
    assert (lambda r: (r.prompt_len, r.output_len))(send(answer(counted), Prompt([1, 2], 2))) == (40, 7)
    # usage on a chunk that also carries text is read too
    both = sse({"choices": [{"text": "z"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}, "[DONE]")
    assert (lambda r: (r.prompt_len, r.output_len, r.text))(send(answer(both), Prompt([1], 1))) == (3, 1, "z")


def test_choices_without_text_are_chunks_and_several_choices_are_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_clock(monkeypatch, 0.0, 1.0, 2.0, 4.0, 8.0)
    body = sse({"choices": [{"text": None}]}, {"choices": [{"index": 0}]},
               {"choices": [{"text": "x"}, {"text": "y"}, {"text": ""}]}, {"choices": None}, {}, "[DONE]")
    result = send(answer(body))
    assert result.success and result.text == "xy" and result.output_len == 3
    assert result.ttft == 1.0 and result.itl == [1.0, 2.0] and result.latency == 8.0


def test_an_error_answer_is_its_status_and_the_first_300_characters_of_its_body() -> None:
    body = b"\xff" + b"e" * 299 + b"TAIL"
    result = send(answer(body, status=503))
    assert result == RequestResult(error="HTTP 503: \ufffd" + "e" * 299)
    short = send(answer(b"busy", status=429))
    assert short.error == "HTTP 429: busy" and not short.success


def test_an_error_event_ends_the_request_with_its_first_300_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_clock(monkeypatch, 0.0, 1.0, 55.0)
    body = sse(chunk("a"), {"error": {"message": "m" * 400}}, chunk("b"), "[DONE]")
    result = send(answer(body))
    assert not result.success and result.error == str({"message": "m" * 400})[:300]
    assert result.text == "a" and result.latency == 0.0


def test_a_stream_without_an_output_chunk_fails_after_timing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in_clock(monkeypatch, 1.0, 3.5)
    result = send(answer(sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}, "[DONE]")))
    assert result == RequestResult(success=False, error="no output chunk in the stream", prompt_len=3, latency=2.5)


def test_transport_decoding_and_os_errors_are_recorded_not_raised() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused here", request=request)

    def broken(request: httpx.Request) -> httpx.Response:
        raise OSError("pipe gone")

    assert send(refuse) == RequestResult(error="ConnectError: refused here")
    assert send(broken) == RequestResult(error="OSError: pipe gone")
    bad = send(answer(sse(chunk("a"), "{not json")))
    assert bad.error == "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    assert not bad.success and bad.latency == 0.0


# ---------------------------------------------------------------- a stand-in server for run_requests / check_reachable


class _Completions(QuietHandler):
    """Streams ``max_tokens`` chunks whose text names the prompt, after a delay of the first prompt id in ms;
    records each request's path and body and the most requests in flight at once. With ``wait_for`` set, each
    request is held until that many have been in flight together (bounded), so a gate that lets them through is
    seen to do so however slowly the client sends on a busy machine."""

    paths: ClassVar[list[str]] = []
    bodies: ClassVar[list[dict[str, Any]]] = []
    in_flight: ClassVar[int] = 0
    most: ClassVar[int] = 0
    lock: ClassVar[threading.Lock] = threading.Lock()
    together: ClassVar[threading.Condition] = threading.Condition(lock)
    wait_for: ClassVar[int] = 0

    def do_POST(self) -> None:
        body = self.read_json()
        cls = type(self)
        with cls.together:
            cls.paths.append(self.path)
            cls.bodies.append(body)
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
            cls.together.notify_all()
            cls.together.wait_for(lambda: cls.most >= cls.wait_for, timeout=30.0)
        time.sleep(body["prompt"][0] / 1000)
        with cls.together:
            cls.in_flight -= 1
        name = str(body["prompt"][0])
        self.send_body(sse(*[chunk(name) for _ in range(body["max_tokens"])], "[DONE]"), "text/event-stream")


@pytest.fixture()
def completions() -> Iterator[tuple[str, type[_Completions]]]:
    handler = type("Completions", (_Completions,), {"paths": [], "bodies": [], "in_flight": 0, "most": 0,
                                                    "wait_for": 0})
    with serving(handler) as url:
        yield url, handler


def test_max_concurrency_below_one_is_refused() -> None:
    with pytest.raises(ValueError) as refused:
        asyncio.run(serve.run_requests("http://127.0.0.1:9", "m", [], max_concurrency=0))
    assert str(refused.value) == "--max-concurrency values must be >= 1, got 0"


def test_requests_go_to_the_completions_path_and_come_back_in_prompt_order(
        completions: tuple[str, type[_Completions]]) -> None:
    url, handler = completions
    prompts = [Prompt([40, 0], 2), Prompt([1], 1), Prompt([20], 3)]
    done: list[str] = []
    results, duration = asyncio.run(serve.run_requests(url + "/", "m", prompts, max_concurrency=1, timeout=30.0,
                                                       extra_body={"seed": 5}, on_done=lambda r: done.append(r.text)))
    assert [r.text for r in results] == ["4040", "1", "202020"] and all(r.success for r in results)
    assert done == ["4040", "1", "202020"]  # one at a time: done in the order sent
    assert handler.paths == ["/v1/completions"] * 3 and {b["seed"] for b in handler.bodies} == {5}
    assert duration > 0.06


def test_at_most_max_concurrency_requests_are_in_flight_and_that_many_are(
        completions: tuple[str, type[_Completions]]) -> None:
    url, handler = completions
    handler.wait_for = 2
    prompts = [Prompt([30], 1), Prompt([1], 1), Prompt([1], 1), Prompt([1], 1)]
    done: list[str] = []
    results, _ = asyncio.run(serve.run_requests(url, "m", prompts, max_concurrency=2, timeout=30.0,
                                                on_done=lambda r: done.append(r.text)))
    assert all(r.success for r in results) and [r.text for r in results] == ["30", "1", "1", "1"]
    assert handler.most == 2
    assert sorted(done) == ["1", "1", "1", "30"]


def test_proxy_variables_do_not_reroute_the_requests(completions: tuple[str, type[_Completions]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = completions
    dead = f"http://127.0.0.1:{_free_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    results, _ = asyncio.run(serve.run_requests(url, "m", [Prompt([1], 1)], max_concurrency=1, timeout=30.0))
    assert results[0].success, results[0].error


def test_a_request_slower_than_the_timeout_is_a_read_timeout(completions: tuple[str, type[_Completions]]) -> None:
    url, _ = completions
    # the server answers after 5 s, far past the 0.2 s timeout (a daemon thread: the test does not wait for it)
    results, _ = asyncio.run(serve.run_requests(url, "m", [Prompt([5000], 1)], max_concurrency=1, timeout=0.2))
    assert results[0].error.startswith("ReadTimeout") and not results[0].success


def test_the_client_reads_with_the_timeout_connects_within_ten_seconds_and_pools_the_gate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []
    urls: list[str] = []
    real = httpx.AsyncClient

    def stream(request: httpx.Request) -> httpx.Response:
        urls.append(f"{request.url} {json.loads(request.content)['model']}")
        return httpx.Response(200, content=sse(chunk("a"), "[DONE]"))

    def recording(**kwargs: Any) -> httpx.AsyncClient:
        made.append(kwargs)
        return real(transport=httpx.MockTransport(stream), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", recording)
    stand_in_clock(monkeypatch, 100.0, 101.0, 102.0, 103.0, 107.5)
    results, duration = asyncio.run(serve.run_requests("http://h", "m1", [Prompt([1], 1)], max_concurrency=3,
                                                       timeout=42.0))
    # the round's duration: the clock before the first request is sent and after the last one ended
    assert duration == 7.5 and (results[0].ttft, results[0].latency) == (1.0, 2.0)
    monkeypatch.setattr(serve, "time", time)
    asyncio.run(serve.run_requests("http://boX/", "m2", [Prompt([1], 1)], max_concurrency=1))
    # the URL as sent (a stand-in http.server would fold the leading "//" of a doubled slash away; a host may end
    # in any letter) and the model asked for
    assert urls == ["http://h/v1/completions m1", "http://box/v1/completions m2"]
    assert [k["timeout"] for k in made] == [httpx.Timeout(42.0, connect=10.0), httpx.Timeout(600.0, connect=10.0)]
    assert made[0]["limits"] == httpx.Limits(max_connections=3, max_keepalive_connections=3)
    assert all(k["trust_env"] is False for k in made)


# ---------------------------------------------------------------- check_reachable


def _models(status: int, body: Any) -> type[QuietHandler]:
    class Models(QuietHandler):
        paths: ClassVar[list[str]] = []

        def do_GET(self) -> None:
            type(self).paths.append(self.path)
            if isinstance(body, str):
                self.send_body(body.encode(), "text/plain", status=status)
            else:
                self.send_json(body, status=status if self.path == "/v1/models" else 404)

    return Models


def test_a_reachable_server_names_its_first_model() -> None:
    handler = _models(200, {"data": [{"id": 7}, {"id": "second"}]})
    with serving(handler) as url:
        assert serve.check_reachable(url + "/", timeout=30.0) == "7"
    assert handler.paths == ["/v1/models"]


@pytest.mark.parametrize("body", [{"data": []}, {"object": "list"}, {"data": None}])
def test_a_server_that_lists_no_model_is_unreachable(body: Any) -> None:
    with serving(_models(200, body)) as url, pytest.raises(serve.ServerUnreachable) as refused:
        serve.check_reachable(url, timeout=30.0)
    assert str(refused.value) == f"{url}/v1/models lists no model"


def test_an_error_answer_is_unreachable_with_its_status_and_200_characters() -> None:
    with serving(_models(500, "x" * 199 + "yz")) as url, pytest.raises(serve.ServerUnreachable) as refused:
        serve.check_reachable(url, timeout=30.0)
    assert str(refused.value) == f"{url}/v1/models answered HTTP 500: " + "x" * 199 + "y"


def test_nothing_listening_is_unreachable_naming_the_url_and_the_error_alone() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(serve.ServerUnreachable) as refused:
        serve.check_reachable(url + "/", timeout=5.0)
    assert str(refused.value).startswith(f"cannot reach {url}/v1/models: ConnectError: ")
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_check_reachable_waits_five_seconds_by_default_and_ignores_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def get(url: str, **kwargs: Any) -> httpx.Response:
        asked.append((url, kwargs))
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    monkeypatch.setattr(httpx, "get", get)
    assert serve.check_reachable("http://boX/") == "m"
    assert asked == [("http://boX/v1/models", {"timeout": 5.0, "trust_env": False})]  # one slash, as sent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- metrics


def _ok(prompt_len: int, output_len: int, ttft: float, latency: float, itl: list[float]) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt_len, output_len=output_len, ttft=ttft, latency=latency,
                         itl=itl)


def test_every_metric_is_the_formula_over_the_successful_requests() -> None:
    results = [_ok(10, 5, 0.1, 0.9, [0.1, 0.3, 0.2, 0.2]), _ok(20, 3, 0.2, 0.6, [0.15, 0.25]),
               _ok(5, 1, 0.3, 0.3, []), RequestResult(success=False, error="x", prompt_len=99, output_len=99,
                                                      latency=50.0, ttft=40.0, itl=[9.0])]
    m = serve.compute_metrics(results, duration=4.0)
    e2e = np.array([900.0, 600.0, 300.0])
    ttft = np.array([100.0, 200.0, 300.0])
    tpot = np.array([(0.9 - 0.1) / 4 * 1000, (0.6 - 0.2) / 2 * 1000])
    itl = np.array([100.0, 300.0, 200.0, 200.0, 150.0, 250.0])
    expected: dict[str, float] = {
        "duration": 4.0, "completed": 3, "failed": 1, "total_input_tokens": 35, "total_output_tokens": 9,
        "request_throughput": 0.75, "input_throughput": 8.75, "output_throughput": 2.25, "total_throughput": 11.0,
        "concurrency": 0.45, "max_itl_ms": 300.0}
    for prefix, values in (("e2e_latency", e2e), ("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        expected.update({f"mean_{prefix}_ms": values.mean(), f"median_{prefix}_ms": float(np.median(values)),
                         f"std_{prefix}_ms": values.std(), f"p99_{prefix}_ms": float(np.percentile(values, 99))})
    expected["p95_itl_ms"] = float(np.percentile(itl, 95))
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-12), key
    assert m["std_ttft_ms"] != pytest.approx(float(ttft.std(ddof=1)))  # the population's, as the engines report


def test_metrics_without_a_successful_request_are_nan_and_zero() -> None:
    m = serve.compute_metrics([RequestResult(error="x")], 2.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["concurrency"] == 0 and m["total_throughput"] == 0
    nan_keys = {k for k, v in m.items() if isinstance(v, float) and math.isnan(v)}
    assert nan_keys == {f"{s}_{p}_ms" for p in ("e2e_latency", "ttft", "tpot", "itl")
                        for s in ("mean", "median", "std", "p99")} | {"p95_itl_ms", "max_itl_ms"}


def test_a_round_of_no_time_or_negative_time_is_refused() -> None:
    for duration in (0.0, -1.5):
        with pytest.raises(ValueError) as refused:
            serve.compute_metrics([], duration)
        assert str(refused.value) == f"duration must be > 0, got {duration}"
    assert serve.compute_metrics([], 1e-9)["completed"] == 0


def test_tpot_leaves_out_one_token_requests_only() -> None:
    m = serve.compute_metrics([_ok(1, 2, 0.1, 0.3, [0.2]), _ok(1, 1, 0.1, 5.0, [])], 1.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0) and m["p99_tpot_ms"] == pytest.approx(200.0)


# ---------------------------------------------------------------- configuration, order, seeds, rows


def test_the_configuration_defaults() -> None:
    cfg = BenchConfig()
    assert (cfg.model, cfg.dataset, cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
            cfg.random_range_ratio, cfg.text_input_chars, cfg.concurrencies, cfg.rounds, cfg.warmup_requests,
            cfg.seed, cfg.timeout, cfg.extra_body) == (None, "random", 32, 128, 128, 1.0, 512, (1, 2, 4, 8, 16, 32),
                                                        1, 2, 0, 600.0, None)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_prompts": 0}, "--num-prompts must be >= 1, got 0"),
    ({"rounds": 0}, "--rounds must be >= 1, got 0"),
    ({"warmup_requests": -1}, "--warmup-requests must be >= 0, got -1"),
    ({"concurrencies": ()}, "--max-concurrency values must be >= 1, got []"),
    ({"concurrencies": (2, 0, 4)}, "--max-concurrency values must be >= 1, got [2, 0, 4]"),
    ({"dataset": "sharegpt"}, f"--dataset must be one of {DATASETS}, got 'sharegpt'"),
])
def test_a_configuration_the_flags_cannot_mean_is_refused_in_their_words(kwargs: dict[str, Any],
                                                                          message: str) -> None:
    with pytest.raises(ValueError) as refused:
        BenchConfig(**kwargs)
    assert str(refused.value) == message


def test_the_smallest_allowed_values_are_accepted() -> None:
    cfg = BenchConfig(num_prompts=1, rounds=1, warmup_requests=0, concurrencies=(1,), dataset=DATASETS[-1])
    assert (cfg.num_prompts, cfg.rounds, cfg.warmup_requests, cfg.concurrencies) == (1, 1, 0, (1,))


def test_arms_alternate_by_round_and_seeds_are_per_cell() -> None:
    arms = [Arm("a", "u"), Arm("b", "v"), Arm("c", "w")]
    assert [[a.name for a in serve.arm_order(arms, r)] for r in range(4)] == [["a", "b", "c"], ["c", "b", "a"]] * 2
    assert serve.round_seed(5, 2, 3) == 2008 and serve.round_seed(0, 0, 0) == 0


def test_a_row_holds_the_arguments_the_arm_and_the_metrics() -> None:
    cfg = BenchConfig(dataset="random", num_prompts=9, random_input_len=11, random_output_len=13,
                      random_range_ratio=0.5)
    row = serve.result_row(cfg, Arm("k3", "http://x:1"), "m", 4, 2, 77, {"completed": 9, "duration": 1.5},
                           10.0, 12.5)
    assert row == {"backend": "vllm", "dataset_name": "random", "request_rate": math.inf, "max_concurrency": 4,
                   "random_input_len": 11, "random_output_len": 13, "random_range_ratio": 0.5, "num_prompts": 9,
                   "arm": "k3", "base_url": "http://x:1", "model": "m", "round": 2, "seed": 77, "start_time": 10.0,
                   "end_time": 12.5, "completed": 9, "duration": 1.5}
    untimed = serve.result_row(cfg, Arm("k3", "u"), "m", 4, 2, 77, {})
    assert math.isnan(untimed["start_time"]) and math.isnan(untimed["end_time"])


def test_rows_are_appended_one_json_line_each_and_read_back_without_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n")
    serve.append_jsonl(path, {"a": 1, "x": math.nan})
    serve.append_jsonl(str(path), {"a": 2, "s": "é"})
    text = path.read_text(encoding="utf-8")
    assert text == '\n{"a": 1, "x": NaN}\n{"a": 2, "s": "\\u00e9"}\n'
    rows = serve.load_rows(path)
    assert len(rows) == 2 and rows[0]["a"] == 1 and math.isnan(rows[0]["x"]) and rows[1] == {"a": 2, "s": "é"}
    assert serve.load_rows(str(path))[1] == {"a": 2, "s": "é"}


def test_a_request_result_as_a_dict() -> None:
    result = RequestResult(success=True, error="e", prompt_len=1, output_len=2, ttft=0.5, latency=1.5, itl=[1.0],
                           text="t")
    assert serve.row_as_dict(result) == {"success": True, "error": "e", "prompt_len": 1, "output_len": 2,
                                         "ttft": 0.5, "latency": 1.5, "itl": [1.0], "text": "t"}
    assert RequestResult() == RequestResult(success=False, error="", prompt_len=0, output_len=0, ttft=0.0,
                                            latency=0.0, itl=[], text="")


# ---------------------------------------------------------------- run_benchmark, requests stood in


class Sweep:
    """Stand-ins for what ``run_benchmark`` calls (``check_reachable``, ``make_prompts``, ``run_requests``, the
    engine counters' ``scrape`` and ``round_fields``, the clock), each call recorded in ``calls``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: dict[str, list[str]] | None = None,
                 warm_fail: str | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail or {}  # base URL -> the errors of its requests in every measured round
        self.warm_fail = warm_fail
        self.scrapes = itertools.count()
        wall = itertools.count(1000.0, 1.0)
        monkeypatch.setattr(serve, "time", SimpleNamespace(time=lambda: next(wall), perf_counter=time.perf_counter))
        for name in ("check_reachable", "make_prompts", "run_requests"):
            monkeypatch.setattr(serve, name, getattr(self, name))
        monkeypatch.setattr(serve.engine_counters, "scrape", self.scrape)
        monkeypatch.setattr(serve.engine_counters, "round_fields", self.round_fields)

    def check_reachable(self, base_url: str) -> str:
        self.calls.append(("check", base_url))
        return f"model-of-{base_url}"

    def make_prompts(self, *args: Any) -> list[Prompt]:
        self.calls.append(("prompts", *args))
        return [Prompt([args[2], i], 2) for i in range(args[1])]

    async def run_requests(self, base_url: str, model: str, prompts: list[Prompt], max_concurrency: int,
                           timeout: float = 600.0, extra_body: dict[str, Any] | None = None,
                           on_done: Callable[[RequestResult], None] | None = None,
                           ) -> tuple[list[RequestResult], float]:
        self.calls.append(("run", base_url, model, [p.prompt[0] for p in prompts], max_concurrency, timeout,
                           extra_body, on_done is not None))
        warm = on_done is None
        errors = ([f"{self.warm_fail} #{i}" for i in range(len(prompts))] if warm and self.warm_fail else
                  [] if warm else self.fail.get(base_url, []))
        results = [RequestResult(error=e) for e in errors] or [
            RequestResult(success=True, prompt_len=3, output_len=2, ttft=0.1, latency=0.2, itl=[0.1])
            for _ in prompts]
        for res in results:
            if on_done is not None:
                on_done(res)
        return results, 2.0

    def scrape(self, base_url: str) -> dict[str, float]:
        self.calls.append(("scrape", base_url))
        return {"n": float(next(self.scrapes))}

    def round_fields(self, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {"spec_span": after["n"] - before["n"], "spec_first": before["n"]}

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c[1:] for c in self.calls if c[0] == kind]


def test_no_arm_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError) as refused:
        serve.run_benchmark([], BenchConfig(), progress=False)
    assert str(refused.value) == ("at least one server is needed (--base-url, or --base-url-a and --base-url-b)")


def test_the_sweep_warms_each_arm_then_runs_every_cell_in_alternating_order(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    sweep = Sweep(monkeypatch)
    out = tmp_path / "rows.jsonl"
    cfg = BenchConfig(dataset="text", num_prompts=2, random_input_len=5, random_output_len=40,
                      random_range_ratio=0.5, text_input_chars=64, concurrencies=(3, 1), rounds=2,
                      warmup_requests=3, seed=10, timeout=9.0, extra_body={"k": 1})
    enriched: list[dict[str, Any]] = []
    after: list[tuple[str, bool]] = []

    def enrich(row: dict[str, Any]) -> None:
        enriched.append(row)
        row["enriched"] = len(enriched)

    def after_round(row: dict[str, Any]) -> None:
        after.append((row["arm"], len(serve.load_rows(out)) == len(after) + 1))

    rows = serve.run_benchmark([Arm("a", "http://a"), Arm("b", "http://b")], cfg, output_file=out, progress=False,
                               after_round=after_round, enrich=enrich)
    assert sweep.of("check") == [("http://a",), ("http://b",)]
    warm = ("text", 3, 9, 5, 16, 0.5, 64)
    cells = [("text", 2, seed, 5, 40, 0.5, 64) for seed in (10, 11, 1010, 1011)]
    assert sweep.of("prompts") == [warm, warm, *cells]
    runs = sweep.of("run")
    assert runs[:2] == [("http://a", "model-of-http://a", [9, 9, 9], 3, 9.0, {"k": 1}, False),
                        ("http://b", "model-of-http://b", [9, 9, 9], 3, 9.0, {"k": 1}, False)]
    order = [("a", 3, 10), ("b", 3, 10), ("b", 3, 11), ("a", 3, 11), ("a", 1, 1010), ("b", 1, 1010),
             ("b", 1, 1011), ("a", 1, 1011)]
    assert runs[2:] == [(f"http://{arm}", f"model-of-http://{arm}", [seed, seed], c, 9.0, {"k": 1}, True)
                        for arm, c, seed in order]
    assert [(r["arm"], r["max_concurrency"], r["seed"], r["round"]) for r in rows] == [
        (arm, c, seed, seed % 2) for arm, c, seed in order]
    assert all(r["model"] == f"model-of-{r['base_url']}" and r["completed"] == 2 and r["duration"] == 2.0
               for r in rows)
    # each round's window: the wall clock read before and after its requests; its counters scraped around them
    assert [(r["start_time"], r["end_time"]) for r in rows] == [(1000.0 + 2 * i, 1001.0 + 2 * i) for i in range(8)]
    assert [(r["spec_span"], r["spec_first"]) for r in rows] == [(1.0, 2.0 * i) for i in range(8)]
    assert sweep.of("scrape") == [(f"http://{arm}",) for arm, _, _ in order for _ in range(2)]
    assert [r["enriched"] for r in rows] == list(range(1, 9)) and enriched == rows
    assert after == [(arm, True) for arm, _, _ in order]  # each row on disk, enriched, before after_round sees it
    assert serve.load_rows(out) == json.loads(json.dumps(rows))


def test_a_given_model_is_used_but_every_arm_is_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = Sweep(monkeypatch)
    cfg = BenchConfig(model="given", num_prompts=1, concurrencies=(1,), warmup_requests=0)
    rows = serve.run_benchmark([Arm("a", "http://a"), Arm("b", "http://b")], cfg, progress=False)
    assert sweep.of("check") == [("http://a",), ("http://b",)]
    assert [r["model"] for r in rows] == ["given", "given"]
    assert [run[1] for run in sweep.of("run")] == ["given", "given"]  # no warm-up run with warmup_requests 0
    assert sweep.of("prompts") == [("random", 1, 0, 128, 128, 1.0, 512)]


def test_a_short_output_warms_up_with_its_own_length(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = Sweep(monkeypatch)
    cfg = BenchConfig(num_prompts=1, random_output_len=4, concurrencies=(1,), warmup_requests=1)
    serve.run_benchmark([Arm("a", "http://a")], cfg, progress=False)
    assert sweep.of("prompts")[0] == ("random", 1, -1, 128, 4, 1.0, 512)


def test_a_failed_warm_up_names_the_server_and_its_first_error(monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = Sweep(monkeypatch, warm_fail="HTTP 500: no")
    cfg = BenchConfig(num_prompts=1, concurrencies=(1,), warmup_requests=2)
    with pytest.raises(serve.ServerUnreachable) as refused:
        serve.run_benchmark([Arm("a", "http://a")], cfg, progress=False)
    assert str(refused.value) == "warm-up against http://a failed: HTTP 500: no #0"  # the first of the two
    assert [run[-1] for run in sweep.of("run")] == [False]  # nothing measured


def test_a_round_where_every_request_failed_is_written_then_raised(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    Sweep(monkeypatch, fail={"http://b": ["HTTP 500: d", "HTTP 500: a", "HTTP 500: a", "HTTP 500: c", "HTTP 500: b"]})
    out = tmp_path / "rows.jsonl"
    seen: list[str] = []
    cfg = BenchConfig(num_prompts=5, concurrencies=(2, 4), warmup_requests=0)
    with pytest.raises(RuntimeError) as raised:
        serve.run_benchmark([Arm("a", "http://a"), Arm("b", "http://b")], cfg, output_file=out, progress=False,
                            after_round=lambda row: seen.append(row["arm"]))
    assert str(raised.value) == ("every request to http://b failed at concurrency 2: "
                                 "['HTTP 500: a', 'HTTP 500: b', 'HTTP 500: c']")
    assert [(r["arm"], r["completed"], r["failed"]) for r in serve.load_rows(out)] == [("a", 5, 0), ("b", 0, 5)]
    assert seen == ["a", "b"]


def test_by_default_a_progress_bar_counts_every_measured_request_on_stderr(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    Sweep(monkeypatch)
    cfg = BenchConfig(num_prompts=3, concurrencies=(1, 2), rounds=2, warmup_requests=1)
    serve.run_benchmark([Arm("a", "http://a"), Arm("b", "http://b")], cfg)  # a bar unless told otherwise
    captured = capsys.readouterr()
    assert captured.out == ""
    # not a terminal: the bar's last state alone, the last round's arm and every request in every column
    assert re.fullmatch(r"a c=2 round 2/2 ━{40} 24/24 \d+:\d\d:\d\d", captured.err.strip())
    serve.run_benchmark([Arm("a", "http://a")], cfg, progress=False)
    assert capsys.readouterr().err == ""


def test_on_a_terminal_the_bar_starts_as_requests_before_the_first_round(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    Sweep(monkeypatch)
    for name, value in (("TTY_COMPATIBLE", "1"), ("NO_COLOR", "1"), ("TERM", "xterm"), ("COLUMNS", "100")):
        monkeypatch.setenv(name, value)
    serve.run_benchmark([Arm("a", "http://a")], BenchConfig(num_prompts=3, concurrencies=(1,), warmup_requests=0),
                        progress=True)
    err = capsys.readouterr().err
    shown = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", part).strip() for part in re.split(r"[\r\n]", err)]
    shown = [line for line in shown if line]
    assert re.fullmatch(r"requests +0/3 \d+:\d\d:\d\d", shown[0])  # drawn as the bar starts
    assert re.fullmatch(r"a c=1 round 1/1 ━{40} 3/3 \d+:\d\d:\d\d", shown[-1])
