"""One soak against one running server: warm-up, the exactness probe, the seeded mix under the concurrency
schedule, with the server's health and its process group's memory watched throughout.

``soak_server`` returns the arm's report (a JSON-able dict): requests sent / completed / refused (with the
engine's status) / aborted / failed, health over time, memory after warm-up and at the end, the processes
that vanished (a restart or a crash), and the time taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

from oea.soak.client import Outcome, run_phases, tally
from oea.soak.mix import MixShares, Phase, make_mix, probe_requests, schedule
from oea.soak.monitor import Health, ServerInfo, SoakError, group_pids, memory, watch_health

MAX_REQUESTS = 1_000_000
MAX_DURATION_S = 24 * 3600.0


@dataclass(frozen=True)
class SoakConfig:
    """What one arm sends and how long it may take; every limit is finite (the soak stops by itself).

    ``requests``: requests of the mix (after ``warmup`` more, not counted); ``duration_s``: no request is
    launched after this many seconds; ``timeout_s``: one request's limit; ``probe``: send the exactness probe
    (seeded sampling, one request at a time) after the warm-up; ``settle_s``: idle time before the memory
    readings (the engine's writers flush every 0.5 s and checkpoint once idle).
    """

    requests: int
    duration_s: float
    seed: int = 0
    max_concurrency: int = 32
    warmup: int = 64
    timeout_s: float = 300.0
    probe: bool = True
    shares: MixShares = field(default_factory=MixShares)
    ramp_share: float = 0.3
    burst_idle_s: float = 1.5
    settle_s: float = 3.0
    memory_every_s: float = 5.0

    def __post_init__(self) -> None:
        _bounded("--requests", self.requests, 1, MAX_REQUESTS, integer=True)
        _bounded("--duration", self.duration_s, 1e-3, MAX_DURATION_S)
        _bounded("--timeout", self.timeout_s, 1e-3, MAX_DURATION_S)
        _bounded("--max-concurrency", self.max_concurrency, 1, 1024, integer=True)
        _bounded("--warmup", self.warmup, 0, MAX_REQUESTS, integer=True)
        if not 0.0 <= self.ramp_share <= 1.0:
            raise SoakError(f"--ramp-share must be in [0, 1], got {self.ramp_share}")


def _bounded(flag: str, value: float, low: float, high: float, integer: bool = False) -> None:
    kind = "an integer" if integer else "a finite number"
    bad = not isinstance(value, (int, float)) or isinstance(value, bool) or (integer and value != int(value))
    if bad or not math.isfinite(value) or not low <= value <= high:
        raise SoakError(f"{flag} must be {kind} in {low:g}..{high:g} (the soak is bounded in requests and time "
                        f"and stops by itself), got {value!r}")


def _keep(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [o.as_row() for o in outcomes]


async def _sample_memory(pgid: int, samples: list[dict[str, Any]], stop: asyncio.Event, every_s: float) -> None:
    while not stop.is_set():
        reading = memory(pgid)
        samples.append({key: reading[key] for key in ("time", "rss_mib", "pss_mib", "anon_mib", "file_mib")})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def _soak(info: ServerInfo, cfg: SoakConfig, pgid: int | None, started: float) -> dict[str, Any]:
    deadline = started + cfg.duration_s
    report: dict[str, Any] = {"server": info.__dict__, "config": {
        "requests": cfg.requests, "duration_s": cfg.duration_s, "seed": cfg.seed,
        "max_concurrency": cfg.max_concurrency, "warmup": cfg.warmup, "shares": cfg.shares.__dict__,
        "max_prompt_len": info.prompt_limit, "max_total_len": info.total_limit}}
    # Every request asks for its output token ids: both engines ``identify`` accepts (monitor.ENGINES) return
    # them (return_token_ids), so that the probe compares outputs exactly and the judge counts tokens.
    lengths = {"max_prompt_len": info.prompt_limit, "max_total_len": info.total_limit}
    warm = make_mix(cfg.seed + 1, cfg.warmup, info.model, info.max_model_len, cfg.shares, token_ids=True, **lengths)
    warm_out, _ = await run_phases(info.base_url, [Phase(tuple(warm), cfg.max_concurrency)], deadline, cfg.timeout_s)
    report["warmup"] = tally(warm_out)
    await asyncio.sleep(cfg.settle_s)
    if pgid is not None:
        report["memory_after_warmup"] = memory(pgid)
        report["pids_after_warmup"] = group_pids(pgid)
    if cfg.probe:
        probes = [Phase((p,), 1) for p in probe_requests(info.model, token_ids=True)]
        probe_out, _ = await run_phases(info.base_url, probes, deadline, cfg.timeout_s)
        report["probe"] = [o.as_row(keep_tokens=True) for o in probe_out]
    requests = make_mix(cfg.seed, cfg.requests, info.model, info.max_model_len, cfg.shares, token_ids=True, **lengths)
    phases = schedule(requests, cfg.max_concurrency, cfg.ramp_share, cfg.burst_idle_s)
    health, stop, samples = Health(), asyncio.Event(), []
    watchers = [asyncio.create_task(watch_health(info.base_url, health, stop))]
    if pgid is not None:
        watchers.append(asyncio.create_task(_sample_memory(pgid, samples, stop, cfg.memory_every_s)))
    began = time.monotonic()
    try:
        outcomes, unsent = await run_phases(info.base_url, phases, deadline, cfg.timeout_s)
        soak_s = time.monotonic() - began
        await asyncio.sleep(cfg.settle_s)
    finally:
        stop.set()
        await asyncio.gather(*watchers)
    report.update(tally(outcomes))
    report.update(unsent=unsent, stopped="duration" if unsent else "requests", soak_s=round(soak_s, 1),
                  phases=[{"concurrency": p.concurrency, "burst": p.burst, "requests": len(p.requests)}
                          for p in phases],
                  health=health.summary(), health_samples=[[round(t, 1), s, round(ms, 1)]
                                                           for t, s, ms in health.samples],
                  outcomes=_keep(outcomes))
    if pgid is not None:
        end = memory(pgid)
        before = report["memory_after_warmup"]
        alive = set(group_pids(pgid))
        gone = not end["processes"]  # the server exited (a fault, a crash): no end reading
        report.update(memory_end=end, memory_samples=samples,
                      rss_growth_mib=None if gone else round(end["rss_mib"] - before["rss_mib"], 1),
                      **{f"{part}_growth_mib": None if gone else round(end[f"{part}_mib"] - before[f"{part}_mib"], 1)
                         for part in ("pss", "anon", "file")},
                      rss_growth_second_half_mib=_second_half_growth(samples, end, gone),
                      vanished_pids=sorted(set(report["pids_after_warmup"]) - alive),
                      new_pids=sorted(alive - set(report["pids_after_warmup"])))
    return report


def _second_half_growth(samples: list[dict[str, Any]], end: dict[str, Any], gone: bool) -> float | None:
    """RSS growth (MiB) from the sample nearest the soak's midpoint to the end: a leak keeps growing there,
    the allocator's warm-up does not."""
    if gone or len(samples) < 2:
        return None
    middle = (samples[0]["time"] + end["time"]) / 2
    nearest = min(samples, key=lambda s: abs(s["time"] - middle))
    return round(end["rss_mib"] - nearest["rss_mib"], 1)


def soak_server(info: ServerInfo, cfg: SoakConfig, pgid: int | None = None) -> dict[str, Any]:
    """Soak one running server (``identify`` gave ``info``); ``pgid``: its process group, for memory and
    restarts (None: not watched). Blocks until the mix is sent or ``cfg.duration_s`` passed."""
    started = time.monotonic()
    report = asyncio.run(_soak(info, cfg, pgid, started))
    report["time_s"] = round(time.monotonic() - started, 1)
    report["restarts"] = len(report.get("vanished_pids", []))
    return report
