"""Model and accelerator presets for the what-if simulator and the latency cost model.

Model shapes come from each model's Hugging Face ``config.json`` (URLs in ``source``); accelerator
figures from vendor datasheets (dense tensor-core peaks, i.e. the sparse marketing figure / 2).
The ``cpu`` accelerator is *this* machine, described by the layer benchmark's measured fit in
``oea/presets/data/cpu_layer_fit.json``; until that file exists the preset says it is unmeasured.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Literal

from oea.presets.decoder_shapes import DECODER_SHAPES, DecoderShape

Scoring = Literal["softmax", "sigmoid"]

CPU_FIT_PATH = pathlib.Path(__file__).parent / "data" / "cpu_layer_fit.json"

# Packed 4-bit formats, including their block scales:
NVFP4_BYTES = 0.5625  # 4-bit E2M1 + one FP8 (E4M3) scale per 16 values = 4.5 bits
MXFP4_BYTES = 0.53125  # 4-bit E2M1 + one E8M0 scale per 32 values = 4.25 bits


@dataclass(frozen=True)
class ModelPreset:
    """Shape of one MoE model's routed experts (shared experts are always on and not counted).

    Attributes:
        name: preset key.
        num_experts: N, routed experts per MoE layer.
        top_k: k, experts per token.
        hidden_size: d_model.
        moe_intermediate_size: intermediate width of one routed expert.
        num_moe_layers: MoE layers (dense prefix layers excluded).
        bytes_per_weight: storage bytes per expert weight (2 bf16, 1 fp8, 0.5625 nvfp4, 4 fp32).
        scoring: router family, ``"softmax"`` or ``"sigmoid"``.
        n_group / topk_group: group-limited routing (``None`` = none).
        num_shared_experts: always-on shared experts (not routed; not part of T).
        source: where the numbers come from.
        decoder: the rest of the decoder (attention, dense and shared MLPs, head) for the step-level
            roofline (``oea.presets.decoder_shapes``); ``None`` where not described.
    """

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    num_moe_layers: int
    bytes_per_weight: float
    scoring: Scoring = "softmax"
    n_group: int | None = None
    topk_group: int | None = None
    num_shared_experts: int = 0
    source: str = ""
    decoder: DecoderShape | None = None

    @property
    def expert_params(self) -> int:
        """Weights of one SwiGLU expert: gate, up ([I, H] each) and down ([H, I]) = 3·H·I."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> float:
        """Bytes moved from memory to load one expert once: 3·H·I·bytes_per_weight."""
        return self.expert_params * self.bytes_per_weight

    @property
    def expert_flops_per_token(self) -> float:
        """FLOPs of one expert on one token: 2 multiply-adds per weight = 2·3·H·I."""
        return 2.0 * self.expert_params


def _model(**kwargs: object) -> ModelPreset:
    return ModelPreset(**kwargs)  # type: ignore[arg-type]


MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: dataclasses.replace(p, decoder=DECODER_SHAPES.get(p.name))
    for p in (
        _model(
            name="qwen3-30b-a3b", num_experts=128, top_k=8, hidden_size=2048, moe_intermediate_size=768,
            num_moe_layers=48, bytes_per_weight=2.0, scoring="softmax",
            source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (bf16); "
            "paper setup §11.1",
        ),
        _model(
            name="qwen3-235b-a22b", num_experts=128, top_k=8, hidden_size=4096, moe_intermediate_size=1536,
            num_moe_layers=94, bytes_per_weight=2.0, scoring="softmax",
            source="https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (94 layers, all MoE; "
            "the paper says 96); bf16",
        ),
        _model(
            name="deepseek-v3", num_experts=256, top_k=8, hidden_size=7168, moe_intermediate_size=2048,
            num_moe_layers=58, bytes_per_weight=1.0, scoring="sigmoid", n_group=8, topk_group=4,
            num_shared_experts=1,
            source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (61 layers, first 3 "
            "dense; fp8 e4m3 with 128x128 block scales, scale bytes negligible)",
        ),
        _model(
            name="glm-4.5-air", num_experts=128, top_k=8, hidden_size=4096, moe_intermediate_size=1408,
            num_moe_layers=45, bytes_per_weight=2.0, scoring="sigmoid", n_group=1, topk_group=1,
            num_shared_experts=1,
            source="https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json (46 layers, "
            "first_k_dense_replace=1); bf16",
        ),
        _model(
            name="glm-5", num_experts=256, top_k=8, hidden_size=6144, moe_intermediate_size=2048,
            num_moe_layers=75, bytes_per_weight=NVFP4_BYTES, scoring="sigmoid", n_group=1, topk_group=1,
            num_shared_experts=1,
            source="zai-org GLM-5 config.json (GlmMoeDsaForCausalLM: 78 layers, first_k_dense_replace=3); "
            "experts in NVFP4 (4-bit + fp8 scale per 16 = 0.5625 B/weight)",
        ),
        _model(
            name="gpt-oss-120b", num_experts=128, top_k=4, hidden_size=2880, moe_intermediate_size=2880,
            num_moe_layers=36, bytes_per_weight=MXFP4_BYTES, scoring="softmax",
            source="https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json (MXFP4 experts: "
            "4-bit + e8m0 scale per 32 = 0.53125 B/weight; softmax over the top-4)",
        ),
        _model(
            name="mixtral-8x7b", num_experts=8, top_k=2, hidden_size=4096, moe_intermediate_size=14336,
            num_moe_layers=32, bytes_per_weight=2.0, scoring="softmax",
            source="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json; bf16",
        ),
        _model(
            name="olmoe-1b-7b", num_experts=64, top_k=8, hidden_size=2048, moe_intermediate_size=1024,
            num_moe_layers=16, bytes_per_weight=2.0, scoring="softmax",
            source="https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json; bf16",
        ),
        _model(
            name="embedded", num_experts=128, top_k=8, hidden_size=128, moe_intermediate_size=48,
            num_moe_layers=4, bytes_per_weight=4.0, scoring="softmax",
            source="the project's own embedded Qwen3-MoE model (oea_lab_data/embedded/config.json); stored "
            "in bf16, loaded as float32 by oea.models.load_model, so 4 bytes per weight on CPU",
        ),
    )
}


@dataclass(frozen=True)
class LayerFit:
    """A measured MoE layer fit ``t(B, T) = a_us·B·k + b_us·T + c_us`` on one machine and model preset."""

    a_us: float
    b_us: float
    c_us: float
    r2: float
    preset: str
    measured_on: str


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator for the latency cost model.

    Attributes:
        name: preset key.
        hbm_bandwidth_GBps: memory bandwidth, GB/s (``None`` = unmeasured).
        peak_tflops_bf16 / peak_tflops_fp8 / peak_tflops_fp4: dense tensor-core peaks, TFLOP/s
            (``None`` where the format is not supported or not measured).
        launch_overhead_us: fixed cost per MoE layer call (kernel launches, routing, gather/scatter).
        interconnect_GBps: per-direction device-to-device bandwidth for the TP all-reduce estimate.
        interconnect_latency_us: per-step latency floor of one all-reduce hop.
        source: datasheet / measurement the numbers come from.
        fit: the measured layer fit (``cpu`` only; ``None`` elsewhere).
    """

    name: str
    hbm_bandwidth_GBps: float | None
    peak_tflops_bf16: float | None
    peak_tflops_fp8: float | None = None
    peak_tflops_fp4: float | None = None
    launch_overhead_us: float = 0.0
    interconnect_GBps: float | None = None
    interconnect_latency_us: float = 0.0
    source: str = ""
    fit: LayerFit | None = field(default=None)

    @property
    def measured(self) -> bool:
        """False when the numbers needed by the cost model are missing (the ``cpu`` preset before
        the layer benchmark has written its fit)."""
        return self.hbm_bandwidth_GBps is not None and self.peak_tflops_bf16 is not None

    def peak_tflops(self, bytes_per_weight: float) -> float:
        """The tensor-core peak that matches a weight format (fp4 <= 0.6 B, fp8 <= 1 B, else bf16)."""
        if not self.measured:
            raise ValueError(f"gpu preset {self.name!r} is unmeasured: {self.source}")
        assert self.peak_tflops_bf16 is not None
        if bytes_per_weight <= 0.6 and self.peak_tflops_fp4 is not None:
            return self.peak_tflops_fp4
        if bytes_per_weight <= 1.0 and self.peak_tflops_fp8 is not None:
            return self.peak_tflops_fp8
        return self.peak_tflops_bf16


# Fixed per-layer overhead: the paper's Qwen3-30B-A3B / H100 / SGLang table (oea-algorithm.md §11.2)
# fits latency = 2.91 µs·T + 33.7 µs; the compute term at B <= 16 is ~1 µs, leaving ~32 µs of fixed
# cost. The same figure is assumed for the other GPUs (labelled as an assumption in their source).
_PAPER_FIXED_US = 32.0

_DATACENTER_GPUS = (
    GpuPreset(
        name="h100-sxm", hbm_bandwidth_GBps=3350.0, peak_tflops_bf16=989.0, peak_tflops_fp8=1979.0,
        launch_overhead_us=_PAPER_FIXED_US, interconnect_GBps=450.0, interconnect_latency_us=5.0,
        source="NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TF bf16 / 1979 TF fp8 dense, NVLink 900 GB/s "
        "bidirectional; fixed overhead fitted to the paper's Table 3/4 (Qwen3-30B-A3B, SGLang)",
    ),
    GpuPreset(
        name="h200", hbm_bandwidth_GBps=4800.0, peak_tflops_bf16=989.0, peak_tflops_fp8=1979.0,
        launch_overhead_us=_PAPER_FIXED_US, interconnect_GBps=450.0, interconnect_latency_us=5.0,
        source="NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 989 TF bf16 / 1979 TF fp8 dense, NVLink 900 GB/s "
        "bidirectional; fixed overhead assumed equal to the H100 fit",
    ),
    GpuPreset(
        name="b200", hbm_bandwidth_GBps=8000.0, peak_tflops_bf16=2250.0, peak_tflops_fp8=4500.0,
        peak_tflops_fp4=9000.0, launch_overhead_us=_PAPER_FIXED_US, interconnect_GBps=900.0,
        interconnect_latency_us=5.0,
        source="NVIDIA HGX B200 datasheet: 8 TB/s HBM3e, 2.25 PF bf16 / 4.5 PF fp8 / 9 PF fp4 dense "
        "(half the sparse figures), NVLink 5 1.8 TB/s bidirectional; fixed overhead assumed as H100",
    ),
    GpuPreset(
        name="rtx-pro-6000", hbm_bandwidth_GBps=1792.0, peak_tflops_bf16=500.0, peak_tflops_fp8=1000.0,
        peak_tflops_fp4=2000.0, launch_overhead_us=_PAPER_FIXED_US, interconnect_GBps=64.0,
        interconnect_latency_us=10.0,
        source="NVIDIA RTX PRO 6000 Blackwell Server/Workstation datasheet: 96 GB GDDR7 at 1792 GB/s, "
        "4 PF fp4 with sparsity (2 PF dense; fp8 / bf16 derived by halving), no NVLink: PCIe Gen5 x16 "
        "~64 GB/s per direction; fixed overhead assumed as H100",
    ),
)


def load_cpu_fit(path: pathlib.Path = CPU_FIT_PATH) -> LayerFit | None:
    """The layer benchmark's measured fit, or ``None`` when the file does not exist.

    Raises ``ValueError`` naming the file and field when the file exists but is malformed.
    """
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    values: dict[str, object] = {}
    for name in ("a_us", "b_us", "c_us", "r2"):
        value = raw.get(name) if isinstance(raw, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{path}: field {name!r} must be a number, got {value!r}")
        values[name] = float(value)
    for name in ("preset", "measured_on"):
        value = raw.get(name)
        if not isinstance(value, str):
            raise ValueError(f"{path}: field {name!r} must be a string, got {value!r}")
        values[name] = value
    if values["preset"] not in MODEL_PRESETS:
        raise ValueError(
            f"{path}: field 'preset' must be one of {sorted(MODEL_PRESETS)}, got {values['preset']!r}"
        )
    if values["b_us"] <= 0:  # type: ignore[operator]
        raise ValueError(f"{path}: field 'b_us' must be > 0 (µs per active expert), got {values['b_us']}")
    return LayerFit(**values)  # type: ignore[arg-type]


def cpu_preset(path: pathlib.Path = CPU_FIT_PATH) -> GpuPreset:
    """This machine as a cost-model device, derived from the measured layer fit.

    Effective bandwidth = expert_bytes / b_us and effective FLOP rate = expert FLOPs per token / a_us
    of the fitted model preset, so the fit transfers to other presets by bytes and FLOPs; the fixed
    term c_us is the launch overhead. Without the fit file the preset is returned unmeasured.
    """
    try:
        fit = load_cpu_fit(path)
    except ValueError as err:  # an unusable fit: the preset says why (shown wherever it is used)
        return GpuPreset(name="cpu", hbm_bandwidth_GBps=None, peak_tflops_bf16=None,
                         source=f"unmeasured: the layer fit is unusable: {err}")
    if fit is None:
        return GpuPreset(
            name="cpu", hbm_bandwidth_GBps=None, peak_tflops_bf16=None,
            source=f"unmeasured: {path} does not exist yet (written by the MoE layer benchmark)",
        )
    model = MODEL_PRESETS[fit.preset]
    bandwidth = model.expert_bytes / (fit.b_us * 1e-6) / 1e9
    # a fitted a <= 0 means per-token compute is below the fit's resolution: treated as free
    tflops = model.expert_flops_per_token / (fit.a_us * 1e-6) / 1e12 if fit.a_us > 0 else float("inf")
    return GpuPreset(
        name="cpu", hbm_bandwidth_GBps=bandwidth, peak_tflops_bf16=tflops, peak_tflops_fp8=tflops,
        peak_tflops_fp4=tflops, launch_overhead_us=max(fit.c_us, 0.0),
        source=f"measured layer fit on {fit.measured_on} with preset {fit.preset} (R²={fit.r2:.3f}): "
        f"a={fit.a_us:.4g} µs/token-slot, b={fit.b_us:.4g} µs/expert, c={fit.c_us:.4g} µs",
        fit=fit,
    )


def gpu_presets() -> dict[str, GpuPreset]:
    """Every accelerator preset by name (``cpu`` read fresh from its fit file)."""
    presets = {p.name: p for p in _DATACENTER_GPUS}
    presets["cpu"] = cpu_preset()
    return presets


def model_preset_names() -> list[str]:
    """Valid ``get_model_preset`` names."""
    return sorted(MODEL_PRESETS)


def gpu_preset_names() -> list[str]:
    """Valid ``get_gpu_preset`` names."""
    return sorted([p.name for p in _DATACENTER_GPUS] + ["cpu"])


def get_model_preset(name: str) -> ModelPreset:
    """The model preset ``name``; raises ``ValueError`` listing the valid names."""
    preset = MODEL_PRESETS.get(name)
    if preset is None:
        raise ValueError(f"model preset must be one of {model_preset_names()}, got {name!r}")
    return preset


def get_gpu_preset(name: str) -> GpuPreset:
    """The accelerator preset ``name``; raises ``ValueError`` listing the valid names."""
    if name == "cpu":
        return cpu_preset()
    for preset in _DATACENTER_GPUS:
        if preset.name == name:
            return preset
    raise ValueError(f"gpu preset must be one of {gpu_preset_names()}, got {name!r}")
