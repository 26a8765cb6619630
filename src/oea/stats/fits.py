"""Linear least-squares fits with R² (``oea.stats`` re-exports them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oea.stats.intervals import _values


@dataclass(frozen=True)
class LinearFit:
    """Least-squares fit ``y ≈ Σ coefficients[j] · columns[j] (+ intercept)``.

    Attributes:
        coefficients: one per column, in column order.
        intercept: the constant term (0.0 when fitted without one).
        r2: coefficient of determination on the fitted points (see ``r_squared``).
        n: number of points.
    """

    coefficients: tuple[float, ...]
    intercept: float
    r2: float
    n: int

    def predict(self, columns: Sequence[Sequence[float]]) -> np.ndarray:
        """Predictions [n] for ``columns`` (one sequence of n values per coefficient)."""
        design = _design(columns, None, intercept=False)
        return design @ np.asarray(self.coefficients, dtype=np.float64) + self.intercept


def r_squared(observed: Sequence[float], predicted: Sequence[float]) -> float:
    """Coefficient of determination ``1 - SS_res / SS_tot`` of ``predicted`` against ``observed``.

    Constant ``observed`` (SS_tot = 0) gives 1.0 when the prediction is exact and 0.0 otherwise.
    """
    y = _values(observed, "observed")
    p = _values(predicted, "predicted")
    if y.size != p.size:
        raise ValueError(f"observed and predicted must have equal length, got {y.size} and {p.size}")
    residual = float(np.sum((y - p) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    if total == 0:
        return 1.0 if residual == 0 else 0.0
    return 1.0 - residual / total


def _design(columns: Sequence[Sequence[float]], n: int | None, intercept: bool) -> np.ndarray:
    arrays = [_values(column, f"columns[{j}]") for j, column in enumerate(columns)]
    if not arrays:
        raise ValueError("linear_fit needs at least one column")
    sizes = {a.size for a in arrays} | ({n} if n is not None else set())
    if len(sizes) != 1:
        raise ValueError(f"columns and observed must have equal lengths, got {sorted(sizes)}")
    if intercept:
        arrays.append(np.ones_like(arrays[0]))
    return np.column_stack(arrays)


def linear_fit(columns: Sequence[Sequence[float]], observed: Sequence[float], intercept: bool = True) -> LinearFit:
    """Ordinary least squares (``numpy.linalg.lstsq``) of ``observed`` on ``columns`` (+ an intercept).

    ``columns``: one sequence of n values per regressor. Needs at least as many points as fitted
    parameters (exactly as many gives an exact fit, R² = 1).
    """
    y = _values(observed, "observed")
    design = _design(columns, y.size, intercept)
    if y.size < design.shape[1]:
        raise ValueError(f"linear_fit needs at least as many points as parameters, got {y.size} points and "
                         f"{design.shape[1]} parameters")
    solution, *_ = np.linalg.lstsq(design, y, rcond=None)
    coefficients = tuple(float(c) for c in (solution[:-1] if intercept else solution))
    constant = float(solution[-1]) if intercept else 0.0
    return LinearFit(coefficients, constant, r_squared(y, design @ solution), int(y.size))
