"""User model presets (``--model-preset-file``): the documented Qwen1.5-MoE example predicts latency;
every malformed field is named with its allowed values; ``oea presets`` lists the built-in ones."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

from oea.cli import main
from oea.presets import MODEL_PRESETS, get_gpu_preset, gpu_preset_names
from oea.sim.costmodel import CostModel
from oea.sim.preset_file import load_model_preset_file

torch.set_num_threads(1)
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "presets.md"
QWEN15 = {"name": "qwen1.5-moe-a2.7b", "num_experts": 60, "top_k": 4, "hidden_size": 2048,
          "moe_intermediate_size": 1408, "num_moe_layers": 24, "bytes_per_weight": 2}


def _docs_toml(tmp_path: pathlib.Path) -> pathlib.Path:
    block = re.search(r"```toml\n(.*?)```", DOCS.read_text(), re.S)
    assert block, "docs/presets.md has no TOML example"
    path = tmp_path / "qwen15-moe.toml"
    path.write_text(block.group(1))
    return path


def test_the_documented_toml_and_the_json_form_give_the_same_preset(tmp_path: pathlib.Path) -> None:
    toml = load_model_preset_file(_docs_toml(tmp_path))
    (tmp_path / "q.json").write_text(json.dumps(QWEN15))
    as_json = load_model_preset_file(tmp_path / "q.json")
    assert toml.model.num_experts == 60 and toml.model.top_k == 4 and toml.model.num_shared_experts == 1
    for name in ("num_experts", "top_k", "hidden_size", "moe_intermediate_size", "num_moe_layers",
                 "bytes_per_weight", "name"):
        assert getattr(toml.model, name) == getattr(as_json.model, name), name
    assert toml.model.expert_bytes == 3 * 2048 * 1408 * 2


def test_simulate_predicts_latency_with_the_documented_qwen15_preset(tmp_path: pathlib.Path, capsys,
                                                                    imported_trace) -> None:
    trace = imported_trace(8, 8)
    preset = _docs_toml(tmp_path)
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--model-preset-file", str(preset), "--gpu", "h100-sxm",
                 "--policies", "vanilla", "oea", "--k0", "2", "--batch-sizes", "8", "--num-batches", "4",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cost = CostModel(load_model_preset_file(preset).model, get_gpu_preset("h100-sxm"))
    assert cost.expert_load_us == pytest.approx(3 * 2048 * 1408 * 2 / 3350e3)  # 5.16 µs per expert
    for row in rows:  # latency is linear in T and slots, so the mean latency is the latency of the means
        slots = 8 * row["mean_experts_per_token"]
        expected = cost.layer_latency_us(row["mean_active_experts"], slots, 8)
        assert row["predicted_latency_us"] == pytest.approx(expected, rel=1e-9)
        assert row["latency_model"].startswith("qwen1.5-moe-a2.7b on h100-sxm")
    assert rows[1]["predicted_latency_us"] < rows[0]["predicted_latency_us"]


def test_roofline_accepts_the_preset_file_and_its_tp(tmp_path: pathlib.Path, capsys) -> None:
    (tmp_path / "q.json").write_text(json.dumps({**QWEN15, "tp": 2}))
    assert main(["roofline", "--model-preset-file", str(tmp_path / "q.json"), "--gpu", "h100-sxm",
                 "--batch-sizes", "1", "16", "--trace", "none", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["model"] == "qwen1.5-moe-a2.7b" and rows[0]["tp"] == 2
    assert main(["roofline", "--model-preset-file", str(tmp_path / "q.json"), "--tp", "1", "--trace", "none",
                 "--batch-sizes", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["tp"] == 1  # the flag wins over the file


def test_a_preset_files_tp_that_does_not_split_the_model_is_named_as_the_files(tmp_path: pathlib.Path, capsys,
                                                                              imported_trace) -> None:
    """Its tp stands in for --tp: the error names the file's field; given, the flag is named instead."""
    (tmp_path / "tp3.json").write_text(json.dumps({**QWEN15, "tp": 3}))
    base = ["simulate", "--trace", str(imported_trace(8, 8)), "--model-preset-file", str(tmp_path / "tp3.json"),
            "--gpu", "h100-sxm", "--num-batches", "2"]
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err
    assert f"tp of --model-preset-file {tmp_path / 'tp3.json'} must split qwen1.5-moe-a2.7b's" in err
    assert main([*base, "--tp", "5"]) == 2
    assert "--tp must split qwen1.5-moe-a2.7b's" in capsys.readouterr().err


BAD_FIELDS = [
    ({"top_k": 0}, r"field 'top_k' must be an integer in 1\.\.60, got 0"),
    ({"top_k": 61}, r"field 'top_k' must be an integer in 1\.\.60"),
    ({"num_experts": 6.5}, r"field 'num_experts' must be an integer in 1\.\.32768, got 6\.5"),
    ({"hidden_size": True}, r"field 'hidden_size' must be an integer >= 1"),
    ({"bytes_per_weight": "fp5"}, r"field 'bytes_per_weight' must be a number > 0 or one of \['bf16'"),
    ({"bytes_per_weight": -2}, r"field 'bytes_per_weight'"),
    ({"scoring": "relu"}, r"field 'scoring' must be one of \['softmax', 'sigmoid'\]"),
    ({"n_group": 7, "topk_group": 1}, r"field 'n_group' must divide num_experts=60"),
    ({"n_group": 4}, r"'n_group' and 'topk_group' go together"),
    ({"n_group": 4, "topk_group": 5}, r"field 'topk_group' must be an integer in 1\.\.4"),
    ({"ep": 7}, r"field 'ep' must divide num_experts=60"),
    ({"tp": 2, "ep": 2}, r"'tp' and 'ep'.*not both"),
    ({"num_shared_experts": -1}, r"field 'num_shared_experts' must be an integer >= 0"),
    ({"experts": 60}, r"unknown fields \['experts'\]; allowed: \['num_experts'"),
    ({"name": "qwen3-30b-a3b"}, r"field 'name' 'qwen3-30b-a3b' is a built-in preset"),
]


@pytest.mark.parametrize(("change", "message"), BAD_FIELDS, ids=[m.split("'")[1] for _, m in BAD_FIELDS])
def test_a_bad_field_exits_2_naming_file_field_and_allowed_values(tmp_path: pathlib.Path, capsys, change: dict,
                                                                  message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**QWEN15, **change}))
    assert main(["roofline", "--model-preset-file", str(path), "--trace", "none", "--json"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(path) in err and re.search(message, err), err


@pytest.mark.parametrize(("name", "text", "message"), [
    ("missing.json", None, r"model preset file does not exist"),
    ("broken.toml", "num_experts = ", r"not valid TOML"),
    ("broken.json", "{", r"not valid JSON"),
    ("preset.yaml", "num_experts: 60", r"must be JSON or TOML"),
    ("short.json", json.dumps({"num_experts": 60, "top_k": 4}), r"missing required fields \['hidden_size'"),
    ("list.json", "[1, 2]", r"must hold one table/object"),
])
def test_unreadable_files_are_named(tmp_path: pathlib.Path, capsys, name: str, text: str | None,
                                    message: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["simulate", "--model-preset-file", str(path), "--gpu", "h100-sxm", "--batch-sizes", "4",
                 "--num-batches", "2"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_name_and_a_file_together_are_refused(tmp_path: pathlib.Path, capsys) -> None:
    (tmp_path / "q.json").write_text(json.dumps(QWEN15))
    assert main(["simulate", "--model-preset", "qwen3-30b-a3b", "--model-preset-file", str(tmp_path / "q.json"),
                 "--gpu", "h100-sxm"]) == 2
    assert "give --model-preset or --model-preset-file, not both" in capsys.readouterr().err


def test_oea_presets_lists_every_builtin_model_and_gpu(tmp_path: pathlib.Path, capsys) -> None:
    assert main(["presets", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listing["models"]] == list(MODEL_PRESETS)
    assert sorted(g["name"] for g in listing["gpus"]) == gpu_preset_names()
    qwen3 = next(m for m in listing["models"] if m["name"] == "qwen3-30b-a3b")
    assert qwen3["num_experts"] == 128 and qwen3["expert_megabytes"] == pytest.approx(3 * 2048 * 768 * 2 / 1e6)
    (tmp_path / "q.json").write_text(json.dumps(QWEN15))
    assert main(["presets", "--model-preset-file", str(tmp_path / "q.json")]) == 0
    out = capsys.readouterr().out
    assert "qwen1.5-moe-a2.7b" in out and "h100-sxm" in out
