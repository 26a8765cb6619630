"""``oea bench decode`` on a tiny configuration (the embedded model, not inflated, or inflated to 64):
row contract, ratios, active experts, the k0 = top_k identity check, the static-cache decode loop against
``generate``, device / compile selection, bad input. Timings are not asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from oea.bench.decode.run import (  # noqa: E402
    DecodeBenchConfig,
    _Samples,
    batch_rows,
    make_variants,
    prompt_batch,
    resolve_device,
    rotated,
    run_decode_bench,
)
from oea.bench.decode.step import Decoder, StepTimer, resolve_graph_mode  # noqa: E402
from oea.cli import main  # noqa: E402

ROW_FIELDS = {"policy", "k0", "batch_size", "step_ms_median", "step_ms_ci", "ratio_vs_vanilla", "mean_active_experts",
              "tokens_per_s", "ratio_ci", "token_match_vs_vanilla"}
TINY = {"like": None, "batch_sizes": (1, 4), "rounds": 2, "new_tokens": 3, "prompt_tokens": 8, "threads": 1,
        "device": "cpu"}


@pytest.fixture(scope="module")
def result() -> dict:
    return run_decode_bench(DecodeBenchConfig(k0s=(1, 8), policies=("oea", "pruned"), **TINY))


def test_rows_follow_the_contract(result: dict) -> None:
    rows = result["rows"]
    assert [(r["batch_size"], r["policy"], r["k0"]) for r in rows] == [
        (b, p, k) for b in (1, 4) for p, k in (("vanilla", None), ("oea", 1), ("oea", 8), ("pruned", 1), ("pruned", 8))]
    for row in rows:
        assert row.keys() >= ROW_FIELDS
        lo, hi = row["step_ms_ci"]
        assert 0 < lo <= row["step_ms_median"] <= hi
        assert row["steps"] == 2 * 3
        assert row["tokens_per_s"] == pytest.approx(row["batch_size"] * 1e3 / row["step_ms_median"])
        if row["policy"] == "vanilla":
            assert row["ratio_vs_vanilla"] == 1.0 and row["token_match_vs_vanilla"] == 1.0
        else:
            assert row["ratio_ci"][0] <= row["ratio_vs_vanilla"] <= row["ratio_ci"][1]
    assert result["device"] == "cpu" and result["graph"] == "none" and result["graph_fallbacks"] == []
    assert result["model"]["moe_intermediate_size"] == 48
    json.dumps(result)  # JSON-serialisable as printed by --json


def test_active_experts_and_identity(result: dict) -> None:
    at = {(r["batch_size"], r["label"]): r for r in result["rows"]}
    assert at[(1, "vanilla")]["mean_active_experts"] == 8.0  # one token: its top-8 (min_batch keeps B=1 vanilla)
    assert at[(4, "oea k0=1")]["mean_active_experts"] < at[(4, "vanilla")]["mean_active_experts"]
    assert at[(4, "oea k0=8")]["mean_active_experts"] == at[(4, "vanilla")]["mean_active_experts"]
    assert at[(4, "oea k0=8")]["token_match_vs_vanilla"] == 1.0
    assert at[(4, "pruned k0=1")]["token_match_vs_vanilla"] < 1.0  # the comparison can tell tokens apart
    assert result["identity"] == {"1": True, "4": True} and result["k0_top_k_identical"] is True


def test_static_cache_decode_matches_generate() -> None:
    from oea.models import load_model

    model, _tok = load_model(None, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    prompts = torch.randint(5, 4000, (3, 8), generator=torch.Generator().manual_seed(1))
    tokens, seconds = Decoder(model, 3, 8, 5, "cpu").run(prompts, StepTimer("cpu"))
    with torch.no_grad():
        reference = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                                   do_sample=False, pad_token_id=0)[:, 8:]
    assert len(seconds) == 5 and torch.equal(tokens, reference)


def test_ratio_and_ci_from_paired_steps() -> None:
    variants = make_variants(["oea"], [3], top_k=8)
    tokens = [torch.zeros(2, 4, dtype=torch.int64)] * 2
    vanilla = _Samples([[0.010, 0.012, 0.011], [0.013, 0.010, 0.012]], tokens, [20.0, 20.0], [20.0, 20.0])
    half = _Samples([[t / 2 for t in r] for r in vanilla.seconds], tokens, [9.0, 11.0], [20.0, 20.0])
    rows = batch_rows(variants, {"vanilla": vanilla, "oea k0=3": half}, 2, np.random.default_rng(0))
    assert rows[1]["ratio_vs_vanilla"] == pytest.approx(0.5)
    assert rows[1]["ratio_ci"] == pytest.approx([0.5, 0.5])
    assert rows[1]["mean_active_experts"] == 10.0 and rows[0]["step_ms_median"] == pytest.approx(11.5)


def test_variants_order_and_rotation() -> None:
    labels = [v.label for v in make_variants(["oea", "pruned"], [3, 5, 3], top_k=8)]
    assert labels == ["vanilla", "oea k0=3", "oea k0=5", "pruned k0=3", "pruned k0=5"]
    names = ["a", "b", "c"]
    assert [rotated(names, r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                     ["a", "b", "c"]]
    assert prompt_batch([list(range(50)), list(range(100, 120))], 4, 10, seed=0).shape == (4, 10)


def test_device_and_compile_selection() -> None:
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    with pytest.raises(ValueError, match=r"--device cuda: torch\.cuda\.is_available"):
        resolve_device("cuda", cuda_available=False)
    assert resolve_graph_mode("auto", "cuda") == "capture" and resolve_graph_mode("auto", "cpu") == "none"
    assert resolve_graph_mode("compile", "cpu") == "compile" and resolve_graph_mode("none", "cuda") == "none"
    with pytest.raises(ValueError, match="--graph capture needs --device cuda"):
        resolve_graph_mode("capture", "cpu")


def test_failed_capture_warns_and_falls_back_to_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.models import load_model

    model, _tok = load_model(None, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    compiled_calls = []

    def fake_compile(fn, **kwargs):  # CPU stand-in: record the options, run eagerly
        compiled_calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    decoder = Decoder(model, 2, 8, 3, "cpu", mode="capture")  # the CPU side of the CUDA path

    def failing_capture():
        raise RuntimeError("operation not permitted when stream is capturing")

    decoder.prefill(torch.randint(5, 4000, (2, 8)))
    with pytest.warns(RuntimeWarning, match="capture of the decode step failed"):
        decoder.capture(failing_capture)
    assert decoder.mode == "compile" and "not permitted" in decoder.fallback_error
    prompts = torch.randint(5, 4000, (2, 8), generator=torch.Generator().manual_seed(2))
    tokens, seconds = decoder.run(prompts, StepTimer("cpu"))
    eager, _ = Decoder(model, 2, 8, 3, "cpu").run(prompts, StepTimer("cpu"))
    assert torch.equal(tokens, eager) and len(seconds) == 3
    assert compiled_calls == [{"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}]


@pytest.mark.parametrize(("argv", "message"), [
    (["--k0", "9"], "--k0 values must be in 1..8 (the model's top_k), got [9]"),
    (["--policies", "magic"], "--policies must be among ['oea', 'pruned'], got ['magic']"),
    (["--batch-sizes", "0"], "--batch-sizes must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--like", "qwen9"], "--like must be one of"),
    (["--like", "qwen3-30b-a3b", "--moe-intermediate-size", "64"], "at most one of --like and --moe-intermediate"),
    (["--graph", "capture"], "--graph capture needs --device cuda"),
])
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "decode", "--device", "cpu", "--batch-sizes", "1", "--new-tokens", "1",
                 "--rounds", "1", "--like", "none", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_json_with_a_small_inflation(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    plot = tmp_path / "decode.png"
    code = main(["bench", "decode", "--moe-intermediate-size", "64", "--device", "cpu", "--threads", "1",
                 "--batch-sizes", "2", "--k0", "3", "--rounds", "1", "--new-tokens", "2", "--prompt-tokens", "8",
                 "--json", "--plot", str(plot)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["moe_intermediate_size"] == 64 and out["model"]["moe_intermediate_size_base"] == 48
    assert [r["label"] for r in out["rows"]] == ["vanilla", "oea k0=3"] and out["k0_top_k_identical"] is True
    assert plot.stat().st_size > 0


def test_k0_equal_top_k_hands_the_router_s_own_routing_back_ties_included() -> None:
    """Routers' top-k breaks exact ties in its own (implementation-defined) order, ``oea.route`` by the lower
    index; at k0 = top_k ``oea.attach`` must keep the router's output, so the tokens are the model's."""
    import oea
    from oea.models import load_model

    model, _tok = load_model(None, dtype=torch.bfloat16, experts_implementation="grouped_mm")
    with torch.no_grad():
        for layer in model.model.layers:  # experts 8..127 share one router row: 120-way exact ties
            layer.mlp.gate.weight[8:] = layer.mlp.gate.weight[8]
        tokens = torch.randint(5, 4000, (32, 1), generator=torch.Generator().manual_seed(3))
        base = model(tokens).logits
        with oea.attach(model, oea.OEAConfig(8)) as handle:
            kept = model(tokens).logits
            stats = handle.stats()[0]
    assert stats["steps"] == 1 and stats["mean_active_experts"] == stats["mean_active_experts_vanilla"]
    assert torch.equal(kept, base)
