"""``oea.integrations.sglang.fillers.distinct_fillers``: OEA's repeated filler ids become distinct ids that the
batch already runs, as SGLang's native MoE (which counts a row's experts with ``scatter_``) needs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from oea.integrations.sglang.fillers import distinct_fillers, distinct_fillers_on_host, earlier_mask
from oea.routing import OEAConfig, RouterSpec, route


def _scatter_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-expert token counts as SGLang's moe_forward_native computes them (a row's repeat counts once)."""
    cnts = ids.new_zeros((ids.shape[0], num_experts)).long()
    cnts.scatter_(1, ids.long(), 1)
    return cnts.sum(dim=0)


def test_oea_routing_with_distinct_fillers_counts_every_slot_and_adds_only_the_experts_a_row_lacks() -> None:
    torch.manual_seed(0)
    spec = RouterSpec(num_experts=128, top_k=8, scoring="softmax", renormalize=True)
    logits = torch.randn(2, 128)  # 2 tokens x k0 = 3: a union of at most 6, so each keeps fewer than 8 experts
    ids, weights = route(logits, spec, OEAConfig(3, min_batch=1))
    assert _scatter_counts(ids, 128).sum() < ids.numel(), "OEA's own fillers repeat ids (the case fixed here)"
    new_ids, new_weights = distinct_fillers(ids, weights, 8, 128)
    assert _scatter_counts(new_ids, 128).sum() == new_ids.numel()  # every slot counted: no slice shifts
    union = set(ids.unique().tolist())
    assert len(union) < 8  # a row cannot hold 8 distinct experts of the union: the lowest unused ids are shared
    spare = [e for e in range(128) if e not in union][: 8 - len(union)]
    assert set(new_ids.unique().tolist()) == union | set(spare)
    assert torch.equal(new_weights.sum(dim=1), weights.sum(dim=1))
    for row in range(2):  # each token's weighted experts are unchanged
        before = {(i, w) for i, w in zip(ids[row].tolist(), weights[row].tolist(), strict=True) if w}
        after = {(i, w) for i, w in zip(new_ids[row].tolist(), new_weights[row].tolist(), strict=True) if w}
        assert before == after


Fillers = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BOTH = pytest.mark.parametrize("fillers", [distinct_fillers, distinct_fillers_on_host], ids=["torch", "host"])


@BOTH
def test_repeats_take_experts_other_rows_run_before_unused_ones(fillers: Fillers) -> None:
    ids = torch.tensor([[4, 4, 4, 4], [4, 9, 2, 6]])
    weights = torch.tensor([[1.0, 0, 0, 0], [0.25] * 4])
    assert fillers(ids, weights, 4, 16)[0].tolist() == [[4, 2, 6, 9], [4, 9, 2, 6]]


@BOTH
def test_rows_without_repeats_and_appended_columns_are_kept_and_a_lone_row_takes_unused_experts(fillers: Fillers
                                                                                                ) -> None:
    ids = torch.tensor([[3, 1, 3, 3, 8], [0, 1, 2, 5, 8], [7, 7, 7, 7, 8]], dtype=torch.int32)
    weights = torch.tensor([[.5, .5, 0, 0, 1], [.25, .25, .25, .25, 1], [1, 0, 0, 0, 1]])
    new_ids, new_weights = fillers(ids, weights, 4, 8)
    assert new_ids.dtype == ids.dtype and new_weights.dtype == weights.dtype
    assert new_ids.tolist() == [[3, 1, 0, 2, 8], [0, 1, 2, 5, 8], [7, 0, 1, 2, 8]]
    assert torch.equal(new_weights, weights)
    alone = torch.tensor([[5, 5, 5, 5]])
    assert fillers(alone, torch.tensor([[1.0, 0, 0, 0]]), 4, 8)[0].tolist() == [[5, 0, 1, 2]]


def test_on_the_host_a_call_without_repeats_returns_its_own_tensors_and_never_writes_them() -> None:
    """The usual decode call (a union of at least k experts): nothing to rename, nothing copied; a call with repeats
    gets new tensors and its inputs stay as they were (SGLang's capture may still hold them)."""
    ids, weights = torch.tensor([[1, 2, 3], [2, 3, 4]], dtype=torch.int32), torch.rand(2, 3)
    assert all(a is b for a, b in zip(distinct_fillers_on_host(ids, weights, 3, 8), (ids, weights), strict=True))
    repeated, before = torch.tensor([[1, 1, 1]]), torch.tensor([[1.0, 0, 0]])
    new_ids, _ = distinct_fillers_on_host(repeated, before.clone(), 3, 8, earlier_mask(3, torch.device("cpu")).numpy())
    assert new_ids.tolist() == [[1, 0, 2]] and repeated.tolist() == [[1, 1, 1]]


def _literal_fillers(ids: torch.Tensor, weights: torch.Tensor, k: int, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of ``distinct_fillers`` row by row in Python (the oracle): a slot whose id an earlier slot of the
    row holds gets weight 0 and the row's next free candidate (experts other rows route to, ascending, then
    experts nobody routes to, ascending; ids clamped to 0..N for membership, N meaning none)."""
    rows = [[min(max(int(e), 0), num_experts) for e in row[:k]] for row in ids.tolist()]
    active = {e for row in rows for e in row if e < num_experts}
    order = sorted(active) + [e for e in range(num_experts) if e not in active]
    new_ids, new_weights = ids.clone(), weights.clone()
    for m, row in enumerate(ids.tolist()):
        free = iter(e for e in order if e not in set(rows[m]))
        for j in range(k):
            if row[j] in row[:j]:
                new_ids[m, j] = next(free)
                new_weights[m, j] = 0
    return new_ids, new_weights


@BOTH
def test_distinct_fillers_equal_the_literal_rule_on_random_calls(fillers: Fillers) -> None:
    gen = torch.Generator().manual_seed(3)
    for case in range(300):
        n = int(torch.randint(8, 160, (1,), generator=gen))
        k = int(torch.randint(2, min(n, 10) + 1, (1,), generator=gen))
        m, s = int(torch.randint(1, 24, (1,), generator=gen)), case % 3
        if case % 2:
            k0 = int(torch.randint(1, k + 1, (1,), generator=gen))
            ids, weights = route(torch.randn(m, n, generator=gen), RouterSpec(n, k, "softmax", True),
                                 OEAConfig(k0, min_batch=1))
        else:  # any ids, out-of-range ones included
            ids = torch.randint(-1, int(torch.randint(1, n + 2, (1,), generator=gen)), (m, k), generator=gen)
            weights = torch.rand(m, k, generator=gen)
        ids = torch.cat([ids.to(torch.int32), torch.full((m, s), 5, dtype=torch.int32)], dim=1)
        weights = torch.cat([weights.float(), torch.ones(m, s)], dim=1)
        got, expected = fillers(ids, weights, k, n), _literal_fillers(ids, weights, k, n)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (case, ids)
