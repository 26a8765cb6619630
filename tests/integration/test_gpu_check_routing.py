"""The CPU side of ``scripts/gpu_check.py``'s step 0 (the fast routing kernel on a GPU): the settings it runs
there, the dry run on CPU (numba instead of Triton, no graphs) and its pass rule. The CUDA run itself is step 0
of ``scripts/gpu_check.sh`` on a GPU; these tests do not stand in for it."""

from __future__ import annotations

import pytest
import torch
from project_scripts import load_script

import oea


@pytest.fixture(scope="module")
def step():
    return load_script("gpu_check_routing")


def _eager(fn, *static):
    return fn


def test_gpu_settings(step, monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(step, "exactness", lambda device, cases, graphed: seen.setdefault("cases", cases) and {
        "ok": True})
    monkeypatch.setattr(step, "timing", lambda device, batches, repeats, graphed: seen.setdefault(
        "batches", batches) and [{"fast_added_us": 12.0}, {"fast_added_us": 4.0}])
    result = step.check_fast_routing("cuda", dry_run=False, repeats=200, graphed=_eager)
    assert seen == {"cases": 10000, "batches": (1, 16, 64, 256)}
    assert result["ok"] and result["worst_added_us"] == 12.0 and not result["target_met"]
    assert set(step.routers("cpu", torch.Generator()).keys()) == {
        "softmax N=64", "softmax N=128", "softmax N=256", "sigmoid-grouped N=256"}


def test_dry_run_on_cpu(step) -> None:
    result = step.check_fast_routing("cpu", dry_run=True, repeats=10, graphed=_eager)
    assert result["exactness"]["mismatches"] == 0 and result["exactness"]["graph_mismatches"] == 0
    assert result["ok"]
    assert {(r["router"], r["batch_size"]) for r in result["timing"]} == {
        (name, b) for name in step.routers("cpu", torch.Generator()) for b in (1, 16)}
    assert all(r["fast_impl"] == "numba" and r["fast_us"] > 0 and r["stock_us"] > 0 for r in result["timing"])
    lines = "\n".join(step.summary_lines(result))
    assert "0 mismatches in 50 generated cases" in lines and "worst added" in lines


def test_a_kernel_that_differs_fails_the_step(step, monkeypatch) -> None:
    def swapped(logits, spec, cfg=None, valid=None, *, impl="auto"):
        ids, weights = oea.route(logits, spec, cfg, valid)
        return ids.flip(1), weights.flip(1)

    monkeypatch.setattr(oea, "route_fast", swapped)
    exact = step.exactness("cpu", 5, _eager)
    assert not exact["ok"] and exact["mismatches"] == 5 and exact["graph_mismatches"] == 12
    assert "ids differ" in exact["examples"][0]["why"]
