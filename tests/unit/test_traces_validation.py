"""Every malformed trace is refused with the file, the field and the first offending row named.

Each case is checked three ways: building a ``Trace``, loading a file written behind the format's back
(so ``save_trace``'s own checks cannot hide a loader gap), and the CLI (exit 2, one line, no traceback).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from property_cases import examples
from safetensors.torch import save_file

import oea
from oea.cli import main
from oea.traces import Trace, bundled_trace_names, load_trace, save_trace
from oea.traces.checks import ordering_status

torch.set_num_threads(1)
N, K, T, L = 16, 4, 12, 3


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, L, N, generator=g)
    scores, ids = logits.softmax(-1).topk(K, dim=-1)
    return {"ids": ids, "scores": scores, "request_ids": torch.arange(T) % 4, "positions": torch.arange(T) // 4,
            "step_ids": torch.arange(T) // 4 + 100}


def _dup(t):
    t["ids"][7, 2, 3] = t["ids"][7, 2, 1]


def _range(t):
    t["ids"][4, 1, 0] = N


def _negative_id(t):
    t["ids"][2, 0, 2] = -1


def _float_ids(t):
    t["ids"] = t["ids"].double()
    t["ids"][5, 1, 3] = 2.5


def _whole_float_ids(t):
    t["ids"] = t["ids"].float()


def _nan(t):
    t["scores"][6, 2, 1] = float("nan")


def _inf(t):
    t["scores"][6, 0, 0] = float("inf")


def _negative_score(t):
    t["scores"][3, 1, 3] = -0.1


def _above_one(t):
    t["scores"][8, 0, 0] = 1.5


def _order(t):
    t["scores"][9, 1] = t["scores"][9, 1].flip(0)


def _shape(t):
    t["scores"] = t["scores"][:-1]


def _request_length(t):
    t["request_ids"] = t["request_ids"][:-2]


def _float_positions(t):
    t["positions"] = t["positions"].double() + 0.5


def _negative_position(t):
    t["positions"][10] = -3


def _negative_step(t):
    t["step_ids"][11] = -1


def _float_steps(t):
    t["step_ids"] = t["step_ids"].double()
    t["step_ids"][3] = 7.5


def _step_length(t):
    t["step_ids"] = t["step_ids"][:-1]


def _logits(t) -> torch.Tensor:
    t["logits"] = torch.randn(T, L, N, generator=torch.Generator().manual_seed(1))
    return t["logits"]


def _nan_logits(t):
    _logits(t)[5, 1, 3:7] = float("nan")


def _all_nan_logits(t):
    _logits(t).fill_(float("nan"))


def _unroutable_row(t):
    _logits(t)[2, 2] = float("-inf")


def _nan_bias(t):
    t["correction_bias"] = torch.zeros(L, N)
    t["correction_bias"][2, 5] = float("nan")


# (mutation, field, regex for the row / detail the message must name)
CASES: list[tuple[Callable, str, str]] = [
    (_dup, "ids", r"distinct.*row \(token 7, layer 2\).*expert \d+ twice"),
    (_range, "ids", r"0\.\.15.*row \(token 4, layer 1\)"),
    (_negative_id, "ids", r"0\.\.15.*row \(token 2, layer 0\)"),
    (_float_ids, "ids", r"integers.*2\.5.*row \(token 5, layer 1\)"),
    (_whole_float_ids, "ids", r"integer tensor, got float32"),
    (_nan, "scores", r"finite.*row \(token 6, layer 2\)"),
    (_inf, "scores", r"finite.*row \(token 6, layer 0\)"),
    (_negative_score, "scores", r"\[0, 1\].*row \(token 3, layer 1\).*negative"),
    (_above_one, "scores", r"\[0, 1\].*row \(token 8, layer 0\).*above 1"),
    (_order, "scores", r"best first.*row \(token 9, layer 1\)"),
    (_shape, "scores", r"expected shape \[T=12, L=3, k=4\], got \(11, 3, 4\)"),
    (_request_length, "request_ids", r"expected shape \[T=12\], got \(10,\)"),
    (_float_positions, "positions", r"integers.*token 0"),
    (_negative_position, "positions", r">= 0.*token 10 has -3"),
    (_negative_step, "step_ids", r">= 0.*token 11 has -1"),
    (_float_steps, "step_ids", r"integers.*7\.5 at token 3"),
    (_step_length, "step_ids", r"expected shape \[T=12\], got \(11,\)"),
    (_nan_logits, "logits", r"not be NaN.*row \(token 5, layer 1\) holds 4 NaN of 16 \(1 of 36 rows hold NaN\)"),
    (_all_nan_logits, "logits", r"not be NaN.*\(36 of 36 rows hold NaN\)"),
    (_unroutable_row, "logits", r"above -inf.*row \(token 2, layer 2\) holds only -inf \(1 of 36 rows\)"),
    (_nan_bias, "correction_bias", r"finite values, layer 2 expert 5 holds nan"),
]


@pytest.mark.parametrize(("mutate", "field", "detail"), CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_building_a_bad_trace_names_field_and_row(mutate, field: str, detail: str) -> None:
    tensors = _tensors()
    mutate(tensors)
    with pytest.raises(ValueError, match=rf"^Trace: field '{field}': .*{detail}"):
        Trace(spec=oea.RouterSpec(N, K), **tensors)


def _write_behind_the_back(directory: pathlib.Path, tensors: dict[str, torch.Tensor]) -> pathlib.Path:
    """A trace file holding ``tensors`` as they are (no validation), with a consistent sidecar."""
    path = directory / "bad.safetensors"
    save_file({name: value.contiguous() for name, value in tensors.items()}, str(path))
    meta = {"format": "oea-trace", "version": 1, "num_tokens": int(tensors["ids"].shape[0]),
            "num_layers": L, "spec": {"num_experts": N, "top_k": K}, "tensors": sorted(tensors)}
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize(("mutate", "field", "detail"), CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_loading_a_bad_file_names_file_field_and_row(tmp_path: pathlib.Path, mutate, field: str,
                                                     detail: str) -> None:
    tensors = _tensors()
    mutate(tensors)
    path = _write_behind_the_back(tmp_path, tensors)
    with pytest.raises(ValueError, match=rf"bad\.safetensors: field '{field}': .*{detail}"):
        load_trace(str(path))


@pytest.mark.parametrize("command", [
    ["simulate", "--batch-sizes", "4", "--num-batches", "2"],
    ["calibrate", "layers", "--batch-size", "4", "--num-batches", "2"],
    ["compare", "--batch-size", "4", "--num-batches", "2", "--ep", "2"],
])
@pytest.mark.parametrize(("mutate", "field", "detail"), [CASES[0], CASES[3], CASES[5], CASES[9]],
                         ids=["dup", "float_ids", "nan", "order"])
def test_every_command_turns_a_bad_trace_into_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], command: list[str], mutate, field: str, detail: str
) -> None:
    tensors = _tensors()
    mutate(tensors)
    path = _write_behind_the_back(tmp_path, tensors)
    assert main([*command, "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert str(path) in lines[0] and f"field '{field}'" in lines[0]
    assert __import__("re").search(detail, lines[0])


@pytest.mark.parametrize("command", [["simulate"], ["calibrate", "layers"], ["compare"], ["traces"]])
def test_a_missing_trace_file_is_said_not_to_exist(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    argv = [*command, "/missing.safetensors"] if command == ["traces"] else [*command, "--trace",
                                                                           "/missing.safetensors"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not exist: /missing.safetensors" in err and len(err.strip().splitlines()) == 1


def test_a_missing_sidecar_is_named(tmp_path: pathlib.Path) -> None:
    path = save_trace(Trace(spec=oea.RouterSpec(N, K), **_tensors()), tmp_path / "t.safetensors")
    path.with_suffix(".json").unlink()
    with pytest.raises(FileNotFoundError, match=r"sidecar does not exist: .*t\.json"):
        load_trace(str(path))


@pytest.mark.parametrize(("key", "value"), [("notes", "one string"), ("licence", 3), ("model_preset", 7)])
def test_sidecar_fields_of_the_wrong_type_are_named(tmp_path: pathlib.Path, key: str, value: object) -> None:
    path = save_trace(Trace(spec=oea.RouterSpec(N, K), **_tensors()), tmp_path / "s.safetensors")
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta[key] = value
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"s\.json: field '{key}'"):
        load_trace(str(path))


def test_unordered_scores_are_accepted_when_a_correction_bias_ranked_the_experts() -> None:
    tensors = _tensors()
    _order(tensors)
    trace = Trace(spec=oea.RouterSpec(N, K, scoring="sigmoid"), correction_bias=torch.zeros(L, N), **tensors)
    assert ordering_status(trace).startswith("unchecked")


def test_order_status_says_what_could_be_checked() -> None:
    tensors = _tensors()
    assert ordering_status(Trace(spec=oea.RouterSpec(N, K), **tensors)).startswith("checked")
    del tensors["scores"]
    status = ordering_status(Trace(spec=oea.RouterSpec(N, K), **tensors))
    assert status.startswith("unchecked") and "cannot be verified" in status


def test_valid_tensors_given_as_numpy_are_accepted_and_stored_as_int64() -> None:
    tensors = {name: value.numpy() for name, value in _tensors().items()}
    tensors["ids"] = tensors["ids"].astype(np.int32)
    trace = Trace(spec=oea.RouterSpec(N, K), **tensors)
    assert trace.ids.dtype == torch.int64 and trace.positions.dtype == torch.int64


def test_every_bundled_trace_passes_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    for name in bundled_trace_names():
        trace = load_trace(name)
        assert trace.num_tokens > 0, name
    assert main(["traces", "flame-moe-290m"]) == 0
    assert "best-first order: checked" in capsys.readouterr().out


# ---------------------------------------------------------------- property: one bad entry anywhere is found there

KINDS = ("id out of range", "id below 0", "id repeated", "score above 1", "score below 0", "score rising",
         "position below 0", "step id below 0")
FOUND = {"id out of range": ("ids", "0..15"), "id below 0": ("ids", "0..15"), "id repeated": ("ids", "distinct"),
         "score above 1": ("scores", "above 1"), "score below 0": ("scores", "negative"),
         "score rising": ("scores", "best first"), "position below 0": ("positions", ">= 0"),
         "step id below 0": ("step_ids", ">= 0")}


def _corrupt(tensors: dict[str, torch.Tensor], kind: str, t: int, layer: int, slot: int) -> None:
    """Make entry (t, layer, slot) of a clean trace wrong in one way, leaving every other row valid."""
    ids, scores = tensors["ids"], tensors["scores"]
    if kind == "id out of range":
        ids[t, layer, slot] = N
    elif kind == "id below 0":
        ids[t, layer, slot] = -1
    elif kind == "id repeated":
        ids[t, layer, slot] = ids[t, layer, (slot + 1) % K]
    elif kind == "score above 1":
        scores[t, layer, slot] = 1.01
    elif kind == "score below 0":
        scores[t, layer, slot] = -1e-6
    elif kind == "score rising":
        slot = max(slot, 1)
        scores[t, layer, slot] = torch.nextafter(scores[t, layer, slot - 1], torch.tensor(2.0))
    else:
        tensors["positions" if kind == "position below 0" else "step_ids"][t] = -1


@settings(max_examples=examples(60))
@given(st.sampled_from(KINDS), st.integers(0, T - 1), st.integers(0, L - 1), st.integers(0, K - 1))
@example("id out of range", 0, 0, 0)
@example("id out of range", T - 1, L - 1, K - 1)
@example("score rising", T - 1, L - 1, K - 1)
@example("score below 0", 0, L - 1, K - 1)
@example("position below 0", T - 1, 0, 0)
def test_one_bad_entry_anywhere_is_refused_naming_its_row(kind: str, t: int, layer: int, slot: int) -> None:
    tensors = _tensors()
    _corrupt(tensors, kind, t, layer, slot)
    field, what = FOUND[kind]
    where = f"token {t}" if field in ("positions", "step_ids") else f"row (token {t}, layer {layer})"
    with pytest.raises(ValueError, match=rf"^Trace: field '{field}': .*{what}") as error:
        Trace(spec=oea.RouterSpec(N, K), **tensors)
    assert where in str(error.value), str(error.value)


@settings(max_examples=examples(30))
@given(st.integers(0, T - 1), st.integers(0, L - 1), st.integers(1, K - 1))
@example(0, 0, 1)
@example(T - 1, L - 1, K - 1)
def test_values_at_the_edge_of_the_rules_are_accepted(t: int, layer: int, slot: int) -> None:
    """The largest id N - 1, equal neighbouring scores (ties are not a wrong order), a best score one float16
    ulp above 1 (storage rounding) and position / step id 0 all pass."""
    tensors = _tensors()
    row = tensors["ids"][t, layer]
    if int(N - 1) not in row.tolist():
        row[slot] = N - 1
    tensors["scores"][t, layer, slot] = tensors["scores"][t, layer, slot - 1]
    tensors["scores"][t, layer, 0] = 1.0 + 2.0**-10
    tensors["positions"][t] = 0
    tensors["step_ids"][t] = 0
    trace = Trace(spec=oea.RouterSpec(N, K), **tensors)
    assert trace.num_tokens == T


def test_more_experts_than_int16_ids_hold_are_refused(tmp_path: pathlib.Path) -> None:
    ids = torch.tensor([[[40000, 1]]])
    with pytest.raises(ValueError, match=r"^Trace: field 'spec.num_experts': must be in 1\.\.32768 \(expert ids are "
                                         r"stored as int16\), got 40001"):
        Trace(spec=oea.RouterSpec(40001, 2), ids=ids)
    trace = Trace(spec=oea.RouterSpec(32768, 2), ids=torch.tensor([[[32767, 0]]]))
    assert load_trace(str(save_trace(trace, tmp_path / "wide.safetensors"))).ids[0, 0].tolist() == [32767, 0]
