"""Step 0 of ``scripts/gpu_check.py``: the fast routing kernel (``oea.route_fast``: Triton on CUDA) on one GPU.

1. Exactness: 10,000 of ``scripts/kernel_sweep.py``'s generated cases on CUDA (every router family,
   padding, ties, bf16/fp16, NaN/±inf; N in {64, 256}, k = 8 to bound Triton's compilations),
   ``route_fast(impl="triton")`` against ``oea.route`` on the same device: ids bit-equal slot by slot,
   weights within the stated tolerance; and the kernel captured in a CUDA graph,
   replayed on new inputs, against eager ``oea.route``.
2. Timing inside CUDA graphs (each timed call = one replay, CUDA events): stock top-k routing (softmax,
   top-k, renormalise), ``oea.route`` (the PyTorch path) and the Triton kernel, OEA k0 = 3, k = 8, for a
   softmax router with N in {64, 128, 256} and a DeepSeek/GLM-style grouped sigmoid router (N = 256, 8
   groups, top-4 groups, bias, scaling 2.5), B in {1, 16, 64, 256}. Target: Triton adds <= 10 µs per layer
   call over stock at B <= 256.

``--device cpu --dry-run`` runs the same code eagerly on tiny sizes (numba instead of Triton, no graphs).
"""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import oea

HERE = pathlib.Path(__file__).resolve().parent
TARGET_ADDED_US = 10.0
GPU_SIZES = (64, 256)  # with k = 8: 28 kernel specialisations to compile (gpu_check_budget counts them)


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def stock_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine-style routing: softmax, top-k, renormalise ([M, N] -> ids, weights [M, k])."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def routers(device: str, gen: torch.Generator) -> dict[str, oea.RouterSpec]:
    """The routers this step times (softmax N = 64 / 128 / 256 and a grouped sigmoid N = 256)."""
    bias = (torch.randn(256, generator=gen) * 0.1).to(device)
    return {"softmax N=64": oea.RouterSpec(64, 8), "softmax N=128": oea.RouterSpec(128, 8),
            "softmax N=256": oea.RouterSpec(256, 8),
            "sigmoid-grouped N=256": oea.RouterSpec(256, 8, "sigmoid", correction_bias=bias, n_group=8, topk_group=4,
                                                    routed_scaling_factor=2.5)}


def exactness(device: str, cases: int, graphed: Callable[..., Any]) -> dict[str, Any]:
    """Generated cases (eager) and graph replays against ``oea.route``: counts of mismatching cases."""
    sweep = _load("kernel_sweep")
    impl = "triton" if device == "cuda" else "auto"
    mismatches = []
    for seed in range(cases):
        logits, spec, cfg, valid = sweep.random_case(seed, sizes=GPU_SIZES, top_ks=(8,))
        if spec.correction_bias is not None:
            spec = oea.RouterSpec(spec.num_experts, spec.top_k, spec.scoring, spec.renormalize,
                                  spec.correction_bias.to(device), spec.n_group, spec.topk_group,
                                  spec.routed_scaling_factor)
        logits, valid = logits.to(device), None if valid is None else valid.to(device)
        why = sweep.mismatch(oea.route_fast(logits, spec, cfg, valid, impl=impl), oea.route(logits, spec, cfg, valid))
        if why is not None:
            mismatches.append({"seed": seed, "why": why})
    gen = torch.Generator().manual_seed(1)
    graph_mismatches = 0
    for spec in routers(device, gen).values():
        valid = (torch.arange(32) < 28).to(device)
        static = torch.randn(32, spec.num_experts, generator=gen).to(device)
        replay = graphed(lambda x, spec=spec, valid=valid: oea.route_fast(x, spec, oea.OEAConfig(3), valid, impl=impl),
                         static)
        for trial in range(3):
            logits = (torch.randn(32, spec.num_experts, generator=gen) * (1 + trial)).to(device)
            want = oea.route(logits, spec, oea.OEAConfig(3), valid)
            graph_mismatches += sweep.mismatch(replay(logits), want) is not None
    return {"cases": cases, "mismatches": len(mismatches), "examples": mismatches[:5],
            "graph_replays": 12, "graph_mismatches": graph_mismatches,
            "ok": not mismatches and graph_mismatches == 0}


def _time(fn: Callable[[], Any], device: str, repeats: int) -> list[float]:
    """µs per call: CUDA events around each replay on CUDA, the wall clock elsewhere."""
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - begin) * 1e6)
    return samples


def timing(device: str, batch_sizes: tuple[int, ...], repeats: int, graphed: Callable[..., Any]
           ) -> list[dict[str, Any]]:
    """Median µs per layer call of stock / oea.route / route_fast (OEA k0 = 3), each inside a CUDA graph."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, spec in routers(device, gen).items():
        cfg = oea.OEAConfig(3)
        variants = {"stock": lambda x, spec=spec: stock_topk(x, spec.top_k),
                    "route": lambda x, spec=spec, cfg=cfg: oea.route(x, spec, cfg),
                    "fast": lambda x, spec=spec, cfg=cfg: oea.route_fast(x, spec, cfg)}
        for batch in batch_sizes:
            logits = torch.randn(batch, spec.num_experts, generator=gen).to(device)
            replays = {label: graphed(fn, logits) for label, fn in variants.items()}
            for replay in replays.values():  # warm-up
                replay(logits)
            samples: dict[str, list[float]] = {label: [] for label in replays}
            for _ in range(max(1, repeats // 10)):  # interleave the variants in rounds
                for label, replay in replays.items():
                    samples[label] += _time(lambda replay=replay, logits=logits: replay(logits), device, 10)
            med = {label: statistics.median(values) for label, values in samples.items()}
            rows.append({"router": name, "batch_size": batch, "stock_us": med["stock"], "route_us": med["route"],
                         "fast_us": med["fast"], "fast_impl": oea.kernels.choose_impl(logits, spec, cfg),
                         "fast_added_us": med["fast"] - med["stock"],
                         "fast_vs_stock": med["fast"] / med["stock"], "route_vs_stock": med["route"] / med["stock"]})
    return rows


def check_fast_routing(device: str, dry_run: bool, repeats: int, graphed: Callable[..., Any],
                       cases: int | None = None) -> dict[str, Any]:
    """Step 0: exactness (``cases`` generated cases: 10,000, or 50 dry) and timing of the fast routing path;
    ``ok`` is exactness (timing is reported against its target)."""
    exact = exactness(device, cases if cases is not None else (50 if dry_run else 10000), graphed)
    rows = timing(device, (1, 16) if dry_run else (1, 16, 64, 256), repeats, graphed)
    worst = max(r["fast_added_us"] for r in rows)
    return {"exactness": exact, "timing": rows, "worst_added_us": worst,
            "target": f"fast adds <= {TARGET_ADDED_US} µs per layer call over stock at B <= 256",
            "target_met": worst <= TARGET_ADDED_US, "ok": exact["ok"]}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The printed table of step 0."""
    exact = result["exactness"]
    lines = [f"fast routing exactness: {exact['mismatches']} mismatches in {exact['cases']} generated cases, "
             f"{exact['graph_mismatches']} in {exact['graph_replays']} graph replays",
             f"{'router':<24}{'B':>5}{'stock µs':>10}{'route µs':>10}{'fast µs':>10}{'added µs':>10}  impl"]
    for r in result["timing"]:
        lines.append(f"{r['router']:<24}{r['batch_size']:>5}{r['stock_us']:>10.1f}{r['route_us']:>10.1f}"
                     f"{r['fast_us']:>10.1f}{r['fast_added_us']:>10.1f}  {r['fast_impl']}")
    lines.append(f"worst added: {result['worst_added_us']:.1f} µs ({result['target']}: "
                 f"{'met' if result['target_met'] else 'NOT met'})")
    return lines
