"""Prometheus export on / off with OEA on, on live servers: prints the paired engine step-time ratio.

Two servers of one engine with the same model and the same OEA setting (``OEA_K0``), one exporting the ``oea_*``
series (the default) and one with ``OEA_PROMETHEUS=0``; both write ``OEA_METRICS_FILE`` (the step times come from
it, and the metrics writer runs in both, so the difference is the export alone: its work in the writer's thread
and the engine's ``/metrics`` reading OEA's files). A scraper reads both servers' ``/metrics`` every
``--scrape-interval`` seconds, as Prometheus would, and checks that only the exporting server has ``oea_*``
series. ``oea bench serve`` then runs paired rounds on the two running servers (order A B, B A, ...), and its
summary prints the ratio of the engine's median decode-step period, export / no export, with a bootstrap interval
paired by round (``oea.stats``), beside TPOT and throughput.

    python scripts/bench_prometheus_overhead.py --python .venv-vllm/bin/python --rounds 12
    python scripts/bench_prometheus_overhead.py --engine sglang --python .venv-sglang/bin/python --rounds 12

Servers bind 127.0.0.1, each in its own process group, stopped (group SIGTERM, then SIGKILL) even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from oea.bench.serve.client import load_rows
from oea.launch.server_process import Server, stop_server, wait_healthy
from oea.models import embedded_model_dir
from oea.stats import ratio_of_medians_interval

ARMS = ("export", "no_export")  # the first exports (OEA_PROMETHEUS unset: on), the second sets OEA_PROMETHEUS=0


def _server_args(engine: str, model: str, port: int) -> list[str]:
    if engine == "vllm":
        return ["--model", model, "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "512",
                "--max-num-seqs", "16", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    # SGLang's CPU engine as docs/eval.md runs it; --enable-metrics in both arms (SGLang's own series the same)
    return ["--model-path", model, "--served-model-name", "m", "--device", "cpu", "--tp", "1", "--attention-backend",
            "torch_native", "--disable-overlap-schedule", "--dtype", "bfloat16", "--max-total-tokens", "4096",
            "--max-running-requests", "16", "--random-seed", "0", "--host", "127.0.0.1", "--port", str(port),
            "--enable-metrics"]


def _start(engine: str, python: str, model: str, port: int, env: dict[str, str], log: Path) -> Server:
    args = _server_args(engine, model, port)
    if engine == "vllm":
        from oea.launch.vllm import start_server

        return start_server(args, env, python=python, log_path=log)
    from oea.launch.sglang_server import start_server as start_sglang

    # the sgl_kernel stand-in (test support of this checkout) replaces SGLang's CPU kernels, which its CPU wheel
    # lacks here (docs/sglang.md "sgl_kernel stand-in"), as in every CPU SGLang server of the tests
    return start_sglang(args, env, python=python, log_path=log, stand_in=True)


# (field of a round, what it is): the engine's own step period first, the figure the export could slow
FIGURES = (("full_step_ms", "engine decode-step period at full batches (rows = concurrency), ms"),
           ("engine_step_ms_median", "engine decode-step period, all decode steps, ms"),
           ("median_tpot_ms", "client TPOT, ms"),
           ("output_throughput", "output tok/s"), ("engine_mean_decode_rows", "rows per decode step"))


def full_step_ms(metrics_rows: list[dict], start: float, end: float, width: int) -> float:
    """Median gap (ms) between consecutive decode steps of one process that both hold ``width`` rows, inside
    [start, end]: the step period at a fixed batch, which the front end's varying fill cannot move (nan: none)."""
    rows = {(r.get("pid"), r["step"]): r for r in metrics_rows
            if start <= r["time"] <= end + 1.0 and r["decode"] and r["rows"] == width and "step" in r}
    gaps = [(r["time"] - rows[(pid, step - 1)]["time"]) * 1e3 for (pid, step), r in rows.items()
            if (pid, step - 1) in rows]
    return float(np.median(gaps)) if gaps else float("nan")


def add_full_steps(rows: list[dict], metrics: dict[str, Path], width: int) -> None:
    """Each round's ``full_step_ms`` (decode steps of ``width`` rows) from its arm's metrics file."""
    loaded = {arm: load_rows(str(path)) for arm, path in metrics.items() if path.exists()}  # kept rows: none
    for row in rows:
        if row["arm"] in loaded:
            row["full_step_ms"] = full_step_ms(loaded[row["arm"]], row["start_time"], row["end_time"], width)


def paired_ratios(rows: list[dict]) -> list[str]:
    """One line per figure: each arm's median over rounds and export / no export, ratio of medians with a
    bootstrap interval paired by round (rounds both arms ran)."""
    by_round: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["arm"]] = row
    pairs = [arms for _, arms in sorted(by_round.items()) if set(ARMS) <= set(arms)]
    lines = [f"{len(pairs)} rounds with both arms"]
    rng = np.random.default_rng(0)
    for key, label in FIGURES:
        both = [p for p in pairs if np.isfinite(p["export"].get(key, np.nan))
                and np.isfinite(p["no_export"].get(key, np.nan))]
        on, off = [p["export"][key] for p in both], [p["no_export"][key] for p in both]
        if len(on) < 2:
            lines.append(f"{label}: fewer than 2 paired rounds, no interval")
            continue
        ratio = ratio_of_medians_interval(on, off, rng, paired=True)
        lines.append(f"{label}: export {np.median(on):.3f}, no export {np.median(off):.3f}; export / no export "
                     f"{ratio.estimate:.3f} [{ratio.low:.3f}, {ratio.high:.3f}] (95%, {len(on)} pairs)")
    return lines


class Scraper(threading.Thread):
    """GET each server's ``/metrics`` every ``interval`` s; counts scrapes and ``oea_*`` sample lines per arm."""

    def __init__(self, urls: dict[str, str], interval: float) -> None:
        super().__init__(daemon=True)
        self.urls, self.interval = urls, interval
        self.stop = threading.Event()
        self.scrapes = dict.fromkeys(urls, 0)
        self.oea_lines = dict.fromkeys(urls, 0)
        self.errors: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self.stop.wait(self.interval):
                for arm, url in self.urls.items():
                    try:
                        text = client.get(f"{url}/metrics").raise_for_status().text
                    except httpx.HTTPError as err:
                        self.errors.append(f"{arm}: {type(err).__name__}: {err}")
                        continue
                    self.scrapes[arm] += 1
                    self.oea_lines[arm] = sum(line.startswith("oea_") for line in text.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--python", required=True, help="interpreter with the engine and oea installed")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--k0", type=int, default=3, help="OEA_K0 of both servers")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="seconds between scrapes of each server")
    parser.add_argument("--ports", type=int, nargs=2, default=(8091, 8092), metavar=("EXPORT", "NO_EXPORT"))
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/bench-prometheus-overhead"))
    parser.add_argument("--output-file", type=Path, default=None,
                        help="the rounds (default: WORK_DIR/rounds-<engine>.jsonl, replaced)")
    parser.add_argument("--health-timeout", type=float, default=900.0)
    parser.add_argument("--summarize", action="store_true",
                        help="run nothing: the figures of an earlier run in WORK_DIR (its rounds and metrics files)")
    args = parser.parse_args()
    model = args.model or str(embedded_model_dir())
    work = args.work_dir.resolve()
    if args.summarize:
        output = (args.output_file or work / f"rounds-{args.engine}.jsonl").resolve()
        rows = load_rows(str(output))  # the run's rounds, or rounds kept with their full_step_ms (docs/)
        add_full_steps(rows, {arm: work / f"metrics-{args.engine}-{arm}.jsonl" for arm in ARMS}, args.concurrency)
        print("\n".join(paired_ratios(rows)))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    output = (args.output_file or work / f"rounds-{args.engine}.jsonl").resolve()
    output.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OEA_", "SGLANG_OEA_"))}
    base.update({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "OEA_K0": str(args.k0),
                 "OEA_METRICS_FLUSH_S": "0.5"})
    servers: dict[str, Server] = {}
    metrics: dict[str, Path] = {}
    scraper = None
    try:
        for arm, port in zip(ARMS, args.ports, strict=True):
            metrics[arm] = work / f"metrics-{args.engine}-{arm}.jsonl"
            metrics[arm].unlink(missing_ok=True)
            env = {**base, "OEA_METRICS_FILE": str(metrics[arm])}
            if arm == "no_export":
                env["OEA_PROMETHEUS"] = "0"
            servers[arm] = _start(args.engine, args.python, model, port, env, work / f"server-{args.engine}-{arm}.log")
        for server in servers.values():  # started together, waited for in turn
            wait_healthy(server, timeout=args.health_timeout, timeout_name="--health-timeout")
        scraper = Scraper({arm: s.base_url for arm, s in servers.items()}, args.scrape_interval)
        scraper.start()
        cmd = [sys.executable, "-m", "oea", "bench", "serve", "--no-progress", "--baseline-arm", "no_export",
               "--max-concurrency", str(args.concurrency), "--rounds", str(args.rounds),
               "--num-prompts", str(args.num_prompts), "--random-input-len", "64", "--random-output-len", "128",
               "--warmup-requests", "4", "--seed", "0", "--output-file", str(output)]
        for arm, server in servers.items():
            cmd += ["--arm", f"{arm}={server.base_url}", "--engine-metrics", f"{arm}={metrics[arm]}"]
        started = time.time()
        code = subprocess.run(cmd, check=False).returncode
        print(f"bench serve: exit {code}, {time.time() - started:.0f} s; rounds in {output}")
        if output.exists():
            rows = load_rows(str(output))
            add_full_steps(rows, metrics, args.concurrency)
            kept = output.with_name(f"{output.stem}-full-steps.jsonl")  # the rounds with full_step_ms, to keep
            kept.write_text("".join(json.dumps(row) + "\n" for row in rows))
            print("\n".join(paired_ratios(rows)) + f"\nrounds with full_step_ms: {kept}")
        scraper.stop.set()
        scraper.join(timeout=30)
        print(f"scrapes: {scraper.scrapes}; oea_* sample lines at the last scrape: {scraper.oea_lines}; "
              f"scrape errors: {len(scraper.errors)}{' (' + scraper.errors[0] + ')' if scraper.errors else ''}")
        problems = []
        if scraper.oea_lines["export"] == 0:
            problems.append("the exporting server's /metrics has no oea_* series")
        if scraper.oea_lines["no_export"] != 0:
            problems.append("the server with OEA_PROMETHEUS=0 exports oea_* series")
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return code or (1 if problems else 0)
    finally:
        if scraper is not None:
            scraper.stop.set()
        for server in servers.values():
            stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
