"""What-if simulation: replay routing traces through policies, predict MoE-layer latency.

    rows = oea.sim.simulate("qwen3-30b-a3b", policies=["vanilla", "oea"], k0s=[3], batch_sizes=[16])
"""

from oea.presets import (
    MODEL_PRESETS,
    GpuPreset,
    ModelPreset,
    get_gpu_preset,
    get_model_preset,
    gpu_preset_names,
    model_preset_names,
)
from oea.sim.costmodel import CostModel, uniform_active_experts
from oea.sim.simulate import (
    LayerBatches,
    Metric,
    batch_expert_load,
    ep_metric,
    make_batches,
    max_device_active,
    router_inputs,
    simulate,
)

__all__ = [
    "MODEL_PRESETS",
    "CostModel",
    "GpuPreset",
    "LayerBatches",
    "Metric",
    "ModelPreset",
    "batch_expert_load",
    "ep_metric",
    "get_gpu_preset",
    "get_model_preset",
    "gpu_preset_names",
    "make_batches",
    "max_device_active",
    "model_preset_names",
    "router_inputs",
    "simulate",
    "uniform_active_experts",
]
