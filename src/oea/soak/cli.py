"""``oea soak`` (the parser only; the work happens in ``oea.soak.session``)."""

from __future__ import annotations

import argparse
import sys


def _main(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from oea.launch.vllm import strip_separator
    from oea.soak.mix import MixShares
    from oea.soak.monitor import SoakError, check_loopback
    from oea.soak.runner import SoakConfig
    from oea.soak.servers import Arm, check_engine_args, engine_of, parse_arms
    from oea.soak.session import run

    engine_args = strip_separator(args.engine_args)
    try:
        if args.nice is not None:  # this process only: its session (the caller's shell) keeps its autogroup's
            import os

            if not -20 <= args.nice <= 19:
                raise SoakError(f"--nice must be in -20..19, got {args.nice}")
            try:
                os.setpriority(os.PRIO_PROCESS, 0, args.nice)
            except PermissionError:
                raise SoakError(f"--nice {args.nice}: not permitted (below 0 needs root or CAP_SYS_NICE)") from None
        cfg = SoakConfig(requests=args.requests, duration_s=args.duration, seed=args.seed,
                         max_concurrency=args.max_concurrency, warmup=args.warmup, timeout_s=args.timeout,
                         probe=not args.no_probe, shares=MixShares(abort=args.abort_share, refuse=args.refuse_share))
        if bool(args.base_url) == bool(args.arm):
            raise SoakError("give either --base-url (a running server) or --arm NAME=ENV ... -- <server arguments>")
        engine = engine_of(engine_args, args.engine)
        if args.base_url:
            if engine_args:
                raise SoakError("--base-url attaches to a running server: no server arguments after '--'")
            env = {var: value for var, value in (("OEA_K0", args.k0), ("OEA_METRICS_FILE", args.metrics_file),
                                                 ("OEA_TRACE_FILE", args.trace_file)) if value is not None}
            arms = [Arm(args.name, {k: str(v) for k, v in env.items()}, base_url=check_loopback(args.base_url))]
            pgids = {args.name: _pgid(args.server_pid)} if args.server_pid else None
        else:
            if not engine_args:
                raise SoakError("--arm starts a server per arm: give its arguments after '--' (vLLM: "
                                "-- --model DIR --port 8077 --max-model-len 512; SGLang: -- --model-path DIR "
                                "--port 30000 --context-length 512)")
            check_engine_args(engine_args)
            arms, pgids = parse_arms(args.arm), None
        result = run(arms, cfg, engine_args, args.python, Path(args.out) if args.out else None, args.baseline,
                     args.identical_outputs, args.health_timeout, pgids,
                     say=lambda line: print(f"oea soak: {line}", file=sys.stderr, flush=True), engine=engine,
                     nice=args.nice, keep_engine_caches=args.keep_engine_caches)
    except SoakError as err:
        print(f"oea soak: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "reports"}, indent=1))
    else:
        from oea.soak.report import print_result

        print_result(result)
    return 0 if result["held"] else 1


def _pgid(pid: int) -> int:
    import os

    from oea.soak.monitor import SoakError

    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        raise SoakError(f"--server-pid {pid}: no such process") from None


def register(commands: argparse._SubParsersAction, _bench: argparse._SubParsersAction) -> None:
    from oea.console import float_between, int_at_least, int_between, seed_value

    p = commands.add_parser(
        "soak",
        help="hold a local vLLM / SGLang server under a seeded, messy request mix; check what must hold",
        description=(
            "Sends a seeded mix to a server on 127.0.0.1 (prompt and output lengths from 1 token to the model "
            "length, concurrency ramping 1 -> --max-concurrency and bursts, streaming and not, n > 1, logprobs, "
            "stop strings, max_tokens = 1, seeded sampling, clients that disconnect mid-stream, and requests "
            "the engine must refuse) and reports per arm: sent / completed / refused (the engine's status) / "
            "aborted / failed, health over time, the server's memory after warm-up and at the end, the time "
            "taken. Then checks what must hold (docs/reliability.md). Exit status: 0 every check held, 1 one "
            "failed, 2 bad input (no server, not vLLM / SGLang, unbounded limits)."),
    )
    p.add_argument("--base-url", help="attach to a running server, e.g. http://127.0.0.1:8000 (loopback only)")
    p.add_argument("--name", default="server", help="--base-url: the arm's name")
    p.add_argument("--server-pid", type=int_at_least(1),
                   help="--base-url: a pid of the server, to watch its process group's memory and restarts")
    p.add_argument("--k0", type=int_at_least(1), help="--base-url: the server's OEA_K0 (bounds the metrics check)")
    p.add_argument("--metrics-file", help="--base-url: the server's OEA_METRICS_FILE, to check it")
    p.add_argument("--trace-file", help="--base-url: the server's OEA_TRACE_FILE, to check it")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=ENV",
                   help="an arm with its own server (ENV: space-separated VAR=VALUE, e.g. 'OEA_K0=3 "
                        "OEA_METRICS_FILE=m.jsonl OEA_TRACE_FILE=t.safetensors'; empty for OEA off); repeat")
    p.add_argument("--engine", choices=("vllm", "sglang"),
                   help="--arm: the engine each arm's server runs (default: sglang when the server arguments use "
                        "an SGLang-only flag such as --model-path, else vllm)")
    p.add_argument("--python", help="--arm: the interpreter with the engine installed (default: this one)")
    p.add_argument("--requests", type=int_between(1, 1_000_000), required=True,
                   help="requests of the mix per arm (after the warm-up)")
    p.add_argument("--duration", type=float_between(1.0, 86400.0), required=True,
                   help="seconds per arm after which no request is started (the soak stops by itself)")
    p.add_argument("--warmup", type=int_between(0, 100_000), default=64,
                   help="requests of another seed before the memory baseline")
    p.add_argument("--seed", type=seed_value, default=0, help="the mix (the same in every arm)")
    p.add_argument("--max-concurrency", type=int_between(1, 1024), default=32,
                   help="the top of the ramp and the size of the bursts")
    p.add_argument("--timeout", type=float_between(1.0, 86400.0), default=300.0, help="one request's time limit (s)")
    p.add_argument("--abort-share", type=float_between(0.0, 1.0), default=0.3,
                   help="share of requests whose client disconnects")
    p.add_argument("--refuse-share", type=float_between(0.0, 1.0), default=0.06,
                   help="share of requests the engine must refuse")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the exactness probe (seeded sampling, one request at a time, after the warm-up)")
    p.add_argument("--baseline", metavar="NAME", help="the arm the others are compared with (default: the first)")
    p.add_argument("--identical-outputs", nargs="+", default=[], metavar="NAME",
                   help="arms whose probe outputs must equal the baseline's token for token (OEA_K0 = top_k)")
    p.add_argument("--health-timeout", type=float_between(1.0, 86400.0), default=900.0,
                   help="--arm: longest wait for each server's /health (s)")
    p.add_argument("--nice", type=int, metavar="N",
                   help="scheduling priority (-20..19) of this client and of each --arm server (a server's own "
                        "session's autogroup included): e.g. 15 to soak beside other work on a shared machine")
    p.add_argument("--keep-engine-caches", action="store_true",
                   help="--arm: start each server with the engine's shape caches as configured (default: oneDNN's "
                        "primitive cache off, ONEDNN_PRIMITIVE_CACHE_CAPACITY=0, so that the memory check sees a "
                        "leak rather than a cache filling with new matmul shapes; an arm's own value wins)")
    p.add_argument("--out", help="folder for each arm's report (<arm>.json, every request) and soak.json")
    p.add_argument("--json", action="store_true", help="print the summary and the checks as JSON")
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="--arm: '--' then the server arguments (vLLM's api_server, SGLang's launch_server)")
    p.set_defaults(handler=_main)
