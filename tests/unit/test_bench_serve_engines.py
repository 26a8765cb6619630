"""``oea bench serve --engine``: the engine detected from a restart-mode command, and running servers checked
against it (a server that is not the engine asked for is one line naming what it said)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from fake_servers import completions_handler, fake_engine, serving
from server_harness import free_port

from oea.bench.serve.engines import detect_engine, served_engine
from oea.cli import main


@pytest.fixture()
def servers() -> Iterator[dict[str, str]]:
    """Streaming /v1/completions servers whose /v1/models says ``owned_by`` vllm, sglang, or nothing."""
    models = {"vllm": {"id": "m", "owned_by": "vllm"}, "sglang": {"id": "m", "owned_by": "sglang"},
              "silent": {"id": "m"}}
    with ExitStack() as stack:
        yield {name: stack.enter_context(serving(completions_handler(model))) for name, model in models.items()}


def test_the_engine_is_detected_from_the_server_arguments() -> None:
    assert detect_engine(["--model-path", "DIR", "--port", "30000"]) == "sglang"
    assert detect_engine(["--model-path=DIR"]) == "sglang"
    assert detect_engine(["--model", "DIR", "--attention-backend", "torch_native"]) == "sglang"
    assert detect_engine(["--model", "DIR", "--port", "8000", "--max-num-seqs", "16"]) == "vllm"


def test_a_server_says_its_engine(servers: dict[str, str]) -> None:
    assert [served_engine(servers[n]) for n in ("vllm", "sglang", "silent")] == ["vllm", "sglang", "unknown"]
    assert served_engine("http://127.0.0.1:9") == "unknown"


@pytest.mark.parametrize(("name", "said"), [("vllm", "owned_by 'vllm'"), ("silent", "no owned_by")])
def test_engine_sglang_against_a_server_that_is_not_is_one_line(servers: dict[str, str], name: str, said: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", "--engine", "sglang", "--base-url", servers[name], "--num-prompts", "1",
                 "--max-concurrency", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err == (f"oea bench serve: error: --engine sglang: the server at {servers[name]} is not SGLang "
                   f"(GET /v1/models says {said})\n")


def test_engine_sglang_against_sglang_runs(servers: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", "--engine", "sglang", "--arm", f"a={servers['sglang']}", "--num-prompts", "2",
                 "--random-input-len", "4", "--random-output-len", "3", "--max-concurrency", "1",
                 "--warmup-requests", "0", "--no-progress", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["arm"], r["completed"]) for r in rows] == [("a", 2)]


FAKE_SGLANG = r'''
import argparse, json, os
from fake_servers import serve_completions
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--model-path"); p.add_argument("--device")
args, _ = p.parse_known_args()
with open(os.environ["FAKE_ENV_DUMP"], "a") as f:
    f.write(json.dumps({k: v for k, v in os.environ.items() if k.startswith(("OEA_", "SGLANG_", "PYTHONPATH"))}) + "\n")
serve_completions(args.host, args.port, {"id": args.model_path, "owned_by": "sglang"})
'''


@pytest.mark.parametrize("engine_flag", [[], ["--engine", "sglang"]])
def test_restart_mode_starts_one_sglang_server_per_arm_and_round(tmp_path: Path, engine_flag: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A fake ``sglang.launch_server`` on PYTHONPATH: the engine is detected from ``--model-path`` (or given), each
    server gets its arm's environment, the CPU engine switch and, with no ``sgl_kernel``, the launcher's stand-in."""
    from oea.bench.serve.client import load_rows
    from oea.launch.sglang_server import STAND_IN_DIR

    fake_engine(tmp_path, "sglang.launch_server", FAKE_SGLANG)
    dump, out = tmp_path / "env.jsonl", tmp_path / "ab.jsonl"
    fake = f"PYTHONPATH={tmp_path / 'fake'} FAKE_ENV_DUMP={dump}"
    code = main(["bench", "serve", *engine_flag, "--serve-arm", f"off={fake}", "--serve-arm", f"k3={fake} OEA_K0=3",
                 "--python", sys.executable, "--num-prompts", "2", "--random-input-len", "4",
                 "--random-output-len", "3", "--max-concurrency", "1", "2", "--rounds", "2", "--warmup-requests", "1",
                 "--output-file", str(out), "--no-progress", "--json",
                 "--", "--model-path", "m", "--device", "cpu", "--port", str(free_port())])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = load_rows(out)
    assert [(r["arm"], r["round"], r["max_concurrency"]) for r in rows] == [
        ("off", 0, 1), ("off", 0, 2), ("k3", 0, 1), ("k3", 0, 2),
        ("k3", 1, 1), ("k3", 1, 2), ("off", 1, 1), ("off", 1, 2)]
    assert all(r["engine"] == "sglang" and r["completed"] == 2 and r["engine_decode_steps"] == 0 for r in rows)
    starts = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [s.get("OEA_K0") for s in starts] == [None, "3", "3", None]
    assert all(s["OEA_TIMING"] == "1" and s["OEA_METRICS_FILE"].endswith(".jsonl") for s in starts)
    assert all(s["SGLANG_USE_CPU_ENGINE"] == "1" and s["PYTHONPATH"].startswith(str(STAND_IN_DIR)) for s in starts)
    assert "sgl_kernel stand-in" in captured.err
    assert {s["arm"] for s in json.loads(captured.out)["summary"]} == {"off", "k3"}
