"""``oea soak`` without an engine: the seeded mix and its schedule, the judging of answers, the checks, a whole
soak against a stand-in OpenAI server on loopback (``FakeServer``: what vLLM answers, not vLLM), and the bad
input of the command (no server, a server that is not vLLM / SGLang, limits that would not stop it)."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from oea.soak.checks import across_arms, arm_checks, memory_bound_mib, metrics_checks
from oea.soak.mix import REFUSALS, MixShares, make_mix, probe_requests, ramp_levels, schedule
from oea.soak.monitor import SoakError, check_loopback, identify, memory
from oea.soak.runner import SoakConfig, soak_server

MAX_LEN = 128


class FakeServer(BaseHTTPRequestHandler):
    """A stand-in for vLLM's OpenAI server: ``/v1/models`` (``owned_by``), ``/health``, ``/version`` and
    ``/v1/completions`` with vLLM's refusals (JSON, ``max_tokens`` >= 1, the model length), ``n`` choices of
    ``max_tokens`` token ids each, streamed one token per chunk or whole. ``owner``, ``broken`` (a 500 on
    every 7th completion), ``accepts_refusals`` (a 200 answer to what vLLM refuses) and ``short`` (each choice
    one token short of ``max_tokens``, still finished by ``length``) are class attributes the tests set.
    ``owner = "sglang"`` answers as SGLang 0.5.23 does: ``/server_info`` (version, ``max_req_input_len``, no
    ``/version``), a prompt of ``max_req_input_len`` tokens or more refused by its scheduler, and the output
    stopped (by ``length``) after ``max_req_len - 1 - prompt`` tokens, ``max_req_len = max_req_input_len + 5``."""

    owner = "vllm"
    broken = False
    accepts_refusals = False
    short = False
    count = 0
    kill_at: tuple[int, int] | None = None  # (POST count, pid): that process is killed when the count is reached
    input_limit = MAX_LEN - 6  # SGLang's max_req_input_len for a context length of MAX_LEN

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"data": [{"id": "m", "owned_by": self.owner, "max_model_len": MAX_LEN, "root": ""}]})
        elif self.path == "/health":
            self._json(200, {})
        elif self.path == "/version" and self.owner != "sglang":
            self._json(200, {"version": "fake"})
        elif self.path == "/server_info" and self.owner == "sglang":
            self._json(200, {"version": "0.5.23-fake", "context_length": MAX_LEN,
                             "max_req_input_len": self.input_limit})
        else:
            self._json(404, {"detail": "not found"})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).count += 1
        if self.kill_at is not None and self.count == self.kill_at[0]:
            os.kill(self.kill_at[1], signal.SIGKILL)
        accepted = {"choices": [{"index": 0, "text": "x", "token_ids": [16], "finish_reason": "length"}],
                    "usage": {"completion_tokens": 1}}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            if self.accepts_refusals:
                return self._json(200, accepted)
            return self._json(400, {"error": {"message": "JSON decode error", "code": 400}})
        prompt, max_tokens, n = body["prompt"], int(body["max_tokens"]), int(body.get("n", 1))
        if self.accepts_refusals and (max_tokens < 1 or len(prompt) >= MAX_LEN):
            return self._json(200, accepted)
        if max_tokens < 1:
            return self._json(400, {"error": {"message": f"max_tokens must be at least 1, got {max_tokens}."}})
        if len(prompt) >= MAX_LEN:
            return self._json(400, {"error": {"message": f"prompt of {len(prompt)} tokens is too long"}})
        if self.broken and self.count % 7 == 0:
            return self._json(500, {"error": {"message": "EngineCore encountered an issue"}})
        tokens = min(max_tokens, MAX_LEN - len(prompt))
        if self.owner == "sglang":
            if len(prompt) >= self.input_limit:
                return self._json(400, {"object": "error", "message": f"Input length ({len(prompt)} tokens) exceeds "
                                        f"the maximum allowed length ({self.input_limit} tokens)."})
            tokens = min(max_tokens, self.input_limit + 5 - 1 - len(prompt))
        if self.short and tokens > 1:
            tokens -= 1
        lp = body.get("logprobs")
        choices = [{"index": i, "text": "x" * tokens, "token_ids": list(range(tokens)), "finish_reason": "length",
                    "logprobs": None if lp is None else {"tokens": ["x"] * tokens}} for i in range(n)]
        usage = {"completion_tokens": tokens * n}
        if not body.get("stream"):
            return self._json(200, {"choices": choices, "usage": usage})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for i in range(n):
                for t in range(tokens):
                    chunk = {"index": i, "text": "x", "token_ids": [t],
                             "finish_reason": "length" if t == tokens - 1 else None,
                             "logprobs": None if lp is None else {"tokens": ["x"]}}
                    self.wfile.write(f"data: {json.dumps({'choices': [chunk]})}\n\n".encode())
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up (an abort)


@pytest.fixture
def server() -> Any:
    FakeServer.owner, FakeServer.broken, FakeServer.count = "vllm", False, 0
    FakeServer.accepts_refusals = FakeServer.short = False
    FakeServer.input_limit = MAX_LEN - 6
    FakeServer.kill_at = None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _wait_until_exec_finished(pids: list[int], argv: list[str], timeout_s: float = 60.0) -> None:
    """Wait until every process of ``pids`` reads as ``argv`` in ``/proc/PID/cmdline``. ``Popen`` returns as soon
    as its child's exec has closed the exec error pipe (or, with vfork, released the parent's memory), which the
    kernel does before it sets the new program's arguments: right after ``Popen`` the cmdline often reads empty
    (1,289 times in 1,500 on a busy two-core machine), which the soak's memory reading would report as a process
    without a name."""
    want = b"".join(arg.encode() + b"\0" for arg in argv)
    deadline = time.monotonic() + timeout_s
    while True:
        ready = []
        for pid in pids:
            try:
                ready.append(Path(f"/proc/{pid}/cmdline").read_bytes() == want)
            except OSError:
                ready.append(False)
        if all(ready):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes {pids} did not finish exec'ing {argv} within {timeout_s:.0f} s")
        time.sleep(0.005)


@pytest.fixture
def server_group() -> Any:
    """The process group a soak watches, standing in for a real server's: (leader pid, member pid), two
    ``sleep`` processes in a process group of their own. Not the test's own group: pytest-xdist's workers and other
    tests' subprocesses share that one and come and go during a soak, which would read as restarts."""
    # The leader's group stays in this session so that the member may join it (setpgid into another session's
    # group is refused); it joins before its exec.
    leader = subprocess.Popen(["sleep", "600"], process_group=0)
    member = None
    try:
        member = subprocess.Popen(["sleep", "600"], process_group=leader.pid)
        _wait_until_exec_finished([leader.pid, member.pid], ["sleep", "600"])
        yield leader.pid, member.pid
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        for process in (leader, member):
            if process is not None:
                process.wait(timeout=10)


def test_each_request_of_the_mix_is_the_same_whatever_the_count() -> None:
    short, long = make_mix(3, 10, "m", 512), make_mix(3, 50, "m", 512)
    assert [r.payload() for r in short] == [r.payload() for r in long[:10]]
    assert [r.payload() for r in make_mix(4, 10, "m", 512)] != [r.payload() for r in short]


def test_the_mix_has_every_kind_within_the_model_length() -> None:
    mix = make_mix(0, 3000, "m", 512, MixShares())
    plans = Counter(r.plan for r in mix)
    assert 0.27 <= plans["abort"] / len(mix) <= 0.33 and 0.04 <= plans["refuse"] / len(mix) <= 0.08
    assert {r.refusal for r in mix if r.plan == "refuse"} == set(REFUSALS)
    served = [r for r in mix if r.plan != "refuse"]
    assert all(r.prompt_len >= 1 and r.prompt_len + r.body["max_tokens"] <= 512 for r in served)
    assert min(r.prompt_len for r in served) == 1 and max(r.prompt_len for r in served) >= 500
    assert any(r.prompt_len + r.body["max_tokens"] == 512 for r in served), "some reach the model length"
    assert sum(r.body["max_tokens"] == 1 for r in served) / len(served) >= 0.08
    assert all(r.body["temperature"] > 0 and "seed" in r.body for r in served if r.n > 1), "n > 1 needs sampling"
    assert any(r.n > 1 for r in served) and any("stop" in r.body for r in served)
    assert any("logprobs" in r.body for r in served) and any(r.stream for r in served)
    assert any(not r.stream for r in served)
    for r in mix:
        if r.refusal == "malformed_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(r.payload())
        if r.refusal == "prompt_too_long":
            assert r.prompt_len > 512
        if r.refusal == "negative_max_tokens":
            assert r.body["max_tokens"] < 0
    aborts = [r for r in mix if r.plan == "abort"]
    assert any(r.abort_after == 0 for r in aborts) and any(r.abort_after_s for r in aborts)


def test_the_schedule_ramps_then_bursts_and_sends_every_request_once() -> None:
    assert ramp_levels(32) == [1, 2, 4, 8, 16, 32] and ramp_levels(20) == [1, 2, 4, 8, 16, 20]
    mix = make_mix(0, 500, "m", 512)
    phases = schedule(mix, 32)
    assert [p.concurrency for p in phases[:6]] == [1, 2, 4, 8, 16, 32] and not any(p.burst for p in phases[:6])
    bursts = [p for p in phases if p.burst]
    assert bursts and all(p.concurrency == len(p.requests) and p.idle_s > 0 for p in bursts)
    assert [r.index for p in phases for r in p.requests] == list(range(500))


@pytest.mark.parametrize(("value", "flag"), [
    ({"requests": 0}, "--requests"), ({"duration_s": float("inf")}, "--duration"), ({"timeout_s": 0.0}, "--timeout"),
    ({"requests": 1.5}, "--requests")])
def test_limits_that_would_not_stop_are_refused_naming_the_flag(value: dict, flag: str) -> None:
    with pytest.raises(SoakError, match=flag):
        SoakConfig(**{"requests": 10, "duration_s": 60.0, **value})


def test_only_loopback_servers_are_soaked() -> None:
    assert check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_loopback("http://[::1]:8000") == "http://[::1]:8000"
    for url in ("http://10.1.2.3:8000", "http://example.com", "ftp://127.0.0.1"):
        with pytest.raises(SoakError):
            check_loopback(url)


def test_a_soak_against_a_well_behaved_server_holds(server: str, server_group: tuple[int, int]) -> None:
    info = identify(server)
    assert (info.engine, info.model, info.max_model_len) == ("vllm", "m", MAX_LEN)
    cfg = SoakConfig(requests=120, duration_s=60, warmup=8, max_concurrency=8, settle_s=0.1, burst_idle_s=0.05)
    report = soak_server(info, cfg, server_group[0])
    assert report["pids_after_warmup"] == sorted(server_group) and report["vanished_pids"] == []
    assert report["sent"] == 120 and report["failed"] == 0, report["failures"]
    assert report["completed"] + report["refused"] + report["aborted"] == 120
    assert set(report["refused_by_status"]) <= {f"{kind} 400" for kind in REFUSALS} and report["refused"] > 0
    assert report["aborted"] > 0 and report["health"]["unhealthy"] == 0 and report["restarts"] == 0
    assert len(report["probe"]) == len(probe_requests("m")) and all(p["token_ids"] for p in report["probe"])
    checks = arm_checks("fake", report, min_aborted_share=0.1)
    assert all(c.held for c in checks), [c for c in checks if not c.held]
    same = across_arms("a", {"a": report, "b": report}, identical_outputs=["b"])
    assert all(c.held for c in same)


def test_a_process_of_the_server_that_dies_mid_soak_is_a_restart(server: str, server_group: tuple[int, int]
                                                                  ) -> None:
    FakeServer.kill_at = (30, server_group[1])  # after the 8 warm-up requests, before the last
    cfg = SoakConfig(requests=60, duration_s=60, warmup=8, max_concurrency=4, probe=False, settle_s=0.0)
    report = soak_server(identify(server), cfg, server_group[0])
    assert report["failed"] == 0 and report["vanished_pids"] == [server_group[1]] and report["restarts"] == 1
    restart = next(c for c in arm_checks("dies", report) if "restarts" in c.name)
    assert not restart.held and "1 processes of the server vanished" in restart.detail


def test_server_errors_and_accepted_refusals_are_failures(server: str) -> None:
    FakeServer.broken = True
    info = identify(server)
    report = soak_server(info, SoakConfig(requests=60, duration_s=60, warmup=0, max_concurrency=4, probe=False,
                                          settle_s=0.0), None)
    assert report["failed"] > 0 and any("HTTP 500" in f for f in report["failures"])
    assert not arm_checks("broken", report)[0].held


def test_refusals_that_differ_between_arms_are_reported() -> None:
    def arm(message: str) -> dict:
        return {"outcomes": [{"index": 3, "plan": "refuse", "status": 400, "error": message, "outcome": "refused"}]}

    held = across_arms("off", {"off": arm("too long"), "oea": arm("too long")})
    assert all(c.held for c in held)
    differ = across_arms("off", {"off": arm("too long"), "oea": arm("internal error")})
    assert not differ[1].held and "request 3" in differ[1].detail


def test_metrics_rows_outside_the_bounds_are_reported() -> None:
    good = {"pid": 1, "step": 1, "decode": True, "oea": True, "rows": 2, "layers": 2, "active": [3, 5],
            "active_stock": [9, 10]}
    assert metrics_checks("a", [good], k0=3, top_k=8, num_experts=64)[0].held
    for bad in ({"active": [2, 5]},  # below k0
                {"active": [3, 17]},  # above k x rows
                {"active": [3, 11]},  # more than stock routing of the same logits
                {"oea": False, "active": [8, 9]},  # a stock step must equal stock routing
                {"layers": 3}):
        assert not metrics_checks("a", [{**good, **bad}], k0=3, top_k=8, num_experts=64)[0].held, bad
    assert not metrics_checks("a", [good, {**good}], k0=3, top_k=8, num_experts=64)[0].held, "a repeated step"


def test_memory_reads_every_process_of_the_group(server_group: tuple[int, int]) -> None:
    reading = memory(server_group[0])
    assert [(p["pid"], p["name"]) for p in reading["processes"]] == [(pid, "sleep") for pid in sorted(server_group)]
    assert reading["rss_mib"] > 1
    for process in reading["processes"]:  # the kernel's RssAnon + RssFile + RssShmem is VmRSS
        parts = process["anon_mib"] + process["file_mib"] + process["shmem_mib"]
        assert abs(parts - process["rss_mib"]) <= 0.3 and process["anon_mib"] > 0, process
    assert reading["anon_mib"] == pytest.approx(sum(p["anon_mib"] for p in reading["processes"]), abs=0.2)


def test_a_heap_allocation_shows_as_anonymous_memory_not_as_file_backed() -> None:
    def mine(reading: dict) -> dict:
        return next(p for p in reading["processes"] if p["pid"] == os.getpid())

    # A private anonymous mapping, each page written: fresh pages whatever malloc holds. A bytearray may be
    # carved from heap that earlier tests in this worker freed but left resident, and then RssAnon stays put.
    size = 64 * 2**20
    before = mine(memory(os.getpgid(0)))
    held = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, size, mmap.PAGESIZE):
        held[offset] = 1
    after = mine(memory(os.getpgid(0)))
    assert after["anon_mib"] - before["anon_mib"] >= 60 and abs(after["file_mib"] - before["file_mib"]) < 16
    held.close()
    assert memory_bound_mib(1000.0) > memory_bound_mib(0.0) > 0


def _oea(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """``oea soak ARGS`` in this process: (exit status, stderr)."""
    from oea.cli import main

    code = main(["soak", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--base-url", "http://127.0.0.1:9", "--requests", "5", "--duration", "10"],  # nothing listens
    ["--base-url", "http://10.0.0.1:9", "--requests", "5", "--duration", "10"],  # not loopback
    ["--base-url", "http://127.0.0.1:9", "--requests", "5"],  # no time limit
    ["--base-url", "http://127.0.0.1:9", "--requests", "0", "--duration", "10"],
    ["--base-url", "http://127.0.0.1:9", "--requests", "5", "--duration", "inf"],
    ["--arm", "a=", "--requests", "5", "--duration", "10"],  # no server arguments
    ["--arm", "a=OEA_K0=x", "--requests", "5", "--duration", "10", "--", "--model", "m", "--port", "1"],
    ["--arm", "a=", "--requests", "5", "--duration", "10", "--", "--model", "m", "--host", "0.0.0.0"],
])
def test_bad_input_is_one_line_and_exit_status_2(args: list[str], capsys: pytest.CaptureFixture) -> None:
    code, err = _oea(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("owner", ["openai", "llama.cpp"])
def test_a_server_that_is_not_vllm_or_sglang_is_refused(server: str, owner: str, capsys: pytest.CaptureFixture
                                                        ) -> None:
    FakeServer.owner = owner
    code, err = _oea(capsys, "--base-url", server, "--requests", "5", "--duration", "10")
    assert code == 2 and "is not vLLM or SGLang" in err and owner in err and len(err.strip().splitlines()) == 1
    assert FakeServer.count == 0, "nothing was sent"


def test_a_request_the_engine_must_refuse_but_answers_is_a_failure(server: str) -> None:
    FakeServer.accepts_refusals = True
    report = soak_server(identify(server), SoakConfig(requests=60, duration_s=60, warmup=0, max_concurrency=4,
                                                      probe=False, settle_s=0.0), None)
    refusals = [o for o in report["outcomes"] if o["plan"] == "refuse"]
    assert refusals and report["refused"] == 0
    for o in refusals:  # each one failed for what it is, not for what the 200 answer happens to hold
        assert o["outcome"] == "failed" and o["error"].startswith("accepted a request the engine must refuse"), o
    assert not arm_checks("accepts", report)[0].held


@pytest.mark.parametrize(("stream", "answer"),
                         [(False, "[1]"), (False, "null"), (True, "data: [1]\n\ndata: [DONE]\n\n")])
def test_an_answer_that_is_json_but_not_an_object_is_a_failure(stream: bool, answer: str) -> None:
    import asyncio

    import httpx

    from oea.soak.client import send

    request = next(r for r in make_mix(0, 200, "m", MAX_LEN) if r.plan == "complete" and r.stream == stream)

    async def sent() -> Any:
        transport = httpx.MockTransport(lambda _: httpx.Response(200, text=answer))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, "http://127.0.0.1:1/v1/completions", request, 5.0)

    out = asyncio.run(sent())
    assert out.outcome == "failed" and "is not a JSON object: " in out.error, out


def test_an_answer_finished_by_length_short_of_max_tokens_is_a_failure(server: str) -> None:
    FakeServer.short = True
    cfg = SoakConfig(requests=60, duration_s=60, warmup=0, max_concurrency=4, probe=False, settle_s=0.0)
    report = soak_server(identify(server), cfg, None)
    sent = {r.index: r for r in make_mix(cfg.seed, cfg.requests, "m", MAX_LEN, cfg.shares, token_ids=True)}
    judged = [(o, sent[o["index"]].body["max_tokens"]) for o in report["outcomes"] if o["plan"] == "complete"]
    assert any(max_tokens > 1 for _, max_tokens in judged)
    for o, max_tokens in judged:  # the stand-in cuts every answer of more than one token by one
        if max_tokens > 1:
            assert o["outcome"] == "failed" and f"of max_tokens {max_tokens} tokens" in o["error"], o
        else:
            assert o["outcome"] == "completed", o


def test_sglang_is_soaked_within_the_lengths_its_scheduler_serves(server: str) -> None:
    FakeServer.owner = "sglang"
    info = identify(server)
    assert (info.engine, info.version, info.max_model_len) == ("sglang", "0.5.23-fake", MAX_LEN)
    assert (info.prompt_limit, info.total_limit) == (MAX_LEN - 7, MAX_LEN - 2)
    cfg = SoakConfig(requests=150, duration_s=60, warmup=4, max_concurrency=8, settle_s=0.1, burst_idle_s=0.05)
    report = soak_server(info, cfg, None)
    assert report["failed"] == 0, report["failures"]
    assert set(report["refused_by_status"]) <= {f"{kind} 400" for kind in REFUSALS} and report["refused"] > 0
    sent = make_mix(cfg.seed, cfg.requests, "m", MAX_LEN, cfg.shares, token_ids=True,
                    max_prompt_len=info.prompt_limit, max_total_len=info.total_limit)
    assert max(r.prompt_len + r.body["max_tokens"] for r in sent if r.plan != "refuse") == MAX_LEN - 2
    assert [r.payload() for r in make_mix(cfg.seed, 40, "m", MAX_LEN, cfg.shares)] == [
        r.payload() for r in make_mix(cfg.seed, 40, "m", MAX_LEN, cfg.shares, max_prompt_len=MAX_LEN - 1,
                                      max_total_len=MAX_LEN)], "vLLM's lengths are the defaults: its mix is unchanged"


def test_sglang_limits_come_from_its_server_info_or_its_context_length() -> None:
    from oea.soak.monitor import serving_limits

    assert serving_limits("vllm", 512, None) == (511, 512)
    assert serving_limits("sglang", 512, {"max_req_input_len": 506}) == (505, 510)
    assert serving_limits("sglang", 512, {}) == (505, 510)  # max_req_len = context length - 1
    assert serving_limits("sglang", 4096, {"max_req_input_len": 1018}) == (1017, 1022)  # a KV pool of 1024 tokens


def test_the_memory_check_says_where_the_growth_is() -> None:
    def reading(worker_mib: float) -> dict:
        return {"rss_mib": 100.0 + worker_mib, "processes": [{"pid": 1, "name": "api", "rss_mib": 100.0},
                                                             {"pid": 2, "name": "worker", "rss_mib": worker_mib}]}

    report = {"failed": 0, "warmup": {"failed": 0, "sent": 1, "failures": []}, "failures": [], "sent": 10,
              "aborted": 5, "health": {"unhealthy": 0, "samples": 3}, "memory_after_warmup": reading(500.0),
              "memory_end": reading(700.0), "rss_growth_mib": 200.0, "pss_growth_mib": 199.0,
              "anon_growth_mib": 198.5, "file_growth_mib": 1.5}
    memory = arm_checks("a", report)[-1]
    assert not memory.held and "anon +198.5, file +1.5; most in worker +200.0 MiB" in memory.detail


def test_an_arms_memory_growth_is_compared_with_the_baselines() -> None:
    def arm(growth: float | None) -> dict:
        return {"outcomes": [{"index": 3, "plan": "refuse", "status": 400, "error": "x", "outcome": "refused"}],
                "memory_after_warmup": {"rss_mib": 1000.0}, "rss_growth_mib": growth}

    bound = memory_bound_mib(1000.0)

    def held(growth: float | None) -> bool:
        return next(c for c in across_arms("off", {"off": arm(200.0), "oea": arm(growth)}, off="off")
                    if "growth" in c.name).held

    assert held(200.0 + bound) and held(150.0)  # the engine's own growth is not OEA's
    assert not held(200.0 + bound + 1) and not held(None)
