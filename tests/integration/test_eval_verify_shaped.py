"""Verify-shaped decoding on the embedded model: ``oea.attach(..., decode_tokens=1 + d)`` routes a forward of
B sequences x (1 + d) tokens as one decode step (the rows a speculative verify step routes together), and
``oea eval --draft-tokens d`` measures ΔCE and active experts on those rows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import oea  # noqa: E402
from oea.cli import main  # noqa: E402
from oea.eval import evaluate  # noqa: E402
from oea.eval.decode import _cache_kwarg, lockstep_cross_entropy  # noqa: E402
from oea.integrations.transformers import find_moe_layers  # noqa: E402

torch.set_num_threads(1)
DRAFTS = 3


@pytest.fixture(scope="module")
def rows(embedded):
    model, tokenizer = embedded
    options = {"tokenizer": tokenizer, "batch_sizes": (4,), "k0s": (3, 8), "policies": ("oea",), "positions": 12,
               "num_batches": 2, "generate_tokens": 0}
    return {d: evaluate(model, draft_tokens=d, **options) for d in (0, DRAFTS)}


def _row(rows: list[dict], policy: str, k0: int | None) -> dict:
    [row] = [r for r in rows if r["policy"] == policy and r["k0"] == k0]
    return row


def test_a_verify_shaped_forward_routes_all_its_rows_as_one_union(embedded) -> None:
    """One forward of [B, 1 + d] tokens: each layer's active experts equal ``oea.route`` over all B (1 + d)
    rows of its router's logits, fewer than those rows' own top-k union; a plain handle leaves it vanilla."""
    model, _ = embedded
    layers = find_moe_layers(model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.router.register_forward_hook(lambda m, a, out, i=layer.index: seen.__setitem__(i, out[0]))
             for layer in layers]
    ids = torch.randint(16, 4000, (4, 8 + 1 + DRAFTS), generator=torch.Generator().manual_seed(0))
    cfg = oea.OEAConfig(3)
    try:
        for decode_tokens, rerouted in ((1 + DRAFTS, True), (1, False)):
            handle = oea.attach(model, cfg, decode_tokens=decode_tokens)
            try:
                with torch.no_grad():
                    cache = {_cache_kwarg(model): transformers.DynamicCache()}
                    model(input_ids=ids[:, :8], use_cache=True, **cache)
                    before = {i: s["steps"] for i, s in handle.stats().items()}
                    model(input_ids=ids[:, 8:], use_cache=True, **cache)
                stats = handle.stats()
                active = handle.last_active_experts()
            finally:
                handle.remove()
            for layer in layers:
                logits = seen[layer.index]
                assert logits.shape[0] == 4 * (1 + DRAFTS)
                own = int(oea.active_experts(*oea.route(logits, layer.spec)))
                counted = stats[layer.index]["steps"] - before[layer.index]
                if rerouted:
                    assert counted == 1 and stats[layer.index]["tokens"] == 4 * (1 + DRAFTS)
                    assert active[layer.index] == int(oea.active_experts(*oea.route(logits, layer.spec, cfg)))
                    assert active[layer.index] < own
                else:
                    assert counted == 0, "a plain decode handle counted a 4-token forward as a decode step"
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.slow
def test_verify_shaped_vanilla_scores_the_same_tokens_as_plain_decode(rows) -> None:
    plain, verify = _row(rows[0], "vanilla", None), _row(rows[DRAFTS], "vanilla", None)
    assert verify["tokens"] == plain["tokens"] == 2 * 4 * 12 and verify["documents"] == plain["documents"]
    assert verify["cross_entropy"] == pytest.approx(plain["cross_entropy"], abs=2e-3)  # only numerics differ
    assert verify["decode_steps"] == plain["decode_steps"] // (1 + DRAFTS)
    assert (verify["draft_tokens"], verify["rows_per_step"]) == (DRAFTS, 4 * (1 + DRAFTS))
    assert (plain["draft_tokens"], plain["rows_per_step"]) == (0, 4)
    assert verify["mean_active_experts"] > plain["mean_active_experts"], "16 rows load more experts than 4"


@pytest.mark.slow
def test_verify_shaped_oea_is_paired_with_verify_shaped_vanilla(rows) -> None:
    vanilla, oea3, oea8 = (_row(rows[DRAFTS], p, k) for p, k in (("vanilla", None), ("oea", 3), ("oea", 8)))
    assert oea8["cross_entropy"] == pytest.approx(vanilla["cross_entropy"], abs=1e-5) and oea8["delta_ce"] == 0.0
    assert oea3["mean_active_experts"] < 0.7 * vanilla["mean_active_experts"]
    assert oea3["delta_ce"] == pytest.approx(oea3["cross_entropy"] - vanilla["cross_entropy"], abs=1e-9)
    low, high = oea3["delta_ce_ci"]
    assert low <= oea3["delta_ce"] <= high and oea3["verdict"] in ("worse", "better", "no significant difference")


def test_bad_draft_tokens_are_named(embedded) -> None:
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=r"draft_tokens \(--draft-tokens\) must be an integer in 0\.\.6, got 7"):
        evaluate(model, tokenizer=tokenizer, batch_sizes=(2,), positions=8, draft_tokens=7)
    with pytest.raises(ValueError, match=r"positions \(10, --positions\) must be a multiple of 1 \+ draft_tok"):
        evaluate(model, tokenizer=tokenizer, batch_sizes=(2,), positions=10, draft_tokens=3)
    with pytest.raises(ValueError, match=r"decode_tokens must be an integer >= 1, got 0"):
        oea.attach(model, oea.OEAConfig(3), decode_tokens=0)
    with pytest.raises(ValueError, match=r"step_tokens must be in 1\.\.7"):
        lockstep_cross_entropy(model, torch.zeros(2, 17, dtype=torch.int64), 8, step_tokens=8)


def test_cli_draft_tokens(capsys: pytest.CaptureFixture) -> None:
    code = main(["eval", "--batch-sizes", "2", "--k0", "3", "--policies", "oea", "--positions", "4",
                 "--num-batches", "1", "--no-generate", "--draft-tokens", "1"])
    assert code == 0
    assert "verify-shaped steps: B x (1 + 1) rows routed together" in capsys.readouterr().out
    assert main(["eval", "--positions", "5", "--draft-tokens", "1", "--batch-sizes", "2"]) == 2
    assert "--positions" in capsys.readouterr().err
