"""The hook-target declarations and their ``ast`` checker (``tests/engines/wheel_source.py``), without the wheels.

* The vLLM plugin cannot name a vLLM module, class or function that ``vllm/targets.py`` does not declare (so
  the CUDA-release check, ``tests/engines/test_cuda_release_targets.py``, covers everything it touches).
* The checker, on a small wheel made here: a missing module, class, method, attribute or parameter, a wrong
  leading parameter and a call the body no longer makes each fail, naming the target.
"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest

from oea.integrations.hook_targets import HookTarget
from oea.integrations.vllm import targets as vllm_targets
from tests.engines.wheel_source import WheelSource

ROOT = Path(__file__).resolve().parents[2]


def _vllm_names_in_plugin() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` in the vLLM plugin's modules."""
    found = set()
    for path in (ROOT / "src" / "oea" / "integrations" / "vllm").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                found |= {(node.module, alias.name) for alias in node.names}  # type: ignore[misc]
    return found


def test_cuda_release_every_vllm_name_the_plugin_imports_is_declared() -> None:
    declared = {(t.module, t.name.split(".")[0]) for t in vllm_targets.TARGETS}
    missing = sorted(f"{module}.{name}" for module, name in _vllm_names_in_plugin() if (module, name) not in declared)
    assert missing == [], f"declare these in oea/integrations/vllm/targets.py TARGETS: {missing}"
    assert len(_vllm_names_in_plugin()) >= 8


def test_cuda_release_the_wrapped_router_classes_are_the_declared_ones() -> None:
    from oea.integrations.vllm import plugin

    assert plugin.ROUTER_CLASSES is vllm_targets.ROUTER_CLASSES
    wrapped = {t.name.split(".")[0] for t in vllm_targets.TARGETS if t.name.endswith("._compute_routing")}
    assert wrapped == set(vllm_targets.ROUTER_CLASSES)


ENGINE = '''
from engine.base import Base as Parent

class Router(Parent):
    limit = 3
    def __init__(self, top_k):
        self.top_k = top_k

    def route(self, hidden, logits, *, ids=None):
        return dispatch(logits)

def dispatch(x):
    return x
'''
BASE = '''
class Base:
    def __init__(self):
        self.experts = 8

    @property
    def monolithic(self):
        return True
'''


@pytest.fixture
def source(tmp_path: Path) -> WheelSource:
    path = tmp_path / "engine-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("engine/__init__.py", "")
        whl.writestr("engine/router.py", ENGINE)
        whl.writestr("engine/base.py", BASE)
    return WheelSource(path)


def test_cuda_release_checker_finds_what_is_there(source: WheelSource) -> None:
    present = [HookTarget("engine.router", "Router.route", leading=("self", "hidden", "logits"), parameters=("ids",),
                          calls=("dispatch",)),
               HookTarget("engine.router", "Router", kind="class"),
               HookTarget("engine.router", "Router.top_k", kind="attribute"),
               HookTarget("engine.router", "Router.limit", kind="attribute"),
               HookTarget("engine.router", "Router.experts", kind="attribute"),  # a base class's
               HookTarget("engine.router", "Router.monolithic"),  # a base class's property
               HookTarget("engine.router", "dispatch", leading=("x",)),
               HookTarget("engine.router", "Parent", kind="class")]  # imported under another name
    assert [source.check(t) for t in present] == [None] * len(present)


@pytest.mark.parametrize(("target", "problem"), [
    (HookTarget("engine.gone", "Router"), "engine.gone.Router (engine-1.0-py3-none-any.whl): module engine.gone is "
                                          "missing"),
    (HookTarget("engine.router", "Gate", kind="class"), "Gate not found in engine.router"),
    (HookTarget("engine.router", "Router.select"), "Router.select not found in engine.router"),
    (HookTarget("engine.router", "Router.bias", kind="attribute"), "Router.bias not found"),
    (HookTarget("engine.router", "Router.route", parameters=("num_token_non_padded",)),
     "lacks parameter(s) ['num_token_non_padded'] (has ['hidden', 'ids', 'logits', 'self'])"),
    (HookTarget("engine.router", "Router.route", leading=("self", "logits")),
     "leading parameters ('self', 'hidden', 'logits'), expected ('self', 'logits')"),
    (HookTarget("engine.router", "Router.route", calls=("remap|to_physical",)), "does not call ['remap|to_physical']"),
    (HookTarget("engine.router", "Router.limit"), "not a function (Assign)"),
], ids=lambda x: x if isinstance(x, str) else x.name)
def test_cuda_release_checker_names_what_is_missing(source: WheelSource, target: HookTarget, problem: str) -> None:
    found = source.check(target)
    assert found is not None and problem in found and found.startswith(target.path)
