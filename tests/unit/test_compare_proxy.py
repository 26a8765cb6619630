"""``oea compare``: the quality proxy is named (field and header), every mean has its interval, bad layers
and k0 are refused before anything runs."""

from __future__ import annotations

import json

import pytest
import torch

import oea
from oea.cli import main
from oea.traces import Trace, load_trace
from oea.tuning.compare import PROXIES, check_compare_arguments, compare_policies, proxy_of

torch.set_num_threads(1)


def _logit_trace() -> Trace:
    logits = torch.randn(96, 2, 32, generator=torch.Generator().manual_seed(0)) * 1.5 + torch.linspace(2, 0, 32)
    return Trace(spec=oea.RouterSpec(32, 4), logits=logits, meta={"name": "synthetic"})


def test_rows_name_their_proxy_and_carry_intervals() -> None:
    trace = _logit_trace()
    assert proxy_of(trace) == "lost_router_mass" and proxy_of(load_trace("qwen3-30b-a3b")) == "lost_topk_share"
    rows = compare_policies(trace, batch_size=8, k0s=(2,), ep=4, num_batches=5)
    for row in rows:
        record = row.as_dict()
        assert record["proxy"] == "lost_router_mass" and "quality_loss" not in record
        assert record["lost_router_mass"] == row.proxy_loss
        for name in ("mean_active_experts", "max_device_active_experts", "mean_experts_per_token",
                     "lost_router_mass"):
            low, high = record[f"{name}_ci"]
            assert low <= record[name] <= high
    oea_row = next(r for r in rows if r.policy == "oea")
    assert oea_row.ci("mean_active_experts")[1] > oea_row.ci("mean_active_experts")[0]  # batches differ
    assert set(PROXIES) == {"lost_router_mass", "lost_topk_share"}


def test_bad_layers_and_k0_name_the_flag() -> None:
    trace = _logit_trace()
    assert check_compare_arguments(trace, [1, 2], 2, None) == [0, 1]
    for layers in ([99], [-1], [0, 0], []):
        with pytest.raises(ValueError, match=r"--layers must be distinct MoE layer indices in 0\.\.1"):
            check_compare_arguments(trace, [1], 2, layers)
    with pytest.raises(ValueError, match=r"--k0 must be distinct integers in 1\.\.4"):
        check_compare_arguments(trace, [5], 2, None)
    with pytest.raises(ValueError, match="--num-batches must be an integer >= 2"):
        check_compare_arguments(trace, [1], 1, None)


def test_compare_json_names_the_proxy_and_runs_each_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--batch-sizes", "8", "16", "--k0", "3", "--layers", "0", "--num-batches", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["proxy"] == "lost_topk_share" and "ΔCE" in out["proxy_note"]
    assert sorted({r["batch_size"] for r in out["rows"]}) == [8, 16]
    assert main(["compare", "--batch-size", "8", "--k0", "3", "--layers", "0", "--num-batches", "2", "--json"]) == 0
    assert {r["batch_size"] for r in json.loads(capsys.readouterr().out)["rows"]} == {8}  # the old spelling
