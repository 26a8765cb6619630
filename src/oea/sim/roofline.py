"""``oea roofline``: the theoretical-maximum analysis of OEA for one model on one accelerator.

For each batch size B it states:

* arithmetic intensity of the MoE layer (expert FLOPs per weight byte, 2·B·k / (T·bytes_per_weight))
  against the accelerator's ridge point, hence whether decode is memory- or compute-bound;
* expected active experts T under uniform routing, N(1 - (1 - k/N)^B), and from a bundled real trace
  for vanilla and OEA (scaled to the model: T_model = T_uniform,model × T_trace / T_uniform,trace
  when the trace's N, k differ from the model's);
* predicted MoE-layer latency for vanilla and OEA, and OEA's predicted gain;
* the whole decode step (``oea.sim.step``: attention, KV cache, dense and shared MLPs, routed experts, the TP
  all-reduces over the chosen interconnect, the output head; ``step_*`` fields), the routed experts' share of
  it and OEA's predicted step gain, which is what a TPOT measurement can show. ``None`` with ``step_note``
  where the preset has no decoder shape or ``ep`` > 1.

Trace T values are means over simulated batches and carry their 95% intervals (``*_ci``); the
latencies' intervals are the cost model at T's bounds, and the gain's interval comes from the
interval of OEA's T / vanilla T (paired by batch), with vanilla T at its mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oea.presets import ModelPreset, get_gpu_preset, get_model_preset
from oea.sim.costmodel import CostModel, check_tp, uniform_active_experts, uniform_max_device_active
from oea.sim.step import Interconnect, StepModel, resolve_interconnect, with_interconnect

DEFAULT_CONTEXT_LEN = 2048
STEP_TERMS: tuple[str, ...] = ("attention", "kv_cache", "dense_mlp", "shared_experts", "all_reduce", "lm_head")


def trace_active_experts(
    trace_name: str,
    batch_sizes: Sequence[int],
    k0s: Sequence[int],
    num_batches: int,
    seed: int,
    ep: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[tuple[str, int | None, int], dict[str, Any]], Any]:
    """Vanilla and OEA mean T (and busiest-device T for ``ep`` > 1) on a bundled trace, mixed mode.

    Returns ``({(policy, k0, B): {"T": ..., "T_device": ..., "slots": ...}}, trace)``.
    """
    from oea.sim.simulate import simulate
    from oea.traces import load_trace

    trace = load_trace(trace_name)
    usable = [b for b in batch_sizes if b <= trace.num_tokens]
    rows = simulate(trace, policies=("vanilla", "oea"), k0s=k0s, batch_sizes=usable, mode="mixed", seed=seed,
                    num_batches=num_batches, ep=ep if ep > 1 and trace.spec.num_experts % ep == 0 else None,
                    progress=progress)
    return table_from_rows(rows), trace


def table_from_rows(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int | None, int], dict[str, Any]]:
    """``simulate`` rows -> ``{(policy, k0, B): {"T", "T_ci", "ratio_ci", "T_device", "experts_per_token"}}``."""
    return {
        (row["policy"], row["k0"], row["batch_size"]): {
            "T": row["mean_active_experts"],
            "T_ci": row.get("mean_active_experts_ci"),
            "ratio_ci": row.get("active_ratio_vs_vanilla_ci"),
            "T_device": row.get("max_device_active_experts"),
            "experts_per_token": row["mean_experts_per_token"],
        }
        for row in rows
    }


def roofline(
    model: str | ModelPreset,
    gpu: str,
    tp: int = 1,
    ep: int = 1,
    batch_sizes: Sequence[int] = (1, 4, 16, 64, 256, 1024),
    k0s: Sequence[int] = (3, 5),
    trace: str | None = "qwen3-30b-a3b",
    num_batches: int = 16,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    context_len: int = DEFAULT_CONTEXT_LEN,
    interconnect: Interconnect | None = None,
) -> list[dict[str, Any]]:
    """One row per batch size (fields listed in the module docstring; ``None`` where not applicable).

    ``model`` is a built-in preset name or a ``ModelPreset`` (e.g. ``load_model_preset_file(...).model``);
    ``context_len`` the cached tokens per decode token, ``interconnect`` the all-reduce's link (default: the
    accelerator preset's own). Raises ``ValueError`` naming the flag for batch sizes < 1, k0 outside
    1..top_k, tp or ep < 1, a tp the model's dimensions do not divide, a context length < 1.
    """
    preset = model if isinstance(model, ModelPreset) else get_model_preset(model)
    check_roofline_arguments(preset, tp, ep, batch_sizes, k0s)
    if not isinstance(context_len, int) or isinstance(context_len, bool) or context_len < 1:
        raise ValueError(f"--context-len must be an integer >= 1, got {context_len!r}")
    table: dict[tuple[str, int | None, int], dict[str, Any]] = {}
    trace_ref = None
    if trace is not None:
        table, trace_obj = trace_active_experts(trace, batch_sizes, k0s, num_batches, seed, ep, progress)
        trace_ref = TraceRef(trace_obj.name, trace_obj.spec.num_experts, trace_obj.spec.top_k)
    return roofline_from_table(model, gpu, tp, ep, batch_sizes, k0s, table, trace_ref, context_len=context_len,
                               interconnect=interconnect)


def check_roofline_arguments(
    preset: ModelPreset, tp: int, ep: int, batch_sizes: Sequence[int], k0s: Sequence[int]
) -> None:
    """Batch sizes >= 1, k0 in 1..top_k of ``preset``, tp and ep >= 1, tp a size the model's dimensions
    divide (``allowed_tp_sizes``); errors name the flag and the allowed values."""
    for name, value in (("tp", tp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be an integer >= 1, got {value!r}")
    check_tp(preset, tp, "--tp")
    bad = [b for b in batch_sizes if not isinstance(b, int) or b < 1]
    if bad or not batch_sizes:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {list(batch_sizes)}")
    bad = [k0 for k0 in k0s if not isinstance(k0, int) or not 1 <= k0 <= preset.top_k]
    if bad:
        raise ValueError(f"--k0 must be integers in 1..{preset.top_k} (top_k of {preset.name}), got {bad}")


@dataclass(frozen=True)
class TraceRef:
    """Which trace a T table came from: name, N and k (for scaling T to another model)."""

    name: str
    num_experts: int
    top_k: int


def roofline_from_table(
    model: str | ModelPreset,
    gpu: str,
    tp: int,
    ep: int,
    batch_sizes: Sequence[int],
    k0s: Sequence[int],
    table: dict[tuple[str, int | None, int], dict[str, Any]],
    trace: TraceRef | None,
    *,
    context_len: int = DEFAULT_CONTEXT_LEN,
    interconnect: Interconnect | None = None,
) -> list[dict[str, Any]]:
    """``roofline`` rows from an existing T table ``{(policy, k0, B): {"T", "T_device",
    "experts_per_token"}}`` (e.g. rows already simulated by ``oea report``)."""
    preset = model if isinstance(model, ModelPreset) else get_model_preset(model)
    accelerator = get_gpu_preset(gpu)
    link = interconnect or (resolve_interconnect(accelerator) if accelerator.measured else None)
    cost = CostModel(preset, with_interconnect(accelerator, link), tp=tp, ep=ep)
    step, step_note = _step_model(cost, context_len)
    n, k = preset.num_experts, preset.top_k
    rows = []
    for b in batch_sizes:
        uniform = uniform_active_experts(n, k, b)
        uniform_device = uniform_max_device_active(n, k, b, ep) if ep > 1 else None
        slots = float(b * k)
        row: dict[str, Any] = {
            "model": preset.name, "gpu": cost.gpu.name, "tp": tp, "ep": ep, "batch_size": b,
            "expert_load_us": cost.expert_load_us, "token_compute_us": cost.token_compute_us,
            "ridge_point_flops_per_byte": cost.ridge_point,
            "uniform_active_experts": uniform,
            "uniform_arithmetic_intensity": cost.arithmetic_intensity(uniform, slots),
            "uniform_latency_us": cost.layer_latency_us(uniform, slots, b, uniform_device),
            "trace": trace.name if trace is not None else None,
            "context_len": context_len, "interconnect": None if link is None else link.name,
            "interconnect_GBps": None if link is None else link.GBps,
            "interconnect_latency_us": None if link is None else link.latency_us, "step_note": step_note,
        }
        vanilla = _scaled(table, ("vanilla", None, b), trace, n, k, b)
        row["trace_vanilla_active_experts"] = vanilla
        row["trace_vanilla_active_experts_ci"] = _scaled_ci(table, ("vanilla", None, b), trace, n, k, b)
        active = vanilla if vanilla is not None else uniform
        row["arithmetic_intensity"] = cost.arithmetic_intensity(active, slots)
        row["bound"] = "compute" if row["arithmetic_intensity"] >= cost.ridge_point else "memory"
        row["memory_us"] = cost.memory_us(active / ep)
        row["compute_us"] = cost.compute_us(slots / ep)
        vanilla_device = _device(table, ("vanilla", None, b), ep, trace, n) if vanilla is not None else \
            uniform_device
        row["latency_vanilla_us"] = cost.layer_latency_us(active, slots, b, vanilla_device)
        row["latency_vanilla_us_ci"] = _latency_ci(cost, row["trace_vanilla_active_experts_ci"], slots, b, ep)
        _step_vanilla(row, step, b, active, slots, row["trace_vanilla_active_experts_ci"])
        for k0 in k0s:
            oea_t = _scaled(table, ("oea", k0, b), trace, n, k, b)
            row[f"oea_k0_{k0}_active_experts"] = oea_t
            row[f"oea_k0_{k0}_active_experts_ci"] = _scaled_ci(table, ("oea", k0, b), trace, n, k, b)
            for name in (f"latency_oea_k0_{k0}_us", f"predicted_gain_k0_{k0}", f"step_latency_oea_k0_{k0}_us",
                         f"predicted_step_gain_k0_{k0}"):
                row[name] = row[f"{name}_ci"] = None
            if oea_t is None or trace is None:
                continue
            oea_slots = b * table[("oea", k0, b)]["experts_per_token"] * k / trace.top_k
            device = _device(table, ("oea", k0, b), ep, trace, n)
            latency = cost.layer_latency_us(oea_t, oea_slots, b, device)
            row[f"latency_oea_k0_{k0}_us"] = latency
            row[f"latency_oea_k0_{k0}_us_ci"] = _latency_ci(cost, row[f"oea_k0_{k0}_active_experts_ci"],
                                                            oea_slots, b, ep)
            row[f"predicted_gain_k0_{k0}"] = 1.0 - latency / row["latency_vanilla_us"]
            ratio_ci = table[("oea", k0, b)].get("ratio_ci")
            if ratio_ci is not None and device is None:
                gains = [1.0 - cost.layer_latency_us(r * active, oea_slots, b, None) / row["latency_vanilla_us"]
                         for r in ratio_ci]
                row[f"predicted_gain_k0_{k0}_ci"] = [min(gains), max(gains)]
            if step is not None:
                _step_oea(row, step, k0, b, oea_t, oea_slots, None if device is not None else ratio_ci, active,
                          row[f"oea_k0_{k0}_active_experts_ci"])
        rows.append(row)
    return rows


def _scaled(table, key, trace: TraceRef | None, n: int, k: int, b: int) -> float | None:
    entry = table.get(key)
    if entry is None or trace is None:
        return None
    if (trace.num_experts, trace.top_k) == (n, k):
        return entry["T"]
    return uniform_active_experts(n, k, b) * entry["T"] / uniform_active_experts(trace.num_experts, trace.top_k, b)


def _scaled_ci(table, key, trace: TraceRef | None, n: int, k: int, b: int) -> list[float] | None:
    entry = table.get(key)
    if entry is None or trace is None or entry.get("T_ci") is None:
        return None
    scale = 1.0 if (trace.num_experts, trace.top_k) == (n, k) else (
        uniform_active_experts(n, k, b) / uniform_active_experts(trace.num_experts, trace.top_k, b))
    return [scale * bound for bound in entry["T_ci"]]


def _latency_ci(cost: CostModel, t_ci: list[float] | None, slots: float, b: int, ep: int) -> list[float] | None:
    """Latency at T's bounds (latency grows with T); ``None`` without an interval or under EP (the
    busiest device's count has its own interval)."""
    if t_ci is None or ep > 1:
        return None
    return [cost.layer_latency_us(t, slots, b, None) for t in t_ci]


def _device(table, key, ep: int, trace: TraceRef | None, n: int) -> float | None:
    if ep == 1:
        return None
    entry = table.get(key)
    if entry is not None and entry.get("T_device") is not None and trace is not None and trace.num_experts == n:
        return entry["T_device"]
    return None  # the cost model falls back to T / ep (balanced)


def _step_model(cost: CostModel, context_len: int) -> tuple[StepModel | None, str | None]:
    """The step model for ``cost``, or ``None`` and why not (no decoder shape, expert parallelism)."""
    if cost.model.decoder is None:
        return None, (f"no step-level figures: preset {cost.model.name!r} has no decoder shape (attention, dense "
                      "layers, vocabulary)")
    if cost.ep > 1:
        return None, "no step-level figures: the step model covers tensor parallelism only (ep = 1)"
    return StepModel(cost, context_len), None


def _step_vanilla(row: dict[str, Any], step: StepModel | None, b: int, active: float, slots: float,
                  t_ci: list[float] | None) -> None:
    """``step_<term>_us`` for every part, ``step_routed_experts_vanilla_us``, ``step_latency_vanilla_us`` (with
    ``_ci`` at T's bounds) and ``moe_share_of_step`` (the routed experts' share of the vanilla step)."""
    if step is None:
        for name in ("step_routed_experts_vanilla_us", "step_latency_vanilla_us", "step_latency_vanilla_us_ci",
                     "moe_share_of_step", *(f"step_{term}_us" for term in STEP_TERMS)):
            row[name] = None
        return
    for term, value in step.terms_us(b).items():
        row[f"step_{term}_us"] = value
    routed = step.routed_experts_us(active, slots)
    row["step_routed_experts_vanilla_us"] = routed
    row["step_latency_vanilla_us"] = step.step_us(b, active, slots)
    row["step_latency_vanilla_us_ci"] = None if t_ci is None else [step.step_us(b, t, slots) for t in t_ci]
    row["moe_share_of_step"] = routed / row["step_latency_vanilla_us"]


def _step_oea(row: dict[str, Any], step: StepModel, k0: int, b: int, oea_t: float, oea_slots: float,
              ratio_ci: list[float] | None, vanilla_t: float, t_ci: list[float] | None) -> None:
    """``step_latency_oea_k0_<k0>_us`` (``_ci`` at T's bounds) and ``predicted_step_gain_k0_<k0>`` (interval
    from the interval of OEA's T / vanilla T, as the layer gain's)."""
    vanilla = row["step_latency_vanilla_us"]
    latency = step.step_us(b, oea_t, oea_slots)
    row[f"step_latency_oea_k0_{k0}_us"] = latency
    if t_ci is not None:
        row[f"step_latency_oea_k0_{k0}_us_ci"] = [step.step_us(b, t, oea_slots) for t in t_ci]
    row[f"predicted_step_gain_k0_{k0}"] = 1.0 - latency / vanilla
    if ratio_ci is not None:
        gains = [1.0 - step.step_us(b, r * vanilla_t, oea_slots) / vanilla for r in ratio_ci]
        row[f"predicted_step_gain_k0_{k0}_ci"] = [min(gains), max(gains)]
