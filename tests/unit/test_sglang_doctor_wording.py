"""``oea doctor sglang`` words an SGLang that cannot be imported as what it is: a missing dependency is named
as one (not as an SGLang version problem); only a missing SGLang module reads as a version problem."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from oea.integrations.doctor import run as doctor_report
from oea.integrations.sglang import doctor
from oea.integrations.sglang.targets import SELECT_EXPERTS_TARGET, TOPK_MODULE

VERSION_WORDING = "supported SGLang versions"


def _not_found(name: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"No module named {name!r}", name=name)


@pytest.mark.parametrize("missing", ["torchvision", "torchvision.transforms"])
def test_missing_dependency_is_named_as_one(missing: str) -> None:
    message = doctor.import_failure(_not_found(missing), TOPK_MODULE)
    assert message.startswith(f"SGLang could not import: No module named {missing!r} (a dependency of sglang")
    assert "not an SGLang version problem" in message
    assert VERSION_WORDING not in message
    assert message.endswith(f"needed by {TOPK_MODULE}")


def test_missing_sglang_module_is_a_version_problem() -> None:
    message = doctor.import_failure(_not_found(TOPK_MODULE), TOPK_MODULE)
    assert VERSION_WORDING in message
    assert "dependency" not in message


def test_other_import_error_is_a_broken_installation() -> None:
    message = doctor.import_failure(RuntimeError("operator  torchvision::nms\ndoes not exist"), TOPK_MODULE)
    assert f"SGLang could not import {TOPK_MODULE}: RuntimeError: operator torchvision::nms does not exist" in message
    assert "not an SGLang version problem" in message
    assert VERSION_WORDING not in message


@pytest.fixture
def sglang_missing_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A stand-in ``sglang`` package whose MoE top-k module needs a torchvision that is not installed."""
    moe = tmp_path / "sglang" / "srt" / "layers" / "moe"
    moe.mkdir(parents=True)
    for package in (moe, *moe.parents):
        if package == tmp_path:
            break
        (package / "__init__.py").write_text("")
    (moe / "topk.py").write_text("raise ModuleNotFoundError(\"No module named 'torchvision'\", name='torchvision')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(doctor, "engine_version", lambda: "0.5.23")
    before = set(sys.modules)
    importlib.invalidate_caches()
    yield
    for name in set(sys.modules) - before:
        if name == "sglang" or name.startswith("sglang."):
            del sys.modules[name]


@pytest.mark.usefixtures("sglang_missing_torchvision")
def test_doctor_reports_the_missing_dependency_not_a_version() -> None:
    checks = {c["name"]: c for c in doctor.doctor_checks()}
    assert checks["version"]["ok"], checks["version"]
    imports = checks["imports"]
    assert not imports["ok"]
    assert imports["detail"].startswith("SGLang could not import: No module named 'torchvision' (a dependency")
    assert not [name for name in checks if name.startswith("hook target")]  # not one "missing target" per hook
    assert not checks["self-test select_experts"]["ok"]
    assert not [c for c in checks.values() if VERSION_WORDING in c["detail"]], checks

    report, code = doctor_report.run_doctor("sglang")
    assert code == 1 and not report["ok"]
    summary = doctor_report.format_text(report).splitlines()[-1]
    assert summary.startswith("oea doctor: sglang: imports: SGLang could not import: No module named 'torchvision'")


@pytest.mark.usefixtures("sglang_missing_torchvision")
def test_hook_target_behind_a_missing_dependency_is_not_called_missing() -> None:
    with pytest.raises(RuntimeError) as raised:
        doctor._check_target(SELECT_EXPERTS_TARGET)
    message = str(raised.value)
    assert "No module named 'torchvision' (a dependency of sglang" in message
    assert "missing target" not in message and VERSION_WORDING not in message
