"""Step-level roofline: one decode step of the whole model on one tensor-parallel rank, term by term.

OEA shrinks only the routed experts' weight reads. What a user measures (TPOT) is the whole decode step,
so the gain they can see is the MoE-layer gain times the routed experts' share of the step. For a batch of
B decode tokens, each with C tokens of context, on ``tp`` ranks (all figures per rank, µs)::

    step = L·(attention + kv_cache) + L_dense·dense_mlp + L_moe·(shared_experts + routed_experts)
           + 2·L·all_reduce + lm_head

    stream(P, bytes)  = P·bytes / BW + 2·B·P / peak(bytes)          P weights read once, B tokens through them
    attention         = stream(P_attn / rank, weight_bytes)          P_attn: DecoderShape.attention_params_per_device
    kv_cache          = B·C·(kv_values·kv_bytes / BW + attn_flops / peak(kv_bytes))   per cached token and layer
    dense_mlp         = stream(3·H·I_dense / tp, weight_bytes)
    shared_experts    = stream(3·H·I_shared / tp, weight_bytes)
    routed_experts    = fixed + b·T + a·S                            the MoE cost model (oea.sim.costmodel)
    all_reduce        = latency + 2(tp-1)/tp · B·H·2 bytes / link    after attention and after the MLP/MoE
    lm_head           = stream(V·H / tp, weight_bytes)

with BW the accelerator's memory bandwidth, peak its dense tensor-core peak for that weight format, b and a
the routed experts' per-expert load and per-token-slot compute times, T the active experts and S the token
slots. Assumptions: datasheet peaks; memory and compute times add (no overlap), as in the MoE cost model;
only the routed experts carry a fixed per-layer overhead (the paper's fit), the other parts none, and the
all-reduce is the latency floor plus ring traffic. The other parts' times are therefore optimistic, so the
routed experts' share, and the step gain derived from it, is an upper bound. Norms, rotary, the router's gate,
sampling and the embedding lookup are not counted; DSA's indexer (GLM-5) is not modelled. Step-level figures
need ``ep == 1`` and a preset with a ``DecoderShape``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from oea.presets import GpuPreset
from oea.presets.decoder_shapes import DecoderShape
from oea.sim.costmodel import CostModel

ACTIVATION_BYTES = 2.0  # bf16 activations on the all-reduce


@dataclass(frozen=True)
class Interconnect:
    """A device-to-device link for the TP all-reduce.

    Attributes:
        name: preset key (or a description of where the figures came from).
        GBps: per-direction bandwidth of one device's link, GB/s.
        latency_us: the latency floor of one all-reduce, µs.
        source: where the numbers come from.
    """

    name: str
    GBps: float
    latency_us: float
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.GBps, (int, float)) or not 0 < self.GBps < 1e6:
            raise ValueError(f"--interconnect-gbps must be a number > 0 (GB/s per direction), got {self.GBps!r}")
        if not isinstance(self.latency_us, (int, float)) or not 0 <= self.latency_us < 1e6:
            raise ValueError(f"--interconnect-latency-us must be a number >= 0, got {self.latency_us!r}")


_FLOOR = ("latency floor per all-reduce: an assumption (the same as the accelerator presets'); measure yours "
          "with nccl-tests all_reduce_perf at B·hidden·2 bytes and pass --interconnect-latency-us")
INTERCONNECTS: dict[str, Interconnect] = {
    ic.name: ic
    for ic in (
        Interconnect("pcie-gen4", 32.0, 10.0, f"PCIe 4.0 x16: 16 GT/s x 16 lanes = ~32 GB/s per direction; {_FLOOR}"),
        Interconnect("pcie-gen5", 64.0, 10.0, "PCIe 5.0 x16: 32 GT/s x 16 lanes = ~64 GB/s per direction (about "
                     f"54 GB/s measured peer-to-peer on RTX PRO 6000 servers, less across NUMA nodes); {_FLOOR}"),
        Interconnect("nvlink4", 450.0, 5.0, f"NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional; {_FLOOR}"),
        Interconnect("nvlink5", 900.0, 5.0, f"NVLink 5 (B200): 1.8 TB/s bidirectional; {_FLOOR}"),
    )
}


def interconnect_names() -> list[str]:
    return sorted(INTERCONNECTS)


def resolve_interconnect(gpu: GpuPreset, name: str | None = None, gbps: float | None = None,
                         latency_us: float | None = None) -> Interconnect | None:
    """The link the all-reduce uses: the preset ``name`` (else the accelerator preset's own link), with
    ``gbps`` / ``latency_us`` overriding its figures. ``None`` when the accelerator has no link and none is given."""
    if name is not None:
        if name not in INTERCONNECTS:
            raise ValueError(f"--interconnect must be one of {interconnect_names()}, got {name!r}")
        base = INTERCONNECTS[name]
    elif gpu.interconnect_GBps is not None:
        base = Interconnect(f"{gpu.name} preset", gpu.interconnect_GBps, gpu.interconnect_latency_us,
                            f"the {gpu.name} accelerator preset's link ({gpu.source})")
    elif gbps is not None:
        base = Interconnect("given", gbps, latency_us or 0.0, "--interconnect-gbps")
    else:
        return None
    if gbps is None and latency_us is None:
        return base
    return Interconnect(base.name + " (overridden)", base.GBps if gbps is None else gbps,
                        base.latency_us if latency_us is None else latency_us, base.source)


def with_interconnect(gpu: GpuPreset, link: Interconnect | None) -> GpuPreset:
    """``gpu`` with its all-reduce link replaced by ``link`` (unchanged for ``None``)."""
    if link is None:
        return gpu
    return dataclasses.replace(gpu, interconnect_GBps=link.GBps, interconnect_latency_us=link.latency_us)


@dataclass(frozen=True)
class StepModel:
    """One decode step of ``cost.model`` (which must carry a ``DecoderShape``) on one of ``cost.tp`` ranks.

    Attributes:
        cost: the routed experts' cost model; its accelerator (with the chosen link) and ``tp`` are the step's.
        context_len: C, cached tokens each decode token attends to.
    """

    cost: CostModel
    context_len: int

    def __post_init__(self) -> None:
        if self.cost.model.decoder is None:
            raise ValueError(f"model preset {self.cost.model.name!r} has no decoder shape (attention, dense layers, "
                             "vocabulary): no step-level prediction")
        if self.cost.ep != 1:
            raise ValueError(f"the step-level model covers tensor parallelism only, got ep={self.cost.ep}")
        if not isinstance(self.context_len, int) or isinstance(self.context_len, bool) or self.context_len < 1:
            raise ValueError(f"--context-len must be an integer >= 1, got {self.context_len!r}")

    @property
    def decoder(self) -> DecoderShape:
        assert self.cost.model.decoder is not None
        return self.cost.model.decoder

    def _stream_us(self, params: float, batch_size: int, bytes_per_weight: float) -> float:
        """``params`` weights read once from memory plus ``batch_size`` tokens' 2·params FLOPs through them."""
        gpu = self.cost.gpu
        return params * bytes_per_weight / (self.cost.bandwidth_GBps * 1e3) + 2.0 * batch_size * params / (
            gpu.peak_tflops(bytes_per_weight) * 1e6)

    def terms_us(self, batch_size: int) -> dict[str, float]:
        """Every part of the step except the routed experts, summed over the layers it occurs in (µs)."""
        d, h, tp, b = self.decoder, self.cost.model.hidden_size, self.cost.tp, batch_size
        gpu = self.cost.gpu
        cached = b * self.context_len
        kv_one_layer = cached * d.kv_values_per_token(tp) * d.kv_bytes / (self.cost.bandwidth_GBps * 1e3) + \
            cached * d.attention_flops_per_context_token(tp) / (gpu.peak_tflops(d.kv_bytes) * 1e6)
        return {
            "attention": d.num_layers * self._stream_us(d.attention_params_per_device(h, tp), b, d.weight_bytes),
            "kv_cache": d.num_layers * kv_one_layer,
            "dense_mlp": d.num_dense_layers * self._stream_us(3 * h * d.dense_intermediate_size / tp, b,
                                                              d.weight_bytes),
            "shared_experts": d.num_moe_layers * self._stream_us(3 * h * d.shared_intermediate_size / tp, b,
                                                                 d.weight_bytes),
            "all_reduce": 2 * d.num_layers * self.cost.allreduce_us(b),
            "lm_head": self._stream_us(d.vocab_size * h / tp, b, d.weight_bytes),
        }

    def routed_experts_us(self, active_experts: float, token_slots: float) -> float:
        """All MoE layers' routed experts: L_moe·(fixed + b·T + a·S), the all-reduce counted in ``terms_us``."""
        one = self.cost.gpu.launch_overhead_us + self.cost.memory_us(active_experts) + \
            self.cost.compute_us(token_slots)
        return self.decoder.num_moe_layers * one

    def step_us(self, batch_size: int, active_experts: float, token_slots: float) -> float:
        """The whole decode step with T active experts and S token slots per MoE layer (µs)."""
        return sum(self.terms_us(batch_size).values()) + self.routed_experts_us(active_experts, token_slots)
