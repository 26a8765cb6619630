"""``oea.bench.layer``: exact-T synthetic routings, statistics, the fit, memory planning, a tiny run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import oea
from oea.bench.layer import inputs as layer_inputs
from oea.bench.layer import run as layer
from oea.bench.layer import timing as layer_timing
from oea.bench.layer.fit import fit_latency, write_fit
from oea.bench.layer.inputs import LayerBenchConfig, default_sweep, synthetic_routing
from oea.bench.layer.moe import MoEShape
from oea.bench.layer.run import plan_weight_copies, run_layer_bench
from oea.stats import median_interval, ratio_of_medians_interval

TINY = MoEShape(num_experts=128, top_k=8, hidden_size=32, intermediate_size=16)


@pytest.fixture(autouse=True)
def _restore_threads():  # run_layer_bench sets the thread count it is given
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("n", "k", "b", "t"), [(128, 8, 16, 8), (128, 8, 16, 37), (128, 8, 16, 128),
                                                 (64, 8, 4, 32), (16, 4, 1, 4), (8, 2, 16, 8)])
def test_synthetic_routing_has_exactly_t_active_experts(n, k, b, t):
    gen = torch.Generator().manual_seed(t)
    for _ in range(5):
        ids, weights = synthetic_routing(n, k, b, t, gen)
        assert ids.shape == (b, k) and weights.shape == (b, k)
        assert int(oea.active_experts(ids, weights)) == t
        assert all(len(set(row)) == k for row in ids.tolist())  # k distinct experts per token
        assert int(ids.min()) >= 0 and int(ids.max()) < n
        assert (weights > 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(b))


def test_synthetic_routing_rejects_impossible_t():
    gen = torch.Generator()
    with pytest.raises(ValueError, match="exact T must lie in k=8"):
        synthetic_routing(128, 8, 16, 7, gen)
    with pytest.raises(ValueError, match="B·k=16"):
        synthetic_routing(128, 8, 2, 17, gen)


def test_default_sweep_spans_k_to_the_reachable_maximum():
    assert default_sweep(8, 128, 16) == [8, 38, 68, 98, 128]
    assert default_sweep(8, 128, 16, points=7) == [8, 28, 48, 68, 88, 108, 128]
    sweep = default_sweep(8, 128, 2)
    assert sweep[0] == 8 and sweep[-1] == 16 and sweep == sorted(set(sweep))


def test_fit_recovers_a_known_linear_model():
    t = np.array([8, 28, 48, 68, 88, 108, 128, 34, 34, 66], dtype=float)
    slots = np.array([128] * 7 + [48, 80, 128], dtype=float)
    latency = 2.5 * t + 0.3 * slots + 40.0
    fit = fit_latency(t, slots, latency)
    assert fit["b_us"] == pytest.approx(2.5) and fit["a_us"] == pytest.approx(0.3)
    assert fit["c_us"] == pytest.approx(40.0) and fit["r2"] == pytest.approx(1.0)
    assert fit["a_identified"] and fit["points"] == 10


def test_fit_with_constant_slots_fixes_a_at_zero_and_reports_a_worse_r2_for_noise():
    t = np.array([8, 28, 48, 68, 88], dtype=float)
    rng = np.random.default_rng(0)
    latency = 3.0 * t + 10 + rng.normal(0, 20, t.size)
    fit = fit_latency(t, [128] * 5, latency)
    assert not fit["a_identified"] and fit["a_us"] == 0.0
    assert 0.0 < fit["r2"] < 1.0
    with pytest.raises(ValueError, match=">= 2 points"):
        fit_latency([1.0], [1.0], [1.0])


def test_bootstrap_ci_brackets_the_median_and_paired_ratio_is_tight():
    rng = np.random.default_rng(1)
    round_effect = rng.uniform(50, 150, 60)  # shared by both variants (same routing batch per round)
    base = round_effect * (1 + rng.normal(0, 0.01, 60))
    half = 0.5 * round_effect * (1 + rng.normal(0, 0.01, 60))
    lo, hi = median_interval(base, rng).bounds
    assert lo <= np.median(base) <= hi
    r_lo, r_hi = ratio_of_medians_interval(half, base, rng, paired=True).bounds
    assert r_lo <= np.median(half) / np.median(base) <= r_hi
    assert r_hi - r_lo < 0.15  # pairing cancels the round-to-round spread
    with pytest.raises(ValueError, match="paired"):
        ratio_of_medians_interval([1.0, 2.0], [1.0], rng, paired=True)


def test_weight_copy_plan_and_the_memory_error_names_the_size():
    gib = 2**30
    assert plan_weight_copies(gib, 100 * gib, None, "x") == 1
    assert plan_weight_copies(16 * 2**20, 100 * gib, None, "x") == 16  # 256 MiB of weights
    assert plan_weight_copies(16 * 2**20, 40 * 2**20, None, "x") == 1  # memory caps the rotation
    with pytest.raises(ValueError, match=r"one layer needs 18\.00 GiB but only 8\.00 GiB"):
        plan_weight_copies(18 * gib, 8 * gib, None, "preset 'glm-5'")
    with pytest.raises(ValueError, match=r"3 weight copies need 3\.00 GiB"):
        plan_weight_copies(gib, 4 * gib, 3, "x")


def test_available_memory_is_read():
    assert layer.available_memory_bytes("cpu") > 0


def _tiny_config(**overrides) -> LayerBenchConfig:
    values = dict(preset="qwen3-30b-a3b", shape=TINY, trace="qwen3-30b-a3b", batch_size=16, k0s=(3,),
                  repeats=3, warmup=1, threads=1, t_sweep=(8, 64, 128), num_batches=3, weight_copies=2)
    values.update(overrides)
    return LayerBenchConfig(**values)


def test_tiny_run_reports_contract_fields_and_oea_activates_fewer_experts():
    result = run_layer_bench(_tiny_config())
    rows = {r["label"]: r for r in result["rows"]}
    assert set(rows) == {"vanilla", "pruned k0=3", "oea k0=3"}
    for row in result["rows"]:
        for key in ("policy", "k0", "batch_size", "mean_active_experts", "latency_us_median", "ratio_vs_vanilla",
                    "latency_us_ci95", "bandwidth_GBps_median"):
            assert key in row
        assert row["samples"] == 3 and row["batch_size"] == 16
        assert row["latency_us_ci95"][0] <= row["latency_us_median"] <= row["latency_us_ci95"][1]
    assert rows["vanilla"]["ratio_vs_vanilla"] == 1.0 and rows["vanilla"]["k0"] is None
    assert rows["oea k0=3"]["mean_active_experts"] < rows["vanilla"]["mean_active_experts"]
    # OEA and pruned share S_base; pruned uses exactly B·k0 slots, OEA more
    assert rows["oea k0=3"]["mean_active_experts"] == rows["pruned k0=3"]["mean_active_experts"]
    assert rows["pruned k0=3"]["mean_token_slots"] == 16 * 3 < rows["oea k0=3"]["mean_token_slots"]
    assert [r["active_experts"] for r in result["sweep"]] == [8, 64, 128]
    assert set(result["fit"]) >= {"a_us", "b_us", "c_us", "r2"}
    assert result["weight_copies"] == 2 and result["trace"] == "qwen3-30b-a3b"
    json.dumps(result)  # JSON-ready


def test_id_only_trace_routes_oea_within_the_recorded_top_k():
    cfg = layer_inputs._policy_cfg("oea", 3, 8, id_only=True)
    assert isinstance(cfg, oea.OEAConfig) and cfg.k0 == 3 and cfg.max_rank == 8
    assert layer_inputs._policy_cfg("oea", 3, 8, id_only=False).max_rank is None
    assert layer_inputs._policy_cfg("vanilla", None, 8, id_only=True) is None


def test_bad_configs_are_rejected_with_the_allowed_values():
    with pytest.raises(ValueError, match="model preset must be one of"):
        run_layer_bench(LayerBenchConfig(preset="no-such-model"))
    with pytest.raises(ValueError, match=r"--k0 must be in 1\.\.top_k=8"):
        run_layer_bench(_tiny_config(k0s=(9,)))
    with pytest.raises(ValueError, match="larger than the pool"):
        run_layer_bench(_tiny_config(batch_size=5000, t_sweep=()))
    with pytest.raises(ValueError, match="--dtype must be one of"):
        run_layer_bench(_tiny_config(dtype="int8"))
    with pytest.raises(ValueError, match="policy must be one of"):
        run_layer_bench(_tiny_config(policies=("greedy",)))
    with pytest.raises(ValueError, match="N=64, k=8"):
        run_layer_bench(_tiny_config(shape=MoEShape(64, 8, 32, 16)))


def test_preset_larger_than_memory_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(layer, "available_memory_bytes", lambda device: 8 * 2**30)
    with pytest.raises(ValueError, match=r"preset 'glm-5'.*needs 18\.00 GiB"):
        run_layer_bench(LayerBenchConfig(preset="glm-5"))


def test_random_trace_and_no_policies():
    result = run_layer_bench(_tiny_config(trace="random", policies=(), t_sweep=(8, 16)))
    assert result["rows"] == [] and len(result["sweep"]) == 2
    result = run_layer_bench(_tiny_config(trace="random", t_sweep=()))
    assert result["sweep"] == [] and "random" in result["routing_note"]


def test_write_fit_is_readable_by_the_cost_model(tmp_path):
    from oea.presets import cpu_preset, load_cpu_fit

    result = {"preset": "qwen3-30b-a3b", "tp": 1, "machine": "test machine", "dtype": "bfloat16", "impl": "loop",
              "batch_size": 16, "repeats": 3, "rows": [], "sweep": [],
              "fit": {"a_us": 20.0, "b_us": 2000.0, "c_us": 500.0, "r2": 0.99, "a_identified": True}}
    path = write_fit(result, tmp_path / "fit.json")
    fit = load_cpu_fit(path)
    assert fit is not None and fit.b_us == 2000.0 and fit.a_us == 20.0 and fit.measured_on == "test machine"
    assert cpu_preset(path).measured
    with pytest.raises(ValueError, match="needs a fit"):
        write_fit({**result, "fit": None}, tmp_path / "none.json")


def test_random_logits_use_the_preset_router_family():
    result = run_layer_bench(_tiny_config(preset="glm-5", shape=MoEShape(256, 8, 32, 16), trace="random",
                                          t_sweep=(), repeats=2))
    assert "sigmoid router" in result["routing_note"]
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["oea k0=3"]["mean_active_experts"] < rows["vanilla"]["mean_active_experts"]


def test_rows_without_vanilla_have_no_ratio():
    result = run_layer_bench(_tiny_config(policies=("oea",), t_sweep=(8, 128), repeats=2))
    assert [r["label"] for r in result["rows"]] == ["oea k0=3"]
    assert result["rows"][0]["ratio_vs_vanilla"] is None


def test_measure_interleaves_variants_round_robin_and_pairs_batches(monkeypatch):
    from oea.bench.layer.moe import init_weights

    gen = torch.Generator().manual_seed(0)
    shape = MoEShape(16, 2, 8, 4)
    variants = layer_inputs.sweep_variants(shape, 4, [2, 4, 8], num_batches=2, generator=gen)
    order: list[tuple[str, int]] = []

    def fake_time(self, fn):
        order.append((fn.variant.label, id(fn.experts)))
        return 1e-3

    monkeypatch.setattr(layer_timing._CpuTimer, "time", fake_time)
    copies = [init_weights(shape, torch.float32, seed=s) for s in range(2)]
    samples = layer_timing.measure(variants, copies, [torch.randn(4, 8)], "loop", "cpu", repeats=3, warmup=1)
    labels = [label for label, _ in order]
    assert labels == ["T=2", "T=4", "T=8", "T=4", "T=8", "T=2", "T=8", "T=2", "T=4", "T=2", "T=4", "T=8"]
    assert [id(c) for c in copies] * 6 == [experts for _, experts in order]  # weight copies rotate per call
    for v in variants:
        assert len(samples[v.label]) == 3  # warm-up dropped
        assert [s[1] for s in samples[v.label]] == [v.active[r % 2] for r in (1, 2, 3)]
