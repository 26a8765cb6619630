"""``oea soak``'s soak of one arm (``oea.soak.runner``) at the edges the generated mutants of ``make mutation``
found unguarded (docs/testing.md, "Generated mutants"): the limits a ``SoakConfig`` refuses and their words;
what the soak sends and in which order (the warm-up of the next seed, the settle, the probe one request at a
time, the seeded mix under its schedule), with which deadline and time-out; what the report holds (the config,
the tallies, the phases, health over time, every outcome, the memory readings and their growth, the processes
that vanished or appeared, the time taken); the memory sampler; the second half's growth.

Everything ``_soak`` calls that would need a server is stood in: ``run_phases`` (recorded, answering from the
plan of each request), ``watch_health``, ``memory``, ``group_pids``, the clock and ``asyncio.sleep`` (recorded,
never waiting): no server, no network, no timing."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from oea.soak import runner
from oea.soak.client import Outcome, tally
from oea.soak.mix import MixShares, Phase, make_mix, probe_requests, schedule
from oea.soak.monitor import Health, ServerInfo, SoakError
from oea.soak.runner import MAX_DURATION_S, MAX_REQUESTS, SoakConfig, soak_server

INFO = ServerInfo("http://127.0.0.1:9", "vllm", "m", 96, version="v", root="/models/m", max_prompt_len=80,
                  max_total_len=90)
REAL_SLEEP = asyncio.sleep


# -- the limits ---------------------------------------------------------------------------------------------------

def _refusal(**value: Any) -> str:
    with pytest.raises(SoakError) as err:
        SoakConfig(**{"requests": 10, "duration_s": 60.0, **value})
    return str(err.value)


BOUNDED = "(the soak is bounded in requests and time and stops by itself)"


@pytest.mark.parametrize(("value", "message"), [
    ({"requests": 0}, f"--requests must be an integer in 1..1e+06 {BOUNDED}, got 0"),
    ({"requests": MAX_REQUESTS + 1}, f"--requests must be an integer in 1..1e+06 {BOUNDED}, got 1000001"),
    ({"requests": 2.5}, f"--requests must be an integer in 1..1e+06 {BOUNDED}, got 2.5"),
    ({"requests": True}, f"--requests must be an integer in 1..1e+06 {BOUNDED}, got True"),
    ({"requests": "3"}, f"--requests must be an integer in 1..1e+06 {BOUNDED}, got '3'"),
    ({"duration_s": 0.0009}, f"--duration must be a finite number in 0.001..86400 {BOUNDED}, got 0.0009"),
    ({"duration_s": MAX_DURATION_S + 1}, f"--duration must be a finite number in 0.001..86400 {BOUNDED}, got 86401.0"),
    ({"duration_s": float("nan")}, f"--duration must be a finite number in 0.001..86400 {BOUNDED}, got nan"),
    ({"timeout_s": 0.0}, f"--timeout must be a finite number in 0.001..86400 {BOUNDED}, got 0.0"),
    ({"timeout_s": 86400.5}, f"--timeout must be a finite number in 0.001..86400 {BOUNDED}, got 86400.5"),
    ({"max_concurrency": 0}, f"--max-concurrency must be an integer in 1..1024 {BOUNDED}, got 0"),
    ({"max_concurrency": 1025}, f"--max-concurrency must be an integer in 1..1024 {BOUNDED}, got 1025"),
    ({"warmup": -1}, f"--warmup must be an integer in 0..1e+06 {BOUNDED}, got -1"),
    ({"warmup": MAX_REQUESTS + 1}, f"--warmup must be an integer in 0..1e+06 {BOUNDED}, got 1000001"),
    ({"warmup": 1.5}, f"--warmup must be an integer in 0..1e+06 {BOUNDED}, got 1.5"),
    ({"ramp_share": -0.01}, "--ramp-share must be in [0, 1], got -0.01"),
    ({"ramp_share": 1.01}, "--ramp-share must be in [0, 1], got 1.01"),
])
def test_each_unbounded_limit_is_refused_in_its_own_words(value: dict[str, Any], message: str) -> None:
    assert _refusal(**value) == message


def test_every_limit_at_its_bounds_is_accepted() -> None:
    """The bounds are inclusive, an integral float counts as an integer, and the defaults are what the
    docstring and ``oea soak``'s help say."""
    for low in (SoakConfig(requests=1, duration_s=1e-3, timeout_s=1e-3, max_concurrency=1, warmup=0, ramp_share=0.0),
                SoakConfig(requests=MAX_REQUESTS, duration_s=MAX_DURATION_S, timeout_s=MAX_DURATION_S,
                           max_concurrency=1024, warmup=MAX_REQUESTS, ramp_share=1.0),
                SoakConfig(requests=3.0, duration_s=5, warmup=2.0)):  # type: ignore[arg-type]
        assert low.requests >= 1
    cfg = SoakConfig(requests=10, duration_s=60.0)
    assert (cfg.seed, cfg.max_concurrency, cfg.warmup, cfg.timeout_s, cfg.probe, cfg.shares, cfg.ramp_share,
            cfg.burst_idle_s, cfg.settle_s, cfg.memory_every_s) == (0, 32, 64, 300.0, True, MixShares(), 0.3, 1.5,
                                                                      3.0, 5.0)


def test_the_bound_check_alone_names_its_kind_and_bounds() -> None:
    runner._bounded("--x", 5, 5, 5)
    runner._bounded("--x", 5, 5, 5, integer=True)
    with pytest.raises(SoakError, match=r"^--x must be a finite number in 0\.5\.\.2\.5 "):
        runner._bounded("--x", 3, 0.5, 2.5)
    with pytest.raises(SoakError, match=r"^--x must be a finite number in 1\.\.10 .*, got inf$"):
        runner._bounded("--x", float("inf"), 1, 10)
    with pytest.raises(SoakError, match=r"^--x must be an integer in 1\.\.9 .*, got None$"):
        runner._bounded("--x", None, 1, 9, integer=True)  # type: ignore[arg-type]


# -- the soak of one arm, everything it calls stood in ------------------------------------------------------------

def _outcome(request: Any, tokens: int) -> Outcome:
    """What the stand-in server answers: a refusal refused, an abort aborted, every other request completed
    (the request's index as its one token id) or, for a request index divisible by 7, failed."""
    if request.plan == "refuse":
        return Outcome(request.index, request.plan, "refused", status=400, refusal=request.refusal, error="no")
    if request.plan == "abort":
        return Outcome(request.index, request.plan, "aborted")
    if request.index % 7 == 0:
        return Outcome(request.index, request.plan, "failed", status=500, error="HTTP 500: boom")
    return Outcome(request.index, request.plan, "completed", status=200, tokens=tokens,
                   token_ids=[[request.index] * tokens], latency_s=0.25)


class _Asyncio:
    """``runner``'s ``asyncio`` with ``sleep`` recorded (and only yielding) and, optionally, ``wait_for``
    recorded; everything else is asyncio's own."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, seconds: float) -> None:
        self.stage.calls.append(("sleep", seconds))
        await REAL_SLEEP(0)


class Stage:
    """Stand-ins for what ``_soak`` calls, each call recorded in ``calls`` in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, memory: Sequence[dict[str, Any]] = (),
                 pids: Sequence[list[int]] = (), unsent: int = 0, health: Sequence[tuple[float, int, float]] = (),
                 clock: Iterator[float] | None = None, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.readings, self.groups = list(memory), list(pids)
        self.unsent, self.health, self.fail = unsent, list(health), fail
        self.stopped: list[bool] = []
        self.stop: asyncio.Event | None = None  # the soak's, once ``watch_health`` got it
        times = clock or itertools.count(1000.0, 0.5)
        monkeypatch.setattr(runner, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(times))}))
        monkeypatch.setattr(runner, "asyncio", _Asyncio(self))
        for name in ("run_phases", "watch_health", "memory", "group_pids"):
            monkeypatch.setattr(runner, name, getattr(self, name))

    async def run_phases(self, base_url: str, phases: Sequence[Phase], deadline: float,
                         timeout_s: float) -> tuple[list[Outcome], int]:
        self.calls.append(("run_phases", base_url, list(phases), deadline, timeout_s))
        for _ in range(1000):  # the mix, with a watched group: until the sampler took its samples (stop is set)
            if len(self.runs()) == 1 or len(self.readings) < 2 or (self.stop is not None and self.stop.is_set()):
                break
            await REAL_SLEEP(0)
        if self.fail is not None and len([c for c in self.calls if c[0] == "run_phases"]) == 3:
            raise self.fail
        outcomes = [_outcome(r, 3 if p.concurrency > 1 else 2) for p in phases for r in p.requests]
        return outcomes, self.unsent

    async def watch_health(self, base_url: str, health: Health, stop: asyncio.Event) -> None:
        self.calls.append(("watch_health", base_url))
        self.stop = stop
        health.samples += self.health
        await stop.wait()
        self.stopped.append(stop.is_set())

    def memory(self, pgid: int) -> dict[str, Any]:
        self.calls.append(("memory", pgid))
        reading = self.readings.pop(0)
        if self.stop is not None and len(self.readings) == 1:
            self.stop.set()  # the sampler took its last sample: the end reading is left
        return reading

    def group_pids(self, pgid: int) -> list[int]:
        self.calls.append(("group_pids", pgid))
        return self.groups.pop(0)

    def runs(self) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == "run_phases"]


def _reading(t: float, rss: float, pss: float = 0.0, anon: float = 0.0, file: float = 0.0,
              processes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"time": t, "rss_mib": rss, "pss_mib": pss, "anon_mib": anon, "file_mib": file, "shmem_mib": 0.0,
            "processes": [{"pid": 1}] if processes is None else processes}


CFG = SoakConfig(requests=40, duration_s=30.0, seed=5, max_concurrency=4, warmup=6, timeout_s=12.0,
                 shares=MixShares(abort=0.2, refuse=0.1), ramp_share=0.5, burst_idle_s=0.75, settle_s=2.5)


def test_the_soak_sends_the_warm_up_the_probe_and_the_mix_in_order_with_their_limits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, clock=iter([500.0, 510.25, 530.33, 540.34]),
                  health=[(0.04, 200, 3.26), (1.06, 503, 7.74), (2.14, 200, 12.34)])
    report = soak_server(INFO, CFG)
    lengths = {"max_prompt_len": 80, "max_total_len": 90}
    warm = make_mix(6, 6, "m", 96, CFG.shares, token_ids=True, **lengths)
    mix = make_mix(5, 40, "m", 96, CFG.shares, token_ids=True, **lengths)
    probes = probe_requests("m", token_ids=True)
    phases = schedule(mix, 4, 0.5, 0.75)
    deadline, url = 530.0, "http://127.0.0.1:9"
    assert [c[0] for c in stage.calls if c[0] != "watch_health"] == ["run_phases", "sleep", "run_phases",
                                                                      "run_phases", "sleep"]
    assert stage.runs() == [("run_phases", url, [Phase(tuple(warm), 4)], deadline, 12.0),
                            ("run_phases", url, [Phase((p,), 1) for p in probes], deadline, 12.0),
                            ("run_phases", url, phases, deadline, 12.0)]
    assert [c for c in stage.calls if c[0] == "sleep"] == [("sleep", 2.5), ("sleep", 2.5)]
    assert [c for c in stage.calls if c[0] == "watch_health"] == [("watch_health", url)] and stage.stopped == [True]
    assert report["server"] == INFO.__dict__
    assert report["config"] == {"requests": 40, "duration_s": 30.0, "seed": 5, "max_concurrency": 4, "warmup": 6,
                                "shares": MixShares(abort=0.2, refuse=0.1).__dict__, "max_prompt_len": 80,
                                "max_total_len": 90}
    assert report["warmup"] == tally([_outcome(r, 3) for r in warm])
    assert report["probe"] == [_outcome(p, 2).as_row(keep_tokens=True) for p in probes]
    assert all(row["token_ids"] for row in report["probe"] if row["outcome"] == "completed")
    outcomes = [_outcome(r, 2 if p.concurrency == 1 else 3) for p in phases for r in p.requests]
    for key, value in tally(outcomes).items():
        assert report[key] == value, key
    assert report["outcomes"] == [o.as_row() for o in outcomes] and "token_ids" not in report["outcomes"][1]
    assert report["phases"] == [{"concurrency": p.concurrency, "burst": p.burst, "requests": len(p.requests)}
                                for p in phases]
    assert (report["unsent"], report["stopped"], report["soak_s"], report["time_s"]) == (0, "requests", 20.1, 40.3)
    health = Health(samples=[(0.04, 200, 3.26), (1.06, 503, 7.74), (2.14, 200, 12.34)])
    assert report["health"] == health.summary()
    assert report["health_samples"] == [[0.0, 200, 3.3], [1.1, 503, 7.7], [2.1, 200, 12.3]]
    assert report["restarts"] == 0
    for key in ("memory_after_warmup", "pids_after_warmup", "memory_end", "memory_samples", "rss_growth_mib",
                "vanished_pids", "new_pids"):
        assert key not in report  # no process group: nothing read
    assert not [c for c in stage.calls if c[0] in ("memory", "group_pids")]


def test_requests_left_unsent_mean_the_duration_stopped_it(monkeypatch: pytest.MonkeyPatch) -> None:
    Stage(monkeypatch, unsent=3)
    report = soak_server(INFO, SoakConfig(requests=10, duration_s=9.0, warmup=0, probe=False, settle_s=0.0))
    assert (report["unsent"], report["stopped"]) == (3, "duration")


def test_without_the_probe_nothing_is_sent_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch)
    report = soak_server(INFO, SoakConfig(requests=10, duration_s=9.0, warmup=2, probe=False, seed=3,
                                          max_concurrency=2))
    assert "probe" not in report and len(stage.runs()) == 2
    assert stage.runs()[0][2] == [Phase(tuple(make_mix(4, 2, "m", 96, MixShares(), token_ids=True,
                                                       max_prompt_len=80, max_total_len=90)), 2)]


def test_a_watched_group_gives_memory_its_growth_and_the_processes_that_came_and_went(
        monkeypatch: pytest.MonkeyPatch) -> None:
    after = _reading(100.0, 1000.04, pss=900.0, anon=600.0, file=400.0)
    samples = [_reading(120.0, 1010.0, pss=905.0, anon=601.0, file=402.0), _reading(160.0, 1060.0)]
    end = _reading(200.0, 1100.16, pss=951.27, anon=655.54, file=444.44)
    stage = Stage(monkeypatch, memory=[after, *samples, end], pids=[[7, 3, 5], [9, 3, 8]])
    report = soak_server(INFO, SoakConfig(requests=10, duration_s=9.0, warmup=1, probe=False, settle_s=0.5,
                                          memory_every_s=0.0), 42)
    names = [c[0] for c in stage.calls]
    assert names[:4] == ["run_phases", "sleep", "memory", "group_pids"]
    assert names[-2:] == ["memory", "group_pids"]
    assert all(c[1] == 42 for c in stage.calls if c[0] in ("memory", "group_pids"))
    assert report["memory_after_warmup"] == after and report["pids_after_warmup"] == [7, 3, 5]
    assert report["memory_samples"] == [{k: s[k] for k in ("time", "rss_mib", "pss_mib", "anon_mib", "file_mib")}
                                        for s in samples]
    assert report["memory_end"] == end
    assert (report["rss_growth_mib"], report["pss_growth_mib"], report["anon_growth_mib"],
            report["file_growth_mib"]) == (100.1, 51.3, 55.5, 44.4)
    assert report["rss_growth_second_half_mib"] == 40.2  # from the sample at the midpoint (160 s)
    assert report["vanished_pids"] == [5, 7] and report["new_pids"] == [8, 9]
    assert report["restarts"] == 2


def test_a_server_gone_by_the_end_has_no_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    after = _reading(100.0, 1000.0, pss=900.0, anon=600.0, file=400.0)
    samples = [_reading(120.0, 1001.0), _reading(140.0, 1002.0)]
    end = _reading(200.0, 0.0, processes=[])
    Stage(monkeypatch, memory=[after, *samples, end], pids=[[4, 6], []])
    report = soak_server(INFO, SoakConfig(requests=10, duration_s=9.0, warmup=0, probe=False, memory_every_s=0.0),
                         11)
    assert len(report["memory_samples"]) == 2
    for part in ("rss", "pss", "anon", "file"):
        assert report[f"{part}_growth_mib"] is None, part
    assert report["rss_growth_second_half_mib"] is None
    assert report["vanished_pids"] == [4, 6] and report["new_pids"] == [] and report["restarts"] == 2


def test_a_failing_soak_still_stops_its_watchers(monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(monkeypatch, fail=SoakError("gone"))
    with pytest.raises(SoakError, match="gone"):
        soak_server(INFO, SoakConfig(requests=10, duration_s=9.0, warmup=0))
    assert stage.stopped == [True]


# -- the memory sampler and the second half's growth --------------------------------------------------------------

def test_the_sampler_reads_until_stopped_waiting_its_interval_between_readings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    readings = [_reading(float(t), 10.0 + t, pss=1.0, anon=2.0, file=3.0) for t in range(3)]
    stop = asyncio.Event()

    def memory(pgid: int) -> dict[str, Any]:
        assert pgid == 13
        if len(readings) == 1:
            stop.set()
        return readings.pop(0)

    async def wait_for(aw: Any, timeout: float) -> None:
        aw.close()  # the stop event's wait, never awaited: the interval passes at once
        waits.append(timeout)
        raise asyncio.TimeoutError

    proxy = type("Asyncio", (), {"wait_for": staticmethod(wait_for), "TimeoutError": asyncio.TimeoutError})
    monkeypatch.setattr(runner, "memory", memory)
    monkeypatch.setattr(runner, "asyncio", proxy)
    samples: list[dict[str, Any]] = []
    asyncio.run(runner._sample_memory(13, samples, stop, 2.5))
    assert samples == [{"time": float(t), "rss_mib": 10.0 + t, "pss_mib": 1.0, "anon_mib": 2.0, "file_mib": 3.0}
                       for t in range(3)]
    assert waits == [2.5, 2.5, 2.5]


def test_the_second_half_grows_from_the_sample_nearest_the_midpoint() -> None:
    """The midpoint of the first sample (10 s) and the end (100 s) is 55 s: the sample at 58 s, not the one at
    66 s (the midpoint from the second sample), 30 s (a third of the way) or the first or last."""
    samples = [{"time": t, "rss_mib": r} for t, r in ((10.0, 1.0), (30.0, 2.0), (58.0, 3.0), (66.0, 4.0),
                                                      (80.0, 5.0))]
    assert runner._second_half_growth(samples, {"time": 100.0, "rss_mib": 100.0}, False) == 97.0


def test_the_second_half_growth_is_rounded_and_needs_two_samples_and_a_live_server() -> None:
    two = [{"time": 0.0, "rss_mib": 1.0}, {"time": 10.0, "rss_mib": 2.04}]
    end = {"time": 20.0, "rss_mib": 5.0}
    assert runner._second_half_growth(two, end, False) == 3.0  # the midpoint 10: 5.0 - 2.04 = 2.96
    assert runner._second_half_growth(two, end, True) is None
    assert runner._second_half_growth(two[:1], end, False) is None
    assert runner._second_half_growth([], end, False) is None


def test_kept_outcomes_are_rows_without_token_ids() -> None:
    out = [Outcome(1, "complete", "completed", tokens=2, token_ids=[[3, 4]]), Outcome(2, "abort", "aborted")]
    assert runner._keep(out) == [o.as_row() for o in out] and all("token_ids" not in r for r in runner._keep(out))

