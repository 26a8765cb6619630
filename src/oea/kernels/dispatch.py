"""``route_fast``: ``oea.route``'s contract through the fastest implementation that reproduces it.

Which implementation (``choose_impl``):

* ``"numba"``: CPU tensors, numba installed (``oea.kernels.numba_cpu``): one compiled call.
* ``"triton"``: CUDA tensors, Triton installed (``oea.kernels.triton_gpu``): two kernel launches (three for
  sigmoid routers: torch's own sigmoid first), fixed shapes, no host synchronisation, CUDA-graph capturable.
  CPU tensors run in Triton's interpreter when ``TRITON_INTERPRET=1`` (the CPU tests do this).
* ``"torch"``: ``oea.route`` itself, for every call a kernel cannot reproduce exactly (``p < 1``, the other
  policies, a correction bias with non-finite values, other devices, an empty batch) and where no kernel
  library is installed. ``impl="auto"`` falls back to it; asking for a kernel by name raises
  ``KernelUnavailableError`` naming what is missing instead.

Exactness (tested in ``tests/unit/test_kernels*.py``, swept by ``scripts/kernel_sweep.py``): the ids are
bit-equal to ``oea.route``'s, slot by slot (the kernels rank by the same float32 scores with the same tie
rule); the weights are equal within ``WEIGHT_RTOL`` relative + ``WEIGHT_ATOL`` absolute: the kernels compute
``exp`` and sums in float64 from the same float32 inputs, while torch uses its own float32 ``exp``
(Sleef on CPU, CUDA's on GPU) and summation order, which no other code reproduces to the bit. Every weight
the core sets to 0 by rule (filler slots, rows without a finite logit, ``keep`` False) is exactly 0.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from oea.kernels.numba_cpu import NumbaRouter, numba_available
from oea.kernels.params import KernelParams, kernel_params
from oea.kernels.triton_gpu import interpreter_ready, triton_available, triton_route
from oea.routing import AdaptiveK0Config, RouterSpec, route
from oea.routing.policies import check_route_args

IMPLS: tuple[str, ...] = ("auto", "numba", "triton", "torch")
WEIGHT_RTOL = 2e-6
WEIGHT_ATOL = 1e-12

_BIAS_FINITE: weakref.WeakKeyDictionary[RouterSpec, bool] = weakref.WeakKeyDictionary()
# spec -> {(cfg, device type, rows or None, impl, interpreter): (impl, params, prepared numba kernel or None)}
_PLANS: weakref.WeakKeyDictionary[RouterSpec, dict[tuple, tuple[str, KernelParams | None, Any]]] = (
    weakref.WeakKeyDictionary())


class KernelUnavailableError(RuntimeError):
    """A kernel asked for by name cannot run this call (library missing, wrong device, unsupported option)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _bias_reason(spec: RouterSpec, device: torch.device) -> str | None:
    """Why the spec's correction bias rules the kernels out (non-finite values), checked once per spec."""
    bias = spec.correction_bias
    if bias is None:
        return None
    finite = _BIAS_FINITE.get(spec)
    if finite is None:
        if _capturing(bias.device):  # a host read is not allowed here; the core is graph-safe
            return "correction_bias not checked yet (first call inside CUDA-graph capture)"
        finite = _BIAS_FINITE[spec] = bool(torch.isfinite(bias).all())
    return None if finite else "correction_bias has non-finite values"


def _kernel_for_device(device: torch.device) -> tuple[str | None, str]:
    """(the kernel for this device, or None; why not)."""
    if device.type == "cpu":
        if numba_available():
            return "numba", ""
        if _interpreting() and triton_available() and interpreter_ready():
            return "triton", ""
        return None, "numba is not installed (pip install numba)"
    if device.type == "cuda":
        return ("triton", "") if triton_available() else (None, "Triton is not installed (pip install triton)")
    return None, f"no routing kernel for device {device.type!r}"


def _requested(impl: str, device: torch.device) -> str | None:
    """Why the kernel ``impl`` cannot run on ``device`` (None: it can)."""
    if impl == "numba":
        if device.type != "cpu":
            return f"the numba kernel runs on CPU tensors, got device {device.type!r}"
        return None if numba_available() else "numba is not installed (pip install numba)"
    if not triton_available():
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and _interpreting():
        if interpreter_ready():
            return None
        return ("TRITON_INTERPRET=1 was set after Triton was imported in this process; Triton reads it at "
                "import, so set it before the first import (for example in the environment)")
    if device.type == "cpu":
        return "the Triton kernel runs on CUDA tensors, got device 'cpu' (TRITON_INTERPRET=1 runs it on CPU)"
    return f"the Triton kernel runs on CUDA tensors, got device {device.type!r}"


def plan(router_logits: torch.Tensor, spec: RouterSpec, cfg: object | None = None,
         impl: str = "auto") -> tuple[str, KernelParams | None]:
    """(the implementation ``route_fast`` uses for this call, its kernel parameters or None for ``"torch"``).

    Raises ``ValueError`` for an unknown ``impl`` and ``KernelUnavailableError`` when a kernel named by
    ``impl`` cannot run the call.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch", None
    device = router_logits.device
    if impl == "auto":
        chosen, _ = _kernel_for_device(device)
        if chosen is None:
            return "torch", None
    else:
        missing = _requested(impl, device)
        if missing is not None:
            raise KernelUnavailableError(f"impl={impl!r}: {missing}")
        chosen = impl
    params = kernel_params(spec, cfg, router_logits.shape[0])
    reason = params if isinstance(params, str) else _bias_reason(spec, device)
    if reason is None and router_logits.shape[0] == 0:
        reason = "an empty batch"
    if reason is not None:
        if impl != "auto":
            raise KernelUnavailableError(f"impl={impl!r} cannot reproduce oea.route here: {reason}")
        return "torch", None
    assert not isinstance(params, str)
    return chosen, params


def choose_impl(router_logits: torch.Tensor, spec: RouterSpec, cfg: object | None = None) -> str:
    """The implementation ``route_fast(router_logits, spec, cfg)`` runs: "numba", "triton" or "torch"."""
    return plan(router_logits, spec, cfg)[0]


def _cached_plan(router_logits: torch.Tensor, spec: RouterSpec, cfg: object | None, impl: str
                 ) -> tuple[str, KernelParams | None, Any]:
    """``plan`` remembered per spec object (and config, device, implementation; rows for adaptive k0)."""
    try:
        key = (cfg, router_logits.device.type, router_logits.shape[0] if isinstance(cfg, AdaptiveK0Config) else None,
               impl, _interpreting())
        hash(key)
    except TypeError:  # a config that is not hashable: plan every call
        chosen, params = plan(router_logits, spec, cfg, impl)
        return chosen, params, None
    plans = _PLANS.get(spec)
    if plans is None:
        plans = _PLANS[spec] = {}
    found = plans.get(key)
    if found is None:
        chosen, params = plan(router_logits, spec, cfg, impl)
        prepared = NumbaRouter(params, spec.correction_bias, spec.num_experts) if (
            chosen == "numba" and params is not None) else None
        found = plans[key] = (chosen, params, prepared)
    return found


def route_fast(router_logits: torch.Tensor, spec: RouterSpec, cfg: object | None = None,
               valid: torch.Tensor | None = None, *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``oea.route`` through a fast kernel where one reproduces it (same arguments, same results).

    Args:
        router_logits: [M, N] raw router logits (float32, bf16, fp16; other float dtypes are cast).
        spec / cfg / valid: as ``oea.route`` (same validation, same ``ValueError`` messages).
        impl: ``"auto"`` (the fastest exact implementation, else ``oea.route``), or ``"numba"``,
            ``"triton"``, ``"torch"`` to force one (a kernel that cannot run raises ``KernelUnavailableError``).

    Returns:
        ``ids`` [M, k] int64 (bit-equal to ``oea.route``'s) and ``weights`` [M, k] float32 (within
        ``WEIGHT_RTOL`` / ``WEIGHT_ATOL``; exact zeros where the core's are zero by rule).
    """
    check_route_args(router_logits, spec, cfg, valid)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    chosen, params, prepared = _cached_plan(router_logits, spec, cfg, impl)
    if chosen == "torch" or params is None:
        return route(router_logits, spec, cfg, valid)
    if prepared is not None:
        return prepared(router_logits, valid)
    if chosen == "numba":
        return NumbaRouter(params, spec.correction_bias, spec.num_experts)(router_logits, valid)
    routed = triton_route(router_logits, params, spec.correction_bias, valid)
    return route(router_logits, spec, cfg, valid) if routed is None else routed  # None: cannot compile here
