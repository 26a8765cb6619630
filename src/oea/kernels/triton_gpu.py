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

import warnings
from dataclasses import dataclass
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


TILE_ELEMENTS = 4096  # [BM, BN] elements per program: BM = min(16, TILE_ELEMENTS // BN)
ELEMENTS_PER_THREAD = 8  # warps per program: BM * BN / (32 * this), so no [BM, BN] int64 key spills
MAX_WARPS = 8  # at 16 warps ptxas held phase1 (N = 512, float32) to 64 registers and spilled on sm_90 / sm_100


@dataclass(frozen=True)
class Launch:
    """One kernel launch as ``triton_route`` makes it: ``kernel[grid](*args, **kwargs)``.

    ``kwargs`` hold the constexprs (the specialisation: ``N``, ``K``, ``KP``, ``BM``, ``BN``, ``SIGMOID``,
    ``N_GROUP``, ``GP``, ``HAS_VALID``) and the launch option ``num_warps``; the pointer dtypes in ``args``
    complete it. ``oea.kernels.aot`` compiles exactly these for CUDA targets without a GPU.
    """

    kernel: str  # "phase1" | "phase2" (attributes of oea.kernels.triton_source)
    grid: tuple[int]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def launches(router_logits: torch.Tensor, params: KernelParams, correction_bias: torch.Tensor | None,
             valid: torch.Tensor | None) -> tuple[tuple[Launch, ...], tuple[torch.Tensor, torch.Tensor]]:
    """The two launches of one call ([M, N] logits) and their outputs (ids [M, k] int64, weights [M, k]
    float32, allocated here, written by the launches). Sigmoid routers run torch's sigmoid here first."""
    rows, n = router_logits.shape
    device = router_logits.device
    k, k0 = params.top_k, params.k0
    block_n = _next_pow2(n)
    block_m = max(1, min(16, TILE_ELEMENTS // block_n))
    num_warps = max(1, min(MAX_WARPS, _next_pow2(block_m * block_n // (32 * ELEMENTS_PER_THREAD))))
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
             "N_GROUP": params.n_group, "GP": _next_pow2(params.n_group), "HAS_VALID": valid is not None,
             "num_warps": num_warps}
    common = (k0, params.topk_group, int(params.cross_fill), int(correction_bias is not None))
    first = Launch("phase1", (tiles,), (x, bias, valid_arg, vanilla, union, counts, rows, *common), shape)
    second = Launch("phase2", (tiles,), (x, bias, valid_arg, vanilla, union, counts, ids, weights, rows, tiles,
                                         params.scaling, *common, int(params.pruned), params.max_experts,
                                         params.max_rank, params.min_batch, int(params.renormalize),
                                         int(params.renormalize_rerouted)), shape)
    return (first, second), (ids, weights)


def specialisation_key(launch: Launch) -> tuple[Any, ...]:
    """What makes Triton compile a new kernel for a launch: its constexprs and options, and its tensors'
    dtypes (the same for both launches of a call)."""
    return (*launch.kwargs.values(), *(a.dtype for a in launch.args[:3]))


# (device, specialisation) -> why it failed to compile (its calls run oea.route); and those that ran
FAILED: dict[tuple[Any, ...], str] = {}
_LAUNCHED: set[tuple[Any, ...]] = set()


def triton_route(router_logits: torch.Tensor, params: KernelParams, correction_bias: torch.Tensor | None,
                 valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The routing of one call: [M, N] logits (CUDA, or CPU under ``TRITON_INTERPRET=1``) -> ids [M, k]
    int64, weights [M, k] float32. Callers check ``triton_available()`` and the params
    (``oea.kernels.dispatch``).

    Returns None when this specialisation's kernels cannot be compiled for the device: the first launch of
    a specialisation on a device compiles it, and a failure there is warned about once (naming the device,
    the specialisation and the error) and remembered, so the caller runs ``oea.route`` for it from then on.
    An error of a specialisation that has run before is not a compile failure and propagates.
    """
    source = _compile()
    calls, out = launches(router_logits, params, correction_bias, valid)
    device = router_logits.device
    key = (device, *specialisation_key(calls[1]))
    if key in FAILED:
        return None
    try:
        for call in calls:
            getattr(source, call.kernel)[call.grid](*call.args, **call.kwargs)
    except Exception as err:
        if key in _LAUNCHED:
            raise
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        FAILED[key] = reason
        warnings.warn(f"oea.kernels: the Triton routing kernel for N={calls[1].kwargs['N']} "
                      f"K={calls[1].kwargs['K']} ({'sigmoid' if params.sigmoid else 'softmax'}, "
                      f"{calls[1].args[0].dtype}) cannot be compiled for {_device_name(device)}: {reason}; "
                      "these calls run oea.route instead", RuntimeWarning, stacklevel=3)
        return None
    _LAUNCHED.add(key)
    return out


def _device_name(device: torch.device) -> str:
    """``cuda:0 (sm_90)``, or the device itself where there is no capability to name."""
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} (sm_{major}{minor})"
