"""Test support for the SGLang CPU servers of tests/engines: routed-experts return (``--enable-return-routed-experts``)
on a machine without CUDA.

SGLang 0.5.23's routed-experts capturer allocates its host buffer with ``alloc_with_host_register(...,
pin_memory=True)``, which pins it with ``cudaHostRegister`` (``_cuda_host_register``); without CUDA that raises
(``Torch not compiled with CUDA enabled``) and the server stops at start-up. Pinning only speeds up device-to-host
copies, and on a CPU server there is no device: with this folder on ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up in every process of the server) ``_cuda_host_register`` and its unregister twin do
nothing when torch has no CUDA. Nothing else of SGLang changes: the capture, its buffers and the response are
SGLang's own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

TARGET = "sglang.srt.mem_cache.pool_host.common"


def _no_pinning(module: Any) -> None:
    import torch

    if torch.cuda.is_available():
        return
    module._cuda_host_register = lambda *args, **kwargs: None
    module._cuda_host_unregister = lambda *args, **kwargs: None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _no_pinning(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Finder())
