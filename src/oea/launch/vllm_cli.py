"""``oea serve vllm`` (parser and handler): start vLLM's OpenAI server with OEA settings, wait for /health,
forward signals."""

from __future__ import annotations

import argparse
import signal
import sys
import time


def main(args: argparse.Namespace) -> int:
    """Run the server until it exits or this process gets SIGINT/SIGTERM; returns its exit code."""
    from oea.launch.vllm import (
        memory_defaults,
        oea_env,
        signal_server,
        start_server,
        stop_server,
        strip_separator,
        wait_healthy,
    )

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


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def register(commands: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    """``oea serve`` and ``oea serve vllm``."""
    s = commands.add_parser("serve", help="start an inference server with OEA enabled")
    engines = s.add_subparsers(dest="serve_engine", metavar="ENGINE")
    s.set_defaults(handler=lambda _args: _usage(s))
    v = engines.add_parser(
        "vllm",
        help="python -m vllm.entrypoints.openai.api_server with OEA_K0/OEA_MIN_BATCH set",
        description="Sets OEA_K0 / OEA_MIN_BATCH, starts vLLM's OpenAI server (bound to 127.0.0.1 unless "
                    "--host is given after '--'), waits for /health and forwards SIGINT/SIGTERM.",
    )
    v.add_argument("--k0", type=int, help="baseline experts per token (1..top_k); omit for stock routing")
    v.add_argument("--min-batch", type=int, help="vanilla routing below this many rows (OEA_MIN_BATCH)")
    v.add_argument("--metrics-file", help="OEA_METRICS_FILE: JSONL of active experts per decode step")
    v.add_argument("--timing", action="store_true", help="OEA_TIMING=1: time the routing op in the worker")
    v.add_argument("--python", help="interpreter with vLLM installed (default: this one)")
    v.add_argument("--health-timeout", type=float, default=900.0,
                   help="longest wait for the server's /health before giving up (seconds)")
    v.add_argument("--json", action="store_true",
                   help="announce readiness as one JSON line on stdout (url, pid, OEA settings) for scripts")
    v.add_argument("vllm_args", nargs=argparse.REMAINDER, help="'--' then vLLM server arguments")
    v.set_defaults(handler=main)
