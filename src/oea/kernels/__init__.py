"""Fast implementations of OEA routing, engine-free (the layer between ``oea.routing`` and the adapters).

Each kernel computes what ``oea.route`` computes for the cases it covers (same ids, weights, filler rule
and padding semantics) and is tested against it; ``oea.route`` stays the graph-safe reference.

* ``fast_softmax_oea`` (``torch_softmax.py``): the simplified algorithm for ungrouped softmax routers in a
  few PyTorch ops (any device, traceable by Dynamo).
* ``numba_softmax_oea`` (``numba_cpu.py``): the same as one compiled CPU call; numba is imported on first
  use, and the function returns None where numba is missing.

Kernels import nothing of the project but ``oea.routing``; numba (and later Triton) only inside functions.
"""

from oea.kernels.numba_cpu import numba_available, numba_softmax_oea
from oea.kernels.torch_softmax import fast_softmax_oea

__all__ = ["fast_softmax_oea", "numba_available", "numba_softmax_oea"]
