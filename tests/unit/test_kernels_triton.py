"""The Triton kernel against ``oea.route`` in Triton's CPU interpreter, in a fresh process.

Triton reads ``TRITON_INTERPRET`` once, at its first import, so the cases (``triton_interpreter_cases.py``)
run in a child pytest started with it set; in this process other tests may have imported Triton already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oea
from oea.kernels import KernelUnavailableError, route_fast, triton_available

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not triton_available(), reason="the project's dev extra installs Triton")


def test_triton_kernel_in_the_interpreter_equals_route() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cases = ROOT / "tests" / "unit" / "triton_interpreter_cases.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_interpreter_asked_for_after_triton_was_imported_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.max, InterpretedFunction):
        pytest.skip("this process imported Triton with TRITON_INTERPRET set")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = oea.RouterSpec(8, 2, "softmax")
    with pytest.raises(KernelUnavailableError, match="set after Triton was imported"):
        route_fast(torch.randn(4, 8), spec, oea.OEAConfig(1), impl="triton")
    ids, _ = route_fast(torch.randn(4, 8), spec, oea.OEAConfig(1))  # auto: numba or torch, not Triton
    assert ids.shape == (4, 2)
