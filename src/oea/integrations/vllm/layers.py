"""Per-layer k0 in the vLLM plugin (``OEA_LAYER_K0_FILE``, written by ``oea calibrate``), optionally per
batch-size range (the file's ``batch_k0``).

``load`` (model load) reads the file once through ``oea.config.layer_k0_policies`` for the model's MoE
routers (router id = MoE layer index, in model order) and fails start-up naming the variable and the file
when it does not fit the model. ``layer_config`` is what the hot path asks for each routing call: the
call's config with the layer's k0 (and ``min_batch``) put in. A per-batch-size k0 is looked up from the
call's row count M: on CPU the custom op sees it on every call; under CUDA graphs M is the captured
graph's (padded) batch size, a static shape, so the choice is made when the graph is captured and costs
nothing at replay (no host synchronisation). Configs are built once per (router, k0) and reused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from oea.config import layer_k0_policies
from oea.integrations.vllm.state import STATE, log
from oea.routing import AdaptiveK0Config, OEAConfig, RouterSpec

_CONFIGS: dict[tuple[int, int], tuple[Any, Any]] = {}  # (router id, k0) -> (the default it was made from, config)


def load(specs: list[RouterSpec | None]) -> None:
    """Read ``OEA_LAYER_K0_FILE`` for the model's routers (``specs``: one per router, None = stock layer).

    Raises ``ValueError`` naming the variable and the file when it was calibrated for another model or does
    not fit ``OEA_MAX_EXPERTS``; nothing happens without the file or without ``OEA_K0``.
    """
    settings = STATE.settings
    STATE.layer_policies = None
    _CONFIGS.clear()
    if settings is None or settings.oea is None or not settings.layer_k0_file:
        return
    known = [spec for spec in specs if spec is not None]
    if not known:
        return
    policies = layer_k0_policies(settings, known[0].num_experts, known[0].top_k, len(specs))
    assert policies is not None
    STATE.layer_policies = policies
    log.info("oea: per-layer k0 from OEA_LAYER_K0_FILE=%s: %s", settings.layer_k0_file, describe(policies))


def describe(policies: list[OEAConfig | AdaptiveK0Config]) -> str:
    """One line: each layer's k0, or its k0 per batch-size range."""
    parts = []
    for policy in policies:
        if isinstance(policy, AdaptiveK0Config):
            parts.append("/".join(f"{k0}(<={b})" for b, k0 in policy.schedule))
        else:
            parts.append(str(policy.k0))
    return "k0 per layer " + " ".join(parts)


def layer_config(router_id: int | None, rows: int, default: Any) -> Any:
    """The config of router ``router_id`` for a call of ``rows`` rows: ``default`` (``OEA_K0``'s, or the EP
    policy's) with the file's k0 and ``min_batch`` for this layer and batch size; ``default`` itself without
    the file, for unnumbered routers, or when OEA is off."""
    policies = STATE.layer_policies
    if policies is None or default is None or router_id is None or router_id >= len(policies):
        return default
    policy = policies[router_id]
    k0 = policy.k0_for(rows) if isinstance(policy, AdaptiveK0Config) else policy.k0
    cached = _CONFIGS.get((router_id, k0))
    if cached is None or cached[0] is not default:  # a new default (settings, an EP placement update): rebuild
        if type(default) is OEAConfig:
            config = policy.config(k0) if isinstance(policy, AdaptiveK0Config) else policy
        else:  # another policy with a k0 (EP-aware OEA): its own fields, the layer's k0
            changes: dict[str, Any] = {"k0": k0, "min_batch": policy.min_batch}
            if getattr(default, "boost_rank", None) is not None:
                changes["boost_rank"] = max(default.boost_rank, k0)
            config = dataclasses.replace(default, **changes)
        cached = _CONFIGS[(router_id, k0)] = (default, config)
    return cached[1]
