"""``oea eval`` (policy evaluation on held-out text) and ``oea eval lm-eval`` (lm-evaluation-harness tasks).

Parsers only; the work happens in ``oea.eval.evaluate`` / ``oea.eval.lm_eval_bridge``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from oea.console import (
    add_batch_sizes_argument,
    check_unique,
    float_between,
    format_interval,
    format_p_value,
    int_at_least,
    seed_value,
    wide_console,
)

POLICY_CHOICES = ["vanilla", "pruned", "oea"]


def _eval(args: argparse.Namespace) -> int:
    import torch

    from oea.eval.evaluate import evaluate

    check_unique(args.policies, "--policies")
    check_unique(args.k0, "--k0")
    check_unique(args.batch_sizes, "--batch-sizes")
    check_batch_sizes_fit_documents(args.batch_sizes, args.model)
    torch.set_num_threads(args.threads)
    generate_tokens = 0 if args.no_generate else args.generate_tokens
    options = {"batch_sizes": args.batch_sizes, "k0s": args.k0, "policies": args.policies,
               "num_batches": args.num_batches, "positions": args.positions, "seed": args.seed,
               "generate_tokens": generate_tokens, "draft_tokens": args.draft_tokens}
    if args.json:
        print(json.dumps(evaluate(args.model, **options), indent=1))
        return 0
    from rich.console import Console

    with Console(stderr=True).status("evaluating") as status:
        rows = evaluate(args.model, progress=lambda text: status.update(f"evaluating {text}"), **options)
    console = wide_console()
    title = args.model or "embedded model"
    if args.draft_tokens:
        title += f", verify-shaped steps: B x (1 + {args.draft_tokens}) rows routed together"
    console.print(results_table(rows, title))
    console.print(verdict_note(rows))
    return 0


def check_batch_sizes_fit_documents(batch_sizes: list[int], model: str | None) -> None:
    """Before the model loads: a batch holds windows of *different* documents, so B may not exceed the held-out
    documents (the model's own list, or the embedded model's); a larger B would decode one document in several
    rows of every batch. ``ValueError`` naming ``--batch-sizes``."""
    import pathlib

    from oea.eval.evaluate import _documents

    folder = pathlib.Path(model) if model is not None and pathlib.Path(model).is_dir() else None
    documents = len(_documents(folder))
    too_large = [b for b in batch_sizes if b > documents]
    if too_large:
        raise ValueError(f"--batch-sizes must be <= {documents}, the held-out documents (a batch decodes windows of "
                         f"different documents together), got {too_large}")


def verdict_note(rows: list[dict[str, Any]]) -> str:
    """The rules behind the table's two verdict columns."""
    from oea.eval.summary import PAPER_RULE

    rule = rows[0]["verdict_rule"] if rows else ""
    return (f"[...] = 95% interval. verdict: {rule}; 'worse'/'better' when the interval of ΔCE excludes 0, "
            f"'identical' (p: -) when every document's CE equals vanilla's. "
            f"paper rule (for comparison): {PAPER_RULE}. T and experts/token: means over decode steps.")


def results_table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich table of ``evaluate`` rows."""
    from rich.table import Table

    table = Table(title=f"oea eval: {title}")
    for name in ("B", "policy", "k0", "CE (nats)", "ΔCE vs vanilla", "p", "verdict (paired)", "paper rule",
                 "active experts T", "T / vanilla", "experts/token", "gen. agreement", "docs"):
        table.add_column(name, justify="left" if name in ("policy", "verdict (paired)", "paper rule") else "right")
    for r in rows:
        agreement = r["generation_agreement"]
        table.add_row(
            str(r["batch_size"]), r["policy"], "-" if r["k0"] is None else str(r["k0"]),
            format_interval(r["cross_entropy"], r["cross_entropy_ci"], 4),
            format_interval(r["delta_ce"], r["delta_ce_ci"], 4, signed=True), format_p_value(r["delta_p_value"]),
            r["verdict"], r["paper_verdict"],
            format_interval(r["mean_active_experts"], r["mean_active_experts_ci"], 1),
            format_interval(r["active_vs_vanilla"], r["active_vs_vanilla_ci"], 2),
            format_interval(r["mean_experts_per_token"], r["mean_experts_per_token_ci"], 2),
            "-" if agreement is None else format_interval(100 * agreement, _percent(r["generation_agreement_ci"]), 0),
            str(r["documents"]),
        )
    return table


def _percent(ci: list[float] | None) -> list[float] | None:
    return None if ci is None else [100 * ci[0], 100 * ci[1]]


def _lm_eval(args: argparse.Namespace) -> int:
    import torch

    from oea.eval.lm_eval_bridge import check_lm_eval_arguments, run_lm_eval

    check_unique(args.batch_sizes, "--batch-sizes")
    check_lm_eval_arguments(args.policy, args.k0, args.include_path)
    torch.set_num_threads(args.threads)
    runs = []
    for batch_size in args.batch_sizes:
        result = run_lm_eval(
            args.model, args.tasks, k0=args.k0, policy=args.policy, batch_size=batch_size, limit=args.limit,
            include_path=args.include_path, num_fewshot=args.num_fewshot, decode_only=not args.all_forwards,
        )
        runs.append({"batch_size": batch_size, **result})
    if args.json:
        print(json.dumps(runs, indent=1, default=str))
        return 0
    console = wide_console()
    for run in runs:
        routing = run["oea"]
        cells = {key: format_interval(routing[key], routing[f"{key}_ci"], digits) for key, digits in
                 (("mean_active_experts", 1), ("mean_active_experts_vanilla", 1), ("active_vs_vanilla", 2),
                  ("mean_experts_per_token", 2))}
        console.print(f"B={run['batch_size']} policy={routing['policy']} k0={routing['k0']}: "
                      f"{routing['decode_steps']} decode steps, active experts per layer and step "
                      f"{cells['mean_active_experts']} (vanilla routing would load "
                      f"{cells['mean_active_experts_vanilla']}; ratio {cells['active_vs_vanilla']}), experts/token "
                      f"{cells['mean_experts_per_token']} (95% intervals over decode steps)", soft_wrap=True)
        for task, metrics in run["results"].items():
            shown = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()
                              if isinstance(value, float) and "stderr" not in name)
            errors = {name.replace("_stderr", ""): value for name, value in metrics.items()
                      if "_stderr" in name and isinstance(value, float)}
            console.print(f"  {task}: {shown}" + (f" (lm-eval stderr: {errors})" if errors else ""))
    return 0


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "eval",
        help="cross-entropy / active experts / generation agreement of OEA vs pruned vs vanilla",
        description="Teacher-forced lock-step batched decoding on held-out text: per batch size B, B windows "
        "of different documents advance one token per decode step with the policy attached. The verdict is "
        "the paired t-test on per-document ΔCE; every mean carries its 95% interval.",
    )
    p.add_argument("--model", default=None, metavar="PATH",
                   help="HF checkpoint directory with its tokenizer (default: the embedded model)")
    add_batch_sizes_argument(p, [1, 4, 16],
                             "decode batch sizes B (windows of different documents decoded together)")
    p.add_argument("--k0", type=int_at_least(1), nargs="+", default=[3, 5], metavar="K0",
                   help="k0 values for pruned and oea, each in 1..top_k")
    p.add_argument("--policies", nargs="+", default=POLICY_CHOICES, choices=POLICY_CHOICES, metavar="POLICY",
                   help=f"policies among {POLICY_CHOICES} (vanilla is always evaluated as the reference)")
    p.add_argument("--positions", type=int_at_least(1), default=32, help="decode steps (scored tokens) per window")
    p.add_argument("--num-batches", type=int_at_least(1), default=None,
                   help="batches per B (default: ceil(16 / B), at least 16 documents)")
    p.add_argument("--generate-tokens", type=int_at_least(0), default=16,
                   help="greedy tokens for the generation-agreement check")
    p.add_argument("--no-generate", action="store_true", help="skip the generation-agreement check")
    p.add_argument("--draft-tokens", type=int_at_least(0), default=0, metavar="D",
                   help="verify-shaped decode steps: each window feeds its next 1 + D tokens per step and the "
                        "B x (1 + D) rows are routed together, as a speculative verify step with every draft "
                        "accepted (D <= 6; --positions a multiple of 1 + D); 0: plain decode")
    p.add_argument("--seed", type=seed_value, default=0, help="shuffles the document order")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(handler=_eval)

    sub = p.add_subparsers(dest="eval_command", metavar="{lm-eval,serve}")
    lm = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks with OEA attached",
                        description="lm-eval tasks on the model with a routing policy attached (decode steps only "
                        "unless --all-forwards); one run per batch size.")
    lm.add_argument("--model", default=None, metavar="PATH",
                    help="HF checkpoint directory with its tokenizer (default: the embedded model)")
    lm.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names")
    lm.add_argument("--k0", type=int_at_least(1), default=None,
                    help="k0 in 1..top_k for pruned / oea (omit, with no --policy, for vanilla routing)")
    lm.add_argument("--policy", default=None, choices=POLICY_CHOICES,
                    help="routing policy (default: oea when --k0 is given, else vanilla)")
    add_batch_sizes_argument(lm, [16], "lm-eval batch sizes (the decode batch OEA routes together), one run each",
                             legacy_alias=True)
    lm.add_argument("--limit", type=float_between(0, low_open=True), default=None,
                    help="lm-eval --limit: examples per task, or a fraction below 1 (default: all)")
    lm.add_argument("--num-fewshot", type=int_at_least(0), default=None, help="lm-eval --num_fewshot "
                    "(default: the task's)")
    lm.add_argument("--include-path", default=None, metavar="DIR", help="directory of extra task YAMLs")
    lm.add_argument("--all-forwards", action="store_true",
                    help="reroute every forward, not only decode steps (affects log-likelihood tasks)")
    lm.add_argument("--threads", type=int_at_least(1), default=1, help="torch.set_num_threads")
    lm.add_argument("--json", action="store_true", help="print the runs as JSON (lm-eval results and routing)")
    lm.set_defaults(handler=_lm_eval)
    from oea.eval.serve_cli import register_serve

    register_serve(sub)
