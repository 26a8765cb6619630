"""``oea.config``: environment parsing shared by every engine adapter."""

from __future__ import annotations

import pytest

from oea.config import ALIASES, EnvSettings, check_k0_against, settings_from_env
from oea.routing import OEAConfig


def test_empty_environment_means_off() -> None:
    settings = settings_from_env({})
    assert settings == EnvSettings(oea=None, apply_to_verify=False, layer_k0_file=None, metrics_file=None,
                                   source={})


def test_k0_alone_gives_the_defaults() -> None:
    settings = settings_from_env({"OEA_K0": "3"})
    assert settings.oea == OEAConfig(k0=3, max_experts=None, min_batch=2, group_fill="in")
    assert settings.source == {"OEA_K0": "3"}


def test_every_variable_is_read() -> None:
    env = {
        "OEA_K0": " 2 ", "OEA_MIN_BATCH": "0", "OEA_MAX_EXPERTS": "6", "OEA_GROUP_FILL": "cross",
        "OEA_APPLY_TO_VERIFY": "yes", "OEA_LAYER_K0_FILE": "/tmp/k0.json", "OEA_METRICS_FILE": "/tmp/m.jsonl",
    }
    settings = settings_from_env(env)
    assert settings.oea == OEAConfig(k0=2, max_experts=6, min_batch=0, group_fill="cross")
    assert settings.apply_to_verify is True
    assert (settings.layer_k0_file, settings.metrics_file) == ("/tmp/k0.json", "/tmp/m.jsonl")
    assert settings.source == {"OEA_K0": " 2 ", "OEA_MIN_BATCH": "0", "OEA_MAX_EXPERTS": "6"}


def test_sglang_aliases_and_primary_precedence() -> None:
    assert ALIASES == {"OEA_K0": "SGLANG_OEA_K0", "OEA_MIN_BATCH": "SGLANG_OEA_MIN_BATCH"}
    settings = settings_from_env({"SGLANG_OEA_K0": "4", "SGLANG_OEA_MIN_BATCH": "8"})
    assert settings.oea == OEAConfig(k0=4, min_batch=8)
    assert settings.source == {"SGLANG_OEA_K0": "4", "SGLANG_OEA_MIN_BATCH": "8"}
    same = settings_from_env({"OEA_K0": "4", "SGLANG_OEA_K0": " 4", "OEA_MIN_BATCH": "3", "SGLANG_OEA_MIN_BATCH": "3"})
    assert same.oea == OEAConfig(k0=4, min_batch=3)  # both names set to one value: one setting
    assert same.source == {"OEA_K0": "4", "OEA_MIN_BATCH": "3"}
    blank_primary = settings_from_env({"OEA_K0": "  ", "SGLANG_OEA_K0": "2"})
    assert blank_primary.oea == OEAConfig(k0=2) and blank_primary.source == {"SGLANG_OEA_K0": "2"}


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"OEA_K0": "two"}, "OEA_K0"),
        ({"OEA_K0": "0"}, "OEA_K0"),
        ({"OEA_K0": "1.5"}, "OEA_K0"),
        ({"SGLANG_OEA_K0": "-2"}, "SGLANG_OEA_K0"),
        ({"OEA_K0": "2", "OEA_MIN_BATCH": "-1"}, "OEA_MIN_BATCH"),
        ({"OEA_K0": "2", "SGLANG_OEA_MIN_BATCH": "many"}, "SGLANG_OEA_MIN_BATCH"),
        ({"OEA_K0": "2", "OEA_MAX_EXPERTS": "0"}, "OEA_MAX_EXPERTS"),
        ({"OEA_K0": "2", "OEA_GROUP_FILL": "everywhere"}, "OEA_GROUP_FILL"),
        ({"OEA_APPLY_TO_VERIFY": "maybe"}, "OEA_APPLY_TO_VERIFY"),
        ({"OEA_MIN_BATCH": "x"}, "OEA_MIN_BATCH"),  # malformed even while OEA is off: fail at start-up
    ],
)
def test_malformed_values_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ValueError, match=variable):
        settings_from_env(env)


@pytest.mark.parametrize(("env", "message"), [
    ({"OEA_K0": "2", "SGLANG_OEA_K0": "5"}, "OEA_K0=2 and SGLANG_OEA_K0=5 disagree"),
    ({"OEA_K0": "2", "OEA_MIN_BATCH": "1", "SGLANG_OEA_MIN_BATCH": "4"}, "OEA_MIN_BATCH=1 and SGLANG_OEA_MIN_BATCH=4"),
    ({"OEA_K0": "2", "SGLANG_OEA_K0": "two"}, "SGLANG_OEA_K0 must be an integer"),  # a bad alias is not ignored
])
def test_a_variable_and_its_alias_with_different_values_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings_from_env(env)


def test_inconsistent_values_name_every_variable_involved() -> None:
    with pytest.raises(ValueError, match=r"OEA_K0, OEA_MAX_EXPERTS.*max_experts must be >= k0"):
        settings_from_env({"OEA_K0": "4", "OEA_MAX_EXPERTS": "2"})


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", " On "])
def test_truthy_flags(raw: str) -> None:
    assert settings_from_env({"OEA_APPLY_TO_VERIFY": raw}).apply_to_verify is True


@pytest.mark.parametrize("raw", ["", "0", "false", "no", "off", "  "])
def test_falsy_flags(raw: str) -> None:
    assert settings_from_env({"OEA_APPLY_TO_VERIFY": raw}).apply_to_verify is False


def test_blank_file_variables_mean_unset() -> None:
    settings = settings_from_env({"OEA_LAYER_K0_FILE": "  ", "OEA_METRICS_FILE": ""})
    assert settings.layer_k0_file is None and settings.metrics_file is None


def test_file_paths_are_stripped() -> None:
    settings = settings_from_env({"OEA_LAYER_K0_FILE": " /tmp/k0.json\n", "OEA_METRICS_FILE": " /tmp/m "})
    assert (settings.layer_k0_file, settings.metrics_file) == ("/tmp/k0.json", "/tmp/m")


def test_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OEA_K0", "SGLANG_OEA_K0", "OEA_MIN_BATCH", "SGLANG_OEA_MIN_BATCH", "OEA_MAX_EXPERTS",
                 "OEA_GROUP_FILL", "OEA_APPLY_TO_VERIFY", "OEA_LAYER_K0_FILE", "OEA_METRICS_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert settings_from_env().oea is None
    monkeypatch.setenv("SGLANG_OEA_K0", "3")
    assert settings_from_env().oea == OEAConfig(k0=3)


def test_check_k0_against_names_the_variable() -> None:
    check_k0_against(OEAConfig(k0=8), top_k=8)
    with pytest.raises(ValueError, match=r"SGLANG_OEA_K0 must be in 1\.\.8 \(the model's top_k\), got 9"):
        check_k0_against(OEAConfig(k0=9), top_k=8, variable="SGLANG_OEA_K0")
    with pytest.raises(ValueError, match=r"^OEA_K0 "):
        check_k0_against(OEAConfig(k0=3), top_k=2)


def test_trace_variables_are_read_with_their_defaults() -> None:
    from oea.config import TraceSettings, trace_settings_from_env

    assert trace_settings_from_env({"OEA_TRACE_SAMPLE": "0.5"}) is None  # options without the file: no recording
    assert trace_settings_from_env({"OEA_TRACE_FILE": " /tmp/t.safetensors "}) == TraceSettings(
        "/tmp/t.safetensors", 1.0, 1024 * 2**20, "logits")
    got = trace_settings_from_env({"OEA_TRACE_FILE": "/tmp/t.safetensors", "OEA_TRACE_SAMPLE": "0.25",
                                   "OEA_TRACE_MAX_MB": "0.5", "OEA_TRACE_CONTENT": "topk"})
    assert got == TraceSettings("/tmp/t.safetensors", 0.25, 2**19, "topk")


@pytest.mark.parametrize(("env", "message"), [
    ({"OEA_TRACE_FILE": "/tmp/trace.bin"}, "OEA_TRACE_FILE must name a .safetensors file"),
    ({"OEA_TRACE_SAMPLE": "0"}, "OEA_TRACE_SAMPLE must be a number in (0, 1], got '0'"),
    ({"OEA_TRACE_SAMPLE": "1.5"}, "OEA_TRACE_SAMPLE must be a number in (0, 1], got '1.5'"),
    ({"OEA_TRACE_MAX_MB": "-2"}, "OEA_TRACE_MAX_MB must be a number > 0, got '-2'"),
    ({"OEA_TRACE_MAX_MB": "inf"}, "OEA_TRACE_MAX_MB must be a number > 0, got 'inf'"),
    ({"OEA_TRACE_CONTENT": "ids"}, "OEA_TRACE_CONTENT must be one of ('logits', 'topk'), got 'ids'"),
])
def test_malformed_trace_variables_name_the_variable(env: dict[str, str], message: str) -> None:
    from oea.config import trace_settings_from_env

    with pytest.raises(ValueError) as err:
        trace_settings_from_env({"OEA_TRACE_FILE": "/tmp/t.safetensors", **env})
    assert str(err.value).startswith(message)


def test_policy_defaults_to_plain_oea_and_reads_ep() -> None:
    assert settings_from_env({"OEA_K0": "3"}).policy == "oea"
    assert settings_from_env({"OEA_K0": "3", "OEA_POLICY": " ep "}).policy == "ep"
    assert settings_from_env({"OEA_K0": "3", "OEA_POLICY": ""}).policy == "oea"


@pytest.mark.parametrize("raw", ["EP", "ep-oea", "expert"])
def test_unknown_policy_is_refused_naming_the_allowed_values(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^OEA_POLICY must be one of \('oea', 'ep'\), got '{raw}'$"):
        settings_from_env({"OEA_K0": "3", "OEA_POLICY": raw})


def test_environment_check_reports_the_policy() -> None:
    from oea.integrations.doctor.env import check_environment

    checks = {c.name: c for c in check_environment({"OEA_K0": "3", "OEA_POLICY": "ep"})}
    assert checks["OEA_POLICY"].ok and checks["OEA_POLICY"].detail == "policy = ep"
    bad = {c.name: c for c in check_environment({"OEA_K0": "3", "OEA_POLICY": "both"})}
    assert not bad["OEA_POLICY"].ok and "one of ('oea', 'ep')" in bad["OEA_POLICY"].detail
    idle = {c.name: c for c in check_environment({"OEA_POLICY": "ep"})}
    assert idle["OEA_K0"].detail == "unset: OEA is off, so OEA_POLICY has no effect"


def test_the_docs_table_is_the_variables_table() -> None:
    """docs/configuration.md shows the table the settings and the doctor parse with, unchanged."""
    from pathlib import Path

    from oea.config.variables import markdown_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    start, end = "<!-- the table: oea.config.variables.markdown_table() -->\n", "<!-- end of the table -->"
    assert page[page.index(start) + len(start):page.index(end)] == markdown_table()


def test_every_variable_parses_what_the_settings_read_and_names_itself_when_malformed() -> None:
    from oea.config.variables import VARIABLES

    assert [v.name for v in VARIABLES][:3] == ["OEA_K0", "OEA_MIN_BATCH", "OEA_MAX_EXPERTS"]
    for variable in VARIABLES:
        if variable.name in ("OEA_LAYER_K0_FILE", "OEA_METRICS_FILE"):
            continue  # any path parses; the file is checked where it is used
        with pytest.raises(ValueError, match=rf"^{variable.name} must "):
            variable.parse(variable.name, "-7x")


def test_blank_variables_are_named_with_what_they_mean() -> None:
    """``OEA_K0=`` (``OEA_K0=$K0`` with K0 unset) is read as unset: OEA off, which the note says."""
    from oea.config import blank_note, blank_variables

    env = {"OEA_K0": "", "SGLANG_OEA_MIN_BATCH": "  ", "OEA_TRACE_FILE": "t.safetensors", "OEA_OTHER": ""}
    assert settings_from_env(env).oea is None
    assert blank_variables(env) == ["OEA_K0", "SGLANG_OEA_MIN_BATCH"]  # known variables only
    assert blank_note(["OEA_K0"]) == ("OEA_K0 is set but empty: read as unset (OEA is off without OEA_K0); unset it, "
                                      "or give it a value")
    assert "(OEA is off" not in blank_note(["OEA_TRACE_FILE"])
    assert blank_note([]) == "" and blank_variables({"OEA_K0": "3"}) == []


def test_k0_note_says_what_a_k0_above_every_preset_top_k_does() -> None:
    from oea.config import k0_note
    from oea.config.variables import LARGEST_PRESET_TOP_K
    from oea.presets import MODEL_PRESETS

    assert max(p.top_k for p in MODEL_PRESETS.values()) == LARGEST_PRESET_TOP_K
    assert k0_note(LARGEST_PRESET_TOP_K - 1) == ""
    assert "routing is unchanged (k0 = top_k)" in k0_note(LARGEST_PRESET_TOP_K)
    assert k0_note(999).startswith("no model preset has top_k >= 999 (the largest is 8): a model whose top_k is "
                                   "below 999 is refused at load (OEA_K0 must be in 1..top_k)")


def test_process_settings_complete_routing_settings_once() -> None:
    """An adapter entered with routing settings alone (``settings_from_env``) gets the rest of the process's
    settings (timing, metrics flush, trace) from the same environment; settings that hold them are kept as given."""
    from oea.config.settings import all_settings_from_env, process_settings

    env = {"OEA_K0": "2", "OEA_TIMING": "1", "OEA_METRICS_FLUSH_S": "7", "OEA_TRACE_FILE": "/tmp/t.safetensors"}
    routing = settings_from_env(env)
    assert (routing.timing, routing.metrics_flush_s, routing.trace, routing.process) == (False, 0.5, None, False)
    full = process_settings(routing, env)
    assert full == all_settings_from_env(env)
    assert (full.timing, full.metrics_flush_s, full.trace.path, full.process) == (True, 7.0, "/tmp/t.safetensors", True)
    assert process_settings(full, {}) is full
    assert (full.prometheus, full.prometheus_port) == (True, None)  # export on by default, no port of its own


def test_prometheus_settings_are_read_once_with_the_rest() -> None:
    """``OEA_PROMETHEUS`` is a flag (malformed: start-up stops naming it); ``OEA_PROMETHEUS_PORT`` is kept as written,
    since a bad or taken port is one warning where it is served and serving goes on."""
    from oea.config.settings import all_settings_from_env

    got = all_settings_from_env({"OEA_K0": "2", "OEA_PROMETHEUS": "off", "OEA_PROMETHEUS_PORT": " nine "})
    assert (got.prometheus, got.prometheus_port) == (False, "nine")
    assert all_settings_from_env({"OEA_K0": "2", "OEA_PROMETHEUS": "1"}).prometheus is True
    with pytest.raises(ValueError, match=r"OEA_PROMETHEUS must be one of 0/1/true/false/yes/no/on/off, got 'maybe'"):
        all_settings_from_env({"OEA_K0": "2", "OEA_PROMETHEUS": "maybe"})
