"""``oea eval serve``: restart mode against a fake ``vllm.entrypoints.openai.api_server`` (the servers of
``eval_serve_fakes``), the "does it pay" rows and plot, and an lm-eval task from a local YAML through lm-eval's
``local-completions`` model against a stand-in server."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from eval_serve_fakes import answers
from fake_servers import fake_engine, serving
from lm_eval_task import write_task
from server_harness import free_port

from oea.cli import main

FAKE_ENGINE = r'''
import argparse
from eval_serve_fakes import serve_from_env
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--model")
args, _ = p.parse_known_args()
serve_from_env(args.host, args.port, args.model)
'''


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # four fake servers start (each imports oea)
def test_restart_mode_serves_each_arm_with_its_environment_and_metrics_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = fake_engine(tmp_path, "vllm.entrypoints.openai.api_server", FAKE_ENGINE)
    shutil.copy(Path(__file__).with_name("eval_serve_fakes.py"), fake / "eval_serve_fakes.py")
    out = tmp_path / "runs" / "q.jsonl"
    code = main(["eval", "serve", "--serve-arm", f"off=PYTHONPATH={fake}", "--serve-arm",
                 f"k3=PYTHONPATH={fake} OEA_K0=3", "--python", sys.executable, "--num-items", "9", "--rounds", "2",
                 "--max-concurrency", "1", "3", "--output-file", str(out), "--no-progress", "--json",
                 "--", "--model", "m", "--port", str(free_port())])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cells = [r for r in rows if r["kind"] == "cell"]
    # one server per arm and round, order rotated between rounds; every concurrency on each server
    assert [(c["round"], c["arm"], c["max_concurrency"]) for c in cells] == [
        (0, "off", 1), (0, "off", 3), (0, "k3", 1), (0, "k3", 3), (1, "k3", 1), (1, "k3", 3), (1, "off", 1),
        (1, "off", 3)]
    assert [c["arm_env"].get("OEA_K0") for c in cells[::2]] == [None, "3", "3", None]
    assert all(Path(c["metrics_file"]).name == f"engine-{c['arm']}-round{c['round']}.jsonl" for c in cells)
    assert all(c["decode_steps"] == 9 for c in cells)  # one stand-in step per item, inside the cell's window
    assert [c["rewritten_steps"] for c in cells[::2]] == [0, 9, 9, 0]
    summary = _json(capsys)["summary"]
    k3 = [r for r in summary if r["arm"] == "k3" and r["metric"] == "exact_match"]
    assert all(r["delta"] < 0 and r["active_experts_ratio"] == pytest.approx(0.5) for r in k3)
    off = [r for r in summary if r["arm"] == "off"]
    assert all(r["verdict"] == "baseline" and r["rewritten_steps"] == 0 for r in off)


def _speed_row(arm: str, concurrency: int, rnd: int, tpot: float) -> dict:
    return {"arm": arm, "max_concurrency": concurrency, "round": rnd, "median_tpot_ms": tpot, "mean_tpot_ms": tpot,
            "output_throughput": 1000 / tpot, "mean_ttft_ms": 5.0}


def test_does_it_pay_puts_the_tpot_ratio_beside_the_quality_delta(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    quality = tmp_path / "quality.jsonl"
    with serving(answers()) as off, serving(answers(wrong_every=3)) as k3:
        assert main(["eval", "serve", "--arm", f"off={off}", "--arm", f"k3={k3}", "--num-items", "12",
                     "--max-concurrency", "4", "--output-file", str(quality), "--no-progress"]) == 0
    capsys.readouterr()
    speed = tmp_path / "speed.jsonl"
    speed.write_text("".join(json.dumps(_speed_row(arm, 4, r, tpot)) + "\n" for r in range(3)
                             for arm, tpot in (("off", 10.0 + r), ("k3", 8.0 + r))))
    plot = tmp_path / "pay.png"
    assert main(["eval", "serve", "--summarize", str(quality), "--speed-file", str(speed), "--plot", str(plot),
                 "--json"]) == 0
    pay = _json(capsys)["pay"]
    assert [(p["arm"], p["max_concurrency"], p["metric"]) for p in pay] == [("k3", 4, "exact_match")]
    assert pay[0]["tpot_ratio"] == pytest.approx(9.0 / 11.0)  # medians over rounds: 9 / 11
    assert pay[0]["delta"] < 0 and len(pay[0]["delta_ci"]) == 2 and len(pay[0]["tpot_ratio_ci"]) == 2
    assert plot.stat().st_size > 0
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(_speed_row("off", 8, 0, 1.0)) + "\n" + json.dumps(_speed_row("k5", 8, 0, 1.0)) + "\n")
    assert main(["eval", "serve", "--summarize", str(quality), "--speed-file", str(other)]) == 2
    assert "--speed-file: its bench serve rows share no (arm, max_concurrency)" in capsys.readouterr().err


@pytest.mark.slow
def test_an_lm_eval_task_from_a_local_yaml_runs_through_local_completions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_task(tmp_path / "tasks", 6)
    off_handler, k3_handler = answers(), answers(wrong_every=3)
    with serving(off_handler) as off, serving(k3_handler) as k3:
        code = main(["eval", "serve", "--arm", f"off={off}", "--arm", f"k3={k3}", "--task", "oea_lines",
                     "--include-path", str(tmp_path / "tasks"), "--num-items", "6", "--max-concurrency", "2",
                     "--no-progress", "--json"])
    assert code == 0
    rows = {r["arm"]: r for r in _json(capsys)["summary"] if r["metric"] == "exact_match"}
    assert rows["off"]["score"] == 1.0 and rows["off"]["n_items"] == 6
    assert rows["k3"]["score"] < 1.0 and rows["k3"]["errors"] == 0
    sent = off_handler.requests
    assert len(sent) == 6 and all(r["temperature"] == 0 and r["stop"] == ["\n"] for r in sent)
    code = main(["eval", "serve", "--arm", "a=http://127.0.0.1:9", "--task", "nope", "--include-path",
                 str(tmp_path / "tasks")])
    assert code == 2 and "--task nope: not a task under --include-path" in capsys.readouterr().err
