"""``oea.maybe_attach`` (environment-gated attach) and ``doctor_checks`` for transformers."""

from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import oea  # noqa: E402
from oea.config import write_layer_k0_file  # noqa: E402
from oea.integrations.transformers import doctor_checks, engine_version, maybe_attach  # noqa: E402
from oea.routing import LayerK0Schedule  # noqa: E402
from oea.testing import TINY_FAMILIES, tiny_moe  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_moe("qwen3_moe", top_k=4)


def _assert_clean(model: torch.nn.Module) -> None:
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_unset_environment_leaves_the_model_alone(model: torch.nn.Module) -> None:
    assert maybe_attach(model, env={}) is None
    with pytest.warns(RuntimeWarning, match="OEA_K0 is set but empty"):
        assert maybe_attach(model, env={"OEA_K0": "  ", "OEA_MIN_BATCH": "4"}) is None
    _assert_clean(model)


@pytest.mark.parametrize(
    ("env", "k0", "min_batch"),
    [
        ({"OEA_K0": "2"}, 2, 2),
        ({"SGLANG_OEA_K0": "3"}, 3, 2),
        ({"SGLANG_OEA_K0": "1", "SGLANG_OEA_MIN_BATCH": "5"}, 1, 5),
        ({"OEA_K0": "2", "SGLANG_OEA_K0": "2", "OEA_MIN_BATCH": "0"}, 2, 0),  # both names, one value
    ],
)
def test_env_and_aliases_configure_every_layer(model: torch.nn.Module, env: dict, k0: int, min_batch: int) -> None:
    handle = oea.maybe_attach(model, env=env)
    assert handle is not None
    try:
        assert handle.rerouted_layers == [0, 1]
        for cfg in handle.configs.values():
            assert isinstance(cfg, oea.OEAConfig) and (cfg.k0, cfg.min_batch) == (k0, min_batch)
    finally:
        handle.remove()
    _assert_clean(model)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"OEA_K0": "5"}, "OEA_K0"),
        ({"SGLANG_OEA_K0": "9"}, "SGLANG_OEA_K0"),
        ({"OEA_K0": "two"}, "OEA_K0"),
        ({"SGLANG_OEA_K0": "2", "SGLANG_OEA_MIN_BATCH": "-1"}, "SGLANG_OEA_MIN_BATCH"),
        ({"OEA_K0": "2", "OEA_MAX_EXPERTS": "6"}, "OEA_MAX_EXPERTS"),
        ({"OEA_K0": "2", "OEA_GROUP_FILL": "all"}, "OEA_GROUP_FILL"),
        ({"OEA_K0": "2", "SGLANG_OEA_K0": "3"}, "OEA_K0=2 and SGLANG_OEA_K0=3 disagree"),
    ],
)
def test_bad_environment_raises_naming_the_variable(model: torch.nn.Module, env: dict, variable: str) -> None:
    with pytest.raises(ValueError, match=variable):
        maybe_attach(model, env=env)
    _assert_clean(model)


def test_k0_above_top_k_message_states_the_range(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"OEA_K0 must be in 1\.\.4 \(the model's top_k\), got 5"):
        maybe_attach(model, env={"OEA_K0": "5"})


def _schedule_file(tmp_path, **overrides) -> str:
    fields = {"num_experts": 16, "top_k": 4, "num_layers": 2, "k0": (1, 3), "min_batch": 3, **overrides}
    path = tmp_path / "k0.json"
    write_layer_k0_file(LayerK0Schedule(**fields), path)
    return str(path)


def test_layer_k0_file_sets_each_layer(model: torch.nn.Module, tmp_path) -> None:
    path = _schedule_file(tmp_path)
    for env, min_batch in (({"OEA_LAYER_K0_FILE": path, "OEA_K0": "4"}, 3),
                           ({"OEA_LAYER_K0_FILE": path, "OEA_K0": "2", "SGLANG_OEA_MIN_BATCH": "5"}, 5)):
        handle = maybe_attach(model, env=env)
        assert handle is not None
        try:
            assert handle.configs == {0: oea.OEAConfig(k0=1, min_batch=min_batch),
                                      1: oea.OEAConfig(k0=3, min_batch=min_batch)}
            assert handle.rerouted_layers == [0, 1]
        finally:
            handle.remove()


def test_the_layer_files_own_min_batch_decides_when_the_environment_sets_none(model: torch.nn.Module,
                                                                            tmp_path) -> None:
    """The behaviour behind ``min_batch=3`` above: with OEA_K0 and OEA_LAYER_K0_FILE set (the file's min_batch 3,
    k0 1; OEA_MIN_BATCH unset), a decode step of 2 rows keeps the router's own routing and one of 3 rows is
    rerouted."""
    path = _schedule_file(tmp_path, k0=(1, 1), min_batch=3)
    ids = torch.randint(0, model.config.vocab_size, (3, 1), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        vanilla = {rows: model(ids[:rows]).logits for rows in (2, 3)}
        handle = maybe_attach(model, env={"OEA_K0": "2", "OEA_LAYER_K0_FILE": path})
        assert handle is not None
        try:
            routed = {rows: model(ids[:rows]).logits for rows in (2, 3)}
        finally:
            handle.remove()
    assert torch.equal(routed[2], vanilla[2]), "2 rows < the file's min_batch 3: the router's own routing"
    assert not torch.equal(routed[3], vanilla[3]), "3 rows reach the file's min_batch: rerouted with k0 = 1"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"num_layers": 3, "k0": (1, 1, 1)}, "num_layers: file has 3, model has 2"),
     ({"num_experts": 32}, "num_experts: file has 32, model has 16")],
)
def test_layer_k0_file_for_another_model_is_refused(model, tmp_path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"OEA_LAYER_K0_FILE=.*{message}"):
        maybe_attach(model, env={"OEA_K0": "2", "OEA_LAYER_K0_FILE": _schedule_file(tmp_path, **overrides)})
    _assert_clean(model)


def test_layer_k0_file_without_oea_k0_is_refused(model: torch.nn.Module, tmp_path) -> None:
    """OEA is on only with OEA_K0, in every engine: a file that would not be used stops, naming both variables."""
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.* is set but OEA_K0 is not"):
        maybe_attach(model, env={"OEA_LAYER_K0_FILE": _schedule_file(tmp_path)})
    _assert_clean(model)


def test_layer_k0_file_with_batch_k0_routes_by_the_calls_rows(model: torch.nn.Module, tmp_path) -> None:
    """batch_k0: each layer's config follows the router call's row count, as in the engine plugins."""
    path = _schedule_file(tmp_path, batch_k0=((4, (4, 4)), (64, (1, 2))))
    handle = maybe_attach(model, env={"OEA_K0": "2", "OEA_LAYER_K0_FILE": path})
    try:
        assert handle.configs == {0: oea.routing.AdaptiveK0Config(((4, 4), (64, 1)), min_batch=3),
                                  1: oea.routing.AdaptiveK0Config(((4, 4), (64, 2)), min_batch=3)}
    finally:
        handle.remove()


def test_missing_layer_k0_file_names_the_variable(model: torch.nn.Module, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*not found"):
        maybe_attach(model, env={"OEA_K0": "2", "OEA_LAYER_K0_FILE": str(tmp_path / "absent.json")})
    _assert_clean(model)


def test_doctor_checks_pass_here() -> None:
    checks = doctor_checks()
    names = [check["name"] for check in checks]
    assert names == [
        "transformers version",
        *(f"router class {family}" for family in TINY_FAMILIES),
        "self-test",
        "environment",
    ]
    for check in checks:
        assert set(check) == {"name", "ok", "detail"}
        assert isinstance(check["detail"], str) and check["detail"]
        assert check["ok"] is True, check
    assert transformers.__version__ in checks[0]["detail"]
    assert engine_version() == transformers.__version__


def test_doctor_reports_a_bad_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OEA_K0", "zero")
    env_check = doctor_checks()[-1]
    assert env_check["name"] == "environment" and env_check["ok"] is False
    assert "OEA_K0" in env_check["detail"]


def test_doctor_fails_on_a_layer_k0_file_that_maybe_attach_cannot_use(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path) -> None:
    """Where maybe_attach raises for the file, the doctor may not say that models are left alone."""
    monkeypatch.setenv("OEA_K0", "2")
    monkeypatch.setenv("OEA_LAYER_K0_FILE", str(tmp_path / "absent.json"))
    env_check = doctor_checks()[-1]
    assert env_check["name"] == "environment" and env_check["ok"] is False
    assert "OEA_LAYER_K0_FILE=" in env_check["detail"] and "not found" in env_check["detail"]
    assert "leaves models alone" not in env_check["detail"]
    future = tmp_path / "future.json"  # a version this oea cannot read, and a field it does not know
    for field, message in (({"version": 99}, "field 'version' must be one of [1, 2]"),
                           ({"colour": "red"}, "unknown field 'colour' (allowed: format, version,")):
        future.write_text(json.dumps({**json.loads(pathlib.Path(_schedule_file(tmp_path)).read_text()), **field}))
        monkeypatch.setenv("OEA_LAYER_K0_FILE", str(future))
        env_check = doctor_checks()[-1]
        assert env_check["ok"] is False and message in env_check["detail"], env_check
    monkeypatch.setenv("OEA_LAYER_K0_FILE", _schedule_file(tmp_path))
    env_check = doctor_checks()[-1]
    assert env_check["ok"] and "attaches each layer's config from OEA_LAYER_K0_FILE" in env_check["detail"]


def _environments(tmp_path) -> list[dict[str, str]]:
    good = _schedule_file(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_experts": 16, "top_k": 4, "num_layers": 2, "k0": ["one", 3]}')
    return [{}, {"OEA_MIN_BATCH": "3"}, {"OEA_K0": "2"}, {"OEA_K0": "x"}, {"OEA_K0": "2", "SGLANG_OEA_K0": "3"},
            {"OEA_LAYER_K0_FILE": good}, {"OEA_LAYER_K0_FILE": good, "OEA_K0": "4", "OEA_MIN_BATCH": "1"},
            {"OEA_LAYER_K0_FILE": good, "OEA_K0": "5"}, {"OEA_LAYER_K0_FILE": str(bad)},
            {"OEA_LAYER_K0_FILE": str(tmp_path / "absent.json")}, {"OEA_K0": "2", "OEA_GROUP_FILL": "all"}]


def test_doctor_and_maybe_attach_agree(model: torch.nn.Module, tmp_path) -> None:
    """For a model the file fits: the doctor's environment check fails exactly when maybe_attach raises,
    and says "leaves models alone" exactly when maybe_attach returns None."""
    from oea.integrations.transformers.attach import describe_environment

    for env in _environments(tmp_path):
        try:
            said: str | None = describe_environment(env)
        except ValueError:
            said = None
        try:
            handle = maybe_attach(model, env=env)
        except ValueError:
            assert said is None, f"{env}: maybe_attach raises, the doctor says {said!r}"
            continue
        assert said is not None, f"{env}: the doctor fails, maybe_attach works"
        assert (handle is None) == ("leaves models alone" in said), (env, said)
        if handle is not None:
            handle.remove()
    _assert_clean(model)


def test_an_empty_k0_warns_and_leaves_the_model_alone(model: torch.nn.Module) -> None:
    from oea.integrations.transformers.attach import describe_environment

    with pytest.warns(RuntimeWarning, match=r"^oea: OEA_K0 is set but empty: read as unset"):
        assert maybe_attach(model, env={"OEA_K0": ""}) is None
    assert describe_environment({"OEA_K0": ""}) == "OEA_K0 unset (set but empty): maybe_attach() leaves models alone"
    assert "no model preset has top_k >= 999" in describe_environment({"OEA_K0": "999"})
