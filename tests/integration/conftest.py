"""Fixtures of the integration tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def embedded() -> tuple[Any, Any]:
    """The shipped embedded model and its tokenizer, loaded once per test module (a module may attach policies
    to it; the next module starts from a fresh copy)."""
    pytest.importorskip("transformers")
    from oea.models import load_embedded

    return load_embedded()
