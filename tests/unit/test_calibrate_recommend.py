"""``oea calibrate`` from a trace: k0 per batch-size range and per layer, T and latency per range, the
``OEA_LAYER_K0_FILE`` it writes (read back through ``oea.config``), and bad flag values (refused naming the flag)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import oea
from oea.cli import main
from oea.config import layer_k0_policies, read_layer_k0_file, settings_from_env
from oea.routing import AdaptiveK0Config
from oea.traces import Trace, save_trace

torch.set_num_threads(1)
N, K = 32, 8


def synthetic_trace(tokens: int = 256) -> Trace:
    """Layer 0: one dominant expert per token (OEA loses almost nothing at any k0); layer 1: flat top-8."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, 2, N, generator=gen) * 0.05
    logits[torch.arange(tokens), 0, torch.randint(N, (tokens,), generator=gen)] += 12.0
    return Trace(spec=oea.RouterSpec(N, K), logits=logits, request_ids=torch.arange(tokens) % 16,
                 positions=torch.arange(tokens) // 16, meta={"name": "synthetic"})


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_trace(synthetic_trace(), tmp_path_factory.mktemp("calibrate") / "synthetic.safetensors")


def _run(capsys, *argv: str) -> dict:
    assert main(["calibrate", *argv, "--num-batches", "4", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_layers_with_batch_sizes_gives_one_k0_per_layer_and_range(trace_path, tmp_path, capsys) -> None:
    out = tmp_path / "k0.json"
    result = _run(capsys, "layers", "--trace", str(trace_path), "--batch-sizes", "4", "16", "--tolerance", "0.02",
                  "--out", str(out))
    rows = {row["calibrated_at"]: row for row in result["ranges"]}
    assert rows[4]["batch_sizes"] == [4, 15] and rows[16]["batch_sizes"] == [16, None]
    assert rows[4]["k0"][0] == 1 and rows[16]["k0"][0] == 1  # the sharp layer needs one expert
    assert rows[4]["k0"][1] > rows[16]["k0"][1] > 1  # the flat layer: larger batches recover more by piggybacking
    schedule = read_layer_k0_file(out)
    assert schedule.batch_k0 == ((3, (8, 8)), (15, tuple(rows[4]["k0"])), (16, tuple(rows[16]["k0"])))
    assert schedule.k0 == (1, rows[4]["k0"][1])  # readers without batch_k0: the largest calibrated k0
    assert result["vanilla_batch_sizes"] == [1, 3]


def test_the_written_file_reads_back_through_oea_config_and_routes_by_batch_size(trace_path, tmp_path,
                                                                                capsys) -> None:
    out = tmp_path / "k0.json"
    result = _run(capsys, "layers", "--trace", str(trace_path), "--batch-sizes", "4", "16", "--tolerance", "0.02",
                  "--out", str(out))
    flat = {row["calibrated_at"]: row["k0"][1] for row in result["ranges"]}
    settings = settings_from_env({"OEA_LAYER_K0_FILE": str(out)})
    policies = layer_k0_policies(settings, num_experts=N, top_k=K, num_layers=2)
    assert policies[0] == AdaptiveK0Config(((3, 8), (16, 1)), min_batch=2)
    assert policies[1] == AdaptiveK0Config(((3, 8), (15, flat[4]), (16, flat[16])), min_batch=2)
    spec = oea.RouterSpec(N, K)
    for rows, k0 in ((2, 8), (8, flat[4]), (16, flat[16]), (40, flat[16])):  # the router call's rows pick k0
        logits = torch.randn(rows, N, generator=torch.Generator().manual_seed(rows))
        got = oea.route(logits, spec, policies[1])
        want = oea.route(logits, spec, oea.OEAConfig(k0))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows
    env = {"OEA_LAYER_K0_FILE": str(out), "OEA_MIN_BATCH": "8", "OEA_MAX_EXPERTS": "8"}
    assert layer_k0_policies(settings_from_env(env), N, K, 2)[0] == AdaptiveK0Config(((3, 8), (16, 1)), min_batch=8,
                                                                                     max_experts=8)
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*num_layers: file has 2, model has 3"):
        layer_k0_policies(settings, N, K, 3)
    assert layer_k0_policies(settings_from_env({}), N, K, 2) is None


def test_layers_with_one_batch_size_keeps_one_k0_per_layer_for_every_batch_size(trace_path, tmp_path,
                                                                               capsys) -> None:
    out = tmp_path / "k0.json"
    result = _run(capsys, "layers", "--trace", str(trace_path), "--batch-size", "16", "--tolerance", "0.02",
                  "--out", str(out))
    schedule = read_layer_k0_file(out)
    assert schedule.batch_k0 is None and schedule.k0 == tuple(result["k0"]) and schedule.k0[0] == 1
    assert schedule.config_for_layer(1) == oea.OEAConfig(schedule.k0[1])


def test_adaptive_gives_one_k0_per_range_and_tolerance_zero_is_vanilla(trace_path, capsys) -> None:
    result = _run(capsys, "adaptive", "--trace", str(trace_path), "--batch-sizes", "4", "16", "--tolerance", "0")
    for row in result["ranges"]:
        assert row["k0"] == K and row["proxy_loss"]["mean"] == pytest.approx(0.0, abs=1e-6)
        assert row["oea_active_experts"]["mean"] == pytest.approx(row["vanilla_active_experts"]["mean"])
    loose = _run(capsys, "adaptive", "--trace", str(trace_path), "--batch-sizes", "4", "16", "--tolerance", "1")
    assert [row["k0"] for row in loose["ranges"]] == [1, 1] and loose["schedule"] == [[3, 8], [16, 1]]
    for row in loose["ranges"]:
        low, high = row["oea_active_experts"]["ci"]
        assert low <= row["oea_active_experts"]["mean"] <= high < row["vanilla_active_experts"]["mean"]


def test_latency_per_range_with_a_preset_file_and_without_a_preset(trace_path, tmp_path, capsys) -> None:
    preset = tmp_path / "model.json"
    preset.write_text(json.dumps({"name": "synthetic-moe", "num_experts": N, "top_k": K, "hidden_size": 2048,
                                  "moe_intermediate_size": 1024, "num_moe_layers": 2, "bytes_per_weight": "bf16"}))
    result = _run(capsys, "adaptive", "--trace", str(trace_path), "--batch-sizes", "16", "--tolerance", "0.3",
                  "--model-preset-file", str(preset), "--gpu", "h200")
    row = result["ranges"][0]
    assert "synthetic-moe on h200" in result["latency"]
    gain, vanilla, rerouted = row["latency_gain"], row["predicted_latency_vanilla_us"], row["predicted_latency_oea_us"]
    assert rerouted["mean"] < vanilla["mean"] and 0 < gain["mean"] < 1
    assert gain["ci"][0] <= gain["mean"] <= gain["ci"][1]
    without = _run(capsys, "adaptive", "--trace", str(trace_path), "--batch-sizes", "16")
    assert without["ranges"][0]["latency_gain"] is None and "not predicted" in without["latency"]


def test_an_imported_recording_calibrates_in_lockstep_mode(tmp_path, capsys, imported_trace) -> None:
    trace = imported_trace(16, 8)
    capsys.readouterr()
    result = _run(capsys, "adaptive", "--trace", str(trace), "--mode", "lockstep", "--batch-sizes", "4", "16",
                  "--tolerance", "0.5", "--out", str(tmp_path / "k0.json"))
    assert result["proxy"] == "kept_topk_share" and len(result["ranges"]) == 2
    assert read_layer_k0_file(tmp_path / "k0.json").top_k == 4


@pytest.mark.parametrize(("argv", "message"), [
    (["layers", "--tolerance", "-1"], "--tolerance must be in [0, 1]"),
    (["adaptive", "--tolerance", "nan"], "--tolerance must be in [0, 1]"),
    (["adaptive", "--batch-size", "16"], "--batch-size applies to `oea calibrate layers`"),
    (["layers", "--batch-size", "16", "--batch-sizes", "4", "16"], "not both"),
    (["adaptive", "--batch-sizes", "0", "4"], "values must be integers >= 1, got [0]"),
    (["adaptive", "--batch-sizes", "4", "4"], "must not repeat"),
    (["adaptive", "--batch-sizes", "1"], "below --min-batch=2"),
    (["layers", "--num-batches", "1"], "--num-batches must be >= 2"),
    (["adaptive", "--k0", "9"], "--k0 values must be in 1..8"),
    (["adaptive", "--gpu", "h100-sxm"], "names no model preset"),
    (["adaptive", "--gpu", "h100-sxm", "--model-preset", "nope"], "model preset must be one of"),
])
def test_bad_flags_exit_2_with_one_line(trace_path, tmp_path, capsys, argv: list[str], message: str) -> None:
    out = tmp_path / "never.json"
    assert main(["calibrate", *argv, "--trace", str(trace_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_out_naming_a_directory_is_refused(trace_path, tmp_path, capsys) -> None:
    assert main(["calibrate", "layers", "--trace", str(trace_path), "--out", str(tmp_path)]) == 2
    assert "--out must name a file" in capsys.readouterr().err


@pytest.mark.parametrize(("change", "message"), [
    ({"k0": ["3", "5"]}, r"k0 must hold integers >= 1, got \['3', '5'\]"),
    ({"k0": 3}, r"k0 must be a list"),
    ({"num_layers": "2"}, r"num_layers must be an integer >= 1"),
    ({"batch_k0": [{"max_batch": 4, "k0": [3, 3]}, {"max_batch": 2, "k0": [3, 3]}]}, r"must be increasing"),
    ({"batch_k0": [{"max_batch": 4}]}, r"batch_k0 entries must be objects"),
    ({"format": "other"}, r"field 'format' must be 'oea-layer-k0'"),
    ({"version": 99}, r"field 'version' must be one of \[1, 2\] .*got 99"),
    ({"version": "2"}, r"field 'version' must be one of \[1, 2\] .*got '2'"),
    ({"min_bacth": 3}, r"unknown field 'min_bacth' \(allowed: format, version, num_experts, top_k, num_layers, k0,"),
])
def test_malformed_layer_k0_files_name_the_file_and_field(tmp_path, change: dict, message: str) -> None:
    path = tmp_path / "k0.json"
    path.write_text(json.dumps({"num_experts": N, "top_k": K, "num_layers": 2, "k0": [3, 5], **change}))
    with pytest.raises(ValueError, match=rf"k0\.json: .*{message}"):
        read_layer_k0_file(path)
    with pytest.raises(ValueError, match=r"^OEA_LAYER_K0_FILE="):
        layer_k0_policies(settings_from_env({"OEA_LAYER_K0_FILE": str(path)}), N, K, 2)


def test_a_version_1_file_without_format_or_batch_k0_still_loads(tmp_path) -> None:
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"num_experts": N, "top_k": K, "num_layers": 2, "k0": [3, 5], "min_batch": 2,
                                "model": "m", "calibration": {}}))
    schedule = read_layer_k0_file(path)
    assert schedule.k0 == (3, 5) and schedule.batch_k0 is None
    assert json.loads(json.dumps(schedule.to_json()))["version"] == 2
