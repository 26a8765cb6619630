"""The what-if simulator against independent counts and the routing invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oea
from oea.routing import RouterSpec
from oea.sim import batch_expert_load, make_batches, max_device_active, simulate
from oea.sim.costmodel import uniform_active_experts
from oea.sim.simulate import route_batches, router_inputs
from oea.traces import Trace, load_trace

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qwen3() -> Trace:
    return load_trace("qwen3-30b-a3b")


def _numpy_union_sizes(ids: np.ndarray, batches: np.ndarray) -> np.ndarray:
    """[T, L, k] ids, [nb, B] token indices -> [L, nb] distinct experts, counted with Python sets."""
    _, layers, _ = ids.shape
    return np.array([[len(set(ids[batch, layer].ravel().tolist())) for batch in batches]
                     for layer in range(layers)])


def test_vanilla_T_equals_an_independent_count_of_the_same_batches(qwen3: Trace) -> None:
    rows = simulate(qwen3, policies=["vanilla"], batch_sizes=[16], num_batches=64, seed=3)
    batches = make_batches(qwen3, 16, "mixed", 64, torch.Generator().manual_seed(3)).numpy()
    expected = _numpy_union_sizes(qwen3.ids.numpy(), batches)
    assert rows[0]["mean_active_experts"] == pytest.approx(expected.mean(), abs=1e-9)
    assert rows[0]["per_layer_active_experts"] == pytest.approx(expected.mean(axis=1).round(3).tolist())


def test_mixed_batches_never_repeat_a_token(qwen3: Trace) -> None:
    batches = make_batches(qwen3, 128, "mixed", 50, torch.Generator().manual_seed(0))
    assert batches.shape == (50, 128)
    assert all(len(set(batch.tolist())) == 128 for batch in batches), "mixed batches are drawn without replacement"
    assert int(batches.min()) >= 0 and int(batches.max()) < qwen3.num_tokens


@pytest.mark.parametrize("batch_size", [48, 47])
def test_batch_of_the_whole_pool_loads_every_expert_the_pool_uses(batch_size: int) -> None:
    """Independent of ``make_batches``: a batch holding the whole pool has exactly the pool's distinct experts,
    and one token fewer can drop at most the experts only that token used."""
    trace = _full_logit_trace(tokens=48, n=64, k=2)
    top = [[set(torch.topk(trace.logits[t, layer], 2).indices.tolist()) for t in range(48)] for layer in range(2)]
    pool = [len(set().union(*layer_sets)) for layer_sets in top]
    rows = simulate(trace, policies=["vanilla"], batch_sizes=[batch_size], num_batches=8, seed=5)
    per_layer = rows[0]["per_layer_active_experts"]
    if batch_size == 48:  # every batch is the whole pool: 8 samples of pool[0] and 8 of pool[1]
        assert per_layer == pool
        assert rows[0]["p95_active_experts"] == pytest.approx(max(pool))  # torch.quantile's linear rule
        assert rows[0]["p50_active_experts"] == pytest.approx(sum(pool) / 2)
    else:
        fewest = [min(len(set().union(*(s for u, s in enumerate(layer_sets) if u != t))) for t in range(48))
                  for layer_sets in top]
        assert all(f <= got <= p for f, got, p in zip(fewest, per_layer, pool, strict=True))


def test_vanilla_T_at_B16_is_the_measured_64_5_not_uniform_82_4(qwen3: Trace) -> None:
    # Independent: numpy's own random batches (not make_batches), 400 trials as in real-traces.md §3.1.
    rng = np.random.default_rng(1)
    ids = qwen3.ids.numpy()
    batches = np.stack([rng.choice(len(ids), 16, replace=False) for _ in range(400)])
    independent = _numpy_union_sizes(ids, batches).mean()
    simulated = simulate(qwen3, policies=["vanilla"], batch_sizes=[16], num_batches=128, seed=0)[0]
    assert independent == pytest.approx(64.5, abs=0.6)
    assert simulated["mean_active_experts"] == pytest.approx(independent, abs=1.0)
    assert uniform_active_experts(128, 8, 16) == pytest.approx(82.4, abs=0.05)


def test_oea_and_pruned_share_T_and_oea_fills_within_the_recorded_top_k(qwen3: Trace) -> None:
    rows = simulate(qwen3, policies=["vanilla", "pruned", "oea"], k0s=[2, 4], batch_sizes=[8],
                    num_batches=4, seed=0, layers=[0, 17, 47])
    by = {(r["policy"], r["k0"]): r for r in rows}
    for k0 in (2, 4):
        oea_row, pruned_row = by[("oea", k0)], by[("pruned", k0)]
        assert oea_row["mean_active_experts"] == pruned_row["mean_active_experts"]  # T = |S_base|
        assert pruned_row["mean_experts_per_token"] == k0
        assert k0 < oea_row["mean_experts_per_token"] <= 8
        # id-only: every routed expert is in the token's recorded top-8
        assert oea_row["kept_topk_share"] == pytest.approx(oea_row["mean_experts_per_token"] / 8)
        assert "max_rank=8" in oea_row["note"]
        assert oea_row["mean_active_experts"] < by[("vanilla", None)]["mean_active_experts"]
    assert by[("oea", 2)]["mean_active_experts"] < by[("oea", 4)]["mean_active_experts"]


def test_route_batches_matches_one_route_call_per_batch(qwen3: Trace) -> None:
    logits, spec, _ = router_inputs(qwen3, 5)
    batches = make_batches(qwen3, 8, "mixed", 3, torch.Generator().manual_seed(0))
    for cfg in (None, oea.PrunedConfig(3), oea.OEAConfig(3, max_rank=8)):
        ids, weights = route_batches(logits, spec, cfg, batches)
        for i, batch in enumerate(batches):
            want_ids, want_weights = oea.route(logits[batch], spec, cfg)
            assert torch.equal(ids[i], want_ids)
            torch.testing.assert_close(weights[i], want_weights)
            assert int((batch_expert_load(ids[i:i + 1], weights[i:i + 1], 128) > 0).sum()) == int(
                oea.active_experts(want_ids, want_weights))


def test_rank_synthesised_logits_reproduce_the_recorded_order(qwen3: Trace) -> None:
    logits, spec, mass = router_inputs(qwen3, 0)
    ids, _ = oea.route(logits[:50], spec)
    assert torch.equal(ids, qwen3.ids[:50, 0])
    assert mass is None


def _full_logit_trace(tokens: int = 64, n: int = 16, k: int = 4) -> Trace:
    g = torch.Generator().manual_seed(0)
    return Trace(spec=RouterSpec(n, k), logits=2 * torch.randn(tokens, 2, n, generator=g),
                 request_ids=torch.arange(tokens) % 8, positions=torch.arange(tokens) // 8,
                 meta={"name": "synthetic"})


def test_full_logit_trace_piggybacks_beyond_top_k_and_reports_mass() -> None:
    trace = _full_logit_trace()
    rows = simulate(trace, policies=["pruned", "oea"], k0s=[1], batch_sizes=[8], num_batches=16)
    by = {r["policy"]: r for r in rows}
    assert "full router logits" in by["oea"]["note"]
    assert 0 < by["pruned"]["kept_mass"] < by["oea"]["kept_mass"] <= 1.0 + 1e-6
    # full ranking: OEA may use experts outside the token's own top-k
    assert by["oea"]["kept_topk_share"] < by["oea"]["mean_experts_per_token"] / 4


def test_lockstep_batches_hold_distinct_requests_at_one_position() -> None:
    trace = load_trace("flame-moe-290m")
    batches = make_batches(trace, 16, "lockstep", 20, torch.Generator().manual_seed(0))
    for batch in batches:
        assert len(set(trace.positions[batch].tolist())) == 1
        assert len(set(trace.request_ids[batch].tolist())) == 16
    with pytest.raises(ValueError, match="at most 64"):
        make_batches(trace, 65, "lockstep", 1, torch.Generator())


def _recorded_steps_trace() -> Trace:
    """Full logits of 3 engine steps (5, 8 and 8 rows), rows of different requests and positions, shuffled."""
    g = torch.Generator().manual_seed(4)
    sizes = [5, 8, 8]
    steps = torch.cat([torch.full((n,), 40 + i) for i, n in enumerate(sizes)])
    order = torch.randperm(len(steps), generator=g)
    return Trace(spec=RouterSpec(32, 4), logits=torch.randn(len(steps), 2, 32, generator=g),
                 request_ids=torch.arange(len(steps))[order], positions=(torch.arange(len(steps)) * 7 % 11)[order],
                 step_ids=steps[order])


def test_lockstep_replays_recorded_engine_steps_as_batched() -> None:
    """With ``step_ids`` a lockstep batch is rows of one engine step (not one position); a step of exactly B
    rows is the whole step, so vanilla T is the step's own union, counted here by hand."""
    trace = _recorded_steps_trace()
    batches = make_batches(trace, 8, "lockstep", 30, torch.Generator().manual_seed(1))
    for batch in batches:
        assert len(set(trace.step_ids[batch].tolist())) == 1 and len(set(batch.tolist())) == 8
    assert {int(trace.step_ids[b[0]]) for b in batches} == {41, 42}  # the 5-row step is too small for B = 8
    union = {s: [len(set(trace.logits[trace.step_ids == s, layer].topk(4).indices.flatten().tolist()))
                 for layer in range(2)] for s in (41, 42)}
    expected = np.mean([union[int(trace.step_ids[b[0]])] for b in batches])
    rows = simulate(trace, policies=["vanilla"], batch_sizes=[8], mode="lockstep", num_batches=30, seed=1)
    assert rows[0]["mean_active_experts"] == pytest.approx(expected, abs=1e-9)
    with pytest.raises(ValueError, match=r"needs 9 requests at one engine step.*at most 8"):
        make_batches(trace, 9, "lockstep", 1, torch.Generator())


def test_bad_inputs_give_clear_errors(qwen3: Trace) -> None:
    with pytest.raises(ValueError, match=r"larger than the pool.*4130"):
        simulate(qwen3, policies=["vanilla"], batch_sizes=[5000], num_batches=2)
    with pytest.raises(ValueError, match=r"lockstep.*request ids"):
        simulate(qwen3, policies=["vanilla"], batch_sizes=[4], mode="lockstep", num_batches=2)
    with pytest.raises(ValueError, match=r"policy must be one of .*'oea'"):
        simulate(qwen3, policies=["nope"], batch_sizes=[4], num_batches=2)
    with pytest.raises(ValueError, match=r"k0 must be in 1\.\.top_k=8"):
        simulate(qwen3, policies=["oea"], k0s=[9], batch_sizes=[4], num_batches=2)
    with pytest.raises(ValueError, match="mode must be one of"):
        simulate(qwen3, policies=["vanilla"], batch_sizes=[4], mode="sideways", num_batches=2)
    with pytest.raises(ValueError, match=r"num_batches must be an integer >= 2 \(an interval needs two"):
        simulate(qwen3, policies=["vanilla"], batch_sizes=[4], num_batches=1)


def test_expert_load_and_busiest_device_by_hand() -> None:
    ids = torch.tensor([[[0, 1], [1, 6]], [[7, 7], [2, 3]]])  # [nb=2, B=2, k=2]
    weights = torch.tensor([[[0.5, 0.5], [0.5, 0.5]], [[1.0, 0.0], [0.5, 0.5]]])
    load = batch_expert_load(ids, weights, 8)
    assert load.tolist() == [[1, 2, 0, 0, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0, 0, 1]]
    assert max_device_active(load, 2).tolist() == [2, 2]
    assert max_device_active(load, 4).tolist() == [2, 2]
    with pytest.raises(ValueError, match="ep must be a positive divisor"):
        max_device_active(load, 3)


def test_ep_metric_and_latency_columns(qwen3: Trace) -> None:
    rows = simulate(qwen3, policies=["vanilla", "oea"], k0s=[3], batch_sizes=[16], num_batches=4,
                    layers=[0, 1], gpu="h100-sxm", ep=8)
    for row in rows:
        assert row["mean_active_experts"] / 8 <= row["max_device_active_experts"] <= 16
        assert row["predicted_latency_us"] > 0
    assert rows[1]["latency_ratio_vs_vanilla"] < 1.0
