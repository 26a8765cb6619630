"""Adapter conformance: every scenario of ``conformance_scenarios.SCENARIOS`` through every adapter's real routing
entry point (vLLM's ``oea::cpu_route`` op, SGLang's ``select_experts`` rewrite, ``oea.maybe_attach``), checked
against ``oea.route`` with the config the table names, and the same words for the same bad input.

One child process per engine runs the whole table (``ADAPTERS``: adapter -> its interpreter and script); a new
engine adapter adds a row there and a child script, and is held to the same table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_scenarios import SCENARIOS, TOP_K, Scenario, as_json, expected, family_spec, logits, spec_fields
from engine_venvs import child_env, engine_python

from oea.config import write_layer_k0_file
from oea.integrations.replay import filler_slots
from oea.routing import LayerK0Schedule, route, routing_difference

HERE = Path(__file__).resolve().parent
ADAPTERS: dict[str, tuple[Callable[[], Path | str], str]] = {  # adapter -> (its Python, its child script)
    "vllm": (lambda: engine_python("vllm"), "conformance_vllm.py"),
    "sglang": (lambda: engine_python("sglang"), "conformance_sglang.py"),
    "transformers": (lambda: sys.executable, "conformance_transformers.py"),
}
ENGINE_MARKS = {"vllm": [pytest.mark.engine, pytest.mark.slow], "sglang": [pytest.mark.engine, pytest.mark.slow],
                "transformers": []}
_RESULTS: dict[str, dict[str, Any]] = {}  # adapter -> its outcomes, whose messages name files in `folder`


def _layer_files(folder: Path) -> dict[str, str]:
    files = {}
    for scenario in SCENARIOS:
        if scenario.layer_file is not None:
            fields = dict(scenario.layer_file)
            for name in ("k0", "layer_ids"):
                if name in fields:
                    fields[name] = tuple(fields[name])
            if "batch_k0" in fields:
                fields["batch_k0"] = tuple((e["max_batch"], tuple(e["k0"])) for e in fields["batch_k0"])
            path = folder / f"{scenario.name}.json"
            write_layer_k0_file(LayerK0Schedule(**fields), path)
            files[scenario.name] = str(path)
    return files


# One folder per process, as _RESULTS is: a module-scoped fixture is made again whenever another module's tests
# run between this module's (a shuffled order), and the cached outcomes would name the old folder's files.
@pytest.fixture(scope="session")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.fixture(scope="session")
def layer_files(folder: Path) -> dict[str, str]:
    return _layer_files(folder)


def _results(adapter: str, folder: Path, files: dict[str, str]) -> dict[str, Any]:
    """The adapter's outcome of every scenario that applies to it (one child process, run once)."""
    if adapter not in _RESULTS:
        python, script = ADAPTERS[adapter]
        interpreter = python()
        table = [s for s in SCENARIOS if adapter in s.adapters]
        scenarios = folder / f"{adapter}.json"
        scenarios.write_text(as_json(tuple(table), files))
        proc = subprocess.run([str(interpreter), str(HERE / script), str(scenarios)], capture_output=True, text=True,
                              cwd=HERE, env=child_env(), timeout=900)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
        assert line is not None, f"{adapter} child: exit {proc.returncode}\n{proc.stderr[-4000:]}"
        _RESULTS[adapter] = json.loads(line[len("RESULT"):])
    return _RESULTS[adapter]


def _expected_routing(scenario: Scenario, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``oea.route`` with the table's config, padding rows left out of the union; [real rows, k]. What an engine
    puts in its padding rows is its own (SGLang marks them -1), so only the real rows are compared."""
    x, spec = logits(scenario.rows, layer), family_spec(scenario.family)
    real = scenario.rows - scenario.padding
    valid = torch.arange(scenario.rows) < real if scenario.padding else None
    ids, weights = route(x, spec, expected(scenario, layer), valid)
    return ids[:real], weights[:real]


def _message(scenario: Scenario, files: dict[str, str]) -> str:
    return (scenario.message or "").replace("{file}", files.get(scenario.name, ""))


def _check_replay(adapter: str, layer: int, got: dict[str, Any], ids: torch.Tensor, weights: torch.Tensor,
                  engine_own: bool) -> None:
    """The routed-experts ids of one layer's real rows (``got["replay"]``) against the routing the layer should
    have run (``ids`` / ``weights`` [real rows, k]): every slot is a filler by ``oea.integrations.replay``'s rule
    or the adapter's own id there with a non-zero weight; each row's distinct ids are exactly the experts with a
    non-zero weight; ``engine_own`` (OEA changed nothing): the adapter's ids exactly."""
    real = ids.shape[0]
    replay = torch.tensor(got["replay"])[:real, :TOP_K]
    own_ids, own_weights = torch.tensor(got["ids"])[:real, :TOP_K], torch.tensor(got["weights"])[:real, :TOP_K]
    where = f"{adapter} layer {layer} routed-experts ids"
    if engine_own:
        assert torch.equal(replay, own_ids), f"{where} {replay.tolist()} are not the engine's own {own_ids.tolist()}"
    filler = filler_slots(replay)
    ran = (replay == own_ids) & (own_weights != 0)
    assert bool((filler | ran).all()), f"{where}: slots neither a filler nor run with a weight: {replay.tolist()}"
    for row in range(real):
        replayed = set(replay[row][~filler[row]].tolist())
        wanted = set(ids[row][weights[row] != 0].tolist())
        assert replayed == wanted, f"{where}, row {row}: {sorted(replayed)} replayed, {sorted(wanted)} ran"


def _check(adapter: str, scenario: Scenario, outcome: dict[str, Any], files: dict[str, str]) -> None:
    assert outcome["kind"] != "harness-error", outcome["message"]
    want = scenario.outcome(adapter)
    message = _message(scenario, files)
    assert outcome["kind"] == want, f"{adapter}: {outcome['kind']} ({outcome['message']}), table says {want}"
    if want == "error":
        assert message in outcome["message"], f"{adapter} says {outcome['message']!r}, table says {message!r}"
        return
    if want == "stock":
        assert any(message in warning for warning in outcome["warnings"]), (adapter, outcome["warnings"])
        for layer, got in enumerate(outcome["layers"]):
            ids, weights = route(logits(scenario.rows, layer), family_spec(scenario.family))
            difference = routing_difference(ids, weights, torch.tensor(got["ids"]), torch.tensor(got["weights"]))
            assert difference is None, f"{adapter} layer {layer} is not the engine's own routing: {difference}"
            _check_replay(adapter, layer, got, ids, weights, engine_own=True)
        return
    if scenario.warning is not None:
        assert any(scenario.warning in warning for warning in outcome["warnings"]), (adapter, outcome["warnings"])
    assert len(outcome["layers"]) == 2
    for layer, got in enumerate(outcome["layers"]):
        assert got["spec"] == spec_fields(family_spec(scenario.family)), f"{adapter} translated the router wrongly"
        ids, weights = _expected_routing(scenario, layer)
        real = scenario.rows - scenario.padding
        difference = routing_difference(ids, weights, torch.tensor(got["ids"])[:real],
                                        torch.tensor(got["weights"])[:real])
        assert difference is None, f"{adapter} layer {layer} vs oea.route({expected(scenario, layer)}): {difference}"
        _check_replay(adapter, layer, got, ids, weights, engine_own=expected(scenario, layer) is None)


CASES = [pytest.param(adapter, scenario, id=f"{adapter}-{scenario.name}", marks=ENGINE_MARKS[adapter])
         for adapter in ADAPTERS for scenario in SCENARIOS if adapter in scenario.adapters]


@pytest.mark.parametrize(("adapter", "scenario"), CASES)
def test_conformance(adapter: str, scenario: Scenario, folder: Path, layer_files: dict[str, str]) -> None:
    _check(adapter, scenario, _results(adapter, folder, layer_files)[scenario.name], layer_files)


def test_conformance_table_covers_every_situation() -> None:
    """The table holds each setting, each router family and each bad value the architecture doc names."""
    names = {s.name for s in SCENARIOS}
    env = {var for s in SCENARIOS for var in s.env} | {"OEA_LAYER_K0_FILE"}
    assert {"OEA_K0", "SGLANG_OEA_K0", "OEA_MIN_BATCH", "OEA_MAX_EXPERTS", "OEA_GROUP_FILL", "OEA_POLICY"} <= env
    assert {s.family for s in SCENARIOS} == {"softmax-renorm", "softmax", "sigmoid-grouped"}
    assert {"layer-file", "layer-file-batch-k0", "padding-rows", "k0-above-top-k", "layer-file-another-model",
            "layer-file-missing-layer", "bad-k0", "alias-conflict", "routed_experts-fillers",
            "routed_experts-k0-equals-top-k"} <= names
    assert len(CASES) == sum(len(s.adapters) for s in SCENARIOS)
