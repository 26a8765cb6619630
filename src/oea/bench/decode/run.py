"""``oea bench decode``: end-to-end batched greedy decode through transformers, OEA off vs OEA policies.

What it answers: **how much faster is a whole decode step** (attention, routers, experts, LM head) when
OEA shrinks the number of active experts, on a model whose experts have real byte sizes (by default the
embedded model inflated in memory to Qwen3-30B-A3B's per-expert bytes, ``oea.models.inflate``).

How it measures:

* Prompts: windows of ``prompt_tokens`` tokens from held-out text (the embedded model's held-out files,
  else held-out standard-library files), B per batch, new prompts every round, the same for every policy.
* Decode: transformers ``StaticCache``; prefill (untimed) then ``new_tokens`` greedy steps, each timed:
  one forward of ``[B, 1]`` tokens, argmax, next input. Experts run with ``grouped_mm`` (only active
  experts are read). OEA is attached with ``oea.attach`` (decode steps only), which also counts the
  active experts per layer and step for every policy, vanilla included.
* CPU: eager, ``threads`` threads, every round runs all policies in a rotated order (interleaved, so
  drift hits all alike). CUDA: the decode step is captured in a CUDA graph once per (policy, batch size)
  (``oea.bench.decode.step``; ``torch.compile(mode="reduce-overhead")`` as fallback or with ``--graph
  compile``); rounds run policy by policy, timed with CUDA events, and vanilla's graph tokens are
  compared with eager ones (``graph_token_match_vs_eager``).
* Statistics (``oea.stats``): step latency median with a bootstrap 95% CI over all timed steps; the
  ratio to vanilla is the ratio of medians with a paired bootstrap CI (step s of round r of a policy is
  paired with step s of round r of vanilla: same prompts, same position, neighbours in time).
* Identity check: per batch size, OEA with k0 = top_k must give exactly vanilla's greedy tokens
  (both eager, same prompts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oea.bench.decode.step import GRAPH_MODES, Decoder, StepTimer, resolve_graph_mode

POLICIES: tuple[str, ...] = ("oea", "pruned")
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
DEFAULT_LIKE = "qwen3-30b-a3b"


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What ``oea bench decode`` runs (field names follow the flags).

    ``like`` / ``moe_intermediate_size``: inflate the model in memory (``oea.models.inflate``); both None
    keeps it as it is. ``graph``: ``oea.bench.decode.step.GRAPH_MODES`` (auto: CUDA graphs on CUDA, eager on CPU).
    """

    model: str | None = None
    like: str | None = DEFAULT_LIKE
    moe_intermediate_size: int | None = None
    policies: tuple[str, ...] = ("oea",)
    k0s: tuple[int, ...] = (3, 5)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    prompt_tokens: int = 32
    new_tokens: int = 16
    rounds: int = 3
    threads: int = 2
    device: str = "auto"
    dtype: str = "bfloat16"
    graph: str = "auto"
    seed: int = 0
    check_identity: bool = True

    def __post_init__(self) -> None:
        positive = {"--prompt-tokens": self.prompt_tokens, "--new-tokens": self.new_tokens, "--rounds": self.rounds,
                    "--threads": self.threads}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be >= 1, got {list(self.batch_sizes)}")
        if not self.k0s and self.policies:
            raise ValueError("--k0 needs at least one value when --policies is not empty")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"--policies must be among {list(POLICIES)}, got {unknown}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.graph not in GRAPH_MODES:
            raise ValueError(f"--graph must be one of {list(GRAPH_MODES)}, got {self.graph!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.like is not None and self.moe_intermediate_size is not None:
            raise ValueError("give at most one of --like and --moe-intermediate-size")


@dataclass(frozen=True)
class Variant:
    """One policy row: ``label`` (e.g. ``oea k0=3``), ``policy`` (vanilla/oea/pruned), ``k0``, routing config."""

    label: str
    policy: str
    k0: int | None
    cfg: object | None


def make_variants(policies: Sequence[str], k0s: Sequence[int], top_k: int) -> list[Variant]:
    """Vanilla first, then every (policy, k0); ``ValueError`` naming ``--k0`` when a k0 is outside 1..top_k."""
    import oea

    bad = [k for k in k0s if not 1 <= k <= top_k]
    if bad:
        raise ValueError(f"--k0 values must be in 1..{top_k} (the model's top_k), got {bad}")
    out = [Variant("vanilla", "vanilla", None, None)]
    for policy in policies:
        for k0 in dict.fromkeys(k0s):
            cfg = oea.OEAConfig(k0) if policy == "oea" else oea.PrunedConfig(k0)
            out.append(Variant(f"{policy} k0={k0}", policy, k0, cfg))
    return out


def check_checkpoint(cfg: DecodeBenchConfig) -> None:
    """What the checkpoint's ``config.json`` settles before any weight loads (the CLI calls it before it
    re-executes itself): ``--model`` is a checkpoint directory, ``--like`` a model preset, and every ``--k0``
    fits the model's top_k. Errors name the flag."""
    import json
    import pathlib

    from oea.models import embedded_model_dir
    from oea.presets import MODEL_PRESETS, model_preset_names

    folder = embedded_model_dir() if cfg.model is None else pathlib.Path(cfg.model)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--model {folder}: not a checkpoint directory (no config.json)")
    if cfg.like is not None and cfg.like not in MODEL_PRESETS:
        raise ValueError(f"--like must be one of {model_preset_names()}, got {cfg.like!r}")
    top_k = json.loads((folder / "config.json").read_text()).get("num_experts_per_tok")
    if isinstance(top_k, int):
        make_variants(cfg.policies, cfg.k0s, top_k)


def resolve_device(name: str, cuda_available: bool | None = None) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; ``cuda`` without CUDA -> ``ValueError``."""
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if name == "auto":
        return "cuda" if available else "cpu"
    if name == "cuda" and not available:
        raise ValueError("--device cuda: torch.cuda.is_available() is False")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be one of {list(DEVICES)}, got {name!r}")
    return name


# ---------------------------------------------------------------- model and prompts


def load_bench_model(cfg: DecodeBenchConfig, device: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)``: the checkpoint (default: embedded) in ``cfg.dtype`` with ``grouped_mm``
    experts, inflated in memory when asked, on ``device``."""
    from oea.models import embedded_model_dir, load_model
    from oea.models.inflate import inflate_model

    model, tokenizer = load_model(cfg.model, dtype=DTYPES[cfg.dtype], experts_implementation="grouped_mm")
    base = getattr(model.config, "moe_intermediate_size", None)
    if cfg.like is not None or cfg.moe_intermediate_size is not None:
        inflate_model(model, like=cfg.like, moe_intermediate_size=cfg.moe_intermediate_size, seed=cfg.seed)
    model.to(device)
    info = {"model": str(cfg.model or embedded_model_dir()), "like": cfg.like,
            "moe_intermediate_size_base": base, "moe_intermediate_size": getattr(model.config,
                                                                                 "moe_intermediate_size", None)}
    return model, tokenizer, info


def token_streams(tokenizer: Any, model_dir: str | None, min_tokens: int) -> list[list[int]]:
    """Token ids of every held-out document with at least ``min_tokens`` tokens."""
    from oea.bench.serve.prompts import heldout_texts
    from oea.models import heldout_documents

    try:
        texts = [text for _name, text in heldout_documents(model_dir)] if model_dir else heldout_texts()
    except FileNotFoundError:
        texts = heldout_texts()
    # verbose=False: whole documents exceed model_max_length on purpose (prompts are windows cut from them)
    streams = [tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] for text in texts]
    streams = [s for s in streams if len(s) >= min_tokens]
    if not streams:
        raise ValueError(f"no held-out document has {min_tokens} tokens (--prompt-tokens)")
    return streams


def prompt_batch(streams: Sequence[Sequence[int]], batch_size: int, length: int, seed: int) -> torch.Tensor:
    """``[batch_size, length]`` int64: windows at random places of random documents (seeded)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch_size):
        stream = streams[int(rng.integers(len(streams)))]
        start = int(rng.integers(0, len(stream) - length + 1))
        rows.append(list(stream[start:start + length]))
    return torch.tensor(rows, dtype=torch.int64)


# ---------------------------------------------------------------- decoding


def _static_counters(handle: Any) -> None:
    """Give the handle's device counters static addresses, so that CUDA-graph trees may update them
    in place instead of skipping the graph (the counters are hook state, not module buffers)."""
    for hook in getattr(handle, "_hooks", {}).values():
        for tensor in (hook.counts, hook.last_active):
            torch._dynamo.mark_static_address(tensor)


def mean_active(stats: dict[int, dict[str, Any]]) -> tuple[float, float]:
    """(mean active experts per layer and step, the same for the router's own picks) from ``handle.stats()``."""
    layers = list(stats.values())
    return (float(np.mean([s["mean_active_experts"] for s in layers])),
            float(np.mean([s["mean_active_experts_vanilla"] for s in layers])))


# ---------------------------------------------------------------- the run


@dataclass
class _Samples:
    """One variant's measurements at one batch size: per round, step seconds and greedy tokens."""

    seconds: list[list[float]]
    tokens: list[torch.Tensor]
    active: list[float]
    active_vanilla: list[float]


def rotated(variants: Sequence[Variant], round_index: int) -> list[Variant]:
    """The variants in the order round ``round_index`` runs them: rotated left by the round index."""
    shift = round_index % len(variants)
    return list(variants[shift:]) + list(variants[:shift])


def _measure(decoder: Decoder, handle: Any, prompts: torch.Tensor, timer: StepTimer, samples: _Samples
             ) -> None:
    handle.reset_stats()
    tokens, seconds = decoder.run(prompts, timer)
    oea_active, own_active = mean_active(handle.stats())
    samples.seconds.append(seconds)
    samples.tokens.append(tokens)
    samples.active.append(oea_active)
    samples.active_vanilla.append(own_active)


def measure_batch(model: Any, variants: Sequence[Variant], prompts: Sequence[torch.Tensor], cfg: DecodeBenchConfig,
                  device: str, graph: str, progress: Callable[[str], None] | None = None
                  ) -> tuple[dict[str, _Samples], list[str]]:
    """Every variant over every round's prompts ``[B, P]`` at one batch size -> ({label: samples}, graph
    capture errors that made a decoder fall back to ``compile``).

    Eager (``graph="none"``): one decoder, a short untimed warm-up, then rounds with the variants in rotated
    order, hooks attached per run. Graph modes: per variant one decoder whose first, untimed run captures
    (or compiles) the step with that variant's hooks; the hooks stay attached for all its rounds (the
    graph updates their counters; re-attaching would recompile), so rounds run variant by variant.
    """
    import oea

    timer = StepTimer(device)
    batch_size = prompts[0].shape[0]
    samples = {v.label: _Samples([], [], [], []) for v in variants}
    fallbacks: list[str] = []
    if graph != "none":
        for variant in variants:
            decoder = Decoder(model, batch_size, cfg.prompt_tokens, cfg.new_tokens, device, mode=graph)
            with oea.attach(model, variant.cfg) as handle:
                _static_counters(handle)  # before a compile, also one a failed capture falls back to
                decoder.run(prompts[0], timer)  # captures / compiles
                if decoder.fallback_error:
                    fallbacks.append(f"B={batch_size} {variant.label}: {decoder.fallback_error}")
                for r, batch in enumerate(prompts):
                    if progress is not None:
                        progress(f"B={batch_size} {variant.label} round {r + 1}/{len(prompts)}")
                    _measure(decoder, handle, batch, timer, samples[variant.label])
                del decoder  # the graph goes before the hooks whose counters it writes
        return samples, fallbacks
    decoder = Decoder(model, batch_size, cfg.prompt_tokens, cfg.new_tokens, device)
    with torch.no_grad():
        decoder.run(prompts[0], timer, steps=2)  # warm-up: allocator, caches, first-call costs
    for r, batch in enumerate(prompts):
        for variant in rotated(variants, r):
            if progress is not None:
                progress(f"B={batch_size} {variant.label} round {r + 1}/{len(prompts)}")
            with oea.attach(model, variant.cfg) as handle:
                _measure(decoder, handle, batch, timer, samples[variant.label])
    return samples, fallbacks


def identity_check(model: Any, prompts: torch.Tensor, top_k: int, cfg: DecodeBenchConfig, device: str,
                   vanilla_tokens: torch.Tensor | None = None) -> tuple[bool, torch.Tensor]:
    """(whether OEA with k0 = top_k gives exactly vanilla's greedy tokens on ``prompts``, vanilla's tokens),
    both decoded eagerly; ``vanilla_tokens`` (eager, same prompts) saves the vanilla run."""
    import oea

    decoder = Decoder(model, prompts.shape[0], cfg.prompt_tokens, cfg.new_tokens, device)
    timer = StepTimer(device)
    if vanilla_tokens is None:
        with oea.attach(model, None):
            vanilla_tokens, _ = decoder.run(prompts, timer)
    with oea.attach(model, oea.OEAConfig(top_k)):
        tokens, _ = decoder.run(prompts, timer)
    return bool(torch.equal(tokens, vanilla_tokens)), vanilla_tokens


def batch_rows(variants: Sequence[Variant], samples: dict[str, _Samples], batch_size: int,
               rng: np.random.Generator) -> list[dict[str, Any]]:
    """One row per variant (contract fields: ``policy``, ``k0``, ``batch_size``, ``step_ms_median``,
    ``step_ms_ci``, ``ratio_vs_vanilla``, ``mean_active_experts``; plus ``ratio_ci``, ``tokens_per_s``,
    ``step_ms_p10``/``p90``, ``mean_active_experts_vanilla``, ``token_match_vs_vanilla``, ``steps``)."""
    from oea.stats import median_interval, ratio_of_medians_interval

    vanilla = samples["vanilla"]
    vanilla_ms = np.concatenate([np.asarray(s) for s in vanilla.seconds]) * 1e3
    rows = []
    for variant in variants:
        own = samples[variant.label]
        ms = np.concatenate([np.asarray(s) for s in own.seconds]) * 1e3
        step = median_interval(ms, rng)
        if variant.policy == "vanilla":
            ratio, ratio_ci = 1.0, [1.0, 1.0]
        else:
            interval = ratio_of_medians_interval(ms, vanilla_ms, rng, paired=True)
            ratio, ratio_ci = interval.estimate, interval.as_list()
        match = np.mean([float((t[:, 1:] == v[:, 1:]).float().mean()) for t, v in zip(own.tokens, vanilla.tokens,
                                                                                        strict=True)])
        rows.append({
            "policy": variant.policy, "k0": variant.k0, "label": variant.label, "batch_size": batch_size,
            "step_ms_median": step.estimate, "step_ms_ci": step.as_list(),
            "step_ms_p10": float(np.quantile(ms, 0.1)), "step_ms_p90": float(np.quantile(ms, 0.9)),
            "tokens_per_s": batch_size * 1e3 / step.estimate,
            "ratio_vs_vanilla": ratio, "ratio_ci": ratio_ci,
            "mean_active_experts": float(np.mean(own.active)),
            "mean_active_experts_vanilla": float(np.mean(own.active_vanilla)),
            "token_match_vs_vanilla": float(match), "steps": int(ms.size),
        })
    return rows


def run_decode_bench(cfg: DecodeBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns ``{"rows": [...], "identity": {B: bool}, "k0_top_k_identical": bool, ...}``."""
    from oea.bench.layer.run import machine_description

    started, load_before = time.perf_counter(), os.getloadavg()
    device = resolve_device(cfg.device)
    graph = resolve_graph_mode(cfg.graph, device)
    if device == "cpu":
        torch.set_num_threads(cfg.threads)
    if graph != "none":  # compile (also a capture's fallback): one graph per (policy, batch size)
        torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
        torch._dynamo.config.accumulated_recompile_limit = max(512, torch._dynamo.config.accumulated_recompile_limit)
    model, tokenizer, info = load_bench_model(cfg, device)
    top_k = int(model.config.num_experts_per_tok)
    variants = make_variants(cfg.policies, cfg.k0s, top_k)
    streams = token_streams(tokenizer, cfg.model, cfg.prompt_tokens)
    rng = np.random.default_rng(cfg.seed)
    rows: list[dict[str, Any]] = []
    identity: dict[int, bool] = {}
    graph_vs_eager: dict[str, float] = {}
    fallbacks: list[str] = []
    for batch_size in cfg.batch_sizes:
        prompts = [prompt_batch(streams, batch_size, cfg.prompt_tokens, cfg.seed + 1000 * batch_size + r)
                   for r in range(cfg.rounds)]
        samples, errors = measure_batch(model, variants, prompts, cfg, device, graph, progress)
        fallbacks += errors
        if cfg.check_identity:
            vanilla_tokens = None if graph != "none" else samples["vanilla"].tokens[0]
            identity[batch_size], eager = identity_check(model, prompts[0], top_k, cfg, device, vanilla_tokens)
            if graph != "none":  # a correct capture replays eager's kernels: same greedy tokens
                graph_vs_eager[str(batch_size)] = float((samples["vanilla"].tokens[0] == eager).float().mean())
        rows.extend(batch_rows(variants, samples, batch_size, rng))
    result: dict[str, Any] = {
        "config": {**cfg.__dict__, "policies": list(cfg.policies), "k0s": list(cfg.k0s),
                   "batch_sizes": list(cfg.batch_sizes)},
        "device": device, "graph": graph, "graph_fallbacks": fallbacks,
        "graph_token_match_vs_eager": graph_vs_eager, "machine": machine_description(device, cfg.threads),
        "model": info, "top_k": top_k, "rows": rows,
        "identity": {str(b): ok for b, ok in identity.items()},
        "k0_top_k_identical": all(identity.values()) if identity else None,
        "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
        "wall_s": time.perf_counter() - started,
    }
    if graph != "none":
        from torch._dynamo.utils import counters

        result["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
    return result
