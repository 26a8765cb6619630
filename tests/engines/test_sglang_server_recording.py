"""Recording and metrics from a real SGLang server (``python -m sglang.launch_server --device cpu``, SGLang 0.5.23 of
.venv-sglang, the embedded model, the plugin loaded through SGLang's own entry point): ``OEA_TRACE_FILE`` with
``OEA_METRICS_FILE`` and ``OEA_K0=3``.

The session's shared ``OEA_K0=3`` server (``conftest.py``: ``sglang_k0_3_served``) got two rounds of 16 greedy
requests sent together (SGLang decodes them as 16-row DECODE forwards), then three requests one at a time
(1-row DECODE forwards, below ``OEA_MIN_BATCH``), a pause for the metrics writer, then SIGTERM to its process
group; the tests read what it left:

* the trace holds exactly the DECODE forwards the metrics counted, with their real rows, and survives the
  shutdown;
* SGLang's own top-k (``select_experts``, in .venv-sglang: ``sglang_topk_replay.py``) on the recorded logits gives
  every decode row's ``active_stock``, and ``oea.route`` with k0 = 3 its ``active``;
* ``oea simulate --mode lockstep`` at B = 16 reproduces the server's vanilla T (``active_stock`` of its 16-row
  decode forwards) within 1%.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_server import (
    K0_3_ROUNDS,
    K0_3_TOKENS,
    ONE_BY_ONE,
    ONE_BY_ONE_TOKENS,
    PAIR_TOKENS,
    PROMPTS,
    served_routing,
)
from sglang_venv import ROOT, run_script_json

import oea
from oea.integrations.metrics import routed_hash
from oea.integrations.replay import filler_slots
from oea.integrations.sglang.fillers import distinct_fillers
from oea.traces import load_trace

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]  # may start the shared servers

TOKENS = K0_3_TOKENS
ROUNDS = K0_3_ROUNDS
K0 = oea.OEAConfig(3)
REPLAY = ROOT / "tests" / "engines" / "sglang_topk_replay.py"


@pytest.fixture(scope="module")
def served(sglang_k0_3_served: dict[str, Any]) -> dict[str, Any]:
    return sglang_k0_3_served


def _routed_hash(logits: Any, spec: oea.RouterSpec, cfg: oea.OEAConfig) -> str:
    """The metrics rows' ``routed`` hash of what SGLang's MoE got from one rewritten call: OEA over the call's real
    rows (``served_routing``: the plugin's kernel, checked against ``oea.route``), its zero-weight filler repeats
    renamed to distinct experts (``distinct_fillers``, as the plugin does for SGLang's native MoE)."""
    ids, weights = served_routing(logits, spec, cfg)
    return routed_hash(*distinct_fillers(ids, weights, spec.top_k, spec.num_experts), None)


def _decode_rows(served: dict[str, Any]) -> list[dict[str, Any]]:
    """The metrics rows of DECODE forwards, in the server's order (the trace numbers them 1, 2, ...)."""
    return [r for r in served["metrics"] if r["decode"]]


def test_sglang_server_trace_holds_exactly_the_decode_forwards_the_metrics_counted(served: dict[str, Any]) -> None:
    assert [len(a["output_ids"]) for a in served["answers"]] == [TOKENS] * (ROUNDS * len(PROMPTS))
    trace = load_trace(str(served["trace_path"]))
    decode = _decode_rows(served)
    assert any(not r["decode"] for r in served["metrics"]), "the prefill (EXTEND) forwards have rows too"
    steps = sorted(set(trace.step_ids.tolist()))
    assert steps == list(range(1, len(decode) + 1)), "every decode forward the metrics counted, and only those"
    assert [int((trace.step_ids == s).sum()) for s in steps] == [r["rows"] for r in decode], "real rows only"
    assert sum(r["rows"] == len(PROMPTS) for r in decode) >= ROUNDS * (TOKENS - 2)
    assert sum(r["rows"] == 1 for r in decode) >= ONE_BY_ONE * (ONE_BY_ONE_TOKENS - 2), \
        "the requests sent one at a time decode alone"
    assert all(r["padding_rows"] == 0 and r["layers"] == trace.num_layers == 4 for r in decode)
    assert len({r["pid"] for r in served["metrics"]}) == 1, "one scheduler process"


def test_sglang_server_trace_survives_the_servers_sigterm(served: dict[str, Any]) -> None:
    trace = load_trace(str(served["trace_path"]))
    print(f"\nSGLang server exit {served['exit']}; the trace says it stopped: {trace.meta['stopped']}", file=sys.stderr)
    assert trace.meta["steps_dropped"] == 0 and trace.meta["steps_recorded"] == len(_decode_rows(served))
    assert "oea: recording 100% of decode forwards" in served["log"]


def test_sglang_server_sglangs_own_topk_on_the_recorded_logits_gives_active_stock(served: dict[str, Any]) -> None:
    proc, report = run_script_json(REPLAY, [str(served["trace_path"])])
    assert proc.returncode == 0 and report is not None, proc.stderr[-4000:]
    decode = _decode_rows(served)
    replayed = [report["active"][str(step)] for step in range(1, len(decode) + 1)]
    assert replayed == [r["active_stock"] for r in decode]
    trace = load_trace(str(served["trace_path"]))
    for step, row in enumerate(decode, 1):
        rows = trace.step_ids == step
        if row["rows"] < K0.min_batch:
            assert row["active"] == row["active_stock"] and not row["oea"]
            continue
        assert row["oea"], step
        assert row["active"] == [int(oea.active_experts(*oea.route(trace.logits[rows, layer], trace.spec, K0)))
                                 for layer in range(trace.num_layers)], step
        assert row["routed"] == [_routed_hash(trace.logits[rows, layer], trace.spec, K0)
                                 for layer in range(trace.num_layers)], f"step {step}: not OEA's ids/weights"


def test_sglang_server_simulate_lockstep_reproduces_the_servers_vanilla_t(served: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    full = [r for r in _decode_rows(served) if r["rows"] == len(PROMPTS)]
    server_t = sum(sum(r["active_stock"]) for r in full) / (4 * len(full))
    proc = subprocess.run([sys.executable, "-m", "oea", "simulate", "--trace", str(served["trace_path"]), "--mode",
                           "lockstep", "--policies", "vanilla", "--batch-sizes", str(len(PROMPTS)),
                           "--num-batches", "600", "--json"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    simulated = json.loads(proc.stdout)[0]["mean_active_experts"]
    print(f"\noea simulate --mode lockstep B=16: vanilla T {simulated:.3f}; the server's over its {len(full)} 16-row "
          f"decode forwards {server_t:.3f} ({(simulated / server_t - 1) * 100:+.2f}%)", file=sys.stderr)
    assert abs(simulated / server_t - 1) <= 0.01


def test_sglang_server_routed_experts_at_k0_3_are_the_routing_it_ran_with_recognisable_fillers(
        served: dict[str, Any]) -> None:
    """Routing replay (--enable-return-routed-experts; ``return_routed_experts`` on the first round of 16 and on the
    pair of prompts sent together after the rounds): each generated token's returned ids, layer by layer, against
    ``oea.route`` with k0 = 3 over the DECODE forward that fed it (the trace: its logits, request and position):
    the row's distinct ids are exactly the experts the layer ran for the token with a non-zero weight, every other
    slot a filler by ``oea.integrations.replay``'s rule (a repeat of an earlier id of the row). In the pair's
    forwards (2 rows x k0 = 3 < 8 experts) every row holds fillers. Prompt tokens keep SGLang's routing: no
    repeats."""
    trace = load_trace(str(served["trace_path"]))
    names = trace.meta["request_names"]
    checked = 0
    for answer, tokens, pair in [(a, TOKENS, False) for a in served["answers"][:len(PROMPTS)]] + \
                                [(a, PAIR_TOKENS, True) for a in served["pair"]]:
        ids, prompt = torch.from_numpy(answer["routed_experts"]), answer["meta"]["prompt_tokens"]
        assert ids.shape == (prompt + tokens - 1, trace.num_layers, trace.spec.top_k)
        assert not bool(filler_slots(ids[:prompt]).any()), "a prompt token's ids repeat an expert"
        request = names.index(answer["meta"]["id"])
        for position in range(prompt, ids.shape[0]):
            row = int(torch.nonzero((trace.request_ids == request) & (trace.positions == position))[0])
            step = trace.step_ids == trace.step_ids[row]
            index = int(torch.nonzero(step)[0])  # the step's rows are contiguous, in the trace's order
            assert int(step.sum()) == (2 if pair else len(PROMPTS)), "the requests were not decoded together"
            for layer in range(trace.num_layers):
                want_ids, want_weights = oea.route(trace.logits[step, layer], trace.spec, K0)
                want, got = want_ids[row - index], ids[position, layer]
                real = ~filler_slots(got)
                assert set(got[real].tolist()) == set(want[want_weights[row - index] != 0].tolist()), (position, layer)
                assert not pair or not bool(real.all()), f"a pair row without fillers: {got.tolist()}"
                checked += 1
    assert checked == (len(PROMPTS) * (TOKENS - 1) + 2 * (PAIR_TOKENS - 1)) * trace.num_layers, checked
