"""``oea report``: capture, simulate, evaluate, predict latency, write ``oea-report/report.md``."""

from __future__ import annotations

import argparse
import pathlib

from oea.console import int_at_least, seed_value


def _report(args: argparse.Namespace) -> int:
    from oea.report.build import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser("report", help="the OEA what-if report (Markdown + PNG plots)")
    p.add_argument("--out", default="oea-report", metavar="FOLDER",
                   help="output folder for report.md, results.json and the plots (created; default: oea-report)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    p.add_argument("--json", action="store_true", help="print the collected results as JSON")
    p.add_argument("--seed", type=seed_value, default=0, help="seeds batch formation, capture and evaluation order")
    p.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch.set_num_threads (1: the small ops here gain nothing from more)")
    p.add_argument("--served-quality", type=pathlib.Path, default=None, metavar="FILE",
                   help="an oea eval serve --output-file: adds the served system's paired quality section")
    p.add_argument("--served-speed", type=pathlib.Path, default=None, metavar="FILE",
                   help="an oea bench serve --output-file of the same arms and concurrencies: adds 'does it pay' "
                        "(TPOT ratio beside the quality difference, and its plot); needs --served-quality")
    p.set_defaults(handler=_report)
