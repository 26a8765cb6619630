"""``oea bench routing``: the parser and its handler; the measurement lives in ``oea.bench.routing.run``."""

from __future__ import annotations

import argparse

from oea.console import add_batch_sizes_argument, int_at_least, seed_value


def _routing(args: argparse.Namespace) -> int:
    from oea.bench.routing.run import main

    return main(args)


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("routing", help="routing microbenchmark: stock top-k, vanilla, OEA, the fast kernels "
                                         "(oea.route_fast), a naive implementation")
    p.add_argument("--num-experts", type=int_at_least(1), nargs="+", default=[64, 128, 256], metavar="N",
                   help="router sizes N")
    p.add_argument("--top-k", type=int_at_least(1), default=8, help="experts per token k (<= N)")
    p.add_argument("--k0", type=int_at_least(1), default=3, help="OEA's k0 (<= --top-k)")
    add_batch_sizes_argument(p, [1, 16, 64, 256], "batch sizes B (router rows per call)")
    p.add_argument("--repeats", type=int_at_least(5), default=200, help="timed calls per variant and shape")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=seed_value, default=0, help="seeds the router logits and the variant order")
    p.add_argument("--compile", action="store_true", help="time vanilla and OEA under torch.compile(fullgraph=True)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the logits live (cuda: the Triton kernel; each timed call ends with a synchronise)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=_routing)
