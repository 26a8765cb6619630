"""The presets of ``oea.presets`` under the import path user code has for them (``oea.sim.presets``).

The presets are pure data and live on the foundation floor (``oea.presets``), where the traces, models and
bench tools read them without importing the simulator. The project itself imports ``oea.presets``.
"""

from oea.presets import (
    CPU_FIT_PATH,
    MODEL_PRESETS,
    MXFP4_BYTES,
    NVFP4_BYTES,
    GpuPreset,
    LayerFit,
    ModelPreset,
    cpu_preset,
    get_gpu_preset,
    get_model_preset,
    gpu_preset_names,
    gpu_presets,
    load_cpu_fit,
    model_preset_names,
)

__all__ = ["CPU_FIT_PATH", "MODEL_PRESETS", "MXFP4_BYTES", "NVFP4_BYTES", "GpuPreset", "LayerFit", "ModelPreset",
           "cpu_preset", "get_gpu_preset", "get_model_preset", "gpu_preset_names", "gpu_presets", "load_cpu_fit",
           "model_preset_names"]
