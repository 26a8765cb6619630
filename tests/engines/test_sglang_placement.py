"""``OEA_POLICY=ep`` through SGLang's real ``select_experts`` and ``ExpertLocationMetadata`` (sglang 0.5.23, CPU):
a GLM-5-like router at TP = 8 with EP = 8 (the SGLang side: ``sglang_cpu_placement.py`` in .venv-sglang)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sglang_venv import check, run_script_json

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "sglang_cpu_placement.py"


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    proc, out = run_script_json(SCRIPT, [])
    assert proc.returncode == 0 and out is not None, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("layer", [0, 1])
def test_glm5_ep8_decode_routes_with_sglangs_placement(report: dict[str, Any], layer: int) -> None:
    """Layer 0: the trivial layout with 8 redundant slots (static dispatch of rank 0); layer 1: a permutation."""
    for name in ("decode_equals_ep_route", "placement_read", "busiest_not_raised", "extend_untouched"):
        assert check(report, f"{name}:layer{layer}")["ok"], check(report, f"{name}:layer{layer}")
    figures = report["figures"][f"glm5_layer{layer}"]
    assert figures["ep"] == figures["plain"] and figures["T_ep"] > figures["T_plain"], figures
    assert "256 experts on 8 EP devices" in check(report, f"placement_read:layer{layer}")["detail"]


def test_a_map_missing_experts_keeps_plain_oea_and_names_them(report: dict[str, Any]) -> None:
    assert check(report, "missing_experts_plain_oea")["ok"]
    warned = check(report, "missing_experts_warned")
    assert warned["ok"] and "missing experts [9, 13]" in warned["detail"], warned


def test_rebalance_updates_the_placement_in_place(report: dict[str, Any]) -> None:
    assert check(report, "rebalance_refreshes_in_place")["ok"]
    assert check(report, "decode_after_rebalance")["ok"]


def test_tp8_without_expert_parallelism_warns_and_keeps_plain_oea(report: dict[str, Any]) -> None:
    assert check(report, "tp8_without_ep_plain_oea")["ok"]
    assert check(report, "tp8_without_ep_warned")["ok"]


def test_dp_attention_ranks_routing_their_own_rows_keep_plain_oea(report: dict[str, Any]) -> None:
    assert check(report, "dp_attention_a2a_plain_oea")["ok"]
    assert check(report, "dp_attention_a2a_warned")["ok"], check(report, "dp_attention_a2a_warned")


def test_busiest_device_at_ep8_equals_the_simulator(report: dict[str, Any]) -> None:
    """The same 24 batches of 16 tokens of the bundled Qwen3 trace (layer 0) through SGLang's routing and
    through ``oea simulate``: the busiest of 8 EP devices agrees within 5%."""
    from oea.sim import simulate

    row = simulate("qwen3-30b-a3b", policies=["ep-oea"], k0s=[3], batch_sizes=[16], num_batches=24, seed=5, ep=8,
                   layers=[0])[0]
    plugin = report["figures"]["qwen3_ep8_layer0"]
    assert plugin == pytest.approx(row["max_device_active_experts"], rel=0.05)
    print(f"SGLang plugin at EP=8: busiest device {plugin:.3f}, oea simulate {row['max_device_active_experts']:.3f}")
