"""Make SGLang's routing module importable on a CPU-only test venv (see design/cpu-recipes.md §3.3).

``import sglang.srt.layers.moe.topk`` reaches ``torchvision.transforms`` through SGLang's
multimodal configs, and the PyPI torchvision breaks next to the CPU torch. ``install()`` appends
an import finder that serves ``torchvision*`` as MagicMock modules; a real torchvision, where one
is installed, still wins because the finder is appended last. Dynamo is disabled so SGLang's
``@torch.compile`` top-k helpers run eagerly (Inductor on CPU costs ~20 s per new shape).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from unittest.mock import MagicMock


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> MagicMock:
        module = MagicMock(name=spec.name)
        module.__spec__ = spec
        module.__path__ = []
        module.__name__ = spec.name
        module.__file__ = None
        return module

    def exec_module(self, module: object) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def install() -> None:
    """Install the torchvision stub and disable Dynamo; call before importing sglang."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)  # its backend needs sgl_kernel, which has no CPU build
    import torch

    torch.set_num_threads(1)
    torch._dynamo.config.disable = True
    import transformers.utils.import_utils as import_utils

    import_utils.is_torchvision_available()  # cache False before the stub exists
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.append(_StubFinder())
