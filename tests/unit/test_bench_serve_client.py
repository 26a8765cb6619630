"""``oea.bench.serve.client`` against a fake OpenAI streaming server with known timings (127.0.0.1, random port)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest
from fake_servers import QuietHandler, serving

from oea.bench.serve import client as serve
from oea.bench.serve import prompts as prompts_mod
from oea.bench.serve import summary as summary_mod
from oea.bench.serve.client import Arm, BenchConfig, RequestResult

FIRST_DELAY = 0.12  # seconds before the first chunk
GAP = 0.03  # seconds between later chunks


class _FakeOpenAI(QuietHandler):
    """Streams ``max_tokens`` one-token chunks: the first after FIRST_DELAY, then one every GAP."""

    requests: ClassVar[list[dict]] = []

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.send_json({"object": "list", "data": [{"id": "fake-model"}]})
        elif self.path == "/health":
            self.send_json({})
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = self.read_json()
        type(self).requests.append(body)
        if body.get("model") == "broken":
            self.send_json({"error": "no such model"}, status=404)
            return
        n = int(body["max_tokens"])
        prompt_len = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        time.sleep(FIRST_DELAY)
        for i in range(n):
            if i:
                time.sleep(GAP)
            self._chunk({"choices": [{"index": 0, "text": f"t{i} "}]})
        self._chunk({"choices": [], "usage": {"prompt_tokens": prompt_len, "completion_tokens": n}})
        self._write(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, event: dict) -> None:
        self._write(f"data: {json.dumps(event)}\n\n".encode())

    def _write(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()



@pytest.fixture()
def fake_server() -> Iterator[str]:
    _FakeOpenAI.requests = []
    with serving(_FakeOpenAI) as url:
        yield url


def test_metrics_from_known_timings(fake_server: str) -> None:
    prompts = prompts_mod.random_prompts(4, input_len=10, output_len=6, seed=1)
    import asyncio

    results, duration = asyncio.run(serve.run_requests(fake_server, "fake-model", prompts, max_concurrency=4))
    assert all(r.success for r in results), [r.error for r in results]
    # The server sleeps FIRST_DELAY then GAP between chunks, so these lower bounds are exact; a loaded machine
    # only adds time, so no upper bound holds (the exact figures are checked with a stand-in clock in
    # test_mutation_survivors_bench_serve_client.py).
    for r in results:
        assert r.output_len == 6 and r.prompt_len == 10
        assert len(r.itl) == 5
        assert r.ttft >= FIRST_DELAY - 0.005
        assert all(gap >= 0 for gap in r.itl)  # a busy client may read two chunks at once
        assert r.latency >= FIRST_DELAY + 5 * GAP - 0.005  # the last chunk is sent after 5 gaps
        # first chunk + the gaps = the last chunk, which comes before the stream's end (usage, [DONE])
        assert r.ttft + sum(r.itl) <= r.latency + 1e-9
    m = serve.compute_metrics(results, duration)
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 24 and m["total_input_tokens"] == 40
    tpots = [(r.latency - r.ttft) / 5 for r in results]
    assert m["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / 4)
    assert m["mean_ttft_ms"] == pytest.approx(1000 * sum(r.ttft for r in results) / 4)
    assert m["mean_itl_ms"] == pytest.approx(1000 * sum(sum(r.itl) for r in results) / 20)
    assert m["output_throughput"] == pytest.approx(24 / duration)
    # Concurrency is the requests' summed latency over the round's wall time, never above the gate's 4 (that
    # all four are in flight at once is checked with a server that holds each until they are).
    assert m["concurrency"] == pytest.approx(sum(r.latency for r in results) / duration)
    assert 0 < m["concurrency"] <= 4.0 + 1e-9
    assert [b["max_tokens"] for b in _FakeOpenAI.requests] == [6] * 4
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0.0 for b in _FakeOpenAI.requests)


def test_max_concurrency_one_serialises(fake_server: str) -> None:
    import asyncio

    prompts = prompts_mod.random_prompts(3, 5, 3, seed=0)
    results, duration = asyncio.run(serve.run_requests(fake_server, "fake-model", prompts, max_concurrency=1))
    m = serve.compute_metrics(results, duration)
    # one request in flight at a time: the round lasts at least the sum of the latencies (a busy machine only
    # stretches the client's gaps between requests, so concurrency has no tight lower bound)
    assert duration >= sum(r.latency for r in results) * 0.95
    assert 0 < m["concurrency"] <= 1.0 / 0.95


def test_compute_metrics_formulas() -> None:
    results = [
        RequestResult(success=True, prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(success=True, prompt_len=20, output_len=3, ttft=0.2, latency=0.4, itl=[0.1, 0.1]),
        RequestResult(success=True, prompt_len=5, output_len=1, ttft=0.3, latency=0.3, itl=[]),
        RequestResult(success=False, error="HTTP 500"),
    ]
    m = serve.compute_metrics(results, duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_throughput"] == pytest.approx(22.0)
    # TPOT per request = (E2EL - TTFT) / (n - 1); one-token requests are left out.
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_e2e_latency_ms"] == pytest.approx(400.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(498.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0) and m["max_itl_ms"] == pytest.approx(100.0)
    assert m["concurrency"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="duration"):
        serve.compute_metrics(results, 0.0)


def test_no_successful_request_gives_nan_latencies() -> None:
    m = serve.compute_metrics([RequestResult(error="x")], 1.0)
    assert m["completed"] == 0 and math.isnan(m["mean_ttft_ms"]) and m["output_throughput"] == 0


def test_unreachable_server_fails_fast_with_url() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(serve.ServerUnreachable, match=f"127.0.0.1:{port}"):
        serve.run_benchmark([Arm("a", url)], BenchConfig(num_prompts=1, concurrencies=(1,)), progress=False)
    assert time.monotonic() - start < 60  # a refused connection, not a wait for a time-out or retries


def test_ab_rounds_alternate_and_rows_append(fake_server: str, tmp_path) -> None:
    out = tmp_path / "ab.jsonl"
    cfg = BenchConfig(num_prompts=2, random_input_len=4, random_output_len=3, concurrencies=(1, 2), rounds=2,
                      warmup_requests=1, seed=7)
    seen: list[str] = []
    rows = serve.run_benchmark([Arm("a", fake_server), Arm("b", fake_server)], cfg, output_file=out,
                               progress=False, after_round=lambda row: seen.append(row["arm"]))
    assert seen == ["a", "b", "b", "a"] * 2
    written = serve.load_rows(out)
    assert written == json.loads(json.dumps(rows))
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "output_throughput", "request_throughput",
                "max_concurrency", "completed", "duration", "mean_e2e_latency_ms", "arm", "round", "seed"):
        assert key in written[0]
    # Same prompts for both arms of one (concurrency, round) cell; fresh prompts in the next round.
    assert written[0]["seed"] == written[1]["seed"] != written[2]["seed"]
    # 1 warm-up per arm + 2 prompts x 2 concurrencies x 2 rounds x 2 arms
    assert len(_FakeOpenAI.requests) == 2 + 16


def test_interrupted_run_keeps_measured_rows(fake_server: str, tmp_path) -> None:
    out = tmp_path / "partial.jsonl"

    def interrupt(row: dict) -> None:
        if row["max_concurrency"] == 2:
            raise KeyboardInterrupt

    cfg = BenchConfig(num_prompts=1, random_input_len=3, random_output_len=2, concurrencies=(1, 2, 4),
                      warmup_requests=0)
    with pytest.raises(KeyboardInterrupt):
        serve.run_benchmark([Arm("a", fake_server)], cfg, output_file=out, progress=False, after_round=interrupt)
    assert [r["max_concurrency"] for r in serve.load_rows(out)] == [1, 2]


def test_failed_requests_raise_after_row(fake_server: str, tmp_path) -> None:
    out = tmp_path / "fail.jsonl"
    cfg = BenchConfig(model="broken", num_prompts=2, random_output_len=2, concurrencies=(1,), warmup_requests=0)
    with pytest.raises(RuntimeError, match="every request"):
        serve.run_benchmark([Arm("a", fake_server)], cfg, output_file=out, progress=False)
    assert serve.load_rows(out)[0]["failed"] == 2


def test_random_prompts_are_seeded_and_sized() -> None:
    a = prompts_mod.random_prompts(5, 12, 7, seed=3, range_ratio=0.5)
    assert a == prompts_mod.random_prompts(5, 12, 7, seed=3, range_ratio=0.5)
    assert a != prompts_mod.random_prompts(5, 12, 7, seed=4, range_ratio=0.5)
    assert all(6 <= len(p.prompt) <= 12 and 3 <= p.output_len <= 7 for p in a)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        prompts_mod.random_prompts(1, 4, 4, seed=0, range_ratio=0.0)


def test_text_prompts_come_from_documents() -> None:
    docs = ["line one\nline two\nline three\n" * 20]
    prompts = prompts_mod.text_prompts(3, input_chars=40, output_len=5, seed=0, documents=docs)
    assert all(isinstance(p.prompt, str) and len(p.prompt) == 40 and p.prompt in docs[0] for p in prompts)
    with pytest.raises(ValueError, match="--text-input-chars"):
        prompts_mod.text_prompts(1, input_chars=10_000, output_len=5, seed=0, documents=docs)


def test_plot_and_summary(tmp_path) -> None:
    rows = []
    for arm, tput in (("off", 100.0), ("k0=3", 120.0)):
        for conc in (1, 4):
            for r in range(2):
                rows.append({"arm": arm, "max_concurrency": conc, "output_throughput": tput * conc + r,
                             "mean_tpot_ms": 10.0 / conc + r, "mean_ttft_ms": 5.0})
    summary = summary_mod.summarize(rows)
    first = next(s for s in summary if s["arm"] == "off" and s["max_concurrency"] == 4)
    assert first["output_throughput_median"] == pytest.approx(400.5) and first["rounds"] == 2
    from oea.bench.serve.summary import ab_summary, plot_ab

    single = ab_summary([dict(r, round=i) for i, r in enumerate(rows) if r["arm"] == "off"])
    assert all("median_tpot_ms_ratio" not in e and len(e["output_throughput_ci"]) == 2 for e in single)
    png = plot_ab(single, tmp_path / "ab.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_end_to_end(fake_server: str, tmp_path, capsys) -> None:
    from oea.cli import main

    out = tmp_path / "cli.jsonl"
    code = main(["bench", "serve", "--base-url-a", fake_server, "--base-url-b", fake_server, "--num-prompts", "2",
                 "--random-input-len", "4", "--random-output-len", "3", "--max-concurrency", "1", "2",
                 "--warmup-requests", "0", "--output-file", str(out), "--plot", str(tmp_path / "p.png"),
                 "--no-progress", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rows"]) == 4 and {s["arm"] for s in report["summary"]} == {"a", "b"}
    assert len(serve.load_rows(out)) == 4 and (tmp_path / "p.png").exists()


def test_cli_rejects_missing_servers(capsys) -> None:
    from oea.cli import main

    assert main(["bench", "serve", "--no-progress"]) == 2
    assert "--base-url" in capsys.readouterr().err


def test_stream_data_yields_the_data_payloads_done_included() -> None:
    import asyncio

    async def lines():
        for line in ["", ": a comment", "data: {\"a\": 1}", "event: x", "  data:[DONE]  ", "data: after"]:
            yield line

    async def collect() -> list[str]:
        return [data async for data in serve.stream_data(lines())]

    assert asyncio.run(collect()) == ['{"a": 1}', serve.STREAM_DONE, "after"]
