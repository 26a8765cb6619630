"""``capture_decode`` on tiny transformers MoE models: real lock-step decode, logits the model used."""

from __future__ import annotations

import pathlib

import pytest
import torch

import oea
from oea.traces import load_trace, save_trace
from oea.traces.capture import capture_decode, document_prompts

pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_capture_records_one_router_call_per_step_and_round_trips(family: str, tmp_path: pathlib.Path) -> None:
    from oea.testing import tiny_moe

    model = tiny_moe(family, num_experts=16, top_k=4)
    prompts = [[(7 * i + j) % 256 for j in range(6)] for i in range(4)]
    trace = capture_decode(model, prompts, new_tokens=5, request_names=list("abcd"))
    assert tuple(trace.logits.shape) == (20, 2, 16)
    assert trace.request_ids.tolist()[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert trace.positions.tolist()[:8] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (trace.correction_bias is not None) == (family == "deepseek_v3")
    back = load_trace(str(save_trace(trace, tmp_path / f"{family}.safetensors")))
    torch.testing.assert_close(back.logits, trace.logits.float())
    assert back.spec.scoring == trace.spec.scoring


def test_recorded_logits_are_the_routers_logits_for_the_decoded_tokens() -> None:
    from oea.testing import tiny_moe

    model = tiny_moe("qwen3_moe", num_experts=16, top_k=4)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6]]
    trace = capture_decode(model, prompts, new_tokens=3)
    # Re-run the full sequences (prompt + greedy continuation) without cache; the router of layer 0
    # must see the same inputs at the decode positions.
    with torch.no_grad():
        ids = torch.tensor(prompts)
        for _ in range(3):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        seen = []
        router = model.model.layers[0].mlp.gate
        handle = router.register_forward_hook(lambda _m, _i, out: seen.append(out[0].detach()))
        model(input_ids=ids)  # prompt (positions 0-3) + the 3 tokens fed at decode steps 0-2
        handle.remove()
    full = seen[0].reshape(2, -1, 16)  # [B, positions, N]
    recorded = trace.logits[:, 0].float().reshape(3, 2, 16)  # [step, B, N]
    for step in range(3):
        torch.testing.assert_close(recorded[step], full[:, 4 + step], atol=2e-3, rtol=1e-2)
    ids_recorded, _ = oea.route(trace.logits[:, 0].float(), trace.spec)
    assert ids_recorded.shape == (6, 4)


def test_document_prompts_take_distinct_documents_and_fail_clearly() -> None:
    class Tok:
        def encode(self, text: str) -> list[int]:
            return [ord(c) % 50 for c in text]

    docs = [(f"d{i}", "x" * (3 + i)) for i in range(6)]
    prompts, names = document_prompts(Tok(), docs, batch_size=3, prompt_tokens=5, seed=0)
    assert len(set(names)) == 3 and all(len(p) == 5 for p in prompts)
    with pytest.raises(ValueError, match="only 4 documents have >= 5 tokens"):
        document_prompts(Tok(), docs, batch_size=5, prompt_tokens=5, seed=0)


def test_a_captured_grouped_sigmoid_trace_replays_through_the_simulator() -> None:
    from oea.sim import simulate
    from oea.testing import tiny_moe

    model = tiny_moe("deepseek_v3", num_experts=16, top_k=4)
    prompts = [[(5 * i + j) % 256 for j in range(5)] for i in range(6)]
    trace = capture_decode(model, prompts, new_tokens=3)
    rows = simulate(trace, policies=["vanilla", "oea"], k0s=[1], batch_sizes=[6], mode="lockstep", num_batches=3)
    vanilla, oea_row = rows
    assert oea_row["mean_active_experts"] <= vanilla["mean_active_experts"]
    assert 0 < oea_row["kept_mass"] <= 1.0 + 1e-6
    # the per-layer selection bias travels with the trace, so replay uses the model's own biased router
    own = model.model.layers[1].mlp.gate
    torch.testing.assert_close(trace.layer_spec(1).correction_bias, own.e_score_correction_bias.float())
    assert trace.spec.n_group == 4 and trace.spec.topk_group == 2
