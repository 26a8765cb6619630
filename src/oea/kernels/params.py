"""What a routing kernel needs to know about one call, and which calls a kernel can reproduce exactly.

``kernel_params(spec, cfg, rows)`` turns a ``RouterSpec`` and a policy config into plain numbers (the same
for every kernel), or into the reason no kernel reproduces ``oea.route`` for them; the dispatcher then
falls back to ``oea.route``.

Covered: vanilla routing (``cfg=None``), ``PrunedConfig``, ``OEAConfig`` with ``p = 1`` (any ``k0``,
``max_experts``, ``max_rank``, ``min_batch``, ``group_fill``) and ``AdaptiveK0Config`` (its k0 for the
call's row count), for softmax (± renormalise) and sigmoid routers (correction bias, groups, routed
scaling). Not covered: ``p < 1`` (the top-p baseline compares a float32 sum over all experts with p, and
a kernel cannot reproduce the summation order of ``torch.sum``, so a token at the boundary could keep a
different baseline) and the other policies (EP-aware OEA, budget, subtractive).
"""

from __future__ import annotations

from dataclasses import dataclass

from oea.routing import AdaptiveK0Config, OEAConfig, PrunedConfig, RouterSpec


@dataclass(frozen=True)
class KernelParams:
    """One routing call as plain numbers.

    Attributes:
        top_k: k. ``k0``: baseline experts (0: vanilla routing, no rerouting).
        pruned: ``PrunedConfig`` (each rerouted row keeps its own top-k0 only).
        max_experts / max_rank: OEA's caps (k and N when unset).
        min_batch: fewer valid rows than this -> vanilla routing for the whole call.
        renormalize: the router's own rule (vanilla rows); ``renormalize_rerouted``: rerouted rows.
        scaling: routed scaling factor. ``sigmoid``: sigmoid scoring (else softmax).
        n_group / topk_group: group limit (1 / 1: none). ``cross_fill``: ``group_fill="cross"``.
    """

    top_k: int
    k0: int
    pruned: bool
    max_experts: int
    max_rank: int
    min_batch: int
    renormalize: bool
    renormalize_rerouted: bool
    scaling: float
    sigmoid: bool
    n_group: int
    topk_group: int
    cross_fill: bool

    def as_ints(self) -> tuple[int, ...]:
        """The integer fields in the order the kernels read them (``INT_FIELDS``)."""
        return tuple(int(getattr(self, name)) for name in INT_FIELDS)


INT_FIELDS = ("top_k", "k0", "pruned", "max_experts", "max_rank", "min_batch", "renormalize",
              "renormalize_rerouted", "sigmoid", "n_group", "topk_group", "cross_fill")


def kernel_params(spec: RouterSpec, cfg: object | None, rows: int) -> KernelParams | str:
    """The numbers of one ``route(logits [rows, N], spec, cfg)`` call, or why no kernel reproduces it."""
    n, k = spec.num_experts, spec.top_k
    grouped = spec.grouped and spec.scoring == "sigmoid"  # the core applies a group limit to sigmoid routers only
    common = {"top_k": k, "renormalize": spec.renormalize, "scaling": float(spec.routed_scaling_factor),
              "sigmoid": spec.scoring == "sigmoid", "n_group": spec.n_group if grouped else 1,
              "topk_group": spec.topk_group if grouped else 1}
    if cfg is None:
        return KernelParams(k0=0, pruned=False, max_experts=k, max_rank=n, min_batch=0,
                            renormalize_rerouted=spec.renormalize, cross_fill=False, **common)  # type: ignore[arg-type]
    if isinstance(cfg, AdaptiveK0Config):
        cfg = cfg.config(cfg.k0_for(rows))
    if isinstance(cfg, PrunedConfig):
        renormalize = spec.renormalize if cfg.renormalize is None else cfg.renormalize
        return KernelParams(k0=cfg.k0, pruned=True, max_experts=k, max_rank=n, min_batch=0,
                            renormalize_rerouted=renormalize, cross_fill=False, **common)  # type: ignore[arg-type]
    if type(cfg) is not OEAConfig:
        return f"{type(cfg).__name__} has no kernel"
    if cfg.p < 1.0:
        return ("OEAConfig p < 1 has no exact kernel (the top-p baseline compares a float32 sum over every "
                "expert with p; its summation order is torch's own)")
    return KernelParams(k0=cfg.k0, pruned=False, max_experts=cfg.max_experts or k, max_rank=cfg.max_rank or n,
                        # OEAConfig bounds min_batch by MAX_MIN_BATCH (int32), so it fits the kernels' parameters
                        min_batch=cfg.min_batch, renormalize_rerouted=spec.renormalize,
                        cross_fill=grouped and cfg.group_fill == "cross", **common)  # type: ignore[arg-type]
