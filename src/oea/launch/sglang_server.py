"""Start, health-check and stop a real SGLang server (``python -m sglang.launch_server``) with OEA settings.

The server runs in its own session through ``oea.launch.server_process``: stopping it kills the whole process
group (the HTTP server / tokenizer manager, the scheduler and the detokenizer processes SGLang spawns).
The OEA plugin reaches every one of those processes through SGLang's ``sglang.srt.plugins`` entry point; only
the environment (``OEA_K0``, ...) is set here.

On a CPU (``--device cpu``) SGLang's CPU engine needs ``SGLANG_USE_CPU_ENGINE=1`` (set here unless the
environment sets it) and, where SGLang's C++ kernel package ``sgl_kernel`` has no CPU build installed,
``stand_in=True``: the test-support stand-in of the source checkout's ``tests/support/sgl_kernel_stand_in`` goes
first on the server's ``PYTHONPATH`` (see its docstring: one torch kernel, no ``torch.ops.sgl_kernel`` ops, so SGLang
keeps its torch-native paths). Nothing is installed anywhere, and the ``oea`` wheel does not contain the stand-in: a CPU
SGLang server with it runs from a source checkout (``pip install -e .``) only, and says so when it starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from oea.launch.server_process import (
    Server,
    is_healthy,
    oea_env,
    signal_server,
    start_process,
    stop_server,
    strip_separator,
    wait_healthy,
)
from oea.launch.server_process import option as _option

__all__ = ["CPU_SERVER_ARGS", "LOCAL_SERVER_ENV", "STAND_IN_DIR", "Server", "cpu_server_args", "is_healthy",
           "oea_env", "server_env", "server_url", "signal_server", "start_server", "stop_server", "strip_separator",
           "wait_healthy"]

SGLANG_MAIN = "sglang.launch_server"
DEFAULT_PORT = "30000"  # sglang.launch_server's own default
# The folder that holds the stand-in package ``sgl_kernel``: test support in the source checkout (src/oea/launch ->
# the repository root), never installed; absent when oea runs from a wheel.
STAND_IN_DIR = Path(__file__).resolve().parents[3] / "tests" / "support" / "sgl_kernel_stand_in"
CPU_ENGINE_VAR = "SGLANG_USE_CPU_ENGINE"

# Loopback-only, offline defaults for a local server.
LOCAL_SERVER_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
}

# The CPU flag set that serves on SGLang's torch-native paths (docs/sglang.md, "Run a real SGLang server on CPU"):
# torch_native attention (SDPA; the CPU default intel_amx needs sgl_kernel), no overlap scheduler (as SGLang's CPU
# docs run it), and a capped KV pool (on CPU SGLang sizes it from free memory, far too large on a shared machine).
CPU_SERVER_ARGS: tuple[str, ...] = (
    "--device", "cpu", "--tp", "1", "--attention-backend", "torch_native", "--disable-overlap-schedule",
    "--dtype", "bfloat16", "--max-total-tokens", "4096", "--max-running-requests", "16",
)


def cpu_server_args(model_path: str | Path, port: int, host: str = "127.0.0.1", extra: Sequence[str] = ()
                    ) -> list[str]:
    """``sglang.launch_server`` arguments serving ``model_path`` on this CPU at ``host:port`` (``CPU_SERVER_ARGS``
    then ``extra``, whose flags win as argparse keeps the last value)."""
    return ["--model-path", str(model_path), *CPU_SERVER_ARGS, "--host", host, "--port", str(port), *extra]


def server_url(sglang_args: Sequence[str]) -> str:
    """The base URL the server will listen on, from its ``--host`` / ``--port`` (defaults 127.0.0.1:30000)."""
    host = _option(sglang_args, "--host") or "127.0.0.1"
    port = _option(sglang_args, "--port") or DEFAULT_PORT
    return f"http://{host}:{port}"


def server_env(sglang_args: Sequence[str], env: Mapping[str, str], stand_in: bool = False) -> dict[str, str]:
    """The server's environment: ``LOCAL_SERVER_ENV`` under ``env``, plus

    * ``SGLANG_USE_CPU_ENGINE=1`` when the arguments say ``--device cpu`` and ``env`` does not set it (without it
      SGLang's ``is_cpu()`` is false and it launches GPU kernels on CPU tensors);
    * with ``stand_in``, ``STAND_IN_DIR`` first on ``PYTHONPATH`` (the rest of ``env``'s ``PYTHONPATH`` kept);
      ``ValueError`` naming ``--sgl-kernel-stand-in`` when this installation has no stand-in (a wheel, not a checkout).
    """
    full = {**LOCAL_SERVER_ENV, **env}
    if _option(sglang_args, "--device") == "cpu" and CPU_ENGINE_VAR not in env:
        full[CPU_ENGINE_VAR] = "1"
    if stand_in:
        if not (STAND_IN_DIR / "sgl_kernel" / "__init__.py").is_file():
            raise ValueError(f"--sgl-kernel-stand-in: the sgl_kernel stand-in is test support of oea's source checkout "
                             f"and {STAND_IN_DIR} does not exist in this installation; run oea from a checkout "
                             f"(pip install -e .) or install SGLang's own sgl_kernel")
        rest = full.get("PYTHONPATH", "")
        full["PYTHONPATH"] = os.pathsep.join([str(STAND_IN_DIR), *([rest] if rest else [])])
    return full


def start_server(
    sglang_args: Sequence[str],
    env: Mapping[str, str],
    python: str | None = None,
    log_path: str | Path | None = None,
    cwd: str | Path | None = None,
    nice: int | None = None,
    stand_in: bool = False,
) -> Server:
    """Start ``python -m sglang.launch_server *sglang_args`` in a new session (``server_env`` for its
    environment; ``--host 127.0.0.1`` added when the arguments name no host).

    ``env`` is the whole environment of the server (e.g. ``oea.launch.vllm.oea_env(k0)``: OEA_K0 and
    friends). Output goes to ``log_path`` (inherited when None). ``nice``: as in
    ``oea.launch.server_process.start_process``. Returns at once; call ``wait_healthy`` next (SGLang answers
    ``/health`` with 200 once its warm-up request has run).
    """
    args = list(sglang_args)
    if _option(args, "--host") is None:
        args += ["--host", "127.0.0.1"]
    cmd = [python or sys.executable, "-m", SGLANG_MAIN, *args]
    return start_process(cmd, server_env(args, env, stand_in), server_url(args), log_path=log_path, cwd=cwd,
                         nice=nice, name="SGLang server")
