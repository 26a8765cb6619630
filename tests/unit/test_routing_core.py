"""The vectorised routing core against the literal reference and the spec's invariants (CPU, fast)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import examples, with_boundaries

import oea
from oea.routing import router_scores

torch.set_num_threads(1)


def distinct_logits(m: int, n: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    """[m, n] logits without ties (a random permutation per row), so rankings are unambiguous."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(n, generator=gen) for _ in range(m)]).float()
    return ranks * scale + torch.rand(m, 1, generator=gen)


@st.composite
def routing_cases(draw: st.DrawFn, general: bool = False):
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    n = draw(st.sampled_from([4, 8, 16, 32, 64]))
    k = draw(st.integers(1, min(8, n)))
    m = draw(st.integers(1, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed + 1)
    spec_kwargs: dict = {"renormalize": draw(st.booleans())}
    if scoring == "sigmoid":
        if draw(st.booleans()):
            spec_kwargs["correction_bias"] = torch.randint(-8, 8, (n,), generator=gen).float() / 64
        groups = [g for g in (1, 2, 4, 8) if n % g == 0 and n // g >= 2]
        n_group = draw(st.sampled_from(groups))
        feasible = [t for t in range(1, n_group + 1) if t * (n // n_group) >= k]
        spec_kwargs.update(n_group=n_group, topk_group=draw(st.sampled_from(feasible)))
        spec_kwargs["routed_scaling_factor"] = draw(st.sampled_from([1.0, 2.5]))
    spec = oea.RouterSpec(n, k, scoring=scoring, **spec_kwargs)
    k0 = draw(st.integers(1, k))
    cfg_kwargs: dict = {"min_batch": draw(st.integers(0, 4)), "group_fill": draw(st.sampled_from(["in", "cross"]))}
    if general:
        cfg_kwargs["p"] = draw(st.sampled_from([1.0, 0.9, 0.5, 0.2]))
        cfg_kwargs["max_experts"] = draw(st.integers(k0, k))
        cfg_kwargs["max_rank"] = draw(st.integers(k0, n))
    cfg = oea.OEAConfig(k0, **cfg_kwargs)
    valid = None
    if draw(st.booleans()):
        valid = torch.rand(m, generator=gen) < 0.7
    return distinct_logits(m, n, seed), spec, cfg, valid


def as_sets(ids: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    """Per row: expert -> weight over non-zero-weight slots."""
    return [
        {int(e): float(w) for e, w in zip(row_ids, row_w, strict=True) if w != 0}
        for row_ids, row_w in zip(ids, weights, strict=True)
    ]


def reference_sets(logits, spec, cfg, valid) -> list[dict[int, float]]:
    ids, weights = oea.reference_route(logits, spec, cfg, valid)
    return [{e: w for e, w in zip(r, ws, strict=True) if w != 0} for r, ws in zip(ids, weights, strict=True)]


def assert_matches_reference(logits, spec, cfg, valid) -> None:
    ids, weights = oea.route(logits, spec, cfg, valid)
    got, want = as_sets(ids, weights), reference_sets(logits, spec, cfg, valid)
    for row, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), f"row {row}: {sorted(g)} != reference {sorted(w)}"
        for e in g:
            assert math.isclose(g[e], w[e], rel_tol=2e-5, abs_tol=1e-6), (row, e, g[e], w[e])


@with_boundaries(named=False)
@settings(max_examples=examples(150))
@given(routing_cases())
def test_simplified_oea_equals_reference(case):
    assert_matches_reference(*case)


@with_boundaries((oea.OEAConfig,), named=False)
@settings(max_examples=examples(150))
@given(routing_cases(general=True))
def test_general_oea_equals_reference(case):
    assert_matches_reference(*case)


@with_boundaries((oea.OEAConfig, oea.PrunedConfig), named=False)
@settings(max_examples=examples(60))
@given(routing_cases())
def test_vanilla_and_pruned_equal_reference(case):
    logits, spec, cfg, valid = case
    assert_matches_reference(logits, spec, None, valid)
    assert_matches_reference(logits, spec, oea.PrunedConfig(cfg.k0), valid)


@settings(max_examples=examples(60))
@given(routing_cases(), st.sampled_from([None, True, False]))
def test_pruned_renormalize_override_equals_reference(case, renormalize):
    logits, spec, cfg, valid = case
    assert_matches_reference(logits, spec, oea.PrunedConfig(cfg.k0, renormalize=renormalize), valid)


def test_pruned_without_renormalising_on_a_renormalising_router():
    spec = oea.RouterSpec(32, 8, renormalize=True)
    logits = distinct_logits(6, 32, seed=4)
    valid = torch.tensor([True, True, False, True, False, True])
    ids, w = oea.route(logits, spec, oea.PrunedConfig(3, renormalize=False), valid)
    probs = torch.softmax(logits, -1)
    top3 = probs.topk(3, dim=-1)
    for i in range(6):
        if valid[i]:  # raw probabilities of the own top-3, which sum to less than 1
            assert ids[i, :3].tolist() == top3.indices[i].tolist()
            torch.testing.assert_close(w[i, :3], top3.values[i])
            assert torch.equal(w[i, 3:], torch.zeros(5)) and float(w[i].sum()) < 0.99
        else:  # padding rows keep the router's own (renormalised) routing
            top8 = probs[i].topk(8)
            assert ids[i].tolist() == top8.indices.tolist()
            torch.testing.assert_close(w[i], top8.values / top8.values.sum())
    _, w_all = oea.route(logits, spec, oea.PrunedConfig(3, renormalize=False))
    torch.testing.assert_close(w_all[:, :3], top3.values)


@settings(max_examples=examples(60))
@given(routing_cases(), st.integers(0, 4), st.booleans())
def test_exactly_min_batch_real_rows_are_rerouted(case, min_batch, padded):
    """A batch of exactly ``min_batch`` real rows (with or without padding rows) is rerouted; one
    real row fewer keeps every row vanilla."""
    _, spec, cfg, _ = case
    n = spec.num_experts
    real = distinct_logits(max(min_batch, 1), n, seed=min_batch + n)
    pad = distinct_logits(3, n, seed=min_batch + n + 1)
    cfg = oea.OEAConfig(cfg.k0, min_batch=min_batch, group_fill=cfg.group_fill)
    for rows in (real[:min_batch], real[: max(min_batch - 1, 0)]):
        if rows.shape[0] == 0:
            continue
        batch, valid = rows, None
        if padded:
            batch = torch.cat([rows, pad])
            valid = torch.arange(batch.shape[0]) < rows.shape[0]
        assert_matches_reference(batch, spec, cfg, valid)
    if min_batch >= 1:  # exactly min_batch rows: routed as if there were no min_batch at all
        always = dataclasses.replace(cfg, min_batch=0)
        got, want = oea.route(real[:min_batch], spec, cfg), oea.route(real[:min_batch], spec, always)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@with_boundaries((oea.OEAConfig,), named=False)
@settings(max_examples=examples(150))
@given(routing_cases())
def test_output_contract(case):
    logits, spec, cfg, valid = case
    m, n, k = logits.shape[0], spec.num_experts, spec.top_k
    ids, weights = oea.route(logits, spec, cfg, valid)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (m, k)
    assert int(ids.min()) >= 0 and int(ids.max()) < n  # never a sentinel

    rows_valid = torch.ones(m, dtype=torch.bool) if valid is None else valid
    applied = int(rows_valid.sum()) >= cfg.min_batch
    vanilla_ids, vanilla_w = oea.route(logits, spec, None)
    scores = router_scores(logits, spec, cfg.group_fill)
    own_base = scores.select.sort(dim=-1, descending=True, stable=True).indices[:, :cfg.k0]  # ties: lower index
    s_base = {int(e) for i in range(m) if rows_valid[i] for e in own_base[i]}

    for i in range(m):
        chosen = [int(e) for e, w in zip(ids[i], weights[i], strict=True) if w != 0]
        assert len(chosen) == len(set(chosen)), f"row {i}: duplicate with non-zero weight"
        for slot in range(k):  # fillers repeat one of the row's own non-filler experts, weight exactly 0
            if weights[i, slot] == 0:
                assert int(ids[i, slot]) in chosen, f"row {i} slot {slot}: filler {int(ids[i, slot])} not in {chosen}"
        if not (applied and rows_valid[i]):
            assert chosen == [int(e) for e, w in zip(vanilla_ids[i], vanilla_w[i], strict=True) if w != 0]
            continue
        assert {int(e) for e in own_base[i]} <= set(chosen)  # baseline kept
        assert set(chosen) <= s_base  # no new experts
        reachable = {e for e in s_base if scores.fill[i, e] > float("-inf")}  # "in": own groups only
        assert len(chosen) == min(k, len(reachable))  # exact count (max_rank = N, p = 1)
        if spec.renormalize:
            assert math.isclose(float(weights[i].sum()), spec.routed_scaling_factor, rel_tol=1e-5)

    if applied:
        t_oea = int(oea.active_experts(ids, weights, rows_valid))
        assert t_oea == len(s_base)
        assert t_oea <= int(oea.active_experts(vanilla_ids, vanilla_w, rows_valid))


@with_boundaries((oea.OEAConfig,), named=False)
@settings(max_examples=examples(80))
@given(routing_cases())
def test_k0_equal_k_is_vanilla(case):
    logits, spec, cfg, valid = case
    ids, weights = oea.route(logits, spec, oea.OEAConfig(spec.top_k, group_fill=cfg.group_fill), valid)
    v_ids, v_weights = oea.route(logits, spec, None, valid)
    order, v_order = ids.argsort(-1), v_ids.argsort(-1)  # same set and weights; slot order may differ
    assert torch.equal(ids.gather(1, order), v_ids.gather(1, v_order))
    torch.testing.assert_close(weights.gather(1, order), v_weights.gather(1, v_order))


@with_boundaries(named=False)
@settings(max_examples=examples(60))
@given(routing_cases())
def test_padding_rows_never_grow_the_union(case):
    logits, spec, cfg, _ = case
    m = logits.shape[0]
    pad = distinct_logits(5, spec.num_experts, seed=m + 7)[:, torch.randperm(spec.num_experts)]
    valid = torch.cat([torch.ones(m, dtype=torch.bool), torch.zeros(5, dtype=torch.bool)])
    ids, w = oea.route(torch.cat([logits, pad]), spec, cfg, valid)
    ids_alone, w_alone = oea.route(logits, spec, cfg)
    assert int(oea.active_experts(ids, w, valid)) == int(oea.active_experts(ids_alone, w_alone))
    torch.testing.assert_close(w[:m], w_alone)
    v_ids, v_w = oea.route(pad, spec, None)  # padding rows keep vanilla routing
    assert torch.equal(ids[m:], v_ids)
    torch.testing.assert_close(w[m:], v_w)  # batch size may change SIMD tails by an ulp


def test_single_token_is_pruning():
    spec = oea.RouterSpec(64, 8)
    logits = distinct_logits(1, 64, seed=3)
    ids, w = oea.route(logits, spec, oea.OEAConfig(3, min_batch=1))
    p_ids, p_w = oea.route(logits, spec, oea.PrunedConfig(3))
    assert as_sets(ids, w) == as_sets(p_ids, p_w)
    assert int((w != 0).sum()) == 3


def test_min_batch_keeps_small_batches_vanilla():
    spec = oea.RouterSpec(32, 4)
    logits = distinct_logits(6, 32, seed=5)
    valid = torch.tensor([True, False, False, False, False, False])
    ids, w = oea.route(logits, spec, oea.OEAConfig(1, min_batch=2), valid)
    v_ids, v_w = oea.route(logits, spec, None)
    assert torch.equal(ids, v_ids) and torch.equal(w, v_w)
    ids2, _ = oea.route(logits[:1], spec, oea.OEAConfig(1, min_batch=2))
    assert torch.equal(ids2, v_ids[:1])
    valid[1] = True  # two valid rows reach min_batch: rerouted
    ids3, w3 = oea.route(logits, spec, oea.OEAConfig(1, min_batch=2), valid)
    assert int(oea.active_experts(ids3, w3, valid)) <= 2


def test_short_rows_fill_with_zero_weight_copies_of_own_expert():
    spec = oea.RouterSpec(16, 8)
    logits = distinct_logits(2, 16, seed=11)
    ids, w = oea.route(logits, spec, oea.OEAConfig(2))
    for i in range(2):
        real = [int(e) for e, x in zip(ids[i], w[i], strict=True) if x != 0]
        assert len(real) == int(oea.active_experts(ids, w))  # |S_base| < k: every row holds all of S_base
        fillers = [int(e) for e, x in zip(ids[i], w[i], strict=True) if x == 0]
        assert fillers and set(fillers) <= set(real)
        assert float(w[i].sum()) == pytest.approx(1.0)


def test_non_renormalising_router_keeps_raw_probabilities():
    spec = oea.RouterSpec(32, 8, renormalize=False)
    logits = distinct_logits(8, 32, seed=2)
    probs = torch.softmax(logits, -1)
    ids, w = oea.route(logits, spec, oea.OEAConfig(3))
    torch.testing.assert_close(w, probs.gather(1, ids) * (w != 0))


def test_weights_come_from_probabilities_not_logits_and_unbiased_sigmoid():
    bias = torch.linspace(-0.5, 0.5, 16)
    spec = oea.RouterSpec(16, 4, "sigmoid", renormalize=True, correction_bias=bias, routed_scaling_factor=2.5)
    logits = distinct_logits(3, 16, seed=9)
    ids, w = oea.route(logits, spec, oea.OEAConfig(2))
    s = torch.sigmoid(logits).gather(1, ids) * (w != 0)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * 2.5)


def test_grouped_phase1_uses_group_masked_biased_score():
    # Expert 0 has the best raw score but its group loses after the bias: vanilla must not pick it.
    n, k = 8, 2
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    spec = oea.RouterSpec(n, k, "sigmoid", correction_bias=bias, n_group=2, topk_group=1)
    logits = torch.tensor([[3.0, 0.1, 0.0, -1.0, 0.2, 0.3, 0.4, 0.5]])
    ids, _ = oea.route(logits, spec, None)
    assert set(ids[0].tolist()) == {6, 7}
    ids_oea, _ = oea.route(logits.repeat(3, 1), spec, oea.OEAConfig(1))
    assert all(set(r.tolist()) <= {4, 5, 6, 7} for r in ids_oea)


def test_cross_group_fill_may_use_other_groups():
    spec = oea.RouterSpec(8, 2, "sigmoid", n_group=2, topk_group=1)
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, -5.0, -5.0, -5.0, -5.0], [-5.0, -5.0, 0.0, 0.0, 5.0, 4.5, 0.0, 0.0]])
    ids_in, w_in = oea.route(logits, spec, oea.OEAConfig(1, group_fill="in"))
    ids_cross, w_cross = oea.route(logits, spec, oea.OEAConfig(1, group_fill="cross"))
    assert as_sets(ids_in, w_in)[0].keys() == {0}  # union {0, 4}: 4 is outside row 0's group
    assert as_sets(ids_cross, w_cross)[0].keys() == {0, 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype(dtype):
    spec = oea.RouterSpec(32, 4)
    logits = distinct_logits(4, 32, seed=1, scale=0.5).to(dtype)
    ids, w = oea.route(logits, spec, oea.OEAConfig(2))
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.allclose(w.sum(-1), torch.ones(4))


def test_non_finite_logits_contract():
    spec = oea.RouterSpec(8, 2)
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [nan, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # NaN behaves as -inf: never preferred
            [inf, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # +inf wins and takes all the weight
            [-inf] * 8,  # no finite logit: all-zero weights, not NaN
            [nan] * 8,
        ]
    )
    ids, w = oea.route(logits, spec, None)
    assert not torch.isnan(w).any()
    assert set(ids[0].tolist()) == {2, 1} and 0 not in ids[0].tolist()
    assert ids[1, 0] == 0 and w[1, 0] == pytest.approx(1.0) and w[1, 1] == 0
    assert torch.equal(w[2], torch.zeros(2)) and torch.equal(w[3], torch.zeros(2))
    ids_o, w_o = oea.route(logits, spec, oea.OEAConfig(1))
    assert not torch.isnan(w_o).any() and int(ids_o.min()) >= 0 and int(ids_o.max()) < 8
    sig = oea.RouterSpec(8, 2, "sigmoid")
    _, w_s = oea.route(logits, sig, oea.OEAConfig(1))
    assert not torch.isnan(w_s).any()


def test_active_experts_counts_distinct_nonzero_valid():
    ids = torch.tensor([[1, 2, 2], [3, 1, 1], [7, 7, 7]])
    w = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [1.0, 0.0, 0.0]])
    assert int(oea.active_experts(ids, w)) == 4
    assert int(oea.active_experts(ids, w, torch.tensor([True, True, False]))) == 3
    assert int(oea.active_experts(ids, torch.zeros_like(w))) == 0
    load = oea.expert_load(ids, w, 8)
    assert load.tolist() == [0, 2, 1, 1, 0, 0, 0, 1]
    assert oea.expert_load(ids, w, 8, torch.tensor([True, False, True])).tolist() == [0, 1, 1, 0, 0, 0, 0, 1]


def test_compiles_fullgraph_with_identical_results():
    torch._dynamo.reset()
    spec = oea.RouterSpec(64, 8, "sigmoid", correction_bias=torch.randn(64) * 0.1, n_group=8, topk_group=4)
    cfg = oea.OEAConfig(3)

    def step(logits: torch.Tensor, valid: torch.Tensor):
        ids, w = oea.route(logits, spec, cfg, valid)
        return ids, w, oea.active_experts(ids, w, valid)

    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):
        logits = distinct_logits(16, 64, seed)
        valid = torch.arange(16) < 13
        got, want = compiled(logits, valid), step(logits, valid)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: oea.RouterSpec(8, 9), "top_k must be <= num_experts, got top_k=9 and num_experts=8"),
        (lambda: oea.RouterSpec(10, 2, "sigmoid", n_group=4), "num_experts=10 and n_group=4"),
        (lambda: oea.RouterSpec(16, 2, "sigmoid", n_group=4, topk_group=5), "topk_group=5 and n_group=4"),
        (lambda: oea.RouterSpec(16, 2, scoring="relu"), "scoring must be one of ('softmax', 'sigmoid')"),
        (lambda: oea.RouterSpec(16, 2, correction_bias=torch.zeros(16)), "correction_bias is only used"),
        (lambda: oea.RouterSpec(16, 2, "sigmoid", correction_bias=torch.zeros(8)), "[num_experts]=[16]"),
        (lambda: oea.RouterSpec(16, 8, "sigmoid", n_group=8, topk_group=2), "topk_group groups must hold"),
        (lambda: oea.RouterSpec(0, 1), "num_experts must be an integer >= 1, got 0"),
        (lambda: oea.OEAConfig(0), "k0 must be an integer >= 1, got 0"),
        (lambda: oea.OEAConfig(3, max_experts=2), "max_experts=2 and k0=3"),
        (lambda: oea.OEAConfig(3, p=0.0), "p must be in (0, 1], got p=0.0"),
        (lambda: oea.OEAConfig(3, group_fill="any"), "group_fill must be one of ('in', 'cross')"),
    ],
)
def test_invalid_configuration_names_the_field(build, fragment):
    with pytest.raises(ValueError) as err:
        build()
    assert fragment in str(err.value)


def test_invalid_calls_name_the_field():
    spec = oea.RouterSpec(16, 4)
    with pytest.raises(ValueError, match=r"k0 must be in 1\.\.top_k, got k0=5 and top_k=4"):
        oea.route(torch.randn(2, 16), spec, oea.OEAConfig(5))
    with pytest.raises(ValueError, match=r"router_logits must have shape \[M, num_experts=16\], got \(2, 8\)"):
        oea.route(torch.randn(2, 8), spec)
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        oea.route(torch.randn(2, 16), spec, oea.OEAConfig(2), torch.ones(2))
    with pytest.raises(ValueError, match="max_rank must be <= num_experts, got max_rank=17"):
        oea.route(torch.randn(2, 16), spec, oea.OEAConfig(2, max_rank=17))
    with pytest.raises(ValueError, match="cfg must be None or one of"):
        oea.route(torch.randn(2, 16), spec, object())


def test_a_group_of_one_expert_is_refused_naming_the_field():
    """A group's score is the sum of its two best experts (DeepSeek-V3 / GLM), so groups need two experts:
    one expert per group is refused at construction, naming n_group, not routed wrongly."""
    with pytest.raises(ValueError, match=r"each group needs >= 2 experts .*num_experts=8 and n_group=8"):
        oea.RouterSpec(8, 2, "sigmoid", n_group=8, topk_group=4)
    pairs = oea.RouterSpec(8, 2, "sigmoid", n_group=4, topk_group=1)  # two per group: the smallest allowed
    ids, _ = oea.route(torch.tensor([[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 3.0, 3.0]]), pairs)
    # sigmoid group sums: (0, 1) 0.500 + 0.993, (2, 3) 0.982 + 0.500, (4, 5) 1.000, (6, 7) 0.953 + 0.953 = 1.905
    assert ids[0].tolist() == [6, 7], "the group with the best pair wins over the one with the best expert"
