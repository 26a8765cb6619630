"""``oea.models.inflate`` planning and bad input (no model forward): sizes, presets, families, memory and
disk checks before anything is written, and the ``oea inflate`` command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from oea.cli import main  # noqa: E402
from oea.models import embedded_model_dir  # noqa: E402
from oea.models.inflate import (  # noqa: E402
    InflationPlan,
    check_disk,
    check_memory,
    intermediate_size_like,
    padded_expert,
    plan_inflation,
    write_inflated,
)

QWEN = {"model_type": "qwen3_moe", "hidden_size": 128, "moe_intermediate_size": 48, "num_experts": 128,
        "initializer_range": 0.02}


def test_like_matches_the_presets_per_expert_bytes() -> None:
    # Qwen3-30B-A3B: 3 * 2048 * 768 bf16 weights per expert; at hidden 128 that is intermediate 12288.
    assert intermediate_size_like("qwen3-30b-a3b", hidden_size=128, bytes_per_weight=2) == 12288
    plan = plan_inflation(QWEN, num_moe_layers=4, bytes_per_weight=2, like="qwen3-30b-a3b")
    assert plan.expert_bytes == 3 * 2048 * 768 * 2
    assert plan.expert_bytes_total == 128 * 4 * plan.expert_bytes  # about 4.8 GB
    assert plan.added_bytes == 3 * 128 * (12288 - 48) * 2 * 128 * 4
    assert plan_inflation(QWEN, 4, 2, moe_intermediate_size=96).size == 96


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError, match=r"--like must be one of \[.*'qwen3-30b-a3b'.*\], got 'qwen9'"):
        plan_inflation(QWEN, 4, 2, like="qwen9")


def test_smaller_than_base_names_both_sizes() -> None:
    with pytest.raises(ValueError, match="size 20, smaller than the base model's 48"):
        plan_inflation(QWEN, 4, 2, moe_intermediate_size=20)


def test_unsupported_family_names_what_was_looked_for() -> None:
    with pytest.raises(ValueError, match=r"not a supported MoE family: looked for .*qwen3_moe.*moe_intermediate_size"
                                         r".*got model_type 'llama'"):
        plan_inflation({"model_type": "llama", "hidden_size": 64}, 4, 2, moe_intermediate_size=96)
    with pytest.raises(ValueError, match="exactly one of --like PRESET and --moe-intermediate-size"):
        plan_inflation(QWEN, 4, 2)


def test_padding_keeps_the_expert_and_adds_dense_nonzero_gate_up_and_zero_down() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    plan = InflationPlan(base_size=6, size=10, hidden_size=4, num_experts=1, num_moe_layers=1, bytes_per_weight=4)
    g, u, d = padded_expert(gate, up, down, plan, gen)
    assert g.shape == u.shape == (10, 4) and d.shape == (4, 10)
    assert torch.equal(g[:6], gate) and torch.equal(u[:6], up) and torch.equal(d[:, :6], down)
    assert torch.all(g[6:] != 0) and torch.all(u[6:] != 0)  # nothing a kernel could skip in gate/up
    assert torch.all(d[:, 6:] == 0)
    x = torch.randn(3, 4)
    base = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    wide = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
    torch.testing.assert_close(wide, base, rtol=1e-6, atol=1e-6)


def test_memory_and_disk_checks_name_the_size_needed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not enough memory for x: needs 1\.00 GiB, 0\.50 GiB available"):
        check_memory(2**30, "x", available=2**29)
    with pytest.raises(ValueError, match=r"not enough disk space .* needs 1\.00 GiB, 0\.50 GiB free"):
        check_disk(2**30, tmp_path / "a" / "b", free=2**29)
    check_disk(2**20, tmp_path / "a" / "b")  # a missing directory: its nearest existing parent is measured


def test_write_checks_disk_and_memory_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "inflated"
    with pytest.raises(ValueError, match=r"not enough disk space for the inflated checkpoint .* needs 4\.5"):
        write_inflated(out, like="qwen3-30b-a3b", free_disk=2**30)
    assert not out.exists()
    with pytest.raises(ValueError, match=r"not enough memory for writing one inflated layer .* needs 2\.25 GiB"):
        write_inflated(out, like="qwen3-30b-a3b", free_disk=2**40, available_memory=2**30)
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        write_inflated(out, moe_intermediate_size=96)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_unsupported_checkpoints_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text(json.dumps(QWEN))
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 4, 2)}, str(fused / "model.safetensors"))
    with pytest.raises(ValueError, match="fused expert tensors"):
        write_inflated(tmp_path / "out", fused, moe_intermediate_size=96)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 4)}, str(llama / "model.safetensors"))
    with pytest.raises(ValueError, match="not a supported MoE family: looked for"):
        write_inflated(tmp_path / "out", llama, moe_intermediate_size=96)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--like", "qwen9"], "--like must be one of"),
    (["--moe-intermediate-size", "8"], "smaller than the base model's 48"),
    ([], "give exactly one of --like PRESET and --moe-intermediate-size N"),
    (["--like", "qwen3-30b-a3b", "--moe-intermediate-size", "96"], "give exactly one of"),
])
def test_cli_bad_input_exits_2_and_writes_nothing(argv: list[str], message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["inflate", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_writes_a_small_inflation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["inflate", "--moe-intermediate-size", "64", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["base_size"], summary["size"], summary["num_moe_layers"]) == (48, 64, 4)
    config = json.loads((out / "config.json").read_text())
    assert config["moe_intermediate_size"] == 64
    assert config["hidden_size"] == json.loads((embedded_model_dir() / "config.json").read_text())["hidden_size"]
    for name in ("tokenizer.json", "heldout_files.json", "model.safetensors.index.json", "inflation.json"):
        assert (out / name).is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.3.mlp.experts.127.down_proj.weight"].startswith("model-00004-of-")
    assert index["metadata"]["total_size"] == summary["bytes_written"]
