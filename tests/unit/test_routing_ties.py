"""The ranking rule of the routing core: equal scores go to the lower expert index, on every path.

``torch.topk`` orders equal values as its implementation pleases (and differently on CPU and CUDA), so the
core ranks by ``oea.routing.ranking.rank_keys``; these tests pin the rule against the literal reference,
slot order included, on logits full of ties (bf16-like grids, repeated values, -0.0 and +0.0).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import examples, with_boundaries

import oea
from oea.routing.ranking import rank_keys, top_indices

torch.set_num_threads(1)


def test_rank_keys_order_by_value_then_lower_index():
    scores = torch.tensor([[0.5, -0.0, 2.0, 0.5, 0.0, float("-inf"), -3.0, 2.0]])
    order = top_indices(rank_keys(scores), 8)[0].tolist()
    assert order == [2, 7, 0, 3, 1, 4, 6, 5]  # -0.0 and +0.0 tie: index 1 before 4
    stable = scores.argsort(dim=-1, descending=True, stable=True)[0].tolist()
    assert order == stable


@st.composite
def tied_cases(draw: st.DrawFn):
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    n = draw(st.sampled_from([8, 16, 32, 64]))
    k = draw(st.integers(1, min(8, n)))
    m = draw(st.integers(1, 12))
    levels = draw(st.integers(1, 6))  # few distinct values: ties everywhere
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-levels, levels + 1, (m, n), generator=gen).float() / 2
    logits = torch.where(logits == 0, torch.where(torch.rand(m, n, generator=gen) < 0.5, -0.0, 0.0), logits)
    kwargs: dict = {"renormalize": draw(st.booleans())}
    if scoring == "sigmoid":
        groups = [g for g in (1, 2, 4) if n % g == 0 and n // g >= 2]
        n_group = draw(st.sampled_from(groups))
        kwargs.update(n_group=n_group, topk_group=draw(st.sampled_from(
            [t for t in range(1, n_group + 1) if t * (n // n_group) >= k])))
    spec = oea.RouterSpec(n, k, scoring=scoring, **kwargs)
    k0 = draw(st.integers(1, k))
    cfg = draw(st.sampled_from([
        None, oea.PrunedConfig(k0),
        oea.OEAConfig(k0, min_batch=0, group_fill=draw(st.sampled_from(["in", "cross"]))),
        oea.OEAConfig(k0, min_batch=0, max_experts=draw(st.integers(k0, k)), max_rank=draw(st.integers(k0, n))),
    ]))
    valid = (torch.rand(m, generator=gen) < 0.7) if draw(st.booleans()) else None
    return logits, spec, cfg, valid


@with_boundaries(named=False)
@settings(max_examples=examples(150))
@given(tied_cases())
def test_route_equals_the_reference_slot_by_slot_on_ties(case):
    """Same ids in the same slots as the literal scan, which breaks ties by a stable sort (lower index)."""
    logits, spec, cfg, valid = case
    ids, weights = oea.route(logits, spec, cfg, valid)
    ref_ids, ref_weights = oea.reference_route(logits, spec, cfg, valid)
    for row, (got, want, got_w, want_w) in enumerate(zip(ids.tolist(), ref_ids, weights.tolist(), ref_weights,
                                                          strict=True)):
        assert got[: len(want)] == want, f"row {row}: {got} != reference {want}"
        assert all(w == 0 and e == got[0] for e, w in zip(got[len(want):], got_w[len(want):], strict=True))
        torch.testing.assert_close(torch.tensor(got_w[: len(want)]), torch.tensor(want_w, dtype=torch.float32),
                                   rtol=2e-5, atol=1e-6)


def test_ties_do_not_depend_on_the_batch_or_the_device_order():
    """A tied row routes the same alone and inside a larger batch (topk's order would not promise this)."""
    spec = oea.RouterSpec(64, 8)
    row = torch.zeros(1, 64)
    row[0, [5, 9, 40, 63]] = 1.0
    alone, _ = oea.route(row, spec, None)
    batch, _ = oea.route(torch.cat([torch.randn(300, 64), row]), spec, None)
    assert alone[0].tolist() == batch[-1].tolist() == [5, 9, 40, 63, 0, 1, 2, 3]
