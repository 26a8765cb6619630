"""``oea serve vllm`` and the restart-mode A/B of ``oea bench serve``, against a fake
``vllm.entrypoints.openai.api_server`` module (a tiny OpenAI streaming server) put on PYTHONPATH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from fake_servers import fake_engine
from server_harness import free_port

from oea.bench.serve import client as serve
from oea.launch.vllm import oea_env, server_url

FAKE_SERVER = r'''
import argparse, json, os, sys, time
from fake_servers import serve_completions
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--model")
args, _ = p.parse_known_args()
with open(os.environ["FAKE_ENV_DUMP"], "a") as f:
    f.write(json.dumps({**{k: v for k, v in os.environ.items() if k.startswith(("OEA_", "VLLM_HOST"))},
                        "argv": sys.argv[1:]}) + "\n")
time.sleep(0.3)  # a start-up delay, so that the health wait is exercised
serve_completions(args.host, args.port, {"id": args.model})
'''


@pytest.fixture()
def fake_vllm(tmp_path: Path) -> Path:
    return fake_engine(tmp_path, "vllm.entrypoints.openai.api_server", FAKE_SERVER)


def test_oea_env_sets_and_clears() -> None:
    env = oea_env(3, 4, base={"OEA_K0": "7", "SGLANG_OEA_K0": "1", "PATH": "/bin"})
    assert env == {"OEA_K0": "3", "OEA_MIN_BATCH": "4", "PATH": "/bin"}
    assert "OEA_K0" not in oea_env(None, None, base={"OEA_K0": "7"})
    with pytest.raises(ValueError, match="--k0"):
        oea_env(0, None, base={})
    assert server_url(["--model", "m", "--port=9001"]) == "http://127.0.0.1:9001"


def test_serve_vllm_waits_for_health_and_forwards_sigterm(fake_vllm: Path, tmp_path: Path) -> None:
    port = free_port()
    dump = tmp_path / "env.jsonl"
    env = {**os.environ, "PYTHONPATH": str(fake_vllm), "FAKE_ENV_DUMP": str(dump)}
    proc = subprocess.Popen([sys.executable, "-m", "oea", "serve", "vllm", "--k0", "3", "--min-batch", "2",
                             "--", "--model", "m", "--port", str(port)],
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stderr.readline()  # printed once /health answered
        assert "ready at http://127.0.0.1:" in line and "OEA_K0=3" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # returns once the server's process group is gone
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    seen = json.loads(dump.read_text().splitlines()[0])
    assert seen["OEA_K0"] == "3" and seen["OEA_MIN_BATCH"] == "2" and seen["VLLM_HOST_IP"] == "127.0.0.1"


def test_serve_vllm_rejects_bad_k0_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    from oea.cli import main

    assert main(["serve", "vllm", "--k0", "0", "--", "--model", "m"]) == 2
    assert "--k0" in capsys.readouterr().err
    assert main(["serve", "vllm", "--k0", "2"]) == 2
    assert "after '--'" in capsys.readouterr().err


def test_restart_mode_ab(fake_vllm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oea.cli import main

    dump = tmp_path / "env.jsonl"
    out = tmp_path / "ab.jsonl"
    fake = f"PYTHONPATH={fake_vllm} FAKE_ENV_DUMP={dump}"
    code = main(["bench", "serve", "--serve-arm", f"off={fake}", "--serve-arm", f"k3={fake} OEA_K0=3",
                 "--serve-arm-args", "k3=--extra-flag '7 8'", "--python", sys.executable, "--num-prompts", "2",
                 "--random-input-len", "4",
                 "--random-output-len", "3", "--max-concurrency", "1", "2", "--rounds", "2",
                 "--warmup-requests", "1", "--output-file", str(out), "--no-progress", "--json",
                 "--", "--model", "m", "--port", str(free_port())])
    assert code == 0
    rows = serve.load_rows(out)
    assert [(r["arm"], r["round"], r["max_concurrency"]) for r in rows] == [
        ("off", 0, 1), ("off", 0, 2), ("k3", 0, 1), ("k3", 0, 2),
        ("k3", 1, 1), ("k3", 1, 2), ("off", 1, 1), ("off", 1, 2)]
    assert all(r["completed"] == 2 and r["engine_decode_steps"] == 0 for r in rows)
    starts = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [s.get("OEA_K0") for s in starts] == [None, "3", "3", None]
    assert [s["argv"].count("--extra-flag") for s in starts] == [0, 1, 1, 0]  # k3's servers only
    assert all(s["argv"][s["argv"].index("--extra-flag") + 1] == "7 8" for s in starts[1:3])
    extra = ["--extra-flag", "7 8"]
    assert [r.get("arm_server_args") for r in rows[::2]] == [None, extra, extra, None]
    assert all(s["OEA_TIMING"] == "1" and s["OEA_METRICS_FILE"].endswith(".jsonl") for s in starts)
    report = json.loads(capsys.readouterr().out)
    assert {s["arm"] for s in report["summary"]} == {"off", "k3"}


def test_engine_summary_windows() -> None:
    from oea.bench.serve.ab import engine_summary

    rows = [{"time": 10.0, "decode": True, "rows": 4, "active": [4, 6], "active_stock": [8, 8],
             "routing_us": [40.0, 60.0]},
            {"time": 11.0, "decode": False, "rows": 30, "active": [20, 20], "routing_us": [90.0, 90.0]},
            {"time": 50.0, "decode": True, "rows": 2, "active": [1, 1], "routing_us": [1.0, 1.0]}]
    s = engine_summary(rows, 9.0, 12.0)
    assert s["engine_decode_steps"] == 1 and s["engine_routing_us_per_call"] == 50.0
    assert s["engine_active_experts"] == 5.0 and s["engine_active_experts_stock"] == 8.0


def test_serve_arm_parsing() -> None:
    from oea.bench.serve.ab import parse_serve_arms

    arms = parse_serve_arms(["off=", "k3=OEA_K0=3 OEA_MIN_BATCH=2"])
    assert arms == {"off": {}, "k3": {"OEA_K0": "3", "OEA_MIN_BATCH": "2"}}
    with pytest.raises(ValueError, match="--serve-arm"):
        parse_serve_arms(["noequals"])
    with pytest.raises(ValueError, match="VAR=VALUE"):
        parse_serve_arms(["a=JUNK"])
    from oea.bench.serve.ab import parse_serve_arm_args

    assert parse_serve_arm_args(["k3=--a 1 --b '{\"x\": 1}'"], arms) == {"k3": ["--a", "1", "--b", '{"x": 1}']}
    for bad, message in ((["k5=--a"], "no --serve-arm of that name"), (["k3="], "NAME=ARGS"),
                         (["k3=--a", "k3=--b"], "given twice")):
        with pytest.raises(ValueError, match=message):
            parse_serve_arm_args(bad, arms)


def test_serve_arm_args_need_restart_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from oea.cli import main

    assert main(["bench", "serve", "--serve-arm-args", "a=--x 1", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "--serve-arm-args is only used with --serve-arm" in capsys.readouterr().err
