"""``oea.stats``: exact values from published examples, and properties of the intervals and tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import examples

from oea.stats import (
    Interval,
    bootstrap_interval,
    linear_fit,
    mean_bootstrap_interval,
    mean_interval,
    mean_of_estimates,
    median_interval,
    paired_difference,
    r_squared,
    ratio_of_means_interval,
    ratio_of_medians_interval,
    standard_error,
    t_quantile,
    t_two_sided_p,
    unpaired_standard_error,
)

# Student's sleep data (Cushny & Peebles 1905, R's `sleep`): extra hours of sleep of the same ten
# patients under two drugs. R 4.x: t.test(extra ~ group, data = sleep, paired = TRUE) gives
# t = -4.0621, df = 9, p-value = 0.002833, 95% CI of the mean difference (group 1 - group 2)
# [-2.4598858, -0.7001142], mean difference -1.58.
SLEEP_DRUG_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_DRUG_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]

# Anscombe's quartet, set I: least squares y = 3.00009 + 0.500091 x, R² = 0.666542.
ANSCOMBE_X = [10, 8, 13, 9, 11, 14, 6, 4, 12, 7, 5]
ANSCOMBE_Y = [8.04, 6.95, 7.58, 8.81, 8.33, 9.96, 7.24, 4.26, 10.84, 4.82, 5.68]

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)
samples = st.lists(finite, min_size=2, max_size=40)


# ---------------------------------------------------------------- exact values


@pytest.mark.parametrize(("probability", "df", "expected"), [
    (0.975, 1, 12.706205),  # t tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
    (0.975, 2, 4.302653),
    (0.975, 9, 2.262157),
    (0.975, 10, 2.228139),
    (0.975, 30, 2.042272),
    (0.995, 5, 4.032143),
    (0.95, 20, 1.724718),
    (0.025, 10, -2.228139),
])
def test_t_quantiles_match_the_tables(probability, df, expected):
    assert t_quantile(probability, df) == pytest.approx(expected, abs=1e-6)


def test_t_two_sided_p_matches_closed_forms():
    # df = 1 is the Cauchy distribution: P(|T| >= t) = 1 - 2 atan(t) / pi
    for t in (0.0, 0.5, 1.0, 3.0, 40.0):
        assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-9)
        assert t_two_sided_p(-t, 1) == t_two_sided_p(t, 1)
    # df = 2: P(|T| >= t) = 1 - t / sqrt(2 + t²)
    for t in (0.3, 1.0, 4.0):
        assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert t_two_sided_p(t_quantile(0.975, 7), 7) == pytest.approx(0.05, rel=1e-9)


def test_paired_t_test_reproduces_the_sleep_study():
    diff = paired_difference(SLEEP_DRUG_1, SLEEP_DRUG_2)
    assert diff.n == 10 and diff.mean == pytest.approx(-1.58)
    assert diff.t_statistic == pytest.approx(-4.0621, abs=5e-5)
    assert diff.p_value == pytest.approx(0.002833, abs=5e-7)
    assert diff.ci.low == pytest.approx(-2.4598858, abs=1e-7) and diff.ci.high == pytest.approx(-0.7001142, abs=1e-7)
    assert diff.stderr == pytest.approx(0.3889587, abs=1e-7)  # sd(d) = 1.2299955
    assert diff.significant and diff.ci.level == 0.95 and diff.ci.method == "paired t"
    assert diff.verdict(lower_is_better=True) == "better"  # drug 1 gives less extra sleep...
    assert diff.verdict(lower_is_better=False) == "worse"  # ...which is worse when more is better
    reverse = paired_difference(SLEEP_DRUG_2, SLEEP_DRUG_1)
    assert reverse.mean == pytest.approx(1.58) and reverse.p_value == pytest.approx(diff.p_value)
    assert paired_difference(SLEEP_DRUG_1, SLEEP_DRUG_2, level=0.99).significant  # p = 0.0028 < 0.01
    assert not paired_difference(SLEEP_DRUG_1, SLEEP_DRUG_2, level=0.999).significant


def test_the_unpaired_comparison_of_the_sleep_study_is_much_weaker():
    # R: t.test(extra ~ group, data = sleep) (Welch) gives t = -1.8608: se = 1.58 / 1.8608
    se = unpaired_standard_error(SLEEP_DRUG_1, SLEEP_DRUG_2)
    assert se == pytest.approx(1.58 / 1.8608, rel=1e-4)
    assert se > 2 * paired_difference(SLEEP_DRUG_1, SLEEP_DRUG_2).stderr


def test_mean_interval_is_the_one_sample_t_interval():
    diffs = np.subtract(SLEEP_DRUG_2, SLEEP_DRUG_1)
    interval = mean_interval(diffs)
    assert interval.estimate == pytest.approx(1.58)
    assert interval.bounds == pytest.approx((0.7001142, 2.4598858), abs=1e-7)
    assert interval.method == "t" and interval.half_width == pytest.approx(0.8798858, abs=1e-7)
    # textbook by hand: 1, 2, 3, 4, 5 -> mean 3, s = sqrt(2.5), se = sqrt(0.5), t(0.975, 4) = 2.776445
    small = mean_interval([1, 2, 3, 4, 5])
    assert small.bounds == pytest.approx((3 - 2.776445 * math.sqrt(0.5), 3 + 2.776445 * math.sqrt(0.5)), abs=1e-6)
    assert standard_error([1, 2, 3, 4, 5]) == pytest.approx(math.sqrt(0.5))


def test_linear_fit_reproduces_anscombe_set_one():
    fit = linear_fit([ANSCOMBE_X], ANSCOMBE_Y)
    assert fit.coefficients[0] == pytest.approx(0.500091, abs=1e-6)
    assert fit.intercept == pytest.approx(3.000091, abs=1e-6)
    assert fit.r2 == pytest.approx(0.666542, abs=1e-6) and fit.n == 11
    assert fit.predict([[10.0, 0.0]]) == pytest.approx([3.000091 + 5.00091, 3.000091], abs=1e-5)


def test_linear_fit_recovers_an_exact_model_with_two_regressors():
    x1 = np.array([8, 28, 48, 68, 88, 34, 34, 66], dtype=float)
    x2 = np.array([128, 128, 128, 128, 128, 48, 80, 128], dtype=float)
    fit = linear_fit([x1, x2], 2.5 * x1 + 0.3 * x2 + 40.0)
    assert fit.coefficients == pytest.approx((2.5, 0.3)) and fit.intercept == pytest.approx(40.0)
    assert fit.r2 == pytest.approx(1.0)
    through_origin = linear_fit([x1], 2.0 * x1, intercept=False)
    assert through_origin.coefficients == pytest.approx((2.0,)) and through_origin.intercept == 0.0


def test_r_squared_by_hand():
    # observed 1, 2, 3 (mean 2, SS_tot 2), predicted 1, 2, 4 (SS_res 1) -> 0.5
    assert r_squared([1, 2, 3], [1, 2, 4]) == pytest.approx(0.5)
    assert r_squared([1, 2, 3], [3, 2, 1]) == pytest.approx(-3.0)  # worse than the mean is negative
    assert r_squared([5, 5], [5, 5]) == 1.0 and r_squared([5, 5], [4, 6]) == 0.0


def test_bootstrap_matches_a_loop_over_the_same_draws():
    values = np.array([3.0, 9.0, 1.0, 4.0, 7.0, 2.0, 8.0])
    interval = bootstrap_interval(values, np.random.default_rng(5), resamples=300, level=0.9)
    draws = np.random.default_rng(5).integers(0, values.size, size=(300, values.size))
    medians = sorted(float(np.median([values[i] for i in row])) for row in draws)
    # numpy's default quantile interpolates linearly between order statistics: position q·(R-1)
    def quantile(q: float) -> float:
        position = q * (len(medians) - 1)
        low = math.floor(position)
        return medians[low] + (position - low) * (medians[min(low + 1, len(medians) - 1)] - medians[low])
    assert interval.bounds == pytest.approx((quantile(0.05), quantile(0.95)))
    assert interval.estimate == 4.0 and interval.level == 0.9 and interval.method == "bootstrap"


def test_median_and_mean_bootstrap_intervals():
    rng = np.random.default_rng(0)
    values = rng.lognormal(0.0, 1.0, 200)
    median = median_interval(values, rng)
    mean = mean_bootstrap_interval(values, rng)
    assert median.estimate == pytest.approx(float(np.median(values))) and median.contains(median.estimate)
    assert mean.estimate == pytest.approx(float(values.mean())) and mean.contains(mean.estimate)
    assert median_interval([7.0] * 5, rng).bounds == (7.0, 7.0)


def test_paired_ratio_cancels_shared_variation_and_unpaired_does_not():
    rng = np.random.default_rng(1)
    round_effect = rng.uniform(50, 150, 60)  # shared by both variants (same routing batch per round)
    base = round_effect * (1 + rng.normal(0, 0.01, 60))
    half = 0.5 * round_effect * (1 + rng.normal(0, 0.01, 60))
    paired = ratio_of_medians_interval(half, base, rng, paired=True)
    unpaired = ratio_of_medians_interval(half, base, rng, paired=False)
    assert paired.estimate == unpaired.estimate == pytest.approx(float(np.median(half) / np.median(base)))
    assert paired.contains(paired.estimate) and unpaired.contains(unpaired.estimate)
    assert paired.high - paired.low < 0.05 < unpaired.high - unpaired.low
    assert paired.method == "paired bootstrap" and unpaired.method == "bootstrap"
    assert ratio_of_medians_interval([1.0, 2.0, 3.0], [2.0, 4.0], rng, paired=False).estimate == pytest.approx(2 / 3)


def test_ratio_of_means_is_paired_by_item_and_matches_a_loop_over_the_same_draws():
    rng = np.random.default_rng(3)
    batch_effect = rng.uniform(20, 60, 40)  # e.g. vanilla T per batch; the policy's T follows it
    vanilla = batch_effect
    policy = 0.5 * batch_effect + rng.normal(0, 0.2, 40)
    paired = ratio_of_means_interval(policy, vanilla, np.random.default_rng(5), paired=True, resamples=300)
    assert paired.estimate == pytest.approx(policy.mean() / vanilla.mean())
    draws = np.random.default_rng(5).integers(0, 40, size=(300, 40))
    ratios = np.array([policy[d].mean() / vanilla[d].mean() for d in draws])
    assert paired.bounds == pytest.approx((np.quantile(ratios, 0.025), np.quantile(ratios, 0.975)))
    unpaired = ratio_of_means_interval(policy, vanilla, rng, paired=False, resamples=300)
    assert paired.high - paired.low < (unpaired.high - unpaired.low) / 5
    exact = ratio_of_means_interval([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], rng, paired=True)
    assert exact.bounds == (0.5, 0.5) and exact.method == "paired bootstrap"
    with pytest.raises(ValueError, match="denominator mean is 0"):
        ratio_of_means_interval([1.0, 2.0], [1.0, -1.0], rng, paired=True)


def test_mean_of_independent_estimates_combines_their_errors():
    combined = mean_of_estimates([1.0, 3.0], [1.0, 1.0], [10, 10])
    # se = sqrt(1 + 1) / 2; df = (1 + 1)² / (1/10 + 1/10) = 20; t(0.975, 20) = 2.085963
    assert combined.estimate == 2.0
    assert combined.half_width == pytest.approx(2.085963 * math.sqrt(2) / 2, abs=1e-6)
    one = mean_of_estimates([5.0], [0.5], [9])  # a single estimate keeps its own t interval
    assert one.half_width == pytest.approx(2.262157 * 0.5, abs=1e-6)
    assert mean_of_estimates([1.0, 2.0], [0.0, 0.0], [3, 3]).bounds == (1.5, 1.5)
    with pytest.raises(ValueError, match="equal length"):
        mean_of_estimates([1.0, 2.0], [0.1], [3, 3])


def test_bad_input_is_named():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="at least 2 values, got 1"):
        mean_interval([1.0])
    with pytest.raises(ValueError, match="non-finite"):
        mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="at least 1 value, got 0"):
        median_interval([], rng)
    with pytest.raises(ValueError, match="level must be strictly between 0 and 1"):
        mean_interval([1.0, 2.0], level=95)
    with pytest.raises(ValueError, match="resamples must be >= 1"):
        median_interval([1.0, 2.0], rng, resamples=0)
    with pytest.raises(ValueError, match="paired ratio needs samples of equal length, got 2 and 1"):
        ratio_of_medians_interval([1.0, 2.0], [1.0], rng, paired=True)
    with pytest.raises(ValueError, match="denominator median is 0"):
        ratio_of_medians_interval([1.0, 2.0], [0.0, 0.0], rng, paired=True)
    with pytest.raises(ValueError, match="paired samples must have equal length"):
        paired_difference([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="one-dimensional"):
        standard_error([[1.0, 2.0]])
    with pytest.raises(ValueError, match="at least as many points as parameters"):
        linear_fit([[1.0]], [2.0])
    with pytest.raises(ValueError, match="equal lengths"):
        linear_fit([[1.0, 2.0, 3.0]], [2.0, 3.0])
    with pytest.raises(ValueError, match="df must be > 0"):
        t_quantile(0.975, 0)


def test_constant_differences_are_decided_by_their_sign():
    same = paired_difference([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same.mean == 0 and same.p_value == 1.0 and not same.significant
    assert same.verdict() == "no significant difference" and same.ci.bounds == (0.0, 0.0)
    shifted = paired_difference([1.5, 2.5, 3.5], [1.0, 2.0, 3.0])
    assert shifted.stderr == 0 and shifted.t_statistic == math.inf and shifted.verdict() == "worse"


# ---------------------------------------------------------------- properties


@settings(max_examples=examples(80))
@given(samples, st.sampled_from([0.5, 0.8, 0.9, 0.95, 0.99]))
def test_t_interval_contains_the_mean_and_widens_with_the_level(values, level):
    interval = mean_interval(values, level)
    wider = mean_interval(values, min(0.999, level + 0.005))
    assert interval.low <= interval.estimate <= interval.high
    assert wider.low <= interval.low + 1e-9 and interval.high <= wider.high + 1e-9


@settings(max_examples=examples(60))
@given(samples, st.floats(-100, 100), st.floats(0.1, 10))
def test_t_interval_moves_with_shift_and_scale(values, shift, scale):
    base = mean_interval(values)
    moved = mean_interval([scale * v + shift for v in values])
    assert moved.low == pytest.approx(scale * base.low + shift, abs=1e-6 * (1 + abs(scale * base.low + shift)))
    assert moved.high == pytest.approx(scale * base.high + shift, abs=1e-6 * (1 + abs(scale * base.high + shift)))


@settings(max_examples=examples(80))
@given(st.lists(st.tuples(finite, finite), min_size=3, max_size=40))
def test_paired_se_is_the_unpaired_se_corrected_by_the_covariance(pairs):
    a = np.array([p[0] for p in pairs])
    b = np.array([p[1] for p in pairs])
    n = a.size
    paired = paired_difference(a, b)
    covariance = float(np.cov(a, b, ddof=1)[0, 1])
    expected = unpaired_standard_error(a, b) ** 2 - 2 * covariance / n
    assert paired.stderr**2 == pytest.approx(max(expected, 0.0), rel=1e-6, abs=1e-6)
    if covariance >= 0:
        assert paired.stderr <= unpaired_standard_error(a, b) + 1e-9


@settings(max_examples=examples(80))
@given(st.lists(st.tuples(finite, finite), min_size=3, max_size=30), st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_significance_is_the_interval_excluding_zero(pairs, level):
    diff = paired_difference([p[0] for p in pairs], [p[1] for p in pairs], level)
    excludes_zero = diff.ci.low > 0 or diff.ci.high < 0
    if diff.stderr > 0 and abs(abs(diff.t_statistic) - t_quantile((1 + level) / 2, diff.n - 1)) > 1e-6:
        assert diff.significant == excludes_zero  # (skip the knife edge |t| = critical value)
    assert 0.0 <= diff.p_value <= 1.0


@settings(max_examples=examples(40))
@given(st.lists(st.floats(1, 1000), min_size=1, max_size=30), st.integers(0, 2**32 - 1))
def test_bootstrap_bounds_lie_within_the_data(values, seed):
    interval = median_interval(values, np.random.default_rng(seed), resamples=200)
    assert min(values) <= interval.low <= interval.high <= max(values)
    same = ratio_of_medians_interval(values, values, np.random.default_rng(seed), paired=True, resamples=200)
    assert same.bounds == (1.0, 1.0) and same.estimate == 1.0  # paired: identical samples, no spread


def test_intervals_cover_the_true_value_about_as_often_as_promised():
    rng = np.random.default_rng(2026)
    trials, n = 400, 12
    t_hits = sum(mean_interval(rng.normal(10.0, 3.0, n)).contains(10.0) for _ in range(trials))
    boot_hits = sum(median_interval(rng.normal(10.0, 3.0, 40), rng, resamples=400).contains(10.0)
                    for _ in range(trials))
    paired_hits = 0
    for _ in range(trials):
        item = rng.normal(0.0, 5.0, n)  # large item effect shared by both arms
        paired_hits += paired_difference(item + 0.5 + rng.normal(0, 1, n), item + rng.normal(0, 1, n)).ci.contains(0.5)
    # 95% nominal; binomial sd over 400 trials is 1.1 points. The percentile bootstrap of a median
    # under-covers slightly at n = 40.
    assert 0.91 <= t_hits / trials <= 0.99
    assert 0.88 <= boot_hits / trials <= 0.99
    assert 0.91 <= paired_hits / trials <= 0.99


def test_interval_helpers():
    interval = Interval(2.0, 1.0, 4.0, 0.9, "t")
    assert interval.bounds == (1.0, 4.0) and interval.as_list() == [1.0, 4.0] and interval.half_width == 1.5
    assert interval.contains(1.0) and interval.contains(4.0) and not interval.contains(4.5)


def test_proportion_interval_is_wilsons_and_stays_inside_0_1() -> None:
    from scipy.stats import binomtest

    from oea.stats import proportion_interval

    for successes, trials in [(0, 10), (10, 10), (5, 10), (1, 4), (3, 7), (49, 50)]:
        got = proportion_interval(successes / trials, trials)
        want = binomtest(successes, trials).proportion_ci(0.95, method="wilson")  # independent implementation
        assert got.low == pytest.approx(want.low, abs=1e-12) and got.high == pytest.approx(want.high, abs=1e-12)
        assert 0.0 <= got.low <= got.estimate <= got.high <= 1.0 and got.method == "wilson"
    assert proportion_interval(0.5, 10).as_list() == pytest.approx([0.2366, 0.7634], abs=1e-4)  # textbook value
    assert proportion_interval(1.0, 1).low == pytest.approx(0.2065, abs=1e-4)
    share = proportion_interval(0.46, 4)  # a t interval over 4 rows gave 46 ±50 (%), past 0
    assert 0.0 < share.low < 0.46 < share.high < 1.0
    for bad, trials in [(1.2, 4), (-0.1, 4), (0.5, 0), (0.5, 2.0)]:
        with pytest.raises(ValueError, match="must be"):
            proportion_interval(bad, trials)


@pytest.mark.parametrize("n", [1, 2, 17])
def test_bootstrap_intervals_are_the_quantiles_of_one_draw_per_sample_from_the_generator(n):
    # scipy.stats.bootstrap resamples (oea.stats.intervals); the figures stay those of this hand computation, bit for
    # bit, and the generator moves on by exactly these draws.
    data = np.random.default_rng(11).lognormal(size=(2, n)) + 0.1
    resamples, tail = 300, 0.025

    def by_hand(draw_pairs: bool, statistic):
        rng = np.random.default_rng(5)
        if draw_pairs:
            rows = rng.integers(0, n, size=(resamples, n))
            ratios = statistic(data[0][rows]) / statistic(data[1][rows])
        else:
            num = data[0][rng.integers(0, n, size=(resamples, n))]
            ratios = statistic(num) / statistic(data[1][rng.integers(0, n, size=(resamples, n))])
        return (float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))), rng.integers(0, 2**62)

    for paired in (True, False):
        rng = np.random.default_rng(5)
        found = ratio_of_medians_interval(data[0], data[1], rng, paired=paired, resamples=resamples)
        assert (found.bounds, rng.integers(0, 2**62)) == by_hand(paired, lambda x: np.median(x, axis=-1))
    rng = np.random.default_rng(5)
    alone = median_interval(data[0], rng, resamples=resamples)
    draws = np.median(data[0][np.random.default_rng(5).integers(0, n, size=(resamples, n))], axis=-1)
    assert alone.bounds == (float(np.quantile(draws, tail)), float(np.quantile(draws, 1 - tail)))
