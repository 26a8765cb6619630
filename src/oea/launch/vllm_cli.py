"""``oea serve vllm``: start vLLM's OpenAI server with OEA settings, wait for /health, forward signals."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from oea.launch.vllm import memory_defaults, oea_env, signal_server, start_server, stop_server, wait_healthy


def strip_separator(args: list[str]) -> list[str]:
    """The arguments after a leading ``--`` (argparse.REMAINDER keeps it)."""
    return args[1:] if args[:1] == ["--"] else args


def main(args: argparse.Namespace) -> int:
    """Run the server until it exits or this process gets SIGINT/SIGTERM; returns its exit code."""
    vllm_args = strip_separator(list(args.vllm_args))
    if not vllm_args:
        raise ValueError("give the vLLM server arguments after '--', e.g. oea serve vllm --k0 3 -- --model DIR")
    env = oea_env(args.k0, args.min_batch)
    if args.metrics_file:
        env["OEA_METRICS_FILE"] = args.metrics_file
    if args.timing:
        env["OEA_TIMING"] = "1"
    if args.k0 is not None:  # fail here, not inside three vLLM processes
        from oea.config import settings_from_env

        settings_from_env(env)
    applied = memory_defaults(env, vllm_args)
    defaults = "".join(f"; {var}={value} (CPU KV cache GiB; set it, --kv-cache-memory-bytes or "
                       "--gpu-memory-utilization to choose)" for var, value in applied.items())
    server = start_server(vllm_args, env, python=args.python)
    stopping = {"signal": None}

    def forward(signum: int, _frame: object) -> None:
        # Only signal here: waiting on the child inside a handler can deadlock with the main loop's wait.
        stopping["signal"] = signum
        signal_server(server, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        wait_healthy(server, timeout=args.health_timeout)
        if getattr(args, "json", False):
            import json

            print(json.dumps({"ready": server.base_url, "pid": server.process.pid,
                              "oea_env": {k: v for k, v in env.items() if k.startswith("OEA_")},
                              "defaults": applied}), flush=True)
        print(f"oea serve vllm: ready at {server.base_url} (OEA_K0={env.get('OEA_K0', 'unset')}, "
              f"pid {server.process.pid}{defaults})", file=sys.stderr, flush=True)
        while server.process.poll() is None and stopping["signal"] is None:
            time.sleep(0.2)
        if stopping["signal"] is not None:
            stop_server(server)
            return 128 + int(stopping["signal"])
        return int(server.process.returncode)
    except RuntimeError as err:
        if stopping["signal"] is not None:
            return 128 + int(stopping["signal"])
        print(f"oea serve vllm: error: {err}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server.process.poll() is None:
            stop_server(server)
