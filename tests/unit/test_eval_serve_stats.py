"""``oea.stats.paired_items``: the paired per-item statistics of ``oea eval serve``, against closed-form answers."""

from __future__ import annotations

import math

import pytest
from scipy import stats as scipy_stats

from oea.stats import (
    compare_items,
    first_difference,
    mcnemar_exact,
    min_detectable_graded,
    min_detectable_pass_fail,
    output_agreement,
)

Z = 1.959963984540054 + 0.8416212335729143  # z_0.975 + z_0.8


def test_exact_mcnemar_is_the_binomial_tail_of_the_discordant_pairs() -> None:
    # 5 items the treatment passes and the baseline fails, none the other way: p = 2 * 0.5^5
    assert mcnemar_exact([1] * 5 + [0] * 3, [0] * 5 + [0] * 3) == (0.0625, 0, 5)
    # b = 1, c = 9: p = 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024 (concordant pairs do not count)
    treatment = [0] + [1] * 9 + [1] * 7 + [0] * 4
    baseline = [1] + [0] * 9 + [1] * 7 + [0] * 4
    assert mcnemar_exact(treatment, baseline) == (pytest.approx(22 / 1024), 1, 9)
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]) == (1.0, 0, 0)
    with pytest.raises(ValueError, match="pass/fail"):
        mcnemar_exact([0.5, 1], [1, 1])


def test_min_detectable_pass_fail_closed_forms() -> None:
    # nothing discordant: k^2 / (n + k^2), 1.55 points for 500 items
    assert min_detectable_pass_fail(500, 0.0) == pytest.approx(Z**2 / (500 + Z**2))
    assert min_detectable_pass_fail(500, 0.0) == pytest.approx(0.015455, abs=1e-6)
    # 20% discordant of 100: k sqrt(p / (n + k^2))
    assert min_detectable_pass_fail(100, 0.2) == pytest.approx(Z * math.sqrt(0.2 / (100 + Z**2)))
    assert min_detectable_pass_fail(400, 0.2) < min_detectable_pass_fail(100, 0.2)  # more items, finer


def test_min_detectable_graded_is_t_quantiles_times_the_standard_error() -> None:
    k = scipy_stats.t.ppf(0.975, 9) + scipy_stats.t.ppf(0.8, 9)
    assert min_detectable_graded(1.0, 10) == pytest.approx(k / math.sqrt(10))
    # t_{0.975, 9} = 2.262157 and t_{0.8, 9} = 0.883404 (tables)
    assert min_detectable_graded(1.0, 10) == pytest.approx((2.262157 + 0.883404) / math.sqrt(10), abs=1e-5)


def test_pass_fail_comparison_worse_better_and_identical() -> None:
    baseline = [1] * 30 + [0] * 10
    worse = [0] * 12 + [1] * 18 + [0] * 10  # 12 items lost, none gained
    result = compare_items(worse, baseline)
    assert result.test == "exact McNemar" and result.discordant == (12, 0)
    assert result.delta.estimate == pytest.approx(-12 / 40)
    assert result.p_value == pytest.approx(2 * 0.5**12)
    assert result.verdict == "worse"
    assert result.delta.high < 0
    assert compare_items(baseline, worse).verdict == "better"
    same = compare_items(baseline, baseline)
    assert (same.delta.estimate, same.delta.low, same.delta.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert same.verdict == "no significant difference"
    assert same.min_detectable_delta == pytest.approx(Z**2 / (40 + Z**2))
    assert same.score.method == "wilson" and same.score.estimate == 0.75


def test_graded_comparison_is_the_paired_t_test() -> None:
    baseline = [0.5, 0.6, 0.7, 0.8, 0.9]
    treatment = [0.4, 0.55, 0.6, 0.75, 0.85]
    result = compare_items(treatment, baseline)
    expected = scipy_stats.ttest_rel(treatment, baseline)
    assert result.test == "paired t"
    assert result.p_value == pytest.approx(expected.pvalue)
    assert result.delta.estimate == pytest.approx(-0.07)
    assert result.verdict == "worse"
    d_sd = float(scipy_stats.tstd([t - b for t, b in zip(treatment, baseline, strict=True)]))
    assert result.min_detectable_delta == pytest.approx(min_detectable_graded(d_sd, 5))
    # no spread in the differences: the baseline's own spread stands in (never a detectable difference of 0)
    same = compare_items(baseline, baseline)
    assert same.min_detectable_delta == pytest.approx(min_detectable_graded(float(scipy_stats.tstd(baseline)), 5))


def test_agreement_share_and_first_difference() -> None:
    outputs = ["abc", "abd", "x", "same"]
    baseline = ["abc", "abc", "y", "same"]
    agree = output_agreement(outputs, baseline, [list(o) for o in outputs], [list(b) for b in baseline])
    assert agree.share.estimate == 0.5 and agree.differing == 2
    assert agree.first_difference == pytest.approx((2 + 0) / 2)
    assert 0 <= agree.share.low < 0.5 < agree.share.high <= 1
    assert output_agreement(outputs, baseline).first_difference is None  # tokens unknown
    assert first_difference(["a", "b"], ["a", "b", "c"]) == 2  # a prefix: the shorter length
    with pytest.raises(ValueError, match="equal length"):
        output_agreement(["a"], ["a", "b"])
