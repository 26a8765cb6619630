"""A real SGLang server (``python -m sglang.launch_server --device cpu``, SGLang 0.5.23 of .venv-sglang) serving the
embedded model with the OEA plugin loaded through SGLang's own ``sglang.srt.plugins`` entry point.

SGLang's paths that run here: its HTTP server, tokenizer manager, scheduler (no overlap), torch-native routing
(``fused_topk_torch_native`` -> ``_post_process_topk_ids``, where the plugin hooks), ``moe_forward_native``,
``torch_native`` attention, no CUDA graphs, no AMX kernels (the ``sgl_kernel`` stand-in registers no op).
The servers are the session's shared ones (``conftest.py``: ``sglang_servers``); the ``OEA_K0=3`` server's
answers, metrics and trace come from ``sglang_k0_3_served``, which sent it all its requests and stopped it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from engine_venvs import ROOT, child_env, engine_python
from sglang_server import (
    BAD_K0,
    EMBEDDED_TOP_K,
    K0_3_TOKENS,
    ONE_BY_ONE,
    ONE_BY_ONE_TOKENS,
    PROMPTS,
    Live,
    generate,
    generate_one_by_one,
)

import oea
from oea.integrations.replay import filler_slots

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]  # the first test starts 9 servers

TOP_K = EMBEDDED_TOP_K
K0_TOP_K_TOKENS = 24  # generate()'s default max_new_tokens
SPEC = oea.RouterSpec(128, TOP_K, "softmax", True)  # its router (Qwen3-MoE, norm_topk_prob)


@pytest.fixture(scope="module")
def servers(sglang_servers: dict[str, Live]) -> dict[str, Live]:
    return sglang_servers


@pytest.fixture(scope="module")
def off(servers: dict[str, Live]) -> list[dict]:
    return generate(servers["off"].url, PROMPTS, routed_experts=True)


@pytest.fixture(scope="module")
def top_k(servers: dict[str, Live]) -> list[dict]:
    """The ``OEA_K0`` = top_k server's answers to the 16 prompts sent together, with their routed experts."""
    return generate(servers["k0_top_k"].url, PROMPTS, routed_experts=True)


@pytest.fixture(scope="module")
def k0_3(sglang_k0_3_served: dict) -> list[dict]:
    """The OEA_K0=3 server's answers to the 16 prompts sent together (its first round, on a fresh server)."""
    return sglang_k0_3_served["answers"][:len(PROMPTS)]


def _ids(answers: list[dict]) -> list[list[int]]:
    return [a["output_ids"] for a in answers]


def test_sglang_server_k0_top_k_serves_the_same_greedy_text_as_oea_off(off: list[dict], top_k: list[dict]) -> None:
    assert _ids(top_k) == _ids(off)
    assert len({a["text"] for a in off}) > 1, "the model must generate text, not one constant answer"


def test_sglang_server_routed_experts_at_k0_top_k_equal_oea_offs(off: list[dict], top_k: list[dict]) -> None:
    """Routing replay (--enable-return-routed-experts): with OEA_K0 = top_k every returned id, prompt and generated
    tokens alike, is the one the server returns with OEA off, slot for slot; no row repeats an expert."""
    for answer, base in zip(top_k, off, strict=True):
        assert answer["routed_experts"].shape == (answer["meta"]["prompt_tokens"] + K0_TOP_K_TOKENS - 1, 4, TOP_K)
        assert np.array_equal(answer["routed_experts"], base["routed_experts"])
        assert not bool(filler_slots(answer["routed_experts"]).any())


def test_sglang_server_sglang_oea_k0_works_as_oea_k0(servers: dict[str, Live], off: list[dict], k0_3: list[dict]
                                                     ) -> None:
    assert _ids(generate(servers["alias_3"].url, PROMPTS)) == _ids(k0_3)
    assert _ids(k0_3) != _ids(off), "k0 = 3 changed no token of 16 x 24"


def test_sglang_server_k0_3_leaves_prefill_untouched(off: list[dict], k0_3: list[dict]) -> None:
    """The first token of each answer comes from the prefill (EXTEND) forward: identical; decode changes the rest."""
    assert [a[0] for a in _ids(k0_3)] == [a[0] for a in _ids(off)]
    assert [len(a) for a in _ids(k0_3)] == [K0_3_TOKENS] * len(PROMPTS)


def test_sglang_server_concurrency_1_keeps_sglangs_routing(servers: dict[str, Live], sglang_k0_3_served: dict
                                                          ) -> None:
    """One request at a time: every decode forward has 1 row, below OEA_MIN_BATCH: SGLang's own routing."""
    one_by_one = sglang_k0_3_served["one_by_one"]  # the OEA_K0=3 server's, one request at a time
    assert len(one_by_one) == ONE_BY_ONE
    assert _ids(one_by_one) == _ids(generate_one_by_one(servers["off"].url, PROMPTS[:ONE_BY_ONE], ONE_BY_ONE_TOKENS))


def test_sglang_server_bad_oea_k0_stops_start_up_with_one_line(servers: dict[str, Live]) -> None:
    live = servers["bad"]
    assert live.error is not None and "exited with code" in live.error, "the server must not start"
    log = live.log()
    naming = [line for line in log.splitlines() if "OEA_K0" in line]
    assert len(naming) == 1 and BAD_K0 in naming[0], naming
    assert "Traceback" not in log, log[-3000:]


def test_sglang_server_a_router_the_settings_do_not_fit_is_served_unmodified_with_one_warning(
        servers: dict[str, Live], off: list[dict]) -> None:
    assert _ids(generate(servers["k0_9"].url, PROMPTS)) == _ids(off)
    warnings = [line for line in servers["k0_9"].log().splitlines() if "OEA_K0" in line and "top_k" in line]
    assert len(warnings) == 1, warnings


def test_sglang_server_doctor_is_ok_in_the_servers_environment_and_names_the_decode_detection() -> None:
    from oea.launch.sglang_server import server_env

    env = server_env(["--device", "cpu"], child_env({"OEA_K0": "3"}), stand_in=True)  # the k0_3 server's
    oea_script = Path(engine_python("sglang")).with_name("oea")
    proc = subprocess.run([str(oea_script), "doctor", "sglang"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    detection = [line for line in proc.stdout.splitlines() if line.startswith("  [ok] decode detection: live: ")]
    assert detection and "forward_context" in detection[0], proc.stdout
    print(f"\nobserve: {detection[0].strip()}")


def test_sglang_server_sglangs_own_bench_serving_completes_every_request(servers: dict[str, Live],
                                                                         tmp_path: Path) -> None:
    """Against the SGLANG_OEA_K0=3 server (the OEA_K0=3 one is stopped once its traffic is recorded; the two
    serve the same tokens: test_sglang_server_sglang_oea_k0_works_as_oea_k0)."""
    from oea.models import embedded_model_dir

    out = tmp_path / "bench.jsonl"
    model = str(embedded_model_dir())
    cmd = [str(engine_python("sglang")), "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url",
           servers["alias_3"].url, "--model", model, "--tokenizer", model, "--dataset-name", "random-ids",
           "--num-prompts", "16", "--random-input-len", "32", "--random-output-len", "16", "--random-range-ratio",
           "1", "--max-concurrency", "16", "--disable-tqdm", "--output-file", str(out), "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 16, result


def test_sglang_server_k0_3_records_its_decode_forwards_and_their_active_experts_drop(sglang_k0_3_served: dict
                                                                                     ) -> None:
    """The OEA_K0=3 server, stopped by SIGTERM (the recorder finishes the trace): the trace holds the router logits
    of every DECODE forward the live server ran (never a prefill); replaying them, OEA's k0 = 3 routing activates
    fewer experts per step and layer than SGLang's top-8 over the same rows."""
    from oea.traces import load_trace

    served = sglang_k0_3_served
    assert served["trace_path"].exists(), served["log"][-3000:]
    assert "oea: recording 100% of decode forwards" in served["log"]
    trace = load_trace(served["trace_path"])
    assert trace.num_layers == 4
    steps, rows = trace.step_ids.unique(return_counts=True)
    # one row per running request: a prefill of 16 prompts would hold their ~100 prompt tokens
    assert int(rows.max()) == len(PROMPTS), "the 16 requests were decoded together, and no prefill was recorded"
    vanilla, routed = [], []
    for step in steps.tolist():
        batch = trace.step_ids == step
        if int(batch.sum()) < 2:
            continue
        for layer in range(trace.num_layers):
            logits = trace.logits[batch, layer].float()
            vanilla.append(int(oea.active_experts(*oea.route(logits, SPEC, oea.OEAConfig(TOP_K)))))
            routed.append(int(oea.active_experts(*oea.route(logits, SPEC, oea.OEAConfig(3)))))
    assert routed and sum(routed) < 0.8 * sum(vanilla), (sum(routed), sum(vanilla))


def test_prometheus_sglang_counters_on_sglangs_metrics_equal_the_metrics_file(servers: dict[str, Live]) -> None:
    """The SGLANG_OEA_K0=3 server runs with --enable-metrics: after eight requests decoded together and two one at
    a time, the oea_* counters on SGLang's own /metrics equal exactly what its scheduler's metrics file counted."""
    from prometheus_live import file_counts, scraped_counts, settled

    live = servers["alias_3"]
    generate(live.url, PROMPTS[:8])  # eight sequences in one batch: rewritten decode forwards
    generate_one_by_one(live.url, PROMPTS[:2], ONE_BY_ONE_TOKENS)  # one row: below OEA_MIN_BATCH
    samples, rows = settled(live.url, Path(live.arm.env["OEA_METRICS_FILE"]))
    scraped, counted = scraped_counts(samples), file_counts(rows)
    assert scraped == counted
    assert counted["rewritten"] > 0 and counted["reason:below_min_batch"] > 0, counted
    enabled = [(labels, value) for name, labels, value in samples if name == "oea_enabled"]
    assert [(labels["engine"], labels["k0"], labels["rank"], value) for labels, value in enabled] == \
        [("sglang", "3", "0", 1.0)], enabled


def test_prometheus_sglang_off_exports_no_oea_series(servers: dict[str, Live], off: list[dict]) -> None:
    """The OEA-off server with --enable-metrics, after its traffic: SGLang's own series, no oea_* one."""
    from prometheus_live import scrape

    samples = scrape(servers["off"].url)
    assert any(name.startswith("sglang:") for name, _, _ in samples), "SGLang's /metrics served nothing"
    assert not [name for name, _, _ in samples if name.startswith("oea_")]
