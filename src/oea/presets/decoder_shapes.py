"""What one decode step reads besides the routed experts: attention, dense and shared MLPs, the output head.

A ``DecoderShape`` holds the dimensions of a model's decoder that the step-level roofline
(``oea.sim.step``) needs; ``ModelPreset.decoder`` carries it. Numbers come from each model's
``config.json`` (the same sources as the model presets; transformers' config classes default to them).

Attention kinds:

* ``"gqa"`` (Qwen3-MoE, Mixtral, OLMoE, GLM-4.5): q [H, heads·d], k and v [H, kv_heads·d], o [heads·d, H];
  the KV cache holds 2·kv_heads·d values per token and layer;
* ``"mla"`` (DeepSeek-V3, GLM-5): q_a [H, q_lora], kv_a [H, kv_lora + rope] (replicated on every TP rank,
  as SGLang's ``DeepseekV2AttentionMLA`` builds them: ``ReplicatedLinear``), q_b [q_lora, heads·(nope + rope)],
  kv_b [kv_lora, heads·(nope + v)], o [heads·v, H] (split by heads); the KV cache holds the kv_lora + rope
  latent per token and layer, which every TP rank keeps and reads whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["gqa", "mla"]
ATTENTION_KINDS: tuple[str, ...] = ("gqa", "mla")


@dataclass(frozen=True)
class DecoderShape:
    """The decoder dimensions a decode step reads besides the routed experts.

    Attributes:
        num_layers: all decoder layers (dense and MoE).
        num_dense_layers: layers with a dense MLP instead of the MoE (``first_k_dense_replace``).
        dense_intermediate_size: the dense MLP's width (0 when there are no dense layers).
        shared_intermediate_size: the total width of a MoE layer's shared experts (0: none).
        vocab_size: rows of the output head (untied or tied, it is read once per step).
        attention: ``"gqa"`` or ``"mla"`` (module docstring).
        num_heads: query heads.
        num_kv_heads / head_dim: GQA only (0 for MLA).
        q_lora_rank / kv_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim: MLA only (0 for GQA;
            q_lora_rank 0 on MLA means q is projected from H directly).
        weight_bytes: bytes per weight of everything here (attention, dense and shared MLPs, output head).
        kv_bytes: bytes per KV-cache element.
        source: where the numbers come from.
    """

    num_layers: int
    num_dense_layers: int
    dense_intermediate_size: int
    shared_intermediate_size: int
    vocab_size: int
    attention: AttentionKind
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"decoder field 'attention' must be one of {list(ATTENTION_KINDS)}, "
                             f"got {self.attention!r}")
        positive = ["num_layers", "vocab_size", "num_heads"]
        positive += ["num_kv_heads", "head_dim"] if self.attention == "gqa" else [
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"decoder field {name!r} must be an integer >= 1 ({self.attention}), got {value!r}")
        for name in ("num_dense_layers", "dense_intermediate_size", "shared_intermediate_size", "q_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"decoder field {name!r} must be an integer >= 0, got {value!r}")
        if self.num_dense_layers > self.num_layers:
            raise ValueError(f"decoder field 'num_dense_layers' must be at most num_layers={self.num_layers}, got "
                             f"{self.num_dense_layers}")
        if self.num_dense_layers and not self.dense_intermediate_size:
            raise ValueError("decoder field 'dense_intermediate_size' must be >= 1 when num_dense_layers > 0")
        if self.attention == "gqa" and self.num_heads % self.num_kv_heads:
            raise ValueError(f"decoder field 'num_kv_heads' must divide num_heads={self.num_heads}, got "
                             f"{self.num_kv_heads}")
        for name in ("weight_bytes", "kv_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 64:
                raise ValueError(f"decoder field {name!r} must be a number > 0 (bytes), got {value!r}")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def attention_params_per_device(self, hidden_size: int, tp: int) -> float:
        """Attention weights one of ``tp`` ranks reads per layer: split by heads (GQA's k and v over at most
        ``num_kv_heads`` ranks, replicated beyond), MLA's q_a and kv_a replicated (module docstring)."""
        h = hidden_size
        if self.attention == "gqa":
            q_o = 2 * h * self.num_heads * self.head_dim
            k_v = 2 * h * self.num_kv_heads * self.head_dim
            return q_o / tp + k_v / min(tp, self.num_kv_heads)
        q_width = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        split = (self.q_lora_rank or h) * q_width + self.kv_lora_rank * self.num_heads * (
            self.qk_nope_head_dim + self.v_head_dim) + self.num_heads * self.v_head_dim * h
        replicated = h * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)
        return split / tp + replicated

    def kv_values_per_token(self, tp: int) -> float:
        """KV-cache values one of ``tp`` ranks reads per cached token and layer (GQA: its kv heads; MLA: the
        whole kv_lora + rope latent, which every rank keeps)."""
        if self.attention == "gqa":
            return 2 * self.num_kv_heads * self.head_dim / min(tp, self.num_kv_heads)
        return float(self.kv_lora_rank + self.qk_rope_head_dim)

    def attention_flops_per_context_token(self, tp: int) -> float:
        """FLOPs of one query token against one cached token in one layer on one of ``tp`` ranks (its heads):
        scores and values; MLA as the absorbed decode kernels compute it, against the latent."""
        if self.attention == "gqa":
            return 4 * self.num_heads * self.head_dim / tp
        return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) / tp


def _gqa(layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int, source: str, dense: int = 0,
         dense_width: int = 0, shared: int = 0, weight_bytes: float = 2.0) -> DecoderShape:
    return DecoderShape(num_layers=layers, num_dense_layers=dense, dense_intermediate_size=dense_width,
                        shared_intermediate_size=shared, vocab_size=vocab, attention="gqa", num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=head_dim, weight_bytes=weight_bytes, source=source)


def _mla(layers: int, dense: int, dense_width: int, shared: int, vocab: int, heads: int, q_lora: int, kv_lora: int,
         nope: int, rope: int, v: int, weight_bytes: float, source: str) -> DecoderShape:
    return DecoderShape(num_layers=layers, num_dense_layers=dense, dense_intermediate_size=dense_width,
                        shared_intermediate_size=shared, vocab_size=vocab, attention="mla", num_heads=heads,
                        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                        v_head_dim=v, weight_bytes=weight_bytes, source=source)


# Keyed by model preset name. gpt-oss-120b has none: half its layers use a 128-token sliding window, which
# this shape does not describe.
DECODER_SHAPES: dict[str, DecoderShape] = {
    "qwen3-30b-a3b": _gqa(48, 32, 4, 128, 151936, "Qwen3-30B-A3B config.json; bf16"),
    "qwen3-235b-a22b": _gqa(94, 64, 4, 128, 151936, "Qwen3-235B-A22B config.json; bf16"),
    "glm-4.5-air": _gqa(46, 96, 8, 128, 151552, "GLM-4.5-Air config.json (first_k_dense_replace=1, intermediate "
                        "10944, one shared expert of 1408); bf16", dense=1, dense_width=10944, shared=1408),
    "mixtral-8x7b": _gqa(32, 32, 8, 128, 32000, "Mixtral-8x7B config.json; bf16"),
    "olmoe-1b-7b": _gqa(16, 16, 16, 128, 50304, "OLMoE-1B-7B config.json; bf16"),
    "embedded": _gqa(4, 4, 2, 32, 4096, "oea_lab_data/embedded/config.json (tied head); float32 on CPU",
                     weight_bytes=4.0),
    "deepseek-v3": _mla(61, 3, 18432, 2048, 129280, 128, 1536, 512, 128, 64, 128, 1.0,
                        "DeepSeek-V3 config.json (first_k_dense_replace=3, one shared expert); every linear "
                        "layer fp8 (1 B/weight)"),
    "glm-5": _mla(78, 3, 12288, 2048, 154880, 64, 2048, 512, 192, 64, 256, 2.0,
                  "zai-org GLM-5 config.json (GlmMoeDsaForCausalLM: MLA, first_k_dense_replace=3, one shared "
                  "expert); GLM-5-NVFP4 quantises only the routed experts: attention, dense and shared MLPs and "
                  "the head stay bf16. DSA's indexer is not modelled: attention reads the whole context"),
}
