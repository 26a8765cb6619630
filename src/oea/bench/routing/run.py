"""``oea bench routing``: microbenchmark of vanilla routing, OEA (``oea.route``), the fast path
(``oea.route_fast``: the numba kernel on CPU, Triton on CUDA), stock top-k routing and a naive OEA.

``stock`` is routing as an engine writes it (softmax, top-k, renormalise: three ops, no tie rule, no
non-finite handling), the floor any OEA pays on top of; ``vanilla`` is ``oea.route(cfg=None)``.

The naive version reproduces the style the spec's pitfalls describe (a full per-token sort over N,
a Python loop over slots, boolean-mask indexing and ``unique`` with host synchronisation, fallback
to the original slot); it exists only as the yardstick of this benchmark.

Variants are interleaved inside every repeat (round-robin in a shuffled order) and inputs rotate
over a pool, so drift and caches hit every variant alike; figures are medians with a bootstrap 95%
interval (``*_us_ci``) and the interquartile range, and ratios are ratios of medians with a bootstrap
interval paired by repeat (the variants of one repeat ran back to back on the same input; ``oea.stats``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import oea
from oea.console import format_interval, progress_bar, wide_console
from oea.kernels import choose_impl
from oea.stats import median_interval, ratio_of_medians_interval

Variant = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def naive_oea(router_logits: torch.Tensor, top_k: int, k0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-family OEA written the slow way: [M, N] -> ids [M, k], weights [M, k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    m, n = probs.shape
    orders = [torch.sort(probs[i], descending=True).indices for i in range(m)]  # full per-token sort
    in_union = torch.zeros(n, dtype=torch.bool)
    in_union[torch.unique(torch.cat([order[:k0] for order in orders]))] = True  # host sync
    ids = torch.empty(m, top_k, dtype=torch.long)
    for i, order in enumerate(orders):
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[order[:k0]] = True
        ids[i, :k0] = order[:k0]
        for slot in range(k0, top_k):  # Python loop over slots
            candidates = order[in_union[order] & ~chosen[order]]  # boolean-mask indexing
            pick = candidates[0] if len(candidates) else order[slot]  # fallback: the original slot
            ids[i, slot] = pick
            chosen[pick] = True
    weights = probs.gather(1, ids)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def stock_topk(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine-style softmax routing: [M, N] -> ids [M, k], renormalised weights [M, k]."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def _variants(num_experts: int, top_k: int, k0: int, compiled: bool) -> dict[str, Variant]:
    spec = oea.RouterSpec(num_experts, top_k)
    cfg = oea.OEAConfig(k0)

    def fast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return oea.route_fast(x, spec, cfg)

    def vanilla(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return oea.route(x, spec, None)

    def opportunistic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return oea.route(x, spec, cfg)

    if compiled:
        torch._dynamo.reset()  # one compiled graph per shape; do not accumulate recompiles across shapes
        vanilla = torch.compile(vanilla, fullgraph=True, dynamic=False)
        opportunistic = torch.compile(opportunistic, fullgraph=True, dynamic=False)
    variants = {"vanilla": vanilla, "oea": opportunistic, "fast": fast, "stock": lambda x: stock_topk(x, top_k)}
    return variants | {"naive": lambda x: naive_oea(x.cpu(), top_k, k0)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    num_experts: int, batch_size: int, top_k: int, k0: int, repeats: int, seed: int, compiled: bool = False,
    pool: int = 8, device: str = "cpu",
) -> dict[str, Any]:
    """Median and IQR (µs per call) of each variant for one shape (on CUDA each call ends with a synchronise)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [(torch.randn(batch_size, num_experts, generator=gen) * 2).to(device) for _ in range(pool)]
    variants = _variants(num_experts, top_k, k0, compiled)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in variants.values():  # warm-up
        for x in inputs:
            fn(x)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    shuffle = random.Random(seed)
    for r in range(repeats):
        shuffle.shuffle(order)
        x = inputs[r % pool]
        for name in order:
            start = time.perf_counter_ns()
            variants[name](x)
            sync()
            times[name].append((time.perf_counter_ns() - start) / 1e3)
    row: dict[str, Any] = {"num_experts": num_experts, "batch_size": batch_size, "top_k": top_k, "k0": k0,
                           "fast_impl": choose_impl(inputs[0], oea.RouterSpec(num_experts, top_k),
                                                    oea.OEAConfig(k0))}
    rng = np.random.default_rng(seed)
    for name, samples in times.items():
        row[f"{name}_us"] = statistics.median(samples)
        row[f"{name}_us_ci"] = median_interval(samples, rng).as_list()
        row[f"{name}_p25_us"] = _quantile(samples, 0.25)
        row[f"{name}_p75_us"] = _quantile(samples, 0.75)
    ratios = {"oea_vs_vanilla": ("oea", "vanilla"), "naive_vs_oea": ("naive", "oea"),
              "fast_vs_vanilla": ("fast", "vanilla"), "fast_vs_stock": ("fast", "stock")}
    for ratio, (top, bottom) in ratios.items():
        interval = ratio_of_medians_interval(times[top], times[bottom], rng, paired=True)
        row[ratio] = float(row[f"{top}_us"]) / float(row[f"{bottom}_us"])
        row[f"{ratio}_ci"] = interval.as_list()
    return row


def run(
    num_experts: list[int], batch_sizes: list[int], top_k: int, k0: int, repeats: int, threads: int, seed: int,
    compiled: bool = False, device: str = "cpu", progress: Callable[[int, int], None] | None = None,
) -> dict:
    """The full sweep; returns a JSON-ready dict with rows and the target check.

    ``progress(done, total)`` is called after each (N, B) shape is measured.
    """
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if repeats < 5:
        raise ValueError(f"--repeats must be >= 5, got {repeats}")
    bad = [b for b in batch_sizes if not isinstance(b, int) or b < 1]
    if bad or not batch_sizes:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {list(batch_sizes)}")
    bad = [n for n in num_experts if not isinstance(n, int) or n < 1]
    if bad or not num_experts:
        raise ValueError(f"--num-experts must be integers >= 1, got {list(num_experts)}")
    for n in num_experts:
        if not 1 <= k0 <= top_k <= n:
            raise ValueError(f"need 1 <= --k0 <= --top-k <= num_experts, got k0={k0}, top_k={top_k}, N={n}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be one of ['cpu', 'cuda'], got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False")
    torch.set_num_threads(threads)
    rows = []
    if progress is not None:
        progress(0, len(num_experts) * len(batch_sizes))
    with torch.inference_mode():
        for n in num_experts:
            for b in batch_sizes:
                rows.append(measure(n, b, top_k, k0, repeats, seed, compiled, device=device))
                if progress is not None:
                    progress(len(rows), len(num_experts) * len(batch_sizes))
    large = [r for r in rows if int(r["batch_size"]) >= 16]
    return {
        "benchmark": "routing",
        "torch": torch.__version__,
        "threads": threads,
        "repeats": repeats,
        "mode": "torch.compile(fullgraph=True)" if compiled else "eager",
        "device": device,
        "rows": rows,
        "targets": {
            "oea_vs_vanilla_max_B>=16": max((float(r["oea_vs_vanilla"]) for r in large), default=None),
            "naive_vs_oea_min_B>=16": min((float(r["naive_vs_oea"]) for r in large), default=None),
            "fast_vs_vanilla_max_B>=16": max((float(r["fast_vs_vanilla"]) for r in large), default=None),
            "fast_vs_stock_max_B>=16": max((float(r["fast_vs_stock"]) for r in large), default=None),
            "goal": "oea_vs_vanilla <= 1.5, fast_vs_vanilla <= 1.5 and naive_vs_oea >= 5 for B >= 16",
        },
    }


def _print_table(result: dict) -> None:
    from rich.table import Table

    setup = (f"torch {result['torch']}, {result['device']}, {result['threads']} thread(s), {result['mode']}, "
             f"{result['repeats']} interleaved repeats")
    # Two tables, and cells that wrap at their space rather than being cut: on a terminal narrower than all
    # eleven columns rich would otherwise crop every interval ("1.32 [0.…") and squeeze N and B to nothing.
    latency = Table(title=f"oea bench routing: median µs [95% interval] ({setup})")
    ratios = Table(title="ratios of medians, paired by repeat [95% interval]")
    for table, columns in ((latency, ("stock µs", "vanilla µs", "OEA µs", "fast µs", "naive µs")),
                           (ratios, ("OEA/vanilla", "fast/vanilla", "fast/stock", "naive/OEA"))):
        table.add_column("N", justify="right", no_wrap=True, min_width=3)
        table.add_column("B", justify="right", no_wrap=True, min_width=3)
        for col in columns:
            table.add_column(col, justify="right", overflow="fold")
    for r in result["rows"]:
        shape = (str(r["num_experts"]), str(r["batch_size"]))
        latency.add_row(*shape, *(format_interval(r[f"{name}_us"], r[f"{name}_us_ci"])
                                  for name in ("stock", "vanilla", "oea", "fast", "naive")))
        ratios.add_row(*shape, *(format_interval(r[ratio], r[f"{ratio}_ci"], 2)
                                 for ratio in ("oea_vs_vanilla", "fast_vs_vanilla", "fast_vs_stock")),
                       format_interval(r["naive_vs_oea"], r["naive_vs_oea_ci"], 1))
    console = wide_console()
    console.print(latency)
    console.print(ratios)
    t = result["targets"]
    if t["oea_vs_vanilla_max_B>=16"] is None:
        console.print("B >= 16: not measured (the targets are stated for B >= 16; add such a --batch-sizes value)")
        return
    console.print(f"B >= 16: worst OEA/vanilla = {t['oea_vs_vanilla_max_B>=16']:.2f}, worst fast/vanilla = "
                  f"{t['fast_vs_vanilla_max_B>=16']:.2f} (goal <= 1.5; fast = {result['rows'][0]['fast_impl']}), "
                  f"worst fast/stock = {t['fast_vs_stock_max_B>=16']:.2f}, smallest naive/OEA = "
                  f"{t['naive_vs_oea_min_B>=16']:.1f} (goal >= 5)")


def main(args: argparse.Namespace) -> int:
    """CLI handler of ``oea bench routing``."""
    with progress_bar("oea bench routing: measuring N x B shapes", not args.json) as update:
        result = run(args.num_experts, args.batch_sizes, args.top_k, args.k0, args.repeats, args.threads,
                     args.seed, args.compile, getattr(args, "device", "cpu"), progress=update)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0
