"""The inflated embedded model computes the base model's function: same logits (float32: to float
rounding; bf16: within bf16 rounding), same greedy tokens over several prompts and batch sizes; the
checkpoint written to disk is the in-memory inflation, padding included."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from oea.models import heldout_documents, load_model  # noqa: E402
from oea.models.inflate import inflate_model, load_inflated, write_inflated  # noqa: E402

torch.set_num_threads(1)
SIZE = 96  # small: the test is about the function, not the bytes
PROMPT_TOKENS, NEW_TOKENS = 24, 12


@pytest.fixture(scope="module")
def prompts() -> torch.Tensor:
    _model, tokenizer = load_model(None)
    docs = [text for _name, text in heldout_documents()][:6]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][40:40 + PROMPT_TOKENS] for text in docs]
    return torch.tensor(rows)


def _greedy(model: torch.nn.Module, prompts: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_logits_and_greedy_tokens_as_the_base_model(prompts: torch.Tensor, dtype: torch.dtype) -> None:
    base, _ = load_model(None, dtype=dtype)
    wide, _ = load_inflated(None, moe_intermediate_size=SIZE, dtype=dtype)
    assert wide.model.layers[0].mlp.experts.gate_up_proj.shape[1] == 2 * SIZE
    with torch.no_grad():
        base_logits = base(prompts).logits.float()
        wide_logits = wide(prompts).logits.float()
    if dtype == torch.float32:
        torch.testing.assert_close(wide_logits, base_logits, rtol=1e-4, atol=1e-4)
    else:  # bf16 keeps 8 bits of mantissa: differences within a few bf16 ulps of the logit's size
        diff = (wide_logits - base_logits).abs()
        assert bool((diff <= 4 * 2.0**-8 * base_logits.abs().clamp_min(1.0)).all()), float(diff.max())
    for batch in (1, 2, 6):  # several batch sizes, several prompts
        assert torch.equal(_greedy(wide, prompts[:batch]), _greedy(base, prompts[:batch])), batch


def test_checkpoint_on_disk_is_the_in_memory_inflation(tmp_path: Path, prompts: torch.Tensor) -> None:
    out = tmp_path / "inflated"
    summary = write_inflated(out, moe_intermediate_size=SIZE, seed=3)
    assert summary["size"] == SIZE
    from_disk, _ = load_model(out, dtype=torch.bfloat16)
    in_memory, _ = load_model(None, dtype=torch.bfloat16)
    inflate_model(in_memory, moe_intermediate_size=SIZE, seed=3)
    disk_params, memory_params = dict(from_disk.named_parameters()), dict(in_memory.named_parameters())
    assert disk_params.keys() == memory_params.keys()
    for name, value in disk_params.items():
        assert torch.equal(value, memory_params[name]), name
    experts = from_disk.model.layers[2].mlp.experts
    assert torch.all(experts.down_proj[:, :, 48:] == 0)
    assert torch.all(experts.gate_up_proj[:, 48:SIZE] != 0) and torch.all(experts.gate_up_proj[:, SIZE + 48:] != 0)


def test_in_memory_inflation_refuses_when_memory_is_short() -> None:
    model, _ = load_model(None, dtype=torch.bfloat16)
    before = model.model.layers[0].mlp.experts.gate_up_proj.shape
    with pytest.raises(ValueError, match=r"not enough memory for inflating to moe_intermediate_size 12288: needs 4\.4"):
        inflate_model(model, like="qwen3-30b-a3b", available_memory=2**30)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == before
    with pytest.raises(ValueError, match="not a supported MoE family"):
        inflate_model(torch.nn.Linear(2, 2), moe_intermediate_size=96)  # type: ignore[arg-type]
