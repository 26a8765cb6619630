"""TEST SUPPORT, NOT SGLang's kernel library: a stand-in for SGLang's C++ package ``sgl_kernel`` on CPU.

What it replaces: ``sgl_kernel`` (PyPI ``sgl-kernel`` / ``sglang-kernel``), whose CPU build (AMX / AVX-512 C++
kernels) is not on the package index. With ``SGLANG_USE_CPU_ENGINE=1`` a few SGLang 0.5.23 modules import it at
module level, first ``sglang/srt/mem_cache/allocation.py`` (``assign_req_to_token_pool_cpu``, which the scheduler
needs), so SGLang's CPU server cannot start without some ``sgl_kernel``.

What it provides:

* ``assign_req_to_token_pool_cpu``: the one kernel SGLang calls on its native CPU path, in plain torch (the same
  writes as SGLang's Triton ``assign_req_to_token_pool``).
* any other public name: a function that raises ``NotImplementedError`` naming this stand-in, so a module-level
  ``from sgl_kernel import X`` succeeds and calling ``X`` says clearly what is missing.

It registers NO ``torch.ops.sgl_kernel`` op: SGLang's own capability checks (``cpu_has_amx_support()`` looks for
``torch.ops.sgl_kernel.convert_weight_packed``; qwen3_moe's fused qk-norm/rope checks ``hasattr(torch.ops.sgl_kernel,
...)``) therefore keep choosing SGLang's torch-native paths: ``forward_native`` norms and activations,
``fused_topk_torch_native`` routing, ``moe_forward_native`` experts, ``torch_native`` attention.

It is put on ``PYTHONPATH`` only on request (``oea.launch.sglang_server.start_server(..., stand_in=True)``,
``oea serve sglang --sgl-kernel-stand-in``, ``scripts/install_sglang_cpu.sh``'s import check) and is never
installed: it lives in the source tree's ``tests/support/``, which the ``oea`` wheel does not contain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+oea.stand.in"
STAND_IN = True  # lets a caller tell this module from the real package


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its ``req_to_token`` row, in place.

    Args:
        req_pool_indices: [B] the requests' rows of ``req_to_token``.
        req_to_token: [R, pool_len] token index -> KV-cache slot, per request row.
        start_offset, end_offset: [B] the token range ``[start, end)`` of each request to write.
        out_cache_loc: [sum(end - start)] the new slots, request after request in batch order.
        pool_len: ``req_to_token.shape[1]`` (SGLang passes it; checked, not needed).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"sgl_kernel stand-in: pool_len {pool_len} != req_to_token.shape[1] {req_to_token.shape[1]}")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        length = end - start
        if length > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + length].to(req_to_token.dtype)
        offset += length


def _missing(name: str) -> Callable[..., Any]:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by OEA's test-support sgl_kernel stand-in "
            "(oea/launch/sgl_kernel_stand_in): only assign_req_to_token_pool_cpu is; this SGLang path needs the "
            "real sgl_kernel package")

    missing.__name__ = missing.__qualname__ = name
    return missing


def __getattr__(name: str) -> Any:
    """Module-level imports of any other kernel name succeed; calling it raises ``NotImplementedError``."""
    if name.startswith("__"):  # import machinery and introspection probe dunders: keep them honest
        raise AttributeError(name)
    return _missing(name)
