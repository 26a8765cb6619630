"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo caches the modules traced code imports (process-wide, ``symbolic_convert._import_module``): each
    test's stand-in ``vllm.forward_context`` (``vllm_stand_ins``) is a new module, so forget the cached one
    before and after."""
    from torch._dynamo import symbolic_convert

    def forget() -> None:
        torch._dynamo.reset()
        cached_import = getattr(symbolic_convert, "_import_module", None)
        if hasattr(cached_import, "cache_clear"):
            cached_import.cache_clear()

    forget()
    yield
    forget()


@pytest.fixture
def imported_trace(tmp_path: Path) -> Callable[[int, int], Path]:
    """``make(requests, steps)``: a seeded 60-expert top-4 trace of two layers, ``requests`` rows per decode step
    for ``steps`` steps (lock-step), written by ``oea traces import`` from an ``.npz`` of routed ids."""
    from oea.cli import main

    def make(requests: int, steps: int) -> Path:
        rows = requests * steps
        logits = np.random.default_rng(0).standard_normal((rows, 2, 60))
        ids = tmp_path / "imported.npz"
        np.savez(ids, ids=np.argsort(-logits, -1)[..., :4], request_ids=np.arange(rows) % requests,
                 positions=np.arange(rows) // requests)
        out = tmp_path / "imported.safetensors"
        assert main(["traces", "import", str(ids), "--out", str(out), "--num-experts", "60", "--top-k", "4"]) == 0
        return out

    return make
