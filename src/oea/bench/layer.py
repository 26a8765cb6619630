"""``oea bench layer``: MoE-layer decode latency A/B with a controlled number of active experts.

Shape legend: B = decode batch, k = top-k, N = routed experts, T = active (distinct, non-zero-weight)
experts of one layer call, B·k = token-expert slots.

Two kinds of variants are timed on the same real-size layer (``oea.bench.moe_layer``):

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
(design/oea-algorithm.md §10) is fitted by least squares over the sweep and policy points (the
policy rows vary the used slots B·k: pruned and OEA share T but not B·k, which identifies a).
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

import oea
from oea.bench.moe_layer import IMPLS, MoEShape, MoEWeights, grouped_mm_works, init_weights, moe_forward

CACHE_DEFEAT_BYTES = 256 * 2**20  # >= 8x this machine's 32 MiB L3 and 5x an H100/H200 L2
RANDOM_TRACE = "random"
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DEVICES: tuple[str, ...] = ("cpu", "cuda")
POLICIES: tuple[str, ...] = ("vanilla", "pruned", "oea")
SWEEP_POINTS = 5
MEMORY_HEADROOM = 0.6  # use at most this share of the available memory for weight copies
MAX_AUTO_COPIES = 16


@dataclass(frozen=True)
class LayerBenchConfig:
    """Everything one ``oea bench layer`` run needs (CLI flags map one to one).

    Attributes:
        preset: model preset name (``oea.sim.presets.MODEL_PRESETS``).
        batch_size: B, decode tokens per layer call.
        k0s: baseline experts per token for ``pruned`` and ``oea``.
        policies: subset of ``POLICIES``.
        trace: bundled trace name or path; ``"random"`` for Gaussian logits; ``None`` = the trace
            recorded for the preset if one is bundled, else random.
        repeats: timed rounds (each times every variant once).
        warmup: untimed rounds first.
        threads: ``torch.set_num_threads`` (CPU).
        device: ``cpu`` or ``cuda``.
        dtype: weight / activation dtype name.
        t_sweep: exact T values of the synthetic sweep; ``None`` = ``SWEEP_POINTS`` evenly spaced
            from k to min(N, B·k); empty = no sweep.
        seed: seeds weights, batches and synthetic routings.
        impl: ``loop``, ``grouped`` or ``auto`` (grouped where ``torch._grouped_mm`` works, else loop;
            always grouped on CUDA, which graph capture needs).
        tp: tensor-parallel degree: the layer holds one 1/tp slice of each expert.
        weight_copies: independent layer copies to rotate over; ``None`` = enough for
            ``CACHE_DEFEAT_BYTES`` (at most ``MAX_AUTO_COPIES``) within ``MEMORY_HEADROOM`` of the
            available memory.
        shape: explicit layer dimensions instead of the preset's (tests, custom sizes).
        num_batches: routing batches per variant (cycled); ``None`` = ``repeats``.
    """

    preset: str = "qwen3-30b-a3b"
    batch_size: int = 16
    k0s: tuple[int, ...] = (3,)
    policies: tuple[str, ...] = POLICIES
    trace: str | None = None
    repeats: int = 20
    warmup: int = 2
    threads: int = 2
    device: str = "cpu"
    dtype: str = "bfloat16"
    t_sweep: tuple[int, ...] | None = None
    seed: int = 0
    impl: str = "auto"
    tp: int = 1
    weight_copies: int | None = None
    shape: MoEShape | None = None
    num_batches: int | None = None


@dataclass
class Variant:
    """One timed configuration and its pool of inputs.

    ``logits`` ([B, N] each) for policy rows, routed inside the timed call with ``cfg``;
    ``ids`` / ``weights`` ([B, k] each) the routing used (precomputed for policy rows, for T stats).
    """

    label: str
    kind: str  # "policy" or "sweep"
    policy: str | None
    k0: int | None
    cfg: object | None
    spec: oea.RouterSpec | None
    logits: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]
    active: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.active = [int(oea.active_experts(i, w)) for i, w in zip(self.ids, self.weights, strict=True)]
        self.slots = [int((w != 0).sum()) for w in self.weights]


# ---------------------------------------------------------------- inputs


def resolve_dtype(name: str) -> torch.dtype:
    """``bfloat16`` / ``bf16`` / ``float16`` / ``float32`` ... -> torch dtype; ValueError otherwise."""
    canonical = DTYPE_ALIASES.get(name, name)
    if canonical not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES) + sorted(DTYPE_ALIASES)}, got {name!r}")
    return DTYPES[canonical]


def default_sweep(top_k: int, num_experts: int, batch_size: int, points: int = SWEEP_POINTS) -> list[int]:
    """Evenly spaced exact T values from k to min(N, B·k) (distinct, ascending)."""
    high = min(num_experts, batch_size * top_k)
    return sorted({round(v) for v in np.linspace(top_k, high, points)})


def synthetic_routing(
    num_experts: int, top_k: int, batch_size: int, active: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing with exactly ``active`` distinct experts: -> ids [B, k] int64, weights [B, k] float32.

    ``active`` experts are drawn at random; the first ``active`` slots (token-major) cover each of
    them once, every remaining slot takes a random chosen expert not yet in its token, so every
    token has k distinct experts and every chosen expert is used. Weights are random, positive,
    summing to 1 per token.
    """
    if not top_k <= active <= min(num_experts, batch_size * top_k):
        raise ValueError(f"exact T must lie in k={top_k}..min(N={num_experts}, B·k={batch_size * top_k}), "
                         f"got {active}")
    chosen = torch.randperm(num_experts, generator=generator)[:active].tolist()
    ids = torch.empty(batch_size, top_k, dtype=torch.int64)
    for b in range(batch_size):
        row = chosen[b * top_k : min((b + 1) * top_k, active)] if b * top_k < active else []
        free = [e for e in chosen if e not in row]
        extra = torch.randperm(len(free), generator=generator)[: top_k - len(row)].tolist()
        ids[b] = torch.tensor(row + [free[i] for i in extra])
    weights = torch.softmax(torch.randn(batch_size, top_k, generator=generator), dim=-1)
    return ids, weights


def auto_trace_name(preset: str) -> str:
    """The bundled trace recorded for ``preset`` (``meta['model_preset']``), else ``"random"``."""
    from oea.traces import DATA_DIR, bundled_trace_names

    for name in bundled_trace_names():
        meta = json.loads((DATA_DIR / f"{name}.json").read_text())
        if meta.get("model_preset") == preset:
            return name
    return RANDOM_TRACE


def _policy_cfg(policy: str, k0: int | None, top_k: int, id_only: bool) -> object | None:
    from oea.routing import make_policy

    cfg = make_policy(policy, k0)
    if id_only and isinstance(cfg, oea.OEAConfig):  # piggyback only within the recorded top-k
        cfg = oea.OEAConfig(cfg.k0, max_rank=top_k)
    return cfg


def _preset_router(preset: str, num_experts: int, top_k: int) -> oea.RouterSpec:
    """The preset's router family (scoring, groups) when it matches N and k, else plain softmax."""
    from oea.sim.presets import MODEL_PRESETS

    model = MODEL_PRESETS.get(preset)
    if model is None or (model.num_experts, model.top_k) != (num_experts, top_k):
        return oea.RouterSpec(num_experts, top_k)
    return oea.RouterSpec(num_experts, top_k, scoring=model.scoring, n_group=model.n_group,
                          topk_group=model.topk_group)


def policy_variants(
    shape: MoEShape, config: LayerBenchConfig, num_batches: int, generator: torch.Generator
) -> tuple[list[Variant], str, str]:
    """Policy variants on trace (or random) logits: -> (variants, trace name, routing note)."""
    for policy in config.policies:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    for k0 in config.k0s:
        if not isinstance(k0, int) or not 1 <= k0 <= shape.top_k:
            raise ValueError(f"--k0 must be in 1..top_k={shape.top_k}, got {k0!r}")
    name = config.trace or auto_trace_name(config.preset)
    b, n, k = config.batch_size, shape.num_experts, shape.top_k
    if name == RANDOM_TRACE:
        spec = _preset_router(config.preset, n, k)
        batches = [torch.randn(b, n, generator=generator) * 2.0 for _ in range(num_batches)]
        note = f"random Gaussian router logits, {spec.scoring} router (overstates T; see design/landscape.md §5)"
        id_only = False
    else:
        from oea.sim.simulate import make_batches, router_inputs
        from oea.traces import load_trace

        trace = load_trace(name)
        if (trace.spec.num_experts, trace.spec.top_k) != (n, k):
            raise ValueError(f"trace {trace.name!r} routes N={trace.spec.num_experts}, k={trace.spec.top_k} but "
                             f"the layer has N={n}, k={k}; pick a trace of the same model (--trace)")
        tokens = make_batches(trace, b, "mixed", num_batches, generator)  # ValueError if B > pool
        layers = torch.randint(trace.num_layers, (num_batches,), generator=generator).tolist()
        inputs = {layer: router_inputs(trace, layer) for layer in sorted(set(layers))}
        batches = [inputs[layer][0][tokens[i]] for i, layer in enumerate(layers)]
        spec = inputs[layers[0]][1]  # id-only traces: a plain softmax router of the same N, k
        id_only = not trace.has_logits
        note = (f"trace {trace.name!r}: B tokens drawn at random from {trace.num_tokens}, a random layer per batch"
                + ("; id-only: rank-synthesised logits, OEA with max_rank=k" if id_only else ""))
        if trace.correction_bias is not None:
            raise ValueError(f"trace {trace.name!r} has per-layer correction biases, which this benchmark does "
                             "not replay; use a softmax-family trace")
    variants = []
    for policy in config.policies:
        for k0 in (None,) if policy == "vanilla" else config.k0s:
            cfg = _policy_cfg(policy, k0, k, id_only)
            routed = [oea.route(x, spec, cfg) for x in batches]
            label = policy if k0 is None else f"{policy} k0={k0}"
            variants.append(Variant(label, "policy", policy, k0, cfg, spec, batches,
                                    [r[0] for r in routed], [r[1] for r in routed]))
    return variants, name, note


def sweep_variants(
    shape: MoEShape, batch_size: int, t_values: Sequence[int], num_batches: int, generator: torch.Generator
) -> list[Variant]:
    """One variant per exact T, each with ``num_batches`` synthetic routings."""
    variants = []
    for t in t_values:
        routed = [synthetic_routing(shape.num_experts, shape.top_k, batch_size, t, generator)
                  for _ in range(num_batches)]
        variants.append(Variant(f"T={t}", "sweep", None, None, None, None, [],
                                [r[0] for r in routed], [r[1] for r in routed]))
    return variants


# ---------------------------------------------------------------- memory


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


# ---------------------------------------------------------------- statistics


def bootstrap_ci(
    samples: Sequence[float], rng: np.random.Generator, statistic: Callable[[np.ndarray], np.ndarray] | None = None,
    resamples: int = 2000, level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap CI of the median (or ``statistic`` over axis -1) of ``samples``."""
    values = np.asarray(samples, dtype=np.float64)
    if values.size == 0:
        raise ValueError("bootstrap_ci needs at least one sample")
    stat = statistic or (lambda x: np.median(x, axis=-1))
    draws = stat(values[rng.integers(0, values.size, size=(resamples, values.size))])
    tail = (1.0 - level) / 2.0
    return float(np.quantile(draws, tail)), float(np.quantile(draws, 1.0 - tail))


def ratio_ci(
    numerator: Sequence[float], denominator: Sequence[float], rng: np.random.Generator, resamples: int = 2000,
    level: float = 0.95,
) -> tuple[float, float]:
    """Paired bootstrap CI of median(numerator) / median(denominator).

    Sample i of both comes from the same round (same routing batch, neighbouring in time), so whole
    rounds are resampled: batch-to-batch variation of T cancels instead of widening the interval.
    """
    num, den = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if num.size != den.size or num.size == 0:
        raise ValueError(f"ratio_ci needs paired samples of equal, non-zero length, got {num.size} and {den.size}")
    rounds = rng.integers(0, num.size, size=(resamples, num.size))
    ratios = np.median(num[rounds], axis=-1) / np.median(den[rounds], axis=-1)
    tail = (1.0 - level) / 2.0
    return float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1.0 - tail))


def fit_latency(active: Sequence[float], slots: Sequence[float], latency_us: Sequence[float]) -> dict[str, Any]:
    """Least-squares fit of ``latency = b·T + a·(B·k) + c`` (numpy lstsq).

    When the used slots do not vary (a sweep alone) or a comes out negative, a is fixed at 0 and
    the fit is ``b·T + c`` (``a_identified`` False). Returns ``a_us``, ``b_us``, ``c_us``, ``r2``,
    ``points``, ``a_identified``.
    """
    t = np.asarray(active, dtype=np.float64)
    s = np.asarray(slots, dtype=np.float64)
    y = np.asarray(latency_us, dtype=np.float64)
    if not (t.size == s.size == y.size) or t.size < 2:
        raise ValueError(f"fit_latency needs >= 2 points of equal length, got {t.size}, {s.size}, {y.size}")
    a_identified = t.size >= 3 and float(np.ptp(s)) > 0
    if a_identified:
        (b, a, c), *_ = np.linalg.lstsq(np.column_stack([t, s, np.ones_like(t)]), y, rcond=None)
        a_identified = a >= 0
    if not a_identified:
        (b, c), *_ = np.linalg.lstsq(np.column_stack([t, np.ones_like(t)]), y, rcond=None)
        a = 0.0
    predicted = b * t + a * s + c
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else 1.0
    return {"a_us": float(a), "b_us": float(b), "c_us": float(c), "r2": r2, "points": int(t.size),
            "a_identified": bool(a_identified)}


def r_squared(
    fit: dict[str, Any], active: Sequence[float], slots: Sequence[float], latency_us: Sequence[float]
) -> float:
    """R² of ``fit`` on the given points."""
    y = np.asarray(latency_us, dtype=np.float64)
    predicted = fit["b_us"] * np.asarray(active) + fit["a_us"] * np.asarray(slots) + fit["c_us"]
    total = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else 1.0


# ---------------------------------------------------------------- timing


class _Call:
    """One variant's timed call on one weight copy, reading its inputs from static buffers."""

    def __init__(self, variant: Variant, experts: MoEWeights, hidden: torch.Tensor, impl: str, device: str):
        self.variant, self.experts, self.hidden, self.impl = variant, experts, hidden, impl
        if variant.kind == "policy":
            self.logits = variant.logits[0].to(device).clone()
        else:
            self.ids = variant.ids[0].to(device).clone()
            self.weights = variant.weights[0].to(device).clone()

    def load(self, index: int) -> None:
        """Copy input batch ``index`` into the static buffers (untimed)."""
        v = self.variant
        if v.kind == "policy":
            self.logits.copy_(v.logits[index])
        else:
            self.ids.copy_(v.ids[index])
            self.weights.copy_(v.weights[index])

    def __call__(self) -> torch.Tensor:
        if self.variant.kind == "policy":
            ids, weights = oea.route(self.logits, self.variant.spec, self.variant.cfg)
        else:
            ids, weights = self.ids, self.weights
        return moe_forward(self.hidden, ids, weights, self.experts, self.impl)  # type: ignore[arg-type]


class _CpuTimer:
    def prepare(self, call: _Call) -> Callable[[], object]:
        return call

    def time(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class _CudaGraphTimer:
    """Captures each call in a CUDA graph once; times ``replay()`` with CUDA events."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def prepare(self, call: _Call) -> Callable[[], object]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        return graph.replay

    def time(self, fn: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def measure(
    variants: Sequence[Variant], copies: Sequence[MoEWeights], hidden: Sequence[torch.Tensor], impl: str,
    device: str, repeats: int, warmup: int, progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[tuple[float, int, int]]]:
    """Time every variant ``repeats`` times: -> {label: [(seconds, T, used slots), ...]}.

    Round r times the variants in round-robin order starting at variant r mod V and gives each its
    routing batch r mod (its batches) (so policy variants are paired round by round); the c-th call
    uses weight copy c mod len(copies); each (variant, copy) pair reads its own activation batch from
    ``hidden``. On CUDA each (variant, copy) call is captured once as a CUDA graph and replayed.
    """
    timer: _CpuTimer | _CudaGraphTimer = _CudaGraphTimer() if device == "cuda" else _CpuTimer()
    calls = {(v.label, c): _Call(v, copies[c], hidden[(i + c) % len(hidden)], impl, device)
             for i, v in enumerate(variants) for c in range(len(copies))}
    runners = {key: timer.prepare(call) for key, call in calls.items()}
    samples: dict[str, list[tuple[float, int, int]]] = {v.label: [] for v in variants}
    count = 0
    rounds = warmup + repeats
    for r in range(rounds):
        start = r % len(variants)
        for v in list(variants[start:]) + list(variants[:start]):
            key = (v.label, count % len(copies))
            batch = r % len(v.ids)
            calls[key].load(batch)
            seconds = timer.time(runners[key])
            count += 1
            if r >= warmup:
                samples[v.label].append((seconds, v.active[batch], v.slots[batch]))
        if progress is not None:
            progress(r + 1, rounds)
    return samples


# ---------------------------------------------------------------- the run


def _row(variant: Variant, samples: list[tuple[float, int, int]], batch_size: int, expert_bytes: int,
         rng: np.random.Generator) -> dict[str, Any]:
    us = np.array([s[0] for s in samples]) * 1e6
    active = np.array([s[1] for s in samples], dtype=np.float64)
    bandwidth = active * expert_bytes / (us * 1e-6) / 1e9
    lo, hi = bootstrap_ci(us, rng)
    row: dict[str, Any] = {
        "label": variant.label, "kind": variant.kind, "policy": variant.policy, "k0": variant.k0,
        "batch_size": batch_size,
        "mean_active_experts": float(active.mean()),
        "mean_token_slots": float(np.mean([s[2] for s in samples])),
        "latency_us_median": float(np.median(us)), "latency_us_ci95": [lo, hi],
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


def run_layer_bench(
    config: LayerBenchConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready result (``rows``, ``sweep``, ``fit``, settings).

    Raises ``ValueError`` for an unknown preset / policy / dtype / device, k0 out of range, a batch
    larger than the trace pool, or weights that do not fit the available memory.
    """
    from oea.sim.presets import get_model_preset

    if config.device not in DEVICES:
        raise ValueError(f"--device must be one of {list(DEVICES)}, got {config.device!r}")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if config.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {config.batch_size}")
    if config.repeats < 1 or config.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {config.repeats}, {config.warmup}")
    if config.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {config.threads}")
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
        row["ratio_vs_vanilla"] = float(np.median(num) / np.median(den))
        row["ratio_ci95"] = list(ratio_ci(num, den, rng))
    fit_rows = sweep_rows + policy_rows
    fit = None
    if len(fit_rows) >= 2:
        fit = fit_latency([r["mean_active_experts"] for r in fit_rows], [r["mean_token_slots"] for r in fit_rows],
                          [r["latency_us_median"] for r in fit_rows])
        if sweep_rows:
            fit["r2_sweep"] = r_squared(fit, [r["mean_active_experts"] for r in sweep_rows],
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


def write_fit(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Write the fit in the format ``oea.sim.presets.load_cpu_fit`` reads (plus provenance keys)."""
    fit = result.get("fit")
    if not fit:
        raise ValueError("--write-fit needs a fit: run with a T sweep and at least two points")
    if result.get("custom_shape") or result.get("tp", 1) != 1:
        raise ValueError("--write-fit needs a whole-expert preset run (no --tp, no custom shape)")
    payload = {
        "a_us": fit["a_us"], "b_us": fit["b_us"], "c_us": fit["c_us"], "r2": fit["r2"],
        "preset": result["preset"],
        "measured_on": result["machine"] + (f", OMP_WAIT_POLICY={result['omp_wait_policy']}"
                                            if result.get("omp_wait_policy") else ""),
        "dtype": result["dtype"], "impl": result["impl"], "batch_size": result["batch_size"],
        "repeats": result["repeats"], "r2_sweep": fit.get("r2_sweep"), "a_identified": fit["a_identified"],
        "token_slots_of_sweep": fit.get("token_slots_of_sweep"),
        "points": [{"label": r["label"], "active": r["mean_active_experts"], "token_slots": r["mean_token_slots"],
                    "latency_us_median": r["latency_us_median"]} for r in result["sweep"] + result["rows"]],
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": result.get("command", "oea bench layer --write-fit"),
    }
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# ---------------------------------------------------------------- output


def render_table(result: dict[str, Any], console: Any | None = None) -> None:
    """Print the policy rows, the sweep and the fit as rich tables."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 150))
    title = (f"MoE layer {result['preset']} B={result['batch_size']} {result['dtype']} {result['device']} "
             f"impl={result['impl']} threads={result['threads']} repeats={result['repeats']}")
    for kind, rows in (("policies", result["rows"]), ("T sweep (synthetic, exact T)", result["sweep"])):
        if not rows:
            continue
        table = Table(title=f"{title}: {kind}")
        for column in ("variant", "T", "B·k used", "median µs", "95% CI µs", "p10–p90 µs", "GB/s", "vs vanilla"):
            table.add_column(column, justify="left" if column == "variant" else "right")
        for r in rows:
            ratio = r.get("ratio_vs_vanilla")
            ratio_text = "–" if ratio is None else f"{ratio:.3f} [{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}]"
            table.add_row(
                r["label"], f"{r['mean_active_experts']:.1f}", f"{r['mean_token_slots']:.1f}",
                f"{r['latency_us_median']:.0f}", f"{r['latency_us_ci95'][0]:.0f}–{r['latency_us_ci95'][1]:.0f}",
                f"{r['latency_us_p10']:.0f}–{r['latency_us_p90']:.0f}", f"{r['bandwidth_GBps_median']:.2f}",
                ratio_text,
            )
        console.print(table)
    fit = result.get("fit")
    if fit:
        console.print(
            f"fit: latency = {fit['b_us']:.1f} µs·T + {fit['a_us']:.2f} µs·(B·k) + {fit['c_us']:.1f} µs   "
            f"R² = {fit['r2']:.4f} over {fit['points']} points"
            + (f", R² on the sweep = {fit['r2_sweep']:.4f}" if "r2_sweep" in fit else "")
            + ("" if fit["a_identified"] else "  (a not identified: fixed at 0)")
        )
    console.print(f"routing: {result['routing_note']}; {result['weight_copies']} weight copies of "
                  f"{result['layer_bytes'] / 2**30:.2f} GiB; {result['machine']}")


def plot_result(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """PNG: median latency vs T for the sweep (95% CI bars), the fit line at the sweep's B·k, and
    the policy rows marked at their mean T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = result["sweep"]
    if sweep:
        t = np.array([r["mean_active_experts"] for r in sweep])
        y = np.array([r["latency_us_median"] for r in sweep]) / 1e3
        med = np.array([r["latency_us_median"] for r in sweep])
        err = np.abs(np.array([[r["latency_us_ci95"][0] for r in sweep], [r["latency_us_ci95"][1] for r in sweep]])
                     - med) / 1e3
        ax.errorbar(t, y, yerr=err, fmt="o", color="0.3", capsize=3, label="synthetic routing, exact T")
    fit = result.get("fit")
    if fit:
        xs = np.linspace(0, result["shape"]["num_experts"], 50)
        slots = fit.get("token_slots_of_sweep", result["batch_size"] * result["shape"]["top_k"])
        ax.plot(xs, (fit["b_us"] * xs + fit["a_us"] * slots + fit["c_us"]) / 1e3, "--", color="0.5",
                label=f"fit b·T + a·B·k + c at B·k={slots} (R²={fit['r2']:.3f})")
    markers = {"vanilla": "s", "oea": "*", "pruned": "v"}
    for r in result["rows"]:
        ax.plot(r["mean_active_experts"], r["latency_us_median"] / 1e3, markers.get(r["policy"], "D"), markersize=11,
                label=f"{r['label']} (T̄={r['mean_active_experts']:.1f}, B·k used {r['mean_token_slots']:.0f})")
    ax.set_xlabel("active experts T")
    ax.set_ylabel("MoE layer latency, median (ms)")
    ax.set_title(f"{result['preset']} layer, B={result['batch_size']}, {result['dtype']}, {result['device']} "
                 f"({result['impl']})", fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def config_from_args(args: Any) -> LayerBenchConfig:
    """``argparse.Namespace`` of ``oea bench layer`` -> ``LayerBenchConfig``."""
    return LayerBenchConfig(
        preset=args.preset, batch_size=args.batch_size, k0s=tuple(args.k0), policies=tuple(args.policies),
        trace=args.trace, repeats=args.repeats, warmup=args.warmup, threads=args.threads, device=args.device,
        dtype=args.dtype, t_sweep=None if args.t_sweep is None else tuple(args.t_sweep), seed=args.seed,
        impl=args.impl, tp=args.tp, weight_copies=args.weight_copies,
    )


def main(args: Any) -> int:
    """Handler of ``oea bench layer``."""
    config = config_from_args(args)
    quiet = args.json
    progress = None
    if not quiet:
        from rich.console import Console

        console = Console(stderr=True)

        def progress(done: int, total: int) -> None:
            if done == total or done % max(1, total // 10) == 0:
                console.print(f"  round {done}/{total}", highlight=False)

    import os
    import sys

    launcher = pathlib.Path(sys.argv[0])
    from_shell = (launcher.name == "oea" or (launcher.name == "__main__.py" and launcher.parent.name == "oea")) and (
        sys.argv[1:3] == ["bench", "layer"])
    if config.device == "cpu" and config.threads > 1 and "OMP_WAIT_POLICY" not in os.environ:
        # Spinning OpenMP workers on a shared 2-core machine measure the scheduler, not the layer
        # (several times slower, docs/benchmarks.md); libgomp reads the policy only at start-up.
        if from_shell:
            print("oea bench layer: re-running with OMP_WAIT_POLICY=PASSIVE (set it to choose otherwise)",
                  file=sys.stderr)
            sys.stderr.flush()
            os.execve(sys.executable, [sys.executable, "-m", "oea", *sys.argv[1:]],
                      {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        print("oea bench layer: note: OMP_WAIT_POLICY is unset, so OpenMP threads spin while they wait; "
              "on a shared machine set OMP_WAIT_POLICY=PASSIVE before Python starts", file=sys.stderr)
    result = run_layer_bench(config, progress)
    result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    result["command"] = " ".join(["oea", *sys.argv[1:]]) if from_shell else "oea bench layer (called in-process)"
    if args.plot:
        result["plot"] = str(plot_result(result, args.plot))
    if args.write_fit:
        from oea.bench.layer_cli import DEFAULT_FIT
        from oea.sim.presets import CPU_FIT_PATH

        target = CPU_FIT_PATH if args.write_fit == DEFAULT_FIT else args.write_fit
        result["fit_file"] = str(write_fit(result, target))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render_table(result)
        for key in ("plot", "fit_file"):
            if key in result:
                print(f"wrote {result[key]}")
    return 0
