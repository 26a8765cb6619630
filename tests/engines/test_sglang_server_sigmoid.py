"""The reference deployment's router family through a live SGLang server: a tiny random GLM-4.5-MoE checkpoint
(``tests/support/tiny_checkpoint.py``: sigmoid scores, ``e_score_correction_bias``, ``n_group`` 4 / ``topk_group`` 2,
``routed_scaling_factor`` 2.5, one shared expert; 16 experts, top-4) served by ``python -m sglang.launch_server
--device cpu`` with the plugin (SGLang's ``biased_grouped_topk`` torch-native path, ``moe_forward_native``).
Its three servers (OEA off, k0 = top_k, k0 = 2 with a trace and a metrics file) are among the session's shared
ones (``conftest.py``: ``sglang_servers``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sglang_server import GLM_TOP_K, PROMPTS, Live, generate, read_jsonl, served_routing

import oea
from oea.integrations.metrics import routed_hash
from oea.integrations.sglang.fillers import distinct_fillers

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]  # may start the shared servers

TOP_K = GLM_TOP_K
K0 = 2


@pytest.fixture(scope="module")
def servers(sglang_servers: dict[str, Live]) -> dict[str, Live]:
    return {"off": sglang_servers["glm_off"], "k0_top_k": sglang_servers["glm_k0_top_k"],
            "k0_2": sglang_servers["glm_k0_2"]}


def _ids(answers: list[dict]) -> list[list[int]]:
    return [a["output_ids"] for a in answers]


def test_sglang_server_sigmoid_k0_top_k_serves_the_same_greedy_tokens_as_oea_off(servers: dict[str, Live]) -> None:
    assert _ids(generate(servers["k0_top_k"].url, PROMPTS)) == _ids(generate(servers["off"].url, PROMPTS))


def test_sglang_server_sigmoid_k0_2_rewrites_decode_only_and_its_steps_need_fewer_experts(
        servers: dict[str, Live]) -> None:
    from oea.launch.sglang_server import stop_server
    from oea.traces import load_trace

    off = _ids(generate(servers["off"].url, PROMPTS))
    live = servers["k0_2"]
    routed_ids = _ids(generate(live.url, PROMPTS))
    assert [a[0] for a in routed_ids] == [a[0] for a in off], "the prefill's token is SGLang's own"
    assert [len(a) for a in routed_ids] == [24] * len(PROMPTS)
    time.sleep(3.0)  # the trace is checkpointed 1 s after the last step; SGLang's shutdown may not let it finish
    stop_server(live.server, grace=60.0)
    assert live.trace_path is not None and live.trace_path.exists(), live.log()[-3000:]
    trace = load_trace(live.trace_path)
    spec = trace.spec
    assert (spec.scoring, spec.top_k, spec.n_group, spec.topk_group) == ("sigmoid", TOP_K, 4, 2), spec
    steps, rows = trace.step_ids.unique(return_counts=True)
    assert int(rows.max()) == len(PROMPTS), "decode rows only, the 16 requests together"
    bias = trace.correction_bias  # [L, N] each recorded layer's e_score_correction_bias
    assert bias is not None and bool((bias != 0).any())
    vanilla = routed = 0
    for step in steps.tolist():
        batch = trace.step_ids == step
        for layer in range(trace.num_layers):
            layer_spec = trace.layer_spec(layer)
            logits = trace.logits[batch, layer].float()
            vanilla += int(oea.active_experts(*oea.route(logits, layer_spec, oea.OEAConfig(TOP_K))))
            routed += int(oea.active_experts(*oea.route(logits, layer_spec, oea.OEAConfig(K0))))
    assert routed < vanilla, (routed, vanilla)
    decode = [r for r in read_jsonl(Path(live.arm.env["OEA_METRICS_FILE"])) if r["decode"]]
    assert [r["rows"] for r in decode] == [int(n) for n in rows.tolist()] and steps.tolist() == list(
        range(1, len(decode) + 1)), "one metrics row per recorded decode forward"
    check_rewrites_are_oea_route(trace, decode)


def check_rewrites_are_oea_route(trace: Any, decode: list[dict[str, Any]]) -> None:
    """Every rewritten call is ``oea.route`` over its real rows: each decode forward's metrics row (numbered as
    the trace's steps) holds the active experts and the hash of the ids / weights SGLang's MoE got (OEA's, with
    the zero-weight fillers renamed to distinct experts as the plugin does: ``distinct_fillers``)."""
    cfg = oea.OEAConfig(K0)
    rewritten = 0
    for step, row in enumerate(decode, 1):
        batch = trace.step_ids == step
        if row["rows"] < cfg.min_batch:  # SGLang's one-request warm-up: its own routing
            assert row["active"] == row["active_stock"] and not row["oea"], step
            continue
        rewritten += 1
        expected = [served_routing(trace.logits[batch, layer], trace.layer_spec(layer), cfg)
                    for layer in range(trace.num_layers)]
        assert row["oea"] and row["active"] == [int(oea.active_experts(*e)) for e in expected], step
        assert row["routed"] == [routed_hash(*distinct_fillers(*e, TOP_K, trace.spec.num_experts), None)
                                 for e in expected], f"step {step}: not OEA's ids / weights"
    assert rewritten >= len(decode) // 2, (rewritten, len(decode))
