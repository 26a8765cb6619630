"""``oea soak``'s metrics and trace checks at the edges the generated mutants of ``make mutation`` found
unguarded (docs/testing.md, "Generated mutants"): which rows count as one process's steps, the bounds' edges
(exactly k x rows, exactly stock routing, one layer, one row), a run without decode steps, a trace that does not
load, and the words each problem is reported with."""

from __future__ import annotations

from typing import Any

from oea.soak.checks import metrics_checks, trace_checks

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
