"""``oea bench layer``: MoE-layer decode latency A/B with a controlled number of active experts.

Shape legend: B = decode batch, k = top-k, N = routed experts, T = active (distinct, non-zero-weight)
experts of one layer call, B·k = token-expert slots.

Two kinds of variants are timed on the same real-size layer (``oea.bench.layer.moe``):

* **policy rows**: ``oea.route`` (vanilla / ``PrunedConfig`` / ``OEAConfig``) on router logits of B
  tokens drawn at random from a trace pool, a random layer per batch; the timed call is routing +
  layer (on CUDA both inside one CUDA graph). Id-only traces get rank-synthesised logits
  (``oea.sim.simulate.router_inputs``) and OEA with ``max_rank = k``.
* **the T sweep**: synthetic routings with an exact T (``synthetic_routing``) at fixed B·k, timed
  layer only.

Measurement: warm-up rounds; every repeat times each variant once in a rotated round-robin order;
each variant cycles over its own pool of routing batches; calls rotate over independent weight
copies (at least ``CACHE_DEFEAT_BYTES`` of weights in all); medians with bootstrap 95% CIs; the
achieved bandwidth is T · expert bytes / time. The paper's latency model ``t = b·T + a·B·k + c``
is fitted by least squares over the sweep and policy points (``oea.bench.layer.fit``).

The package's other modules: ``inputs`` (configuration, variants, routing batches), ``timing`` (the
timed rounds), ``fit`` (the latency model), ``output`` (tables, plot), ``moe`` (the layer), ``cli``
(the ``oea bench layer`` parser and handler); this module plans memory and runs; intervals come
from ``oea.stats``.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from oea.bench.layer.fit import fit_latency, fit_r_squared
from oea.bench.layer.inputs import (
    CACHE_DEFEAT_BYTES,
    DEVICES,
    MAX_AUTO_COPIES,
    MEMORY_HEADROOM,
    LayerBenchConfig,
    Variant,
    default_sweep,
    policy_variants,
    resolve_dtype,
    sweep_variants,
)
from oea.bench.layer.moe import IMPLS, MoEShape, grouped_mm_works, init_weights
from oea.bench.layer.timing import measure
from oea.stats import median_interval, ratio_of_medians_interval


def available_memory_bytes(device: str) -> int:
    """Free memory for weights: /proc/meminfo MemAvailable (CPU) or ``torch.cuda.mem_get_info`` (CUDA)."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("cannot read MemAvailable from /proc/meminfo")


def plan_weight_copies(layer_bytes: int, available: int, requested: int | None, what: str) -> int:
    """How many independent layer copies to rotate over; ValueError naming the size when none fits."""
    gib = 2**30
    budget = MEMORY_HEADROOM * available
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--weight-copies must be >= 1, got {requested}")
        if requested * layer_bytes > budget:
            raise ValueError(f"{what}: {requested} weight copies need {requested * layer_bytes / gib:.2f} GiB but only "
                             f"{available / gib:.2f} GiB is available ({MEMORY_HEADROOM:.0%} usable); "
                             "use fewer --weight-copies, a larger --tp or a smaller --dtype")
        return requested
    if layer_bytes > budget:
        raise ValueError(f"{what}: one layer needs {layer_bytes / gib:.2f} GiB but only {available / gib:.2f} GiB is "
                         f"available ({MEMORY_HEADROOM:.0%} usable); use a larger --tp, a smaller --dtype or "
                         "a smaller --preset")
    wanted = min(MAX_AUTO_COPIES, max(1, math.ceil(CACHE_DEFEAT_BYTES / layer_bytes)))
    return max(1, min(wanted, int(budget // layer_bytes)))


# ---------------------------------------------------------------- the run


def _row(variant: Variant, samples: list[tuple[float, int, int]], batch_size: int, expert_bytes: int,
         rng: np.random.Generator) -> dict[str, Any]:
    us = np.array([s[0] for s in samples]) * 1e6
    active = np.array([s[1] for s in samples], dtype=np.float64)
    bandwidth = active * expert_bytes / (us * 1e-6) / 1e9
    ci = median_interval(us, rng)
    row: dict[str, Any] = {
        "label": variant.label, "kind": variant.kind, "policy": variant.policy, "k0": variant.k0,
        "batch_size": batch_size,
        "mean_active_experts": float(active.mean()),
        "mean_token_slots": float(np.mean([s[2] for s in samples])),
        "latency_us_median": float(np.median(us)), "latency_us_ci95": ci.as_list(),
        "latency_us_p10": float(np.quantile(us, 0.1)), "latency_us_p90": float(np.quantile(us, 0.9)),
        "bandwidth_GBps_median": float(np.median(bandwidth)),
        "samples": len(samples),
    }
    if variant.kind == "sweep":
        row["active_experts"] = int(active[0])
    return row


def machine_description(device: str, threads: int) -> str:
    """A one-line description of where the run happened."""
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    model = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    return f"{model}, {os.cpu_count()} cores, {threads} threads, torch {torch.__version__}"


def check_config(config: LayerBenchConfig) -> None:
    """What can be checked before any weight is built (the CLI calls it before re-executing itself):
    device, batch size, rounds, threads, dtype, preset and k0 (errors name the flag)."""
    from oea.presets import get_model_preset

    if config.device not in DEVICES:
        raise ValueError(f"--device must be one of {list(DEVICES)}, got {config.device!r}")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if config.batch_size < 1:
        raise ValueError(f"--batch-sizes must be >= 1, got {config.batch_size}")
    if config.repeats < 1 or config.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {config.repeats}, {config.warmup}")
    if config.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {config.threads}")
    resolve_dtype(config.dtype)
    if config.shape is None:
        width = get_model_preset(config.preset).moe_intermediate_size
        if not isinstance(config.tp, int) or config.tp < 1 or width % config.tp:
            allowed = [tp for tp in range(1, min(width, 64) + 1) if width % tp == 0]
            raise ValueError(f"--tp must divide {config.preset}'s moe_intermediate_size={width} (the layer holds "
                             f"one 1/tp slice of every expert): one of {allowed}, got {config.tp!r}")
    shape = config.shape or MoEShape.from_preset(get_model_preset(config.preset), config.tp)
    for k0 in config.k0s:
        if not isinstance(k0, int) or not 1 <= k0 <= shape.top_k:
            raise ValueError(f"--k0 must be in 1..top_k={shape.top_k}, got {k0!r}")


def run_layer_bench(
    config: LayerBenchConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready result (``rows``, ``sweep``, ``fit``, settings).

    Raises ``ValueError`` for an unknown preset / policy / dtype / device, k0 out of range, a batch
    larger than the trace pool, or weights that do not fit the available memory.
    """
    from oea.presets import get_model_preset

    check_config(config)
    dtype = resolve_dtype(config.dtype)
    shape = config.shape or MoEShape.from_preset(get_model_preset(config.preset), config.tp)
    impl = _resolve_impl(config.impl, config.device, dtype)
    torch.set_num_threads(config.threads)

    layer_bytes = shape.layer_bytes(dtype)
    what = (f"preset {config.preset!r} ({shape.num_experts} experts, H={shape.hidden_size}, "
            f"I={shape.intermediate_size}, {dtype})")
    copies_n = plan_weight_copies(layer_bytes, available_memory_bytes(config.device), config.weight_copies, what)

    generator = torch.Generator().manual_seed(config.seed)
    num_batches = config.num_batches or config.repeats
    variants: list[Variant] = []
    trace_name, note = None, "no policy rows"
    if config.policies:
        variants, trace_name, note = policy_variants(shape, config, num_batches, generator)
    t_values = (default_sweep(shape.top_k, shape.num_experts, config.batch_size)
                if config.t_sweep is None else sorted(set(config.t_sweep)))
    variants += sweep_variants(shape, config.batch_size, t_values, num_batches, generator)
    if not variants:
        raise ValueError("nothing to time: give --policies or a non-empty --t-sweep")

    copies = [init_weights(shape, dtype, config.device, seed=config.seed + c) for c in range(copies_n)]
    hidden = [torch.randn(config.batch_size, shape.hidden_size, generator=generator).to(config.device, dtype)
              for _ in range(4)]
    samples = measure(variants, copies, hidden, impl, config.device, config.repeats, config.warmup, progress)

    rng = np.random.default_rng(config.seed)
    expert_bytes = shape.expert_bytes(dtype)
    rows = [_row(v, samples[v.label], config.batch_size, expert_bytes, rng) for v in variants]
    policy_rows = [r for r in rows if r["kind"] == "policy"]
    sweep_rows = [r for r in rows if r["kind"] == "sweep"]
    vanilla = next((v for v in variants if v.policy == "vanilla"), None)
    for variant, row in zip(variants, rows, strict=True):
        if variant.kind != "policy":
            continue
        if vanilla is None:  # vanilla not timed (--policies without it)
            row["ratio_vs_vanilla"], row["ratio_ci95"] = None, None
            continue
        num = [s[0] for s in samples[variant.label]]
        den = [s[0] for s in samples[vanilla.label]]
        ratio = ratio_of_medians_interval(num, den, rng, paired=True)  # same routing batch per round
        row["ratio_vs_vanilla"] = ratio.estimate
        row["ratio_ci95"] = ratio.as_list()
    fit_rows = sweep_rows + policy_rows
    fit = None
    if len(fit_rows) >= 2:
        fit = fit_latency([r["mean_active_experts"] for r in fit_rows], [r["mean_token_slots"] for r in fit_rows],
                          [r["latency_us_median"] for r in fit_rows])
        if sweep_rows:
            fit["r2_sweep"] = fit_r_squared(fit, [r["mean_active_experts"] for r in sweep_rows],
                                        [r["mean_token_slots"] for r in sweep_rows],
                                        [r["latency_us_median"] for r in sweep_rows])
        fit["token_slots_of_sweep"] = config.batch_size * shape.top_k
    return {
        "benchmark": "oea bench layer",
        "preset": config.preset, "shape": asdict(shape), "custom_shape": config.shape is not None, "tp": config.tp,
        "device": config.device, "dtype": str(dtype).removeprefix("torch."), "impl": impl,
        "threads": config.threads, "batch_size": config.batch_size, "repeats": config.repeats,
        "warmup": config.warmup, "seed": config.seed, "trace": trace_name, "routing_note": note,
        "weight_copies": copies_n, "layer_bytes": layer_bytes, "expert_bytes": expert_bytes,
        "machine": machine_description(config.device, config.threads),
        "rows": policy_rows, "sweep": sweep_rows, "fit": fit,
    }


def _resolve_impl(impl: str, device: str, dtype: torch.dtype) -> str:
    if impl not in (*IMPLS, "auto"):
        raise ValueError(f"--impl must be one of {[*IMPLS, 'auto']}, got {impl!r}")
    if device == "cuda" and impl == "loop":
        raise ValueError("--impl loop synchronises with the host and cannot be graph-captured; use grouped on CUDA")
    if impl == "auto":
        return "grouped" if device == "cuda" or grouped_mm_works(device, dtype) else "loop"
    if impl == "grouped" and not grouped_mm_works(device, dtype):
        raise ValueError(f"--impl grouped: torch._grouped_mm does not work for {dtype} on {device}; use loop")
    return impl
