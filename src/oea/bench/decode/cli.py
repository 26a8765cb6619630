"""``oea bench decode``: the parser, the handler and the output (table, PNG); the measurement lives in
``oea.bench.decode.run``."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from oea.bench.passive_wait import launched_from_shell, reexec_passive, start_note
from oea.console import check_plot_file, seed_value

if TYPE_CHECKING:
    from oea.bench.decode.run import DecodeBenchConfig


def config_from_args(args: argparse.Namespace) -> DecodeBenchConfig:
    """Flags -> ``DecodeBenchConfig``. ``--like`` defaults to qwen3-30b-a3b for the embedded model (no
    ``--model``) and to no inflation for a given ``--model``; ``--like none`` never inflates."""
    from oea.bench.decode.run import DEFAULT_LIKE, DecodeBenchConfig

    like = args.like
    if like is None and args.model is None and args.moe_intermediate_size is None:
        like = DEFAULT_LIKE
    if like is not None and like.lower() == "none":
        like = None
    return DecodeBenchConfig(
        model=args.model, like=like, moe_intermediate_size=args.moe_intermediate_size,
        policies=tuple(args.policies), k0s=tuple(args.k0), batch_sizes=tuple(args.batch_sizes),
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, rounds=args.rounds, threads=args.threads,
        device=args.device, dtype=args.dtype, graph=args.graph, seed=args.seed,
        check_identity=not args.no_identity_check,
    )


def render_table(result: dict[str, Any]) -> None:
    """The rows as a rich table on stdout, with the identity check below."""
    from rich.console import Console
    from rich.table import Table

    model = result["model"]
    mode = {"none": "", "capture": " (CUDA graph)", "compile": " (torch.compile)"}[result["graph"]]
    title = (f"decode step, {result['device']}{mode}: {model['model']} "
             f"(expert intermediate {model['moe_intermediate_size']})")
    table = Table(title=title)
    for column in ("B", "policy", "T / layer", "step ms [95% CI]", "tok/s", "× vanilla [95% CI]", "same tokens"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        lo, hi = row["step_ms_ci"]
        rlo, rhi = row["ratio_ci"]
        table.add_row(str(row["batch_size"]), row["label"], f"{row['mean_active_experts']:.1f}",
                      f"{row['step_ms_median']:.1f} [{lo:.1f}–{hi:.1f}]", f"{row['tokens_per_s']:.1f}",
                      f"{row['ratio_vs_vanilla']:.3f} [{rlo:.3f}–{rhi:.3f}]", f"{row['token_match_vs_vanilla']:.0%}")
    console = Console(width=max(120, Console().width))
    console.print(table)
    for error in result["graph_fallbacks"]:
        console.print(f"[yellow]capture failed, compiled instead: {error}[/]")
    if result["graph_token_match_vs_eager"]:
        console.print("vanilla greedy tokens, graph vs eager: " + ", ".join(
            f"B={b}: {m:.0%}" for b, m in result["graph_token_match_vs_eager"].items()))
    if result["identity"]:
        verdict = "identical" if result["k0_top_k_identical"] else "DIFFERENT"
        console.print(f"k0 = top_k ({result['top_k']}) vs vanilla greedy tokens: {verdict} "
                      f"({', '.join(f'B={b}: {ok}' for b, ok in result['identity'].items())})")
    console.print(f"{result['machine']}; load average {result['loadavg_before'][0]:.2f} → "
                  f"{result['loadavg_after'][0]:.2f}; {result['wall_s']:.0f} s", highlight=False)


def plot_result(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """PNG: step latency (median, 95% CI) and ratio to vanilla against batch size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_ms, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r["label"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["label"] == label]
        sizes = [r["batch_size"] for r in rows]
        for ax, key, ci in ((ax_ms, "step_ms_median", "step_ms_ci"), (ax_ratio, "ratio_vs_vanilla", "ratio_ci")):
            mid = np.array([r[key] for r in rows])
            err = np.array([[m - r[ci][0] for m, r in zip(mid, rows, strict=True)],
                            [r[ci][1] - m for m, r in zip(mid, rows, strict=True)]])
            ax.errorbar(sizes, mid, yerr=err, marker="o", capsize=3, label=label)
    for ax, label in ((ax_ms, "decode step (ms), median and 95% CI"), (ax_ratio, "step time / vanilla")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    size = result["model"]["moe_intermediate_size"]
    fig.suptitle(f"oea bench decode: {result['device']}, expert intermediate {size}")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _many_cpu_threads(config: DecodeBenchConfig) -> bool:
    """CPU with several threads: where ``OMP_WAIT_POLICY=PASSIVE`` matters (``oea.bench.passive_wait``)."""
    on_cpu = config.device == "cpu" or (config.device == "auto" and not _cuda_available())
    return on_cpu and config.threads > 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _decode(args: argparse.Namespace) -> int:
    """Handler of ``oea bench decode``."""
    from oea.bench.decode.run import check_checkpoint, run_decode_bench

    config = config_from_args(args)
    check_checkpoint(config)  # bad flags fail here, in one line, before the re-run below
    if args.plot:
        check_plot_file(args.plot)
    many_cpu_threads = _many_cpu_threads(config)
    reexec_passive(("bench", "decode"), many_cpu_threads)
    note = start_note("oea bench decode", many_cpu_threads and launched_from_shell(("bench", "decode")))
    if args.nice is not None:
        from oea.launch.priority import set_priority

        set_priority(args.nice)

    def progress(text: str) -> None:  # stderr, also with --json (stdout): long runs show where they are
        nonlocal note
        if note is not None:  # the measurement has started: every argument passed its checks
            print(note, file=sys.stderr, flush=True)
            note = None
        print(f"  {text}", file=sys.stderr, flush=True)

    result = run_decode_bench(config, progress)
    result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    if args.plot:
        result["plot"] = str(plot_result(result, args.plot))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        render_table(result)
        if args.plot:
            print(f"wrote {result['plot']}")
    return 0 if result["k0_top_k_identical"] in (True, None) else 1


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "decode",
        help="end-to-end decode-step latency A/B in transformers (static cache): OEA off vs policies",
        description="Batched greedy decode of held-out prompts through transformers with a static KV cache; "
        "per-step latency (median, bootstrap 95% CI), ratio to OEA off (paired bootstrap CI), active experts "
        "per layer, tokens/s, and a check that k0 = top_k gives OEA off's tokens. Default model: the embedded "
        "model inflated in memory to Qwen3-30B-A3B's expert size. CPU: eager; CUDA: the step captured in a "
        "CUDA graph (torch.compile reduce-overhead as fallback).",
    )
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--like", metavar="PRESET",
                   help="inflate the experts in memory to this preset's per-expert bytes ('none': do not; default "
                   "qwen3-30b-a3b for the embedded model, none with --model)")
    p.add_argument("--moe-intermediate-size", type=int, metavar="N", help="inflate to this expert intermediate size")
    p.add_argument("--policies", nargs="+", default=["oea"], help="policies besides vanilla: oea, pruned")
    p.add_argument("--k0", type=int, nargs="+", default=[3, 5], help="baseline experts per token")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64], metavar="B",
                   help="sequences decoded together; one measurement per value")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (held-out text windows)")
    p.add_argument("--new-tokens", type=int, default=16, help="timed decode steps per run")
    p.add_argument("--rounds", type=int, default=3, help="runs per policy and batch size (new prompts each)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads on CPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run (auto: cuda when available, else cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="model weights and activations")
    p.add_argument("--graph", default="auto", choices=["auto", "none", "capture", "compile"],
                   help="decode step as a captured CUDA graph (capture), torch.compile reduce-overhead (compile) or "
                   "eager (none); auto: capture on CUDA, none on CPU")
    p.add_argument("--no-identity-check", action="store_true", help="skip the k0 = top_k identical-tokens check")
    p.add_argument("--nice", type=int, metavar="N",
                   help="scheduling priority of this process and its session (-20..19; below 0 needs root): keeps "
                   "other jobs on a shared machine from timing the scheduler")
    p.add_argument("--seed", type=seed_value, default=0,
                   help="fixes the prompt windows, the inflated experts' padding weights and the bootstrap")
    p.add_argument("--plot", metavar="PATH", help="PNG of step latency and ratio to vanilla vs batch size")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(handler=_decode)
