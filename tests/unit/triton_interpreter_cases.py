"""The Triton kernel in Triton's CPU interpreter (``TRITON_INTERPRET=1``) against ``oea.route``.

Run by ``test_kernels_triton.py`` in a fresh process started with ``TRITON_INTERPRET=1``: Triton reads it at
its first import, and in the suite's own process other tests may import Triton first.

Same generated cases as the numba tests (``scripts/kernel_sweep.py``), smaller (the interpreter runs each
kernel op in numpy): ids bit-equal slot by slot, weights within the dispatcher's tolerance.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # already set by the runner; this keeps a direct run honest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import SWEEP, examples, seeded, with_boundaries

import oea
from oea.kernels import plan, route_fast, triton_available

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(not triton_available(), reason="the project's dev extra installs Triton")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@with_boundaries()
@settings(max_examples=examples(40))
@given(st.integers(0, 2**31 - 1).map(lambda seed: seeded(seed, max_rows=20, sizes=(4, 8, 12, 24, 32, 64))))
def test_triton_kernel_equals_route(case):
    logits, spec, cfg, valid = case.case
    assert plan(logits, spec, cfg, impl="triton")[0] == "triton"
    got = route_fast(logits, spec, cfg, valid, impl="triton")
    assert SWEEP.mismatch(got, oea.route(logits, spec, cfg, valid)) is None


def test_several_tiles_share_one_union():
    """More rows than one program's tile: the union and the valid-row count cross tiles (launch 2 reads them)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 256, generator=gen)  # N = 256: 16 rows per tile, 3 tiles
    valid = torch.rand(40, generator=gen) < 0.8
    spec = oea.RouterSpec(256, 8, "sigmoid", correction_bias=torch.randn(256, generator=gen) * 0.05, n_group=8,
                          topk_group=4, routed_scaling_factor=2.5)
    for cfg in (oea.OEAConfig(3), oea.OEAConfig(2, min_batch=40), oea.OEAConfig(1, group_fill="cross")):
        got = route_fast(logits, spec, cfg, valid, impl="triton")
        assert SWEEP.mismatch(got, oea.route(logits, spec, cfg, valid)) is None
