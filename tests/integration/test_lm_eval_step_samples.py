"""``oea.eval.lm_eval_bridge.step_samples``: the per-decode-step samples behind ``oea eval lm-eval``'s intervals,
checked against the handle's own per-layer counters on the embedded model (no lm-eval needed)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import oea  # noqa: E402
from oea.eval.lm_eval_bridge import step_samples  # noqa: E402
from oea.models import heldout_documents  # noqa: E402
from oea.stats import mean_interval  # noqa: E402

torch.set_num_threads(1)
ROWS, NEW_TOKENS = 4, 6


def _generate(embedded, cfg):
    """Greedy generation of ROWS held-out prompts with ``cfg`` attached; (samples, per-step layer means of
    the handle's last-step counter read by an independent hook, the handle's stats)."""
    model, tokenizer = embedded
    texts = [text for _, text in heldout_documents()[:ROWS]]
    ids = torch.stack([tokenizer(text, return_tensors="pt").input_ids[0, :12] for text in texts])
    handle = oea.attach(model, cfg)
    independent: list[float] = []
    try:
        with step_samples(model, handle) as samples:
            def after(*_):  # registered after step_samples' hook: runs after it on each forward
                if len(samples.active) > len(independent):
                    last = handle.last_active_experts()
                    independent.append(sum(last.values()) / len(last))

            hook = model.register_forward_hook(after)
            try:
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                               min_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id or 0)
            finally:
                hook.remove()
        stats = handle.stats()
    finally:
        handle.remove()
    return samples, independent, stats


@pytest.fixture(scope="module")
def k0_one(embedded):
    return _generate(embedded, oea.OEAConfig(1, min_batch=1))


def test_one_sample_per_decode_step_equal_to_the_layers_own_counters(k0_one) -> None:
    samples, independent, stats = k0_one
    steps = {s["steps"] for s in stats.values()}
    assert steps == {NEW_TOKENS - 1}  # the first new token comes from the prefill forward
    assert len(samples.active) == len(samples.vanilla) == len(samples.per_token) == NEW_TOKENS - 1
    assert samples.active == pytest.approx(independent)
    for key, values in (("mean_active_experts", samples.active), ("mean_active_experts_vanilla", samples.vanilla),
                        ("mean_experts_per_token", samples.per_token)):
        weighted = sum(s[key] for s in stats.values()) / len(stats)  # same steps and rows in every layer
        assert sum(values) / len(values) == pytest.approx(weighted)
    assert all(a <= v for a, v in zip(samples.active, samples.vanilla, strict=True))  # k0 = 1 loads a subset
    assert all(1.0 <= p < 8.0 for p in samples.per_token)


def test_every_routing_mean_carries_its_interval_over_decode_steps(embedded, k0_one) -> None:
    samples, _, _ = k0_one
    fields = samples.fields()
    for key, values in (("mean_active_experts", samples.active), ("mean_active_experts_vanilla", samples.vanilla),
                        ("mean_experts_per_token", samples.per_token)):
        want = mean_interval(values)
        assert fields[key] == pytest.approx(want.estimate)
        assert fields[f"{key}_ci"] == pytest.approx(want.as_list())
    low, high = fields["active_vs_vanilla_ci"]
    ratio = (sum(samples.active) / len(samples.active)) / (sum(samples.vanilla) / len(samples.vanilla))
    assert fields["active_vs_vanilla"] == pytest.approx(ratio) and low <= ratio <= high < 1.0
    vanilla, _, _ = _generate(embedded, None)  # attached without a policy: the router's own routing
    plain = vanilla.fields()
    assert plain["mean_active_experts"] == pytest.approx(plain["mean_active_experts_vanilla"])
    assert plain["mean_experts_per_token"] == 8.0 and plain["active_vs_vanilla"] == 1.0
    one_step = type(samples)(samples.active[:1], samples.vanilla[:1], samples.per_token[:1]).fields()
    assert one_step["mean_active_experts_ci"] is None and not math.isnan(one_step["mean_active_experts"])
