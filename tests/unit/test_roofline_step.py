"""Step-level roofline (``oea.sim.step``, ``oea roofline``'s ``step_*`` fields): every cost term against a
value worked out by hand for GLM-5-NVFP4 on 8x RTX PRO 6000 (the reference deployment), the GQA variants of
the attention terms, the interconnect and context flags, and the tensor-parallel sizes a model accepts."""

from __future__ import annotations

import json

import pytest

from oea.cli import main
from oea.presets import MODEL_PRESETS, get_gpu_preset, get_model_preset
from oea.sim.costmodel import CostModel, allowed_tp_sizes
from oea.sim.roofline import TraceRef, roofline, roofline_from_table
from oea.sim.step import INTERCONNECTS, StepModel, resolve_interconnect, with_interconnect

# GLM-5 (hidden 6144, 78 layers = 3 dense + 75 MoE, MLA: 64 heads, q_lora 2048, kv_lora 512, nope 192,
# rope 64, v 256; dense MLP 12288; one shared expert 2048; vocab 154880; bf16 outside the routed experts)
# on RTX PRO 6000 (1792 GB/s = 1792e3 B/µs; 500 TF bf16 = 5e8 FLOP/µs; 2000 TF fp4 = 2e9 FLOP/µs),
# link 64 GB/s = 64e3 B/µs with a 10 µs floor; tp = 8, B = 16, C = 2048.
BW, BF16, FP4, B, C, TP = 1792e3, 5e8, 2e9, 16, 2048, 8
# attention, per rank: split by heads (q_b 2048·64·256 + kv_b 512·64·448 + o 64·256·6144) / 8, replicated
# q_a + kv_a = 6144·(2048 + 512 + 64)
ATTN_PARAMS = (33_554_432 + 14_680_064 + 100_663_296) / 8 + 16_121_856  # = 34_734_080
ATTENTION = 78 * (ATTN_PARAMS * 2 / BW + 2 * B * ATTN_PARAMS / BF16)
# KV cache: B·C = 32768 cached tokens, 576 latent values of 2 bytes each, every rank reads all of it;
# attention FLOPs per cached token on one rank: 2·64·(2·512 + 64) / 8 = 17408
KV_CACHE = 78 * (32_768 * 576 * 2 / BW + 32_768 * 17_408 / BF16)
DENSE = 3 * (28_311_552 * 2 / BW + 2 * B * 28_311_552 / BF16)  # 3·6144·12288 / 8 weights per rank
SHARED = 75 * (4_718_592 * 2 / BW + 2 * B * 4_718_592 / BF16)  # 3·6144·2048 / 8
ALL_REDUCE = 2 * 78 * (10 + 2 * 7 / 8 * (16 * 6144 * 2) / 64e3)  # two per layer, [16, 6144] bf16 each
LM_HEAD = 118_947_840 * 2 / BW + 2 * B * 118_947_840 / BF16  # 154880·6144 / 8
# routed experts, T = 80 active, S = 128 token slots: 32 µs fixed + b·T + a·S per MoE layer, with
# b = 3·6144·2048·0.5625 B / 8 / BW and a = 2·3·6144·2048 / 8 / FP4
ROUTED = 75 * (32 + 21_233_664 / 8 / BW * 80 + 2 * 3 * 6144 * 2048 / 8 / FP4 * 128)
HAND_TERMS = {"attention": ATTENTION, "kv_cache": KV_CACHE, "dense_mlp": DENSE, "shared_experts": SHARED,
              "all_reduce": ALL_REDUCE, "lm_head": LM_HEAD}


def _glm5_step(context_len: int = C) -> StepModel:
    return StepModel(CostModel(get_model_preset("glm-5"), get_gpu_preset("rtx-pro-6000"), tp=TP), context_len)


def test_every_step_term_equals_the_hand_computed_value_for_glm5_on_rtx_pro_6000_tp8() -> None:
    step = _glm5_step()
    terms = step.terms_us(B)
    assert set(terms) == set(HAND_TERMS)
    for name, expected in HAND_TERMS.items():
        assert terms[name] == pytest.approx(expected, rel=1e-9), name
    assert step.routed_experts_us(80, 128) == pytest.approx(ROUTED, rel=1e-9)
    # the total is the sum of all seven parts: leaving any one out misses it by at least LM_HEAD (140 µs)
    assert step.step_us(B, 80, 128) == pytest.approx(sum(HAND_TERMS.values()) + ROUTED, rel=1e-9)
    assert min(HAND_TERMS.values()) > 100


def test_gqa_attention_replicates_kv_heads_beyond_their_count() -> None:
    """Qwen3-30B-A3B: 32 query heads, 4 kv heads of 128, hidden 2048; at tp 8 each rank holds 1/8 of q and o
    but 1/4 of k and v (and of their cache), as engines replicate kv heads past their number."""
    cost = CostModel(get_model_preset("qwen3-30b-a3b"), get_gpu_preset("h100-sxm"), tp=8)
    step = StepModel(cost, 1000)
    params = 2 * 2048 * 32 * 128 / 8 + 2 * 2048 * 4 * 128 / 4  # = 2_621_440
    bw, bf16 = 3350e3, 989e6
    terms = step.terms_us(4)
    assert terms["attention"] == pytest.approx(48 * (params * 2 / bw + 2 * 4 * params / bf16), rel=1e-9)
    kv = 4 * 1000 * (2 * 4 * 128 / 4) * 2 / bw + 4 * 1000 * (4 * 32 * 128 / 8) / bf16
    assert terms["kv_cache"] == pytest.approx(48 * kv, rel=1e-9)
    assert terms["dense_mlp"] == terms["shared_experts"] == 0.0  # every layer MoE, no shared expert


def test_roofline_rows_carry_the_step_figures_and_its_share() -> None:
    table = {("vanilla", None, 16): {"T": 80.0, "T_ci": [78.0, 82.0], "experts_per_token": 8.0},
             ("oea", 3, 16): {"T": 40.0, "T_ci": [39.0, 41.0], "ratio_ci": [0.49, 0.51],
                              "experts_per_token": 6.0}}
    [row] = roofline_from_table("glm-5", "rtx-pro-6000", 8, 1, [16], [3], table, TraceRef("t", 256, 8))
    step = _glm5_step()
    for name, expected in HAND_TERMS.items():
        assert row[f"step_{name}_us"] == pytest.approx(expected, rel=1e-9)
    assert row["step_routed_experts_vanilla_us"] == pytest.approx(ROUTED, rel=1e-9)
    assert row["step_latency_vanilla_us"] == pytest.approx(sum(HAND_TERMS.values()) + ROUTED, rel=1e-9)
    assert row["moe_share_of_step"] == pytest.approx(ROUTED / row["step_latency_vanilla_us"])
    oea = step.step_us(16, 40.0, 16 * 6.0)
    assert row["step_latency_oea_k0_3_us"] == pytest.approx(oea)
    assert row["predicted_step_gain_k0_3"] == pytest.approx(1 - oea / row["step_latency_vanilla_us"])
    low, high = row["predicted_step_gain_k0_3_ci"]
    assert low < row["predicted_step_gain_k0_3"] < high
    # the step gain is the layer gain diluted by everything OEA does not touch
    assert 0 < row["predicted_step_gain_k0_3"] < row["predicted_gain_k0_3"]
    assert (row["context_len"], row["interconnect_GBps"], row["interconnect_latency_us"]) == (2048, 64.0, 10.0)


def test_a_faster_link_and_a_shorter_context_raise_the_step_gain(capsys: pytest.CaptureFixture[str]) -> None:
    def gain(*flags: str) -> dict:
        assert main(["roofline", "--model", "glm-5", "--gpu", "rtx-pro-6000", "--tp", "8", "--batch-sizes", "16",
                     "--k0", "3", "--num-batches", "2", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)[0]

    pcie, nvlink = gain(), gain("--interconnect", "nvlink4")
    assert nvlink["interconnect"] == "nvlink4" and nvlink["interconnect_GBps"] == INTERCONNECTS["nvlink4"].GBps
    assert nvlink["step_all_reduce_us"] < pcie["step_all_reduce_us"]
    assert nvlink["predicted_step_gain_k0_3"] > pcie["predicted_step_gain_k0_3"]
    assert nvlink["predicted_gain_k0_3"] > pcie["predicted_gain_k0_3"]  # the MoE layer's all-reduce: same link
    slow = gain("--interconnect-latency-us", "40")
    assert slow["interconnect_latency_us"] == 40.0
    assert slow["predicted_step_gain_k0_3"] < pcie["predicted_step_gain_k0_3"]
    long = gain("--context-len", "32768")
    assert long["step_kv_cache_us"] == pytest.approx(16 * pcie["step_kv_cache_us"])
    assert long["predicted_step_gain_k0_3"] < pcie["predicted_step_gain_k0_3"]


def test_presets_without_a_decoder_shape_or_with_ep_say_why_there_is_no_step_figure() -> None:
    [row] = roofline("gpt-oss-120b", "b200", batch_sizes=[16], k0s=[3], trace=None)
    assert "has no decoder shape" in row["step_note"] and row["step_latency_vanilla_us"] is None
    [row] = roofline("deepseek-v3", "h200", ep=8, batch_sizes=[16], k0s=[3], trace=None)
    assert "tensor parallelism only" in row["step_note"] and row["predicted_step_gain_k0_3"] is None


def test_every_decoder_shape_agrees_with_its_preset() -> None:
    for preset in MODEL_PRESETS.values():
        if preset.decoder is not None:
            assert preset.decoder.num_moe_layers == preset.num_moe_layers, preset.name
            assert 8 in allowed_tp_sizes(preset) or preset.name == "embedded", preset.name


def test_tp_the_model_does_not_divide_is_an_error_naming_the_flag_and_the_sizes(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--model", "glm-5", "--tp", "3", "--trace", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tp must split glm-5's" in err
    assert "num_attention_heads=64" in err and "one of [1, 2, 4, 8, 16, 32, 64], got 3" in err
    assert allowed_tp_sizes(get_model_preset("glm-5")) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="tp must split glm-5's moe_intermediate_size=2048"):
        CostModel(get_model_preset("glm-5"), get_gpu_preset("rtx-pro-6000"), tp=6)
    # GQA: tp may exceed the kv heads (they are replicated) when it divides the query heads
    assert 8 in allowed_tp_sizes(get_model_preset("qwen3-30b-a3b"))


def test_interconnect_and_context_flags_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fragment in [(["--interconnect", "nope"], "argument --interconnect: invalid choice"),
                           (["--interconnect-gbps", "0"], "argument --interconnect-gbps: must be a number > 0"),
                           (["--interconnect-latency-us", "-1"], "argument --interconnect-latency-us"),
                           (["--context-len", "0"], "argument --context-len: must be an integer >= 1")]:
        assert main(["roofline", "--trace", "none", *argv]) == 2
        assert fragment in capsys.readouterr().err
    with pytest.raises(ValueError, match="--context-len must be an integer >= 1"):
        roofline("glm-5", "rtx-pro-6000", tp=8, batch_sizes=[16], trace=None, context_len=0)
    link = resolve_interconnect(get_gpu_preset("rtx-pro-6000"), "pcie-gen4", latency_us=25.0)
    assert (link.GBps, link.latency_us) == (32.0, 25.0)
    assert with_interconnect(get_gpu_preset("h100-sxm"), link).interconnect_GBps == 32.0
