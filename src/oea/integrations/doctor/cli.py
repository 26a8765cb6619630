"""``oea doctor [sglang|vllm|transformers|all] [--json]``: prove the OEA hooks are live before serving;
``oea doctor gpu [--allow-cpu] [--json]``: the fast routing path on this machine's GPU."""

from __future__ import annotations

import argparse
from typing import Any

from oea.console import int_at_least

ENGINE_CHOICES = ("sglang", "vllm", "transformers", "all", "gpu")


def register(commands: Any, bench: Any) -> None:
    """Add the ``doctor`` subcommand to the root ``oea`` parser."""
    parser = commands.add_parser(
        "doctor",
        help="check that an engine's OEA hook is installed and live (entry point, targets, env, self-test)",
        description="For each installed engine: its version, whether the OEA entry point is registered and "
                    "loads, whether every hook target exists with the expected signature, whether the OEA_* "
                    "environment parses, and a tiny self-test through the engine's own routing on CPU. "
                    "Exit status 1 when anything is off. `oea doctor gpu`: compile the Triton routing kernels for "
                    "this GPU, check them against oea.route and replay one call in a CUDA graph (no CUDA: exit 1 "
                    "unless --allow-cpu).",
    )
    parser.add_argument("engine", nargs="?", default="all", choices=ENGINE_CHOICES,
                        help="engine to check (default: all; engines not installed are then skipped), or gpu")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="oea doctor gpu: exit 0 on a machine without CUDA (and say what would run)")
    parser.add_argument("--metrics-file", default=None, metavar="FILE",
                        help="a server's OEA_METRICS_FILE: also report whether OEA engaged in its decode forwards "
                             "(N of M), the active experts against the engine's own routing, and padding rows")
    parser.add_argument("--metrics-url", default=None, metavar="URL",
                        help="a running server's Prometheus endpoint (http://HOST:PORT/metrics): the same checks "
                             "from its oea_* series, and why forwards kept the engine's routing; unreachable or "
                             "without oea_* series: exit 1")
    parser.add_argument("--min-batch", type=int_at_least(0), default=None,
                        help="with --metrics-file: decode forwards with fewer real rows are not expected to be "
                             "rewritten (default: OEA_MIN_BATCH of this environment, else 2; --metrics-url reads "
                             "the server's own)")
    parser.add_argument("--json", action="store_true",
                        help='print {"engines": [{"name", "version", "ok", "checks": [{"name", "ok", "detail"}]}]} '
                             '(+ "served" with --metrics-file or --metrics-url)')
    parser.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    import json
    import sys

    if args.engine == "gpu":
        from oea.kernels.doctor_gpu import format_gpu, gpu_report

        gpu, code = gpu_report(allow_cpu=args.allow_cpu)
        print(json.dumps(gpu, indent=2) if args.json else format_gpu(gpu))
        return code
    if args.allow_cpu:
        print("oea doctor: --allow-cpu applies to `oea doctor gpu` only", file=sys.stderr)
        return 2
    from oea.integrations.doctor.run import format_text, run_doctor

    min_batch = args.min_batch
    if min_batch is None:
        from oea.config import settings_from_env

        try:
            found = settings_from_env().min_batch
            min_batch = 2 if found is None else found
        except ValueError:  # a broken OEA_MIN_BATCH is reported by the environment checks
            min_batch = 2
    report, code = run_doctor(args.engine, args.metrics_file, min_batch, metrics_url=args.metrics_url)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return code
