"""``oea doctor``: report shape, exit codes, not-installed engines, broken adapters, bad environment.

Engine adapters are replaced by small stand-in modules here; the real SGLang doctor runs in
tests/engines/test_sglang_doctor.py, and a stand-in SGLang *package* lacking a hook target is
checked end to end at the bottom of this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from oea.cli import main
from oea.integrations import doctor


def _adapter(monkeypatch: pytest.MonkeyPatch, engine: str, **functions: Any) -> None:
    module = types.ModuleType(f"oea.integrations.{engine}")
    for name, fn in functions.items():
        setattr(module, name, fn)
    monkeypatch.setitem(sys.modules, f"oea.integrations.{engine}", module)


def _installed(monkeypatch: pytest.MonkeyPatch, *engines: str) -> None:
    monkeypatch.setattr(doctor, "engine_installed", lambda name: name in engines)


def _good_checks() -> list[dict[str, Any]]:
    return [{"name": "entry point registered", "ok": True, "detail": "x"}]


def test_named_engine_not_installed_is_a_failure_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch)
    report, code = doctor.run_doctor("sglang")
    assert code == 1 and not report["ok"]
    (engine,) = report["engines"]
    assert engine["installed"] is False and engine["version"] is None
    assert "not installed" in engine["checks"][0]["detail"] and "pip install" in engine["checks"][0]["detail"]


def test_all_skips_engines_that_are_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "transformers")
    _adapter(monkeypatch, "transformers", engine_version=lambda: "5.24.0", doctor_checks=_good_checks)
    report, code = doctor.run_doctor("all")
    assert code == 0 and report["ok"]
    assert [e["name"] for e in report["engines"]] == ["sglang", "vllm", "transformers"]
    assert [e["installed"] for e in report["engines"]] == [False, False, True]


def test_all_fails_when_an_installed_engine_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "vllm")
    _adapter(monkeypatch, "vllm", engine_version=lambda: "0.33.0",
             doctor_checks=lambda: [{"name": "self-test", "ok": False, "detail": "routing differs"}])
    report, code = doctor.run_doctor("all")
    assert code == 1 and not report["ok"]


def test_missing_adapter_functions_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "vllm")
    _adapter(monkeypatch, "vllm")
    report, code = doctor.run_doctor("vllm")
    details = [c["detail"] for c in report["engines"][0]["checks"]]
    assert code == 1
    assert any("engine_version() is missing" in d for d in details)
    assert any("doctor_checks() is missing" in d for d in details)


def test_raising_or_malformed_checks_become_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> list[dict[str, Any]]:
        raise ImportError("no module named vllm._C")

    _installed(monkeypatch, "vllm", "transformers")
    _adapter(monkeypatch, "vllm", engine_version=lambda: "1", doctor_checks=boom)
    _adapter(monkeypatch, "transformers", engine_version=lambda: "1", doctor_checks=lambda: [{"name": "x"}])
    vllm = doctor.engine_report("vllm")
    transformers = doctor.engine_report("transformers")
    assert not vllm["ok"] and "ImportError: no module named vllm._C" in vllm["checks"][0]["detail"]
    assert not transformers["ok"] and "malformed check record" in transformers["checks"][0]["detail"]


def test_unknown_engine_is_rejected() -> None:
    with pytest.raises(ValueError, match="engine must be one of"):
        doctor.engine_report("tensorrt")


def test_cli_json_shape(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _installed(monkeypatch, "sglang")
    _adapter(monkeypatch, "sglang", engine_version=lambda: "0.5.23", doctor_checks=_good_checks)
    assert main(["doctor", "sglang", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (engine,) = report["engines"]
    assert {"name", "version", "ok", "checks"} <= engine.keys()
    assert engine["name"] == "sglang" and engine["version"] == "0.5.23" and engine["ok"] is True
    assert engine["checks"] == [{"name": "entry point registered", "ok": True, "detail": "x"}]


def test_cli_text_names_the_failed_check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _installed(monkeypatch, "sglang")
    _adapter(monkeypatch, "sglang", engine_version=lambda: "0.5.23",
             doctor_checks=lambda: [{"name": "hooks live", "ok": False, "detail": "run pip install -e ."}])
    assert main(["doctor", "sglang"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] hooks live" in out and "oea doctor: sglang: hooks live: run pip install -e ." in out


def test_cli_rejects_unknown_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "tensorrt"]) == 2  # argparse's error, returned as the exit status
    assert "invalid choice" in capsys.readouterr().err


def test_sglang_environment_check_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.integrations.sglang import doctor as sglang

    monkeypatch.setenv("OEA_K0", "two")
    failed = doctor.check_call("environment", sglang._check_environment)
    assert not failed["ok"] and "OEA_K0 must be an integer" in failed["detail"]
    monkeypatch.setenv("OEA_K0", "2")
    passed = doctor.check_call("environment", sglang._check_environment)
    assert passed["ok"] and "k0=2" in passed["detail"]


FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/plugins/__init__.py": "def load_plugins():\n    pass\n",
    "sglang/srt/plugins/hook_registry.py": (
        "import enum\nclass HookType(enum.Enum):\n    BEFORE = 1\n    AFTER = 2\n    AROUND = 3\n"
        "class HookRegistry:\n    @classmethod\n    def register(cls, *a, **k):\n        pass\n"),
    "sglang/srt/layers/__init__.py": "",
    "sglang/srt/layers/moe/__init__.py": "",
    # A future SGLang that renamed _post_process_topk_ids.
    "sglang/srt/layers/moe/topk.py": (
        "def select_experts(hidden_states, router_logits, topk_config, *, layer_id=None,\n"
        "                   num_token_non_padded=None):\n    raise NotImplementedError\n"),
    "sglang/srt/model_executor/__init__.py": "",
    "sglang/srt/model_executor/forward_context.py": "def forward_context(ctx, *, forward_batch=None):\n    pass\n",
    "sglang-0.5.30.dist-info/METADATA": "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.30\n",
    "sglang-0.5.30.dist-info/RECORD": "",
}


def test_sglang_without_expected_target_names_it_and_the_supported_versions(tmp_path: Path) -> None:
    for relative, text in FAKE_SGLANG.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OEA_", "SGLANG_"))}
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    env["OEA_K0"] = "2"
    proc = subprocess.run([sys.executable, "-m", "oea", "doctor", "sglang", "--json"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr
    (engine,) = json.loads(proc.stdout)["engines"]
    checks = {c["name"]: c for c in engine["checks"]}
    assert engine["version"] == "0.5.30" and not engine["ok"]
    assert "newer than tested 0.5.23" in checks["version"]["detail"]
    missing = checks["hook target sglang.srt.layers.moe.topk._post_process_topk_ids"]
    assert not missing["ok"]
    assert "missing target sglang.srt.layers.moe.topk._post_process_topk_ids" in missing["detail"]
    assert "supported SGLang versions: 0.5.12 to 0.5.23" in missing["detail"]
    assert checks["hook target sglang.srt.layers.moe.topk.select_experts"]["ok"]
    assert checks["entry point registered"]["ok"] and checks["entry point loads"]["ok"]
    assert not checks["self-test select_experts"]["ok"]


def test_sglang_target_check_tells_missing_from_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oea.integrations.sglang import doctor as sglang

    package = tmp_path / "oea_fake_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text("def fn(topk_ids, router_logits):\n    pass\n")
    (package / "broken.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("oea_fake_engine", "oea_fake_engine.good", "oea_fake_engine.broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    good = doctor.check_call("t", lambda: sglang._check_target("oea_fake_engine.good.fn"))
    moved = doctor.check_call("t", lambda: sglang._check_target("oea_fake_engine.good.renamed_fn"))
    gone = doctor.check_call("t", lambda: sglang._check_target("oea_fake_engine.removed_module.fn"))
    broken = doctor.check_call("t", lambda: sglang._check_target("oea_fake_engine.broken.fn"))
    assert good["ok"] and good["detail"] == "oea_fake_engine.good.fn(topk_ids, router_logits)"
    assert not moved["ok"] and moved["detail"].startswith("missing target oea_fake_engine.good.renamed_fn")
    assert not gone["ok"] and gone["detail"].startswith("missing target oea_fake_engine.removed_module.fn")
    assert not broken["ok"] and "cannot import the module of oea_fake_engine.broken.fn: ImportError: libcuda.so.1" \
        in broken["detail"] and "installation problem" in broken["detail"]
