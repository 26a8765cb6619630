"""What the real vLLM CPU server tests share: a free loopback port and a clean server environment."""

from __future__ import annotations

import socket


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
