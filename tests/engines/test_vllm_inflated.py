"""vLLM CPU (.venv-vllm) serves an inflated checkpoint (``oea.models.inflate``, a small inflation: expert
intermediate 48 -> 96) and produces the base model's greedy text; with OEA at k0 = top_k (every decode step
eligible, ``OEA_MIN_BATCH=1``) the plugin hands vLLM's own routing back on every decode step and the text is the
same.

Three servers on 127.0.0.1, ``--enforce-eager`` with ``ONE_PROCESS_WORKER`` (start-up without compilation nor a
worker process of its own), stopped by their process
groups in ``finally``: ``base`` (the embedded model), ``inflated`` (OEA off) and ``inflated_k8``
(``OEA_K0=8``). Prompts are sent one at a time (batch 1: no batch-composition effects).

``INFLATED_CHECKPOINT_DIR=DIR`` runs the same checks on an existing inflated checkpoint (e.g. ``oea inflate
--like qwen3-30b-a3b``); a checkpoint over 1 GiB is served one server at a time to bound memory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from engine_venvs import engine_python
from server_harness import VLLM_SLOTS, free_port, port_of, stopping_servers
from vllm_env import (
    CODE_PROMPTS,
    ONE_PROCESS_WORKER,
    ONE_PROCESS_WORKER_ENV,
    complete,
    server_args,
    server_env,
    start_healthy,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1500)]

SIZE = 96
PROMPTS = [CODE_PROMPTS[i] for i in (0, 1, 2, 3, 5)]  # one at a time on three servers: five bound the run
NEW_TOKENS = 12
HEALTH_TIMEOUT_S = 1200



def _complete(port: int, prompt: str) -> list[str]:
    return complete(port, prompt, NEW_TOKENS, timeout=120, logprobs=True)["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from oea.launch.vllm import stop_server
    from oea.models import embedded_model_dir
    from oea.models.inflate import write_inflated

    engine_python("vllm")
    workdir = tmp_path_factory.mktemp("vllm-inflated")
    inflated = Path(os.environ.get("INFLATED_CHECKPOINT_DIR", "") or workdir / "inflated")
    if not inflated.exists():
        write_inflated(inflated, moe_intermediate_size=SIZE)
    large = sum(f.stat().st_size for f in inflated.glob("*.safetensors")) > 2**30
    metrics = workdir / "k8.jsonl"
    arms = {
        "base": (embedded_model_dir(), {}),
        "inflated": (inflated, {}),
        "inflated_k8": (inflated, {"OEA_K0": "8", "OEA_MIN_BATCH": "1", "OEA_METRICS_FILE": str(metrics)}),
    }
    results: dict[str, dict] = {}
    started = time.monotonic()

    with stopping_servers(slots=VLLM_SLOTS * len(arms), what="vllm inflated") as servers:
        for wave in ([[name] for name in arms] if large else [list(arms)]):
            launches = {}
            for name in wave:
                model, extra = arms[name]
                args = server_args(model, free_port(), max_model_len=512, max_num_seqs=4,
                                   extra=["--enforce-eager", *ONE_PROCESS_WORKER])
                launches[name] = (args, server_env({**extra, **ONE_PROCESS_WORKER_ENV}))
            start_healthy(servers, launches, workdir, HEALTH_TIMEOUT_S, started)
            for name in wave:
                port = port_of(servers[name])
                results[name] = {"tokens": [_complete(port, p) for p in PROMPTS]}
            time.sleep(1.5)  # the worker flushes metrics every 0.5 s
            for name in wave:  # read before stopping: a killed engine core makes the API server log a traceback
                results[name]["log"] = (workdir / f"{name}.log").read_text(errors="replace")
            if large:
                for name in wave:
                    stop_server(servers[name])
    results["inflated_k8"]["metrics"] = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return results


def test_inflated_checkpoint_gives_the_base_model_s_greedy_text(runs: dict[str, dict]) -> None:
    assert "Traceback" not in runs["inflated"]["log"]
    assert all(len(tokens) == NEW_TOKENS for tokens in runs["inflated"]["tokens"])
    assert runs["inflated"]["tokens"] == runs["base"]["tokens"]


def test_k0_equal_top_k_keeps_vllm_s_own_routing_and_text(runs: dict[str, dict]) -> None:
    """k0 >= top_k keeps every token's own top-k: the plugin sees every decode step, hands vLLM's routing back
    (``"oea": false``: not rewritten) and the active experts it counts equal vLLM's own."""
    rows = runs["inflated_k8"]["metrics"]
    decode = [r for r in rows if r["decode"]]
    assert len(decode) >= len(PROMPTS) * (NEW_TOKENS - 1), f"{len(decode)} decode steps in the metrics"
    assert not any(r["oea"] for r in decode)
    assert all(r["active"] == r["active_stock"] for r in decode)
    assert runs["inflated_k8"]["tokens"] == runs["inflated"]["tokens"]
