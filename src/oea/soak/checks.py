"""What must hold after a soak, checked on the arms' reports and on the engine's own metrics file and trace.

Each check returns a ``Check`` (name, held or not, what was seen). ``arm_checks`` are the ones of one arm
(no failed request, no restart, the client aborts' share, memory growth within the bound); ``across_arms``
compares arms with the baseline (the same refusals with the same status and message; the exactness probe's
outputs identical where OEA keeps every token's top-k); ``metrics_checks`` reads ``OEA_METRICS_FILE`` (every
step's fields consistent: rows, layers, active experts within [k0, min(N, k x rows)] and never above the
stock routing of the same logits); ``trace_checks`` reads ``OEA_TRACE_FILE`` (it validates, holds exactly
the decode steps the metrics counted with their real rows, no step dropped, the writer's queue within its
bound, and ``oea simulate --mode lockstep`` replays the metrics' active experts).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oea.soak.monitor import MAX_SILENCE_S

# RSS growth allowed from after the warm-up to the end of a soak (docs/reliability.md says why).
MEMORY_BOUND_MIB = 64.0
MEMORY_BOUND_SHARE = 0.02
MIN_ABORTED_SHARE = 0.2
REPLAY_TOLERANCE = 0.01


@dataclass(frozen=True)
class Check:
    """One promise: ``name``, whether it held, what was seen (``detail``); ``verdict`` False: reported only, not
    part of the soak's verdict (the absolute memory bound when the growth is judged against OEA off's)."""

    name: str
    held: bool
    detail: str
    verdict: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "held": self.held, "detail": self.detail, "verdict": self.verdict}


def off_arm(arms: Sequence[tuple[str, Mapping[str, str]]], baseline: str) -> str | None:
    """The arm OEA's memory growth is judged against: ``baseline`` when it runs with OEA off (no ``OEA_K0`` nor
    its alias), else the first such arm of ``arms`` ((name, environment) pairs, memory watched); None when no
    arm runs with OEA off, or none with it on (nothing to judge against OEA off: the absolute bound holds)."""
    off = [name for name, env in arms if not env.get("OEA_K0") and not env.get("SGLANG_OEA_K0")]
    if not off or len(off) == len(arms):
        return None
    return baseline if baseline in off else off[0]


def memory_bound_mib(rss_after_warmup_mib: float) -> float:
    """The RSS growth a soak may show: ``MEMORY_BOUND_MIB`` plus ``MEMORY_BOUND_SHARE`` of the warm RSS."""
    return MEMORY_BOUND_MIB + MEMORY_BOUND_SHARE * rss_after_warmup_mib


def arm_checks(name: str, report: Mapping[str, Any], min_aborted_share: float = MIN_ABORTED_SHARE,
               memory_verdict: bool = True) -> list[Check]:
    """No failed request (warm-up included), no restart and no unhealthy answer, enough client aborts, and
    (when the process group was watched) memory growth within ``memory_bound_mib``: the verdict unless
    ``memory_verdict`` is False (an OEA-off arm ran: ``across_arms`` judges the growth against its growth, and
    the absolute growth is reported)."""
    failed = int(report["failed"]) + int(report["warmup"]["failed"])
    seen = (f"{failed} failed: {report['failures'][:3] or report['warmup']['failures'][:3]}" if failed else
            f"0 failed of {report['sent']} (+{report['warmup']['sent']} warm-up)")
    checks = [Check(f"{name}: 0 failed requests", failed == 0, seen)]
    health = report["health"]
    restarts = int(report.get("restarts", 0))
    silence = float(health.get("longest_silence_s", 0.0))
    first = (f" (the first at {health['first_unhealthy_s']} s: status {health.get('first_unhealthy_status')})"
             if health["unhealthy"] else "")
    checks.append(Check(f"{name}: 0 restarts, healthy throughout",
                        restarts == 0 and health["unhealthy"] == 0 and silence <= MAX_SILENCE_S,
                        f"{restarts} processes of the server vanished, {health['unhealthy']} of {health['samples']} "
                        f"health answers not 200 or unreachable{first}; {health.get('no_answer', 0)} timed out, "
                        f"longest without an answer {silence:.0f} s (bound {MAX_SILENCE_S:.0f} s)"))
    sent = max(1, int(report["sent"]))
    share = int(report["aborted"]) / sent
    checks.append(Check(f"{name}: >= {min_aborted_share:.0%} aborted by the client", share >= min_aborted_share,
                        f"{report['aborted']} of {report['sent']} ({share:.1%})"))
    if "memory_after_warmup" in report:
        warm = float(report["memory_after_warmup"]["rss_mib"])
        bound = memory_bound_mib(warm)
        growth = report["rss_growth_mib"]
        reported = "" if memory_verdict else "; reported, the verdict is the growth against OEA off's"
        if growth is None:
            checks.append(Check(f"{name}: RSS growth after warm-up within {bound:.0f} MiB", False,
                                "the server's processes were gone at the end" + reported, memory_verdict))
        else:
            checks.append(Check(f"{name}: RSS growth after warm-up within {bound:.0f} MiB", growth <= bound,
                                f"{warm:.0f} -> {report['memory_end']['rss_mib']:.0f} MiB ({growth:+.1f} MiB, "
                                f"{_signed(report.get('rss_growth_second_half_mib'))} in the second half; PSS "
                                f"{report['pss_growth_mib']:+.1f} MiB{_where(report)}){reported}", memory_verdict))
    return checks


def _where(report: Mapping[str, Any]) -> str:
    """Where the growth is: anonymous (heap) or file-backed, and the process that grew most (by pid)."""
    parts = "".join(f", {part} {report[f'{part}_growth_mib']:+.1f}" for part in ("anon", "file")
                    if report.get(f"{part}_growth_mib") is not None)
    before = {p["pid"]: p for p in report["memory_after_warmup"].get("processes", [])}
    grown = [(p["rss_mib"] - before[p["pid"]]["rss_mib"], p["name"]) for p in report["memory_end"].get("processes", [])
             if p["pid"] in before]
    if not grown:
        return parts
    most, process = max(grown)
    return f"{parts}; most in {process} {most:+.1f} MiB"


def _signed(value: float | None) -> str:
    return "?" if value is None else f"{value:+.1f} MiB"


def _refusals(report: Mapping[str, Any]) -> dict[int, tuple[int | None, str]]:
    return {o["index"]: (o["status"], o["error"]) for o in report["outcomes"] if o["plan"] == "refuse"}


def across_arms(baseline: str, reports: Mapping[str, Mapping[str, Any]], identical_outputs: Sequence[str] = (),
                off: str | None = None) -> list[Check]:
    """Every arm refuses the baseline's requests with the same status and message (the engine's own refusals,
    untouched by OEA); with ``off`` (an arm with OEA off, ``off_arm``) each other arm's RSS growth is within
    ``off``'s + the bound; the arms in ``identical_outputs`` give the baseline's exact probe outputs."""
    base = reports[baseline]
    checks = []
    expected = _refusals(base)
    for name, report in reports.items():
        got = _refusals(report)
        common = sorted(set(expected) & set(got))
        differ = [i for i in common if got[i] != expected[i]]
        wrong = [i for i, (status, _) in got.items() if status is None or not 400 <= status < 500]
        held = not differ and not wrong and bool(common)
        detail = (f"{len(common)} refusals compared with {baseline}'s: statuses "
                  f"{sorted({s for s, _ in got.values() if s is not None})}")
        if differ:
            i = differ[0]
            detail = f"request {i}: {got[i]} vs {baseline}'s {expected[i]} ({len(differ)} differ)"
        elif wrong:
            detail = f"request {wrong[0]} was not refused by the engine: {got[wrong[0]]}"
        checks.append(Check(f"{name}: refusals are the engine's own, as {baseline}'s", held, detail))
    checks += _growth_against(off, reports) if off is not None else []
    for name in identical_outputs:
        mine, theirs = reports[name].get("probe") or [], base.get("probe") or []
        ids = [p.get("token_ids") for p in mine]
        held = bool(mine) and len(mine) == len(theirs) and None not in ids and ids == [p.get("token_ids")
                                                                                    for p in theirs]
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
                      if a.get("token_ids") != b.get("token_ids")), None)
        detail = (f"{len(mine)} seeded sampling requests (n = 4), every token id equal" if held else
                  f"probe {first} differs" if first is not None else
                  f"{len(mine)} probes vs {len(theirs)}, token ids {'missing' if None in ids else 'present'}")
        checks.append(Check(f"{name}: seeded sampling gives {baseline}'s exact outputs", held, detail))
    return checks


def _growth_against(baseline: str, reports: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """Each other arm's RSS growth after warm-up exceeds ``baseline``'s (the engine's own, OEA off) by at most
    ``memory_bound_mib`` of its warm RSS: what OEA adds, apart from the engine's growth over the same mix. An
    off arm whose processes were gone at the end fails each comparison (there is nothing to compare with)."""
    base = reports[baseline].get("rss_growth_mib")
    checks = []
    for name, report in reports.items():
        growth = report.get("rss_growth_mib")
        if name == baseline or "memory_after_warmup" not in report:
            continue
        bound = memory_bound_mib(float(report["memory_after_warmup"]["rss_mib"]))
        held = growth is not None and base is not None and growth - base <= bound
        more = None if growth is None or base is None else growth - base
        detail = f"{_signed(growth)} vs {baseline}'s {_signed(base)} ({_signed(more)} more, bound {bound:.0f} MiB)"
        checks.append(Check(f"{name}: RSS growth within {baseline}'s + {bound:.0f} MiB", held, detail))
    return checks


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of an ``OEA_METRICS_FILE`` ([] when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics_checks(name: str, rows: Sequence[Mapping[str, Any]], k0: int | None, top_k: int, num_experts: int
                   ) -> list[Check]:
    """Every metrics row is consistent: step numbers increase per process, ``layers`` equals each list's
    length, ``rows`` >= 1 and ``padding_rows`` >= 0, each layer's active experts lie in
    [k0 (rewritten) or top_k (stock), min(N, k x rows)], a rewritten step never loads more experts than
    stock routing of the same logits and a stock step exactly as many."""
    problems: list[str] = []
    last: dict[Any, int] = {}
    decode = sum(bool(r["decode"]) for r in rows)
    for r in rows:
        key = (r.get("pid"), r.get("rank", 0))
        if r["step"] <= last.get(key, -1):
            problems.append(f"step {r['step']} after step {last[key]} (pid {key[0]})" if key in last
                            else f"step {r['step']} below 0 (pid {key[0]})")
        last[key] = r["step"]
        layers = int(r["layers"])
        lists = {f: r[f] for f in ("active", "active_stock", "routing_us") if f in r}
        if any(len(v) != layers for v in lists.values()) or layers < 1:
            problems.append(f"step {r['step']}: layers {layers}, lists {[len(v) for v in lists.values()]}")
        if r["rows"] < 1 or r.get("padding_rows", 0) < 0:
            problems.append(f"step {r['step']}: rows {r['rows']}, padding rows {r.get('padding_rows')}")
        low = k0 if r["oea"] and k0 is not None else top_k
        high = min(num_experts, top_k * int(r["rows"]))
        for layer, active in enumerate(r["active"]):
            if not low <= active <= high:
                problems.append(f"step {r['step']} layer {layer}: {active} active experts outside [{low}, {high}] "
                                f"({r['rows']} rows)")
            stock = r["active_stock"][layer] if layer < len(r.get("active_stock", ())) else None
            if stock is not None and (active > stock or (not r["oea"] and active != stock)):
                problems.append(f"step {r['step']} layer {layer}: {active} active, stock routing {stock} "
                                f"({'rewritten' if r['oea'] else 'not rewritten'})")
    held = bool(rows) and decode > 0 and not problems
    detail = (f"{len(rows)} steps ({decode} decode, {sum(bool(r['oea']) for r in rows)} rewritten)"
              + (f"; {len(problems)} problems, first: {problems[0]}" if problems else ""))
    return [Check(f"{name}: metrics rows consistent", held, detail)]


def trace_checks(name: str, trace_path: str | Path, rows: Sequence[Mapping[str, Any]], k0: int | None
                 ) -> list[Check]:
    """The trace validates (``oea.traces.load_trace``), records exactly the metrics' decode steps with their
    real rows, dropped none, kept its writer queue within the bound, and ``oea simulate --mode lockstep``
    gives the metrics' active experts (stock and, with ``k0``, OEA's) over the widest steps recorded at least
    twice."""
    from oea.traces import load_trace

    try:
        trace = load_trace(str(trace_path))
    except (ValueError, FileNotFoundError) as err:
        return [Check(f"{name}: trace validates", False, str(err)[:300])]
    meta = trace.meta
    checks = [Check(f"{name}: trace validates", True,
                    f"{trace.num_tokens} tokens, {meta.get('steps_recorded')} steps; stopped: {meta.get('stopped')}")]
    decode = {int(r["step"]): r for r in rows if r["decode"]}
    assert trace.step_ids is not None
    recorded: dict[int, int] = {}
    for step in trace.step_ids.tolist():
        recorded[step] = recorded.get(step, 0) + 1
    missing, extra = sorted(set(decode) - set(recorded)), sorted(set(recorded) - set(decode))
    rows_differ = [s for s in recorded if s in decode and recorded[s] != decode[s]["rows"]]
    checks.append(Check(f"{name}: trace holds exactly the decode steps the metrics counted",
                        not missing and not extra and not rows_differ and meta.get("steps_dropped") == 0,
                        f"{len(recorded)} recorded, {len(decode)} counted; missing {missing[:5]}, extra {extra[:5]}, "
                        f"rows differ {rows_differ[:5]}, dropped {meta.get('steps_dropped')}"))
    peak, bound = meta.get("queue_peak_steps"), meta.get("queue_bound_steps")
    checks.append(Check(f"{name}: recorder staging bounded", isinstance(peak, int) and isinstance(bound, int)
                        and peak <= bound, f"writer queue peak {peak} of {bound} steps"))
    checks.append(_replay(name, trace, decode, k0))
    return checks


def _steps_of_width(trace: Any, width: int) -> Any:
    """``trace`` with only the tokens of the steps that decoded exactly ``width`` rows: lockstep batches of
    ``width`` rows are then those steps, never ``width`` rows drawn from a wider step."""
    import torch

    from oea.traces import Trace

    steps, counts = torch.unique(trace.step_ids, return_counts=True)
    keep = torch.isin(trace.step_ids, steps[counts == width])  # [T] bool
    per_token = ("logits", "ids", "scores", "request_ids", "positions", "step_ids")
    return Trace(spec=trace.spec, correction_bias=trace.correction_bias, meta=dict(trace.meta),
                 **{name: None if getattr(trace, name) is None else getattr(trace, name)[keep] for name in per_token})


def _replay(name: str, trace: Any, decode: Mapping[int, Mapping[str, Any]], k0: int | None) -> Check:
    """``oea simulate --mode lockstep`` at the widest step size recorded at least twice, each of those steps
    replayed once, against their metrics. A lockstep batch of a step's whole width is that step, and an interval
    needs two batches: a width the engine batched once (how many requests met in one step depends on the machine's
    timing) cannot be replayed, so the check steps down to the widest width it can."""
    from oea.sim.simulate import simulate

    check_name = f"{name}: oea simulate --mode lockstep replays the trace"
    sizes: dict[int, int] = {}
    for step in trace.step_ids.tolist():
        sizes[step] = sizes.get(step, 0) + 1
    steps_of_width = Counter(sizes.values())
    replayable = [width for width, count in steps_of_width.items() if count >= 2]
    if not replayable:
        return Check(check_name, False, f"no step width was recorded twice (an interval needs two lockstep batches); "
                                   f"steps per width: {dict(sorted(steps_of_width.items()))}")
    widest = max(replayable)
    steps = [decode[s] for s, n in sizes.items() if n == widest and s in decode]
    policies = ("vanilla", "oea") if k0 is not None else ("vanilla",)
    try:
        rows = simulate(_steps_of_width(trace, widest), policies=policies, k0s=(k0 or 1,), batch_sizes=(widest,),
                        mode="lockstep", num_batches=steps_of_width[widest])  # each step of the width once
    except ValueError as err:
        return Check(check_name, False, str(err)[:300])
    want = {"vanilla": _mean(steps, "active_stock" if k0 is not None else "active"), "oea": _mean(steps, "active")}
    # metrics of no active expert (a malformed file) are a gap, not a ZeroDivisionError that stops the soak
    gaps = {r["policy"]: r["mean_active_experts"] / want[r["policy"]] - 1 if want[r["policy"]] else math.inf
            for r in rows}
    held = bool(steps) and all(abs(g) <= REPLAY_TOLERANCE for g in gaps.values())
    detail = f"B = {widest} ({len(steps)} steps): " + ", ".join(
        f"{p} T {r['mean_active_experts']:.2f} vs the engine's {want[p]:.2f} ({gaps[p]:+.2%})"
        for p, r in ((r["policy"], r) for r in rows))
    return Check(check_name, held, detail)


def _mean(steps: Sequence[Mapping[str, Any]], field: str) -> float:
    values = [a for s in steps for a in s.get(field, [])]
    return sum(values) / len(values) if values else math.nan
