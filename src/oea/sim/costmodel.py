"""Latency cost model of one decode-time MoE layer (paper §3.1, ``oea-algorithm.md`` §10).

One expert on n tokens costs f(n) = a·n + b for n > 0 (f(0) = 0), so a layer with T active experts
and S = Σ tokens-per-expert token slots costs ``fixed + b·T + a·S``:

* b (µs per active expert) = expert bytes / memory bandwidth: loading the expert's weights once;
* a (µs per token slot) = expert FLOPs per token / tensor-core peak;
* fixed = the accelerator's per-layer overhead (launches, routing, gather/scatter).

Parallel splits:

* tensor parallel ``tp``: every device holds 1/tp of every expert, so b and a shrink by tp and an
  all-reduce of the [B, hidden] output is added (latency floor + ring traffic);
* expert parallel ``ep``: devices hold N/ep whole experts; the layer waits for the busiest device,
  so latency follows the *maximum* per-device T (``max_device_active``), plus an all-to-all
  dispatch/combine of the token activations.

This is a bandwidth/FLOP roofline at datasheet peaks: real kernels reach less, so predicted times
are optimistic lower bounds; ratios (OEA vs vanilla) are the robust output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oea.presets import GpuPreset, ModelPreset


@dataclass(frozen=True)
class CostModel:
    """Per-layer MoE latency of ``model`` on ``gpu`` with ``tp``-way tensor and ``ep``-way expert parallelism.

    Attributes:
        model: the model preset (expert shape and weight format).
        gpu: the accelerator preset (must be measured; ``cpu`` needs the layer benchmark's fit).
        tp: tensor-parallel degree (each device holds 1/tp of every expert).
        ep: expert-parallel degree (each device holds num_experts/ep whole experts).
        activation_bytes: bytes per activation element on the wire (2 = bf16).
    """

    model: ModelPreset
    gpu: GpuPreset
    tp: int = 1
    ep: int = 1
    activation_bytes: float = 2.0

    def __post_init__(self) -> None:
        check_parallel(self.model, self.tp, self.ep)
        if not self.gpu.measured:
            raise ValueError(f"gpu preset {self.gpu.name!r} is unmeasured: {self.gpu.source}")
        if (self.tp > 1 or self.ep > 1) and self.gpu.interconnect_GBps is None:
            raise ValueError(f"gpu preset {self.gpu.name!r} has no interconnect bandwidth; use tp=1 and ep=1")

    @property
    def bandwidth_GBps(self) -> float:
        assert self.gpu.hbm_bandwidth_GBps is not None
        return self.gpu.hbm_bandwidth_GBps

    @property
    def peak_tflops(self) -> float:
        """The tensor-core peak of the model's weight format on this accelerator."""
        return self.gpu.peak_tflops(self.model.bytes_per_weight)

    @property
    def expert_load_us(self) -> float:
        """b: µs to stream one active expert's (per-device share of) weights from memory."""
        return self.model.expert_bytes / self.tp / (self.bandwidth_GBps * 1e3)

    @property
    def token_compute_us(self) -> float:
        """a: µs of tensor-core time per token slot (one token through one expert, per device)."""
        return self.model.expert_flops_per_token / self.tp / (self.peak_tflops * 1e6)

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte at which compute time equals memory time (peak FLOP/s ÷ bandwidth)."""
        return self.peak_tflops * 1e12 / (self.bandwidth_GBps * 1e9)

    def arithmetic_intensity(self, active_experts: float, token_slots: float) -> float:
        """Expert FLOPs per weight byte loaded: 2·S / (T·bytes_per_weight) (independent of tp)."""
        if active_experts <= 0:
            return 0.0
        return 2.0 * token_slots / (active_experts * self.model.bytes_per_weight)

    def allreduce_us(self, batch_size: int) -> float:
        """TP all-reduce of the [B, hidden] layer output: latency floor + ring traffic 2(tp-1)/tp·bytes."""
        if self.tp == 1:
            return 0.0
        assert self.gpu.interconnect_GBps is not None
        volume = batch_size * self.model.hidden_size * self.activation_bytes
        return self.gpu.interconnect_latency_us + 2 * (self.tp - 1) / self.tp * volume / (
            self.gpu.interconnect_GBps * 1e3
        )

    def alltoall_us(self, token_slots: float) -> float:
        """EP dispatch + combine of the token slots' activations that leave the device ((ep-1)/ep of them)."""
        if self.ep == 1:
            return 0.0
        assert self.gpu.interconnect_GBps is not None
        volume = token_slots * self.model.hidden_size * self.activation_bytes * (self.ep - 1) / self.ep
        return 2 * (self.gpu.interconnect_latency_us + volume / (self.gpu.interconnect_GBps * 1e3))

    def memory_us(self, active_experts: float) -> float:
        """b·T: weight-loading time of the (busiest device's) active experts."""
        return self.expert_load_us * active_experts

    def compute_us(self, token_slots: float) -> float:
        """a·S: tensor-core time of the token slots."""
        return self.token_compute_us * token_slots

    def layer_latency_us(
        self,
        active_experts: float,
        token_slots: float,
        batch_size: int | None = None,
        max_device_active: float | None = None,
    ) -> float:
        """Predicted latency of one MoE layer call, µs.

        Args:
            active_experts: T, distinct experts with at least one token in the batch.
            token_slots: S, token-expert pairs (B·k for vanilla routing).
            batch_size: B, for the TP all-reduce (default: S / top_k).
            max_device_active: EP only: the busiest device's active experts; default T/ep
                (perfectly balanced, optimistic).
        """
        batch = batch_size if batch_size is not None else max(1, round(token_slots / self.model.top_k))
        experts = active_experts
        slots = token_slots
        if self.ep > 1:
            experts = max_device_active if max_device_active is not None else active_experts / self.ep
            slots = token_slots * (experts / active_experts) if active_experts > 0 else 0.0
        total = self.gpu.launch_overhead_us + self.memory_us(experts) + self.compute_us(slots)
        return total + self.allreduce_us(batch) + self.alltoall_us(token_slots)


def tp_split_dimensions(model: ModelPreset) -> dict[str, int]:
    """The widths tensor parallelism splits over its ranks (each must be a multiple of tp): the routed
    experts' intermediate size, and where the preset describes the decoder, the attention heads and the
    dense and shared MLPs' widths."""
    dims = {"moe_intermediate_size": model.moe_intermediate_size}
    decoder = model.decoder
    if decoder is not None:
        dims["num_attention_heads"] = decoder.num_heads
        if decoder.num_dense_layers:
            dims["dense_intermediate_size"] = decoder.dense_intermediate_size
        if decoder.shared_intermediate_size:
            dims["shared_intermediate_size"] = decoder.shared_intermediate_size
    return dims


def allowed_tp_sizes(model: ModelPreset) -> list[int]:
    """Every tp that divides ``tp_split_dimensions`` (GQA: and divides the kv heads or is a multiple of them,
    which engines then replicate)."""
    common = math.gcd(*tp_split_dimensions(model).values())
    sizes = [tp for tp in range(1, common + 1) if common % tp == 0]
    decoder = model.decoder
    if decoder is not None and decoder.attention == "gqa":
        kv = decoder.num_kv_heads
        sizes = [tp for tp in sizes if kv % tp == 0 or tp % kv == 0]
    return sizes


def check_tp(model: ModelPreset, tp: int, flag: str = "tp") -> None:
    """Raises ``ValueError`` naming ``flag``, the dimensions and the allowed sizes when ``tp`` does not split
    the model (``allowed_tp_sizes``)."""
    allowed = allowed_tp_sizes(model)
    if tp not in allowed:
        dims = ", ".join(f"{name}={value}" for name, value in tp_split_dimensions(model).items())
        shown = [size for size in allowed if size <= 64]
        more = "" if len(shown) == len(allowed) else f" (or a larger one of the {len(allowed)} that divide them)"
        raise ValueError(f"{flag} must split {model.name}'s {dims} evenly: one of {shown}{more}, got {tp}")


def check_parallel(model: ModelPreset, tp: object, ep: object, tp_name: str = "tp", ep_name: str = "ep") -> None:
    """``ValueError`` naming ``tp_name`` / ``ep_name`` (a field, or the command-line flag that set it) unless tp and
    ep are integers >= 1, not both > 1, ep divides the model's experts and tp splits it (``check_tp``)."""
    for name, value in ((tp_name, tp), (ep_name, ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    assert isinstance(tp, int) and isinstance(ep, int)
    if tp > 1 and ep > 1:
        raise ValueError(f"combine either {tp_name} or {ep_name} with the cost model, not both; got "
                         f"{tp_name} {tp}, {ep_name} {ep}")
    if model.num_experts % ep:
        raise ValueError(f"{ep_name} must divide num_experts={model.num_experts} ({model.name}), got {ep}")
    check_tp(model, tp, tp_name)


def uniform_active_experts(num_experts: int, top_k: int, batch_size: int) -> float:
    """E[T] when every token's top-k is a uniform random k-subset: N(1 - (1 - k/N)^B)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch_size)


def uniform_max_device_active(num_experts: int, top_k: int, batch_size: int, ep: int) -> float:
    """E[max over ep contiguous blocks of active experts] under uniform routing (exact per-block
    distribution is approximated by the mean per block; the max adds the block's binomial spread)."""
    per_block = num_experts // ep
    p_active = 1.0 - (1.0 - top_k / num_experts) ** batch_size
    mean = per_block * p_active
    spread = (per_block * p_active * (1 - p_active)) ** 0.5
    if ep == 1:
        return mean
    # expected max of ep roughly normal block counts: mean + spread·sqrt(2·ln ep)
    return min(float(per_block), mean + spread * math.sqrt(2.0 * math.log(ep)))
