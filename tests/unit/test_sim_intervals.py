"""``oea simulate``'s statistics (``oea.sim.summary``): means over batches with t intervals, the automatic
batch count for a ±1% interval on T, paired ratios, and EP-aware OEA placed from ``ep``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oea.sim import simulate
from oea.sim.summary import batches_for_precision, relative_half_width, summarise
from oea.stats import mean_interval
from oea.traces import Trace, load_trace


@pytest.fixture(scope="module")
def qwen3() -> Trace:
    return load_trace("qwen3-30b-a3b")


def _samples(per_layer_batches: list[list[float]]) -> list[dict[str, torch.Tensor]]:
    return [{"active_experts": torch.tensor(values, dtype=torch.float64),
             "experts_per_token": torch.full((len(values),), 8.0, dtype=torch.float64),
             "kept_topk_share": torch.ones(len(values), dtype=torch.float64),
             "token_slots": torch.full((len(values),), 128.0, dtype=torch.float64)} for values in per_layer_batches]


def test_a_row_is_the_mean_over_batches_of_the_layer_mean_with_its_t_interval() -> None:
    layers = [[10.0, 12.0, 14.0, 16.0], [20.0, 22.0, 24.0, 30.0]]  # [L=2, nb=4]
    row = summarise({"policy": "oea"}, _samples(layers), [0, 1], None, 16, None)
    per_batch = [15.0, 17.0, 19.0, 23.0]
    assert row["num_batches"] == 4 and row["mean_active_experts"] == pytest.approx(18.5)
    assert row["mean_active_experts_ci"] == pytest.approx(mean_interval(per_batch).as_list())
    # sd of 15, 17, 19, 23 = 3.416; t(0.975, 3) = 3.182: half-width 3.182 * 3.416 / 2 = 5.435
    assert row["mean_active_experts_ci"][1] - 18.5 == pytest.approx(5.435, abs=1e-3)
    assert row["t_ci_relative_half_width"] == pytest.approx(5.435 / 18.5, abs=1e-4)
    assert row["mean_experts_per_token_ci"] == [8.0, 8.0] and row["kept_mass"] is None and row["kept_mass_ci"] is None
    assert row["per_layer_active_experts"] == [13.0, 24.0]


def test_the_needed_batch_count_follows_one_over_the_square_of_the_half_width() -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(50.0, 5.0, 32)
    h = relative_half_width(values)  # about 2.04 * 5 / sqrt(32) / 50 = 3.6%
    samples = {"oea": _samples([values.tolist()]), "constant": _samples([[8.0] * 32])}
    needed = batches_for_precision(samples, 0.01, 10_000)
    assert needed == math.ceil(1.1 * 32 * (h / 0.01) ** 2)
    assert batches_for_precision(samples, 0.01, 100) == 100  # capped
    assert batches_for_precision(samples, 0.5, 10_000) == 32  # already precise enough: no more


def test_simulate_draws_batches_until_t_is_within_the_precision(qwen3: Trace) -> None:
    rows = simulate(qwen3, policies=["vanilla", "oea"], k0s=[3], batch_sizes=[16], layers=[0, 5], precision=0.01)
    for row in rows:
        assert row["num_batches"] > 32  # two layers are noisier than 48: the pilot draw is not enough
        assert row["t_ci_relative_half_width"] <= 0.01 and row["t_ci_target_met"] is True
        low, high = row["mean_active_experts_ci"]
        assert low < row["mean_active_experts"] < high
    oea_row = rows[1]
    low, high = oea_row["active_ratio_vs_vanilla_ci"]
    assert low <= oea_row["active_ratio_vs_vanilla"] <= high < 1.0
    capped = simulate(qwen3, policies=["oea"], k0s=[3], batch_sizes=[16], layers=[0], precision=0.001,
                      max_batches=40)
    assert capped[0]["num_batches"] == 40 and capped[0]["t_ci_target_met"] is False
    assert capped[0]["t_ci_relative_half_width"] > 0.001
    fixed = simulate(qwen3, policies=["oea"], k0s=[3], batch_sizes=[16], layers=[0], num_batches=5)
    assert fixed[0]["num_batches"] == 5 and "t_ci_target_met" not in fixed[0]


def test_ep_places_ep_aware_oea_without_policy_options(qwen3: Trace) -> None:
    rows = simulate(qwen3, policies=["oea", "ep-oea"], k0s=[3], batch_sizes=[16], layers=[0, 1], num_batches=4, ep=8)
    oea_row, ep_row = rows
    assert ep_row["policy"] == "ep-oea"
    # EP-aware OEA never loads the busiest device more than plain OEA, and fills the others
    assert ep_row["max_device_active_experts"] <= oea_row["max_device_active_experts"] + 1e-9
    assert ep_row["mean_active_experts"] >= oea_row["mean_active_experts"]
    assert ep_row["max_device_active_experts_ci"] is not None
    with pytest.raises(ValueError, match=r"'ep-oea' needs the expert-parallel degree: ep=N \(--ep N\)"):
        simulate(qwen3, policies=["ep-oea"], k0s=[3], batch_sizes=[16], layers=[0], num_batches=2)
    with pytest.raises(ValueError, match="ep must divide num_experts"):
        simulate(qwen3, policies=["ep-oea"], k0s=[3], batch_sizes=[16], layers=[0], num_batches=2, ep=3)


def test_repeated_policies_or_k0_are_refused(qwen3: Trace) -> None:
    with pytest.raises(ValueError, match=r"policies must not repeat, got \['oea'\]"):
        simulate(qwen3, policies=["oea", "oea"], batch_sizes=[4], num_batches=2)
    with pytest.raises(ValueError, match=r"k0 values must not repeat, got \['3'\]"):
        simulate(qwen3, policies=["oea"], k0s=[3, 3], batch_sizes=[4], num_batches=2)


def _six_requests_trace(tmp_path, steps: int = 128) -> tuple[str, Trace]:
    """6 requests decoding in lockstep for ``steps`` positions, full logits of 2 layers, saved to a file."""
    from oea.routing import RouterSpec
    from oea.traces.format import save_trace

    g = torch.Generator().manual_seed(3)
    tokens = 6 * steps
    trace = Trace(spec=RouterSpec(32, 4), logits=2 * torch.randn(tokens, 2, 32, generator=g),
                  request_ids=torch.arange(tokens) % 6, positions=torch.arange(tokens) // 6,
                  meta={"name": "six-requests"})
    path = tmp_path / "six.safetensors"
    save_trace(trace, path)
    return str(path), trace


def _json_rows(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    import json

    from oea.cli import main

    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("count", [[], ["--num-batches", "600"]], ids=["auto", "fixed-600"])
def test_lockstep_intervals_count_the_distinct_batches(tmp_path, capsys: pytest.CaptureFixture[str],
                                                       count: list[str]) -> None:
    """6 requests x 128 positions at B = 6: every batch is all six requests at one position, so there are
    exactly 128 distinct batches, whatever count is asked for. The row is their mean with the t interval
    over those 128 values, counted here by hand: per position, the union of the 6 tokens' top-4 experts."""
    path, trace = _six_requests_trace(tmp_path)
    rows = _json_rows(capsys, "--trace", path, "--mode", "lockstep", "--batch-sizes", "6", "--policies", "vanilla",
                      *count)
    assert rows[0]["num_batches"] == 128 and rows[0]["distinct_batches"] == 128
    per_position = [np.mean([len(set(trace.logits[6 * p:6 * p + 6, layer].topk(4).indices.flatten().tolist()))
                             for layer in range(2)]) for p in range(128)]
    want = mean_interval(per_position)
    assert rows[0]["mean_active_experts"] == pytest.approx(want.estimate, abs=1e-9)
    assert rows[0]["mean_active_experts_ci"] == pytest.approx(want.as_list(), abs=1e-9)


@pytest.mark.parametrize("enumerate_limit", [4096, 0], ids=["listed", "redrawn"])
def test_lockstep_batches_never_repeat_and_a_single_distinct_batch_is_refused(
        tmp_path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, enumerate_limit: int) -> None:
    """B = 5 of 6 requests: C(6, 5) = 6 distinct batches per position, 48 over 8 positions; asking for 200
    gives the 48, each once (positions with few batches list them; with the limit at 0 every draw is a random
    one, redrawn when it repeats). A trace of one position holds a single batch at B = 6: no interval, an error."""
    import oea.sim.batches
    from oea.cli import main
    from oea.sim import make_batches

    monkeypatch.setattr(oea.sim.batches, "ENUMERATE_LIMIT", enumerate_limit)
    path, trace = _six_requests_trace(tmp_path, steps=8)
    rows = _json_rows(capsys, "--trace", path, "--mode", "lockstep", "--batch-sizes", "5", "--policies", "vanilla",
                      "--num-batches", "200")
    assert rows[0]["num_batches"] == rows[0]["distinct_batches"] == 48
    batches = make_batches(trace, 5, "lockstep", 200, torch.Generator().manual_seed(0))
    assert len({frozenset(b) for b in batches.tolist()}) == len(batches) == 48
    more = make_batches(trace, 5, "lockstep", 10, torch.Generator().manual_seed(1), exclude=batches[:40])
    assert {frozenset(b) for b in more.tolist()} == {frozenset(b) for b in batches[40:].tolist()}
    one, _ = _six_requests_trace(tmp_path, steps=1)
    assert main(["simulate", "--trace", one, "--mode", "lockstep", "--batch-sizes", "6", "--policies", "vanilla"]) == 2
    assert "holds 1 distinct batch, an interval needs two" in capsys.readouterr().err
