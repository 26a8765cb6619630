"""The XShare-like budget comparator's per-token floor (issue 38 item 4): ``BudgetConfig(budget, floor=f)``.

XShare (vllm-project/vllm#35551) keeps, for every row, the batch-wide budget set plus the row's own top-f
experts (``top_per_token``); the floor is never cut and does not count against the budget. The fast policy
(``oea.routing.comparators.budget_policy``) is checked against the literal per-token loop
(``oea.routing.reference.reference_budget_route``) and against the rule's consequences directly.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from property_cases import examples

import oea
from oea.routing import BudgetConfig, make_policy, policy_options, router_scores
from oea.routing.reference import reference_budget_route
from oea.sim.cli import parse_policy_options

torch.set_num_threads(1)


def chosen_sets(ids: torch.Tensor, weights: torch.Tensor) -> list[set[int]]:
    return [{int(e) for e, w in zip(r, ws, strict=True) if w != 0} for r, ws in zip(ids, weights, strict=True)]


def batch_mass(logits: torch.Tensor, spec: oea.RouterSpec, valid: torch.Tensor | None,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[N]: the weight the real rows give each expert of their own top-k (the budget's ranking), in ``dtype``."""
    scores = router_scores(logits, spec)
    top = scores.select.double().topk(spec.top_k, dim=-1).indices
    mass = scores.weight.to(dtype).gather(1, top)
    if valid is not None:
        mass = mass * valid[:, None]
    return torch.zeros(spec.num_experts, dtype=dtype).scatter_add(0, top.reshape(-1), mass.reshape(-1))


def clear_cut(logits: torch.Tensor, spec: oea.RouterSpec, valid: torch.Tensor | None, budget: int) -> bool:
    """The budget's last expert and the next one differ by more than float32 rounding, or tie exactly in both
    precisions (else the float32 policy and the float64 loop may buy different experts: a tie in one precision
    only, outside what ``reference_route``'s comparison covers too)."""
    mass = batch_mass(logits, spec, valid)
    order = sorted(range(len(mass)), key=lambda e: -float(mass[e]))
    if budget >= len(order) or mass[order[budget]] == 0:
        return True
    last, after = order[budget - 1], order[budget]
    if mass[last] == mass[after]:
        single = batch_mass(logits, spec, valid, torch.float32)
        return bool(single[last] == single[after])
    return bool(mass[last] - mass[after] > 1e-5 * (1 + mass[order[0]]))


@st.composite
def floor_cases(draw: st.DrawFn):
    """(logits [M, N], spec, BudgetConfig with a floor, valid [M] or None): softmax and grouped-sigmoid routers."""
    n = draw(st.sampled_from([8, 16, 32, 64]))
    k = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k <= n]))
    m = draw(st.integers(1, 24))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(m, n, generator=gen) * draw(st.sampled_from([0.5, 2.0, 4.0]))
    if draw(st.booleans()):
        spec = oea.RouterSpec(n, k, renormalize=draw(st.booleans()))
    else:
        groups = draw(st.sampled_from([g for g in (1, 2, 4) if n // g >= 2 and k <= (n // g) * g]))
        spec = oea.RouterSpec(n, k, "sigmoid", correction_bias=torch.randn(n, generator=gen) * 0.1, n_group=groups,
                              topk_group=draw(st.integers(max(1, -(-k // (n // groups))), groups)),
                              routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))
    cfg = BudgetConfig(draw(st.integers(1, n)), min_batch=draw(st.sampled_from([0, 2, 5])),
                       floor=draw(st.integers(0, k)))
    valid = None
    if draw(st.booleans()):
        valid = torch.tensor(draw(st.lists(st.booleans(), min_size=m, max_size=m)))
    return logits, spec, cfg, valid


def assert_matches_reference(logits, spec, cfg, valid) -> None:
    ids, weights = oea.route(logits, spec, cfg, valid)
    want_ids, want_weights = reference_budget_route(logits, spec, cfg, valid)
    for row, (r, ws, wr, ww) in enumerate(zip(ids.tolist(), weights.tolist(), want_ids, want_weights, strict=True)):
        got = {e: w for e, w in zip(r, ws, strict=True) if w != 0}
        want = {e: w for e, w in zip(wr, ww, strict=True) if w != 0}
        assert set(got) == set(want), f"row {row}: {sorted(got)} != reference {sorted(want)}"
        for e in got:
            assert math.isclose(got[e], want[e], rel_tol=2e-5, abs_tol=1e-6), (row, e, got[e], want[e])


TIES = (torch.zeros(6, 16), oea.RouterSpec(16, 4), BudgetConfig(2, min_batch=0, floor=1), None)  # every score equal
PADDED = (torch.randn(7, 32, generator=torch.Generator().manual_seed(3)) * 2, oea.RouterSpec(32, 8),
          BudgetConfig(5, floor=3), torch.tensor([True, False, True, True, False, True, True]))


@example(TIES)
@example(PADDED)
@settings(max_examples=examples(120))
@given(floor_cases())
def test_the_floor_policy_equals_the_literal_loop(case):
    logits, spec, cfg, valid = case
    assume(clear_cut(logits, spec, valid, cfg.budget))
    assert_matches_reference(logits, spec, cfg, valid)


@settings(max_examples=examples(80))
@given(floor_cases())
def test_the_floor_is_kept_and_the_budget_holds_where_the_floor_allows(case):
    """Every real row keeps its own top-``floor``; every expert used is bought by the budget or is a floor expert
    of a row that uses it, so T <= budget + (floor experts outside the budget set)."""
    logits, spec, cfg, valid = case
    cfg = BudgetConfig(cfg.budget, min_batch=0, floor=cfg.floor)
    real = torch.ones(len(logits), dtype=torch.bool) if valid is None else valid
    assume(bool(real.any()))
    scores = router_scores(logits, spec)
    ids, weights = oea.route(logits, spec, cfg, valid)
    own = [[e for e in scores.select[i].double().argsort(descending=True, stable=True).tolist()
            if scores.select[i, e] > float("-inf")] for i in range(len(logits))]
    mass = batch_mass(logits, spec, valid)
    order = sorted(range(spec.num_experts), key=lambda e: -float(mass[e]))
    bought = {e for e in order[: cfg.budget] if mass[e] > 0}
    floors: set[int] = set()
    for i, chosen in enumerate(chosen_sets(ids, weights)):
        if not real[i]:
            continue
        assert set(own[i][: cfg.floor]) <= chosen, f"row {i} lost a floor expert"
        assert chosen <= bought | set(own[i][: cfg.floor]), f"row {i} uses another row's floor expert"
        floors |= set(own[i][: cfg.floor])
    if clear_cut(logits, spec, valid, cfg.budget):
        assert int(oea.active_experts(ids, weights, valid)) <= cfg.budget + len(floors - bought)
    if cfg.floor == 0:
        assert int(oea.active_experts(ids, weights, valid)) <= cfg.budget


@settings(max_examples=examples(60))
@given(floor_cases())
def test_floor_zero_is_the_budget_alone(case):
    """``floor=0`` (XShare's published default) routes exactly as the budget-only comparator did: every real
    row takes its best k inside the budget set, nothing else."""
    logits, spec, cfg, valid = case
    budget_only = BudgetConfig(cfg.budget, min_batch=cfg.min_batch)
    assert budget_only.floor == 0
    got = oea.route(logits, spec, BudgetConfig(cfg.budget, min_batch=cfg.min_batch, floor=0), valid)
    assert all(torch.equal(a, b) for a, b in zip(got, oea.route(logits, spec, budget_only, valid), strict=True))
    assume(clear_cut(logits, spec, valid, cfg.budget))
    mass = batch_mass(logits, spec, valid)
    real = torch.ones(len(logits), dtype=torch.bool) if valid is None else valid
    if int(real.sum()) < cfg.min_batch:
        return
    order = sorted(range(spec.num_experts), key=lambda e: -float(mass[e]))
    bought = {e for e in order[: cfg.budget] if mass[e] > 0}
    scores = router_scores(logits, spec)
    for i, chosen in enumerate(chosen_sets(*got)):
        if real[i]:
            ranked = [e for e in scores.select[i].double().argsort(descending=True, stable=True).tolist()
                      if e in bought and scores.select[i, e] > float("-inf")]
            assert chosen == set(ranked[: spec.top_k]), f"row {i}"


def test_a_floor_is_per_token_and_not_cut_by_the_budget():
    """Budget 1 buys expert 2 (the most demand); token 0's own best is 0, token 1's is 1, and each would take the
    other's as its second choice: with XShare's floor each keeps its own best, never the other's."""
    spec = oea.RouterSpec(6, 3)
    logits = torch.tensor([[9.0, 8.8, 8.5, 0, 0, 0], [8.8, 9.0, 8.5, 0, 0, 0], [0, 0, 9.0, 0, 8.8, 8.5]])
    ids, weights = oea.route(logits, spec, BudgetConfig(1, min_batch=0))
    assert chosen_sets(ids, weights) == [{2}, {2}, {2}]  # the budget alone
    ids, weights = oea.route(logits, spec, BudgetConfig(1, min_batch=0, floor=1))
    assert chosen_sets(ids, weights) == [{0, 2}, {1, 2}, {2}]  # expert 1 is token 1's floor, not token 0's
    assert int(oea.active_experts(ids, weights)) == 3  # budget 1 + two floor experts outside it
    ids, weights = oea.route(logits, spec, BudgetConfig(1, min_batch=0, floor=2))
    assert chosen_sets(ids, weights) == [{0, 1, 2}, {0, 1, 2}, {2, 4}]
    ids, weights = oea.route(logits, spec, BudgetConfig(1, min_batch=4, floor=1))  # below min_batch: vanilla
    assert chosen_sets(ids, weights) == chosen_sets(*oea.route(logits, spec))


def test_padding_rows_add_no_floor_and_no_demand():
    spec = oea.RouterSpec(16, 4)
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)) * 3
    pad = torch.full((2, 16), -5.0)
    pad[:, 15] = 9.0  # the padding rows want expert 15 above all
    valid = torch.tensor([True] * 5 + [False] * 2)
    cfg = BudgetConfig(3, min_batch=0, floor=2)
    ids, weights = oea.route(torch.cat([logits, pad]), spec, cfg, valid)
    alone = oea.route(logits, spec, cfg)
    assert chosen_sets(ids[:5], weights[:5]) == chosen_sets(*alone)
    torch.testing.assert_close(weights[:5], alone[1])
    assert chosen_sets(ids[5:], weights[5:]) == chosen_sets(*oea.route(pad, spec))


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_a_bad_floor_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=rf"^floor must be an integer in 0\.\.top_k, got {bad!r}$"):
        BudgetConfig(8, floor=bad)


def test_a_floor_above_top_k_is_refused_against_the_router():
    with pytest.raises(ValueError, match=r"^floor must be in 0\.\.top_k=4 \(the router's top_k\), got floor=5$"):
        oea.route(torch.randn(3, 16), oea.RouterSpec(16, 4), BudgetConfig(8, min_batch=0, floor=5))
    ids, weights = oea.route(torch.randn(3, 16), oea.RouterSpec(16, 4), BudgetConfig(1, min_batch=0, floor=4))
    assert all(len(s) == 4 for s in chosen_sets(ids, weights))  # floor = k: each token its own top-k


def test_the_floor_is_an_option_by_name():
    assert policy_options("budget") == ("budget", "min_batch", "floor")
    assert make_policy("budget", budget=20, floor=2) == BudgetConfig(20, floor=2)
    assert make_policy("budget", budget=20) == BudgetConfig(20, floor=0)
    assert parse_policy_options(["budget:budget=40", "budget:floor=2"]) == {"budget": {"budget": 40, "floor": 2}}
    with pytest.raises(ValueError, match=r"floor must be an integer in 0\.\.top_k, got -1"):
        make_policy("budget", **parse_policy_options(["budget:budget=40", "budget:floor=-1"])["budget"])


def test_the_floor_compiles_fullgraph():
    torch._dynamo.reset()
    spec = oea.RouterSpec(64, 8)
    logits = torch.randn(16, 64) * 2
    valid = torch.arange(16) < 14
    cfg = BudgetConfig(12, floor=2)
    fn = torch.compile(lambda x, v: oea.route(x, spec, cfg, v), fullgraph=True)
    got, want = fn(logits, valid), oea.route(logits, spec, cfg, valid)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_matched_t_finds_the_floor_budget_whose_t_is_nearest_oea(monkeypatch):
    """``oea compare-quality matched-t``: floor 0 gets OEA's rounded T as its budget; a floor f < k0 gets the
    budget whose measured T is nearest OEA's, found by bisection (here T = b + 3 f - 0.4 stands in for a model)."""
    import oea.eval
    from oea.tuning.quality import matched_t_quality

    oea_t = {2: 21.1, 3: 28.7}
    calls: list[object] = []

    def fake_evaluate(model, *, batch_sizes, k0s, policies, extra_policies=(), **options):
        row = {"batch_size": batch_sizes[0], "delta_ce": 0.0}
        rows = [dict(row, policy="vanilla", k0=None, mean_active_experts=53.0)]
        rows += [dict(row, policy=p, k0=k0, mean_active_experts=oea_t[k0]) for p in policies if p != "vanilla"
                 for k0 in k0s]
        for label, cfg in extra_policies:
            calls.append(cfg)
            t = cfg.expert_count + 3 * cfg.floor - 0.4 if isinstance(cfg, BudgetConfig) else cfg.expert_count
            rows.append(dict(row, policy=label, k0=None, mean_active_experts=t))
        return rows

    monkeypatch.setattr(oea.eval, "evaluate", fake_evaluate)
    rows = matched_t_quality(None, 16, (2, 3), floors=(0, 1, 2))
    got = {(r["policy"], r.get("target_T")): (r.get("budget"), r.get("floor"), r["mean_active_experts"])
           for r in rows if r.get("target_T") is not None}
    assert got[("budget", 21)] == (21, 0, 20.6) and got[("budget", 29)] == (29, 0, 28.6)
    assert got[("budget floor=1", 21)] == (18, 1, 20.6)  # 20.6 and 21.6 are equally near 21.1: the smaller budget
    assert got[("budget floor=1", 29)] == (26, 1, 28.6)
    assert got[("budget floor=2", 29)] == (23, 2, 28.6)
    assert ("budget floor=2", 21) not in got  # floor 2 = k0 2: the floors alone are OEA's union
    assert {r["policy"] for r in rows} == {"vanilla", "pruned", "oea", "budget", "subtractive", "budget floor=1",
                                           "budget floor=2"}
    assert len([c for c in calls if isinstance(c, BudgetConfig) and c.floor]) <= 3 * 6  # bisection, not a sweep
    with pytest.raises(ValueError, match=r"floors must be integers >= 0, got \[0, -1\]"):
        matched_t_quality(None, 16, (3,), floors=(0, -1))


@pytest.mark.parametrize(("argv", "fragment"), [
    (["compare-quality", "matched-t", "--floors", "-1"], "argument --floors: must be an integer >= 0, got '-1'"),
    (["compare-quality", "matched-t", "--floors", "1", "1"], "--floors lists ['1'] more than once"),
])
def test_bad_floors_exit_2_naming_the_flag(argv, fragment, capsys):
    from oea.cli import build_parser, main

    assert build_parser().parse_args(["compare-quality", "matched-t"]).floors == [0, 1, 2]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert fragment in err and "Traceback" not in err and out == ""
