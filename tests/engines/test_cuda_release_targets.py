"""The plugins' hook targets in the CUDA releases' source: every vLLM and SGLang name the plugins patch, wrap,
call or read on the GPU code path, found with the shape the plugin expects, read with ``ast`` from the wheels
``scripts/install_cuda_wheels.sh`` downloads (``make test`` runs it; nothing is installed or imported, no CUDA
torch needed). The targets come from the plugins' own declarations: ``oea.integrations.vllm.targets.TARGETS``,
and for SGLang the plugin's own hook plan for each release (``hooks.hook_plan``, with SGLang's module layout
read from the wheel) plus ``sglang/targets.py``'s reads. A missing wheel fails (run the install script)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import oea.integrations.sglang.hooks as hooks
import oea.integrations.sglang.padding as padding
import oea.integrations.sglang.targets as sglang_targets
from oea.integrations.hook_targets import HookTarget
from oea.integrations.vllm import targets as vllm_targets
from tests.engines.wheel_source import WheelSource, wheel

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("OEA_CUDA_WHEELS", ROOT / ".cache" / "cuda-wheels"))


def _wheel(name: str, version: str) -> WheelSource:
    found = sorted(CACHE.glob(f"{name}-{version}-*.whl"))
    assert found, f"{name}=={version} is not in {CACHE}: run bash scripts/install_cuda_wheels.sh (make test does)"
    return wheel(found[0])


def _problems(source: WheelSource, targets: list[HookTarget]) -> list[str]:
    return [problem for problem in map(source.check, targets) if problem is not None]


def test_cuda_release_vllm_has_every_hook_target() -> None:
    source = _wheel("vllm", vllm_targets.CUDA_RELEASE)
    targets = list(vllm_targets.TARGETS)
    assert len(targets) >= 50
    assert _problems(source, targets) == []
    print(f"cuda_release vllm {vllm_targets.CUDA_RELEASE}: {len(targets)} hook targets found")


def test_cuda_release_vllm_known_gaps_are_still_missing() -> None:
    source = _wheel("vllm", vllm_targets.CUDA_RELEASE)
    still_missing = [t.path for t in vllm_targets.KNOWN_GAPS if source.check(t) is not None]
    assert still_missing == [t.path for t in vllm_targets.KNOWN_GAPS], "found now: move it into TARGETS"


def _split(source: WheelSource, dotted: str) -> tuple[str, str]:
    """``a.b.module.Class.method`` -> (``a.b.module``, ``Class.method``): the longest prefix that is a module."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if source.has_module(".".join(parts[:cut])):
            return ".".join(parts[:cut]), ".".join(parts[cut:])
    return dotted.rsplit(".", 1)[0], dotted.rsplit(".", 1)[1]


def _forward_context_takes_batch(source: WheelSource) -> bool:
    found = source.member(sglang_targets.FORWARD_CONTEXT_MODULE, "forward_context", "function")
    if found is None or not isinstance(found[1], ast.FunctionDef):
        return False
    return "forward_batch" in {a.arg for a in (*found[1].args.args, *found[1].args.kwonlyargs)}


def sglang_release_targets(source: WheelSource, monkeypatch: pytest.MonkeyPatch) -> list[HookTarget]:
    """What the SGLang plugin hooks and reads on this release, from its own hook plan (its version choices read
    SGLang's module layout: here the wheel's) and ``sglang/targets.py``."""
    monkeypatch.setattr(sglang_targets, "module_available", source.has_module)
    plan = hooks.hook_plan(phase_via_forward_context=_forward_context_takes_batch(source))
    replay = {padding.DECODE_REPLAY_TARGET, padding.LEGACY_REPLAY_TARGET, padding.CPU_REPLAY_TARGET}
    out = []
    runner_classes = set()
    for dotted, _, _ in plan:
        module, name = _split(source, dotted)
        wanted = padding.REPLAY_PARAMETERS if dotted in replay else sglang_targets.EXPECTED_PARAMETERS.get(dotted, ())
        calls = sglang_targets.POST_PROCESS_CALLS if dotted == sglang_targets.POST_PROCESS_TARGET else ()
        out.append(HookTarget(module, name, parameters=wanted, calls=calls, why="hooked"))
        if "GraphRunner." in name and not name.startswith("CPUGraphRunner"):
            runner_classes.add((module, name.split(".")[0]))
    for module, cls in sorted(runner_classes):  # the CUDA graph runner's attributes the hooks read
        out += [HookTarget(module, f"{cls}.{attribute}", kind="attribute") for attribute in
                sglang_targets.GRAPH_RUNNER_READS]
    batch_module, batch_class = sglang_targets.FORWARD_BATCH_CLASS.rsplit(".", 1)
    out += [HookTarget(batch_module, f"{batch_class}.{attribute}", kind="attribute")
            for attribute in sglang_targets.FORWARD_BATCH_READS]
    location = sglang_targets.EXPERT_LOCATION_MODULE
    out.append(HookTarget(location, sglang_targets.EXPERT_LOCATION_FUNCTION))
    out += [HookTarget(location, name, kind="attribute") for name in sglang_targets.EXPERT_LOCATION_READS]
    return out


@pytest.mark.parametrize("version", sglang_targets.CUDA_RELEASES, ids=lambda v: f"cuda_release-sglang-{v}")
def test_sglang_cuda_release_has_every_hook_target(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _wheel("sglang", version)
    targets = sglang_release_targets(source, monkeypatch)
    names = {t.path for t in targets}
    assert sglang_targets.POST_PROCESS_TARGET in names and sglang_targets.SELECT_EXPERTS_TARGET in names
    assert any("GraphRunner" in n and ("load_batch" in n or "replay_prepare" in n) for n in names), names
    assert any("num_token_non_padded" in t.parameters for t in targets)
    assert _problems(source, targets) == []
    print(f"cuda_release sglang {version}: {len(targets)} hook targets found")
