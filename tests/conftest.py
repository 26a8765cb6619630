"""Configuration shared by every test: the Hypothesis profiles (docs/testing.md, "Property tests").

``ci`` (the default) is deterministic: ``derandomize`` draws the same examples on every run and machine,
and no example database carries failures from one run to the next, so a fresh clone in CI tests exactly
what a developer's run did. ``explore`` draws new random examples on each run, ten times as many, and keeps
a local database of failures (``.hypothesis/``) to replay them. Pick one with ``OEA_HYPOTHESIS_PROFILE``.
Each property test sizes its own budget for ``ci`` with ``property_cases.examples(n)``, which the
profile scales; the boundaries are explicit ``@example``s that every profile runs first.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

PROFILE_VARIABLE = "OEA_HYPOTHESIS_PROFILE"
CI_EXAMPLES = 100  # property_cases.examples(n) scales n by the loaded profile's max_examples over this

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          max_examples=CI_EXAMPLES)
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True,
                          max_examples=10 * CI_EXAMPLES)

_profile = os.environ.get(PROFILE_VARIABLE, "ci")
if _profile not in ("ci", "explore"):
    raise pytest.UsageError(f"{PROFILE_VARIABLE} must be 'ci' or 'explore', got {_profile!r}")
settings.load_profile(_profile)
