"""Paired comparison of two arms scored on the same items: the quality A/B of ``oea eval serve``.

Every item was answered by both arms (the baseline and the treatment); each has a score per arm, pass/fail
(0 or 1: exact match) or graded (in [0, 1]: a similarity). With ``d_i = treatment_i - baseline_i`` over n items:

* ``delta`` = mean(d) with its paired t interval (``paired_difference``; for pass/fail items this is the
  difference of the two pass rates with the Wald interval of a paired proportion difference);
* ``p_value``: pass/fail: the exact McNemar test (two-sided binomial test of the discordant pairs, ``b``
  baseline-pass/treatment-fail against ``c`` baseline-fail/treatment-pass, with p = 1/2; ``scipy.stats.binomtest``);
  graded: the paired two-sided t-test;
* ``verdict``: ``"worse"`` / ``"better"`` when ``p_value < 1 - level`` (the sign of ``delta`` decides; higher
  scores are better), else ``"no significant difference"``;
* ``min_detectable_delta``: the smallest |delta| this many items would detect with probability ``power`` (0.8) at
  this level, from the normal approximation ``delta = k * sd(d) / sqrt(n)``, ``k = z_{1-a/2} + z_power``:

  - pass/fail: a true difference delta needs at least delta of the items discordant, so
    ``var(d) = max(p_disc, delta) - delta^2`` with ``p_disc`` the observed discordant share; solving gives
    ``delta = k sqrt(p_disc / (n + k^2))`` while that is at most ``p_disc``, else ``k^2 / (n + k^2)`` (the bound
    when hardly any item differs: 500 identical items detect 1.55 points, not 0);
  - graded: ``sd(d)`` observed; when every difference is 0 the baseline scores' own sd stands in for it (an
    identical run says nothing about how the scores would spread once they differ).

Agreement (``output_agreement``): the share of byte-identical outputs with its Wilson interval, and the mean
token position of the first difference over the items that differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oea.stats.intervals import DEFAULT_LEVEL, VERDICTS, Interval, _check_level, _values, paired_difference
from oea.stats.proportions import proportion_interval

DEFAULT_POWER = 0.8


@dataclass(frozen=True)
class ItemComparison:
    """One arm against the baseline over the same n items (see the module docstring for each rule).

    Attributes:
        n: items compared (pairs).
        score: the treatment's mean score with its interval (t; Wilson for pass/fail).
        baseline_score: the baseline's mean score with its interval.
        delta: mean(treatment - baseline) with its paired t interval.
        p_value: exact McNemar (pass/fail) or paired t-test (graded), two-sided.
        test: ``"exact McNemar"`` or ``"paired t"``.
        verdict: one of ``VERDICTS``.
        min_detectable_delta: smallest |delta| detectable with ``power`` at ``level``.
        discordant: (baseline pass & treatment fail, baseline fail & treatment pass) for pass/fail, else None.
    """

    n: int
    score: Interval
    baseline_score: Interval
    delta: Interval
    p_value: float
    test: str
    verdict: str
    min_detectable_delta: float
    discordant: tuple[int, int] | None


def _normal_quantile(probability: float) -> float:
    from scipy import special

    return float(special.ndtri(probability))


def mcnemar_exact(treatment: Sequence[float], baseline: Sequence[float]) -> tuple[float, int, int]:
    """Exact McNemar test of paired pass/fail items (scores 0 or 1): ``(p_value, b, c)`` with ``b`` the items the
    baseline passed and the treatment failed, ``c`` the reverse, and the two-sided binomial p of ``c`` out of
    ``b + c`` at 1/2 (1.0 when no pair is discordant)."""
    t, base = _binary(treatment, "treatment"), _binary(baseline, "baseline")
    if t.size != base.size:
        raise ValueError(f"paired samples must have equal length, got {t.size} and {base.size}")
    b = int(np.sum((base == 1) & (t == 0)))
    c = int(np.sum((base == 0) & (t == 1)))
    if b + c == 0:
        return 1.0, b, c
    from scipy import stats

    return float(stats.binomtest(c, b + c, 0.5).pvalue), b, c


def _binary(values: Sequence[float], name: str) -> np.ndarray:
    array = _values(values, name)
    if not np.all((array == 0) | (array == 1)):
        raise ValueError(f"{name} must hold pass/fail scores (0 or 1)")
    return array


def is_pass_fail(*samples: Sequence[float]) -> bool:
    """Whether every score of every sample is 0 or 1."""
    return all(bool(np.all((np.asarray(s) == 0) | (np.asarray(s) == 1))) for s in samples)


def min_detectable_pass_fail(n: int, discordant_share: float, level: float = DEFAULT_LEVEL,
                             power: float = DEFAULT_POWER) -> float:
    """Smallest pass-rate difference ``n`` paired pass/fail items detect (module docstring); in (0, 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0.0 <= discordant_share <= 1.0:
        raise ValueError(f"discordant_share must be in [0, 1], got {discordant_share}")
    k = _normal_quantile((1.0 + level) / 2.0) + _normal_quantile(power)
    delta = k * math.sqrt(discordant_share / (n + k * k))
    return delta if 0 < delta <= discordant_share else k * k / (n + k * k)


def min_detectable_graded(differences_sd: float, n: int, level: float = DEFAULT_LEVEL,
                          power: float = DEFAULT_POWER) -> float:
    """Smallest mean difference ``n`` paired items with differences of sd ``differences_sd`` detect:
    ``(t_{1-a/2, n-1} + t_{power, n-1}) * sd / sqrt(n)``."""
    from oea.stats.intervals import t_quantile

    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    k = t_quantile((1.0 + level) / 2.0, n - 1) + t_quantile(power, n - 1)
    return k * differences_sd / math.sqrt(n)


def compare_items(treatment: Sequence[float], baseline: Sequence[float], level: float = DEFAULT_LEVEL,
                  power: float = DEFAULT_POWER) -> ItemComparison:
    """``treatment`` against ``baseline`` over the same n >= 2 items (``treatment[i]`` and ``baseline[i]`` score
    the same item); pass/fail when every score is 0 or 1, graded otherwise."""
    _check_level(level)
    t, base = _values(treatment, "treatment", 2), _values(baseline, "baseline", 2)
    diff = paired_difference(t, base, level)
    n = diff.n
    if is_pass_fail(t, base):
        p_value, b, c = mcnemar_exact(t, base)
        score = proportion_interval(float(t.mean()), n, level)
        baseline_score = proportion_interval(float(base.mean()), n, level)
        mdd = min_detectable_pass_fail(n, (b + c) / n, level, power)
        test, discordant = "exact McNemar", (b, c)
    else:
        from oea.stats.intervals import mean_interval

        p_value, test, discordant = diff.p_value, "paired t", None
        score, baseline_score = mean_interval(t, level), mean_interval(base, level)
        sd = float(np.std(t - base, ddof=1))
        mdd = min_detectable_graded(sd if sd > 0 else float(np.std(base, ddof=1)), n, level, power)
    verdict = (VERDICTS[0] if diff.mean < 0 else VERDICTS[1]) if p_value < 1.0 - level else VERDICTS[2]
    return ItemComparison(n, score, baseline_score, diff.ci, p_value, test, verdict, mdd, discordant)


@dataclass(frozen=True)
class Agreement:
    """How often two arms wrote the same thing.

    Attributes:
        share: byte-identical outputs / items, with its Wilson interval.
        first_difference: mean token position (0-based) of the first token that differs, over the items whose
            outputs differ and whose tokens are known (None when no such item).
        differing: items whose outputs differ.
    """

    share: Interval
    first_difference: float | None
    differing: int


def first_difference(a: Sequence[str], b: Sequence[str]) -> int:
    """The 0-based position of the first token where ``a`` and ``b`` differ (the shorter length when one is a
    prefix of the other)."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return min(len(a), len(b))


def output_agreement(outputs: Sequence[str], baseline: Sequence[str],
                     tokens: Sequence[Sequence[str] | None] | None = None,
                     baseline_tokens: Sequence[Sequence[str] | None] | None = None,
                     level: float = DEFAULT_LEVEL) -> Agreement:
    """Agreement of paired outputs (the same items, in the same order); ``tokens`` / ``baseline_tokens``: each
    output's tokens (None where unknown), for the position of the first difference."""
    if len(outputs) != len(baseline) or not outputs:
        raise ValueError(f"paired outputs must be non-empty and of equal length, got {len(outputs)} and "
                         f"{len(baseline)}")
    same = [a == b for a, b in zip(outputs, baseline, strict=False)]
    positions = []
    if tokens is not None and baseline_tokens is not None:
        positions = [first_difference(ta, tb) for equal, ta, tb in zip(same, tokens, baseline_tokens, strict=False)
                     if not equal and ta is not None and tb is not None]
    share = proportion_interval(sum(same) / len(same), len(same), level)
    return Agreement(share, float(np.mean(positions)) if positions else None, len(same) - sum(same))
