"""What-if simulator: replay recorded routing through policies at many batch sizes.

Shape legend: T = trace tokens, L = MoE layers, N = routed experts, k = top-k, B = batch size,
nb = number of simulated batches.

For every (policy, k0, B) the simulator forms ``nb`` batches of B trace tokens (``mixed``: B tokens
drawn uniformly without replacement from the whole pool; ``lockstep``: B different requests at the
same decode position, or, in a trace recorded from an engine (``step_ids``), B requests of one engine
step, never the same batch twice: ``oea.sim.batches``), routes each batch of each layer through ``oea.route``
and measures:

* active experts T per layer and batch (mean, p50, p95 over all layer × batch samples);
* experts per token (non-zero-weight slots);
* the share of each token's original top-k that it keeps, and the router probability mass it keeps
  (when the trace has logits or scores);
* the predicted MoE-layer latency from ``oea.sim.costmodel`` (when a model and GPU preset are given);
* any extra ``Metric`` (e.g. ``max_device_active_experts`` for expert parallelism).

Id-only traces: each token's logits are synthesised from its recorded ranks (rank j -> -j, or
log(score) when scores exist; unrecorded experts -> -inf), routed with a plain softmax router, and
OEA runs with ``max_rank = k``: it can piggyback only within the recorded top-k (the paper's
max_rank = k variant, a conservative approximation of full-ranking OEA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

import oea
from oea.presets import ModelPreset
from oea.routing import RouterSpec, make_policy, policy_names, router_scores
from oea.routing.catalog import needs_k0
from oea.routing.spec import PrunedConfig
from oea.sim.batches import distinct_batches, make_batches
from oea.sim.scaleout import UNIONS, per_rank_metric, route_step, step_batches
from oea.sim.summary import (
    DEFAULT_PRECISION,
    MAX_BATCHES,
    PILOT_BATCHES,
    Samples,
    add_ratios,
    batches_for_precision,
    extend,
    summarise,
)
from oea.traces import Trace, load_trace

Mode = Literal["mixed", "lockstep"]
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
ID_ONLY_NOTE = (
    "{what} trace: logits synthesised from the recorded {how}; OEA piggybacks only within the "
    "recorded top-{k} (max_rank={k}, the paper's conservative variant)"
)


def trace_note(trace: Trace) -> str:
    """How the trace is replayed (full logits, or the max_rank = k approximation)."""
    if trace.has_logits:
        return "full router logits: OEA piggybacks from the full ranking"
    if trace.scores is not None:
        return ID_ONLY_NOTE.format(what="top-k ids + scores", how="scores (log-probabilities)",
                                   k=trace.spec.top_k)
    return ID_ONLY_NOTE.format(what="id-only", how="ranks", k=trace.spec.top_k)


@dataclass(frozen=True)
class LayerBatches:
    """The routing of ``nb`` batches of one layer under one policy (input to metrics).

    Attributes:
        layer: MoE layer index within the trace.
        ids: [nb, B, k] int64 routed ids (fillers have weight 0).
        weights: [nb, B, k] float32 routed weights.
        vanilla_ids: [nb, B, k] int64 the model's own top-k.
        mass: [nb, B, N] float32 router weight source (softmax probabilities / unbiased sigmoid)
            used for ``kept_mass``, or ``None`` when the trace has no scores.
        num_experts: N.
    """

    layer: int
    ids: torch.Tensor
    weights: torch.Tensor
    vanilla_ids: torch.Tensor
    mass: torch.Tensor | None
    num_experts: int


Metric = Callable[[LayerBatches], dict[str, torch.Tensor]]
"""A pluggable metric: ``LayerBatches`` -> {name: [nb] float tensor}; the simulator averages it."""


def batch_expert_load(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert in each batch: [nb, B, k] ids and weights -> [nb, N] int64.

    Slots with weight exactly 0 (fillers) do not count, as in ``oea.expert_load``.
    """
    nb = ids.shape[0]
    routed = torch.where(weights != 0, ids, torch.full_like(ids, num_experts)).reshape(nb, -1)
    load = torch.zeros(nb, num_experts + 1, dtype=torch.int64)
    return load.scatter_add_(1, routed, torch.ones_like(routed))[:, :num_experts]


def max_device_active(load: torch.Tensor, ep: int) -> torch.Tensor:
    """Busiest device's active experts for contiguous placement: [nb, N] load -> [nb] int64.

    Device d holds experts d·N/ep .. (d+1)·N/ep - 1.
    """
    nb, n = load.shape
    if ep < 1 or n % ep:
        raise ValueError(f"ep must be a positive divisor of num_experts={n}, got ep={ep}")
    return (load > 0).reshape(nb, ep, n // ep).sum(dim=-1).max(dim=-1).values


def ep_metric(ep: int) -> Metric:
    """Metric ``max_device_active_experts``: the busiest of ``ep`` contiguous expert blocks."""

    def metric(batches: LayerBatches) -> dict[str, torch.Tensor]:
        load = batch_expert_load(batches.ids, batches.weights, batches.num_experts)
        return {"max_device_active_experts": max_device_active(load, ep).double()}

    return metric


def router_inputs(trace: Trace, layer: int) -> tuple[torch.Tensor, RouterSpec, torch.Tensor | None]:
    """What to feed ``oea.route`` for one layer of a trace.

    Returns ``(logits [T, N] float32, spec, mass [T, N] float32 or None)``: the recorded logits and
    the trace's own router, or, for id-only traces, rank-synthesised logits and a plain softmax
    router of the same N and k. ``mass`` is the router probability of each expert (``None`` when
    neither logits nor scores were recorded).
    """
    spec = trace.layer_spec(layer)
    if trace.logits is not None:
        logits = trace.logits[:, layer].float()
        return logits, spec, router_scores(logits, spec).weight
    assert trace.ids is not None
    t, k = trace.ids.shape[0], trace.ids.shape[2]
    n = spec.num_experts
    ids = trace.ids[:, layer]
    ranks = torch.arange(k, dtype=torch.float32).expand(t, k)
    if trace.scores is not None:
        scores = trace.scores[:, layer].float().clamp_min(1e-30)
        values = scores.log() - 1e-4 * ranks  # keep the recorded order when scores tie
    else:
        values = -ranks
    logits = torch.full((t, n), float("-inf")).scatter(1, ids, values)
    mass = None
    if trace.scores is not None:
        mass = torch.zeros(t, n).scatter(1, ids, trace.scores[:, layer].float())
    return logits, RouterSpec(n, k, scoring="softmax", renormalize=spec.renormalize), mass


def _batch_independent(cfg: object | None) -> bool:
    """Policies whose per-token routing does not depend on the rest of the batch."""
    return cfg is None or (type(cfg) is PrunedConfig)


def route_batches(
    logits: torch.Tensor, spec: RouterSpec, cfg: object | None, batches: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route every batch through ``oea.route``: [T, N] logits, [nb, B] indices -> ids, weights [nb, B, k].

    Batch-independent policies (vanilla, pruned) are routed once over the whole pool and gathered;
    batch-aware ones get one ``route`` call of B rows per batch.
    """
    nb, b = batches.shape
    if _batch_independent(cfg):
        used = torch.unique(batches)
        ids, weights = oea.route(logits[used], spec, cfg, valid=torch.ones(len(used), dtype=torch.bool))
        where = torch.searchsorted(used, batches.reshape(-1))
        return ids[where].reshape(nb, b, -1), weights[where].reshape(nb, b, -1)
    results = [oea.route(logits[batch], spec, cfg) for batch in batches]
    return torch.stack([r[0] for r in results]), torch.stack([r[1] for r in results])


def core_metrics(batches: LayerBatches) -> dict[str, torch.Tensor]:
    """T, experts per token, kept top-k share and kept mass per batch ([nb] each)."""
    load = batch_expert_load(batches.ids, batches.weights, batches.num_experts)
    used = batches.weights != 0  # [nb, B, k]
    k = batches.ids.shape[-1]
    # kept top-k share: a used slot whose id is among the token's own top-k
    in_topk = (batches.ids.unsqueeze(-1) == batches.vanilla_ids.unsqueeze(-2)).any(-1) & used
    # count distinct ids only once (fillers repeat ids but have weight 0, so used slots are distinct)
    metrics = {
        "active_experts": (load > 0).sum(-1).double(),
        "experts_per_token": used.sum(-1).double().mean(-1),
        "kept_topk_share": (in_topk.sum(-1).double() / k).mean(-1),
        "token_slots": used.sum((-1, -2)).double(),
    }
    if batches.mass is not None:
        final = (batches.mass.gather(-1, batches.ids) * used).sum(-1)
        original = batches.mass.gather(-1, batches.vanilla_ids).sum(-1)
        metrics["kept_mass"] = (final.double() / original.double().clamp_min(1e-30)).mean(-1)
    return metrics


@dataclass(frozen=True)
class _Setting:
    policy: str
    k0: int | None
    cfg: object | None
    union: str | None = None  # dp > 1: "local" or "global" (oea.sim.scaleout)


def _settings(
    policies: Sequence[str], k0s: Sequence[int], trace: Trace, options: Mapping[str, Mapping[str, Any]],
    ep: int | None = None,
) -> Iterator[_Setting]:
    known = policy_names()
    for name in options:
        if name not in policies:
            raise ValueError(f"policy_options names policy {name!r}, which is not in policies {list(policies)}")
    for name in policies:
        if name not in known:
            raise ValueError(f"policy must be one of {known}, got {name!r}")
    for values, what in ((policies, "policies"), (k0s, "k0 values")):
        repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
        if repeated:
            raise ValueError(f"{what} must not repeat, got {repeated} more than once")
    k = trace.spec.top_k
    for name in policies:
        extra = dict(options.get(name, {}))
        if name == "ep-oea" and not {"placement", "ep"} & set(extra):
            if ep is None:
                raise ValueError("policy 'ep-oea' needs the expert-parallel degree: ep=N (--ep N), or a "
                                 "placement in its policy options")
            extra.update(ep=ep, num_experts=trace.spec.num_experts)  # contiguous placement, as the ep metric
        if not needs_k0(name):
            yield _Setting(name, None, make_policy(name, **extra))
            continue
        for k0 in k0s:
            if not isinstance(k0, int) or not 1 <= k0 <= k:
                raise ValueError(f"k0 must be in 1..top_k={k} for trace {trace.name!r}, got {k0!r}")
            cfg = make_policy(name, k0, **extra)
            if not trace.has_logits and cfg is not None and dataclasses.is_dataclass(cfg) and any(
                f.name == "max_rank" for f in dataclasses.fields(cfg)
            ):
                current = getattr(cfg, "max_rank", None)
                cfg = dataclasses.replace(cfg, max_rank=k if current is None else min(current, k))
            yield _Setting(name, k0, cfg)


def simulate(
    trace: Trace | str,
    policies: Sequence[str] = ("vanilla", "pruned", "oea"),
    k0s: Sequence[int] = (3,),
    batch_sizes: Sequence[int] = (1, 4, 16, 64),
    mode: str = "mixed",
    seed: int = 0,
    num_batches: int | None = None,
    model_preset: str | ModelPreset | None = None,
    gpu: str | None = None,
    tp: int = 1,
    ep: int | None = None,
    layers: Sequence[int] | None = None,
    metrics: Sequence[Metric] = (),
    progress: Callable[[int, int], None] | None = None,
    policy_options: Mapping[str, Mapping[str, Any]] | None = None,
    precision: float = DEFAULT_PRECISION,
    max_batches: int = MAX_BATCHES,
    dp: int = 1,
) -> list[dict[str, Any]]:
    """Replay ``trace`` through ``policies`` × ``k0s`` at each batch size; one result row per setting.

    Args:
        trace: a ``Trace`` or a bundled name / path for ``load_trace``.
        policies: names from ``oea.routing.policy_names()``; ``vanilla`` ignores k0 (row k0 = None).
        k0s: baseline experts per token for the policies that take one.
        batch_sizes: B values; every one must fit the pool (``mixed``) or the requests (``lockstep``).
        mode: ``"mixed"`` or ``"lockstep"``.
        seed: seeds batch formation; every policy sees the same batches.
        num_batches: batches per batch size (>= 2); ``None`` draws batches until the 95% interval of
            every row's mean T is within ``precision`` of it (``oea.sim.summary``), at most ``max_batches``.
            Lockstep batches never repeat (``oea.sim.batches``): a trace with fewer distinct ones gives
            each once (``ValueError`` when it holds only one).
        model_preset / gpu / tp: latency prediction (``predicted_latency_us``) when both are given;
            ``model_preset`` (a built-in name or a ``ModelPreset``, e.g. from a preset file) defaults
            to the trace's ``meta['model_preset']`` when ``gpu`` is given.
        ep: expert-parallel degree: adds ``max_device_active_experts`` (contiguous placement), uses
            it for the latency, and places ``ep-oea``'s experts (contiguously) unless its options do.
        layers: subset of layer indices (default: all).
        metrics: extra ``Metric`` functions; their per-batch values are averaged into the row.
        progress: called as ``progress(done, total)`` after each (batch size, layer).
        policy_options: extra ``make_policy`` options per policy name, e.g.
            ``{"budget": {"budget": 40}}``.
        precision, max_batches: the automatic batch count (``num_batches=None``).
        dp: data-parallel ranks: each step is ``dp`` batches of B rows (B per rank), routed with a ``local``
            union per rank and a ``global`` one over the step (rows ``union``; ``oea.sim.scaleout``); T,
            the busiest device and the quality proxy are over the whole step, ``per_rank_active_experts``
            per rank. Batch-independent policies (vanilla, pruned) give one ``local`` row.

    Returns:
        Rows with ``trace``, ``mode``, ``policy``, ``k0``, ``batch_size``, ``num_batches``,
        ``mean_active_experts``, ``p50_active_experts``, ``p95_active_experts``,
        ``mean_experts_per_token``, ``kept_topk_share``, ``kept_mass`` (or ``None``),
        ``active_ratio_vs_vanilla`` (when vanilla is simulated), ``per_layer_active_experts``,
        ``distinct_batches`` (lockstep: how many different batches the trace holds at that size),
        ``predicted_latency_us`` (or ``None``; ``latency_ratio_vs_vanilla``), ``max_device_active_experts``
        (when ``ep``), ``dp``, ``union`` and ``per_rank_active_experts`` (when ``dp > 1``), ``note`` and the mean
        of every extra metric. Every mean and ratio has a ``*_ci`` ``[low, high]`` 95% interval over the
        batches; ``t_ci_relative_half_width`` is T's relative half-width (with ``t_ci_target`` and
        ``t_ci_target_met`` when the count was automatic).
    """
    if isinstance(trace, str):
        trace = load_trace(trace)
    if num_batches is not None and (not isinstance(num_batches, int) or num_batches < 2):
        raise ValueError(f"num_batches must be an integer >= 2 (an interval needs two batches), got {num_batches!r}")
    if not 0 < precision < 1 or not isinstance(max_batches, int) or max_batches < PILOT_BATCHES:
        raise ValueError(f"precision must be in (0, 1) and max_batches an integer >= {PILOT_BATCHES}, got "
                         f"{precision!r} and {max_batches!r}")
    if ep is not None and (not isinstance(ep, int) or ep < 1):
        raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}")
    settings = [dataclasses.replace(s, union=u) for s in _settings(policies, k0s, trace, policy_options or {}, ep)
                for u in ((None,) if dp == 1 else ("local",) if _batch_independent(s.cfg) else UNIONS)]
    layer_list = list(range(trace.num_layers)) if layers is None else list(layers)
    for layer in layer_list:
        if not 0 <= layer < trace.num_layers:
            raise ValueError(f"layers must lie in 0..{trace.num_layers - 1}, got {layer}")
    cost = _cost_model(trace, model_preset, gpu, tp, ep)
    extra = list(metrics) + ([ep_metric(ep)] if ep else []) + ([per_rank_metric(dp)] if dp > 1 else [])
    note = trace_note(trace)
    if cost is not None and cost.model.num_experts != trace.spec.num_experts:
        note += (f"; latency uses preset {cost.model.name!r} (N={cost.model.num_experts}) with this "
                 f"trace's T (N={trace.spec.num_experts})")

    for b in batch_sizes if mode == "mixed" else ():  # a pool too small for as many different batches as drawn
        tokens = b * dp
        distinct = distinct_batches(trace, tokens, mode) if tokens <= trace.num_tokens else 0
        if distinct == 1:  # `oea simulate` refuses it before any work; the API says what it computed
            note += (f"; B={b} takes the whole {trace.num_tokens}-token pool: every batch is the same one, so its "
                     "interval is 0 by construction")
        elif 1 < distinct < (num_batches or max_batches):
            note += (f"; B={b}: the {trace.num_tokens}-token pool holds only {distinct} different batches, so "
                     "mixed draws repeat some of them")
    generator = torch.Generator().manual_seed(seed)
    auto = num_batches is None
    first = PILOT_BATCHES if auto else num_batches
    batch_plan = {b: step_batches(make_batches, trace, b, dp, mode, first, generator) for b in batch_sizes}
    inputs = {layer: router_inputs(trace, layer) for layer in layer_list}
    rows = []
    counter = {"done": 0, "total": len(batch_sizes) * len(layer_list)}

    def run(batches: torch.Tensor) -> dict[_Setting, Samples]:
        samples: dict[_Setting, Samples] = {s: [] for s in settings}
        for layer in layer_list:
            logits, spec, mass = inputs[layer]
            vanilla_ids, _ = route_batches(logits, spec, None, batches)
            layer_mass = None if mass is None else mass[batches]
            for setting in settings:
                ids, weights = route_step(route_batches, logits, spec, setting.cfg, batches, dp,
                                          setting.union or "global")
                routed = LayerBatches(layer, ids, weights, vanilla_ids, layer_mass, spec.num_experts)
                values = core_metrics(routed)
                for metric in extra:
                    values.update(metric(routed))
                samples[setting].append(values)
            counter["done"] += 1
            if progress is not None:
                progress(counter["done"], counter["total"])
        return samples

    for b, batches in batch_plan.items():
        distinct = distinct_batches(trace, b * dp, mode) if mode == "lockstep" else None
        if batches.shape[0] < 2:
            raise ValueError(f"lockstep batch size {b}{f' x dp={dp}' if dp > 1 else ''}: trace {trace.name!r} "
                             f"holds {batches.shape[0]} distinct batch, an interval needs two; use a smaller "
                             "batch size or mode 'mixed'")
        samples = run(batches)
        for _ in range(8 if auto else 0):  # the estimate of the needed count settles in one or two rounds
            needed = batches_for_precision(samples, precision, max_batches)
            if needed <= batches.shape[0]:
                break
            more = step_batches(make_batches, trace, b, dp, mode, needed - batches.shape[0], generator,
                                exclude=batches)
            if more.shape[0] == 0:  # every distinct lockstep batch is drawn
                break
            counter["total"] += len(layer_list)
            added = run(more)
            samples = {s: extend(samples[s], added[s]) for s in settings}
            batches = torch.cat([batches, more])
        for setting in settings:
            base = {"trace": trace.name, "mode": mode, "policy": setting.policy, "k0": setting.k0, "batch_size": b}
            if distinct is not None:
                base["distinct_batches"] = distinct
            if dp > 1:
                base.update(dp=dp, union=setting.union)
            row = summarise(base, samples[setting], layer_list, cost, b, precision if auto else None)
            rows.append({**row, "note": note})
    add_ratios(rows, seed)
    return rows


def _cost_model(trace: Trace, model_preset: str | ModelPreset | None, gpu: str | None, tp: int, ep: int | None):
    from oea.presets import get_gpu_preset, get_model_preset
    from oea.sim.costmodel import CostModel

    if isinstance(model_preset, str):
        model_preset = get_model_preset(model_preset)  # validate the name even without a GPU
    if gpu is None:
        return None
    name = model_preset or trace.meta.get("model_preset")
    if not name:
        raise ValueError(f"trace {trace.name!r} names no model preset; pass model_preset "
                         f"(--model-preset or --model-preset-file) to predict latency")
    preset = name if isinstance(name, ModelPreset) else get_model_preset(name)
    return CostModel(preset, get_gpu_preset(gpu), tp=tp, ep=ep or 1)
