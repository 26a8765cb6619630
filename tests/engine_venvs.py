"""Where the engines' virtualenvs are, and the one policy for a missing one: in CI (``CI`` set) it fails the
test, since ``make test`` builds every venv first; on a workstation it skips, naming the command that builds it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENVS: dict[str, tuple[Path, str]] = {  # engine -> (its Python, the command that builds it)
    "vllm": (ROOT / ".venv-vllm" / "bin" / "python", "bash scripts/install_vllm_cpu.sh"),
    "sglang": (ROOT / ".venv-sglang" / "bin" / "python", "bash scripts/install_sglang_cpu.sh"),
}


def engine_python(engine: str) -> Path:
    """The Python of ``engine``'s venv; a missing venv fails in CI and skips elsewhere (naming its command)."""
    python, build = VENVS[engine]
    if not python.exists():
        message = f"{python} is missing: run `{build}` (make test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: ours without any ``OEA_*`` / ``SGLANG_OEA_*`` setting, one compute thread, and
    ``PYTHONPATH`` kept (``scripts/mutation_check.py`` points it at a mutated copy of src/)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OEA_", "SGLANG_OEA_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(extra or {})})
    return env
