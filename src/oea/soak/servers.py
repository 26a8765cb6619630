"""Servers of a soak's arms: started with the project's launcher (``oea.launch.vllm`` or
``oea.launch.sglang_server``: its own session, so the whole process group is stopped together) on 127.0.0.1
with each arm's environment, or attached to.

The engine is ``--engine`` or, when not given, read from the server arguments as ``oea bench serve`` does
(``oea.bench.serve.engines.detect_engine``: a flag only SGLang's ``launch_server`` takes, e.g.
``--model-path``, means SGLang). An SGLang CPU server (``--device cpu``) whose interpreter has no
``sgl_kernel`` runs with the launcher's stand-in (``oea.launch.sglang_server``, docs/sglang.md section 9).

An arm's environment (``NAME=VAR=VALUE ...`` on the command line) says what the engine-side checks read:
``OEA_K0`` (OEA on, its k0), ``OEA_METRICS_FILE`` and ``OEA_TRACE_FILE``. Started servers also get
``LEAK_CHECK_ENV`` unless the arm sets those variables itself or the soak keeps the engine's caches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oea.launch.server_process import option as _option
from oea.soak.monitor import SoakError

# Caches that fill with every new matmul shape up to their capacity: the soak's mix of lengths keeps adding
# shapes, so with them on the memory check would see a cache filling instead of what is left (a leak). oneDNN's
# primitive cache (CPU servers): +191 MiB of vLLM's worker over 2,000 requests with it, +10 MiB
# without (docs/reliability.md, "What grows").
LEAK_CHECK_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


@dataclass
class Arm:
    """One arm: a name, the variables its server runs with, and (once started) the server."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    server: Any = None  # oea.launch.server_process.Server while it runs
    base_url: str | None = None

    @property
    def k0(self) -> int | None:
        value = self.env.get("OEA_K0")
        return int(value) if value not in (None, "") else None


def parse_arms(specs: Sequence[str]) -> list[Arm]:
    """``NAME=VAR=VALUE VAR2=VALUE2`` (or ``NAME=`` for no variable) -> arms, names unique."""
    from oea.launch.server_process import env_arm

    arms: list[Arm] = []
    for spec in specs:
        try:
            name, env = env_arm(spec, "--arm")
        except ValueError as err:
            raise SoakError(str(err)) from None
        if any(a.name == name for a in arms):
            raise SoakError(f"--arm names must be unique, got {name!r} twice")
        k0 = env.get("OEA_K0")
        if k0 is not None and not (k0.strip().isdigit() and int(k0) >= 1):
            raise SoakError(f"--arm {name}: OEA_K0 must be an integer >= 1, got {k0!r}")
        arms.append(Arm(name, env))
    return arms


def check_engine_args(engine_args: Sequence[str]) -> None:
    """The server arguments bind loopback only (``--host`` absent or a loopback address) and name a port."""
    host = _option(engine_args, "--host")
    if host not in (None, "127.0.0.1", "localhost", "::1"):
        raise SoakError(f"--host {host}: the soak's servers bind 127.0.0.1 only (they get malformed and aborted "
                        "requests); drop --host")
    if _option(engine_args, "--port") is None:
        raise SoakError("give the server a --port after '--' (e.g. -- --model DIR --port 8077)")


def engine_of(engine_args: Sequence[str], engine: str | None = None) -> str:
    """The engine the arms' servers run: ``engine`` when given (``vllm`` or ``sglang``), else detected from the
    server arguments (``--model-path`` and other SGLang-only flags: ``sglang``; otherwise ``vllm``)."""
    from oea.bench.serve.engines import ENGINES, detect_engine

    if engine is not None and engine not in ENGINES:
        raise SoakError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return engine or detect_engine(engine_args)


def interpreter(python: str | None) -> str:
    """``python`` as a path that names it from any working folder: a relative path made absolute; a bare name
    (looked up on ``PATH``) as it is; None: this interpreter."""
    if python is None:
        return sys.executable
    return str(Path(python).absolute()) if os.sep in python else python


def needs_stand_in(engine_args: Sequence[str], python: str) -> bool:
    """Whether an SGLang server needs oea's ``sgl_kernel`` stand-in: a CPU server (``--device cpu``) whose
    interpreter cannot find ``sgl_kernel``."""
    if _option(engine_args, "--device") != "cpu":
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sgl_kernel') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode != 0
    except (OSError, subprocess.TimeoutExpired):
        return True


def start(arm: Arm, engine_args: Sequence[str], python: str | None, log_dir: Path, nice: int | None = None,
          engine: str = "vllm", keep_engine_caches: bool = False) -> dict[str, str]:
    """Start ``arm``'s ``engine`` server (its variables on top of this environment without any ``OEA_*`` of
    ours, and ``LEAK_CHECK_ENV`` unless ``keep_engine_caches``) in this process's working folder, so that
    relative paths in the server arguments and in the arm's ``OEA_*_FILE`` variables name the same files for
    the server and for the checks that read them; its log goes to ``log_dir``. Returns the variables of
    ``LEAK_CHECK_ENV`` the server got."""
    from oea.launch.vllm import oea_env

    check_engine_args(engine_args)
    env = {k: v for k, v in oea_env(None, None).items() if not k.startswith("OEA_")}
    leak_check = {} if keep_engine_caches else {k: v for k, v in LEAK_CHECK_ENV.items() if k not in arm.env}
    env.update({**leak_check, **arm.env})
    log_dir.mkdir(parents=True, exist_ok=True)
    python = interpreter(python)
    log_path = log_dir / f"{arm.name}.log"
    if engine == "sglang":
        from oea.launch.sglang_server import start_server as start_sglang

        arm.server = start_sglang(list(engine_args), env, python=python, log_path=log_path, nice=nice,
                                  stand_in=needs_stand_in(engine_args, python))
    else:
        from oea.launch.vllm import start_server

        arm.server = start_server(list(engine_args), env, python=python, log_path=log_path, nice=nice)
    arm.base_url = arm.server.base_url
    return leak_check


def wait(arm: Arm, timeout_s: float) -> None:
    """Block until the arm's server answers ``/health`` (``RuntimeError`` with its log tail otherwise)."""
    from oea.launch.vllm import wait_healthy

    wait_healthy(arm.server, timeout=timeout_s)


def stop(arm: Arm) -> int | None:
    """Stop the arm's server by its process group (SIGTERM, then SIGKILL); its exit code."""
    from oea.launch.vllm import stop_server

    return None if arm.server is None else stop_server(arm.server)


def process_group(arm: Arm) -> int | None:
    """The process group of a started arm's server (None when it has exited)."""
    if arm.server is None:
        return None
    try:
        return os.getpgid(arm.server.process.pid)
    except ProcessLookupError:
        return None


def model_arg(engine_args: Sequence[str] | None) -> str | None:
    """The model folder of the server arguments: vLLM's ``--model``, SGLang's ``--model-path``."""
    args = list(engine_args or [])
    return _option(args, "--model") or _option(args, "--model-path")


def router_shape(model_dir: str | None) -> tuple[int, int] | None:
    """(routed experts N, top_k) from a local model folder's ``config.json`` (None when unknown)."""
    if not model_dir:
        return None
    path = Path(model_dir) / "config.json"
    try:
        config: Mapping[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), None)
    top_k = config.get("num_experts_per_tok")
    return (int(experts), int(top_k)) if isinstance(experts, int) and isinstance(top_k, int) else None
