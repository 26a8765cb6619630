"""``oea traces import``: the npz contract, the other input layouts, --json, and bad input (exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np
import pytest
import torch

from oea.cli import main
from oea.traces import load_trace

torch.set_num_threads(1)
N, K, T, L = 60, 4, 48, 3
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "traces.md"


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((T, L, N))
    ids = np.argsort(-logits, axis=-1)[..., :K]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return {"ids": ids, "scores": np.take_along_axis(probs, ids, -1).astype(np.float32),
            "request_ids": np.arange(T) % 6, "positions": np.arange(T) // 6, "step_ids": np.arange(T) // 6 + 30}


def _import(path: pathlib.Path, out: pathlib.Path, *extra: str) -> int:
    return main(["traces", "import", str(path), "--out", str(out), "--num-experts", str(N), "--top-k", str(K),
                 *extra])


def test_the_npz_contract_round_trips_every_array(tmp_path: pathlib.Path, capsys) -> None:
    arrays = _arrays()
    np.savez(tmp_path / "in.npz", **arrays)
    out = tmp_path / "out.safetensors"
    assert _import(tmp_path / "in.npz", out, "--scoring", "sigmoid", "--name", "qwen15", "--json") == 0
    record = json.loads(capsys.readouterr().out)
    assert record["out"] == str(out) and record["name"] == "qwen15" and record["num_tokens"] == T
    assert record["tensors"] == ["ids", "scores", "request_ids", "positions", "step_ids"]
    assert record["scoring"] == "sigmoid"
    assert record["order"].startswith("checked")
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["format"] == "oea-trace" and sidecar["version"] == 1
    assert sidecar["spec"]["num_experts"] == N and sidecar["spec"]["scoring"] == "sigmoid"
    trace = load_trace(str(out))
    assert trace.name == "qwen15"
    np.testing.assert_array_equal(trace.ids.numpy(), arrays["ids"])
    np.testing.assert_allclose(trace.scores.numpy(), arrays["scores"])
    np.testing.assert_array_equal(trace.request_ids.numpy(), arrays["request_ids"])
    np.testing.assert_array_equal(trace.positions.numpy(), arrays["positions"])
    np.testing.assert_array_equal(trace.step_ids.numpy(), arrays["step_ids"])


def test_an_imported_trace_replays_in_simulate_lockstep(tmp_path: pathlib.Path, capsys) -> None:
    np.savez(tmp_path / "in.npz", **_arrays())
    out = tmp_path / "out.safetensors"
    assert _import(tmp_path / "in.npz", out) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(out), "--mode", "lockstep", "--batch-sizes", "6",
                 "--policies", "vanilla", "oea", "--k0", "2", "--num-batches", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    vanilla, oea_row = rows[0]["mean_active_experts"], rows[1]["mean_active_experts"]
    assert 6 < vanilla <= 24 and oea_row < vanilla


def _write_jsonl(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    with path.open("w") as handle:
        for t in range(T):
            handle.write(json.dumps({"ids": arrays["ids"][t].tolist(), "scores": arrays["scores"][t].tolist(),
                                     "request_id": int(arrays["request_ids"][t]),
                                     "position": int(arrays["positions"][t]),
                                     "step_id": int(arrays["step_ids"][t])}) + "\n")


def _write_csv(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    header = ["token", "layer", *[f"id_{j}" for j in range(K)], *[f"score_{j}" for j in range(K)],
              "request_id", "position", "step_id"]
    lines = [",".join(header)]
    for t in reversed(range(T)):  # any row order
        for layer in range(L):
            lines.append(",".join(map(str, [t, layer, *arrays["ids"][t, layer].tolist(),
                                            *arrays["scores"][t, layer].tolist(), arrays["request_ids"][t],
                                            arrays["positions"][t], arrays["step_ids"][t]])))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_jsonl_and_csv_give_the_same_trace_as_npz(tmp_path: pathlib.Path, suffix: str) -> None:
    arrays = _arrays()
    np.savez(tmp_path / "in.npz", **arrays)
    (_write_jsonl if suffix == ".jsonl" else _write_csv)(tmp_path / f"in{suffix}", arrays)
    assert _import(tmp_path / "in.npz", tmp_path / "a.safetensors") == 0
    assert _import(tmp_path / f"in{suffix}", tmp_path / "b.safetensors") == 0
    a, b = load_trace(str(tmp_path / "a.safetensors")), load_trace(str(tmp_path / "b.safetensors"))
    for name in ("ids", "scores", "request_ids", "positions", "step_ids"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), msg=name)


def test_npy_ids_only_gets_the_unchecked_order_note(tmp_path: pathlib.Path, capsys) -> None:
    np.save(tmp_path / "ids.npy", _arrays()["ids"][:, 0])  # [T, k]: one layer
    out = tmp_path / "ids.safetensors"
    assert _import(tmp_path / "ids.npy", out) == 0
    trace = load_trace(str(out))
    assert trace.num_layers == 1 and trace.scores is None
    assert any("cannot be verified" in note for note in trace.meta["notes"])
    capsys.readouterr()
    assert main(["traces", str(out)]) == 0
    assert "best-first order: unchecked" in capsys.readouterr().out


def test_positions_are_derived_per_request_when_only_request_ids_are_given(tmp_path: pathlib.Path) -> None:
    arrays = _arrays()
    np.savez(tmp_path / "in.npz", ids=arrays["ids"], request_ids=np.array([0, 1, 0, 2, 1, 0] * (T // 6)))
    out = tmp_path / "out.safetensors"
    assert _import(tmp_path / "in.npz", out) == 0
    trace = load_trace(str(out))
    assert trace.positions[:6].tolist() == [0, 0, 1, 0, 1, 2]
    assert trace.positions[6:12].tolist() == [3, 2, 4, 1, 3, 5]
    assert any("positions derived" in note for note in trace.meta["notes"])


def test_sort_by_scores_fixes_an_unordered_input(tmp_path: pathlib.Path) -> None:
    arrays = _arrays()
    np.savez(tmp_path / "in.npz", ids=arrays["ids"][..., ::-1], scores=arrays["scores"][..., ::-1])
    out = tmp_path / "out.safetensors"
    assert _import(tmp_path / "in.npz", out) == 2
    assert _import(tmp_path / "in.npz", out, "--sort-by-scores") == 0
    np.testing.assert_array_equal(load_trace(str(out)).ids.numpy(), arrays["ids"])


def _bad_inputs(tmp: pathlib.Path) -> list[tuple[str, list[str], str]]:
    arrays = _arrays()
    cases = []
    dup = arrays["ids"].copy()
    dup[11, 2, 3] = dup[11, 2, 0]
    np.savez(tmp / "dup.npz", ids=dup)
    cases.append(("dup.npz", [], r"dup\.npz: field 'ids': .*row \(token 11, layer 2\)"))
    np.savez(tmp / "float.npz", ids=arrays["ids"] + 0.25 * (np.arange(T)[:, None, None] == 20))
    cases.append(("float.npz", [], r"float\.npz: field 'ids': .*integers.*row \(token 20, layer 0\)"))
    nan = arrays["scores"].copy()
    nan[30, 1, 2] = np.nan
    np.savez(tmp / "nan.npz", ids=arrays["ids"], scores=nan)
    cases.append(("nan.npz", [], r"nan\.npz: field 'scores': .*row \(token 30, layer 1\)"))
    np.savez(tmp / "shape.npz", ids=arrays["ids"], scores=arrays["scores"][:-1])
    cases.append(("shape.npz", [], r"shape\.npz: field 'scores': expected shape"))
    np.savez(tmp / "extra.npz", ids=arrays["ids"], weights=arrays["scores"])
    cases.append(("extra.npz", [], r"extra\.npz: unknown arrays \['weights'\]"))
    np.savez(tmp / "ok.npz", **arrays)
    cases.append(("ok.npz", ["--top-k", "8"], r"ok\.npz: field 'ids': has 4 experts per row.*--top-k is 8"))
    cases.append(("ok.npz", ["--num-experts", "40"], r"field 'ids': ids must lie in 0\.\.39"))
    (tmp / "x.parquet").write_text("")
    cases.append(("x.parquet", [], r"input format must be one of"))
    cases.append(("missing.npz", [], r"input file does not exist"))
    (tmp / "keys.jsonl").write_text('{"ids": [1, 2, 3, 4]}\n{"ids": [1, 2, 3, 5], "position": 1}\n')
    cases.append(("keys.jsonl", [], r"keys\.jsonl: line 2: .*same keys"))
    (tmp / "ragged.jsonl").write_text('{"ids": [[1, 2, 3, 4]]}\n{"ids": [[1, 2, 3, 4], [5, 6, 7, 8]]}\n')
    cases.append(("ragged.jsonl", [], r"ragged\.jsonl: line 2: field 'ids': shape"))
    (tmp / "gap.csv").write_text("token,layer,id_0,id_1,id_2,id_3\n0,0,1,2,3,4\n1,1,1,2,3,4\n")
    cases.append(("gap.csv", [], r"gap\.csv: \(token 0, layer 1\) is missing"))
    (tmp / "text.csv").write_text("token,layer,id_0,id_1,id_2,id_3\n0,0,1,2,3.5,4\n")
    cases.append(("text.csv", [], r"text\.csv: line 2: column 'id_2' must be an integer, got '3\.5'"))
    (tmp / "cols.csv").write_text("token,layer,id_0,id_1\n0,0,1,2\n")
    cases.append(("cols.csv", [], r"cols\.csv: header lacks columns \['id_2', 'id_3'\]"))
    np.savez(tmp / "nan_logits.npz", logits=np.full((T, L, N), np.nan, dtype=np.float32))
    cases.append(("nan_logits.npz", [], r"nan_logits\.npz: field 'logits': router logits must not be NaN .*"
                                        r"row \(token 0, layer 0\) holds 60 NaN of 60 \(144 of 144 rows hold NaN\)"))
    some = np.random.default_rng(1).standard_normal((T, L, N)).astype(np.float32)
    some[7, 1] = -np.inf
    np.savez(tmp / "masked_row.npz", logits=some)
    cases.append(("masked_row.npz", [], r"field 'logits': every row needs a logit above -inf .*"
                                        r"row \(token 7, layer 1\) holds only -inf \(1 of 144 rows\)"))
    cases.append(("ok.npz", ["--num-experts", "100000"], r"--num-experts must be in 1\.\.32768 \(a trace stores "
                                                         r"expert ids as int16\), got 100000"))
    np.savez(tmp / "ids_only.npz", ids=arrays["ids"])
    cases.append(("ids_only.npz", ["--sort-by-scores"], r"--sort-by-scores reorders each row by its scores, but "
                                                        r".*ids_only\.npz has no 'scores' \(it holds \['ids'\]\)"))
    cases.append(("ok.npz", ["--name", ""], r"argument --name: must be a non-empty name, got ''"))
    cases.append(("ok.npz", ["--name", "  "], r"argument --name: must be a non-empty name"))
    return cases


def test_bad_inputs_exit_2_with_one_line_naming_the_problem_and_write_nothing(tmp_path: pathlib.Path,
                                                                              capsys) -> None:
    for name, extra, pattern in _bad_inputs(tmp_path):
        out = tmp_path / "out" / f"{name}.safetensors"
        defaults = []
        for flag, value in (("--num-experts", str(N)), ("--top-k", str(K))):
            if flag not in extra:
                defaults += [flag, value]
        argv = ["traces", "import", str(tmp_path / name), "--out", str(out), *defaults, *extra]
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 2, (name, captured)
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in captured.err, (name, captured.err)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert not out.exists() and not out.with_suffix(".json").exists(), name


@pytest.mark.parametrize(("argv", "message"), [
    (["traces", "import", "x.npz", "--num-experts", "4", "--top-k", "2"], "needs --out"),
    (["traces", "import", "--out", "o.safetensors", "--num-experts", "4", "--top-k", "2"], "needs FILE"),
    (["traces", "import", "x.npz", "--out", "o.safetensors", "--top-k", "2"], "needs --num-experts"),
    (["traces", "import", "x.npz", "--out", "o.st", "--num-experts", "4", "--top-k", "2"], "--out must name a "
                                                                                           ".safetensors file"),
    (["traces", "qwen3-30b-a3b", "--top-k", "2"], "--top-k only applies to `oea traces import"),
])
def test_missing_or_misplaced_flags_are_named(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_python_example_in_the_docs_runs(tmp_path: pathlib.Path, capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert blocks, "docs/traces.md has no python example"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks:
            exec(compile(block, str(DOCS), "exec"), {})
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "'vanilla'" in out and "row (token 0, layer 0)" in out
    assert (tmp_path / "my-trace.json").is_file()


def test_the_docs_name_every_sidecar_field_and_input_layout() -> None:
    text = DOCS.read_text()
    for name in ("format", "version", "num_tokens", "num_layers", "spec", "tensors", "name", "source", "licence",
                 "model_preset", "notes", "renormalize", "n_group", "topk_group", "routed_scaling_factor"):
        assert f"`{name}`" in text, name
    for suffix in (".npz", ".npy", ".jsonl", ".csv"):
        assert f"`{suffix}`" in text, suffix
