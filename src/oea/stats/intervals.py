"""Intervals, Student-t quantiles and paired comparisons (``oea.stats`` re-exports every public name).

Inputs are 1-D sequences of finite floats (lists, tuples, numpy arrays); every function raises
``ValueError`` naming the problem for empty, non-finite, mismatched or too-short input. Bootstrap
functions take a ``numpy.random.Generator`` so that results are reproducible. Student-t quantiles and
tails are ``scipy.stats.t``'s, percentile bootstrap intervals ``scipy.stats.bootstrap``'s (scipy is
imported on first use: it comes with the ``oea[lab]`` extra).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 2000
VERDICTS: tuple[str, ...] = ("worse", "better", "no significant difference")

Statistic = Callable[[np.ndarray], np.ndarray]  # [R, n] -> [R], reduces the last axis


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided confidence interval.

    Attributes:
        estimate: the statistic on the data itself.
        low, high: interval bounds (``low <= high``).
        level: confidence level, e.g. 0.95.
        method: how the bounds were computed (``"t"``, ``"bootstrap"``, ``"paired bootstrap"``, ...).
    """

    estimate: float
    low: float
    high: float
    level: float
    method: str

    @property
    def bounds(self) -> tuple[float, float]:
        """``(low, high)``."""
        return self.low, self.high

    @property
    def half_width(self) -> float:
        """Half the interval's width."""
        return (self.high - self.low) / 2.0

    def contains(self, value: float) -> bool:
        """Whether ``low <= value <= high``."""
        return self.low <= value <= self.high

    def as_list(self) -> list[float]:
        """``[low, high]``, the form the tools write into JSON (``*_ci`` fields)."""
        return [self.low, self.high]


@dataclass(frozen=True)
class PairedDifference:
    """Mean of per-item differences ``treatment - control`` and its paired two-sided t-test.

    The rule: with ``d_i = treatment_i - control_i`` over n items, ``stderr = sd(d) / sqrt(n)``
    (sample sd, n - 1 degrees of freedom), ``t = mean(d) / stderr`` and ``p_value`` is the
    two-sided Student-t tail probability with n - 1 degrees of freedom. The difference is
    significant at ``level`` iff ``p_value < 1 - level``, which is the same as the ``level``
    t interval ``ci`` excluding 0. Pairing removes the item-to-item spread that the two
    arms share, so this test is much sharper than comparing two separate intervals.

    Attributes:
        mean: mean difference (treatment - control).
        stderr: standard error of the mean difference.
        n: number of pairs.
        ci: t interval of the mean difference at ``level``.
        t_statistic: ``mean / stderr`` (±inf for a constant non-zero difference, 0 for all zeros).
        p_value: two-sided p-value of "mean difference = 0".
        level: confidence level.
    """

    mean: float
    stderr: float
    n: int
    ci: Interval
    t_statistic: float
    p_value: float
    level: float

    @property
    def significant(self) -> bool:
        """``p_value < 1 - level`` (equivalently: ``ci`` excludes 0)."""
        return self.p_value < 1.0 - self.level

    def verdict(self, lower_is_better: bool = True) -> str:
        """``"worse"``, ``"better"`` or ``"no significant difference"`` for the treatment.

        Significant and the mean difference in the bad direction (above 0 when lower is better,
        e.g. cross-entropy) is ``"worse"``; significant in the good direction is ``"better"``.
        """
        if not self.significant:
            return VERDICTS[2]
        worse = self.mean > 0 if lower_is_better else self.mean < 0
        return VERDICTS[0] if worse else VERDICTS[1]


# ---------------------------------------------------------------- input checks


def _values(values: Sequence[float], name: str = "values", minimum: int = 1) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size < minimum:
        raise ValueError(f"{name} needs at least {minimum} value{'s' if minimum > 1 else ''}, got {array.size}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    return array


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be strictly between 0 and 1, got {level!r}")


def _check_resamples(resamples: int) -> None:
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples!r}")


# ---------------------------------------------------------------- Student t


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (e.g. 0.975, 9 -> 2.262)."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be strictly between 0 and 1, got {probability!r}")
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df!r}")
    from scipy import stats

    return float(stats.t.ppf(probability, df))


def t_two_sided_p(t_statistic: float, df: float) -> float:
    """Two-sided tail probability ``P(|T| >= |t|)`` of Student's t with ``df`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df!r}")
    if math.isnan(t_statistic):
        raise ValueError("t_statistic is NaN")
    from scipy import stats

    return float(min(1.0, 2.0 * stats.t.sf(abs(t_statistic), df)))


# ---------------------------------------------------------------- means and medians


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean: sample standard deviation (n - 1) / sqrt(n); needs n >= 2."""
    array = _values(values, minimum=2)
    return float(np.std(array, ddof=1) / math.sqrt(array.size))


def mean_interval(values: Sequence[float], level: float = DEFAULT_LEVEL) -> Interval:
    """Mean with its Student-t interval ``mean ± t_{(1+level)/2, n-1} · se``; needs n >= 2."""
    _check_level(level)
    array = _values(values, minimum=2)
    mean, se = float(array.mean()), standard_error(array)
    half = t_quantile((1.0 + level) / 2.0, array.size - 1) * se
    return Interval(mean, mean - half, mean + half, level, "t")


def _median(draws: np.ndarray) -> np.ndarray:
    return np.median(draws, axis=-1)


def _mean(draws: np.ndarray) -> np.ndarray:
    return np.mean(draws, axis=-1)


def _scipy_bootstrap(samples: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], rng: np.random.Generator,
                     paired: bool, resamples: int, level: float) -> tuple[float, float]:
    """The percentile bootstrap bounds of ``statistic(*samples)``: the resampled statistics by
    ``scipy.stats.bootstrap`` (one [resamples, n] draw of ``rng.integers`` per sample, per pair when ``paired``), the
    bounds their (1 - level)/2 and (1 + level)/2 quantiles by ``numpy.quantile``.

    Not scipy's own bounds: its percentile method can land one ulp outside the data (resamples of [1.0,
    957.3468374748091] give a high of 957.3468374748093), and a bound must stay within what was measured."""
    from scipy import stats

    if min(sample.size for sample in samples) < 2:
        # scipy.stats.bootstrap refuses a sample of one value; the same draws by hand (every resample of one value
        # is that value), so that results and the generator's state match scipy's path for every n.
        if paired:
            rounds = rng.integers(0, samples[0].size, size=(resamples, samples[0].size))
            drawn = [sample[rounds] for sample in samples]
        else:
            drawn = [sample[rng.integers(0, sample.size, size=(resamples, sample.size))] for sample in samples]
        return _percentiles(statistic(*drawn), level)
    with warnings.catch_warnings():
        # scipy also reports the draws' standard error, unused here; with one resample numpy warns about it
        warnings.filterwarnings("ignore", "Degrees of freedom <= 0", RuntimeWarning)
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        found = stats.bootstrap(samples, lambda *drawn, axis: statistic(*drawn), n_resamples=resamples,
                                vectorized=True, paired=paired, confidence_level=level, method="percentile", rng=rng)
    return _percentiles(found.bootstrap_distribution, level)


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    return float(np.quantile(draws, tail)), float(np.quantile(draws, 1.0 - tail))


def bootstrap_interval(
    values: Sequence[float],
    rng: np.random.Generator,
    statistic: Statistic | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """Percentile bootstrap interval of ``statistic`` (default: the median) of ``values``.

    ``resamples`` resamples of size n are drawn with replacement (``rng.integers``, one [resamples,
    n] draw); the bounds are the (1 - level)/2 and (1 + level)/2 quantiles of the statistic over
    them. ``statistic`` maps an array [R, n] to [R] (reduce the last axis); the estimate is the
    statistic of ``values`` itself.
    """
    _check_level(level)
    _check_resamples(resamples)
    array = _values(values)
    stat = statistic or _median
    estimate = float(stat(array[None, :])[0])
    low, high = _scipy_bootstrap((array,), stat, rng, False, resamples, level)
    return Interval(estimate, low, high, level, "bootstrap")


def mean_bootstrap_interval(
    values: Sequence[float], rng: np.random.Generator, resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """Mean with a percentile bootstrap interval (for skewed data where the t interval is doubtful)."""
    return bootstrap_interval(values, rng, _mean, resamples, level)


def median_interval(
    values: Sequence[float], rng: np.random.Generator, resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """Median with a percentile bootstrap interval."""
    return bootstrap_interval(values, rng, _median, resamples, level)


def _ratio_interval(
    numerator: Sequence[float], denominator: Sequence[float], rng: np.random.Generator, paired: bool,
    statistic: Statistic, name: str, resamples: int, level: float,
) -> Interval:
    _check_level(level)
    _check_resamples(resamples)
    num, den = _values(numerator, "numerator"), _values(denominator, "denominator")
    if paired and num.size != den.size:
        raise ValueError(f"a paired ratio needs samples of equal length, got {num.size} and {den.size}")

    def ratio(num_draws: np.ndarray, den_draws: np.ndarray) -> np.ndarray:
        den_stats = statistic(den_draws)
        if np.any(den_stats == 0):
            raise ValueError(f"denominator {name} is 0 in the data or a resample; the ratio is undefined")
        return statistic(num_draws) / den_stats

    estimate = float(ratio(num[None, :], den[None, :])[0])
    low, high = _scipy_bootstrap((num, den), ratio, rng, paired, resamples, level)
    return Interval(estimate, low, high, level, "paired bootstrap" if paired else "bootstrap")


def ratio_of_medians_interval(
    numerator: Sequence[float],
    denominator: Sequence[float],
    rng: np.random.Generator,
    paired: bool,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """``median(numerator) / median(denominator)`` with a percentile bootstrap interval.

    ``paired=True``: sample i of both comes from the same item or round (e.g. the same routing
    batch, timed back to back), so whole pairs are resampled and variation the two share cancels
    instead of widening the interval; the sequences must have equal length. ``paired=False``:
    each sequence is resampled on its own (any lengths). Denominator medians must be non-zero.
    """
    return _ratio_interval(numerator, denominator, rng, paired, _median, "median", resamples, level)


def ratio_of_means_interval(
    numerator: Sequence[float],
    denominator: Sequence[float],
    rng: np.random.Generator,
    paired: bool,
    resamples: int = DEFAULT_RESAMPLES,
    level: float = DEFAULT_LEVEL,
) -> Interval:
    """``mean(numerator) / mean(denominator)`` with a percentile bootstrap interval.

    As ``ratio_of_medians_interval`` (``paired`` resamples whole pairs: e.g. a policy's and vanilla's
    active experts on the same batches), for quantities whose mean is the figure of interest
    (active experts per batch). Denominator means must be non-zero.
    """
    return _ratio_interval(numerator, denominator, rng, paired, _mean, "mean", resamples, level)


# ---------------------------------------------------------------- paired comparisons


def paired_difference(
    treatment: Sequence[float], control: Sequence[float], level: float = DEFAULT_LEVEL
) -> PairedDifference:
    """Paired comparison of two measurements of the same n >= 2 items (see ``PairedDifference``).

    ``treatment[i]`` and ``control[i]`` must belong to the same item (document, sequence, round).
    """
    _check_level(level)
    t_values, c_values = _values(treatment, "treatment", 2), _values(control, "control", 2)
    if t_values.size != c_values.size:
        raise ValueError(f"paired samples must have equal length, got {t_values.size} and {c_values.size}")
    diffs = t_values - c_values
    n = diffs.size
    mean, se = float(diffs.mean()), standard_error(diffs)
    half = t_quantile((1.0 + level) / 2.0, n - 1) * se
    if se > 0:
        t_stat = mean / se
        p_value = t_two_sided_p(t_stat, n - 1)
    else:  # every difference equal: no spread, the sign decides alone
        t_stat = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        p_value = 1.0 if mean == 0 else 0.0
    ci = Interval(mean, mean - half, mean + half, level, "paired t")
    return PairedDifference(mean, se, n, ci, t_stat, p_value, level)


def mean_of_estimates(
    estimates: Sequence[float], stderrs: Sequence[float], dfs: Sequence[float], level: float = DEFAULT_LEVEL
) -> Interval:
    """The mean of k independent estimates (e.g. a ΔCE measured at each of k batch sizes) with its interval.

    ``stderr = sqrt(Σ se_i²) / k``; degrees of freedom by Welch–Satterthwaite,
    ``(Σ se_i²)² / Σ (se_i⁴ / df_i)``; the interval is ``mean ± t_{(1+level)/2, df} · stderr``. All
    standard errors 0 give the point itself. ``dfs`` are the estimates' own degrees of freedom (n_i - 1).
    """
    _check_level(level)
    values = _values(estimates, "estimates")
    errors = _values(stderrs, "stderrs")
    freedom = _values(dfs, "dfs")
    if not values.size == errors.size == freedom.size:
        raise ValueError(f"estimates, stderrs and dfs must have equal length, got {values.size}, {errors.size} "
                         f"and {freedom.size}")
    if np.any(errors < 0) or np.any(freedom <= 0):
        raise ValueError("stderrs must be >= 0 and dfs > 0")
    mean = float(values.mean())
    variances = errors**2
    total = float(variances.sum())
    if total == 0:
        return Interval(mean, mean, mean, level, "t (combined)")
    df = total**2 / float(np.sum(variances**2 / freedom))
    half = t_quantile((1.0 + level) / 2.0, df) * math.sqrt(total) / values.size
    return Interval(mean, mean - half, mean + half, level, "t (combined)")


def unpaired_standard_error(a: Sequence[float], b: Sequence[float]) -> float:
    """Standard error of ``mean(a) - mean(b)`` for independent samples: ``sqrt(se_a² + se_b²)``.

    Given for contrast: with the same items in both, ``paired_difference(a, b).stderr`` equals
    ``sqrt(se_a² + se_b² - 2 cov(a, b) / n)``, smaller whenever the items' values correlate.
    """
    return math.hypot(standard_error(a), standard_error(b))
