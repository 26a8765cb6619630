"""Beyond-the-paper policies: EP-aware OEA, budget and subtractive comparators, adaptive and per-layer k0."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from property_cases import examples

import oea
from oea.config import read_layer_k0_file, write_layer_k0_file
from oea.routing import (
    AdaptiveK0Config,
    BudgetConfig,
    EPOEAConfig,
    ExpertPlacement,
    LayerK0Schedule,
    SubtractiveConfig,
    make_policy,
    max_device_active_experts,
    router_scores,
)

torch.set_num_threads(1)


def chosen_sets(ids: torch.Tensor, weights: torch.Tensor) -> list[set[int]]:
    return [{int(e) for e, w in zip(r, ws, strict=True) if w != 0} for r, ws in zip(ids, weights, strict=True)]


@st.composite
def batches(draw: st.DrawFn):
    n = draw(st.sampled_from([16, 32, 64]))
    k = draw(st.sampled_from([2, 4, 8]))
    m = draw(st.integers(2, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    logits = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * draw(st.sampled_from([0.5, 2.0, 4.0]))
    return logits, oea.RouterSpec(n, k), draw(st.integers(1, k)), draw(st.sampled_from([2, 4, 8]))


def ep_reference(logits, spec, k0, placement, valid=None, boost_rank=None):
    """Literal EP-aware OEA: per-device slack filled by the most wanted new experts.

    Reads the placement only through ``device_of_expert`` (any expert -> device map); padding rows
    (``valid`` False) neither join the union nor add demand, and keep their own top-k. A token's
    demand covers its own ranks k0+1..``boost_rank`` (default top_k).
    """
    probs = torch.softmax(logits.double(), -1)
    m, n = probs.shape
    real = [True] * m if valid is None else valid.tolist()
    ranking = [sorted(range(n), key=lambda e, p=probs[i]: -float(p[e])) for i in range(m)]
    union = {e for i, r in enumerate(ranking) if real[i] for e in r[:k0]}
    device = placement.device_of_expert.tolist()
    counts = [sum(1 for e in union if device[e] == d) for d in range(placement.num_devices)]
    demand: dict[int, float] = {}
    for i, r in enumerate(ranking):
        for e in r[k0 : boost_rank or spec.top_k]:
            if real[i] and e not in union:
                demand[e] = demand.get(e, 0.0) + float(probs[i, e])
    enlarged = set(union)
    for d in range(placement.num_devices):
        mine = sorted((e for e in demand if device[e] == d), key=lambda e: -demand[e])
        enlarged.update(mine[: max(counts) - counts[d]])
    out = []
    for i, r in enumerate(ranking):
        if not real[i]:
            out.append(set(r[: spec.top_k]))
            continue
        chosen = r[:k0]
        chosen += [e for e in r[k0:] if e in enlarged][: spec.top_k - k0]
        out.append(set(chosen))
    return out, max(counts)


@st.composite
def placements(draw: st.DrawFn, num_experts: int) -> ExpertPlacement:
    """Non-contiguous, possibly uneven placements: a random expert -> device map, every device used."""
    num_devices = draw(st.sampled_from([2, 3, 4, 8]))
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))))
    device = torch.zeros(num_experts, dtype=torch.int64)
    cuts = sorted(draw(st.lists(st.integers(1, num_experts - 1), min_size=num_devices - 1,
                                max_size=num_devices - 1, unique=True)))
    for d, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, num_experts], strict=True)):
        device[order[lo:hi]] = d
    if draw(st.booleans()):  # the same map built the EPLB way, from each device's expert list
        return ExpertPlacement.from_devices([torch.nonzero(device == d).flatten().tolist()
                                             for d in range(num_devices)], num_experts)
    return ExpertPlacement(device, num_devices)


def _permuted(m: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=gen) for _ in range(m)]).float() / 4


@settings(max_examples=examples(60))
@given(batches())
@example((_permuted(12, 32, 1), oea.RouterSpec(32, 4), 1, 4))  # k0 = 1
@example((_permuted(12, 32, 2), oea.RouterSpec(32, 4), 4, 8))  # k0 = k: nothing to fill
@example((torch.zeros(6, 16), oea.RouterSpec(16, 4), 2, 2))  # every logit tied
@example((_permuted(3, 16, 3), oea.RouterSpec(16, 4), 1, 16))  # one expert per device
def test_ep_aware_oea_matches_literal_version_and_never_slows_the_busiest_device(case):
    logits, spec, k0, ep = case
    placement = ExpertPlacement.contiguous(spec.num_experts, ep)
    ids, w = oea.route(logits, spec, EPOEAConfig(k0, placement, min_batch=0))
    want, busiest = ep_reference(logits, spec, k0, placement)
    assert chosen_sets(ids, w) == want
    plain_ids, plain_w = oea.route(logits, spec, oea.OEAConfig(k0, min_batch=0))
    assert int(max_device_active_experts(ids, w, placement)) == busiest
    assert busiest == int(max_device_active_experts(plain_ids, plain_w, placement))
    probs = torch.softmax(logits, -1)
    mass = (probs.gather(1, ids) * (w != 0)).sum(-1)
    plain_mass = (probs.gather(1, plain_ids) * (plain_w != 0)).sum(-1)
    assert bool((mass >= plain_mass - 1e-6).all())  # every token keeps at least plain OEA's router mass


@settings(max_examples=examples(60))
@given(batches(), st.data())
def test_ep_aware_oea_follows_a_non_contiguous_placement(case, data):
    logits, spec, k0, _ = case
    placement = data.draw(placements(spec.num_experts))
    m = logits.shape[0]
    valid = None
    if data.draw(st.booleans()):  # several padding rows, at least one real row
        valid = torch.arange(m) % 3 != 2
    boost_rank = data.draw(st.sampled_from([None, spec.top_k, min(2 * spec.top_k, spec.num_experts)]))
    ids, w = oea.route(logits, spec, EPOEAConfig(k0, placement, boost_rank=boost_rank, min_batch=0), valid)
    want, busiest = ep_reference(logits, spec, k0, placement, valid, boost_rank)
    assert chosen_sets(ids, w) == want
    assert int(max_device_active_experts(ids, w, placement, valid)) == busiest


def _comparator_routing(case, config, size):
    """A comparator of ``size`` experts (capped at the router's) routes the case: its logits, spec, size, routing."""
    logits, spec, _, _ = case
    size = min(size, spec.num_experts)
    ids, w = oea.route(logits, spec, config(size, min_batch=0))
    return logits, spec, size, ids, w


@settings(max_examples=examples(60))
@given(batches(), st.integers(1, 64))
def test_budget_comparator(case, budget):
    logits, spec, budget, ids, w = _comparator_routing(case, BudgetConfig, budget)
    probs = torch.softmax(logits, -1)
    v_ids = probs.topk(spec.top_k).indices
    mass = torch.zeros(spec.num_experts).scatter_add(0, v_ids.reshape(-1), probs.gather(1, v_ids).reshape(-1))
    allowed = set(mass.topk(budget).indices.tolist()) & {e for e in range(spec.num_experts) if mass[e] > 0}
    assert int(oea.active_experts(ids, w)) <= budget
    for i, chosen in enumerate(chosen_sets(ids, w)):
        inside = sorted(allowed, key=lambda e, i=i: -float(probs[i, e]))[: spec.top_k]
        assert chosen == set(inside)


@settings(max_examples=examples(60))
@given(batches(), st.integers(1, 64))
def test_subtractive_comparator(case, target):
    logits, spec, target, ids, w = _comparator_routing(case, SubtractiveConfig, target)
    v_ids, v_w = oea.route(logits, spec, None)
    vanilla_union = set(v_ids.reshape(-1).tolist())
    t = int(oea.active_experts(ids, w))
    assert t <= min(target, len(vanilla_union))
    assert set().union(*chosen_sets(ids, w)) <= vanilla_union
    if target >= len(vanilla_union):
        assert chosen_sets(ids, w) == chosen_sets(v_ids, v_w)


POLICIES = {
    "oea": lambda k0, size, spec, ep: oea.OEAConfig(k0, min_batch=0),
    "pruned": lambda k0, size, spec, ep: oea.PrunedConfig(k0),
    "budget": lambda k0, size, spec, ep: BudgetConfig(size, min_batch=0),
    "subtractive": lambda k0, size, spec, ep: SubtractiveConfig(size, min_batch=0),
    "ep-oea": lambda k0, size, spec, ep: EPOEAConfig(k0, ExpertPlacement.contiguous(spec.num_experts, ep),
                                                      min_batch=0),
    "adaptive": lambda k0, size, spec, ep: AdaptiveK0Config(((64, k0),), min_batch=0),  # k0 fixed: M differs
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=examples(15))
@given(batches(), st.integers(1, 16), st.data())
def test_padding_rows_never_change_the_real_rows(policy, case, size, data):
    """Every batch-aware policy: real rows routed next to padding rows exactly as if alone; padding rows
    keep their own top-k."""
    logits, spec, k0, ep = case
    cfg = POLICIES[policy](k0, min(size, spec.num_experts), spec, ep)
    pad = torch.randn(data.draw(st.integers(1, 4)), spec.num_experts) * 3
    valid = torch.cat([torch.ones(len(logits), dtype=torch.bool), torch.zeros(len(pad), dtype=torch.bool)])
    ids, w = oea.route(torch.cat([logits, pad]), spec, cfg, valid)
    alone_ids, alone_w = oea.route(logits, spec, cfg)
    assert chosen_sets(ids[: len(logits)], w[: len(logits)]) == chosen_sets(alone_ids, alone_w)
    torch.testing.assert_close(w[: len(logits)], alone_w)
    assert chosen_sets(ids[len(logits):], w[len(logits):]) == chosen_sets(*oea.route(pad, spec))


def test_subtractive_drops_the_least_used_expert():
    spec = oea.RouterSpec(4, 1)
    # usage: expert 0 twice, experts 1 and 2 once each; expert 1 carries more mass, so 2 is dropped
    logits = torch.tensor([[5.0, 0, 0, 0], [5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0.5, 5.0, 1.0]])
    ids, w = oea.route(logits, spec, SubtractiveConfig(2, min_batch=0))
    assert chosen_sets(ids, w) == [{0}, {0}, {1}, {1}]
    assert int(oea.active_experts(ids, w)) == 2


def test_adaptive_k0_uses_the_schedule_for_the_batch_size():
    spec = oea.RouterSpec(64, 8)
    cfg = AdaptiveK0Config(((1, 8), (8, 5), (32, 3)))
    assert [cfg.k0_for(b) for b in (1, 2, 8, 9, 32, 64)] == [8, 5, 5, 3, 3, 3]
    gen = torch.Generator().manual_seed(0)
    for m, k0 in ((4, 5), (16, 3), (64, 3)):
        logits = torch.randn(m, 64, generator=gen) * 2
        got = oea.route(logits, spec, cfg)
        want = oea.route(logits, spec, oea.OEAConfig(k0))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    capped = AdaptiveK0Config(((64, 2),), max_experts=3, group_fill="cross", min_batch=5)  # OEAConfig's options
    logits = torch.randn(6, 64, generator=gen) * 2
    got = oea.route(logits, spec, capped)
    want = oea.route(logits, spec, oea.OEAConfig(2, max_experts=3, group_fill="cross", min_batch=5))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int((got[1] != 0).sum(1).max()) == 3
    assert torch.equal(oea.route(logits[:4], spec, capped)[0], oea.route(logits[:4], spec)[0])  # below min_batch
    with pytest.raises(ValueError, match="increasing"):
        AdaptiveK0Config(((8, 3), (4, 5)))
    with pytest.raises(ValueError, match=r"k0 must be in 1\.\.top_k"):
        oea.route(torch.randn(2, 64), spec, AdaptiveK0Config(((4, 9),)))


def test_placement_validation_names_the_experts():
    with pytest.raises(ValueError, match=r"missing experts \[3\]"):
        ExpertPlacement.from_devices([[0, 1], [2]], num_experts=4)
    with pytest.raises(ValueError, match=r"experts \[1\] are replicated"):
        ExpertPlacement.from_devices([[0, 1], [1, 2, 3]], num_experts=4)
    placement = ExpertPlacement.from_devices([[0, 1], [1, 2, 3]], num_experts=4, replica_map={1: 1})
    assert placement.device_of_expert.tolist() == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="ep must divide num_experts"):
        ExpertPlacement.contiguous(10, 4)
    with pytest.raises(ValueError, match="placement covers 8 experts but the router has num_experts=16"):
        oea.route(torch.randn(2, 16), oea.RouterSpec(16, 4), EPOEAConfig(2, ExpertPlacement.contiguous(8, 2)))


def test_layer_k0_schedule_round_trip_and_mismatch(tmp_path):
    schedule = LayerK0Schedule(num_experts=128, top_k=8, num_layers=3, k0=(3, 5, 4), model="embedded",
                               calibration={"proxy": "kept_mass", "tolerance": 0.02})
    path = tmp_path / "k0.json"
    write_layer_k0_file(schedule, path)
    loaded = read_layer_k0_file(path)
    assert loaded == schedule
    assert loaded.config_for_layer(1) == oea.OEAConfig(5)
    assert [loaded.index_of_layer_id(i) for i in (-1, 0, 2, 3)] == [None, 0, 2, None]  # engine layer ids
    offset = LayerK0Schedule(num_experts=128, top_k=8, num_layers=2, k0=(3, 5), layer_ids=(3, 7))  # dense 0..2
    assert [offset.index_of_layer_id(i) for i in (0, 3, 5, 7)] == [None, 0, None, 1]
    loaded.check_model(128, 8, 3)
    with pytest.raises(ValueError, match="num_experts: file has 128, model has 64; num_layers: file has 3"):
        loaded.check_model(64, 8, 48)
    with pytest.raises(ValueError, match=r"k0 values must be in 1..top_k=8, got \(layer, k0\) \[\(1, 9\)\]"):
        LayerK0Schedule(num_experts=128, top_k=8, num_layers=2, k0=(3, 9))
    with pytest.raises(FileNotFoundError, match="per-layer k0 file not found"):
        read_layer_k0_file(tmp_path / "absent.json")


def test_catalog_builds_every_policy():
    assert make_policy("vanilla") is None
    assert make_policy("ep-oea", 3, ep=4, num_experts=64).placement.num_devices == 4
    assert make_policy("budget", budget=20) == BudgetConfig(20)
    assert make_policy("subtractive", target=20) == SubtractiveConfig(20)
    assert make_policy("adaptive", schedule=[[4, 6], [64, 3]]).k0_for(16) == 3
    with pytest.raises(ValueError, match="needs the option budget"):
        make_policy("budget")
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("lynx")


@pytest.mark.parametrize(("config", "name"), [(BudgetConfig, "budget"), (SubtractiveConfig, "target")])
def test_the_comparators_expert_count_is_checked_under_its_own_name(config: type, name: str) -> None:
    assert config(5).expert_count == 5
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"^{name} must be an integer >= 1, got {bad!r}$"):
            config(bad)
    with pytest.raises(ValueError, match=rf"^{name} must be <= num_experts, got {name}=9 and num_experts=8$"):
        oea.route(torch.randn(4, 8), oea.RouterSpec(8, 2), config(9, min_batch=0))


def test_beyond_policies_compile_fullgraph():
    torch._dynamo.reset()
    spec = oea.RouterSpec(64, 8)
    placement = ExpertPlacement.contiguous(64, 8)
    logits = torch.randn(16, 64) * 2
    valid = torch.arange(16) < 14
    for cfg in (EPOEAConfig(3, placement), BudgetConfig(24), SubtractiveConfig(24), AdaptiveK0Config(((64, 3),))):
        fn = torch.compile(lambda x, v, cfg=cfg: oea.route(x, spec, cfg, v), fullgraph=True)
        got, want = fn(logits, valid), oea.route(logits, spec, cfg, valid)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_grouped_scores_feed_the_comparators():
    spec = oea.RouterSpec(16, 2, "sigmoid", n_group=4, topk_group=1)
    logits = torch.randn(6, 16)
    scores = router_scores(logits, spec)
    ids, w = oea.route(logits, spec, BudgetConfig(4, min_batch=0))
    for i, chosen in enumerate(chosen_sets(ids, w)):
        assert all(scores.select[i, e] > float("-inf") for e in chosen)  # never outside the token's groups
