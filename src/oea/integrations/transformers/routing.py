"""The hot path: the hooks on each MoE block and router, run in every forward.

* The block's forward pre-hook marks a **decode step** (block input ``[B, S, H]`` with ``S == 1``); its
  forward hook clears it.
* The router's forward hook, in decode steps, recomputes the router logits from the router's own input
  (``F.linear``, fp32 for the grouped sigmoid routers, as they do), reroutes with ``oea.route_fast`` (the
  numba kernel on CPU, Triton on CUDA; ``oea.route`` inside ``torch.compile``) and returns
  ``(router_logits, weights, ids, *rest)`` in the router's own dtypes. transformers 5.0-5.10 DeepSeek/GLM
  blocks are hooked through ``route_tokens_to_experts`` instead.
* Statistics accumulate in device tensors (no Python state changes per step, so a
  ``torch.compile(fullgraph=True)`` decode stays one graph).
* ``_LayerHook.validate`` (once, at attach): with k0 = k the hook must reproduce the router's own ids (as
  sets) and weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oea.integrations.transformers.routers import LEGACY_ROUTE_METHOD, MoELayer
from oea.kernels import route_fast
from oea.routing import OEAConfig, RouterSpec, keeps_every_top_k, route, router_scores, routing_difference

# A layer's device counters, in this order: decode steps, rows, active experts (OEA), active experts
# (the router's own picks), non-zero-weight slots.
_NUM_COUNTERS = 5


class _HandleState:
    """Flags every hook of one handle reads."""

    def __init__(self, decode_only: bool, decode_tokens: int = 1) -> None:
        self.enabled = True
        self.decode_only = decode_only
        self.decode_tokens = decode_tokens  # a block input [B, S, H] with S <= this is a decode (verify) step


class _LayerHook:
    """Decode flag, configuration, counters and the routing rewrite of one MoE layer."""

    def __init__(self, layer: MoELayer, cfg: object | None, state: _HandleState) -> None:
        self.layer = layer
        self.cfg = cfg
        self.state = state
        self.spec = layer.spec
        self.decode = False
        self.validated = False
        self.keeps_own = keeps_every_top_k(cfg, layer.spec)
        device = layer.router.weight.device if hasattr(layer.router, "weight") else torch.device("cpu")
        self.counts = torch.zeros(_NUM_COUNTERS, dtype=torch.int64, device=device)
        self.last_active = torch.zeros((), dtype=torch.int64, device=device)

    # -- routing -----------------------------------------------------------------------------
    def current_spec(self) -> RouterSpec:
        """The spec, following a correction-bias buffer that ``model.to(...)`` moved or cast."""
        bias = self.spec.correction_bias
        if bias is not None:
            router = self.layer.router
            owner = router if hasattr(router, "e_score_correction_bias") else self.layer.block
            live = owner.e_score_correction_bias
            if live.device != bias.device or live.dtype != bias.dtype:
                self.spec = dataclasses.replace(self.spec, correction_bias=live)
        return self.spec

    def logits_from_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Router input ``[..., H]`` -> ``[M, N]`` logits, computed as the router computes them."""
        weight = self.layer.router.weight
        x = hidden_states.reshape(-1, weight.shape[-1])
        if self.layer.logits_in_fp32:
            return F.linear(x.float(), weight.float())
        return F.linear(x, weight)

    def reroute(self, logits: torch.Tensor, cfg: object | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, N]`` logits -> ids ``[M, k]`` int64, weights ``[M, k]`` float32 (``oea.route``'s results)."""
        if torch.compiler.is_compiling():  # traced code: the pure-torch path
            return route(logits, self.current_spec(), cfg)
        return route_fast(logits, self.current_spec(), cfg)

    def rewrite(
        self, logits: Callable[[], torch.Tensor], own_weights: torch.Tensor, own_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The hook body: ``(weights, ids)`` to use instead of the router's own, or None to keep them.

        ``logits()`` gives the ``[M, N]`` router logits (computed only when rerouting);
        ``own_weights`` / ``own_ids`` are the router's output ``[M, k]``. Returned weights keep
        ``own_weights.dtype``, ids are int64. Counts decode steps into the device counters.
        """
        decode = self.decode
        active = self.state.enabled and self.validated and self.cfg is not None and not self.keeps_own
        # below min_batch rows the batch routes as vanilla: the router's own output itself, bit for bit
        # (oea.route would return the same experts with its own rounding of the weights)
        active = active and own_ids.shape[0] >= getattr(self.cfg, "min_batch", 0)
        rerouting = active and (decode or not self.state.decode_only)
        if not rerouting and not decode:
            return None
        if rerouting:
            ids, weights = self.reroute(logits(), self.cfg)
            weights = weights.to(own_weights.dtype)
        else:
            ids, weights = own_ids, own_weights
        if decode:
            self.count(ids, weights, own_ids)
        return (weights, ids) if rerouting else None

    def count(self, ids: torch.Tensor, weights: torch.Tensor, own_ids: torch.Tensor) -> None:
        """Accumulate one decode step into the device counters (no host sync, no Python state).

        ``ids`` / ``weights`` ``[M, k]``: the routing the experts get; ``own_ids`` ``[M, k]``: the router's.
        """
        if self.counts.device != ids.device:  # the model moved after attach (eager only)
            self.counts = self.counts.to(ids.device)
            self.last_active = self.last_active.to(ids.device)
        n = self.spec.num_experts
        used = weights != 0
        routed = torch.where(used, ids, n)  # zero-weight fillers go to the dummy column n
        # one scatter marks both routings' experts: row 0 = what the experts get, row 1 = the router's picks
        marks = torch.zeros(2, n + 1, dtype=torch.int64, device=ids.device)
        marks.scatter_(1, torch.stack([routed.reshape(-1), own_ids.reshape(-1)]), 1)
        distinct = marks[:, :n].sum(dim=1)  # [2]
        fixed = torch.tensor([1, ids.shape[0]], dtype=torch.int64, device=ids.device)
        self.counts.add_(torch.cat([fixed, distinct, used.sum().reshape(1)]))
        self.last_active.copy_(distinct[0])

    # -- hooks -------------------------------------------------------------------------------
    def block_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        self.decode = isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] <= self.state.decode_tokens

    def block_post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.decode = False

    def router_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not isinstance(output, tuple) or len(output) < 3:
            raise TypeError(
                f"{self.layer.name}.{self.layer.router_name}: expected the router to return "
                f"(router_logits, topk_weights, topk_ids, ...), got {type(output).__name__}"
            )
        if not self.decode and self.state.decode_only:
            return None
        x = args[0] if args else kwargs["hidden_states"]
        new = self.rewrite(lambda: self.logits_from_input(x), output[1], output[2])
        if new is None:
            return None
        return (output[0], new[0], new[1], *output[3:])

    def legacy_route(self, original: Callable[[torch.Tensor], tuple]) -> Callable[[torch.Tensor], tuple]:
        """Wrap a 5.0-5.10 ``route_tokens_to_experts(router_logits) -> (ids, weights)``."""

        def route_tokens_to_experts(router_logits: torch.Tensor) -> tuple:
            ids, weights = original(router_logits)
            if not self.decode and self.state.decode_only:
                return ids, weights
            new = self.rewrite(lambda: router_logits.reshape(-1, router_logits.shape[-1]), weights, ids)
            return (ids, weights) if new is None else (new[1], new[0])

        route_tokens_to_experts.__oea_wrapper__ = True  # type: ignore[attr-defined]
        return route_tokens_to_experts

    # -- attach-time check -------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, rows: int = 16, seed: int = 0) -> str | None:
        """k0 = k must reproduce the router's own routing on random inputs; returns a reason or None."""
        router = self.layer.router
        weight = router.weight
        generator = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(rows, weight.shape[-1], generator=generator)
        x = x.to(device=weight.device, dtype=weight.dtype)
        if self.layer.legacy:
            logits = router.forward(x)
            unhooked = getattr(type(self.layer.block), LEGACY_ROUTE_METHOD)  # the class's own method
            own_ids, own_weights = unhooked(self.layer.block, logits)
            logits = logits.reshape(-1, logits.shape[-1])
        else:
            output = router.forward(x)  # .forward: bypasses this handle's hooks
            own_weights, own_ids = output[1], output[2]
            logits = self.logits_from_input(x)
        self.reroute(logits, self.cfg)  # a config route() rejects fails here, at attach, not mid-generate
        ids, weights = self.reroute(logits, OEAConfig(k0=self.spec.top_k, min_batch=0))
        weights = weights.to(own_weights.dtype)
        select = router_scores(logits, self.current_spec()).select
        return routing_difference(own_ids, own_weights, ids, weights, select)

