"""``oea simulate --dp``: per-rank batches, a local union per rank against a global one over the step."""

from __future__ import annotations

import json

import pytest
import torch

import oea
from oea.routing import RouterSpec
from oea.sim import make_batches, simulate
from oea.sim.scaleout import per_rank_active, rank_view, route_step, union_comparison
from oea.sim.simulate import route_batches
from oea.traces import Trace

torch.set_num_threads(1)


def _trace(tokens: int = 96, n: int = 32, k: int = 4) -> Trace:
    g = torch.Generator().manual_seed(11)
    return Trace(spec=RouterSpec(n, k), logits=1.5 * torch.randn(tokens, 2, n, generator=g), meta={"name": "dp-test"})


def test_local_routes_each_rank_alone_and_global_routes_the_whole_step() -> None:
    trace = _trace()
    logits = trace.logits[:, 0].float()
    batches = make_batches(trace, 12, "mixed", 3, torch.Generator().manual_seed(2))  # 3 steps of 3 ranks x 4 rows
    cfg = oea.OEAConfig(1)
    local_ids, local_w = route_step(route_batches, logits, trace.spec, cfg, batches, 3, "local")
    global_ids, global_w = route_step(route_batches, logits, trace.spec, cfg, batches, 3, "global")
    for step, batch in enumerate(batches):
        want_ids, want_w = oea.route(logits[batch], trace.spec, cfg)
        assert torch.equal(global_ids[step], want_ids) and torch.equal(global_w[step], want_w)
        for rank in range(3):
            rows = slice(4 * rank, 4 * rank + 4)
            rank_ids, rank_w = oea.route(logits[batch[rows]], trace.spec, cfg)
            assert torch.equal(local_ids[step, rows], rank_ids) and torch.equal(local_w[step, rows], rank_w)
    assert not torch.equal(local_ids, global_ids), "a global union must give some token another fill"


def test_rank_view_and_per_rank_active_by_hand() -> None:
    assert rank_view(torch.arange(12).reshape(2, 6), 3).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9],
                                                                      [10, 11]]
    with pytest.raises(ValueError, match="dp must be a positive divisor of the step's 6 rows, got dp=4"):
        rank_view(torch.arange(12).reshape(2, 6), 4)
    ids = torch.tensor([[[0, 1], [1, 2], [5, 5], [6, 7]]])  # one step, 2 ranks x 2 rows, k = 2
    weights = torch.tensor([[[0.5, 0.5], [0.5, 0.5], [1.0, 0.0], [0.5, 0.5]]])  # a filler (weight 0) on rank 1
    assert per_rank_active(ids, weights, 8, 2).tolist() == [(3 + 3) / 2]  # rank 0 {0,1,2}, rank 1 {5,6,7}


def test_global_union_keeps_T_and_the_busiest_device_and_adds_quality() -> None:
    """Plain OEA routes every token inside the union of baselines, so the experts the EP devices load are the
    same for both unions; the global one gives tokens more fill candidates (kept mass never lower per step)."""
    rows = simulate(_trace(), policies=["vanilla", "oea"], k0s=[1, 2], batch_sizes=[6], num_batches=8, dp=4, ep=4)
    by = {(r["policy"], r["k0"], r["union"]): r for r in rows}
    assert ("vanilla", None, "local") in by and ("vanilla", None, "global") not in by
    for k0 in (1, 2):
        local, glob = by[("oea", k0, "local")], by[("oea", k0, "global")]
        assert local["dp"] == glob["dp"] == 4 and local["batch_size"] == 6
        assert glob["mean_active_experts"] == local["mean_active_experts"]
        assert glob["max_device_active_experts"] == local["max_device_active_experts"]
        assert glob["kept_mass"] > local["kept_mass"]
        assert glob["per_rank_active_experts"] > local["per_rank_active_experts"]  # without EP: more per rank
        assert local["per_rank_active_experts"] < local["mean_active_experts"]
    (item,) = [c for c in union_comparison(rows) if c["k0"] == 1]
    assert item["proxy"] == "kept_mass" and item["delta_mean_active_experts"] == 0
    assert item["delta_kept_mass"] == pytest.approx(by[("oea", 1, "global")]["kept_mass"]
                                                    - by[("oea", 1, "local")]["kept_mass"])


def test_dp_one_is_the_plain_simulation() -> None:
    plain = simulate(_trace(), policies=["oea"], k0s=[2], batch_sizes=[8], num_batches=4, seed=1)
    same = simulate(_trace(), policies=["oea"], k0s=[2], batch_sizes=[8], num_batches=4, seed=1, dp=1)
    assert plain == same and "union" not in plain[0] and "per_rank_active_experts" not in plain[0]


def test_bad_dp_values_are_named() -> None:
    with pytest.raises(ValueError, match="dp must be an integer >= 1, got 0"):
        simulate(_trace(), policies=["oea"], batch_sizes=[4], num_batches=2, dp=0)
    with pytest.raises(ValueError, match=r"dp=4 ranks of B=32 rows need 128 rows per step: batch size 128 is larger"):
        simulate(_trace(), policies=["oea"], batch_sizes=[32], num_batches=2, dp=4)


def test_cli_dp_rows_and_the_union_note(capsys: pytest.CaptureFixture[str]) -> None:
    from oea.cli import main

    args = ["simulate", "--trace", "flame-moe-290m", "--policies", "oea", "--k0", "2", "--batch-sizes", "4",
            "--num-batches", "2"]
    assert main([*args, "--dp", "2", "--ep", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["union"], r["dp"]) for r in rows} == {("local", 2), ("global", 2)}
    assert main([*args, "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "T per rank (dp=2)" in out and "global vs local union, oea k0=2 B=4/rank x dp=2: kept_mass" in out


def _glm5_like_trace(tokens: int = 256, layers: int = 2) -> Trace:
    """GLM-5's router shape: 256 experts, top-8, sigmoid scores with a correction bias, one group, scale 2.5."""
    g = torch.Generator().manual_seed(5)
    spec = RouterSpec(256, 8, "sigmoid", True, None, 1, 1, 2.5)
    return Trace(spec=spec, logits=torch.randn(tokens, layers, 256, generator=g),
                 correction_bias=torch.rand(layers, 256, generator=g) * 0.5, meta={"name": "glm5-like"})


def test_glm5_deployment_shapes_tp8_and_ep8() -> None:
    """The reference deployment's router at TP = 8 (every GPU a 1/8 shard of each expert: T sets the time) and
    at EP = 8 with DP attention (the busiest GPU does), with the glm-5 preset's latency on RTX PRO 6000s."""
    trace = _glm5_like_trace()
    tp8 = simulate(trace, policies=["vanilla", "oea"], k0s=[3], batch_sizes=[16], num_batches=4,
                   model_preset="glm-5", gpu="rtx-pro-6000", tp=8)
    assert all(r["latency_model"] == "glm-5 on rtx-pro-6000 tp=8 ep=1" for r in tp8)
    assert tp8[1]["mean_active_experts"] < tp8[0]["mean_active_experts"]
    assert tp8[1]["latency_ratio_vs_vanilla"] < 1
    ep8 = simulate(trace, policies=["vanilla", "oea", "ep-oea"], k0s=[3], batch_sizes=[8], num_batches=4,
                   model_preset="glm-5", gpu="rtx-pro-6000", ep=8, dp=2)
    by = {(r["policy"], r["union"]): r for r in ep8}
    assert all(r["latency_model"] == "glm-5 on rtx-pro-6000 tp=1 ep=8" for r in ep8)
    for union in ("local", "global"):
        plain, aware = by[("oea", union)], by[("ep-oea", union)]
        assert aware["mean_active_experts"] > plain["mean_active_experts"]
        assert aware["kept_mass"] > plain["kept_mass"]
        assert plain["max_device_active_experts"] < by[("vanilla", "local")]["max_device_active_experts"]
    # One union over the step: EP-aware OEA only uses idle EP ranks. Per-rank unions: each DP rank fills the same
    # idle EP ranks, and together they make one busier than plain OEA's busiest (why the plugins refuse it there).
    assert by[("ep-oea", "global")]["max_device_active_experts"] == by[("oea", "global")]["max_device_active_experts"]
    assert by[("ep-oea", "local")]["max_device_active_experts"] > by[("oea", "local")]["max_device_active_experts"]
