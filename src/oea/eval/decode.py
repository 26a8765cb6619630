"""Teacher-forced lock-step batched decoding and greedy generation with a routing policy attached.

Lock-step decode: B windows advance together; the first ``prefill`` tokens go through one prefill
forward (vanilla routing: OEA is decode-only), then every later position is one decode forward of
B tokens (input ``[B, 1]`` with the KV cache), so the router at position t sees exactly the B tokens
at t, as a serving engine's decode step would.

Verify-shaped (``step_tokens`` = 1 + d > 1): each forward feeds every window's next 1 + d tokens
(``[B, 1 + d]`` with the KV cache), so the router sees the B (1 + d) rows a speculative verify step routes
together (the last sampled token and d drafts per request, every draft the true next token: all accepted),
and each of the 1 + d positions is scored. The handle must treat such a forward as a decode step
(``oea.attach(..., decode_tokens=1 + d)``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DecodeCounts:
    """Routing totals over decode steps, summed over layers: steps, rows, active experts, used slots.

    ``step_active`` / ``step_experts_per_token``: per decode step, the mean over layers of the active
    experts and of the experts per token (the samples behind the intervals of ``oea eval``).
    """

    layer_steps: int = 0
    rows: int = 0
    active_total: float = 0.0
    slots_total: float = 0.0
    per_layer_active: dict[int, float] = field(default_factory=dict)
    step_active: list[float] = field(default_factory=list)
    step_experts_per_token: list[float] = field(default_factory=list)

    @property
    def mean_active_experts(self) -> float:
        """Distinct non-zero-weight experts per layer per decode step."""
        return self.active_total / self.layer_steps if self.layer_steps else 0.0

    @property
    def mean_experts_per_token(self) -> float:
        """Non-zero-weight expert slots per token per layer."""
        return self.slots_total / self.rows if self.rows else 0.0


def handle_totals(handle: Any) -> dict[int, tuple[int, int, float, float]]:
    """``{layer: (steps, rows, active experts summed over steps, used slots summed over rows)}``."""
    totals = {}
    for index, s in handle.stats().items():
        totals[index] = (
            s["steps"], s["tokens"], s["mean_active_experts"] * s["steps"], s["mean_experts_per_token"] * s["tokens"]
        )
    return totals


def add_counts(counts: DecodeCounts, before: dict, after: dict) -> None:
    """Add the difference of two ``handle_totals`` snapshots (one decode step apart) to ``counts``."""
    steps_sum, rows_sum, active_sum, slots_sum = 0, 0, 0.0, 0.0
    for index, (steps, rows, active, slots) in after.items():
        b_steps, b_rows, b_active, b_slots = before[index]
        steps_sum += steps - b_steps
        rows_sum += rows - b_rows
        active_sum += active - b_active
        slots_sum += slots - b_slots
        counts.per_layer_active[index] = counts.per_layer_active.get(index, 0.0) + active - b_active
    counts.layer_steps += steps_sum
    counts.rows += rows_sum
    counts.active_total += active_sum
    counts.slots_total += slots_sum
    if steps_sum:
        counts.step_active.append(active_sum / steps_sum)
        counts.step_experts_per_token.append(slots_sum / rows_sum if rows_sum else 0.0)


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; earlier 5.x ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def lockstep_cross_entropy(
    model: Any, ids: torch.Tensor, prefill: int, handle: Any | None = None, counts: DecodeCounts | None = None,
    step_tokens: int = 1,
) -> torch.Tensor:
    """Per-token next-token CE (nats) of windows ``ids`` [B, L] decoded in lock step -> [B, L - prefill - 1].

    Position ``prefill + j`` is fed at decode step ``j // step_tokens`` and predicts token ``prefill + j + 1``;
    each decode step feeds ``step_tokens`` positions per window (1: plain decode; 1 + d: verify-shaped), so
    ``L - prefill - 1`` must be a multiple of ``step_tokens``. With a ``handle`` and ``counts``, the routing
    statistics of each decode step are added to ``counts`` (the prefill forward is not a decode step and is
    not counted).
    """
    from transformers import DynamicCache

    if not 1 <= prefill < ids.shape[1] - 1:
        raise ValueError(f"prefill must be in 1..{ids.shape[1] - 2} for windows of {ids.shape[1]}, got {prefill}")
    scored = ids.shape[1] - prefill - 1
    if step_tokens < 1 or scored % step_tokens or step_tokens >= prefill:
        raise ValueError(f"step_tokens must be in 1..{prefill - 1} (below the prefill's {prefill} tokens) and "
                         f"divide the {scored} scored positions, got {step_tokens}")
    cache_name = _cache_kwarg(model)
    cache = DynamicCache()
    out = model(input_ids=ids[:, :prefill], use_cache=True, **{cache_name: cache})
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
    track = handle is not None and counts is not None
    before = handle_totals(handle) if track else None
    losses = []
    for t in range(prefill, ids.shape[1] - 1, step_tokens):
        position = torch.arange(t, t + step_tokens, dtype=torch.int64).expand(ids.shape[0], step_tokens)
        out = model(input_ids=ids[:, t : t + step_tokens], position_ids=position, use_cache=True,
                    **{cache_name: cache})
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None) or cache
        logits = out.logits[:, -step_tokens:].float()  # [B, s, V]
        targets = ids[:, t + 1 : t + 1 + step_tokens]  # [B, s]
        losses.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
        if track:  # per step, so that the routing figures get intervals over decode steps
            after = handle_totals(handle)
            add_counts(counts, before, after)
            before = after
    return torch.cat(losses, dim=1)


@torch.no_grad()
def greedy_generate(model: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``model.generate`` greedily, exactly ``new_tokens`` tokens for prompts [B, P] -> [B, new_tokens]."""
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
    )
    return out[:, prompts.shape[1] :]
