"""The project's scripts (``scripts/<name>.py``) loaded as modules, for the tests of their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py``, executed afresh as the module ``name`` (registered in ``sys.modules`` under that
    name: dataclasses and pickling look a class's module up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no script {SCRIPTS / f'{name}.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
