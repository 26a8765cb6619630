"""Issue 39's command-line and file cases: each bad input exits 2 with one line naming the flag (or the file and
field) before any work, nothing written; directories are called directories; cut and mislabelled files say so."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import torch

from oea.cli import main
from oea.routing import RouterSpec
from oea.traces import Trace, save_trace


def _trace(tokens: int = 6, n: int = 16, k: int = 4) -> Trace:
    raw = torch.randn(tokens, 2, n, generator=torch.Generator().manual_seed(0))
    return Trace(spec=RouterSpec(n, k), logits=raw, meta={"name": "tiny"})


@pytest.fixture
def files(tmp_path: pathlib.Path) -> dict[str, str]:
    """Inputs kept outside the working folder, which must stay empty."""
    inputs = tmp_path / "inputs"
    (inputs / "adir").mkdir(parents=True)
    (inputs / "afile").write_text("x")
    np.savez(inputs / "full.npz", ids=np.zeros((200, 2, 2), dtype=np.int64))
    whole = (inputs / "full.npz").read_bytes()
    (inputs / "half.npz").write_bytes(whole[: len(whole) // 2])
    (inputs / "text.npz").write_text("ids\n1 2\n")
    (inputs / "text.npy").write_text("ids\n1 2\n")
    save_trace(_trace(), inputs / "tiny.safetensors")
    sidecar = inputs / "tiny.json"
    meta = json.loads(sidecar.read_text())
    save_trace(_trace(), inputs / "nopreset.safetensors")
    (inputs / "nopreset.json").write_text(json.dumps({**meta, "model_preset": "nosuch-model"}))
    (inputs / "huge.json").write_text(json.dumps({"num_experts": 10**30, "top_k": 2, "hidden_size": 8,
                                                  "moe_intermediate_size": 8, "num_moe_layers": 1,
                                                  "bytes_per_weight": "bf16"}))
    work = tmp_path / "work"
    work.mkdir()
    return {"dir": str(inputs / "adir"), "file": str(inputs / "afile"), "half": str(inputs / "half.npz"),
            "text_npz": str(inputs / "text.npz"), "text_npy": str(inputs / "text.npy"),
            "tiny": str(inputs / "tiny.safetensors"), "nopreset": str(inputs / "nopreset.safetensors"),
            "huge": str(inputs / "huge.json"), "work": str(work)}


IMPORT = ["--out", "o.safetensors", "--num-experts", "4", "--top-k", "2"]
# (argv with {placeholders} of ``files``, a fragment of the one error line)
CASES: list[tuple[list[str], str]] = [
    (["traces", "import", "{half}", *IMPORT], "half.npz: unreadable .npz file, cut short or corrupt (BadZipFile"),
    (["traces", "import", "{text_npz}", *IMPORT],
     "text.npz: not an .npz archive (a zip file): it does not begin as one"),
    (["traces", "import", "{text_npy}", *IMPORT], "text.npy: not a .npy file: it does not begin as one"),
    (["traces", "import", "{dir}", *IMPORT], "input file {dir} is a directory; give a file"),
    (["simulate", "--trace", "{dir}"], "trace {dir} is a directory; give a .safetensors trace file"),
    (["traces", "{dir}"], "trace {dir} is a directory"),
    (["roofline", "--model-preset-file", "{dir}"], "model preset file {dir} is a directory; give a .json or .toml"),
    (["roofline", "--model-preset-file", "{huge}", "--trace", "none"],
     "field 'num_experts' must be an integer in 1..32768, got 1000000000000000000000000000000"),
    (["bench", "serve", "--summarize", "{dir}"], "--summarize {dir} is a directory; give the JSONL file"),
    (["simulate", "--trace", "{tiny}", "--batch-sizes", "6", "--k0", "2", "--num-batches", "4"],
     "--batch-sizes 6 takes the whole pool of trace 'tiny' (6 tokens): every mixed batch would be the same one"),
    (["simulate", "--trace", "{tiny}", "--batch-sizes", "2", "--model-preset", "qwen3-30b-a3b"],
     "--model-preset sets the latency model, which needs --gpu"),
    (["simulate", "--trace", "{tiny}", "--batch-sizes", "2", "--tp", "2", "--model-preset", "qwen3-30b-a3b"],
     "--model-preset and --tp set the latency model, which needs --gpu"),
    (["simulate", "--trace", "{nopreset}", "--batch-sizes", "2"],
     "field 'model_preset': must be one of oea's model presets"),
    (["eval", "--batch-sizes", "1000"], "--batch-sizes must be <= 60, the held-out documents"),
    (["capture", "--out", "/dev/full"], "--out /dev/full: is not a regular file (a device, pipe or socket)"),
    (["capture", "--out", "trace.txt"], "--out trace.txt: the file name must end in one of .safetensors"),
    (["compare", "--trace", "{tiny}", "--batch-sizes", "2", "--plot", "/dev/full"],
     "--plot /dev/full: is not a regular file"),
    (["compare", "--trace", "{tiny}", "--batch-sizes", "2", "--plot", "myplot"],
     "--plot myplot: the file name must end in one of .png, .pdf, .svg"),
    (["compare", "--trace", "{tiny}", "--batch-sizes", "2", "--plot", "p.txt"], "got '.txt'"),
    (["bench", "serve", "--base-url", "notaurl"], "--base-url must be an http:// or https:// URL with a host"),
    (["bench", "serve", "--arm", "x=localhost:8000"], "--arm x=URL must be an http:// or https:// URL"),
    # the other flags are checked before the (unreachable) server is contacted
    (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", "myplot"], "--plot myplot: the file name"),
    (["bench", "serve", "--base-url", "http://127.0.0.1:9", "--engine-metrics", "bad"],
     "--engine-metrics must be NAME=FILE, got 'bad'"),
    (["serve", "vllm", "--python", "nosuch/python", "--", "--model", "x"],
     "--python nosuch/python: no such executable; give the interpreter that has vllm installed"),
]


@pytest.mark.parametrize(("argv", "fragment"), CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_bad_input_exits_2_with_one_line_before_any_work(
    argv: list[str], fragment: str, files: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(files["work"])
    code = main([arg.format(**files) for arg in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("oea simulate: simulating")]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert fragment.format(**files) in lines[0], lines[0]
    assert "Traceback" not in err and out == ""
    assert os.listdir(files["work"]) == [], "nothing may be written"


def test_roofline_takes_model_preset_as_simulate_does(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["roofline", "--trace", "none", "--batch-sizes", "4", "--k0", "3", "--json"]
    assert main([*argv, "--model-preset", "olmoe-1b-7b"]) == 0
    by_flag = json.loads(capsys.readouterr().out)
    assert main([*argv, "--model", "olmoe-1b-7b"]) == 0
    assert json.loads(capsys.readouterr().out) == by_flag


def test_a_small_mixed_pool_is_noted_when_draws_repeat(files: dict[str, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", files["tiny"], "--batch-sizes", "5", "--k0", "2", "--num-batches", "8",
                 "--policies", "vanilla", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert "B=5: the 6-token pool holds only 6 different batches, so mixed draws repeat some of them" in row["note"]


def test_the_simulate_api_notes_a_batch_of_the_whole_pool() -> None:
    from oea.sim import simulate

    [row] = simulate(_trace(), policies=["vanilla"], batch_sizes=[6], num_batches=2)
    assert "B=6 takes the whole 6-token pool: every batch is the same one, so its interval is 0" in row["note"]


def test_save_trace_refuses_a_path_it_would_rename_or_a_device(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"path must name a \.safetensors file .* got '.*t\.txt'"):
        save_trace(_trace(), tmp_path / "t.txt")
    with pytest.raises(ValueError, match=r"path must name a \.safetensors file"):
        save_trace(_trace(), "/dev/full")
    folder = _folder(tmp_path / "d.safetensors")
    with pytest.raises(ValueError, match=r"is not a regular file \(a folder, device or pipe\)"):
        save_trace(_trace(), folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


def _folder(path: pathlib.Path) -> pathlib.Path:
    path.mkdir()
    return path


def test_load_and_layer_file_readers_call_a_directory_a_directory(tmp_path: pathlib.Path) -> None:
    from oea.config import read_layer_k0_file
    from oea.traces import load_trace
    from oea.traces.format import read_trace_file

    with pytest.raises(ValueError, match=f"trace {tmp_path} is a directory"):
        load_trace(tmp_path)
    folder = _folder(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match=f"trace file {folder} is a directory"):
        read_trace_file(folder)
    with pytest.raises(ValueError, match=f"per-layer k0 file {tmp_path} is a directory"):
        read_layer_k0_file(tmp_path)


def test_doctor_names_a_directory_a_file_for_a_folder_and_a_cut_metrics_file(tmp_path: pathlib.Path) -> None:
    from oea.integrations.doctor.env import check_environment
    from oea.integrations.served import served_checks

    (tmp_path / "afile").write_text("x")
    checks = {c.name: c for c in check_environment({
        "OEA_K0": "2", "OEA_LAYER_K0_FILE": str(tmp_path), "OEA_TRACE_FILE": f"{tmp_path}/afile/t.safetensors",
        "OEA_METRICS_FILE": f"{tmp_path}/afile/m.jsonl"})}
    assert not checks["OEA_LAYER_K0_FILE"].ok and "is a directory" in checks["OEA_LAYER_K0_FILE"].detail
    for var in ("OEA_TRACE_FILE", "OEA_METRICS_FILE"):
        assert not checks[var].ok and checks[var].detail.endswith(f"'{tmp_path}/afile' is a file, not a folder")
    [found] = served_checks(tmp_path, 2)
    assert not found["ok"] and found["detail"] == (f"--metrics-file {tmp_path} is a directory; give the server's "
                                                   "OEA_METRICS_FILE (a JSONL file)")
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"decode": true, "oe')
    [found] = served_checks(cut, 2)
    assert not found["ok"] and "its only line (1) is cut short" in found["detail"]
    row = {"decode": True, "oea": True, "rows": 4, "active": [3]}
    cut.write_text(json.dumps(row) + '\n{"decode": tr')  # a complete line before the cut one: still read
    assert served_checks(cut, 2)[0]["detail"].endswith("1 forwards, 1 decode on rank(s) [0]")
