"""``oea serve``, ``oea serve vllm`` and ``oea serve sglang``: the one serve command line for both engines (parsers and
handler): start the engine's server with OEA settings, wait for /health, forward signals. Lean: it needs none of the
``oea[lab]`` dependencies."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time


def main(args: argparse.Namespace) -> int:
    """``oea serve vllm``: run the server until it exits or this process gets SIGINT/SIGTERM; its exit code."""
    return _serve(args, "vllm")


def main_sglang(args: argparse.Namespace) -> int:
    """``oea serve sglang``: as ``main`` for ``python -m sglang.launch_server``."""
    return _serve(args, "sglang")


def _serve(args: argparse.Namespace, engine: str) -> int:
    from oea.launch.server_process import oea_env, signal_server, stop_server, strip_separator, wait_healthy

    name = f"oea serve {engine}"
    engine_args = strip_separator(list(args.engine_args))
    if not engine_args:
        example = "--model DIR" if engine == "vllm" else "--model-path DIR"
        raise ValueError(f"give the {engine} server arguments after '--', e.g. {name} --k0 3 -- {example}")
    if args.python is not None and shutil.which(args.python) is None:  # before the start, not a bare [Errno 2]
        raise ValueError(f"--python {args.python}: no such executable; give the interpreter that has {engine} "
                         f"installed (e.g. .venv-{engine}/bin/python)")
    env = oea_env(args.k0, args.min_batch)
    if args.metrics_file:
        env["OEA_METRICS_FILE"] = args.metrics_file
    if args.timing:
        env["OEA_TIMING"] = "1"
    if args.k0 is not None:  # fail here, not inside the engine's processes
        from oea.config import settings_from_env

        settings_from_env(env)
    applied: dict[str, str] = {}
    defaults = ""
    if engine == "vllm":
        from oea.launch.vllm import memory_defaults, start_server

        applied = memory_defaults(env, engine_args)
        defaults = "".join(f"; {var}={value} (CPU KV cache GiB; set it, --kv-cache-memory-bytes or "
                           "--gpu-memory-utilization to choose)" for var, value in applied.items())
        server = start_server(engine_args, env, python=args.python)
    else:
        from oea.launch.sglang_server import start_server as start_sglang

        if args.sgl_kernel_stand_in:
            # The named feature "SGLang CPU server with the sgl_kernel stand-in": kept for CPU development, said at
            # start because it is test support (source checkout only), not a tuned CPU build of SGLang.
            print(f"{name}: warning: SGLang CPU server with the sgl_kernel stand-in: oea's test support from the "
                  "source checkout, SGLang's torch-native paths only (docs/sglang.md)", file=sys.stderr, flush=True)
            defaults = "; sgl_kernel: oea's test-support stand-in (SGLang's torch-native paths only)"
        server = start_sglang(engine_args, env, python=args.python, stand_in=args.sgl_kernel_stand_in)
    stopping = {"signal": None}

    def forward(signum: int, _frame: object) -> None:
        # Only signal here: waiting on the child inside a handler can deadlock with the main loop's wait.
        stopping["signal"] = signum
        signal_server(server, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        wait_healthy(server, timeout=args.health_timeout, timeout_name="--health-timeout")
        if getattr(args, "json", False):
            import json

            print(json.dumps({"ready": server.base_url, "pid": server.process.pid,
                              "oea_env": {k: v for k, v in env.items() if k.startswith("OEA_")},
                              "defaults": applied}), flush=True)
        print(f"{name}: ready at {server.base_url} (OEA_K0={env.get('OEA_K0', 'unset')}, "
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
        print(f"{name}: error: {err}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server.process.poll() is None:
            stop_server(server)


def overview(engines: argparse._SubParsersAction) -> dict[str, object]:
    """``oea serve --json``: the engines ``oea serve`` starts (every registered ``oea serve ENGINE``) and what
    the OEA variables of this environment resolve to, as one JSON-ready document."""
    import dataclasses
    import os

    from oea.config import settings_from_env

    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OEA_", "SGLANG_OEA_"))}
    try:
        cfg = settings_from_env(variables).oea
        config = None if cfg is None else dataclasses.asdict(cfg)
        oea: dict[str, object] = {"enabled": cfg is not None, "config": config}
    except ValueError as err:
        oea = {"enabled": False, "error": str(err)}
    listed = [{"engine": name, "help": action.help, "command": f"oea serve {name} [--json] -- ENGINE ARGS",
               "description": engines.choices[name].description} for name, action in
              ((a.dest, a) for a in engines._choices_actions)]
    return {"engines": listed, "environment": variables, "oea": oea}


def _print_json(document: object) -> int:
    import json

    print(json.dumps(document, indent=1))
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def register(commands: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    """``oea serve``, ``oea serve vllm`` and ``oea serve sglang``."""
    s = commands.add_parser("serve", help="start an inference server with OEA enabled")
    s.add_argument("--json", action="store_true",
                   help="print the engines `oea serve` starts and what this environment's OEA_* variables resolve "
                        "to, as one JSON document (for a server's readiness line: oea serve ENGINE --json)")
    engines = s.add_subparsers(dest="serve_engine", metavar="ENGINE")
    s.set_defaults(handler=lambda args: _print_json(overview(engines)) if args.json else _usage(s))
    v = engines.add_parser(
        "vllm",
        help="python -m vllm.entrypoints.openai.api_server with OEA_K0/OEA_MIN_BATCH set",
        description="Sets OEA_K0 / OEA_MIN_BATCH, starts vLLM's OpenAI server (bound to 127.0.0.1 unless "
                    "--host is given after '--'), waits for /health and forwards SIGINT/SIGTERM.",
    )
    _common(v, "vLLM")
    v.add_argument("engine_args", metavar="vllm_args", nargs=argparse.REMAINDER,
                   help="'--' then vLLM server arguments")
    v.set_defaults(handler=main)
    g = engines.add_parser(
        "sglang",
        help="python -m sglang.launch_server with OEA_K0/OEA_MIN_BATCH set",
        description="Sets OEA_K0 / OEA_MIN_BATCH, starts SGLang's server (bound to 127.0.0.1 unless --host is given "
                    "after '--'; SGLANG_USE_CPU_ENGINE=1 with --device cpu), waits for /health and forwards "
                    "SIGINT/SIGTERM. The plugin reaches every SGLang process through its sglang.srt.plugins entry "
                    "point.",
    )
    _common(g, "SGLang")
    g.add_argument("--sgl-kernel-stand-in", action="store_true",
                   help="put oea's test-support sgl_kernel stand-in on the server's PYTHONPATH (CPU without SGLang's "
                        "kernel package: SGLang's torch-native paths only; docs/sglang.md)")
    g.add_argument("engine_args", metavar="sglang_args", nargs=argparse.REMAINDER,
                   help="'--' then sglang.launch_server arguments")
    g.set_defaults(handler=main_sglang)


def _common(p: argparse.ArgumentParser, engine: str) -> None:
    """The options every ``oea serve ENGINE`` has."""
    p.add_argument("--k0", type=int, help="baseline experts per token (1..top_k); omit for stock routing")
    p.add_argument("--min-batch", type=int, help="vanilla routing below this many rows (OEA_MIN_BATCH)")
    p.add_argument("--metrics-file", help="OEA_METRICS_FILE: JSONL of active experts per decode step")
    p.add_argument("--timing", action="store_true", help="OEA_TIMING=1: time the routing op in the worker")
    p.add_argument("--python", help=f"interpreter with {engine} installed (default: this one)")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="longest wait for the server's /health before giving up (seconds)")
    p.add_argument("--json", action="store_true",
                   help="announce readiness as one JSON line on stdout (url, pid, OEA settings) for scripts")
