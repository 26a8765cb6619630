"""Engine-free lifecycle of a local inference server process: start, wait for health, stop.

Every engine launcher (``oea.launch.vllm``, ``oea.launch.sglang_server``) starts its server through
``start_process``: the command runs in its own session (``setsid``), so it leads a process group that holds
every process the server spawns (vLLM's EngineCore and workers, SGLang's scheduler and detokenizer).
``stop_server`` signals that whole group, SIGTERM then SIGKILL (``stop_servers``: several at once), so no child is
left holding memory or a port, even when start-up failed. ``wait_healthy`` polls ``GET /health`` and fails at
once, with the log tail, when the server exits first; its timeout error names the setting that sets it.

Nothing here imports an engine.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Server:
    """A started server: its process (the process-group leader), base URL and log file.

    ``name`` is how errors call it (e.g. ``"vLLM server"``, ``"SGLang server"``).
    """

    process: subprocess.Popen
    base_url: str
    log_path: Path | None
    name: str = "server"

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log ('' when there is no log file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def strip_separator(args: Sequence[str]) -> list[str]:
    """The arguments after a leading ``--`` (argparse.REMAINDER keeps it)."""
    args = list(args)
    return args[1:] if args[:1] == ["--"] else args


def oea_env(k0: int | None = None, min_batch: int | None = None, base: Mapping[str, str] | None = None
            ) -> dict[str, str]:
    """``base`` (default: this process's environment) with the OEA variables set or removed.

    ``k0=None`` removes ``OEA_K0`` (and its alias), so the plugin routes as the stock engine does.
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


def env_arm(spec: str, flag: str) -> tuple[str, dict[str, str]]:
    """An A/B arm given as ``NAME=VAR=VALUE VAR2=VALUE2`` (``NAME=`` for no variable) -> ``(name, env)``.

    Raises ValueError naming ``flag`` (the option the arm came from) when there is no name or an item is not
    ``VAR=VALUE``; the values are split as a shell would (``shlex``), so a value may hold quoted spaces.
    """
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"{flag} must be NAME=ENV (ENV: space-separated VAR=VALUE, may be empty), got {spec!r}")
    env = {}
    for item in shlex.split(rest):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise ValueError(f"{flag} {name}: expected VAR=VALUE, got {item!r}")
        env[var] = value
    return name, env


def option(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``args`` (``--name VALUE`` or ``--name=VALUE``; the last one wins as argparse
    does), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def start_process(
    cmd: Sequence[str],
    env: Mapping[str, str],
    base_url: str,
    log_path: str | Path | None = None,
    cwd: str | Path | None = None,
    nice: int | None = None,
    name: str = "server",
) -> Server:
    """Start ``cmd`` in a new session with exactly ``env`` as its environment.

    Output goes to ``log_path`` (truncated; inherited stdout/stderr when None). ``nice``: the server's
    scheduling priority (-20..19, its session's autogroup included, inherited by its children; below 0 needs
    root or CAP_SYS_NICE; ``oea.launch.priority``). Returns at once; call ``wait_healthy`` next.
    Raises ``ValueError`` naming ``--server-nice`` for a priority out of range or one the system refuses.
    """
    if nice is not None and not -20 <= nice <= 19:
        raise ValueError(f"--server-nice must be in -20..19, got {nice}")
    from oea.launch.priority import set_priority

    log_file = None
    if log_path is not None:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
    try:
        proc = subprocess.Popen(
            list(cmd),
            env=dict(env),
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
    return Server(proc, base_url, log_path, name)


def is_healthy(base_url: str, timeout: float = 2.0) -> bool:
    """True iff ``GET {base_url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(server: Server, timeout: float = 600.0, poll: float = 1.0, timeout_name: str | None = None
                 ) -> None:
    """Block until ``/health`` answers 200.

    Raises ``RuntimeError`` (with the log tail) if the server exits first, or when ``timeout`` seconds pass;
    the timeout error names ``timeout_name`` (the option or variable that sets it) when given.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.name} exited with code {server.process.returncode} before {server.base_url}/health "
                f"answered; log tail:\n{server.log_tail()}"
            )
        if is_healthy(server.base_url):
            return
        time.sleep(poll)
    named = f" ({timeout_name})" if timeout_name else ""
    raise RuntimeError(f"{server.name} at {server.base_url} not healthy after {timeout:.0f} s{named}; log tail:\n"
                       f"{server.log_tail()}")


def stop_server(server: Server, grace: float = 20.0) -> int | None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after ``grace`` seconds.

    The group is killed even when the leader exits in time: children may outlive it. Returns the leader's
    exit code (None if it could not be reaped).
    """
    return stop_servers([server], grace)[0]


def stop_servers(servers: Sequence[Server], grace: float = 20.0) -> list[int | None]:
    """Stop several servers at once, each as ``stop_server`` does: SIGTERM to every group first, then one
    ``grace`` period for all of them (not one each: a server's shutdown is mostly waiting, and N servers stopped
    one after the other would take up to N x ``grace``), then SIGKILL to every group. Returns the leaders' exit
    codes in the order of ``servers``."""
    groups = []
    for server in servers:
        proc = server.process
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        own_group = pgid is not None and pgid == proc.pid
        if own_group:
            _signal_group(pgid, signal.SIGTERM)
        elif proc.poll() is None:
            proc.terminate()
        groups.append(pgid if own_group else None)
    deadline = time.monotonic() + grace
    codes: list[int | None] = []
    for server, pgid in zip(servers, groups, strict=True):
        try:
            codes.append(server.process.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
        finally:
            if pgid is not None:
                _signal_group(pgid, signal.SIGKILL)
    for index, server in enumerate(servers):
        if codes[index] is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                codes[index] = server.process.wait(timeout=grace)
    return codes


def signal_server(server: Server, sig: int) -> None:
    """Send ``sig`` to the server's whole process group (no wait; safe inside a signal handler)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
