"""Presets and the latency cost model, checked against datasheet arithmetic and the paper's tables."""

from __future__ import annotations

import json
import pathlib

import pytest

from oea.presets import (
    MODEL_PRESETS,
    GpuPreset,
    ModelPreset,
    cpu_preset,
    get_gpu_preset,
    get_model_preset,
    gpu_preset_names,
    load_cpu_fit,
)
from oea.sim.costmodel import CostModel, uniform_active_experts, uniform_max_device_active
from oea.sim.roofline import roofline

REQUIRED_MODELS = {"qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "glm-4.5-air", "glm-5", "gpt-oss-120b",
                   "mixtral-8x7b", "olmoe-1b-7b", "embedded"}


def test_required_presets_exist_with_expert_bytes() -> None:
    assert set(MODEL_PRESETS) >= REQUIRED_MODELS
    assert {"h100-sxm", "h200", "b200", "rtx-pro-6000", "cpu"} <= set(gpu_preset_names())
    qwen = get_model_preset("qwen3-30b-a3b")
    assert (qwen.num_experts, qwen.top_k, qwen.hidden_size, qwen.moe_intermediate_size, qwen.num_moe_layers) == (
        128, 8, 2048, 768, 48)
    assert qwen.expert_bytes == 3 * 2048 * 768 * 2
    glm5 = get_model_preset("glm-5")
    assert (glm5.num_experts, glm5.top_k, glm5.scoring, glm5.n_group) == (256, 8, "sigmoid", 1)
    assert glm5.expert_bytes == pytest.approx(3 * 6144 * 2048 * 0.5625)
    embedded = get_model_preset("embedded")
    assert (embedded.num_experts, embedded.top_k, embedded.hidden_size, embedded.moe_intermediate_size,
            embedded.num_moe_layers) == (128, 8, 128, 48, 4)
    for preset in MODEL_PRESETS.values():
        assert preset.source, preset.name


def test_unknown_preset_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"model preset must be one of .*qwen3-30b-a3b.*got 'gpt-5'"):
        get_model_preset("gpt-5")
    with pytest.raises(ValueError, match=r"gpu preset must be one of .*h100-sxm.*got 'tpu'"):
        get_gpu_preset("tpu")


def test_cost_slope_from_the_datasheet_matches_the_papers_measured_slope() -> None:
    # Paper Table 3/4 (Qwen3-30B-A3B, 1x H100): 175.7 µs at T=48.8, 106.8 µs at T=25.1 -> 2.91 µs/expert.
    model = CostModel(get_model_preset("qwen3-30b-a3b"), get_gpu_preset("h100-sxm"))
    slope = (model.layer_latency_us(48.8, 128) - model.layer_latency_us(25.1, 128)) / (48.8 - 25.1)
    assert slope == pytest.approx((175.7 - 106.8) / (48.8 - 25.1), rel=0.05)
    assert model.layer_latency_us(48.8, 128) == pytest.approx(175.7, rel=0.10)


def test_tp8_prediction_is_near_the_papers_235b_table() -> None:
    # Paper §11.3: Qwen3-235B-A22B, TP8 on H100, latency incl. all-reduce: 119.4 µs (T=54.0), 87.7 (T=28.3).
    model = CostModel(get_model_preset("qwen3-235b-a22b"), get_gpu_preset("h100-sxm"), tp=8)
    # ring all-reduce of the [16, 4096] bf16 output over 8 GPUs: 5 µs + 2·7/8 · 131072 B / 450 GB/s
    assert model.allreduce_us(16) == pytest.approx(5.0 + 2 * 7 / 8 * 16 * 4096 * 2 / 450e3)
    assert CostModel(get_model_preset("qwen3-235b-a22b"), get_gpu_preset("h100-sxm")).allreduce_us(16) == 0.0
    assert model.layer_latency_us(54.0, 128, 16) == pytest.approx(119.4, rel=0.10)
    assert model.layer_latency_us(28.3, 128, 16) == pytest.approx(87.7, rel=0.15)
    single = CostModel(get_model_preset("qwen3-235b-a22b"), get_gpu_preset("h100-sxm"))
    assert single.expert_load_us == pytest.approx(8 * model.expert_load_us)


def test_expert_parallel_latency_follows_the_busiest_device() -> None:
    model = CostModel(get_model_preset("qwen3-30b-a3b"), get_gpu_preset("h200"), ep=8)
    balanced = model.layer_latency_us(64, 128, 16)
    skewed = model.layer_latency_us(64, 128, 16, max_device_active=16)
    assert skewed - balanced == pytest.approx(model.expert_load_us * 8 + model.token_compute_us * 128 / 8 * 1,
                                              rel=1e-6)
    assert 64 / 8 <= uniform_max_device_active(128, 8, 16, 8) <= 16
    with pytest.raises(ValueError, match="ep must divide"):
        CostModel(get_model_preset("qwen3-30b-a3b"), get_gpu_preset("h200"), ep=3)


def test_expert_parallel_layer_latency_counts_the_all_to_all_both_ways() -> None:
    """One configuration worked out by hand: the all-to-all moves the token activations to the experts'
    devices (dispatch) and the results back (combine), so it is paid twice."""
    model = ModelPreset(name="hand", num_experts=16, top_k=2, hidden_size=1024, moe_intermediate_size=512,
                        num_moe_layers=1, bytes_per_weight=2.0)
    gpu = GpuPreset(name="hand", hbm_bandwidth_GBps=1000.0, peak_tflops_bf16=100.0, launch_overhead_us=10.0,
                    interconnect_GBps=100.0, interconnect_latency_us=5.0)
    cost = CostModel(model, gpu, ep=4)
    # one expert: 3 * 1024 * 512 = 1,572,864 weights = 3,145,728 bytes -> 3.145728 µs at 1000 GB/s;
    # one token slot: 2 * 1,572,864 FLOPs -> 0.03145728 µs at 100 TFLOP/s.
    # B = 16 tokens, S = 32 slots over T = 8 experts, the busiest device holds 3 of them:
    #   memory   3 * 3.145728                        =  9.437184
    #   compute  (32 * 3 / 8 = 12 slots) * 0.03145728 =  0.37748736
    #   launch                                        = 10
    #   all-to-all: 3/4 of the 32 slots leave their device: 24 * 1024 * 2 B = 49,152 B,
    #     one way 5 µs + 49,152 B / 100 GB/s = 5.49152 µs; dispatch + combine = 10.98304
    expected = 9.437184 + 0.37748736 + 10.0 + 10.98304
    assert cost.layer_latency_us(8, 32, 16, max_device_active=3) == pytest.approx(expected, rel=1e-9)
    assert CostModel(model, gpu).layer_latency_us(8, 32, 16) == pytest.approx(
        10.0 + 8 * 3.145728 + 32 * 0.03145728, rel=1e-9), "without EP there is no all-to-all"


def test_cpu_preset_is_unmeasured_without_the_fit_file(tmp_path: pathlib.Path) -> None:
    preset = cpu_preset(tmp_path / "missing.json")
    assert not preset.measured and "unmeasured" in preset.source
    with pytest.raises(ValueError, match="unmeasured"):
        CostModel(get_model_preset("embedded"), preset)


def test_cpu_preset_reproduces_the_measured_fit(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"a_us": 0.5, "b_us": 20.0, "c_us": 100.0, "r2": 0.99, "preset": "embedded",
                                "measured_on": "test"}))
    preset = cpu_preset(path)
    model = CostModel(get_model_preset("embedded"), preset)
    assert model.layer_latency_us(40, 128) == pytest.approx(100.0 + 20.0 * 40 + 0.5 * 128)
    path.write_text(json.dumps({"a_us": "x", "b_us": 1, "c_us": 1, "r2": 1, "preset": "embedded",
                                "measured_on": "t"}))
    with pytest.raises(ValueError, match=r"fit\.json: field 'a_us'"):
        load_cpu_fit(path)
    unusable = cpu_preset(path)
    assert not unusable.measured and "field 'a_us'" in unusable.source


def test_roofline_is_memory_bound_at_decode_and_compute_bound_at_huge_batches() -> None:
    rows = roofline("qwen3-30b-a3b", "h100-sxm", batch_sizes=[1, 16, 16384], trace=None)
    assert [r["bound"] for r in rows] == ["memory", "memory", "compute"]
    assert rows[1]["uniform_active_experts"] == pytest.approx(uniform_active_experts(128, 8, 16))
    assert rows[0]["ridge_point_flops_per_byte"] == pytest.approx(989e12 / 3350e9)


def test_roofline_scales_trace_T_to_a_model_of_another_size() -> None:
    """T measured on a trace of N=128, k=8 is carried to glm-5 (N=256, k=8) by the uniform-routing ratio;
    on a model of the trace's own size it is used as is."""
    from oea.sim.roofline import TraceRef, roofline_from_table

    table = {("vanilla", None, 16): {"T": 60.0, "T_device": None, "experts_per_token": 8.0},
             ("oea", 3, 16): {"T": 30.0, "T_device": None, "experts_per_token": 6.0}}
    trace = TraceRef("t", 128, 8)
    [glm] = roofline_from_table("glm-5", "h100-sxm", 1, 1, [16], [3], table, trace)
    ratio = uniform_active_experts(256, 8, 16) / uniform_active_experts(128, 8, 16)
    assert glm["trace_vanilla_active_experts"] == pytest.approx(60.0 * ratio)
    assert glm["oea_k0_3_active_experts"] == pytest.approx(30.0 * ratio)
    [qwen] = roofline_from_table("qwen3-30b-a3b", "h100-sxm", 1, 1, [16], [3], table, trace)
    assert (qwen["trace_vanilla_active_experts"], qwen["oea_k0_3_active_experts"]) == (60.0, 30.0)
    cost = CostModel(get_model_preset("qwen3-30b-a3b"), get_gpu_preset("h100-sxm"))
    assert qwen["latency_oea_k0_3_us"] == pytest.approx(cost.layer_latency_us(30.0, 16 * 6.0, 16))
    assert qwen["predicted_gain_k0_3"] == pytest.approx(1 - qwen["latency_oea_k0_3_us"] / cost.layer_latency_us(
        60.0, 16 * 8.0, 16))


def test_roofline_with_the_trace_predicts_an_oea_gain_for_glm5_tp8() -> None:
    rows = roofline("glm-5", "rtx-pro-6000", tp=8, batch_sizes=[16], k0s=[3], num_batches=2)
    row = rows[0]
    assert row["bound"] == "memory"
    assert row["oea_k0_3_active_experts"] < row["trace_vanilla_active_experts"] < row["uniform_active_experts"]
    assert 0 < row["predicted_gain_k0_3"] < 1
