"""What the property tests share: each test's example budget under the loaded Hypothesis profile
(``tests/conftest.py``) and the boundary cases every run checks first, as explicit ``@example``s.

The boundary cases come from ``scripts/kernel_sweep.py`` (``boundary_cases``), the generator of the
kernel sweep and of the random cases: ``min_batch`` - 1 / exactly / + 1 real rows with and without
padding rows, k0 = 1 and k0 = k, every row padding, two experts per group and a single group, ties.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import example, settings
from project_scripts import load_script

import oea

SWEEP = load_script("kernel_sweep")
Case = tuple[torch.Tensor, oea.RouterSpec, Any, torch.Tensor | None]  # (logits [M, N], spec, cfg, valid [M])


def examples(ci: int) -> int:
    """A property test's example count: ``ci`` under the ``ci`` profile, scaled as the loaded profile's
    ``max_examples`` is to ``ci``'s (``explore``: ten times as many)."""
    return max(1, round(ci * settings.default.max_examples / settings.get_profile("ci").max_examples))


@dataclass(frozen=True)
class NamedCase:
    """One routing call with a short name (what Hypothesis prints for a failing example)."""

    name: str
    case: Case

    def __repr__(self) -> str:
        return self.name


def seeded(seed: int, **options: Any) -> NamedCase:
    """``kernel_sweep.random_case(seed, **options)``, named by its arguments."""
    extra = "".join(f", {key}={value!r}" for key, value in options.items())
    return NamedCase(f"random_case({seed}{extra})", SWEEP.random_case(seed, **options))


def boundary_cases(configs: tuple[type, ...] | None = None) -> list[NamedCase]:
    """The boundary cases, optionally only those whose config is one of ``configs`` (``type(None)`` for vanilla)."""
    cases = [NamedCase(name, case) for name, case in SWEEP.boundary_cases()]
    return [c for c in cases if configs is None or isinstance(c.case[2], configs)]


def with_boundaries(configs: tuple[type, ...] | None = None, named: bool = True) -> Callable[[Any], Any]:
    """Decorator (above ``@given``): every boundary case as an explicit ``@example`` of the test's one
    argument, a ``NamedCase`` or (``named=False``) the bare (logits, spec, cfg, valid) tuple."""

    def decorate(test: Any) -> Any:
        for case in reversed(boundary_cases(configs)):
            test = example(case if named else case.case)(test)
        return test

    return decorate
