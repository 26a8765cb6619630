"""``oea bench layer`` end to end (tiny preset) and ``scripts/gpu_check.py`` on CPU (dry run)."""

from __future__ import annotations

import json

import pytest
import torch
from project_scripts import load_script

import oea
from oea.cli import main

TINY = ["--preset", "embedded", "--trace", "qwen3-30b-a3b", "--threads", "1", "--repeats", "2", "--warmup", "0",
        "--weight-copies", "2"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_json_rows_fit_and_plot(tmp_path, capsys):
    plot = tmp_path / "layer.png"
    fit_file = tmp_path / "fit.json"
    code = main(["bench", "layer", *TINY, "--k0", "3", "5", "--t-sweep", "8", "64", "128", "--json",
                 "--plot", str(plot), "--write-fit", str(fit_file)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    labels = [r["label"] for r in result["rows"]]
    assert labels == ["vanilla", "pruned k0=3", "pruned k0=5", "oea k0=3", "oea k0=5"]
    for row in result["rows"]:
        assert {"policy", "k0", "batch_size", "mean_active_experts", "latency_us_median", "ratio_vs_vanilla",
                "latency_us_ci95", "ratio_ci95", "bandwidth_GBps_median"} <= set(row)
    assert set(result["fit"]) >= {"a_us", "b_us", "c_us", "r2"}
    assert result["shape"] == {"num_experts": 128, "top_k": 8, "hidden_size": 128, "intermediate_size": 48}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads(fit_file.read_text())
    assert written["preset"] == "embedded" and written["b_us"] == result["fit"]["b_us"]


def test_table_output(capsys):
    assert main(["bench", "layer", *TINY, "--t-sweep", "8", "128"]) == 0
    out = capsys.readouterr().out
    assert "oea k0=3" in out and "T=128" in out and "fit: latency =" in out and "GB/s" in out


def test_unknown_preset_lists_the_names(capsys):
    assert main(["bench", "layer", "--preset", "qwen4", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "qwen4" in err and "qwen3-30b-a3b" in err and "olmoe-1b-7b" in err


def test_batch_larger_than_the_trace_pool(tmp_path, capsys):
    from oea.traces import Trace, save_trace

    ids = torch.stack([torch.randperm(128)[:8] for _ in range(10)]).reshape(10, 1, 8)
    path = save_trace(Trace(spec=oea.RouterSpec(128, 8), ids=ids, meta={"name": "ten"}), tmp_path / "ten.safetensors")
    assert main(["bench", "layer", *TINY[:2], "--trace", str(path), "--batch-size", "16", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "batch size 16 is larger than the pool" in err and "10 tokens" in err


def test_preset_too_large_for_memory(monkeypatch, capsys):
    from oea.bench.layer import run as layer

    monkeypatch.setattr(layer, "available_memory_bytes", lambda device: 4 * 2**30)
    assert main(["bench", "layer", "--preset", "qwen3-235b-a22b", "--repeats", "1"]) == 2
    assert "needs 4.50 GiB" in capsys.readouterr().err


def test_gpu_check_dry_run_on_cpu(tmp_path, monkeypatch, capsys):
    gpu_check = load_script("gpu_check")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--device", "cpu", "--dry-run", "--threads", "1", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "graph-vs-eager routing: 18/18 ok" in out and "vanilla" in out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["dry_run"] and len(report["bench"]) == 1
    policies = {(r["router"], r["policy"]) for r in report["graph_routing"]}
    assert {p for _, p in policies} == {"vanilla", "oea k0=3", "pruned k0=3"}


def test_gpu_check_arguments_and_the_comparison_detects_differences():
    gpu_check = load_script("gpu_check")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "cpu"])  # CPU only as a dry run
    assert gpu_check.parse_args([]).repeats == 200
    assert gpu_check.parse_args(["--dry-run", "--device", "cpu"]).repeats == 3
    logits = torch.randn(6, 16)
    valid = torch.tensor([True] * 4 + [False] * 2)
    spec = oea.RouterSpec(16, 4)
    eager = oea.route(logits, spec, oea.OEAConfig(2), valid=valid)
    assert gpu_check.compare_routing(eager, eager, valid)["ok"]
    shifted = (eager[0], eager[1] + 1e-3)
    assert not gpu_check.compare_routing(eager, shifted, valid)["ok"]
    other_ids = eager[0].clone()
    other_ids[0, 0] = (other_ids[0, 0] + 1) % 16
    assert not gpu_check.compare_routing(eager, (other_ids, eager[1]), valid)["ok"]
