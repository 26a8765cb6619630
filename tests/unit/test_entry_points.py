"""The adapters' public entry points, reached the way their callers reach them: the pyproject entry points
(vLLM and SGLang load ``module:register`` by name), the ``oea`` facade, and what ``oea doctor`` imports."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from hang_guard import CHILD_TIMEOUT_S


@pytest.mark.parametrize(("group", "package"), [("vllm.general_plugins", "oea.integrations.vllm"),
                                                ("sglang.srt.plugins", "oea.integrations.sglang")])
def test_engine_entry_points_load_the_plugins_register(group: str, package: str) -> None:
    (entry,) = [ep for ep in entry_points(group=group) if ep.name == "oea"]
    assert entry.value == f"{package}:register"
    register = entry.load()
    assert register is importlib.import_module(f"{package}.plugin").register
    assert register is importlib.import_module(package).register


def test_facade_attach_is_the_transformers_adapters_and_loads_lazily() -> None:
    code = ("import sys, oea; before = 'oea.integrations.transformers' in sys.modules; "
            "from oea.integrations.transformers.attach import attach, maybe_attach; "
            "print(before, oea.attach is attach, oea.maybe_attach is maybe_attach)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          check=True)
    assert done.stdout.split() == ["False", "True", "True"], done.stdout + done.stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang", "transformers"])
def test_every_adapter_gives_the_doctor_what_it_calls(engine: str) -> None:
    adapter = importlib.import_module(f"oea.integrations.{engine}")
    assert callable(adapter.engine_version) and callable(adapter.doctor_checks)
    assert adapter.doctor_checks is importlib.import_module(f"oea.integrations.{engine}.doctor").doctor_checks
