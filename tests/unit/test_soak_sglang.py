"""``oea soak`` against SGLang without an engine: the engine read from the server arguments, the interpreter
named from the server's working folder, SGLang's numbering of the trace's decode steps, and a whole soak
against a stand-in that answers as SGLang's OpenAI server does (``owned_by`` sglang, its refusal bodies)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hang_guard import CHILD_TIMEOUT_S

from oea.soak.monitor import SoakError
from oea.soak.servers import engine_of, interpreter, model_arg
from oea.soak.session import trace_numbered


def test_the_engine_is_read_from_the_server_arguments_unless_given() -> None:
    assert engine_of(["--model-path", "m", "--port", "1"]) == "sglang"
    assert engine_of(["--model", "m", "--port", "1"]) == "vllm"
    assert engine_of(["--model", "m"], "sglang") == "sglang"
    with pytest.raises(SoakError, match="--engine"):
        engine_of(["--model", "m"], "trt")
    assert model_arg(["--model-path", "/x", "--port", "1"]) == "/x"
    assert model_arg(["--port", "1", "--model=/y"]) == "/y" and model_arg(["--port", "1"]) is None


def test_a_relative_interpreter_still_names_it_from_the_servers_folder(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert interpreter(".venv-vllm/bin/python") == str(tmp_path / ".venv-vllm" / "bin" / "python")
    assert interpreter("python3") == "python3"  # looked up on PATH wherever it runs
    assert interpreter(None) == sys.executable and os.path.isabs(interpreter(None))


def test_sglang_decode_rows_are_numbered_as_its_trace_numbers_them() -> None:
    rows = [{"pid": 7, "step": 1, "decode": False}, {"pid": 7, "step": 2, "decode": True},
            {"pid": 7, "step": 3, "decode": True}, {"pid": 7, "step": 4, "decode": False},
            {"pid": 7, "step": 5, "decode": True}]
    assert [r["step"] for r in trace_numbered(rows, "sglang") if r["decode"]] == [1, 2, 3]
    assert [r["step"] for r in trace_numbered(rows, "sglang") if not r["decode"]] == [1, 4]
    assert trace_numbered(rows, "vllm") == rows  # vLLM numbers both by the engine step
    assert rows[1]["step"] == 2, "the rows given are not changed"


def test_a_server_that_does_not_start_is_one_line_naming_its_log(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    from oea.cli import main

    code = main(["soak", "--arm", "a=", "--python", "/bin/false", "--requests", "5", "--duration", "10",
                 "--out", str(tmp_path), "--", "--model-path", "m", "--port", "9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err), err
    assert err[-1].startswith("oea soak: error: a: SGLang server exited with code 1"), err
    assert str(tmp_path / "a.log") in err[-1]


def test_servers_run_in_the_soaks_folder_so_relative_paths_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from oea.cli import main

    fake = tmp_path / "fake-python"  # an interpreter that says where and with what it ran, then exits
    fake.write_text('#!/bin/sh\npwd > "$0.cwd"\necho "$OEA_METRICS_FILE" > "$0.env"\nexit 1\n')
    fake.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = main(["soak", "--arm", "a=OEA_K0=3 OEA_METRICS_FILE=m.jsonl", "--python", str(fake), "--requests", "5",
                 "--duration", "10", "--out", "out", "--", "--model", "m", "--port", "9"])
    assert code == 2 and "vLLM server exited with code 1" in capsys.readouterr().err
    assert Path(f"{fake}.cwd").read_text().strip() == str(work)
    assert Path(f"{fake}.env").read_text().strip() == "m.jsonl"  # the checks read work/m.jsonl: the same file
    assert (work / "out" / "a.log").exists()


def test_nice_lowers_the_client_and_each_servers_priority(tmp_path: Path) -> None:
    import subprocess

    fake = tmp_path / "fake-python"  # an interpreter that says its nice value and its session's autogroup's
    fake.write_text('#!/bin/sh\nps -o ni= -p $$ > "$0.nice"\ncat /proc/self/autogroup > "$0.group" 2>/dev/null\n'
                    'exit 1\n')
    fake.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "oea", "soak", "--nice", "15", "--arm", "a=", "--python", str(fake),
                           "--requests", "5", "--duration", "10", "--out", str(tmp_path / "out"), "--", "--model",
                           "m", "--port", "9"], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
                          start_new_session=True)
    own = Path("/proc/self/autogroup")
    own_words = own.read_text().split() if own.exists() else []  # empty in some containers: no autogroup there
    assert not own_words or own_words[-1] != "15", "the caller's session keeps its priority"
    assert proc.returncode == 2 and "server exited with code 1" in proc.stderr, proc.stderr
    assert Path(f"{fake}.nice").read_text().strip() == "15"
    group = Path(f"{fake}.group")
    if group.read_text().split():  # a kernel with sched_autogroup: the server's session weighs as nice 15 too
        assert group.read_text().split()[-1] == "15", group.read_text()


@pytest.mark.parametrize(("arm_env", "flags", "seen"), [("", [], "0"), ("", ["--keep-engine-caches"], ""),
                                                       ("ONEDNN_PRIMITIVE_CACHE_CAPACITY=64", [], "64")])
def test_started_servers_run_with_onednns_shape_cache_off_unless_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, arm_env: str,
        flags: list[str], seen: str) -> None:
    from oea.cli import main

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    fake = tmp_path / "fake-python"  # an interpreter that says the cache capacity it was given, then exits
    fake.write_text('#!/bin/sh\necho "$ONEDNN_PRIMITIVE_CACHE_CAPACITY" > "$0.env"\nexit 1\n')
    fake.chmod(0o755)
    code = main(["soak", "--arm", f"a={arm_env}", "--python", str(fake), "--requests", "5", "--duration", "10",
                 "--out", str(tmp_path / "out"), *flags, "--", "--model", "m", "--port", "9"])
    assert code == 2 and "server exited with code 1" in capsys.readouterr().err
    assert Path(f"{fake}.env").read_text().strip() == seen


def test_a_report_that_would_overwrite_a_traces_sidecar_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from oea.cli import main

    monkeypatch.chdir(tmp_path)
    common = ["--python", "/bin/false", "--requests", "5", "--duration", "10", "--out", "out", "--", "--model", "m",
              "--port", "9"]
    assert main(["soak", "--arm", "oea=OEA_K0=3 OEA_TRACE_FILE=out/oea.safetensors", *common]) == 2
    err = capsys.readouterr().err
    assert "OEA_TRACE_FILE=out/oea.safetensors" in err and "out/oea-trace.safetensors" in err, err
    assert not (tmp_path / "out").exists(), "refused before anything was started or written"
    assert main(["soak", "--arm", "oea=OEA_K0=3 OEA_TRACE_FILE=out/oea-trace.safetensors", *common]) == 2
    assert "server exited with code 1" in capsys.readouterr().err  # accepted: the stand-in server then fails
