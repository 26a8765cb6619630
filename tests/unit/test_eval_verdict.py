"""The quality verdict of ``oea eval`` (``oea.eval.summary``): the paired t-test on per-document ΔCE decides,
the paper's overlapping-interval rule is shown beside it; intervals need two documents."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import examples

from oea.console import format_interval
from oea.eval.evaluate import _num_batches
from oea.eval.summary import PAPER_RULE, REFERENCE, VERDICT_RULE, ci_or_none, quality_fields, routing_fields
from oea.stats import paired_difference

# 16 documents whose cross-entropies spread like the embedded model's held-out files (sd ~1.2 nats)
RNG = np.random.default_rng(0)
VANILLA = {doc: float(ce) for doc, ce in enumerate(RNG.normal(2.85, 1.2, 16))}


def _shifted(shift: float, noise: float, seed: int = 1) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    return {doc: ce + shift + float(rng.normal(0, noise)) for doc, ce in VANILLA.items()}


def test_a_consistent_loss_is_worse_although_the_paper_rule_sees_overlapping_intervals() -> None:
    # pruned k0=3 at +0.33 nats with a paired SE of ~0.04 and a per-document SE of ~0.3: the paper's rule
    # (overlapping per-policy intervals) calls it a tie, the paired difference a clear loss
    row = quality_fields(_shifted(0.33, 0.18), VANILLA)
    assert row["delta_ce"] == pytest.approx(0.33, abs=0.1)
    assert row["delta_stderr"] < 0.06 < 0.25 < row["stderr"]
    assert row["verdict"] == "worse" and row["delta_p_value"] < 1e-4
    assert row["delta_ce_ci"][0] > 0
    assert row["paper_verdict"] == "no worse"  # the overlapping-SE rule misses it
    assert row["verdict_rule"] == VERDICT_RULE and "paired" in VERDICT_RULE and "paper" in PAPER_RULE


def test_noise_around_zero_is_no_significant_difference_and_a_consistent_gain_is_better() -> None:
    noisy = quality_fields(_shifted(0.0, 0.2, seed=4), VANILLA)
    assert noisy["delta_ce_ci"][0] < 0 < noisy["delta_ce_ci"][1]
    assert noisy["verdict"] == "no significant difference" and noisy["delta_p_value"] > 0.05
    gain = quality_fields(_shifted(-0.1, 0.05), VANILLA)
    assert gain["verdict"] == "better" and gain["delta_ce_ci"][1] < 0 and gain["paper_verdict"] == "no worse"


def test_the_verdict_fields_are_the_paired_t_test_of_oea_stats() -> None:
    treatment = _shifted(0.05, 0.1)
    row = quality_fields(treatment, VANILLA)
    docs = sorted(VANILLA)
    diff = paired_difference([treatment[d] for d in docs], [VANILLA[d] for d in docs])
    assert row["delta_ce"] == pytest.approx(diff.mean) and row["delta_stderr"] == pytest.approx(diff.stderr)
    assert row["delta_ce_ci"] == pytest.approx(diff.ci.as_list())
    assert row["delta_p_value"] == pytest.approx(diff.p_value)
    assert row["cross_entropy"] == pytest.approx(np.mean(list(treatment.values())))
    low, high = row["cross_entropy_ci"]
    assert low < row["cross_entropy"] < high
    assert (high - low) / 2 == pytest.approx(2.131 * row["stderr"], rel=1e-3)  # t(0.975, 15) = 2.131


@settings(max_examples=examples(60))
@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=2, max_size=30), st.floats(-0.5, 0.5))
def test_the_verdict_follows_the_interval_of_the_difference(noise: list[float], shift: float) -> None:
    control = {doc: 3.0 + 0.5 * (doc % 5) for doc in range(len(noise))}
    treatment = {doc: control[doc] + shift + 0.1 * e for doc, e in enumerate(noise)}
    row = quality_fields(treatment, control)
    low, high = row["delta_ce_ci"]
    expected = "worse" if low > 0 else "better" if high < 0 else "no significant difference"
    if math.isclose(low, 0.0, abs_tol=1e-12) or math.isclose(high, 0.0, abs_tol=1e-12):
        return  # on the boundary the p-value and the bound may round differently
    assert row["verdict"] == expected


def test_the_vanilla_row_is_the_reference() -> None:
    row = quality_fields(VANILLA, None)
    assert row["verdict"] == row["paper_verdict"] == REFERENCE
    assert row["delta_ce"] == 0.0 and row["delta_ce_ci"] == [0.0, 0.0] and row["delta_p_value"] == 1.0


def test_fewer_than_two_documents_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="at least 2 held-out documents, got 1"):
        quality_fields({0: 2.0}, {0: 1.9})
    with pytest.raises(ValueError, match=r"single document.*num_batches >= 2"):
        _num_batches(1, 1)
    assert _num_batches(1, None) == 16 and _num_batches(16, None) == 1 and _num_batches(1, 2) == 2
    with pytest.raises(ValueError, match="same documents"):
        quality_fields({0: 2.0, 1: 2.1}, {0: 1.9, 2: 2.0})


def test_routing_intervals_over_decode_steps_and_a_single_item_has_none() -> None:
    vanilla = [40.0, 44.0, 38.0, 42.0]
    policy = [20.0, 23.0, 18.0, 21.0]
    fields = routing_fields(policy, [5.0, 5.1, 4.9, 5.0], vanilla)
    assert fields["mean_active_experts"] == pytest.approx(20.5)
    low, high = fields["mean_active_experts_ci"]
    assert low < 20.5 < high
    assert fields["active_vs_vanilla"] == pytest.approx(82 / 164)
    r_low, r_high = fields["active_vs_vanilla_ci"]
    assert 0.47 < r_low <= 0.5 <= r_high < 0.53  # paired by step: the shared step-to-step spread cancels
    single = routing_fields([20.0], [5.0], [40.0])
    assert single["mean_active_experts_ci"] is None and single["active_vs_vanilla_ci"] is None
    assert single["active_vs_vanilla"] == 0.5
    assert ci_or_none([1.0]) is None and ci_or_none([1.0, 3.0]) is not None
    assert format_interval(0.5, None, 2) == "0.50 (n=1)" and format_interval(1.0, [0.5, 1.5], 1) == "1.0 ±0.5"
    assert format_interval(None, None) == "-"
    assert format_interval(0.25, [0.1, 0.4], 2, signed=True) == "+0.25 ±0.15"
    assert format_interval(0.5, [0.45, 0.6], 2) == "0.50 [0.45, 0.60]"  # bootstrap: asymmetric


def test_rows_identical_to_vanilla_say_so_without_a_p_value(capsys: pytest.CaptureFixture[str]) -> None:
    from oea.eval.cli import results_table
    from oea.eval.summary import IDENTICAL

    row = quality_fields(dict(VANILLA), VANILLA)
    assert row["verdict"] == IDENTICAL == row["paper_verdict"] and row["delta_p_value"] is None
    assert row["delta_ce"] == 0.0 and row["delta_ce_ci"] == [0.0, 0.0]
    nearly = quality_fields({d: ce + (1e-9 if d == 3 else 0.0) for d, ce in VANILLA.items()}, VANILLA)
    assert nearly["verdict"] == "no significant difference" and nearly["delta_p_value"] is not None
    table_row = {"batch_size": 1, "policy": "oea", "k0": 3, **row, **routing_fields([8.0, 8.0], [8.0, 8.0],
                                                                                   [8.0, 8.0]),
                 "generation_agreement": 1.0, "generation_agreement_ci": None, "documents": 16}
    from oea.console import wide_console

    wide_console().print(results_table([table_row], "t"))
    line = next(text for text in capsys.readouterr().out.splitlines() if "oea" in text and "identical" in text)
    assert " - " in line.split("identical")[0].rsplit("│", 2)[-2]  # the p column shows no number


def test_generation_agreement_has_a_proportion_interval_inside_0_100() -> None:
    import torch

    from oea.eval.evaluate import _agreement
    from oea.stats import proportion_interval

    vanilla = torch.arange(4 * 9).reshape(4, 9)
    generated = vanilla.clone()
    generated[1, 1:] = -1  # row 1 diverged at its first decode token, row 2 half way, row 3 near the end
    generated[2, 5:] = -1
    generated[3, 8:] = -1
    share, ci = _agreement(generated, vanilla)
    assert share == pytest.approx((1 + 0 + 0.5 + 0.875) / 4)
    assert ci == pytest.approx(proportion_interval(share, 4).as_list())
    assert 0.0 <= ci[0] < share < ci[1] <= 1.0
    assert _agreement(generated[:1], vanilla[:1]) == (1.0, None)  # one row: no interval
    assert _agreement(vanilla, vanilla)[1][1] == 1.0
