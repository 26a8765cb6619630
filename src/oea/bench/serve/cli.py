"""``oea bench serve`` (the parser only; the work happens in ``oea.bench.serve.client`` and ``oea.bench.serve.ab``;
``oea serve vllm`` is registered by ``oea.launch.cli``)."""

from __future__ import annotations

import argparse

from oea.bench.serve.engines import ENGINES
from oea.console import add_server_nice, seed_value


def _bench_serve(args: argparse.Namespace) -> int:
    from oea.bench.serve.ab import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "serve",
        help="serving benchmark / A/B against OpenAI-compatible /v1/completions servers",
        description=(
            "Streamed /v1/completions load at each --max-concurrency; TTFT, TPOT, ITL, E2EL "
            "(mean/median/p99), output tok/s, req/s as vLLM and SGLang define them. Arms: --base-url (one "
            "server), --base-url-a/--base-url-b (two servers), --arm NAME=URL (any number), or "
            "--serve-arm NAME=ENV ... -- <server args> (one vLLM or SGLang server restarted per arm and round: "
            "--engine, or detected from the arguments). Rounds "
            "alternate arm order (A B, B A, ...; restart mode rotates it). With several arms: medians over "
            "rounds with 95% CIs and ratios to --baseline-arm paired by round."
        ),
    )
    p.add_argument("--base-url", help="one server, e.g. http://127.0.0.1:8000")
    p.add_argument("--base-url-a", help="A/B: arm 'a' server")
    p.add_argument("--base-url-b", help="A/B: arm 'b' server")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=URL", help="an arm on a running server")
    p.add_argument("--serve-arm", action="append", default=[], metavar="NAME=ENV",
                   help="restart mode: an arm served by a fresh vLLM or SGLang server (--engine) with ENV "
                        "(space-separated VAR=VALUE, e.g. 'OEA_K0=3'; empty for stock) and the server arguments "
                        "after '--'")
    p.add_argument("--serve-arm-args", action="append", default=[], metavar="NAME=ARGS",
                   help="restart mode: server arguments for one --serve-arm only, added after those after '--' "
                        "(shell-split; e.g. speculative decoding in some arms of the run and not in others)")
    p.add_argument("--engine", choices=ENGINES,
                   help="the servers' engine: restart mode starts it (default: sglang when the arguments after "
                        "'--' use a flag only SGLang's launch_server has, e.g. --model-path; else vllm); with "
                        "running servers, each must say it is this engine (GET /v1/models)")
    p.add_argument("--model", help="model name sent in requests (default: the server's first /v1/models entry)")
    p.add_argument("--dataset", choices=("random", "text"), default="random",
                   help="prompts: random token ids (exact lengths) or windows of held-out text")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per (arm, concurrency, round)")
    p.add_argument("--random-input-len", type=int, default=128, help="random dataset: prompt length in tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="random dataset: input and output lengths drawn from [ratio x len, len] (1.0: exact), "
                        "as in SGLang")
    p.add_argument("--text-input-chars", type=int, default=512, help="text dataset: prompt length in characters")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], metavar="C",
                   help="requests in flight at once; one sweep point per value")
    p.add_argument("--rounds", type=int, default=1, help="measured rounds per arm and concurrency")
    p.add_argument("--warmup-requests", type=int, default=2, help="unrecorded requests per arm before measuring")
    p.add_argument("--seed", type=seed_value, default=0,
                   help="fixes the prompts (each concurrency and round gets its own, the same for every arm)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--output-file", help="append one JSON line per measured round (sglang field names)")
    p.add_argument("--plot", help="PNG of TPOT and output tok/s vs concurrency, one line per arm")
    p.add_argument("--summarize", metavar="FILE",
                   help="run nothing: the table (or --json, --plot) of an earlier run's --output-file")
    p.add_argument("--engine-metrics-dir",
                   help="restart mode: directory for each server's OEA_METRICS_FILE and log (default: "
                        "next to --output-file)")
    p.add_argument("--engine-metrics", action="append", default=[], metavar="NAME=FILE",
                   help="an arm's OEA_METRICS_FILE (vLLM or SGLang plugin): adds engine_* fields (routing us per call, "
                        "active experts per decode step) for each round's time window")
    p.add_argument("--baseline-arm", metavar="NAME",
                   help="A/B summary: ratios against this arm (default: the first arm)")
    p.add_argument("--first-round", type=int, default=0, metavar="R",
                   help="restart mode: number the rounds from R (extend an earlier A/B in the same --output-file)")
    p.add_argument("--max-load", type=float, metavar="L",
                   help="restart mode: start each server only once the 1-minute load average is <= L")
    p.add_argument("--load-wait", type=float, default=1800.0, metavar="S",
                   help="restart mode: longest wait for --max-load before starting anyway (seconds)")
    add_server_nice(p, "e.g. -10 so that other jobs on a shared machine do not time the server")
    p.add_argument("--python", help="restart mode: interpreter with the engine installed (default: this one)")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="restart mode: longest wait for each server's /health (seconds)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the rows and summary as JSON")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="restart mode: '--' then the server's arguments (vLLM's api_server or SGLang's launch_server)")
    p.set_defaults(handler=_bench_serve)
