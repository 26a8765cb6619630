"""What one ``oea bench layer`` run times: its configuration, the variants and their routing batches.

Shape legend: B = decode batch, k = top-k, N = routed experts, T = active (distinct, non-zero-weight)
experts of one layer call, B·k = token-expert slots.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import oea
from oea.bench.layer.moe import MoEShape

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
        preset: model preset name (``oea.presets.MODEL_PRESETS``).
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
    from oea.traces import bundled_trace_dir, bundled_trace_names

    for name in bundled_trace_names():
        meta = json.loads((bundled_trace_dir() / f"{name}.json").read_text())
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
    from oea.presets import MODEL_PRESETS

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
        note = (f"random Gaussian router logits, {spec.scoring} router (overstates T: random logits spread over "
                f"all experts, trained routers concentrate on popular ones; use a trace for realistic T)")
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

