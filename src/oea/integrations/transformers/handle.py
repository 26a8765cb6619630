"""``OEAHandle``: the hooks ``attach`` installed on one model, their statistics, and ``remove()``."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from oea.integrations.transformers.routers import LEGACY_ROUTE_METHOD, MoELayer
from oea.integrations.transformers.routing import _HandleState, _LayerHook

# Routers currently hooked (one OEA handle per model at a time) -> that handle's flags. The value must
# not reference the router, or the weak key would never die and a dropped model would leak.
ATTACHED: weakref.WeakKeyDictionary[nn.Module, _HandleState] = weakref.WeakKeyDictionary()


class OEAHandle:
    """Hooks installed by ``attach``; ``remove()`` restores the model.

    Attributes:
        layers: the hooked ``MoELayer`` list (index, name, router, spec).
        configs: the routing config per layer index (None = vanilla pass-through, still counted).
        decode_only: reroute only decode steps (block input ``[B, S, H]`` with ``S <= decode_tokens``).
        decode_tokens: the most tokens per sequence a decode step runs (1; 1 + d for speculative verify steps).
    """

    def __init__(self, layers: list[MoELayer], configs: dict[int, object | None], decode_only: bool,
                 decode_tokens: int = 1) -> None:
        self.layers = layers
        self.configs = configs
        self.decode_only = decode_only
        self.decode_tokens = decode_tokens
        self._state = _HandleState(decode_only, decode_tokens)
        self._hooks = {layer.index: _LayerHook(layer, configs[layer.index], self._state) for layer in layers}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._legacy: list[nn.Module] = []
        self._removed = False

    @property
    def enabled(self) -> bool:
        """When False, every layer passes the router's own routing through (decode steps still counted)."""
        return self._state.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"enabled must be a bool, got {value!r}")
        self._state.enabled = value

    @property
    def rerouted_layers(self) -> list[int]:
        """Indices of the layers whose routing OEA rewrites (validated, with a config)."""
        return [i for i, hook in self._hooks.items() if hook.validated and hook.cfg is not None]

    def _install(self) -> None:
        """Check each rerouted layer (k0 = k identity), then register its hooks."""
        for layer in self.layers:
            hook = self._hooks[layer.index]
            if hook.cfg is not None:
                reason = hook.validate()
                if reason is not None:
                    warnings.warn(
                        f"oea: layer {layer.index} ({layer.name}, {type(layer.router).__name__}) left on "
                        f"its own routing: the k0=k recomputation does not reproduce the router ({reason})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                else:
                    hook.validated = True
            self._handles.append(layer.block.register_forward_pre_hook(hook.block_pre_hook, with_kwargs=True))
            self._handles.append(layer.block.register_forward_hook(hook.block_post_hook, always_call=True))
            if layer.legacy:
                original = getattr(layer.block, LEGACY_ROUTE_METHOD)
                setattr(layer.block, LEGACY_ROUTE_METHOD, hook.legacy_route(original))
                self._legacy.append(layer.block)
            else:
                self._handles.append(layer.router.register_forward_hook(hook.router_hook, with_kwargs=True))
            ATTACHED[layer.router] = self._state

    def remove(self) -> None:
        """Remove every hook; the model is exactly as before ``attach``. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block in self._legacy:
            if getattr(block.__dict__.get(LEGACY_ROUTE_METHOD), "__oea_wrapper__", False):
                del block.__dict__[LEGACY_ROUTE_METHOD]
        self._legacy.clear()
        for layer in self.layers:
            if ATTACHED.get(layer.router) is self._state:
                del ATTACHED[layer.router]
        self._removed = True

    def __enter__(self) -> OEAHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def reset_stats(self) -> None:
        """Zero every layer's counters."""
        for hook in self._hooks.values():
            hook.counts.zero_()
            hook.last_active.zero_()

    def stats(self) -> dict[int, dict[str, Any]]:
        """Per-layer statistics over the decode steps seen since attach / ``reset_stats()``.

        Returns ``{layer_index: {...}}`` with
            ``name`` (block module name), ``router`` (router class), ``rerouted`` (OEA rewrites
            this layer), ``policy`` (config class name, None when not rerouted), ``k``, ``k0``
            (None when not rerouted or the policy has no single k0), ``num_experts``, ``steps`` (decode
            calls), ``tokens`` (rows over those calls), ``mean_active_experts`` (distinct experts with
            non-zero weight per step), ``mean_active_experts_vanilla`` (distinct experts the model's
            own router picked per step), ``mean_experts_per_token`` (non-zero-weight slots per row).
        Means are 0.0 when no decode step was seen.
        """
        out: dict[int, dict[str, Any]] = {}
        for index, hook in self._hooks.items():
            steps, tokens, active, vanilla, slots = (int(v) for v in hook.counts.tolist())
            rerouted = hook.validated and hook.cfg is not None
            out[index] = {
                "name": hook.layer.name,
                "router": type(hook.layer.router).__name__,
                "rerouted": rerouted,
                "k": hook.layer.spec.top_k,
                "policy": type(hook.cfg).__name__ if rerouted else None,
                "k0": getattr(hook.cfg, "k0", None) if rerouted else None,
                "num_experts": hook.layer.spec.num_experts,
                "steps": steps,
                "tokens": tokens,
                "mean_active_experts": active / steps if steps else 0.0,
                "mean_active_experts_vanilla": vanilla / steps if steps else 0.0,
                "mean_experts_per_token": slots / tokens if tokens else 0.0,
            }
        return out

    def last_active_experts(self) -> dict[int, int]:
        """Distinct active experts per layer in the most recent decode step (0 before any)."""
        return {index: int(hook.last_active) for index, hook in self._hooks.items()}

    def __repr__(self) -> str:
        state = "removed" if self._removed else ("enabled" if self.enabled else "disabled")
        return f"OEAHandle({len(self.layers)} MoE layers, rerouted={self.rerouted_layers}, {state})"
