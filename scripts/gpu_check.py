"""GPU check of ``oea bench layer`` and ``oea bench decode``: CUDA-graph routing + MoE layer, graph-vs-eager
equality, end-to-end decode steps.

Run by ``scripts/gpu_check.sh`` (<= 10 minutes on one H100/H200, no network). Steps:

0. The fast routing kernel (``scripts/gpu_check_routing.py``): ``oea.route_fast``'s Triton kernel against
   ``oea.route`` (ids bit-equal over 10,000 generated cases and in CUDA-graph replays), and its time per
   layer call inside a CUDA graph against stock top-k routing and the PyTorch path (``oea.route``).

1. ``oea.route`` captured in a CUDA graph equals eager ``oea.route`` for vanilla, OEA and pruned,
   with padding rows marked through ``valid``, over several inputs replayed through the same graph;
   the same for the MoE layer (route + grouped layer) output.
2. The layer benchmark on CUDA (each timed call = one CUDA-graph replay of routing + layer, or of
   the layer alone for the synthetic T sweep) for the Qwen3-30B-A3B layer at B = 16 on the bundled
   Qwen3 trace, then OLMoE and a GLM-5 TP-8 slice; a short table each.
3. ``oea bench decode`` on CUDA: the embedded model inflated in memory to Qwen3-30B-A3B's expert size
   (``oea.models.inflate``, 4.8 GB bf16), B in {1, 16, 64}, OEA off vs k0 = 3 and 5, each decode step
   captured in a CUDA graph (``torch.compile`` reduce-overhead if capture fails); checks that k0 = top_k
   gives OEA off's tokens and that the graph gives eager's tokens. A failure here is reported in the JSON
   (``decode_error``) without losing steps 1-2.

Results go to ``$OUT/gpu_check.json`` when ``OUT`` is set (or ``--out``). ``--device cpu --dry-run``
runs the same code eagerly on tiny sizes (what the CPU test suite exercises).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

import oea
from oea.kernels.doctor_gpu import graphed  # CUDA-graph capture + replay (eager on CPU)

RouteFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _load_sibling(name: str) -> Any:
    """A module of this folder by file name (this script is also loaded by path in the tests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def compare_routing(
    eager: tuple[torch.Tensor, torch.Tensor], captured: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor
) -> dict[str, Any]:
    """Equality of two routings ([M, k] ids, [M, k] weights): ids exactly, weights to 1e-6, T equal."""
    ids_equal = bool(torch.equal(eager[0].cpu(), captured[0].cpu()))
    weight_diff = float((eager[1].float().cpu() - captured[1].float().cpu()).abs().max())
    t_eager = int(oea.active_experts(*eager, valid=valid))
    t_captured = int(oea.active_experts(*captured, valid=valid))
    return {"ids_equal": ids_equal, "max_weight_diff": weight_diff, "active_eager": t_eager,
            "active_captured": t_captured, "ok": ids_equal and weight_diff <= 1e-6 and t_eager == t_captured}


def check_graph_routing(
    device: str, num_experts: int = 128, top_k: int = 8, rows: int = 16, padding: int = 4, trials: int = 3,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Graph-captured ``oea.route`` vs eager for vanilla, OEA (k0 3) and pruned (k0 3), softmax and grouped
    sigmoid routers, ``padding`` trailing padding rows (``valid`` False); ``trials`` inputs per graph."""
    gen = torch.Generator().manual_seed(seed)
    specs = {
        "softmax": oea.RouterSpec(num_experts, top_k),
        "sigmoid-grouped": oea.RouterSpec(num_experts, top_k, scoring="sigmoid", n_group=8, topk_group=4,
                                          correction_bias=torch.randn(num_experts, generator=gen).to(device) * 0.1,
                                          routed_scaling_factor=2.5),
    }
    configs = {"vanilla": None, "oea k0=3": oea.OEAConfig(3), "pruned k0=3": oea.PrunedConfig(3)}
    valid = torch.arange(rows) < rows - padding
    results = []
    for spec_name, spec in specs.items():
        for cfg_name, cfg in configs.items():
            def route(
                logits: torch.Tensor, mask: torch.Tensor, spec=spec, cfg=cfg
            ) -> tuple[torch.Tensor, torch.Tensor]:
                return oea.route(logits, spec, cfg, valid=mask)

            static_logits = torch.randn(rows, num_experts, generator=gen).to(device)
            static_valid = valid.to(device)
            captured = graphed(route, static_logits, static_valid)
            for trial in range(trials):
                logits = (torch.randn(rows, num_experts, generator=gen) * (1 + trial)).to(device)
                eager = oea.route(logits, spec, cfg, valid=static_valid)
                result = compare_routing(eager, captured(logits, static_valid), static_valid)
                results.append({"router": spec_name, "policy": cfg_name, "trial": trial, **result})
    return results


def check_graph_layer(device: str, dims: Sequence[int] = (64, 8, 256, 128), rows: int = 16, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Graph-captured route + grouped MoE layer vs eager, for vanilla and OEA k0 = 3."""
    from oea.bench.layer.moe import MoEShape, init_weights, moe_forward

    n, k, h, i = dims
    shape = MoEShape(n, k, h, i)
    experts = init_weights(shape, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed)
    spec = oea.RouterSpec(n, k)
    impl = "grouped" if device == "cuda" else "loop"
    results = []
    for name, cfg in (("vanilla", None), ("oea k0=3", oea.OEAConfig(3))):
        def block(logits: torch.Tensor, hidden: torch.Tensor, cfg=cfg) -> torch.Tensor:
            ids, weights = oea.route(logits, spec, cfg)
            return moe_forward(hidden, ids, weights, experts, impl)  # type: ignore[arg-type]

        static = (torch.randn(rows, n, generator=gen).to(device), torch.randn(rows, h, generator=gen).to(device, dtype))
        captured = graphed(block, *static)
        logits = torch.randn(rows, n, generator=gen).to(device)
        hidden = torch.randn(rows, h, generator=gen).to(device, dtype)
        diff = float((block(logits, hidden).float() - captured(logits, hidden).float()).abs().max())
        results.append({"policy": name, "max_abs_diff": diff, "ok": diff <= 1e-2})
    return results


def bench_configs(device: str, dry_run: bool, repeats: int, threads: int) -> list[tuple[str, Any]]:
    """The layer benchmark settings of step 2: (label, ``LayerBenchConfig``)."""
    from oea.bench.layer.moe import MoEShape
    from oea.bench.layer.run import LayerBenchConfig

    if dry_run:
        runs = [("tiny (dry run)", LayerBenchConfig(preset="qwen3-30b-a3b", trace="qwen3-30b-a3b", batch_size=16,
                                                      k0s=(3,), repeats=repeats, warmup=1, threads=threads,
                                                      device=device, shape=MoEShape(128, 8, 64, 32),
                                                      t_sweep=(8, 64, 128), num_batches=4))]
    else:
        common = {"repeats": repeats, "warmup": 5, "threads": threads, "device": device}
        runs = [
            ("qwen3-30b-a3b B=16 (paper setting)", LayerBenchConfig(preset="qwen3-30b-a3b", k0s=(3, 4, 5, 6, 7),
                                                                     batch_size=16, **common)),
            ("olmoe-1b-7b B=16", LayerBenchConfig(preset="olmoe-1b-7b", k0s=(3, 5), batch_size=16, **common)),
            ("glm-5 TP8 slice B=16 (bf16, random logits)", LayerBenchConfig(preset="glm-5", tp=8, k0s=(3, 5),
                                                                             batch_size=16, trace="random", **common)),
        ]
    return runs


def bench_runs(device: str, dry_run: bool, repeats: int, threads: int) -> list[dict[str, Any]]:
    """Run ``bench_configs``; returns their results (each with ``label`` and ``wall_s``)."""
    from oea.bench.layer.run import run_layer_bench

    results = []
    for label, config in bench_configs(device, dry_run, repeats, threads):
        start = time.perf_counter()
        result = run_layer_bench(config)
        result["label"] = label
        result["wall_s"] = time.perf_counter() - start
        results.append(result)
    return results


def decode_configs(device: str, dry_run: bool, threads: int) -> list[tuple[str, Any]]:
    """The ``oea bench decode`` settings of this check: (label, ``DecodeBenchConfig``)."""
    from oea.bench.decode.run import DecodeBenchConfig

    if dry_run:
        return [("decode, embedded inflated to intermediate 64 (dry run)", DecodeBenchConfig(
            like=None, moe_intermediate_size=64, batch_sizes=(1, 2), k0s=(3, 5), rounds=1, new_tokens=2,
            prompt_tokens=8, threads=threads, device=device))]
    return [("decode, embedded inflated like qwen3-30b-a3b", DecodeBenchConfig(
        like="qwen3-30b-a3b", batch_sizes=(1, 16, 64), k0s=(3, 5), rounds=5, new_tokens=32, prompt_tokens=64,
        threads=threads, device=device, graph="auto"))]


def decode_runs(device: str, dry_run: bool, threads: int) -> tuple[list[dict[str, Any]], str | None]:
    """Run ``decode_configs``; returns (results with ``label`` and ``wall_s``, the error that stopped them)."""
    from oea.bench.decode.run import run_decode_bench

    results = []
    for label, config in decode_configs(device, dry_run, threads):
        start = time.perf_counter()
        try:
            result = run_decode_bench(config)
        except Exception as err:  # keep the layer results: report the error in the JSON and fail the check
            return results, f"{label}: {type(err).__name__}: {err}"
        result["label"] = label
        result["wall_s"] = time.perf_counter() - start
        results.append(result)
    return results, None


def decode_ok(run: dict[str, Any]) -> bool:
    """k0 = top_k gave OEA off's tokens, and a captured graph (no fallback) gave eager's tokens."""
    graph_exact = run["graph"] != "capture" or run["graph_fallbacks"] or all(
        match == 1.0 for match in run["graph_token_match_vs_eager"].values())
    return bool(run["k0_top_k_identical"]) and bool(graph_exact)


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The short printed table."""
    lines = [f"graph-vs-eager routing: {sum(r['ok'] for r in report['graph_routing'])}/"
             f"{len(report['graph_routing'])} ok; layer: {sum(r['ok'] for r in report['graph_layer'])}/"
             f"{len(report['graph_layer'])} ok"]
    for run in report["bench"]:
        lines.append(f"== {run['label']} ({run['machine']}, impl={run['impl']}, {run['wall_s']:.0f} s)")
        lines.append(f"{'variant':<14}{'T':>7}{'B·k':>7}{'median µs':>11}{'95% CI µs':>19}{'GB/s':>9}{'ratio':>8}")
        for r in run["rows"] + run["sweep"]:
            ratio = r.get("ratio_vs_vanilla")
            lines.append(f"{r['label']:<14}{r['mean_active_experts']:>7.1f}{r['mean_token_slots']:>7.0f}"
                         f"{r['latency_us_median']:>11.1f}{r['latency_us_ci95'][0]:>9.1f}–{r['latency_us_ci95'][1]:<9.1f}"
                         f"{r['bandwidth_GBps_median']:>9.1f}{'' if ratio is None else f'{ratio:>8.3f}'}")
        fit = run["fit"]
        if fit:
            lines.append(f"fit: {fit['b_us']:.2f} µs·T + {fit['a_us']:.3f} µs·B·k + {fit['c_us']:.1f} µs, "
                         f"R²={fit['r2']:.4f}")
    for run in report.get("decode", []):
        lines.append(f"== {run['label']} ({run['machine']}, graph={run['graph']}, {run['wall_s']:.0f} s)")
        lines.append(f"{'B':>4} {'policy':<10}{'T/layer':>8}{'step ms':>10}{'95% CI':>17}{'tok/s':>10}{'ratio':>8}"
                     f"{'ratio CI':>16}")
        for r in run["rows"]:
            lines.append(f"{r['batch_size']:>4} {r['label']:<10}{r['mean_active_experts']:>8.1f}"
                         f"{r['step_ms_median']:>10.3f}{r['step_ms_ci'][0]:>8.3f}–{r['step_ms_ci'][1]:<8.3f}"
                         f"{r['tokens_per_s']:>10.0f}{r['ratio_vs_vanilla']:>8.3f}"
                         f"{r['ratio_ci'][0]:>8.3f}–{r['ratio_ci'][1]:<7.3f}")
        lines.append(f"k0=top_k identical: {run['k0_top_k_identical']}; graph vs eager tokens: "
                     f"{run['graph_token_match_vs_eager']}; capture fallbacks: {len(run['graph_fallbacks'])}")
    if report.get("decode_error"):
        lines.append(f"decode benchmark FAILED: {report['decode_error']}")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, few repeats (runs eagerly on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per benchmark (default 200; 3 dry)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU side)")
    parser.add_argument("--skip-decode", action="store_true", help="skip step 3 (oea bench decode)")
    parser.add_argument("--fast-cases", type=int, default=None,
                        help="generated cases of step 0's exactness sweep (default 10000; 50 dry)")
    parser.add_argument("--out", default=None, help="result file (default: $OUT/gpu_check.json when OUT is set)")
    parser.add_argument("--doctor-json", default=None, help="`oea doctor gpu --json` output to include (gpu_check.sh)")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.dry_run:
        parser.error("--device cpu is only for --dry-run (use `oea bench layer` for CPU measurements)")
    if args.repeats is None:
        args.repeats = 3 if args.dry_run else 200
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.fast_cases is not None and args.fast_cases < 1:
        parser.error(f"--fast-cases must be >= 1, got {args.fast_cases}")
    return args


# Every top-level field of the JSON (``$OUT/gpu_check.json``); tests/integration/test_gpu_check_script.py keeps
# this list, the report and docs/benchmarks.md's table of fields equal.
JSON_FIELDS: dict[str, str] = {
    "device": "cuda, or cpu for a dry run",
    "dry_run": "true: tiny sizes, eager (--dry-run)",
    "torch": "torch version",
    "estimate": "device time estimated before running, per step (counts, seconds), total_s, budget_s, fits, unit_costs",
    "doctor": "the report of `oea doctor gpu --json` run first by gpu_check.sh (null when run without it)",
    "steps": "per step: ok, wall_s, error (the exception that stopped it, else null)",
    "fast_routing": "step 0: exactness (cases, mismatches, examples, graph replays), timing rows (stock / oea.route / "
                    "route_fast µs per layer call by router and B), worst_added_us, target, target_met, ok",
    "graph_routing": "step 1: oea.route captured vs eager, per router, policy and trial (ids_equal, max_weight_diff, "
                     "active experts, ok)",
    "graph_layer": "step 1: route + MoE layer captured vs eager, per policy (max_abs_diff, ok)",
    "bench": "step 2: one `oea bench layer` result per setting (rows, sweep, fit, label, wall_s, ...)",
    "decode": "step 3: one `oea bench decode` result per setting (rows, graph checks, label, wall_s, ...)",
    "decode_error": "step 3: the error that stopped the decode benchmark, else null",
    "failed_steps": "names of the steps that failed (empty when ok)",
    "ok": "every step passed its check",
}
STEPS = ("0 fast routing", "1 graph vs eager", "2 layer benchmark", "3 decode benchmark")


# what gpu_check_budget counts: the settings each step will run
_SETTINGS = types.SimpleNamespace(bench_configs=lambda *a: bench_configs(*a),
                                  decode_configs=lambda *a: decode_configs(*a))


def _run_step(report: dict[str, Any], name: str, fn: Callable[[], bool]) -> None:
    """Run one step; its wall time, verdict and the exception that stopped it go to ``report["steps"]``."""
    start = time.perf_counter()
    try:
        ok, error = bool(fn()), None
    except Exception as err:  # the next steps still run; the failure is named at the end
        ok, error = False, f"{type(err).__name__}: {err}"
        print(f"gpu_check: step {name} raised {error}", file=sys.stderr)
    report["steps"][name] = {"ok": ok, "wall_s": round(time.perf_counter() - start, 2), "error": error}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: FAILED step setup: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    fast = _load_sibling("gpu_check_routing")
    budget = _load_sibling("gpu_check_budget")
    report: dict[str, Any] = {"device": args.device, "dry_run": args.dry_run, "torch": torch.__version__,
                              "estimate": budget.estimate(args, _SETTINGS, fast), "doctor": None,
                              "steps": {}}
    print(budget.summary_line(report["estimate"]))
    if args.doctor_json:
        report["doctor"] = json.loads(pathlib.Path(args.doctor_json).read_text())

    def step0() -> bool:
        report["fast_routing"] = fast.check_fast_routing(args.device, args.dry_run, args.repeats, graphed,
                                                         args.fast_cases)
        print("\n".join(fast.summary_lines(report["fast_routing"])))
        return bool(report["fast_routing"]["ok"])

    def step1() -> bool:
        report["graph_routing"] = check_graph_routing(args.device)
        report["graph_layer"] = check_graph_layer(args.device)
        return all(r["ok"] for r in report["graph_routing"] + report["graph_layer"])

    def step2() -> bool:
        report["bench"] = bench_runs(args.device, args.dry_run, args.repeats, args.threads)
        return True

    def step3() -> bool:
        report["decode"], report["decode_error"] = ([], None) if args.skip_decode else decode_runs(
            args.device, args.dry_run, args.threads)
        return report["decode_error"] is None and all(decode_ok(run) for run in report["decode"])

    report.update({"graph_routing": [], "graph_layer": [], "bench": [], "decode": [], "decode_error": None})
    for name, fn in zip(STEPS, (step0, step1, step2, step3), strict=True):
        _run_step(report, name, fn)
    report["failed_steps"] = [name for name, step in report["steps"].items() if not step["ok"]]
    report["ok"] = not report["failed_steps"]
    report = {**{k: report[k] for k in JSON_FIELDS if k in report}, **report}  # the documented order
    print("\n".join(summary_lines(report)))
    out = args.out or (str(pathlib.Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {out}")
    for name in report["failed_steps"]:
        error = report["steps"][name]["error"]
        print(f"gpu_check: FAILED step {name}: {error or 'its check did not pass (see the JSON)'}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
