"""A real MoE layer that computes only the active experts: SwiGLU experts with stacked weights.

Shape legend: B = tokens in the decode batch, k = slots per token (the model's top-k), N = routed
experts, H = hidden size, I = expert intermediate size, S = B·k token-expert slots.

Weights are stacked as in vLLM / torchtitan: ``w13`` [N, 2I, H] holds gate (rows 0..I-1) and up
(rows I..2I-1), ``w2`` [N, H, I] is the down projection. One expert on a token ``x`` [H] computes
``w2 @ (silu(w_gate @ x) * (w_up @ x))``.

Two implementations of the same layer:

* ``moe_forward_loop``: sort the used slots by expert, then one gather + two GEMMs per *active*
  expert (a Python loop over the experts that have tokens; one host synchronisation).
* ``moe_forward_grouped``: the same sort, then ``torch._grouped_mm`` over all N groups with
  fixed shapes and no host synchronisation (CUDA-graph capturable). Experts with no rows are
  skipped by the kernel.

In both, a slot with weight exactly 0 (an OEA / pruned filler) is skipped: it never makes an
expert active and costs no compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Impl = Literal["loop", "grouped"]
IMPLS: tuple[str, ...] = ("loop", "grouped")

# Distinct random experts generated for large layers; the rest are scaled copies (filling
# gigabytes with normal_() takes longer than the benchmark itself, and values do not change speed).
_DISTINCT_EXPERTS = 8


@dataclass(frozen=True)
class MoEShape:
    """Dimensions of one MoE layer's routed experts.

    Attributes:
        num_experts: N.
        top_k: k, slots per token.
        hidden_size: H.
        intermediate_size: I, one expert's intermediate width (after any tensor-parallel split).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape.{name} must be an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEShape.top_k must be <= num_experts={self.num_experts}, got {self.top_k}")

    @property
    def expert_params(self) -> int:
        """Weights of one expert: 3·H·I."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's weights in ``dtype`` (what loading it once moves)."""
        return self.expert_params * torch.empty((), dtype=dtype).element_size()

    def layer_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of all N experts of the layer in ``dtype``."""
        return self.num_experts * self.expert_bytes(dtype)

    @classmethod
    def from_preset(cls, preset: object, tp: int = 1) -> MoEShape:
        """The shape of a ``oea.presets.ModelPreset``; ``tp`` > 1 keeps one tensor-parallel
        slice of every expert (intermediate size / tp), as each GPU of a TP group holds."""
        intermediate = int(preset.moe_intermediate_size)  # type: ignore[attr-defined]
        if not isinstance(tp, int) or tp < 1 or intermediate % tp:
            raise ValueError(f"tp must be a positive divisor of moe_intermediate_size={intermediate}, got {tp!r}")
        return cls(
            num_experts=int(preset.num_experts),  # type: ignore[attr-defined]
            top_k=int(preset.top_k),  # type: ignore[attr-defined]
            hidden_size=int(preset.hidden_size),  # type: ignore[attr-defined]
            intermediate_size=intermediate // tp,
        )


@dataclass(frozen=True)
class MoEWeights:
    """Stacked expert weights of one layer: ``w13`` [N, 2I, H] (gate; up), ``w2`` [N, H, I]."""

    w13: torch.Tensor
    w2: torch.Tensor

    def __post_init__(self) -> None:
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(f"w13 and w2 must be 3-D, got {tuple(self.w13.shape)} and {tuple(self.w2.shape)}")
        n, two_i, h = self.w13.shape
        if two_i % 2 or tuple(self.w2.shape) != (n, h, two_i // 2):
            raise ValueError(f"w13 [N, 2I, H] and w2 [N, H, I] disagree: {tuple(self.w13.shape)} vs "
                             f"{tuple(self.w2.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(N, H, I)."""
        n, two_i, h = self.w13.shape
        return n, h, two_i // 2

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down)."""
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()


def init_weights(
    shape: MoEShape, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0
) -> MoEWeights:
    """Random expert weights (scaled like a trained layer: ~1/sqrt(fan-in)), every byte written.

    Layers with more than ``_DISTINCT_EXPERTS`` experts draw that many random experts and fill the
    rest with scaled copies (distinct values, same cost); every page is written, so no expert
    aliases the zero page.
    """
    n, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w13 = torch.empty(n, 2 * i, h, dtype=dtype, device=device)
    w2 = torch.empty(n, h, i, dtype=dtype, device=device)
    distinct = min(n, _DISTINCT_EXPERTS)
    pool13 = (torch.randn(distinct, 2 * i, h, generator=gen) / h**0.5).to(dtype=dtype, device=device)
    pool2 = (torch.randn(distinct, h, i, generator=gen) / i**0.5).to(dtype=dtype, device=device)
    scales = 0.5 + torch.rand(n, generator=gen)
    for e in range(n):
        if e < distinct:
            w13[e].copy_(pool13[e])
            w2[e].copy_(pool2[e])
        else:
            torch.mul(pool13[e % distinct], float(scales[e]), out=w13[e])
            torch.mul(pool2[e % distinct], float(scales[e]), out=w2[e])
    return MoEWeights(w13, w2)


def _check_inputs(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights) -> None:
    _, h, _ = experts.shape
    if hidden.dim() != 2 or hidden.shape[1] != h:
        raise ValueError(f"hidden must have shape [B, H={h}], got {tuple(hidden.shape)}")
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0] or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"ids and weights must have shape [B={hidden.shape[0]}, k], got "
                         f"{tuple(ids.shape)} and {tuple(weights.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int64 or int32, got {ids.dtype}")


def _sorted_slots(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert, zero-weight slots last: -> (order [S], expert_key [S] with N for skipped)."""
    key = torch.where(weights.reshape(-1) != 0, ids.reshape(-1).long(), num_experts)
    order = torch.argsort(key, stable=True)
    return order, key[order]


def _combine(
    y: torch.Tensor, slots: torch.Tensor, used: torch.Tensor | None, weights: torch.Tensor, batch: int, k: int
) -> torch.Tensor:
    """Weighted scatter-add of per-slot outputs y [S', H] of flat slots ``slots`` [S'] into [B, H] float32.

    ``used`` [S'] bool masks rows to drop (``None``: keep all).
    """
    contrib = y.float() * weights.reshape(-1)[slots].float()[:, None]
    if used is not None:  # where, not multiply: rows a kernel left unwritten may hold NaN (0 * NaN = NaN)
        contrib = torch.where(used[:, None], contrib, 0.0)
    out = torch.zeros(batch, y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, slots // k, contrib)


def moe_forward_loop(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights
) -> torch.Tensor:
    """The MoE layer with one gather + GEMM pair per active expert.

    Args:
        hidden: [B, H] token activations.
        ids: [B, k] expert ids (int64 / int32).
        weights: [B, k] gate weights; slots with weight 0 are skipped.
        experts: the layer's stacked weights.

    Returns:
        [B, H] in ``hidden.dtype``: Σ_slots weight · expert(hidden) (accumulated in float32).
    """
    _check_inputs(hidden, ids, weights, experts)
    batch, k = ids.shape
    n = experts.shape[0]
    order, key = _sorted_slots(ids, weights, n)
    active, counts = torch.unique_consecutive(key, return_counts=True)
    x = hidden[order // k]  # [S, H] gathered in expert order
    outputs = []
    start = 0
    for expert, count in zip(active.tolist(), counts.tolist(), strict=True):
        if expert == n:  # the skipped zero-weight slots sort last
            break
        rows = x[start : start + count]
        gate_up = F.linear(rows, experts.w13[expert])
        gate, up = gate_up.chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, experts.w2[expert]))
        start += count
    if not outputs:
        return torch.zeros_like(hidden)
    return _combine(torch.cat(outputs), order[:start], None, weights, batch, k).to(hidden.dtype)


def moe_forward_grouped(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights
) -> torch.Tensor:
    """The MoE layer with ``torch._grouped_mm`` over fixed shapes (no host synchronisation).

    Same contract as ``moe_forward_loop``. Skipped (zero-weight) slots sort past the last group
    offset, so the kernel never reads an expert for them.
    """
    _check_inputs(hidden, ids, weights, experts)
    batch, k = ids.shape
    n = experts.shape[0]
    order, key = _sorted_slots(ids, weights, n)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    offsets = counts[:n].cumsum(0).to(torch.int32)  # group e = rows offsets[e-1]..offsets[e]-1
    x = hidden[order // k]  # [S, H]
    gate_up = torch._grouped_mm(x, experts.w13.transpose(-2, -1), offs=offsets)  # [S, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm((F.silu(gate) * up).contiguous(), experts.w2.transpose(-2, -1), offs=offsets)
    return _combine(y, order, key < n, weights, batch, k).to(hidden.dtype)


def moe_forward(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights, impl: Impl = "loop"
) -> torch.Tensor:
    """The MoE layer: [B, H], [B, k], [B, k] -> [B, H]; ``impl`` is ``"loop"`` or ``"grouped"``."""
    if impl == "loop":
        return moe_forward_loop(hidden, ids, weights, experts)
    if impl == "grouped":
        return moe_forward_grouped(hidden, ids, weights, experts)
    raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")


def grouped_mm_works(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when ``torch._grouped_mm`` runs (and is correct) for ``dtype`` on ``device``."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(2, 32, 16, generator=gen).to(device=device, dtype=dtype)
    offsets = torch.tensor([1, 4], dtype=torch.int32, device=device)
    try:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    expected = torch.cat([x[:1] @ w[0].T, x[1:] @ w[1].T])
    return bool(torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2))


def moe_reference(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights
) -> torch.Tensor:
    """Dense float64 oracle: every token through every one of its slots, one at a time -> [B, H] float64."""
    _check_inputs(hidden, ids, weights, experts)
    x = hidden.double()
    w13, w2 = experts.w13.double(), experts.w2.double()
    out = torch.zeros_like(x)
    for b in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            gate_weight = float(weights[b, j])
            if gate_weight == 0.0:
                continue
            e = int(ids[b, j])
            gate, up = (w13[e] @ x[b]).chunk(2)
            out[b] += gate_weight * (w2[e] @ (F.silu(gate) * up))
    return out


def touched_experts(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sorted distinct expert ids with a non-zero-weight slot: [B, k], [B, k] -> [T] int64."""
    return torch.unique(ids.reshape(-1)[weights.reshape(-1) != 0].long())
