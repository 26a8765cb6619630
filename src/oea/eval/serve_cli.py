"""``oea eval serve`` (the parser only; registered by ``oea.eval.cli``, the work in ``oea.eval.serve_main``)."""

from __future__ import annotations

import argparse

from oea.bench.serve.engines import ENGINES
from oea.console import add_server_nice, float_between, int_at_least, seed_value


def _eval_serve(args: argparse.Namespace) -> int:
    from oea.eval.serve_main import main

    return main(args)


def register_serve(sub: argparse._SubParsersAction) -> None:
    """Add ``serve`` to ``oea eval``'s subcommands."""
    from oea.eval.serve_tasks import BUNDLED_TASK

    p = sub.add_parser(
        "serve", help="quality A/B against live vLLM / SGLang servers, paired per item",
        description=(
            "The same items, greedy, through every arm at each --max-concurrency: running servers (--arm NAME=URL) "
            "or restart mode (--serve-arm NAME=ENV ... -- <server args>: one vLLM or SGLang server per arm and "
            "round, as oea bench serve). Each arm against --baseline-arm, paired per item: difference with its "
            "95% interval, exact McNemar (pass/fail) or paired t-test (graded), verdict, the smallest difference "
            "the run could detect, share of identical outputs; with OEA_METRICS_FILE, decode steps seen and "
            "rewritten and active experts vs stock routing."),
    )
    p.add_argument("--arm", action="append", default=[], metavar="NAME=URL", help="an arm on a running server")
    p.add_argument("--serve-arm", action="append", default=[], metavar="NAME=ENV",
                   help="restart mode: an arm served by a fresh vLLM or SGLang server with ENV (space-separated "
                        "VAR=VALUE, e.g. 'OEA_K0=3'; empty for stock) and the server arguments after '--'")
    p.add_argument("--engine", choices=ENGINES,
                   help="restart mode: the engine to start (default: detected from the arguments after '--'); "
                        "running servers: each must say it is this engine")
    p.add_argument("--baseline-arm", metavar="NAME", help="arm every other is compared with (default: the first)")
    p.add_argument("--task", default=BUNDLED_TASK,
                   help=f"{BUNDLED_TASK} (bundled: finish lines of held-out text, no download) or an lm-eval "
                        "generate_until task, run through lm-eval's local-completions model")
    p.add_argument("--include-path", metavar="DIR", help="lm-eval: directory of the task's YAML (local data files)")
    p.add_argument("--num-items", type=int_at_least(1), default=200,
                   help="items (the bundled task's count; an lm-eval task's --limit)")
    p.add_argument("--max-concurrency", type=int_at_least(1), nargs="+", default=[1, 4, 16], metavar="C",
                   help="requests in flight at once (the decode batch the server co-schedules); one cell per value")
    p.add_argument("--rounds", type=int_at_least(1), default=1,
                   help="rounds per arm and concurrency (arm order alternates between rounds)")
    p.add_argument("--seed", type=seed_value, default=0, help="chooses the bundled task's items")
    p.add_argument("--timeout", type=float_between(0, low_open=True), default=600.0,
                   help="per-request timeout (s); an item that times out is counted and dropped from the pairing")
    p.add_argument("--engine-metrics", action="append", default=[], metavar="NAME=FILE",
                   help="running servers: an arm's OEA_METRICS_FILE (decode steps seen and rewritten, active experts)")
    p.add_argument("--engine-metrics-dir",
                   help="restart mode: folder of each server's metrics file and log (default: next to --output-file)")
    p.add_argument("--python", help="restart mode: interpreter with the engine installed (default: this one)")
    p.add_argument("--health-timeout", type=float_between(0, low_open=True), default=900.0,
                   help="restart mode: longest wait for each server's /health (seconds)")
    add_server_nice(p, "e.g. 19 to measure quality beside other work without slowing it")
    p.add_argument("--output-file", help="append the item and cell rows (JSON lines) as each cell ends")
    p.add_argument("--summarize", metavar="FILE", help="run nothing: the summary of an earlier run's --output-file")
    p.add_argument("--speed-file", metavar="FILE",
                   help="an oea bench serve --output-file: TPOT ratio per arm beside the quality difference")
    p.add_argument("--metric", help="with --speed-file: the quality metric to show (default: the first)")
    p.add_argument("--plot", help="with --speed-file: PNG of speed gain vs quality change, error bars both ways")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="print the summary rows (and 'pay' rows) as JSON")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="restart mode: '--' then the server's arguments (vLLM's api_server or SGLang's launch_server)")
    p.set_defaults(handler=_eval_serve)
