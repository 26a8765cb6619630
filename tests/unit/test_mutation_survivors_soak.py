"""``oea soak``'s checks (``oea.soak.checks``) at the edges the generated mutants of ``make mutation`` found
unguarded (docs/testing.md, "Generated mutants"). The metrics check: which rows count as one process's steps, the
bounds' edges (exactly k x rows, exactly stock routing, one layer, one row), a run without decode steps. One arm:
the warm-up's failures, the health bound's edge, the aborted share of what was sent, the memory verdict and
where the growth is. Across arms: the engine's own refusals, the exactness probe, growth against OEA off's. The
trace checks on real trace files through the real simulator: the rows of each step, the writer queue's bound,
the replay of every step of its width with the arm's k0 and each layer's selection bias, metrics it cannot
compare with. And the words each problem is reported with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from oea import OEAConfig, route
from oea.routing import RouterSpec
from oea.soak.checks import (
    Check,
    across_arms,
    arm_checks,
    memory_bound_mib,
    metrics_checks,
    read_metrics,
    trace_checks,
)
from oea.soak.monitor import MAX_SILENCE_S
from oea.traces import Trace, load_trace
from oea.traces.format import save_trace

GOOD = {"pid": 1, "step": 1, "decode": True, "oea": True, "rows": 2, "layers": 2, "active": [3, 5],
        "active_stock": [9, 10]}


def check(*rows: dict[str, Any], k0: int | None = 3) -> tuple[bool, str]:
    (only,) = metrics_checks("a", rows, k0=k0, top_k=8, num_experts=64)
    assert only.name == "a: metrics rows consistent"
    return only.held, only.detail


def test_steps_are_numbered_per_process_and_rank() -> None:
    assert check(GOOD, {**GOOD, "pid": 2})[0], "two processes each at step 1"
    assert check({**GOOD, "rank": 0}, {**GOOD, "rank": 1})[0], "two ranks of one process each at step 1"
    assert check({**GOOD, "step": 0}, {**GOOD, "step": 1})[0]
    held, detail = check({**GOOD, "step": -1})
    assert not held and detail.endswith("first: step -1 below 0 (pid 1)")
    held, detail = check(GOOD, {**GOOD, "rank": 0})  # no rank is rank 0: the same step twice
    assert not held
    assert detail == "2 steps (2 decode, 2 rewritten); 1 problems, first: step 1 after step 1 (pid 1)"


def test_the_smallest_valid_rows_hold() -> None:
    assert check({**GOOD, "layers": 1, "active": [3], "active_stock": [9]})[0]
    assert check({**GOOD, "rows": 1, "active": [3, 5], "active_stock": [8, 8], "padding_rows": 0})[0]
    held, detail = check(GOOD)
    assert held and detail == "1 steps (1 decode, 1 rewritten)"


def test_each_list_must_have_one_entry_per_layer() -> None:
    for field, value in (("active", [3]), ("active_stock", [9]), ("routing_us", [1.0])):
        held, detail = check({**GOOD, field: value})
        assert not held, field
        lengths = [len(v) for f, v in {**GOOD, field: value}.items() if f in ("active", "active_stock", "routing_us")]
        assert detail.endswith(f"first: step 1: layers 2, lists {lengths}"), detail


def test_negative_padding_rows_are_a_problem_named_with_the_rows() -> None:
    held, detail = check({**GOOD, "padding_rows": -1})
    assert not held and detail.endswith("first: step 1: rows 2, padding rows -1")
    assert not check({**GOOD, "rows": 0, "padding_rows": 1})[0]


def test_the_bounds_edges() -> None:
    assert check({**GOOD, "active": [3, 16], "active_stock": [9, 16]})[0], "exactly k x rows"
    assert check({**GOOD, "active": [9, 10]})[0], "a rewritten step exactly at stock routing"
    held, detail = check({**GOOD, "active": [2, 5]})
    assert not held and detail.endswith("first: step 1 layer 0: 2 active experts outside [3, 16] (2 rows)")
    held, detail = check({**GOOD, "active": [3, 11]})
    assert not held and detail.endswith("first: step 1 layer 1: 11 active, stock routing 10 (rewritten)")
    stock_step = {**GOOD, "oea": False, "active": [9, 9], "active_stock": [9, 10]}
    held, detail = check(stock_step)
    assert not held and detail.endswith("first: step 1 layer 1: 9 active, stock routing 10 (not rewritten)")


def test_a_stock_step_is_bounded_below_by_top_k_even_with_k0_set() -> None:
    assert not check({**GOOD, "oea": False, "active": [5, 5], "active_stock": [5, 5]}, k0=3)[0]
    assert not check({**GOOD, "active": [5, 5], "active_stock": [9, 10]}, k0=None)[0], "no k0: top_k bounds"


def test_a_run_without_decode_steps_does_not_hold() -> None:
    held, detail = check({**GOOD, "decode": False, "oea": False, "active": [9, 10]})
    assert not held and detail == "1 steps (0 decode, 0 rewritten)"
    assert not check()[0]


def test_a_trace_that_does_not_load_is_one_failed_check_naming_it(tmp_path) -> None:
    missing = tmp_path / "none.safetensors"
    checks = trace_checks("oea", missing, [GOOD], k0=3)
    assert len(checks) == 1
    assert checks[0].name == "oea: trace validates" and checks[0].held is False
    assert str(missing) in checks[0].detail or "none.safetensors" in checks[0].detail


# -- what a check says in soak.json ---------------------------------------------------------------------------------

def test_a_check_is_written_with_its_name_verdict_and_what_was_seen() -> None:
    check = Check("a: x", False, "seen", verdict=False)
    assert check.as_dict() == {"name": "a: x", "held": False, "detail": "seen", "verdict": False}


# -- across arms: the engine's own refusals, the exactness probe, memory against OEA off ---------------------------

def _refusing(*refusals: tuple[int, int | None, str], probe: list[Any] | None = None,
              **more: Any) -> dict[str, Any]:
    """An arm's report whose planned refusals got ``(index, status, message)``; one completed request beside."""
    outcomes = [{"index": i, "plan": "refuse", "status": s, "error": e, "outcome": "refused"} for i, s, e in refusals]
    outcomes.append({"index": 99, "plan": "complete", "status": 500, "error": "", "outcome": "failed"})
    return {"outcomes": outcomes, "probe": probe, **more}


def _refusal_check(reports: dict[str, dict[str, Any]], arm: str = "oea") -> Any:
    return next(c for c in across_arms("off", reports) if c.name == f"{arm}: refusals are the engine's own, as off's")


def test_the_refusal_check_names_the_statuses_compared() -> None:
    off = _refusing((3, 400, "too long"), (5, 422, "bad"))
    check = _refusal_check({"off": off, "oea": _refusing((3, 400, "too long"), (5, 422, "bad"))})
    assert check.held and check.detail == "2 refusals compared with off's: statuses [400, 422]"
    assert _refusal_check({"off": off, "oea": off}, arm="off").held


def test_a_refusal_that_differs_is_named_with_both_answers() -> None:
    off = _refusing((3, 400, "too long"), (5, 422, "bad"))
    check = _refusal_check({"off": off, "oea": _refusing((3, 400, "other"), (5, 400, "bad"))})
    assert not check.held
    assert check.detail == "request 3: (400, 'other') vs off's (400, 'too long') (2 differ)"


@pytest.mark.parametrize(("status", "held"), [(399, False), (400, True), (499, True), (500, False), (None, False)])
def test_a_refusal_the_engine_did_not_give_is_named(status: int | None, held: bool) -> None:
    off = _refusing((3, 400, "too long"))
    check = _refusal_check({"off": off, "oea": _refusing((3, 400, "too long"), (7, status, "boom"))})
    assert check.held is held, check.detail
    if held:
        assert check.detail == f"1 refusals compared with off's: statuses {sorted({400, status})}"
    else:
        assert check.detail == f"request 7 was not refused by the engine: ({status}, 'boom')"


def test_no_refusal_in_common_is_no_evidence() -> None:
    check = _refusal_check({"off": _refusing((3, 400, "too long")), "oea": _refusing((4, 400, "too long"))})
    assert not check.held and check.detail == "0 refusals compared with off's: statuses [400]"


def _probe(*ids: list[int] | None) -> list[dict[str, Any]]:
    return [{"token_ids": i} for i in ids]


def _exact(mine: list[Any] | None, theirs: list[Any] | None) -> Any:
    reports = {"off": _refusing((3, 400, "x"), probe=theirs), "oea": _refusing((3, 400, "x"), probe=mine)}
    checks = across_arms("off", reports, identical_outputs=["oea"])
    (check,) = [c for c in checks if "seeded sampling" in c.name]
    assert check.name == "oea: seeded sampling gives off's exact outputs"
    return check


def test_the_exactness_probe_holds_only_on_equal_token_ids() -> None:
    check = _exact(_probe([1, 2], [3]), _probe([1, 2], [3]))
    assert check.held and check.detail == "2 seeded sampling requests (n = 4), every token id equal"
    differ = _exact(_probe([1, 2], [3], [4]), _probe([1, 2], [5], [6]))
    assert not differ.held and differ.detail == "probe 1 differs"


def test_the_exactness_probe_fails_without_probes_or_token_ids() -> None:
    empty = _exact([], [])
    assert not empty.held and empty.detail == "0 probes vs 0, token ids present"
    assert not _exact(None, None).held
    missing = _exact(_probe(None, None), _probe(None, None))
    assert not missing.held and missing.detail == "2 probes vs 2, token ids missing"
    shorter = _exact(_probe([1, 2]), _probe([1, 2], [3]))
    assert not shorter.held and shorter.detail == "1 probes vs 2, token ids present"
    longer = _exact(_probe([1, 2], [3]), _probe([1, 2]))
    assert not longer.held and longer.detail == "2 probes vs 1, token ids present"


def _warm(growth: float | None) -> dict[str, Any]:
    return _refusing((3, 400, "x"), memory_after_warmup={"rss_mib": 1000.0}, rss_growth_mib=growth)


def test_the_growth_against_off_says_both_growths_and_the_difference() -> None:
    bound = memory_bound_mib(1000.0)  # 84 MiB
    reports = {"off": _warm(200.0), "oea": _warm(250.5), "plain": _refusing((3, 400, "x"))}
    (check,) = [c for c in across_arms("off", reports, off="off") if "RSS growth" in c.name]
    assert check.name == f"oea: RSS growth within off's + {bound:.0f} MiB" and check.held
    assert check.detail == f"+250.5 MiB vs off's +200.0 MiB (+50.5 MiB more, bound {bound:.0f} MiB)"
    less = next(c for c in across_arms("off", {"off": _warm(200.0), "oea": _warm(150.0)}, off="off")
                if "RSS growth" in c.name)
    assert less.held and "(-50.0 MiB more," in less.detail
    gone = next(c for c in across_arms("off", {"off": _warm(None), "oea": _warm(250.5)}, off="off")
                if "RSS growth" in c.name)
    assert not gone.held and gone.detail == f"+250.5 MiB vs off's ? (? more, bound {bound:.0f} MiB)"
    mine = next(c for c in across_arms("off", {"off": _warm(200.0), "oea": _warm(None)}, off="off")
                if "RSS growth" in c.name)
    assert not mine.held and mine.detail == f"? vs off's +200.0 MiB (? more, bound {bound:.0f} MiB)"


# -- the trace checks on a recorded trace file and the engine's metrics of the same steps ----------------------------

SPEC = RouterSpec(16, 4)


def _save(tmp_path: Path, steps: list[int], logits: torch.Tensor | None = None, spec: RouterSpec = SPEC,
          bias: torch.Tensor | None = None, file: str = "t", **meta: Any) -> Path:
    """A trace file as the recorder writes it: one token per entry of ``steps`` (a step's width is how often it
    appears), 2 MoE layers of seeded random logits unless given; ``meta`` replaces the sidecar's fields."""
    if logits is None:
        logits = torch.randn(len(steps), 2, spec.num_experts, generator=torch.Generator().manual_seed(0))
    sidecar = {"steps_recorded": len(set(steps)), "stopped": None, "steps_dropped": 0, "queue_peak_steps": 2,
               "queue_bound_steps": 8, **meta}
    trace = Trace(spec=spec, logits=logits, step_ids=torch.tensor(steps), correction_bias=bias, meta=sidecar)
    return save_trace(trace, tmp_path / f"{file}.safetensors")


def _engine_rows(path: Path, k0: int | None) -> list[dict[str, Any]]:
    """The decode rows an engine's metrics file gives for the trace's steps: its rows, and per layer the experts
    stock routing (``active_stock``) and the arm's routing (``active``: OEA at ``k0``, else stock) load."""
    trace = load_trace(path)
    assert trace.logits is not None and trace.step_ids is not None
    rows = []
    for step in sorted(set(trace.step_ids.tolist())):
        tokens = trace.step_ids == step
        stock, active = [], []
        for layer in range(trace.num_layers):
            logits, spec = trace.logits[tokens, layer], trace.layer_spec(layer)
            stock.append(route(logits, spec)[0].unique().numel())
            ids, weights = route(logits, spec, OEAConfig(k0) if k0 is not None else None)
            active.append(ids[weights > 0].unique().numel())
        rows.append({"pid": 1, "step": step, "decode": True, "oea": k0 is not None, "rows": int(tokens.sum()),
                     "layers": trace.num_layers, "active": active, "active_stock": stock})
    return rows


def _checks(path: Path, rows: list[dict[str, Any]], k0: int | None, name: str = "a") -> dict[str, Any]:
    checks = trace_checks(name, path, rows, k0)
    assert [c.name for c in checks] == [f"{name}: trace validates",
                                        f"{name}: trace holds exactly the decode steps the metrics counted",
                                        f"{name}: recorder staging bounded",
                                        f"{name}: oea simulate --mode lockstep replays the trace"]
    return dict(zip(("validates", "steps", "staging", "replay"), checks, strict=True))


def _mean(rows: list[dict[str, Any]], field: str) -> float:
    values = [a for r in rows for a in r[field]]
    return sum(values) / len(values)


def test_a_trace_of_exactly_the_metrics_steps_holds_every_check(tmp_path: Path) -> None:
    """Three 2-row steps, OEA at k0 = 2 (not the simulator's default 3, nor 1): the replay of the recorded
    logits gives the engine's active experts on both sides."""
    path = _save(tmp_path, [1, 1, 2, 2, 3, 3], stopped="requests")
    rows = _engine_rows(path, k0=2)
    assert [r["active"] for r in rows] != [r["active"] for r in _engine_rows(path, k0=3)]
    assert [r["active"] for r in rows] != [r["active"] for r in _engine_rows(path, k0=1)]
    checks = _checks(path, rows, k0=2, name="arm1")
    assert all(c.held for c in checks.values()), checks
    assert checks["validates"].detail == "6 tokens, 3 steps; stopped: requests"
    assert checks["steps"].detail == "3 recorded, 3 counted; missing [], extra [], rows differ [], dropped 0"
    assert checks["staging"].detail == "writer queue peak 2 of 8 steps"
    stock, oea = _mean(rows, "active_stock"), _mean(rows, "active")
    detail = checks["replay"].detail
    assert detail.startswith(f"B = 2 (3 steps): vanilla T {stock:.2f} vs the engine's {stock:.2f} ("), detail
    assert f"), oea T {oea:.2f} vs the engine's {oea:.2f} (" in detail, detail


def test_a_step_recorded_with_other_rows_than_the_metrics_counted_fails(tmp_path: Path) -> None:
    path = _save(tmp_path, [1, 1, 2, 2, 3, 3])
    rows = _engine_rows(path, k0=None)
    rows[1]["rows"] = 3
    check = _checks(path, rows, k0=None)["steps"]
    assert not check.held
    assert check.detail == "3 recorded, 3 counted; missing [], extra [], rows differ [2], dropped 0"


def test_the_trace_steps_problem_names_the_first_five_of_each_kind(tmp_path: Path) -> None:
    recorded = [s for s in range(1, 7) for _ in range(2)] + list(range(20, 26))
    path = _save(tmp_path, recorded)
    counted = [{"step": s, "decode": True, "rows": 3} for s in range(1, 7)]
    counted += [{"step": s, "decode": True, "rows": 1} for s in range(10, 16)]
    counted += [{"step": 30, "decode": False, "rows": 1}]  # prefill steps are not recorded
    check = _checks(path, counted, k0=None)["steps"]
    assert not check.held
    assert check.detail == ("12 recorded, 12 counted; missing [10, 11, 12, 13, 14], extra [20, 21, 22, 23, 24], "
                            "rows differ [1, 2, 3, 4, 5], dropped 0")


@pytest.mark.parametrize(("peak", "bound", "held"), [(8, 8, True), (9, 8, False), (2, None, False),
                                                      (None, 8, False), (None, None, False)])
def test_the_recorders_queue_is_bounded_by_its_sidecars_bound(tmp_path: Path, peak: int | None,
                                                               bound: int | None, held: bool) -> None:
    path = _save(tmp_path, [1, 1, 2, 2], queue_peak_steps=peak, queue_bound_steps=bound)
    check = _checks(path, _engine_rows(path, k0=None), k0=None)["staging"]
    assert check.held is held and check.detail == f"writer queue peak {peak} of {bound} steps"


def test_a_trace_that_does_not_load_is_named_in_at_most_300_characters(tmp_path: Path) -> None:
    missing = tmp_path / ("x" * 200) / "trace.safetensors"
    (check,) = trace_checks("a", missing, [GOOD], k0=3)
    assert check.held is False and check.detail.startswith("trace file does not exist: ")
    assert len(check.detail) == 300


def test_the_replay_reads_the_selection_bias_of_each_layer(tmp_path: Path) -> None:
    """A sigmoid router whose correction bias sends every token of layer 0 to experts 0-3 and of layer 1 to 12-15:
    the engine loads 4 experts per layer and step, which only a replay with the bias gives."""
    bias = torch.zeros(2, 16)
    bias[0, :4] = bias[1, 12:] = 10.0
    spec = RouterSpec(16, 4, scoring="sigmoid", correction_bias=torch.zeros(16))
    path = _save(tmp_path, [1, 1, 2, 2, 3, 3], spec=spec, bias=bias)
    rows = _engine_rows(path, k0=None)
    assert [r["active"] for r in rows] == [[4, 4]] * 3
    replay = _checks(path, rows, k0=None)["replay"]
    assert replay.held and replay.detail == "B = 2 (3 steps): vanilla T 4.00 vs the engine's 4.00 (+0.00%)"


def test_the_replay_covers_every_step_of_its_width(tmp_path: Path) -> None:
    """300 steps of 8 rows, top-1 of 16 experts: in 295 every row picks one expert, in 5 each row its own. The
    engine's mean is over all 300 steps; a replay of a sample of them (the simulator's automatic count stops at
    32 when they agree; 200 batches miss some) is several per cent off."""
    busy = {16, 219, 247, 292, 295}
    logits = torch.full((300, 8, 1, 16), -5.0)
    for step in range(300):
        for row in range(8):
            logits[step, row, 0, row if step in busy else step % 16] = 5.0
    path = _save(tmp_path, [s + 1 for s in range(300) for _ in range(8)], logits=logits.reshape(2400, 1, 16),
                 spec=RouterSpec(16, 1))
    rows = [{"step": s + 1, "decode": True, "rows": 8, "active": [8 if s in busy else 1]} for s in range(300)]
    replay = _checks(path, rows, k0=None)["replay"]
    assert replay.held and replay.detail == "B = 8 (300 steps): vanilla T 1.12 vs the engine's 1.12 (+0.00%)"


def test_a_replay_the_simulator_refuses_fails_naming_why_in_at_most_300_characters(tmp_path: Path) -> None:
    path = _save(tmp_path, [1, 1, 2, 2, 3, 3], name="n" * 400)
    replay = _checks(path, _engine_rows(path, k0=None), k0=5)["replay"]  # k0 above top_k 4
    assert replay.held is False and replay.detail.startswith("k0 must be in 1..top_k=4"), replay.detail
    assert len(replay.detail) == 300


def test_a_trace_with_no_width_recorded_twice_fails_the_replay(tmp_path: Path) -> None:
    path = _save(tmp_path, [1, 1, 2])
    replay = _checks(path, _engine_rows(path, k0=None), k0=None)["replay"]
    assert replay.held is False and replay.detail.startswith("no step width was recorded twice")


def test_metrics_without_stock_counts_fail_the_replay_instead_of_raising(tmp_path: Path) -> None:
    path = _save(tmp_path, [1, 1, 2, 2, 3, 3])
    rows = [{k: v for k, v in r.items() if k != "active_stock"} for r in _engine_rows(path, k0=2)]
    replay = _checks(path, rows, k0=2)["replay"]
    assert replay.held is False and "vs the engine's nan" in replay.detail, replay.detail


def test_metrics_of_no_active_expert_fail_the_replay_instead_of_raising(tmp_path: Path) -> None:
    path = _save(tmp_path, [1, 1, 2, 2, 3, 3])
    rows = [{**r, "active": [0, 0]} for r in _engine_rows(path, k0=None)]
    replay = _checks(path, rows, k0=None)["replay"]
    assert replay.held is False and "vs the engine's 0.00" in replay.detail, replay.detail


# -- one arm: failed requests, health, aborts, memory ------------------------------------------------------------

def _arm(**changes: Any) -> dict[str, Any]:
    """An arm's report that passes every arm check (no ``restarts``, ``no_answer`` nor silence: none seen)."""
    report: dict[str, Any] = {"failed": 0, "failures": [], "sent": 10, "aborted": 5,
                              "warmup": {"failed": 0, "sent": 4, "failures": []},
                              "health": {"unhealthy": 0, "samples": 3}}
    report.update(changes)
    return report


def _named(checks: list[Any], words: str) -> Any:
    (check,) = [c for c in checks if words in c.name]
    return check


def test_failed_requests_count_the_warm_up_and_name_the_first_three() -> None:
    ok = _named(arm_checks("a", _arm()), "0 failed requests")
    assert ok.name == "a: 0 failed requests" and ok.held and ok.detail == "0 failed of 10 (+4 warm-up)"
    both = _arm(failed=1, failures=["#1 (plain): HTTP 500"],
                warmup={"failed": 1, "sent": 4, "failures": ["#0 (warm-up): HTTP 500"]})
    check = _named(arm_checks("a", both), "0 failed requests")
    assert not check.held and check.detail == "2 failed: ['#1 (plain): HTTP 500']"
    many = _named(arm_checks("a", _arm(failed=4, failures=["#1", "#2", "#3", "#4"])), "0 failed requests")
    assert many.detail == "4 failed: ['#1', '#2', '#3']"
    warm = _arm(warmup={"failed": 4, "sent": 4, "failures": ["#1", "#2", "#3", "#4"]})
    assert _named(arm_checks("a", warm), "0 failed requests").detail == "4 failed: ['#1', '#2', '#3']"


def test_the_health_check_reports_what_it_saw() -> None:
    check = _named(arm_checks("a", _arm()), "healthy throughout")
    assert check.name == "a: 0 restarts, healthy throughout" and check.held
    assert check.detail == ("0 processes of the server vanished, 0 of 3 health answers not 200 or unreachable; "
                            "0 timed out, longest without an answer 0 s (bound 60 s)")
    sick = _arm(restarts=1, health={"unhealthy": 2, "samples": 9, "first_unhealthy_s": 12.5,
                                    "first_unhealthy_status": 503, "no_answer": 3, "longest_silence_s": 31.0})
    check = _named(arm_checks("a", sick), "healthy throughout")
    assert not check.held
    assert check.detail == ("1 processes of the server vanished, 2 of 9 health answers not 200 or unreachable "
                            "(the first at 12.5 s: status 503); 3 timed out, longest without an answer 31 s "
                            "(bound 60 s)")


@pytest.mark.parametrize(("silence", "held"), [(MAX_SILENCE_S, True), (MAX_SILENCE_S + 0.1, False)])
def test_a_silence_up_to_the_bound_is_healthy(silence: float, held: bool) -> None:
    report = _arm(health={"unhealthy": 0, "samples": 3, "longest_silence_s": silence})
    assert _named(arm_checks("a", report), "healthy throughout").held is held


@pytest.mark.parametrize(("sent", "aborted", "share", "held"), [(10, 2, 0.2, True), (10, 1, 0.2, False),
                                                                (0, 0, 0.2, False), (0, 0, 0.0, True),
                                                                (1, 1, 0.6, True), (2, 1, 0.6, False)])
def test_the_aborted_share_is_of_the_requests_sent(sent: int, aborted: int, share: float, held: bool) -> None:
    check = _named(arm_checks("a", _arm(sent=sent, aborted=aborted), min_aborted_share=share), "aborted")
    assert check.name == f"a: >= {share:.0%} aborted by the client" and check.held is held
    assert check.detail == f"{aborted} of {sent} ({aborted / max(1, sent):.1%})"


def _memory(growth: float | None, **more: Any) -> dict[str, Any]:
    return _arm(**{"memory_after_warmup": {"rss_mib": 1000.0}, "memory_end": {"rss_mib": 1000.0 + (growth or 0.0)},
                   "rss_growth_mib": growth, "pss_growth_mib": 9.0, **more})


def test_the_memory_check_is_the_verdict_unless_an_off_arm_judges_it() -> None:
    bound = memory_bound_mib(1000.0)
    check = _named(arm_checks("a", _memory(10.0, rss_growth_second_half_mib=2.0)), "RSS growth")
    assert check.name == f"a: RSS growth after warm-up within {bound:.0f} MiB"
    assert check.held and check.verdict is True
    assert check.detail == "1000 -> 1010 MiB (+10.0 MiB, +2.0 MiB in the second half; PSS +9.0 MiB)"
    reported = _named(arm_checks("a", _memory(10.0), memory_verdict=False), "RSS growth")
    assert reported.verdict is False
    assert reported.detail == ("1000 -> 1010 MiB (+10.0 MiB, ? in the second half; PSS +9.0 MiB); reported, "
                               "the verdict is the growth against OEA off's")
    gone = _named(arm_checks("a", _memory(None)), "RSS growth")
    assert gone.held is False and gone.verdict is True
    assert gone.detail == "the server's processes were gone at the end"


def test_the_memory_check_names_the_process_that_grew_most_of_those_watched_throughout() -> None:
    def reading(rss: dict[int, float]) -> dict[str, Any]:
        return {"rss_mib": sum(rss.values()),
                "processes": [{"pid": pid, "name": f"p{pid}", "rss_mib": mib} for pid, mib in rss.items()]}

    report = _memory(40.0, memory_after_warmup=reading({1: 100.0, 2: 500.0}),
                     memory_end=reading({1: 130.0, 2: 510.0, 3: 900.0}), anon_growth_mib=39.0)
    detail = _named(arm_checks("a", report), "RSS growth").detail
    assert detail.endswith("PSS +9.0 MiB, anon +39.0; most in p1 +30.0 MiB)"), detail
    unlisted = _named(arm_checks("a", _memory(40.0, file_growth_mib=1.0)), "RSS growth").detail
    assert unlisted.endswith("PSS +9.0 MiB, file +1.0)"), unlisted


def test_the_metrics_file_is_read_line_by_line_and_a_missing_one_is_no_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_metrics(path) == [] and read_metrics(str(path)) == []
    path.write_text('{"step": 1}\n\n{"step": 2}\n  \n')
    assert read_metrics(str(path)) == [{"step": 1}, {"step": 2}] == read_metrics(path)
