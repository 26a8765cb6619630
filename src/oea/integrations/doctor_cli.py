"""``oea doctor [sglang|vllm|transformers|all] [--json]``: prove the OEA hooks are live before serving."""

from __future__ import annotations

import argparse
from typing import Any

ENGINE_CHOICES = ("sglang", "vllm", "transformers", "all")


def register(commands: Any, bench: Any) -> None:
    """Add the ``doctor`` subcommand to the root ``oea`` parser."""
    parser = commands.add_parser(
        "doctor",
        help="check that an engine's OEA hook is installed and live (entry point, targets, env, self-test)",
        description="For each installed engine: its version, whether the OEA entry point is registered and "
                    "loads, whether every hook target exists with the expected signature, whether the OEA_* "
                    "environment parses, and a tiny self-test through the engine's own routing on CPU. "
                    "Exit status 1 when anything is off.",
    )
    parser.add_argument("engine", nargs="?", default="all", choices=ENGINE_CHOICES,
                        help="engine to check (default: all; engines not installed are then skipped)")
    parser.add_argument("--json", action="store_true",
                        help='print {"engines": [{"name", "version", "ok", "checks": [{"name", "ok", "detail"}]}]}')
    parser.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    import json

    from oea.integrations.doctor import format_text, run_doctor

    report, code = run_doctor(args.engine)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return code
