"""The statistics of the project, in one place: intervals, paired comparisons, proportions, linear fits.

Every figure a user reads should carry its interval; the tools take them from here (``from oea.stats
import ...``; the files below are how the package is organised, not separate APIs).

* ``mean_interval``: mean ± Student-t interval (the default for a mean over independent items).
* ``bootstrap_interval`` / ``mean_bootstrap_interval`` / ``median_interval``: percentile bootstrap.
* ``ratio_of_medians_interval`` / ``ratio_of_means_interval``: median(a) / median(b) or mean(a) /
  mean(b), resampled in pairs (same round / item) or independently.
* ``paired_difference``: per-item differences, their standard error, t interval and the paired
  two-sided t-test (the rule is stated on ``PairedDifference``).
* ``mean_of_estimates``: the mean of independent estimates with their standard errors (Welch–Satterthwaite).
  (all of these in ``intervals.py``)
* ``proportion_interval``: a share with its Wilson score interval, inside [0, 1] (``proportions.py``).
* ``linear_fit`` / ``r_squared``: ordinary least squares with R² (``fits.py``).
* ``compare_items`` / ``mcnemar_exact`` / ``output_agreement``: two arms scored on the same items (pass/fail or
  graded): difference with interval, exact McNemar or paired t, verdict, minimum detectable difference, share of
  identical outputs (``paired_items.py``).

Inputs are 1-D sequences of finite floats (lists, tuples, numpy arrays); every function raises
``ValueError`` naming the problem for empty, non-finite, mismatched or too-short input. Bootstrap
functions take a ``numpy.random.Generator`` so that results are reproducible. Student-t and normal
quantiles come from ``scipy.special`` (imported on first use).
"""

from oea.stats.fits import LinearFit, linear_fit, r_squared
from oea.stats.intervals import (
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    VERDICTS,
    Interval,
    PairedDifference,
    bootstrap_interval,
    mean_bootstrap_interval,
    mean_interval,
    mean_of_estimates,
    median_interval,
    paired_difference,
    ratio_of_means_interval,
    ratio_of_medians_interval,
    standard_error,
    t_quantile,
    t_two_sided_p,
    unpaired_standard_error,
)
from oea.stats.paired_items import (
    Agreement,
    ItemComparison,
    compare_items,
    first_difference,
    mcnemar_exact,
    min_detectable_graded,
    min_detectable_pass_fail,
    output_agreement,
)
from oea.stats.proportions import proportion_interval

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_RESAMPLES",
    "VERDICTS",
    "Agreement",
    "Interval",
    "ItemComparison",
    "LinearFit",
    "PairedDifference",
    "bootstrap_interval",
    "compare_items",
    "first_difference",
    "linear_fit",
    "mcnemar_exact",
    "mean_bootstrap_interval",
    "mean_interval",
    "mean_of_estimates",
    "median_interval",
    "min_detectable_graded",
    "min_detectable_pass_fail",
    "output_agreement",
    "paired_difference",
    "proportion_interval",
    "r_squared",
    "ratio_of_means_interval",
    "ratio_of_medians_interval",
    "standard_error",
    "t_quantile",
    "t_two_sided_p",
    "unpaired_standard_error",
]
