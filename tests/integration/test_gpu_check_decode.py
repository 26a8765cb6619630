"""The CPU side of ``scripts/gpu_check.py``'s decode step: the settings it would run on a GPU, the dry run on
CPU, the pass/fail rule and that a failing decode run is reported without losing the rest."""

from __future__ import annotations

import json

import pytest
from project_scripts import load_script

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_gpu_settings_are_the_issue_s(gpu_check) -> None:
    from oea.bench.decode.step import resolve_graph_mode

    [(label, config)] = gpu_check.decode_configs("cuda", dry_run=False, threads=2)
    assert "qwen3-30b-a3b" in label
    assert (config.like, config.moe_intermediate_size, config.device) == ("qwen3-30b-a3b", None, "cuda")
    assert config.batch_sizes == (1, 16, 64) and config.k0s == (3, 5) and config.policies == ("oea",)
    assert resolve_graph_mode(config.graph, "cuda") == "capture" and config.check_identity


def test_dry_run_on_cpu_and_the_pass_rule(gpu_check) -> None:
    [run], error = gpu_check.decode_runs("cpu", dry_run=True, threads=1)
    assert error is None and run["model"]["moe_intermediate_size"] == 64
    assert [(r["batch_size"], r["label"]) for r in run["rows"]] == [
        (b, label) for b in (1, 2) for label in ("vanilla", "oea k0=3", "oea k0=5")]
    assert gpu_check.decode_ok(run)
    lines = "\n".join(gpu_check.summary_lines({"graph_routing": [], "graph_layer": [], "bench": [],
                                              "decode": [{**run, "wall_s": 1.0}]}))
    assert "oea k0=3" in lines and "k0=top_k identical: True" in lines
    assert not gpu_check.decode_ok({**run, "k0_top_k_identical": False})
    captured = {**run, "graph": "capture", "graph_fallbacks": [], "graph_token_match_vs_eager": {"16": 0.97}}
    assert not gpu_check.decode_ok(captured)
    assert gpu_check.decode_ok({**captured, "graph_token_match_vs_eager": {"16": 1.0}})
    assert gpu_check.decode_ok({**captured, "graph_fallbacks": ["B=16 vanilla: RuntimeError: x"]})


def test_a_failing_decode_run_is_reported(gpu_check, monkeypatch, tmp_path, capsys) -> None:
    import oea.bench.decode.run as decode

    def boom(_config):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(decode, "run_decode_bench", boom)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_check, "bench_runs", lambda *a: [])  # the layer part has its own test
    assert gpu_check.main(["--device", "cpu", "--dry-run", "--threads", "1", "--repeats", "1"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "out of memory" in report["decode_error"] and not report["ok"] and report["graph_routing"]
    assert "decode benchmark FAILED" in capsys.readouterr().out
