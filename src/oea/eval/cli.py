"""``oea eval`` (policy evaluation on held-out text) and ``oea eval lm-eval`` (lm-evaluation-harness tasks).

Parsers only; the work happens in ``oea.eval.evaluate`` / ``oea.eval.lm_eval_bridge``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _eval(args: argparse.Namespace) -> int:
    import torch

    from oea.eval.evaluate import evaluate

    torch.set_num_threads(args.threads)
    generate_tokens = 0 if args.no_generate else args.generate_tokens
    if args.json:
        rows = evaluate(
            args.model, batch_sizes=args.batch_sizes, k0s=args.k0, policies=args.policies,
            num_batches=args.num_batches, positions=args.positions, seed=args.seed, generate_tokens=generate_tokens,
        )
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("evaluating") as status:
        rows = evaluate(
            args.model, batch_sizes=args.batch_sizes, k0s=args.k0, policies=args.policies,
            num_batches=args.num_batches, positions=args.positions, seed=args.seed, generate_tokens=generate_tokens,
            progress=lambda text: status.update(f"evaluating {text}"),
        )
    width = None if sys.stdout.isatty() else 160  # keep the table whole when piped or captured
    Console(width=width).print(results_table(rows, args.model or "embedded model"))
    return 0


def results_table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich table of ``evaluate`` rows."""
    from rich.table import Table

    table = Table(title=f"oea eval: {title}")
    for name in ("B", "policy", "k0", "CE ± se", "ΔCE ± se", "verdict", "active experts", "vs vanilla",
                 "experts/token", "gen. agreement", "docs"):
        table.add_column(name, justify="left" if name in ("policy", "verdict") else "right")
    for r in rows:
        agreement = r["generation_agreement"]
        ratio = r["active_vs_vanilla"]
        table.add_row(
            str(r["batch_size"]), r["policy"], "-" if r["k0"] is None else str(r["k0"]),
            f"{r['cross_entropy']:.4f} ± {r['stderr']:.4f}", f"{r['delta_ce']:+.4f} ± {r['delta_stderr']:.4f}",
            r["verdict"], f"{r['mean_active_experts']:.1f}", "-" if ratio is None else f"{ratio:.2f}",
            f"{r['mean_experts_per_token']:.2f}", "-" if agreement is None else f"{agreement:.1%}",
            str(r["documents"]),
        )
    return table


def _lm_eval(args: argparse.Namespace) -> int:
    import torch

    from oea.eval.lm_eval_bridge import run_lm_eval

    torch.set_num_threads(args.threads)
    results = run_lm_eval(
        args.model, args.tasks, k0=args.k0, policy=args.policy, batch_size=args.batch_size, limit=args.limit,
        include_path=args.include_path, num_fewshot=args.num_fewshot, decode_only=not args.all_forwards,
    )
    print(json.dumps(results, indent=1, default=str))
    return 0


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "eval",
        help="cross-entropy / active experts / generation agreement of OEA vs pruned vs vanilla",
        description="Teacher-forced lock-step batched decoding on held-out text: per batch size B, B windows "
        "of different documents advance one token per decode step with the policy attached.",
    )
    p.add_argument("--model", default=None, metavar="PATH", help="HF checkpoint directory (default: embedded model)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], metavar="B")
    p.add_argument("--k0", type=int, nargs="+", default=[3, 5], help="k0 values, each in 1..top_k")
    p.add_argument("--policies", nargs="+", default=["vanilla", "pruned", "oea"],
                   choices=["vanilla", "pruned", "oea"])
    p.add_argument("--positions", type=int, default=32, help="decode steps (scored tokens) per window")
    p.add_argument("--num-batches", type=int, default=None, help="batches per B (default: ceil(16 / B))")
    p.add_argument("--generate-tokens", type=int, default=16, help="greedy tokens for the agreement check")
    p.add_argument("--no-generate", action="store_true", help="skip the generation-agreement check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=_eval)

    sub = p.add_subparsers(dest="eval_command", metavar="{lm-eval}")
    lm = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks with OEA attached")
    lm.add_argument("--model", default=None, metavar="PATH", help="HF checkpoint directory (default: embedded)")
    lm.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names")
    lm.add_argument("--k0", type=int, default=None, help="k0 in 1..top_k (omit for vanilla routing)")
    lm.add_argument("--policy", default="oea", choices=["vanilla", "pruned", "oea"])
    lm.add_argument("--batch-size", type=int, default=16, help="lm-eval batch size (the decode batch)")
    lm.add_argument("--limit", type=float, default=None, help="lm-eval --limit (examples per task)")
    lm.add_argument("--num-fewshot", type=int, default=None)
    lm.add_argument("--include-path", default=None, help="directory of extra task YAMLs")
    lm.add_argument("--all-forwards", action="store_true",
                    help="reroute every forward, not only decode steps (affects log-likelihood tasks)")
    lm.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    lm.set_defaults(handler=_lm_eval)

