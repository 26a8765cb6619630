"""``oea.route`` as two Triton kernel launches (GPU; Triton's interpreter runs them on CPU for the tests).

Launch 1 (one program per tile of ``BLOCK_M`` rows): the family scores, the group limit, each row's vanilla
top-k (written to a scratch buffer), the tile's share of the union (its valid rows' top-k0) and its count
of valid rows. Launch 2 (same tiles): the union and the valid-row count from every tile, then each row's
fill from the union and its weights. Fixed shapes, no host synchronisation, buffers from the caching
allocator: CUDA-graph capturable. Sigmoid routers take torch's own float32 sigmoid as input (one more
launch) so that the scores they rank are ``oea.route``'s to the bit.

Ranking: int64 keys ``ordered(float32 score) * N + (N - 1 - index)``, the rule of ``oea.routing.ranking``.
Weights: ``exp`` and sums in float64 from the float32 inputs (see ``oea.kernels.dispatch``).
"""

from __future__ import annotations

from typing import Any

import torch

from oea.kernels.params import KernelParams

_TRITON: dict[str, Any] = {}


def triton_available() -> bool:
    """Whether Triton can be imported (checked once per process)."""
    if "available" not in _TRITON:
        try:
            import triton  # noqa: F401
        except ImportError:
            _TRITON["available"] = False
        else:
            _TRITON["available"] = True
    return bool(_TRITON["available"])


def interpreter_ready() -> bool:
    """Whether Triton's own language functions were built for its CPU interpreter.

    Triton reads ``TRITON_INTERPRET`` when it is first imported; set later, the kernels fail inside the
    interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel").
    """
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.max, InterpretedFunction)


def _compile() -> Any:
    """The Triton kernels (``oea.kernels.triton_source``, imported now). ``TRITON_INTERPRET`` is read when
    that module is first imported: set it before the first call."""
    if "source" not in _TRITON:
        import oea.kernels.triton_source as source

        _TRITON["source"] = source
    return _TRITON["source"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_route(router_logits: torch.Tensor, params: KernelParams, correction_bias: torch.Tensor | None,
                 valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of one call: [M, N] logits (CUDA, or CPU under ``TRITON_INTERPRET=1``) -> ids [M, k]
    int64, weights [M, k] float32. Callers check ``triton_available()`` and the params
    (``oea.kernels.dispatch``)."""
    source = _compile()
    phase1, phase2 = source.phase1, source.phase2
    rows, n = router_logits.shape
    device = router_logits.device
    k, k0 = params.top_k, params.k0
    block_n = _next_pow2(n)
    block_m = max(1, min(16, 4096 // block_n))
    tiles = -(-rows // block_m)
    kp = _next_pow2(k)
    x = router_logits.contiguous()
    if params.sigmoid:  # torch's own float32 sigmoid: the scores the core ranks, to the bit
        x = torch.sigmoid(x.float())
    elif x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    bias = x if correction_bias is None else correction_bias.to(device=device, dtype=torch.float32).contiguous()
    valid_arg = x if valid is None else valid.contiguous()
    vanilla = torch.empty((rows, kp), dtype=torch.int32, device=device)
    union = torch.empty((tiles, block_n), dtype=torch.int8, device=device)
    counts = torch.empty((tiles,), dtype=torch.int32, device=device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=device)
    weights = torch.empty((rows, k), dtype=torch.float32, device=device)
    shape = {"N": n, "K": k, "KP": kp, "BM": block_m, "BN": block_n, "SIGMOID": params.sigmoid,
             "N_GROUP": params.n_group, "GP": _next_pow2(params.n_group), "HAS_VALID": valid is not None}
    common = (k0, params.topk_group, int(params.cross_fill), int(correction_bias is not None))
    phase1[(tiles,)](x, bias, valid_arg, vanilla, union, counts, rows, *common, **shape)
    phase2[(tiles,)](x, bias, valid_arg, vanilla, union, counts, ids, weights, rows, tiles, params.scaling, *common,
                     int(params.pruned), params.max_experts, params.max_rank, params.min_batch,
                     int(params.renormalize), int(params.renormalize_rerouted), **shape)
    return ids, weights
