"""Every ``oea`` subcommand: a bad value exits 2 with one stderr line naming the flag (and what is allowed),
no traceback, nothing written. Also: every flag has help text, every command has ``--json``, and the docs
never point at notes outside the project."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
from hang_guard import CHILD_TIMEOUT_S

from oea.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[2]

# (argv, a fragment the single error line must contain)
CASES: list[tuple[list[str], str]] = [
    (["simulate", "--ep", "0"], "argument --ep: must be an integer >= 1, got '0'"),
    (["simulate", "--threads", "0"], "argument --threads: must be an integer >= 1"),
    (["simulate", "--batch-sizes", "0"], "argument --batch-sizes: must be an integer >= 1"),
    (["simulate", "--k0", "0"], "argument --k0"),
    (["simulate", "--num-batches", "1"], "argument --num-batches: must be an integer >= 2"),
    (["simulate", "--precision", "0"], "argument --precision: must be a number > 0"),
    (["simulate", "--policies", "oea", "oea"], "--policies lists ['oea'] more than once"),
    (["simulate", "--k0", "3", "3"], "--k0 lists ['3'] more than once"),
    (["simulate", "--policies", "budget", "--policy-option", "budget:nosuch=40"],
     "policy 'budget' has no option 'nosuch'; its options: budget, min_batch"),
    (["simulate", "--policies", "nope"], "policy must be one of"),
    (["simulate", "--policies", "ep-oea", "--num-batches", "2"], "needs the expert-parallel degree: ep=N (--ep N)"),
    (["simulate", "--trace", "/missing.safetensors"], "/missing.safetensors"),
    (["simulate", "--mode", "sideways"], "argument --mode: invalid choice"),
    (["roofline", "--batch-sizes", "-4"], "argument --batch-sizes: must be an integer >= 1, got '-4'"),
    (["roofline", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["roofline", "--k0", "0"], "argument --k0"),
    (["roofline", "--k0", "99", "--trace", "none"], "--k0 must be integers in 1..8"),
    (["roofline", "--tp", "0"], "argument --tp"),
    (["roofline", "--model", "glm-5", "--tp", "3", "--trace", "none"],
     "--tp must split glm-5's moe_intermediate_size=2048, num_attention_heads=64"),
    (["simulate", "--tp", "3", "--gpu", "h100-sxm"],
     "--tp must split qwen3-30b-a3b's moe_intermediate_size=768, num_attention_heads=32 evenly"),
    (["simulate", "--ep", "3", "--gpu", "h100-sxm"], "--ep must divide num_experts=128 (qwen3-30b-a3b), got 3"),
    (["simulate", "--ep", "3"], "--ep must divide the trace's num_experts=128, got 3"),
    (["simulate", "--tp", "2", "--ep", "2", "--gpu", "h100-sxm"], "combine either --tp or --ep"),
    (["calibrate", "adaptive", "--trace", "qwen3-30b-a3b", "--tp", "3", "--gpu", "h100-sxm"],
     "--tp must split qwen3-30b-a3b's"),
    (["bench", "layer", "--tp", "5", "--threads", "1"], "--tp must divide qwen3-30b-a3b's moe_intermediate_size=768"),
    (["roofline", "--context-len", "0"], "argument --context-len: must be an integer >= 1"),
    (["roofline", "--interconnect-gbps", "-5"], "argument --interconnect-gbps"),
    (["compare", "--trace", "embedded", "--layers", "99"], "--layers must be distinct MoE layer indices in 0..3"),
    (["compare", "--layers", "-1"], "argument --layers: must be an integer >= 0"),
    (["compare", "--ep", "0"], "argument --ep"),
    (["compare", "--ep", "3", "--layers", "0", "--num-batches", "2"], "ep must divide num_experts"),
    (["compare", "--k0", "9", "--layers", "0"], "--k0 must be distinct integers in 1..8"),
    (["compare", "--num-batches", "1"], "argument --num-batches"),
    (["compare", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["compare-quality", "matched-t", "--k0", "0"], "argument --k0"),
    (["compare-quality", "matched-t", "--positions", "0"], "argument --positions"),
    (["compare-quality", "adaptive", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["eval", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["eval", "--k0", "0"], "argument --k0"),
    (["eval", "--positions", "0"], "argument --positions"),
    (["eval", "--threads", "0"], "argument --threads"),
    (["eval", "--policies", "nope"], "argument --policies: invalid choice"),
    (["eval", "--k0", "3", "3"], "--k0 lists ['3'] more than once"),
    (["eval", "--model", "/missing-model-dir"], "/missing-model-dir"),
    (["eval", "lm-eval", "--tasks", "x", "--policy", "pruned"], "--policy pruned needs --k0"),
    (["eval", "lm-eval", "--tasks", "x", "--policy", "vanilla", "--k0", "3"], "--k0 3 has no effect"),
    (["eval", "lm-eval", "--tasks", "x", "--include-path", "/missing-tasks"], "--include-path /missing-tasks"),
    (["eval", "lm-eval", "--tasks", "x", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["eval", "lm-eval", "--tasks", "x", "--limit", "0"], "argument --limit: must be a number > 0"),
    (["bench", "routing", "--batch-sizes", "-4"], "argument --batch-sizes: must be an integer >= 1, got '-4'"),
    (["bench", "routing", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["bench", "routing", "--k0", "9"], "--k0"),
    (["bench", "routing", "--repeats", "1"], "argument --repeats: must be an integer >= 5"),
    (["bench", "layer", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["bench", "layer", "--batch-sizes", "4", "16"], "argument --batch-sizes: this command takes one batch size"),
    (["bench", "layer", "--k0", "9", "--threads", "1"], "--k0 must be in 1..top_k=8"),
    (["bench", "layer", "--threads", "0"], "argument --threads"),
    (["bench", "layer", "--policies", "oea", "oea"], "--policies lists ['oea'] more than once"),
    (["bench", "layer", "--plot", "/proc/p.png", "--threads", "1"], "--plot /proc/p.png: cannot write in /proc"),
    (["bench", "layer", "--write-fit", "/proc/fit.json"], "--write-fit /proc/fit.json: cannot write in /proc"),
    (["bench", "decode", "--k0", "99"], "--k0 values must be in 1..8 (the model's top_k), got [99]"),
    (["bench", "decode", "--like", "nope"], "--like must be one of ['deepseek-v3',"),
    (["bench", "decode", "--model", "/missing-model"], "--model /missing-model: not a checkpoint directory"),
    (["bench", "decode", "--plot", "/proc/p.png"], "--plot /proc/p.png: cannot write in /proc"),
    (["capture", "--batch-sizes", "0"], "argument --batch-sizes"),
    (["capture", "--new-tokens", "0"], "argument --new-tokens"),
    (["capture", "--out", "no/such/folder/x.safetensors"], "--out no/such/folder/x.safetensors: folder"),
    (["report", "--threads", "0"], "argument --threads"),
    (["calibrate", "adaptive", "--tolerance", "-1"], "--tolerance"),
    (["traces", "/missing.safetensors"], "/missing.safetensors"),
]


@pytest.mark.parametrize(("argv", "fragment"), CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_bad_values_exit_2_with_one_line_naming_the_flag(
    argv: list[str], fragment: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(argv)  # argparse's own errors are returned as 2 too, not raised
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err and out == ""
    assert list(tmp_path.iterdir()) == [], "nothing may be written"


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    yield prefix, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*prefix, name))


def test_every_flag_has_help_and_every_command_has_json() -> None:
    missing_help, missing_json = [], []
    for prefix, parser in _commands(build_parser()):
        subs = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
        handler = parser.get_default("handler")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            if action.help is None and action.dest != "help":
                missing_help.append(f"oea {' '.join(prefix)} {'/'.join(action.option_strings) or action.dest}")
        options = {o for a in parser._actions for o in a.option_strings}
        group = subs and prefix == ("bench",)
        if prefix and handler is not None and not group and "--json" not in options:
            missing_json.append(f"oea {' '.join(prefix)}")
    assert missing_help == []
    assert missing_json == []


def _commands_with(flag: str) -> list[list[str]]:
    found = []
    for prefix, parser in _commands(build_parser()):
        if any(flag in action.option_strings for action in parser._actions):
            found.append(list(prefix))
    return found


SEEDED = _commands_with("--seed")


@pytest.mark.parametrize("command", SEEDED, ids=[" ".join(c) for c in SEEDED])
@pytest.mark.parametrize("seed", ["-1", "4294967296", "x"])
def test_a_seed_out_of_range_names_the_flag(command: list[str], seed: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--tasks", "t"] if command[-1] == "lm-eval" else []
    assert main([*command, *extra, "--seed", seed]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"argument --seed: must be an integer in 0..4294967295, got '{seed}'" in err


def test_every_seeded_command_is_covered() -> None:
    assert len(SEEDED) >= 12 and ["simulate"] in SEEDED and ["bench", "layer"] in SEEDED


def test_serve_json_is_one_document_of_the_engines_and_this_environments_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OEA_K0", "3")
    monkeypatch.setenv("OEA_MIN_BATCH", "4")
    assert main(["serve", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    engines = {e["engine"]: e for e in document["engines"]}
    assert "vllm" in engines and engines["vllm"]["command"].startswith("oea serve vllm")
    assert document["environment"] == {"OEA_K0": "3", "OEA_MIN_BATCH": "4"}
    assert document["oea"]["enabled"] and document["oea"]["config"]["k0"] == 3
    assert document["oea"]["config"]["min_batch"] == 4
    monkeypatch.setenv("OEA_K0", "zero")
    assert main(["serve", "--json"]) == 0
    assert "OEA_K0 must be an integer" in json.loads(capsys.readouterr().out)["oea"]["error"]
    assert main(["serve"]) == 2  # without --json or an engine: the usage


def test_no_help_text_shows_a_doubled_percent_sign() -> None:
    """argparse %-formats flag help, not descriptions: a '%%' written for it in a description prints as is."""
    doubled = [" ".join(prefix) for prefix, parser in _commands(build_parser()) if "%%" in parser.format_help()]
    assert doubled == []


@pytest.mark.parametrize("argv", [
    ["bench", "layer", "--trace", "/missing.safetensors", "--repeats", "1"],
    ["bench", "decode", "--like", "none", "--prompt-tokens", "100000", "--batch-sizes", "1", "--k0", "3"],
], ids=["layer", "decode"])
def test_an_error_found_after_the_passive_wait_re_run_is_the_only_stderr_line(argv: list[str]) -> None:
    """Started from a shell on CPU with several threads, the benchmark re-executes itself with
    OMP_WAIT_POLICY=PASSIVE; an error the re-executed process finds must still be the first and only line."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "oea", *argv, "--threads", "2"], env=env, capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"oea bench {argv[1]}: error: ") and "PASSIVE" not in lines[0]


def test_defaults_are_shown_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.01)" in text and "(default: 1024)" in text and "(default: qwen3-30b-a3b)" in text
    assert "(default: 0)" in text  # --seed: a falsy default is still shown


def test_old_batch_size_spelling_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["compare", "--batch-size", "8"]).batch_sizes == [8]
    assert parser.parse_args(["bench", "layer", "--batch-size", "8"]).batch_sizes == [8]
    assert parser.parse_args(["capture", "--batch-size", "4"]).batch_sizes == [4]
    assert parser.parse_args(["eval", "lm-eval", "--tasks", "t", "--batch-size", "4"]).batch_sizes == [4]
    assert parser.parse_args(["compare-quality", "matched-t", "--batch-size", "4"]).batch_sizes == [4]
    assert main(["compare", "--help"]) == 0
    assert "--batch-size " not in capsys.readouterr().out  # hidden alias


def test_a_layer_k0_file_with_strings_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    from oea.config import layer_k0_schedule, settings_from_env

    path = tmp_path / "k0.json"
    path.write_text(json.dumps({"num_experts": 128, "top_k": 8, "num_layers": 2, "k0": ["3", "4"]}))
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*k0 must hold integers >= 1, got \['3', '4'\]"):
        layer_k0_schedule(settings_from_env({"OEA_LAYER_K0_FILE": str(path)}))


def test_the_docs_are_self_contained() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src" / "oea").rglob("*.py"))]
    offenders = [str(f.relative_to(ROOT)) for f in files if "design/" in f.read_text(encoding="utf-8")]
    assert offenders == [], "references to notes outside the project"
