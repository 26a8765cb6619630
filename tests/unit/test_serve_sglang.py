"""``oea serve sglang`` against fake ``sglang.launch_server`` modules: it sets the OEA environment (and
SGLANG_USE_CPU_ENGINE for --device cpu), waits for /health and stops on SIGTERM; server arguments SGLang refuses
end it at once with a non-zero exit and SGLang's own message, never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fake_servers import fake_engine
from hang_guard import CHILD_TIMEOUT_S
from server_harness import free_port

FAKE_SERVER = r'''
import argparse, json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
p = argparse.ArgumentParser(prog="launch_server")
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--model-path", required=True)
p.add_argument("--device")
args = p.parse_args()  # an unknown flag: argparse's own message and exit code 2, as SGLang's
with open(os.environ["FAKE_ENV_DUMP"], "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("OEA_", "SGLANG_"))}, f)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.send_header("Content-Length", "0")
        self.end_headers()
ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''


@pytest.fixture()
def fake_sglang(tmp_path: Path) -> dict[str, str]:
    fake = fake_engine(tmp_path, "sglang.launch_server", FAKE_SERVER)
    src = Path(__file__).resolve().parents[2] / "src"
    return {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{src}",
            "FAKE_ENV_DUMP": str(tmp_path / "env.json")}


def _oea(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "oea", "serve", "sglang", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_serve_sglang_sets_oea_and_the_cpu_engine_waits_for_health_and_stops_on_sigterm(
        fake_sglang: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    proc = _oea(["--k0", "3", "--", "--model-path", "m", "--device", "cpu", "--port", str(port)], fake_sglang)
    try:
        line = proc.stderr.readline()
        assert line.startswith(f"oea serve sglang: ready at http://127.0.0.1:{port} (OEA_K0=3"), line
        seen = json.loads((tmp_path / "env.json").read_text())
        assert seen["OEA_K0"] == "3" and seen["SGLANG_USE_CPU_ENGINE"] == "1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_sglang_with_arguments_sglang_refuses_exits_with_sglangs_message(fake_sglang: dict[str, str]) -> None:
    proc = _oea(["--health-timeout", "3600", "--", "--model-path", "m", "--bogus-flag"], fake_sglang)
    try:
        _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)  # far below the health timeout: never waited out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "launch_server: error: unrecognized arguments: --bogus-flag" in err  # SGLang's (argparse's) own words
    assert "oea serve sglang: error: SGLang server exited with code 2" in err


def test_serve_sglang_refuses_a_bad_k0_before_starting_anything(fake_sglang: dict[str, str]) -> None:
    proc = _oea(["--k0", "0", "--", "--model-path", "m"], fake_sglang)
    _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode != 0 and "--k0 must be an integer >= 1, got 0" in err, err


def test_serve_sglang_with_the_stand_in_warns_at_start_that_it_is_test_support(fake_sglang: dict[str, str]) -> None:
    port = free_port()
    proc = _oea(["--sgl-kernel-stand-in", "--", "--model-path", "m", "--device", "cpu", "--port", str(port)],
                fake_sglang)
    try:
        first = proc.stderr.readline()
        assert first.startswith("oea serve sglang: warning: SGLang CPU server with the sgl_kernel stand-in: "), first
        assert "test support from the source checkout" in first
        ready = proc.stderr.readline()
        assert ready.startswith("oea serve sglang: ready at") and "sgl_kernel: oea's test-support stand-in" in ready
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
