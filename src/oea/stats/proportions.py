"""Intervals for a proportion: the Wilson score interval, which never leaves [0, 1].

A t interval around a share (``mean ± t · se``) runs below 0 or above 1 when the share is near either end
or rests on few items (``46 ±50`` %); the Wilson interval inverts the score test instead and stays inside.
"""

from __future__ import annotations

import math

from oea.stats.intervals import DEFAULT_LEVEL, Interval, _check_level


def proportion_interval(proportion: float, trials: int, level: float = DEFAULT_LEVEL) -> Interval:
    """``proportion`` of ``trials`` independent trials with its Wilson score interval (inside [0, 1]).

    ``low, high = (p + z²/2n ∓ z·sqrt(p(1 - p)/n + z²/4n²)) / (1 + z²/n)`` with ``z`` the standard normal
    quantile at ``(1 + level) / 2``. ``proportion`` may be a mean of per-trial shares in [0, 1] (e.g. each
    row's share of tokens that agree) rather than successes / trials: a share with mean p has variance at
    most p(1 - p), so the interval is then conservative. Needs ``trials >= 1``.
    """
    _check_level(level)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    if not (isinstance(proportion, (int, float)) and 0.0 <= proportion <= 1.0):
        raise ValueError(f"proportion must be a number in [0, 1], got {proportion!r}")
    from scipy import special

    z = float(special.ndtri((1.0 + level) / 2.0))
    z2n = z * z / trials
    centre = (proportion + z2n / 2.0) / (1.0 + z2n)
    half = z * math.sqrt(proportion * (1.0 - proportion) / trials + z2n / (4.0 * trials)) / (1.0 + z2n)
    # the interval always holds p (p = 0 and p = 1 are its ends); min / max only undo rounding there
    low, high = min(proportion, max(0.0, centre - half)), max(proportion, min(1.0, centre + half))
    return Interval(float(proportion), float(low), float(high), level, "wilson")
