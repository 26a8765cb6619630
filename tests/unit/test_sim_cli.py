"""``oea simulate`` / ``oea roofline`` / ``oea traces`` command lines: JSON contracts and error messages."""

from __future__ import annotations

import json

import pytest
import torch

from oea.cli import main
from oea.sim.cli import parse_policy_options

torch.set_num_threads(1)

CONTRACT_FIELDS = {"trace", "policy", "k0", "batch_size", "mean_active_experts", "mean_experts_per_token",
                   "p50_active_experts", "p95_active_experts", "kept_topk_share", "kept_mass",
                   "predicted_latency_us", "note"}


def test_simulate_json_rows_carry_the_contract_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--trace", "flame-moe-290m", "--batch-sizes", "4", "8", "--k0", "2", "3",
                 "--mode", "lockstep", "--num-batches", "2", "--seed", "1", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * (1 + 2 + 2)  # per B: vanilla + pruned x 2 k0 + oea x 2 k0
    for row in rows:
        assert set(row) >= CONTRACT_FIELDS
        assert row["trace"] == "flame-moe-290m" and row["mode"] == "lockstep"
    assert {r["k0"] for r in rows if r["policy"] == "oea"} == {2, 3}


def test_simulate_with_latency_and_ep(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--trace", "gpt-oss-120b-decode", "--batch-sizes", "16", "--k0", "2",
                 "--num-batches", "2", "--gpu", "b200", "--ep", "4", "--policies", "vanilla", "oea", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["predicted_latency_us"] > 0 and "max_device_active_experts" in r for r in rows)
    assert rows[0]["latency_model"] == "gpt-oss-120b on b200 tp=1 ep=4"


def test_bad_names_exit_2_with_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "nope", "--num-batches", "2"]) == 2
    assert "qwen3-30b-a3b" in capsys.readouterr().err
    assert main(["roofline", "--model", "nope", "--trace", "none"]) == 2
    assert "glm-5" in capsys.readouterr().err
    assert main(["roofline", "--gpu", "nope", "--trace", "none"]) == 2
    assert "rtx-pro-6000" in capsys.readouterr().err
    assert main(["simulate", "--batch-sizes", "9999", "--num-batches", "2", "--policies", "vanilla"]) == 2
    assert "larger than the pool" in capsys.readouterr().err


def test_roofline_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--model", "glm-5", "--gpu", "rtx-pro-6000", "--tp", "8", "--trace", "none",
                 "--batch-sizes", "1", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in rows] == [1, 16]
    assert rows[1]["bound"] == "memory" and rows[1]["tp"] == 8


def test_traces_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["traces", "--json"]) == 0
    names = {r["name"] for r in json.loads(capsys.readouterr().out)}
    assert {"qwen3-30b-a3b", "flame-moe-290m"} <= names


def test_policy_options_parse_json_values() -> None:
    assert parse_policy_options(["budget:budget=40", "adaptive:schedule=[[1,3],[16,5]]", "oea:group_fill=cross"]) == {
        "budget": {"budget": 40}, "adaptive": {"schedule": [[1, 3], [16, 5]]}, "oea": {"group_fill": "cross"}}
    with pytest.raises(ValueError, match="POLICY:KEY=VALUE"):
        parse_policy_options(["budget=40"])
    with pytest.raises(ValueError, match="policy 'budget' has no option 'nosuch'; its options: budget, min_batch"):
        parse_policy_options(["budget:nosuch=40"])
    with pytest.raises(ValueError, match="unknown policy 'x'"):
        parse_policy_options(["x:mode=fast"])
