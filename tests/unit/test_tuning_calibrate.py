"""Calibration of adaptive and per-layer k0 on synthetic traces whose answer is known."""

from __future__ import annotations

import json

import pytest
import torch

import oea
from oea.cli import main
from oea.config import read_layer_k0_file
from oea.traces import Trace, save_trace
from oea.tuning.calibrate import (
    ProxyPoint,
    adaptive_schedule,
    adaptive_schedule_from_eval,
    layer_schedule,
    measure_proxy,
)

torch.set_num_threads(1)


def synthetic_trace(sharp_layers: tuple[int, ...] = (0,), tokens: int = 256) -> Trace:
    """Layer in ``sharp_layers``: one dominant expert per token (OEA loses almost nothing);
    other layers: flat top-8 (OEA loses a lot of mass)."""
    gen = torch.Generator().manual_seed(0)
    n, layers = 32, 2
    logits = torch.randn(tokens, layers, n, generator=gen) * 0.05
    for layer in sharp_layers:
        logits[torch.arange(tokens), layer, torch.randint(n, (tokens,), generator=gen)] += 12.0
    return Trace(spec=oea.RouterSpec(n, 8), logits=logits, meta={"name": "synthetic"})


def test_measure_proxy_is_zero_loss_at_k0_equal_k_and_grows_as_k0_shrinks():
    points = measure_proxy(synthetic_trace(), [4, 16], [1, 4, 8], num_batches=6)
    for p in points:
        if p.k0 == 8:
            assert p.loss == pytest.approx(0.0, abs=1e-6)
    flat = {(p.batch_size, p.k0): p.loss for p in points if p.layer == 1}
    assert flat[(4, 1)] > flat[(4, 4)] > flat[(4, 8)] - 1e-9
    assert flat[(16, 1)] < flat[(4, 1)]  # larger batches recover more by piggybacking


def test_layer_schedule_gives_sharp_layers_a_small_k0():
    trace = synthetic_trace(sharp_layers=(0,))
    points = measure_proxy(trace, [16], list(range(1, 9)), num_batches=6)
    schedule = layer_schedule(trace, points, tolerance=0.02, batch_size=16)
    assert schedule.k0[0] == 1 and schedule.k0[1] > 1
    schedule.check_model(32, 8, 2)


def test_adaptive_schedule_picks_the_smallest_k0_within_tolerance_per_batch_size():
    points = [
        ProxyPoint(1, k0, None, loss, 0.0)
        for k0, loss in ((2, 0.3), (4, 0.1), (6, 0.01))
    ] + [ProxyPoint(16, k0, None, loss, 0.0) for k0, loss in ((2, 0.04), (4, 0.01), (6, 0.0))]
    cfg = adaptive_schedule(points, tolerance=0.05, top_k=8)
    assert cfg.schedule == ((15, 6), (16, 2))
    assert cfg.k0_for(1) == 6 and cfg.k0_for(64) == 2
    assert adaptive_schedule(points, tolerance=0.0, top_k=8).schedule == ((15, 8), (16, 6))


def test_adaptive_schedule_from_eval_rows():
    rows = [
        {"policy": "vanilla", "k0": None, "batch_size": 4, "cross_entropy": 3.0, "mean_active_experts": 20},
        {"policy": "oea", "k0": 3, "batch_size": 4, "cross_entropy": 3.2, "mean_active_experts": 9},
        {"policy": "oea", "k0": 5, "batch_size": 4, "cross_entropy": 3.01, "mean_active_experts": 14},
        {"policy": "vanilla", "k0": None, "batch_size": 16, "cross_entropy": 3.0, "mean_active_experts": 50},
        {"policy": "oea", "k0": 3, "batch_size": 16, "cross_entropy": 3.02, "mean_active_experts": 25},
    ]
    assert adaptive_schedule_from_eval(rows, 0.05, 8).schedule == ((3, 8), (15, 5), (16, 3))
    rows_b1 = [{**r, "batch_size": 1} for r in rows[:3]]  # B=1 is vanilla under min_batch=2: ignored
    assert adaptive_schedule_from_eval(rows_b1 + rows[3:], 0.05, 8).schedule == ((15, 8), (16, 3))
    with pytest.raises(ValueError, match="no 'oea' rows"):
        adaptive_schedule_from_eval(rows[:1], 0.05, 8)


def test_cli_writes_a_layer_file_that_loads(tmp_path, capsys):
    path = tmp_path / "synthetic.safetensors"
    save_trace(synthetic_trace(), path)
    out = tmp_path / "k0.json"
    code = main(["calibrate", "layers", "--trace", str(path), "--batch-size", "16", "--tolerance", "0.02",
                 "--num-batches", "4", "--out", str(out), "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["k0"][0] == 1
    loaded = read_layer_k0_file(out)
    assert loaded.num_layers == 2 and loaded.calibration["proxy"] == "kept_mass"
    assert main(["calibrate", "adaptive", "--trace", str(path), "--k0", "9"]) == 2
