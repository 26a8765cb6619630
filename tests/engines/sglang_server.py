"""Live SGLang servers for the ``test_sglang_server*`` tests: start several together, query, stop.

Every server is a real ``python -m sglang.launch_server --device cpu`` of .venv-sglang on 127.0.0.1
(``oea.launch.sglang_server``: its own process group, stopped even when a test fails), with the
``sgl_kernel`` test-support stand-in on its ``PYTHONPATH`` (no CPU build of SGLang's kernel package exists on
the package index). ``conftest.py`` starts ALL the servers the ``test_sglang_server*`` modules need in one
session fixture and shares them: on a 2-core machine each start costs about a minute of CPU, and they overlap.
Each server runs with ``--sleep-on-idle`` (SGLang's own flag): an idle SGLang scheduler otherwise polls its
sockets without pause, and a handful of idle servers would take most of a 2-core machine from the one a test
is talking to.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_venvs import ROOT, child_env, engine_python
from server_harness import free_port

import oea
from oea.launch.server_process import Server, stop_servers
from oea.launch.sglang_server import cpu_server_args, start_server, wait_healthy
from oea.models import embedded_model_dir

HEALTH_TIMEOUT_S = 900.0  # a 2-core machine shared with other jobs starts SGLang slowly
REQUEST_TIMEOUT_S = 300.0
EMBEDDED_TOP_K = 8  # the embedded model's num_experts_per_tok
EMBEDDED_LAYERS = 4  # its num_hidden_layers (each with an MoE block)
GLM_TOP_K = 4
BAD_K0 = "three"
K0_3_ROUNDS = 2  # rounds of the 16 prompts sent together to the OEA_K0=3 server
K0_3_TOKENS = 24
PAIR_TOKENS = 8  # then 2 prompts together (routing replay: a union of at most 2 x 3 < 8 experts, so fillers)
ONE_BY_ONE = 3  # then this many prompts one request at a time (concurrency 1)
ONE_BY_ONE_TOKENS = 12
IDLE_ARGS = ("--sleep-on-idle",)  # an idle scheduler waits on its sockets instead of polling them without pause
# Routed-experts return (routing replay): SGLang's flag, and the test support that lets a CPU server use it (its
# capturer would pin a host buffer with cudaHostRegister: sglang_routed_experts/sitecustomize.py)
ROUTED_EXPERTS_ARGS = ("--enable-return-routed-experts",)
# SGLang's own /metrics (prometheus_client multiprocess mode), where the plugin's oea_* series go with OEA on
METRICS_ARGS = ("--enable-metrics",)
ROUTED_EXPERTS_SUPPORT = Path(__file__).resolve().parent / "sglang_routed_experts"
PROMPTS = ("def parse_args(argv):\n    ", "class Config:\n    def __init__(self", "import os\nimport sys\n\n",
           "    for key, value in", "def main():\n    parser = ", "    return self._", "# Copyright",
           "try:\n    import ", "    if not isinstance(", "def __repr__(self):\n", "    raise ValueError(",
           "from collections import ", "with open(path) as f:\n", "    @property\n    def ", "async def fetch(",
           "    except KeyError:\n")


@dataclass
class Arm:
    """One server to start: a name, its extra environment (OEA_*), model and extra launch arguments."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    model: Path = field(default_factory=embedded_model_dir)
    args: tuple[str, ...] = ()
    trace: bool = False  # OEA_TRACE_FILE in the work folder


@dataclass
class Live:
    """A started server of ``Arm``."""

    arm: Arm
    server: Server
    log_path: Path
    trace_path: Path | None
    error: str | None = None  # start-up failed (the log tail), for the test that checks it

    @property
    def url(self) -> str:
        return self.server.base_url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


GLM_MODULE = "test_sglang_server_sigmoid"  # the module whose servers serve the GLM checkpoint (glm_*)


def server_arms(work: Path, modules: set[str]) -> list[Arm]:
    """The servers the ``test_sglang_server*`` modules named in ``modules`` need (the GLM checkpoint is written
    into ``work`` when ``GLM_MODULE`` is one of them)."""
    from tiny_checkpoint import write_tiny_checkpoint  # tests/support (pytest's pythonpath)

    arms = []
    replay = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROUTED_EXPERTS_SUPPORT), os.environ.get("PYTHONPATH"))
                                            if p)}
    if modules - {GLM_MODULE}:
        arms += [
            Arm("off", replay, args=(*ROUTED_EXPERTS_ARGS, *METRICS_ARGS)),
            Arm("k0_top_k", {"OEA_K0": str(EMBEDDED_TOP_K), **replay}, args=ROUTED_EXPERTS_ARGS),
            Arm("k0_3", {"OEA_K0": "3", "OEA_METRICS_FILE": str(work / "k0_3.metrics.jsonl"), **replay}, trace=True,
                args=ROUTED_EXPERTS_ARGS),
            Arm("alias_3", {"SGLANG_OEA_K0": "3", "OEA_METRICS_FILE": str(work / "alias_3.metrics.jsonl")},
                args=METRICS_ARGS),
            Arm("k0_9", {"OEA_K0": "9"}),  # more than the model's top_k: the router does not fit the settings
            Arm("bad", {"OEA_K0": BAD_K0}),
        ]
    if GLM_MODULE in modules:
        glm = write_tiny_checkpoint(work / "glm4_moe", "glm4_moe", num_experts=16, top_k=GLM_TOP_K, n_group=4,
                                    topk_group=2)
        arms += [
            Arm("glm_off", model=glm),
            Arm("glm_k0_top_k", {"OEA_K0": str(GLM_TOP_K)}, model=glm),
            Arm("glm_k0_2", {"OEA_K0": "2", "OEA_METRICS_FILE": str(work / "glm_k0_2.metrics.jsonl")}, model=glm,
                trace=True),
        ]
    return arms


def start_all(arms: Sequence[Arm], workdir: Path, expect_failure: Sequence[str] = ()) -> dict[str, Live]:
    """Start every arm at once, then wait for all (``launch_all``, then ``await_all``)."""
    return await_all(launch_all(arms, workdir), expect_failure)


def launch_all(arms: Sequence[Arm], workdir: Path, nice: int | None = None) -> dict[str, Live]:
    """Start a server for every arm and return without waiting for any (their start-ups overlap with each other
    and with whatever runs next; ``nice``: their priority, so that what runs next keeps its core); a failure to
    start one stops those already started."""
    python = str(engine_python("sglang"))
    workdir.mkdir(parents=True, exist_ok=True)
    started: dict[str, Live] = {}
    try:
        for arm in arms:
            env = child_env(arm.env)
            trace = None
            if arm.trace:
                trace = workdir / f"{arm.name}.trace.safetensors"
                env["OEA_TRACE_FILE"] = str(trace)
            log_path = workdir / f"{arm.name}.log"
            args = cpu_server_args(arm.model, free_port(), extra=(*IDLE_ARGS, *arm.args))
            server = start_server(args, env, python=python, log_path=log_path, cwd=ROOT, nice=nice, stand_in=True)
            started[arm.name] = Live(arm, server, log_path, trace)
    except BaseException:
        stop_all(started.values())
        raise
    return started


def await_all(started: dict[str, Live], expect_failure: Sequence[str] = ()) -> dict[str, Live]:
    """Wait until every server of ``launch_all`` answers. Arms named in ``expect_failure`` may exit during
    start-up (their ``error`` holds why); any other failure stops every server and fails the test with its log."""
    try:
        for name, live in started.items():
            try:
                wait_healthy(live.server, timeout=HEALTH_TIMEOUT_S, poll=2.0)
                if live.server.process.poll() is not None:  # healthy, but someone else answered on its port
                    raise RuntimeError(f"{name} exited with code {live.server.process.returncode} although "
                                       f"{live.url} answers: {live.log()[-2000:]}")
            except RuntimeError as err:
                if name not in expect_failure:
                    raise
                live.error = str(err)
    except BaseException as err:
        stop_all(started.values())
        if isinstance(err, RuntimeError):
            pytest.fail(f"an SGLang server did not start: {err}")
        raise
    return started


def stop_all(servers: Iterator[Live] | Sequence[Live] | Any) -> None:
    """Stop the servers at once (``stop_servers``: one 30 s grace period for all of them)."""
    stop_servers([live.server for live in servers], grace=30.0)


def post(url: str, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> Any:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def generate(url: str, prompts: Sequence[str], max_new_tokens: int = 24, routed_experts: bool = False
             ) -> list[dict[str, Any]]:
    """Greedy completions of ``prompts`` sent as ONE ``/generate`` request (SGLang batches them together:
    len(prompts) concurrent sequences); each answer's ``text`` and ``output_ids``; ``routed_experts``: also the
    ids SGLang routed each token to (``return_routed_experts``; the server needs ``ROUTED_EXPERTS_ARGS``), decoded
    into ``routed_experts`` [tokens, layers, top_k]."""
    body: dict[str, Any] = {"text": list(prompts), "sampling_params": {"temperature": 0.0,
                                                                       "max_new_tokens": max_new_tokens,
                                                                       "ignore_eos": True}}
    if routed_experts:
        body["return_routed_experts"] = True
    answers = post(url, "/generate", body)
    out = [{"text": a["text"], "output_ids": a.get("output_ids"), "meta": a.get("meta_info", {})} for a in answers]
    for answer in out if routed_experts else ():
        raw = np.frombuffer(base64.b64decode(answer["meta"]["routed_experts"]), dtype=np.int32)
        answer["routed_experts"] = raw.reshape(-1, EMBEDDED_LAYERS, EMBEDDED_TOP_K).copy()
    return out


def generate_one_by_one(url: str, prompts: Sequence[str], max_new_tokens: int = 24) -> list[dict[str, Any]]:
    """The same prompts one request at a time (concurrency 1)."""
    return [generate(url, [p], max_new_tokens)[0] for p in prompts]


def wait_for_file(path: Path, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return path.exists()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def served_routing(logits: Any, spec: Any, cfg: Any) -> tuple[Any, Any]:
    """What the plugin hands SGLang's MoE for one rewritten call over ``logits`` [M, N]: ``oea.route_fast``, the
    plugin's own kernel choice (the compiled numba kernel on CPU, installed in both venvs at the same version, so
    the same bits as the server's), checked here against ``oea.route``: the same ids [M, k] in the same order, and
    weights [M, k] within float32 rounding (the kernel sums and divides in another order: up to 6e-8 apart, which
    a bit-exact hash of the weights would call a different routing)."""
    ids, weights = oea.route_fast(logits, spec, cfg)
    reference_ids, reference_weights = oea.route(logits, spec, cfg)
    assert torch.equal(ids.to(torch.int64), reference_ids.to(torch.int64)), "route_fast's ids are not oea.route's"
    torch.testing.assert_close(weights.float(), reference_weights.float(), rtol=0, atol=1e-6)
    return ids, weights
