"""``oea.eval.evaluate`` and ``oea eval`` on the shipped embedded model, with tiny sizes."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oea.cli import main  # noqa: E402
from oea.eval import evaluate  # noqa: E402
from oea.models import heldout_documents  # noqa: E402

torch.set_num_threads(1)

FIELDS = {"policy", "k0", "batch_size", "cross_entropy", "stderr", "mean_active_experts", "mean_experts_per_token",
          "delta_ce", "verdict", "generation_agreement"}


@pytest.fixture(scope="module")
def rows(embedded):
    model, tokenizer = embedded
    return evaluate(model, tokenizer=tokenizer, batch_sizes=(4,), k0s=(3, 8), positions=12, num_batches=2,
                    generate_tokens=6)


def _row(rows, policy, k0):
    [row] = [r for r in rows if r["policy"] == policy and r["k0"] == k0]
    return row


def _unigram_entropy(tokenizer) -> float:
    """Entropy (nats) of the held-out text's own unigram distribution: no unigram model does better."""
    ids = [i for _, text in heldout_documents() for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    p = torch.bincount(torch.tensor(ids)).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


@pytest.mark.slow
def test_rows_and_fields(rows) -> None:
    assert [(r["policy"], r["k0"]) for r in rows] == [
        ("vanilla", None), ("pruned", 3), ("oea", 3), ("pruned", 8), ("oea", 8)]
    for r in rows:
        assert set(r) >= FIELDS
        assert r["batch_size"] == 4 and r["documents"] == 8 and r["tokens"] == 2 * 4 * 12
        # k0 = top_k routes as vanilla: its rows say so instead of testing a zero difference
        identical = r["k0"] == 8
        expected = {"identical"} if identical else {"reference", "worse", "better", "no significant difference"}
        assert r["verdict"] in expected, (r["policy"], r["k0"], r["verdict"])
        expected = {"identical"} if identical else {"reference", "worse", "no worse"}
        assert r["paper_verdict"] in expected, (r["policy"], r["k0"], r["paper_verdict"])
        low, high = r["cross_entropy_ci"]
        assert low < r["cross_entropy"] < high and r["mean_active_experts_ci"] is not None
        assert math.isfinite(r["cross_entropy"]) and r["stderr"] > 0


@pytest.mark.slow
def test_vanilla_ce_far_below_unigram(rows, embedded) -> None:
    vanilla = _row(rows, "vanilla", None)
    assert vanilla["cross_entropy"] < _unigram_entropy(embedded[1]) - 1.5
    assert vanilla["delta_ce"] == 0.0 and vanilla["generation_agreement"] == 1.0
    assert vanilla["mean_experts_per_token"] == 8.0


@pytest.mark.slow
def test_oea_at_k0_equal_top_k_is_vanilla(rows) -> None:
    vanilla, oea8 = _row(rows, "vanilla", None), _row(rows, "oea", 8)
    assert oea8["cross_entropy"] == pytest.approx(vanilla["cross_entropy"], abs=1e-5)
    assert oea8["mean_active_experts"] == vanilla["mean_active_experts"]
    assert oea8["generation_agreement"] == 1.0
    assert _row(rows, "pruned", 8)["cross_entropy"] == pytest.approx(vanilla["cross_entropy"], abs=1e-5)


@pytest.mark.slow
def test_small_k0_lowers_active_experts(rows) -> None:
    vanilla, oea3, pruned3 = _row(rows, "vanilla", None), _row(rows, "oea", 3), _row(rows, "pruned", 3)
    assert oea3["mean_active_experts"] < vanilla["mean_active_experts"]
    # both load |S_base| only (the layers' inputs differ, so the unions are close, not equal)
    assert pruned3["mean_active_experts"] < vanilla["mean_active_experts"]
    assert oea3["mean_active_experts"] == pytest.approx(pruned3["mean_active_experts"], rel=0.25)
    assert pruned3["mean_experts_per_token"] == 3.0
    assert 3.0 <= oea3["mean_experts_per_token"] <= 8.0
    assert pruned3["cross_entropy"] > vanilla["cross_entropy"]


def test_bad_inputs_are_named(embedded) -> None:
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=r"1\.\.8"):
        evaluate(model, tokenizer=tokenizer, k0s=(9,), batch_sizes=(2,), positions=2)
    with pytest.raises(ValueError, match="policies"):
        evaluate(model, tokenizer=tokenizer, policies=("topp",), batch_sizes=(2,), positions=2)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        evaluate("/nonexistent/no-such-dir")


def test_model_without_moe_blocks_is_rejected(embedded) -> None:
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    dense = transformers.LlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match="no MoE blocks"):
        evaluate(dense, tokenizer=embedded[1], batch_sizes=(2,), positions=2)


def test_unsupported_router_is_named(embedded) -> None:
    class PlainGate(torch.nn.Linear):
        pass

    model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(
        embedded[0].config._name_or_path, num_hidden_layers=1)).eval()
    model.model.layers[0].mlp.gate = PlainGate(model.config.hidden_size, 128, bias=False)
    with pytest.raises(ValueError, match="PlainGate"):
        evaluate(model, tokenizer=embedded[1], batch_sizes=(2,), positions=2)


@pytest.mark.slow
def test_cli_json_and_errors(capsys) -> None:
    code = main(["eval", "--batch-sizes", "2", "--k0", "3", "--positions", "4", "--num-batches", "1",
                 "--generate-tokens", "3", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["k0"], r["batch_size"]) for r in out] == [
        ("vanilla", None, 2), ("pruned", 3, 2), ("oea", 3, 2)]
    assert main(["eval", "--k0", "9", "--batch-sizes", "2", "--positions", "2", "--json"]) == 2
    assert "1..8" in capsys.readouterr().err
    assert main(["eval", "--model", "/nonexistent/ckpt", "--json"]) == 2
    assert "/nonexistent/ckpt" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_table(capsys) -> None:
    code = main(["eval", "--batch-sizes", "2", "--k0", "3", "--positions", "3", "--num-batches", "1",
                 "--no-generate"])
    assert code == 0
    out = capsys.readouterr().out
    assert "oea eval" in out and "vanilla" in out and "pruned" in out
