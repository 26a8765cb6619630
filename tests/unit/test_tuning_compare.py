"""Policy comparison at matched T and under EP on a synthetic trace."""

from __future__ import annotations

import torch

import oea
from oea.routing import AdaptiveK0Config
from oea.traces import Trace
from oea.tuning.compare import compare_policies, pareto_front, plot_comparison

torch.set_num_threads(1)


def skewed_trace(tokens: int = 200, n: int = 64) -> Trace:
    gen = torch.Generator().manual_seed(1)
    popularity = torch.linspace(2.0, 0.0, n)  # a realistic skew: some experts are popular
    logits = torch.randn(tokens, 2, n, generator=gen) * 1.5 + popularity
    return Trace(spec=oea.RouterSpec(n, 8), logits=logits, meta={"name": "skewed"})


def test_comparison_matches_T_and_ep_aware_oea_beats_plain_oea_per_busiest_device(tmp_path):
    rows = compare_policies(skewed_trace(), batch_size=16, k0s=(2, 4), ep=8, num_batches=6,
                            adaptive=AdaptiveK0Config(((64, 3),)))
    by = {(r.policy, r.setting): r for r in rows}
    vanilla = by[("vanilla", "-")]
    assert vanilla.proxy_loss == 0.0 and vanilla.mean_experts_per_token == 8.0
    for k0 in (2, 4):
        plain, ep_aware = by[("oea", f"k0={k0}")], by[("ep-oea", f"k0={k0}")]
        pruned = by[("pruned", f"k0={k0}")]
        assert plain.mean_active_experts == pruned.mean_active_experts < vanilla.mean_active_experts
        assert plain.proxy_loss < pruned.proxy_loss  # piggybacking recovers router mass
        assert ep_aware.max_device_active_experts == plain.max_device_active_experts
        assert ep_aware.proxy_loss <= plain.proxy_loss
        budget = next(r for r in rows if r.policy == "budget" and r.setting == f"T={round(plain.mean_active_experts)}")
        assert abs(budget.mean_active_experts - plain.mean_active_experts) <= 1.0  # matched T
    assert by[("adaptive", "k0=3")].proxy_loss > 0
    front = pareto_front(rows, "max_device_active_experts")
    assert all(r.policy != "pruned" for r in front)
    path = tmp_path / "cmp.png"
    plot_comparison(rows, str(path), ep=8)
    assert path.stat().st_size > 10_000
