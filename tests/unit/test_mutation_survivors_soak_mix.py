"""``oea soak``'s seeded request mix (``oea.soak.mix``), what it watches (``oea.soak.monitor``) and what it prints
(``oea.soak.report``) at the edges the generated mutants of ``make mutation`` found unguarded (docs/testing.md,
"Generated mutants"). The mix: what each share means (the draws below it), the fields of every kind of request
(sampled, greedy, streamed, aborted at a planned chunk or after planned seconds, each refusal kind), the lengths
at the model's edges and their errors, the exactness probe, and the concurrency schedule. The monitor: loopback
URLs, each engine's served lengths, ``identify``'s requests and refusals (a stand-in ``httpx.get``), the health
summary and poller (a stand-in client and clock), and the memory of every process of a group (a stand-in /proc).
The report: both tables, cell by cell. Everything is seeded or scripted: no server, no timing, no network."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import httpx
import pytest

from oea.soak import mix, monitor, report
from oea.soak.checks import memory_bound_mib
from oea.soak.mix import (
    REFUSALS,
    STOP_STRINGS,
    TOKEN_RANGE,
    MixShares,
    make_mix,
    make_request,
    probe_requests,
    ramp_levels,
    schedule,
)
from oea.soak.monitor import (
    NO_ANSWER,
    UNREACHABLE,
    Health,
    ServerInfo,
    SoakError,
    check_loopback,
    group_pids,
    identify,
    memory,
    serving_limits,
    watch_health,
)

NONE = {"abort": 0.0, "refuse": 0.0, "stream": 0.0, "n_above_one": 0.0, "sampled": 0.0, "logprobs": 0.0,
        "stop": 0.0, "one_token": 0.0, "full_length": 0.0}


# -- the shares ------------------------------------------------------------------------------------------------------

def test_each_share_is_a_fraction_named_by_its_flag() -> None:
    MixShares(**NONE)
    MixShares(**{**{k: 1.0 for k in NONE}, "abort": 1.0, "refuse": 0.0})
    MixShares(**{**{k: 1 for k in NONE}, "abort": 0, "refuse": 1})  # integers are fractions too
    MixShares(abort=0.5, refuse=0.5)  # exactly 1 in all
    for name in NONE:
        flag = name.replace("_", "-")
        for bad in (1.5, -0.25, "0.3", None):
            with pytest.raises(ValueError) as err:
                MixShares(**{**NONE, name: bad})
            assert str(err.value) == f"--{flag}-share must be in [0, 1], got {bad!r}"
    with pytest.raises(ValueError) as err:
        MixShares(abort=0.75, refuse=0.5)
    assert str(err.value) == "--abort-share + --refuse-share must be at most 1, got 0.75 + 0.5"


def test_a_plans_share_takes_exactly_the_draws_below_it() -> None:
    # request 5 of seed 0 draws its plan first: a refuse share equal to that draw does not refuse it, the next
    # double above does
    draw = random.Random("0:5").random()
    at = make_request(0, 5, "m", 64, MixShares(**{**NONE, "refuse": draw}))
    assert at.plan == "complete"
    assert make_request(0, 5, "m", 64, MixShares(**{**NONE, "refuse": math.nextafter(draw, 1)})).plan == "refuse"
    assert make_request(0, 5, "m", 64, MixShares(**{**NONE, "abort": draw})).plan == "complete"
    assert make_request(0, 5, "m", 64, MixShares(**{**NONE, "abort": math.nextafter(draw, 1)})).plan == "abort"


class _Draws(random.Random):
    """A generator whose every ``random()`` is ``value`` (integers still drawn from its seed)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value

    def getrandbits(self, k: int) -> int:
        return super().getrandbits(k)


def _drawn(monkeypatch: pytest.MonkeyPatch, value: float, **shares: float) -> mix.SoakRequest:
    """Request 0 of a 101-token model when every draw of its generator is ``value``."""
    monkeypatch.setattr(mix, "random", SimpleNamespace(Random=lambda seed: _Draws(value)))
    return make_request(0, 0, "m", 101, MixShares(**{**NONE, **shares}))


def test_every_share_and_fixed_chance_takes_only_the_draws_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    even = dict(refuse=0.5, stream=0.5, sampled=0.5, logprobs=0.5, stop=0.5, one_token=0.5, full_length=0.5)
    plain = _drawn(monkeypatch, 0.5, **even)
    # prompt: int(e^(0.5 ln 101)) = 10 tokens; max_tokens: int(e^(0.5 ln 92)) = 9 (log-uniform in [1, 91])
    assert (plain.plan, plain.refusal, plain.tags, plain.expected_tokens) == ("complete", None, (), None)
    assert {k: v for k, v in plain.body.items() if k != "prompt"} == {
        "model": "m", "max_tokens": 9, "ignore_eos": False, "temperature": 0.0}
    assert plain.prompt_len == 10 and plain.abort_after is None and plain.abort_after_s is None

    # above each share by a hair: that one feature is taken
    hair = math.nextafter(0.5, 1)
    assert _drawn(monkeypatch, 0.5, **{**even, "refuse": hair}).plan == "refuse"
    assert _drawn(monkeypatch, 0.5, **even, abort=1e-9).plan == "abort"
    full = _drawn(monkeypatch, 0.5, **{**even, "full_length": hair})
    assert full.tags == ("full_length",) and full.prompt_len + full.body["max_tokens"] == 101
    assert _drawn(monkeypatch, 0.5, **{**even, "one_token": hair}).body["max_tokens"] == 1
    assert _drawn(monkeypatch, 0.5, **{**even, "one_token": 0.25}).body["max_tokens"] == 9
    sampled = _drawn(monkeypatch, 0.5, **{**even, "sampled": hair})
    assert sampled.tags == ("sampled",) and sampled.body["temperature"] == 0.85  # 0.5 + 0.7 x 0.5
    assert _drawn(monkeypatch, 0.5, **{**even, "logprobs": hair}).body["logprobs"] in range(6)
    assert _drawn(monkeypatch, 0.5, **{**even, "stop": hair}).body["stop"]
    streamed = _drawn(monkeypatch, 0.5, **{**even, "stream": hair})
    assert streamed.stream and streamed.body["stream_options"] == {"include_usage": True}
    # ignore_eos at one chance in two: a draw of 0.5 keeps the end of sequence (above), one below ignores it
    assert _drawn(monkeypatch, math.nextafter(0.5, 0)).body["ignore_eos"] is True

    # n > 1 among the sampled requests: n_above_one / sampled of them
    assert "n" not in _drawn(monkeypatch, 0.5, sampled=0.8, n_above_one=0.4).body  # 0.4 / 0.8 = the draw
    assert _drawn(monkeypatch, 0.5, sampled=0.9, n_above_one=0.5).body["n"] in (2, 3, 4)  # 0.56 > the draw

    # an aborted request streams with a chance of 0.8: a draw of 0.8 gives up after planned seconds
    abort = _drawn(monkeypatch, 0.8, abort=0.9)
    assert abort.plan == "abort" and not abort.stream and abort.abort_after is None
    assert abort.abort_after_s == 0.804  # 0.02 + 0.98 x 0.8
    streamed_abort = _drawn(monkeypatch, math.nextafter(0.8, 0), abort=0.9)
    assert streamed_abort.stream and streamed_abort.abort_after_s is None
    assert 0 <= streamed_abort.abort_after < streamed_abort.body["max_tokens"]


# -- the requests of a realistic mix --------------------------------------------------------------------------------

def _realistic() -> list[mix.SoakRequest]:
    """3000 requests of the default mix (made in each test, not at import: the mutants run after import)."""
    return make_mix(0, 3000, "m", 512)


def test_every_request_names_the_model_and_its_plan() -> None:
    mixed = _realistic()
    assert Counter(r.plan for r in mixed).keys() == {"complete", "abort", "refuse"}
    assert all(r.body["model"] == "m" for r in mixed)
    assert all("return_token_ids" not in r.body for r in mixed)
    asked = make_mix(0, 50, "m", 512, token_ids=True)
    assert all(r.body["return_token_ids"] is True for r in asked if r.plan != "refuse")
    assert "return_token_ids" not in make_request(0, 3, "m", 512, MixShares()).body  # not asked by default


def test_sampled_and_greedy_requests() -> None:
    mixed = _realistic()
    served = [r for r in mixed if r.plan != "refuse"]
    assert {r.body["ignore_eos"] for r in served} == {True, False}
    sampled = [r for r in served if "sampled" in r.tags]
    greedy = [r for r in served if "sampled" not in r.tags]
    assert sampled and greedy
    assert all(r.body["temperature"] == 0.0 and "seed" not in r.body and "top_p" not in r.body for r in greedy)
    temperatures = [r.body["temperature"] for r in sampled]
    assert all(0.5 <= t <= 1.2 and t == round(t, 3) for t in temperatures)
    assert min(temperatures) < 0.52 and max(temperatures) > 1.18 and len(set(temperatures)) > 100
    seeds = [r.body["seed"] for r in sampled]
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds) and max(seeds) > 2**30
    assert all(r.body["top_p"] == 0.95 for r in sampled)
    assert {r.n for r in sampled} == {1, 2, 3, 4} and all(r.n == 1 and "n" not in r.body for r in greedy)
    assert {r.body["logprobs"] for r in served if "logprobs" in r.body} == set(range(6))
    stops = [r.body["stop"] for r in served if "stop" in r.body]
    assert {len(s) for s in stops} == {1, 2}
    assert all(len(set(s)) == len(s) and set(s) <= set(STOP_STRINGS) for s in stops)
    assert all(r.tags in ((), ("sampled",), ("full_length",), ("full_length", "sampled")) for r in served)


def test_streams_ask_for_usage_and_only_planned_requests_stream() -> None:
    mixed = _realistic()
    served = [r for r in mixed if r.plan != "refuse"]
    for r in served:
        if r.stream:
            assert r.body["stream"] is True and r.body["stream_options"] == {"include_usage": True}
        else:
            assert "stream" not in r.body and "stream_options" not in r.body
    assert all(not r.stream for r in mixed if r.plan == "refuse")
    never = make_mix(0, 300, "m", 512, MixShares(stream=0.0))
    assert not any(r.stream for r in never if r.plan == "complete")
    always = make_mix(0, 300, "m", 512, MixShares(stream=1.0))
    assert all(r.stream for r in always if r.plan == "complete")
    aborts = [r for r in always if r.plan == "abort"]
    assert 0.7 < sum(r.stream for r in aborts) / len(aborts) < 0.9  # aborts stream 4 times in 5 whatever the share


def test_the_expected_length_is_max_tokens_only_when_nothing_stops_early() -> None:
    mixed = _realistic()
    for r in mixed:
        if r.plan == "refuse":
            assert r.expected_tokens is None
        elif r.body["ignore_eos"] and "stop" not in r.body:
            assert r.expected_tokens == r.body["max_tokens"]
        else:
            assert r.expected_tokens is None
    assert Counter(r.expected_tokens is None for r in mixed if r.plan != "refuse").keys() == {True, False}


def test_an_abort_happens_at_a_planned_chunk_before_the_last_or_after_planned_seconds() -> None:
    mixed = _realistic()
    for r in mixed:
        if r.plan != "abort":
            assert r.abort_after is None and r.abort_after_s is None
    streamed = [r for r in mixed if r.plan == "abort" and r.stream]
    assert all(r.abort_after_s is None and 0 <= r.abort_after < min(r.body["max_tokens"], 64) for r in streamed)
    assert max(r.abort_after for r in streamed) == 63 and min(r.abort_after for r in streamed) == 0
    assert any(r.abort_after == r.body["max_tokens"] - 1 for r in streamed if 1 < r.body["max_tokens"] < 64)
    long = [r for r in make_mix(0, 1000, "m", 512, MixShares(abort=1.0, refuse=0.0, full_length=1.0)) if r.stream]
    assert sum(r.body["max_tokens"] > 64 for r in long) > 500  # each a chance in 64 of the last chunk before 64
    assert max(r.abort_after for r in long) == 63
    one_token = MixShares(abort=1.0, refuse=0.0, one_token=1.0, full_length=0.0)
    one = [r for r in make_mix(0, 400, "m", 512, one_token) if r.stream]
    assert one and all(r.body["max_tokens"] == 1 and r.abort_after == 0 for r in one)
    seconds = [r.abort_after_s for r in mixed if r.plan == "abort" and not r.stream]
    assert all(r.abort_after is None for r in mixed if r.plan == "abort" and not r.stream)
    assert all(0.02 <= s <= 1.0 and s == round(s, 3) for s in seconds)
    assert min(seconds) < 0.05 and max(seconds) > 0.95 and len(set(seconds)) > 100


def test_each_refusal_kind() -> None:
    refusals = make_mix(0, 3000, "m", 16, MixShares(abort=0.0, refuse=1.0))
    by_kind = {kind: [r for r in refusals if r.refusal == kind] for kind in REFUSALS}
    assert all(by_kind.values()) and sum(map(len, by_kind.values())) == 3000
    for r in refusals:
        assert r.plan == "refuse" and r.body["model"] == "m" and r.body["temperature"] == 0.0
        assert r.tags == () and r.expected_tokens is None and not r.stream and "ignore_eos" not in r.body
        assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for t in r.body["prompt"])
    too_long = [r.prompt_len for r in by_kind["prompt_too_long"]]
    assert min(too_long) == 17 and max(too_long) == 16 + 64
    assert {r.body["max_tokens"] for r in by_kind["prompt_too_long"] + by_kind["malformed_json"]} == {8}
    assert {r.body["max_tokens"] for r in by_kind["negative_max_tokens"]} == {-1, -2, -3, -4, -5}
    short = [r.prompt_len for r in by_kind["negative_max_tokens"] + by_kind["malformed_json"]]
    assert min(short) == 1 and max(short) == 16
    for r in by_kind["prompt_too_long"] + by_kind["negative_max_tokens"]:
        assert r.raw is None and r.payload() == json.dumps(r.body).encode()
    cuts = []
    for r in by_kind["malformed_json"]:
        text = json.dumps(r.body).encode()
        assert isinstance(r.raw, bytes) and text.startswith(r.raw) and r.payload() == r.raw
        cuts.append((len(r.raw), len(text)))
    assert min(cut for cut, _ in cuts) == 1 and any(cut == whole - 1 for cut, whole in cuts)


# -- the lengths -----------------------------------------------------------------------------------------------------

def test_the_smallest_model_gets_one_token_prompts_and_outputs() -> None:
    for shares in (MixShares(refuse=0.0), MixShares(**{**NONE, "full_length": 1.0})):
        for r in make_mix(0, 50, "m", 2, shares):
            assert (r.prompt_len, r.body["max_tokens"]) == (1, 1)
    full = make_mix(0, 200, "m", 8, MixShares(**{**NONE, "full_length": 1.0}))
    assert all(r.tags == ("full_length",) and r.prompt_len + r.body["max_tokens"] == 8 for r in full)
    assert {r.prompt_len for r in full} == set(range(1, 8))


def test_prompts_and_outputs_stay_within_the_served_lengths() -> None:
    for shares in (MixShares(refuse=0.0), MixShares(**{**NONE, "full_length": 1.0})):
        served = make_mix(0, 400, "m", 64, shares, max_total_len=10)
        assert all(1 <= r.prompt_len <= 9 and 1 <= r.body["max_tokens"] <= 10 - r.prompt_len for r in served)
        assert max(r.prompt_len for r in served) == 9
    served = make_mix(0, 400, "m", 8, MixShares(refuse=0.0))
    assert {r.prompt_len for r in served} == set(range(1, 8)) and {r.body["max_tokens"] for r in served} == set(
        range(1, 8))
    capped = make_mix(0, 400, "m", 64, MixShares(refuse=0.0), max_prompt_len=5)
    assert max(r.prompt_len for r in capped) == 5 and max(r.prompt_len + r.body["max_tokens"] for r in capped) == 64


@pytest.mark.parametrize(("max_model_len", "prompt", "total"), [(1, None, None), (16, None, 17), (16, None, 1),
                                                                 (16, 20, 1)])
def test_lengths_nothing_can_be_served_in_are_refused(max_model_len: int, prompt: int | None,
                                                      total: int | None) -> None:
    with pytest.raises(ValueError) as err:
        make_request(0, 0, "m", max_model_len, MixShares(), max_prompt_len=prompt, max_total_len=total)
    assert str(err.value) == (f"max_model_len must be >= 2 (a prompt and one output token) and the served lengths "
                              f"within it, got {max_model_len} (prompt {prompt}, total {total})")


def test_log_uniform_draws_nothing_for_one_value_and_favours_short_lengths() -> None:
    rng = random.Random(0)
    state = rng.getstate()
    assert mix._log_uniform(rng, 3, 3) == 3 and mix._log_uniform(rng, 3, 2) == 3
    assert rng.getstate() == state
    counts = Counter(mix._log_uniform(rng, 1, 3) for _ in range(3000))
    # P(1) = ln 2 / ln 4 = 0.5, P(2) = ln 1.5 / ln 4 = 0.29, P(3) = ln(4/3) / ln 4 = 0.21
    assert counts.keys() == {1, 2, 3}
    for value, share in ((1, 0.5), (2, 0.2925), (3, 0.2075)):
        assert abs(counts[value] / 3000 - share) < 0.03, counts


def test_make_mix_is_make_request_of_each_index() -> None:
    shares = MixShares(abort=0.2, refuse=0.2)
    got = make_mix(5, 40, "model-x", 300, shares, first=7, token_ids=True, max_prompt_len=100, max_total_len=200)
    assert got == [make_request(5, 7 + i, "model-x", 300, shares, True, 100, 200) for i in range(40)]
    assert make_mix(5, 40, "model-x", 300) == [make_request(5, i, "model-x", 300, MixShares()) for i in range(40)]


# -- the exactness probe ---------------------------------------------------------------------------------------------

def test_the_probe_is_the_same_seeded_sampling_requests_in_every_arm() -> None:
    probes = probe_requests("m")
    assert probes == probe_requests("m") and len(probes) == 6
    assert [(r.prompt_len, r.body["prompt"][0]) for r in probes] == [
        (17, 119), (10, 433), (11, 2457), (42, 2497), (7, 3783), (33, 459)]
    for i, r in enumerate(probes):
        assert (r.index, r.plan, r.refusal, r.raw, r.expected_tokens, r.tags) == (-1 - i, "complete", None, None, 24,
                                                                                ("probe",))
        assert {k: v for k, v in r.body.items() if k != "prompt"} == {
            "model": "m", "max_tokens": 24, "n": 4, "temperature": 0.9, "seed": 1000 + i, "logprobs": 2,
            "ignore_eos": True}
        assert 4 <= r.prompt_len <= 48 and all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for t in r.body["prompt"])
        assert not r.stream and r.abort_after is None and r.abort_after_s is None
    asked = probe_requests("x", count=2, token_ids=True)
    assert [r.body for r in asked] == [{**r.body, "model": "x", "return_token_ids": True} for r in probes[:2]]
    assert [r.prompt_len for r in probe_requests("m", count=40)][:6] == [r.prompt_len for r in probes]
    lengths = [r.prompt_len for r in probe_requests("m", count=400)]
    assert min(lengths) == 4 and max(lengths) == 48


# -- the schedule ----------------------------------------------------------------------------------------------------

def test_ramp_levels_end_at_the_maximum() -> None:
    assert ramp_levels(1) == [1] and ramp_levels(2) == [1, 2] and ramp_levels(3) == [1, 2, 3]
    assert ramp_levels(8) == [1, 2, 4, 8]
    for bad in (0, -1):
        with pytest.raises(ValueError) as err:
            ramp_levels(bad)
        assert str(err.value) == f"--max-concurrency must be >= 1, got {bad}"


def _layout(phases: list[mix.Phase]) -> list[tuple[int, int, bool, float]]:
    return [(len(p.requests), p.concurrency, p.burst, p.idle_s) for p in phases]


def test_the_schedule_ramps_in_equal_parts_then_alternates_bursts_and_steady_blocks() -> None:
    requests = make_mix(0, 100, "m", 64)
    phases = schedule(requests, 4)
    assert _layout(phases) == [(10, 1, False, 0.0), (10, 2, False, 0.0), (10, 4, False, 0.0)] + [
        (4, 4, True, 1.5), (16, 4, False, 0.0)] * 3 + [(4, 4, True, 1.5), (6, 4, False, 0.0)]
    assert [r for p in phases for r in p.requests] == requests
    assert _layout(schedule(requests[:3], 32)) == [(3, 3, True, 1.5)]  # no ramp: an empty part is no phase
    assert _layout(schedule(requests[:10], 8, ramp_share=0.5, burst_idle_s=0.25)) == [
        (1, 1, False, 0.0), (1, 2, False, 0.0), (1, 4, False, 0.0), (2, 8, False, 0.0), (5, 5, True, 0.25)]


# == oea.soak.monitor ================================================================================================
# which engine answers (a stand-in httpx.get), the health poller (a stand-in httpx.AsyncClient and clock), and the
# memory of every process of a group (a stand-in /proc tree)

def test_only_http_on_a_loopback_address_is_soaked() -> None:
    assert check_loopback("http://127.0.0.1:8000//") == "http://127.0.0.1:8000"
    assert check_loopback("http://127.0.0.1:8000/X/") == "http://127.0.0.1:8000/X"  # a path prefix kept whole
    assert check_loopback("https://localhost:1/") == "https://localhost:1"
    assert check_loopback("http://LOCALHOST:1") == "http://LOCALHOST:1"
    assert check_loopback("http://127.0.0.2:1") == "http://127.0.0.2:1" and check_loopback("http://[::1]:2")
    for url in ("ftp://127.0.0.1:1", "http://", "127.0.0.1:8000", "http://:80"):
        with pytest.raises(SoakError) as err:
            check_loopback(url)
        assert str(err.value) == f"--base-url must be http://127.0.0.1:PORT (a loopback server), got {url!r}"
    for url, host in (("http://10.1.2.3:8000", "10.1.2.3"), ("https://example.com/", "example.com"),
                      ("http://[::2]:1", "::2"), ("http://localhost.example:1", "localhost.example")):
        with pytest.raises(SoakError) as err:
            check_loopback(url)
        assert str(err.value) == ("--base-url must name a loopback address (127.0.0.1, ::1, localhost): the soak "
                                  f"sends malformed and aborted requests and runs only against a local server, got "
                                  f"{host!r}")


def test_the_served_lengths_of_each_engine() -> None:
    assert serving_limits("vllm", 512, {"max_req_input_len": 100}) == (511, 512)
    assert serving_limits("sglang", 512, {"max_req_input_len": 506}) == (505, 510)
    assert serving_limits("sglang", 512, {"max_req_input_len": 2}) == (1, 6)
    for unusable in (None, {}, {"max_req_input_len": 1}, {"max_req_input_len": True}, {"max_req_input_len": "300"},
                     {"max_req_input_len": 300.0}):
        assert serving_limits("sglang", 512, unusable) == (505, 510), unusable  # from the context length
    assert serving_limits("sglang", 4, {"max_req_input_len": 506}) == (3, 4)  # never beyond the model length
    assert serving_limits("sglang", 2, None) == (1, 2)
    info = ServerInfo("u", "vllm", "m", 512)
    assert (info.prompt_limit, info.total_limit) == (511, 512)
    assert (ServerInfo("u", "sglang", "m", 512, max_prompt_len=300, max_total_len=400).prompt_limit,
            ServerInfo("u", "sglang", "m", 512, max_prompt_len=300, max_total_len=400).total_limit) == (300, 400)


class _Answer:
    def __init__(self, status: int, body: Any = None, text: str = "") -> None:
        self.status_code, self.body, self.text = status, body, text

    def json(self) -> Any:
        if isinstance(self.body, Exception):
            raise self.body
        return self.body


def _serve(monkeypatch: pytest.MonkeyPatch, answers: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``httpx.get`` answering ``answers[path]`` (an ``_Answer`` or an exception to raise); the calls made."""
    calls: list[tuple[str, Any, Any]] = []

    def get(url: str, timeout: Any = None, trust_env: Any = True) -> _Answer:
        calls.append((url, timeout, trust_env))
        answer = answers.get(url.split(":8000", 1)[1], _Answer(404, ValueError("no"), "not found"))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(httpx, "get", get)
    return calls


def _models(**first: Any) -> _Answer:
    return _Answer(200, {"object": "list", "data": [{"id": "m", "owned_by": "vllm", "max_model_len": 512, **first}]})


def test_identify_asks_the_model_list_then_the_engines_version(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _serve(monkeypatch, {"/v1/models": _models(root="/models/m"), "/version": _Answer(200, {"version": "1"})})
    assert identify("http://127.0.0.1:8000/", timeout=3.5) == ServerInfo(
        "http://127.0.0.1:8000", "vllm", "m", 512, "1", "/models/m", 511, 512)
    assert calls == [("http://127.0.0.1:8000/v1/models", 3.5, False), ("http://127.0.0.1:8000/version", 3.5, False)]
    calls = _serve(monkeypatch, {"/v1/models": _models(owned_by="sglang", id=7, root=None, max_model_len=4096),
                                 "/server_info": _Answer(200, {"version": 2, "max_req_input_len": 1018})})
    assert identify("http://127.0.0.1:8000") == ServerInfo(
        "http://127.0.0.1:8000", "sglang", "7", 4096, "2", "", 1017, 1022)
    assert [url for url, _, _ in calls] == ["http://127.0.0.1:8000/v1/models", "http://127.0.0.1:8000/server_info"]
    assert {(timeout, trust_env) for _, timeout, trust_env in calls} == {(10.0, False)}


def test_an_engine_that_does_not_say_its_version_is_still_identified(monkeypatch: pytest.MonkeyPatch) -> None:
    for about in (_Answer(500, {"version": "1"}), _Answer(200, ValueError("not json")), _Answer(200, ["1"]),
                  httpx.ConnectError("refused"), None):
        answers = {"/v1/models": _models(owned_by="sglang")}
        if about is not None:
            answers["/server_info"] = about
        _serve(monkeypatch, answers)
        info = identify("http://127.0.0.1:8000")
        assert (info.version, info.max_prompt_len, info.max_total_len) == ("", 505, 510), about


URL = "http://127.0.0.1:8000/v1/models"


@pytest.mark.parametrize(("answer", "message"), [
    (httpx.ConnectError("refused"), f"cannot reach {URL}: ConnectError: refused"),
    (httpx.ReadTimeout("slow"), f"cannot reach {URL}: ReadTimeout: slow"),
    (_Answer(404, {"data": [{"id": "m"}]}, "x" * 200),
     f"{URL} answered HTTP 404 without a model list: not a vLLM or SGLang OpenAI server ({'x' * 120!r})"),
    (_Answer(200, ValueError("bad"), "<html>"),
     f"{URL} answered HTTP 200 without a model list: not a vLLM or SGLang OpenAI server ('<html>')"),
    (_Answer(200, ["m"], "[]"), f"{URL} answered HTTP 200 without a model list: not a vLLM or SGLang OpenAI server "
                                "('[]')"),
    (_Answer(200, {"data": []}, "e"), f"{URL} answered HTTP 200 without a model list: not a vLLM or SGLang OpenAI "
                                      "server ('e')"),
    (_Answer(200, {"data": {"id": "m"}}, "d"), f"{URL} answered HTTP 200 without a model list: not a vLLM or "
                                               "SGLang OpenAI server ('d')"),
    (_Answer(200, {"data": ["m"]}, "s"), f"{URL} answered HTTP 200 without a model list: not a vLLM or SGLang "
                                         "OpenAI server ('s')"),
    (_models(owned_by="openai"), f"{URL}: the server is not vLLM or SGLang (owned_by 'openai'); oea soak knows only "
                                 "vllm, sglang"),
    (_Answer(200, {"data": [{"id": "m", "max_model_len": 512}]}), f"{URL}: the server is not vLLM or SGLang "
                                                                  "(owned_by ''); oea soak knows only vllm, sglang"),
    (_models(owned_by=None), f"{URL}: the server is not vLLM or SGLang (owned_by 'None'); oea soak knows only "
                             "vllm, sglang"),
    (_models(max_model_len=None), f"{URL}: no max_model_len in the model list (got None); start the server with "
                                  "--max-model-len (vLLM) / --context-length (SGLang)"),
    (_models(max_model_len=1), f"{URL}: no max_model_len in the model list (got 1); start the server with "
                               "--max-model-len (vLLM) / --context-length (SGLang)"),
    (_models(max_model_len="512"), f"{URL}: no max_model_len in the model list (got '512'); start the server "
                                   "with --max-model-len (vLLM) / --context-length (SGLang)"),
])
def test_identify_refuses_what_is_not_a_vllm_or_sglang_server(monkeypatch: pytest.MonkeyPatch, answer: Any,
                                                              message: str) -> None:
    calls = _serve(monkeypatch, {"/v1/models": answer, "/version": _Answer(200, {"version": "1"})})
    with pytest.raises(SoakError) as err:
        identify("http://127.0.0.1:8000")
    assert str(err.value) == message
    assert [url for url, _, _ in calls] == [URL], "nothing else asked"
    _serve(monkeypatch, {"/v1/models": _models(owned_by=None), "/version": _Answer(200, {})})
    with pytest.raises(SoakError):
        identify("http://127.0.0.1:8000")
    _serve(monkeypatch, {"/v1/models": _models(max_model_len=2), "/version": _Answer(200, {})})
    assert identify("http://127.0.0.1:8000").max_model_len == 2


def test_the_health_summary() -> None:
    samples = [(0.0, 200, 5.06), (1.0, NO_ANSWER, 10_000.0), (12.0, 503, 3.0), (13.0, UNREACHABLE, 1.0),
               (14.0, 200, 7.36), (15.0, 200, 2.0), (16.0, 200, 4.04)]
    assert Health(samples).summary() == {
        "samples": 7, "unhealthy": 2, "no_answer": 1, "longest_silence_s": 11.0, "first_unhealthy_s": 12.0,
        "first_unhealthy_status": 503, "max_latency_ms": 7.4, "median_latency_ms": 5.1}
    assert Health([(0.25, NO_ANSWER, 10_000.0)]).summary() == {
        "samples": 1, "unhealthy": 0, "no_answer": 1, "longest_silence_s": 10.0, "first_unhealthy_s": None,
        "first_unhealthy_status": None, "max_latency_ms": None, "median_latency_ms": None}
    assert Health([(1.0, NO_ANSWER, 10_060.0)]).summary()["longest_silence_s"] == 10.1
    assert Health([(2.26, UNREACHABLE, 1.0), (3.0, 500, 1.0)]).summary()["first_unhealthy_s"] == 2.3
    assert Health().summary()["samples"] == 0 and Health().samples == [] and Health().samples is not Health().samples


def test_the_longest_silence_runs_from_the_first_unanswered_request_to_the_next_answers_end() -> None:
    assert Health([(0.0, 200, 5.0)]).longest_silence_s() == 0.0
    # two unanswered requests in a row: one silence from the first, to the end of the second (still none came)
    assert Health([(1.0, NO_ANSWER, 10_000.0), (12.0, NO_ANSWER, 10_000.0)]).longest_silence_s() == 21.0
    # ... and to the end of the next answer, whatever its status
    assert Health([(1.0, NO_ANSWER, 10_000.0), (12.0, NO_ANSWER, 10_000.0), (23.0, 500, 500.0)]
                  ).longest_silence_s() == 22.5
    # two silences: the longer counts, each from its own first unanswered request
    assert Health([(1.0, NO_ANSWER, 2_000.0), (4.0, 200, 1_000.0), (10.0, NO_ANSWER, 1_000.0), (11.5, 200, 0.0)]
                  ).longest_silence_s() == 4.0
    assert Health([(1.0, NO_ANSWER, 9_000.0), (10.0, 200, 1_000.0), (20.0, NO_ANSWER, 1_000.0), (21.5, 200, 0.0)]
                  ).longest_silence_s() == 10.0


class _Client:
    """``httpx.AsyncClient``: each ``get`` answers the next of ``script`` (a status or an exception to raise)."""

    made: ClassVar[list[dict[str, Any]]] = []
    urls: ClassVar[list[str]] = []
    script: ClassVar[list[Any]] = []
    stop: asyncio.Event

    def __init__(self, **kwargs: Any) -> None:
        type(self).made.append(kwargs)

    async def __aenter__(self) -> _Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def get(self, url: str) -> Any:
        self.urls.append(url)
        answer = self.script.pop(0)
        if not self.script:
            self.stop.set()
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(status_code=answer)


def test_the_health_poller_records_each_answer_when_it_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 101.0, 101.25, 102.0, 112.0, 113.0, 113.002, 114.0, 114.5])
    monkeypatch.setattr(monitor, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(httpx, "AsyncClient", _Client)
    waits: list[float] = []

    async def wait_for(waited: Any, timeout: float) -> Any:
        waits.append(timeout)
        return await asyncio.wait_for(waited, 0)

    monkeypatch.setattr(monitor, "asyncio", SimpleNamespace(wait_for=wait_for, TimeoutError=asyncio.TimeoutError))
    _Client.made, _Client.urls = [], []
    _Client.script = [200, httpx.ReadTimeout("slow"), httpx.ConnectError("refused"), 503]
    health = Health()

    async def poll() -> None:
        _Client.stop = asyncio.Event()
        await watch_health("http://127.0.0.1:8000", health, _Client.stop, interval_s=0.0, timeout_s=2.5)

    asyncio.run(poll())
    assert health.samples == [(1.0, 200, 250.0), (2.0, NO_ANSWER, 10_000.0), (pytest.approx(13.0), UNREACHABLE,
                                                                            pytest.approx(2.0)), (14.0, 503, 500.0)]
    assert _Client.urls == ["http://127.0.0.1:8000/health"] * 4
    (made,) = _Client.made
    assert waits == [0.0] * 4  # between polls, stopped at the 4th
    assert made["trust_env"] is False and made["timeout"] == 2.5 and made["limits"].max_keepalive_connections == 0

    stopped = asyncio.Event()
    stopped.set()
    _Client.made = []
    monkeypatch.setattr(monitor, "time", SimpleNamespace(monotonic=lambda: 0.0))
    asyncio.run(watch_health("http://127.0.0.1:8000", health, stopped))  # stopped before it began: asks nothing
    assert len(health.samples) == 4 and _Client.made[0]["timeout"] == monitor.HEALTH_TIMEOUT_S
    # by default, a poll a second
    waits.clear()
    _Client.script = [200, 200]
    monkeypatch.setattr(monitor, "time", SimpleNamespace(monotonic=lambda: 0.0))
    _Client.stop = asyncio.Event()
    asyncio.run(watch_health("http://127.0.0.1:8000", Health(), _Client.stop))
    assert waits == [1.0, 1.0]


def _proc(root: Path, pid: str, stat: str | None = None, status: str | None = None, rollup: str | None = None,
          cmdline: bytes | None = None) -> None:
    folder = root / "proc" / pid
    folder.mkdir(parents=True)
    for name, text in (("stat", stat), ("status", status), ("smaps_rollup", rollup)):
        if text is not None:
            (folder / name).write_text(text)
    if cmdline is not None:
        (folder / "cmdline").write_bytes(cmdline)


def _stat(comm: str, state: str, pgrp: int) -> str:
    return f"1 ({comm}) {state} 1 {pgrp} {pgrp} 0 -1 4194560 100 0 0 0\n"


STATUS = ("Name:\tx\nUmask:\t0022\nVmPeak:\t  9999 kB\nVmRSS:\t  {rss} kB\nRssAnon:\t  {anon} kB\n"
          "RssFile:\t  {file} kB\n")


@pytest.fixture
def proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in /proc under ``tmp_path``: monitor's ``open`` and ``os.listdir`` read it."""
    real_open, real_listdir = open, os.listdir
    order: list[str] = []

    def listdir(path: str) -> list[str]:
        assert path == "/proc"
        found = real_listdir(tmp_path / "proc")
        return sorted(found, key=lambda e: order.index(e) if e in order else -1)

    monkeypatch.setattr(monitor, "open", lambda path, *a, **k: real_open(tmp_path / str(path).lstrip("/"), *a, **k),
                        raising=False)
    monkeypatch.setattr(monitor, "os", SimpleNamespace(listdir=listdir, path=os.path))
    monkeypatch.setattr(monitor, "time", SimpleNamespace(time=lambda: 1234.5))
    (tmp_path / "proc").mkdir()
    _proc(tmp_path, "self", stat=_stat("python", "R", 7))  # not a process id
    _proc(tmp_path, "1", stat=_stat("api server", "S", 7), rollup="Rss: 3072 kB\nPss:   2000 kB\nPss_Anon: 5 kB\n",
          status=STATUS.format(rss=3072, anon=2048, file=1000) + "RssShmem:\t  512 kB\nThreads:\t4\n",
          cmdline=b"/usr/bin/python3\0-m\0vllm\0")
    _proc(tmp_path, "10", stat=_stat("a) b (c", "S", 7), status=STATUS.format(rss=1000, anon=600, file=400),
          cmdline=b"VLLM::Worker\0")  # no smaps_rollup: no PSS; no RssShmem line
    _proc(tmp_path, "12", stat=_stat("kthread", "S", 7), status="Name:\tk\nThreads:\t1\n", cmdline=b"")  # no VmRSS
    _proc(tmp_path, "2", stat=_stat("gone", "Z", 7), status=STATUS.format(rss=1, anon=1, file=0))  # a zombie
    _proc(tmp_path, "3", stat=_stat("other", "S", 8), status=STATUS.format(rss=1, anon=1, file=0))  # another group
    _proc(tmp_path, "4")  # ended while listed
    _proc(tmp_path, "9", stat=_stat("x", "S", 17), status=STATUS.format(rss=1, anon=1, file=0))  # group 17 != 7
    _proc(tmp_path, "5", stat=_stat("w", "S", 7), status="VmRSS:\t  abc kB\n", cmdline=b"w\0")  # unreadable RSS
    order.extend(["12", "self", "10", "3", "2", "4", "9", "5", "1"])
    return tmp_path


def test_the_groups_live_processes_are_every_process_of_that_group(proc: Path) -> None:
    assert group_pids(7) == [1, 5, 10, 12]
    assert group_pids(8) == [3] and group_pids(17) == [9] and group_pids(1) == []


def test_memory_sums_every_process_of_the_group(proc: Path) -> None:
    assert memory(7) == {
        "time": 1234.5, "rss_mib": 4.0, "pss_mib": 2.0, "anon_mib": 2.6, "file_mib": 1.4, "shmem_mib": 0.5,
        "processes": [
            {"pid": 1, "name": "python3", "rss_mib": 3.0, "pss_mib": 2.0, "anon_mib": 2.0, "file_mib": 1.0,
             "shmem_mib": 0.5},
            {"pid": 10, "name": "VLLM::Worker", "rss_mib": 1.0, "pss_mib": None, "anon_mib": 0.6, "file_mib": 0.4}]}
    assert memory(8)["processes"][0]["name"] == "?"  # no cmdline
    (proc / "proc" / "1" / "cmdline").write_bytes(b"/opt/caf\xe9/vllm\xff\0serve\0")
    assert memory(7)["processes"][0]["name"] == "vllm\ufffd"  # undecodable bytes replaced
    assert memory(99) == {"time": 1234.5, "rss_mib": 0.0, "pss_mib": 0.0, "anon_mib": 0.0, "file_mib": 0.0,
                          "shmem_mib": 0.0, "processes": []}


def test_kib_reads_the_asked_fields_of_a_proc_file(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text("Name:\tx\nVmRSS:\t  2048 kB\nno colon here\nVmRSSx:\t  1 kB\nRssAnon: 7 kB\n")
    assert monitor._kib(str(path), "VmRSS", "RssAnon") == {"VmRSS": 2048, "RssAnon": 7}
    assert monitor._kib(str(path), "VmRSS") == {"VmRSS": 2048}
    assert monitor._kib(str(tmp_path / "none"), "VmRSS") == {}
    path.write_text("VmRSS:\t  2048 kB\nRssAnon:\n")
    assert monitor._kib(str(path), "VmRSS", "RssAnon") == {}  # a malformed file is not read in part
    path.write_text("VmRSS:\t  2048 kB (a:b)\n")
    assert monitor._kib(str(path), "VmRSS") == {"VmRSS": 2048}  # the value after the first colon
    path.write_text("VmRSS:\t  20x kB\n")
    assert monitor._kib(str(path), "VmRSS") == {}
    assert [monitor._mib(k) for k in (1024, 1000, 1126, 1076, 102400, 0)] == [1.0, 1.0, 1.1, 1.1, 100.0, 0.0]


# == oea.soak.report =================================================================================================
# what `oea soak` prints at its end (the CLI prints it in its own process: here called directly)

def _arm(**changes: Any) -> dict[str, Any]:
    arm = {"server": {"engine": "vllm", "version": "0.11"}, "sent": 10, "completed": 5, "refused": 2,
           "refused_by_status": {"prompt_too_long 400": 1, "malformed_json 400": 1}, "aborted": 3, "failed": 4,
           "unsent": 1, "rss_growth_mib": 12.34, "rss_after_warmup_mib": 1000.4, "rss_end_mib": 1012.6,
           "health": {"samples": 5, "unhealthy": 1}, "soak_s": 61.6}
    arm.update(changes)
    return arm


RESULT = {"arms": {"off": _arm(), "oea-k3": _arm(server={"engine": "sglang", "version": "0.5"}, refused_by_status={},
                                              rss_growth_mib=None, sent=0, completed=0, refused=0, aborted=0,
                                              failed=0, unsent=0, health={"samples": 0, "unhealthy": 0},
                                              soak_s=0.4)},
          "checks": [{"name": "off: no failed requests", "held": True, "detail": "fine"},
                     {"name": "oea: memory", "held": False, "detail": "grew"},
                     {"name": "oea: growth against off", "held": False, "detail": "d", "verdict": False},
                     {"name": "oea: counted", "held": False, "detail": "e", "verdict": True}]}


def _tables(text: str) -> list[list[list[str]]]:
    """The printed tables: each a list of rows (the header first), each row its cells as printed (padding kept)."""
    tables: list[list[list[str]]] = []
    for line in text.splitlines():
        if line.startswith("┏"):
            tables.append([])
        elif line.startswith(("┃", "│")):
            tables[-1].append(line.replace("┃", "│").split("│")[1:-1])
    return tables


def test_the_result_is_one_row_per_arm_then_the_checks(capsys: pytest.CaptureFixture) -> None:
    report.print_result(RESULT)
    out = capsys.readouterr().out
    titles = [line.strip() for line in out.splitlines() if line.strip() and line.strip()[0].isalpha()]
    assert titles == ["oea soak: requests per arm", "what must hold"]
    arms, checks = _tables(out)
    header, *rows = arms
    assert [c.strip() for c in header] == [
        "arm", "engine", "sent", "completed", "refused (status)", "aborted", "failed", "unsent",
        "RSS after warm-up -> end (MiB)", "growth / bound", "health", "time (s)"]
    bound = memory_bound_mib(1000.4)  # 84.0 MiB
    assert [[c.strip() for c in row] for row in rows] == [
        ["off", "vllm 0.11", "10", "5", "2 (malformed_json 400: 1, prompt_too_long 400: 1)", "3", "4", "1",
         "1000 -> 1013", f"+12.3 / {bound:.0f}", "4/5 ok", "62"],
        ["oea-k3", "sglang 0.5", "0", "0", "0 (-)", "0", "0", "0", "-", "-", "0/0 ok", "0"]]
    for row in rows:  # arm, engine and refusals to the left, the numbers to the right
        for column, cell in enumerate(row):
            text = cell.strip()
            assert cell == (f" {text:<{len(cell) - 2}} " if column in (0, 1, 4) else f" {text:>{len(cell) - 2}} ")
    assert [[c.strip() for c in row] for row in checks] == [
        ["check", "held", "seen"], ["off: no failed requests", "yes", "fine"], ["oea: memory", "NO", "grew"],
        ["oea: growth against off", "no (reported)", "d"], ["oea: counted", "NO", "e"]]
    for row in checks:
        assert all(cell == f" {cell.strip():<{len(cell) - 2}} " for cell in row)


def test_a_failed_verdict_is_printed_in_bold_red(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    import oea.console

    consoles: list[Console] = []

    def terminal() -> Console:
        consoles.append(Console(force_terminal=True, color_system="standard", width=220, record=True))
        return consoles[-1]

    monkeypatch.setattr(oea.console, "wide_console", terminal)
    report.print_result(RESULT)
    out = consoles[0].export_text(styles=True)
    assert out.count("\x1b[1;31mNO\x1b[0m") == 2 and "\x1b[1;31mno (reported)" not in out
    assert out.count("\x1b[1;31m") == 2


def test_the_arm_tables_text_columns_are_justified_left_and_its_figures_right(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """The justification each column of the arm table is given, as rich reads it (rich prints an unknown one as
    left, so the printed text alone would not tell ``"left"`` from a misspelt value)."""
    from rich.console import Console

    tables: list[Any] = []
    monkeypatch.setattr(Console, "print", lambda self, table, *args, **kwargs: tables.append(table))
    report.print_result(RESULT)
    left = {"arm", "engine", "refused (status)"}
    assert [c.justify for c in tables[0].columns] == ["left" if c.header in left else "right"
                                                      for c in tables[0].columns]
    assert sum(c.justify == "left" for c in tables[0].columns) == 3
