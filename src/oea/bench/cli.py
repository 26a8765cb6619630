"""``oea bench ...`` subcommands (parsers only; work happens in the benchmark modules)."""

from __future__ import annotations

import argparse


def _routing(args: argparse.Namespace) -> int:
    from oea.bench.routing import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("routing", help="CPU microbenchmark: vanilla vs OEA vs a naive implementation")
    p.add_argument("--num-experts", type=int, nargs="+", default=[64, 128, 256], metavar="N")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--k0", type=int, default=3)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256], metavar="B")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per variant and shape")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="time vanilla and OEA under torch.compile(fullgraph=True)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=_routing)
