"""Configuration shared by every test: the Hypothesis profiles (docs/testing.md, "Property tests").

``ci`` (the default) is deterministic: ``derandomize`` draws the same examples on every run and machine,
and no example database carries failures from one run to the next, so a fresh clone in CI tests exactly
what a developer's run did. ``explore`` draws new random examples on each run, ten times as many, and keeps
a local database of failures (``.hypothesis/``) to replay them. Pick one with ``OEA_HYPOTHESIS_PROFILE``.
Each property test sizes its own budget for ``ci`` with ``property_cases.examples(n)``, which the
profile scales; the boundaries are explicit ``@example``s that every profile runs first.

And how the engine tests are spread over two pytest-xdist workers when asked to (``make test-engines
ENGINE_XDIST="-n 2 --dist loadscope"``; ``make test`` runs them in one process, measured faster on two cores):
one work unit per engine, so each engine's tests run in one worker and in collection order
(tests/engines/conftest.py).
"""

from __future__ import annotations

import os
from typing import Any

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


def engine_of(nodeid: str) -> str:
    """The xdist work unit of an engine test: ``sglang`` for SGLang's modules, ``vllm`` for the rest (vLLM's and
    the CUDA wheels' source checks, which start no server)."""
    return "sglang" if "/test_sglang_" in f"/{nodeid.rsplit('/', 1)[-1]}" else "vllm"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With ``--dist loadscope``: one work unit per engine (``engine_of``) instead of one per module, so that each
    engine's tests run in one worker and in order."""
    if config.getoption("dist", None) != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByEngine(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return engine_of(nodeid)

    return ByEngine(config, log)
