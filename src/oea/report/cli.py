"""``oea report``: capture, simulate, evaluate, predict latency, write ``oea-report/report.md``."""

from __future__ import annotations

import argparse


def _report(args: argparse.Namespace) -> int:
    from oea.report.build import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser("report", help="the OEA what-if report (Markdown + PNG plots)")
    p.add_argument("--out", default="oea-report", help="output folder (default: oea-report)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    p.add_argument("--json", action="store_true", help="print the collected results as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (1: the small ops here gain nothing from more)")
    p.set_defaults(handler=_report)
