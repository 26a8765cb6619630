"""Fast implementations of ``oea.route``, engine-free (the layer between ``oea.routing`` and the adapters).

``route_fast(router_logits, spec, cfg=None, valid=None)`` (also ``oea.route_fast``) has ``oea.route``'s
signature and results and runs the fastest implementation that reproduces them (``dispatch.py``):

* ``numba_cpu.py``: one compiled CPU call (numba, imported on first use); the kernels in ``numba_kernels.py``,
  compiled once and then loaded from numba's on-disk cache by every later process (``route_at``: their entry
  over tensors by address, ``NumbaRouter.route_new``, the SGLang adapter's eager CPU call);
* ``triton_gpu.py``: two Triton launches on CUDA (Triton's interpreter runs them on CPU for the tests), the
  kernels themselves in ``triton_source.py``;
* ``oea.route`` itself for anything a kernel cannot reproduce exactly (``params.py`` says what is covered);
* ``aot.py``: the Triton kernels compiled ahead of time for a GPU capability; ``doctor_gpu.py``: ``oea doctor
  gpu`` (do the kernels compile, equal ``oea.route`` and replay in a CUDA graph on this GPU), and the check record
  every doctor shares.

Kernels import nothing of the project but ``oea.routing``; numba and Triton only inside functions
(``numba_kernels.py``, which imports numba at the top, is itself imported only on first use).
"""

from oea.kernels.dispatch import (
    IMPLS,
    WEIGHT_ATOL,
    WEIGHT_RTOL,
    KernelUnavailableError,
    choose_impl,
    plan,
    route_fast,
)
from oea.kernels.numba_cpu import NumbaRouter, numba_available, numba_route
from oea.kernels.params import KernelParams, kernel_params
from oea.kernels.triton_gpu import triton_available, triton_route

__all__ = [
    "IMPLS",
    "WEIGHT_ATOL",
    "WEIGHT_RTOL",
    "KernelParams",
    "KernelUnavailableError",
    "NumbaRouter",
    "choose_impl",
    "kernel_params",
    "numba_available",
    "numba_route",
    "plan",
    "route_fast",
    "triton_available",
    "triton_route",
]
