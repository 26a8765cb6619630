"""``oea bench serve`` driver: arms from the command line, running servers or one restarted vLLM or SGLang server.

Restart mode (``--serve-arm NAME=ENV ... -- <server args>``): for each round, each arm (order rotated
between rounds: ``restart_order``) gets a fresh server of the engine (``--engine``, else ``engines.detect_engine``
of the arguments: vLLM's ``api_server`` through ``oea.launch.vllm``, SGLang's ``launch_server`` through
``oea.launch.sglang_server``) started with its environment, runs the whole concurrency sweep, and is stopped;
the plugin's metrics file of that server (``OEA_METRICS_FILE``, one per arm and round, the same rows from
both engines) is summarised into the rows: ``engine_routing_us_per_call`` (mean over decode-step
routing calls in the round's time window), ``engine_active_experts`` (mean per layer and decode step)
and ``engine_decode_steps``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oea.bench.serve.client import Arm, BenchConfig, append_jsonl, load_rows, run_benchmark
from oea.bench.serve.engines import check_engine, detect_engine, require_engine
from oea.bench.serve.summary import summarize


def parse_arms(args: argparse.Namespace) -> list[Arm]:
    """Arms on running servers: ``--base-url``, ``--base-url-a/-b``, ``--arm NAME=URL``."""
    arms = []
    if args.base_url:
        arms.append(Arm("server", check_url(args.base_url, "--base-url")))
    if bool(args.base_url_a) != bool(args.base_url_b):
        raise ValueError("--base-url-a and --base-url-b go together")
    if args.base_url_a:
        arms += [Arm("a", check_url(args.base_url_a, "--base-url-a")), Arm("b", check_url(args.base_url_b,
                                                                                          "--base-url-b"))]
    for spec in args.arm:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--arm must be NAME=URL, got {spec!r}")
        arms.append(Arm(name, check_url(url, f"--arm {name}=URL")))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    return arms


def check_url(url: str, flag: str) -> str:
    """``url`` when it is an http(s) URL with a host, else ``ValueError`` naming ``flag`` (before any request)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{flag} must be an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000), "
                         f"got {url!r}")
    return url


def parse_serve_arms(specs: list[str]) -> dict[str, dict[str, str]]:
    """``NAME=VAR=VALUE VAR2=VALUE2`` (or ``NAME=`` for stock) -> {name: env}."""
    from oea.launch.server_process import env_arm

    arms: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, env = env_arm(spec, "--serve-arm")
        if name in arms:
            raise ValueError(f"--serve-arm names must be unique, got {name!r} twice")
        arms[name] = env
    return arms


def parse_serve_arm_args(specs: list[str], arms: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """``NAME=ARGS`` (shell-split) -> {name: server arguments added for that arm only}; NAME must be a
    ``--serve-arm`` and given once (ValueError naming ``--serve-arm-args`` otherwise)."""
    import shlex

    extra: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest.strip():
            raise ValueError(f"--serve-arm-args must be NAME=ARGS (server arguments for that arm), got {spec!r}")
        if name not in arms:
            raise ValueError(f"--serve-arm-args {name}: no --serve-arm of that name (arms: {', '.join(arms)})")
        if name in extra:
            raise ValueError(f"--serve-arm-args {name}: given twice")
        extra[name] = shlex.split(rest)
    return extra


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The request mix from the parsed flags."""
    return BenchConfig(
        model=args.model, dataset=args.dataset, num_prompts=args.num_prompts,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, text_input_chars=args.text_input_chars,
        concurrencies=tuple(args.max_concurrency), rounds=args.rounds, warmup_requests=args.warmup_requests,
        seed=args.seed, timeout=args.timeout,
    )


def engine_summary(metrics_rows: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Decode-step routing time, active experts and step time inside [start, end] (worker clock = wall clock).

    Decode steps here are the generation steps: decode and speculative verify steps (``verify``), rewritten
    or not, so that arms with and without ``OEA_APPLY_TO_VERIFY`` are summarised over the same kind of steps.
    ``engine_step_ms_median``: median gap between the end stamps of consecutive engine steps that are both
    decode steps (the engine's decode step period); ``engine_routing_share_call`` = mean routing time of
    one call / that step; ``engine_routing_share_step`` = mean routing time of all MoE layers of a step /
    that step. With speculation: ``engine_verify_steps`` / ``engine_verify_steps_rewritten`` (verify steps,
    and those OEA rewrote), ``engine_decode_steps_rewritten``, ``engine_mean_tokens_per_request`` (mean over
    steps of the tokens a request ran: 1 + its drafts).
    """
    rows = [r for r in metrics_rows if start <= r["time"] <= end + 1.0 and (r["decode"] or r.get("verify"))]
    times = [t for r in rows for t in r.get("routing_us", [])]
    active = [a for r in rows for a in r["active"]]
    stock = [a for r in rows for a in r.get("active_stock", [])]
    out: dict[str, Any] = {
        "engine_decode_steps": len(rows),
        "engine_routing_us_per_call": statistics.mean(times) if times else math.nan,
        "engine_routing_us_median": statistics.median(times) if times else math.nan,
        "engine_active_experts": statistics.mean(active) if active else math.nan,
        "engine_mean_decode_rows": statistics.mean(r["rows"] for r in rows) if rows else math.nan,
    }
    if stock:
        out["engine_active_experts_stock"] = statistics.mean(stock)
    if any("verify" in r for r in rows):
        verify = [r for r in rows if r["verify"]]
        out["engine_verify_steps"] = len(verify)
        out["engine_verify_steps_rewritten"] = sum(bool(r["oea"]) for r in verify)
        out["engine_decode_steps_rewritten"] = sum(bool(r["oea"]) for r in rows if not r["verify"])
        tokens = [statistics.mean(r["tokens_per_request"]) for r in rows if r.get("tokens_per_request")]
        if tokens:
            out["engine_mean_tokens_per_request"] = statistics.mean(tokens)
    by_step = {(r.get("pid"), r["step"]): r for r in rows if "step" in r}
    gaps = [(r["time"] - by_step[(r.get("pid"), r["step"] - 1)]["time"]) * 1e3 for r in rows
            if "step" in r and (r.get("pid"), r["step"] - 1) in by_step]
    gaps = [g for g in gaps if g > 0]
    if gaps:
        step_ms = statistics.median(gaps)
        out["engine_step_ms_median"] = step_ms
        if times:
            per_step = statistics.mean(sum(r["routing_us"]) for r in rows if r.get("routing_us"))
            out["engine_routing_share_call"] = statistics.mean(times) / 1e3 / step_ms
            out["engine_routing_share_step"] = per_step / 1e3 / step_ms
    return out


def engine_enricher(metrics_files: dict[str, Path], flush_wait: float = 1.0):
    """``enrich(row)`` for ``run_benchmark``: adds ``engine_*`` fields from the arm's OEA metrics file
    (written by the vLLM worker or the SGLang scheduler, the same rows; see docs/vllm.md) for the row's time
    window."""

    def enrich(row: dict[str, Any]) -> None:
        path = metrics_files.get(row["arm"])
        if path is None:
            return
        if path.exists():  # it appears at the worker's first flush (the warm-up requests)
            time.sleep(flush_wait)  # the worker flushes every OEA_METRICS_FLUSH_S (0.5 s by default)
        engine_rows = load_rows(path) if path.exists() else []
        row.update(engine_summary(engine_rows, row["start_time"], row["end_time"]))

    return enrich


def with_load(enrich: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
    """``enrich`` that also records the machine's load average (1, 5, 15 min) at the end of each round."""

    def enrich_with_load(row: dict[str, Any]) -> None:
        row["loadavg"] = list(os.getloadavg())
        if enrich is not None:
            enrich(row)

    return enrich_with_load


def wait_for_load(max_load: float | None, timeout: float, poll: float = 15.0,
                  loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg,
                  sleep: Callable[[float], None] = time.sleep) -> float:
    """Block until the 1-minute load average is at most ``max_load`` (None: do not wait), or ``timeout``
    seconds passed; returns the seconds waited. Starting every server at a similar load keeps other jobs'
    bursts on a shared machine out of some arms' rounds."""
    waited = 0.0
    while max_load is not None and loadavg()[0] > max_load and waited < timeout:
        sleep(poll)
        waited += poll
    return waited


def restart_order(names: list[str], round_index: int) -> list[str]:
    """The arm order of one round in restart mode: rotated left by the round index (off k5 k3, k5 k3 off,
    k3 off k5, ...), so over len(names) rounds every arm runs once in every position."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def parse_engine_metrics(specs: list[str]) -> dict[str, Path]:
    """``NAME=FILE`` items of ``--engine-metrics`` -> {arm name: path}."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--engine-metrics must be NAME=FILE, got {spec!r}")
        out[name] = Path(path)
    return out


def run_restarted(serve_arms: dict[str, dict[str, str]], vllm_args: list[str], cfg: BenchConfig,
                  out_dir: Path, output_file: Path | None, python: str | None, health_timeout: float,
                  progress: bool, server_nice: int | None = None, first_round: int = 0,
                  max_load: float | None = None, load_wait: float = 1800.0,
                  engine: str | None = None, arm_args: dict[str, list[str]] | None = None
                  ) -> list[dict[str, Any]]:
    """Restart mode: one server per (round, arm), arm order rotated between rounds (``restart_order``).

    ``arm_args``: server arguments added after ``vllm_args`` for some arms only (``--serve-arm-args``: e.g.
    speculative decoding in some arms and not in others of the same run); rows record them
    (``arm_server_args``).

    ``engine`` (``vllm`` / ``sglang``; None: ``detect_engine`` of ``vllm_args``, the server's arguments) says
    which server is started; each row records it (``engine``).

    Rounds are numbered from ``first_round`` (prompts, arm order and file names follow the number), so a
    later run can extend an A/B with new rounds into the same output file. With ``max_load`` each server
    starts only once the 1-minute load average is at most that (``wait_for_load``, at most ``load_wait``
    seconds; rows record ``load_wait_s``). SIGTERM stops the current server before this process exits (as
    Ctrl-C does)."""
    if first_round < 0:
        raise ValueError(f"--first-round must be >= 0, got {first_round}")
    if server_nice is not None:  # the client times the stream: it gets the servers' priority too
        from oea.launch.priority import set_priority

        set_priority(server_nice, "--server-nice")
    from oea.launch.vllm import strip_separator

    vllm_args = strip_separator(vllm_args)
    if not vllm_args:
        raise ValueError("restart mode needs the server arguments after '--' (vLLM's api_server or SGLang's "
                         "launch_server)")
    engine = check_engine(engine) or detect_engine(vllm_args)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(serve_arms)
    rows: list[dict[str, Any]] = []

    def stop_on_sigterm(signum: int, _frame: object) -> None:  # run the finally below on SIGTERM too
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        _restart_rounds(serve_arms, names, (engine, vllm_args, arm_args or {}), cfg, out_dir, output_file, python,
                        health_timeout, progress, server_nice, first_round, (max_load, load_wait), rows)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return rows


def _restart_rounds(serve_arms: dict[str, dict[str, str]], names: list[str],
                    command: tuple[str, list[str], dict[str, list[str]]],
                    cfg: BenchConfig, out_dir: Path, output_file: Path | None, python: str | None,
                    health_timeout: float, progress: bool, server_nice: int | None, first_round: int,
                    load_gate: tuple[float | None, float], rows: list[dict[str, Any]]) -> None:
    from oea.launch.server_process import stop_server, wait_healthy
    from oea.launch.vllm import oea_env

    engine, shared_args, arm_args = command
    start_server = server_starter(engine, shared_args, python)
    for r in range(first_round, first_round + cfg.rounds):
        for name in restart_order(names, r):
            metrics_file = out_dir / f"engine-{name}-round{r}.jsonl"
            metrics_file.unlink(missing_ok=True)
            env = oea_env(None, None)
            env.update({"OEA_METRICS_FILE": str(metrics_file), "OEA_TIMING": "1", **serve_arms[name]})
            waited = wait_for_load(*load_gate)
            server_args = [*shared_args, *arm_args.get(name, [])]
            server = start_server(server_args, env, python=python, log_path=out_dir / f"server-{name}-round{r}.log",
                                  nice=server_nice)
            try:
                wait_healthy(server, timeout=health_timeout, timeout_name="--health-timeout")
                require_engine(server.base_url, engine, strict=False)
                single = BenchConfig(**{**cfg.__dict__, "rounds": 1, "seed": cfg.seed + 100 * r})
                for row in run_benchmark([Arm(name, server.base_url)], single, progress=progress,
                                         enrich=with_load(engine_enricher({name: metrics_file}))):
                    row["round"] = r
                    row["engine"] = engine
                    row["arm_env"] = serve_arms[name]
                    if name in arm_args:
                        row["arm_server_args"] = arm_args[name]
                    row["load_wait_s"] = waited
                    rows.append(row)
                    if output_file is not None:
                        append_jsonl(output_file, row)
            finally:
                stop_server(server)


def server_starter(engine: str, server_args: list[str], python: str | None) -> Callable[..., Any]:
    """``start_server(args, env, python=, log_path=, nice=)`` of ``engine``'s launcher. An SGLang CPU server
    (``--device cpu``) whose interpreter has no ``sgl_kernel`` gets the launcher's stand-in
    (``oea.launch.sglang_server``: no CPU build of SGLang's kernel package is on the package index)."""
    if engine != "sglang":
        from oea.launch.vllm import start_server

        return start_server
    from oea.launch.server_process import option
    from oea.launch.sglang_server import start_server as start_sglang

    stand_in = option(server_args, "--device") == "cpu" and not _importable(python or sys.executable, "sgl_kernel")
    if stand_in:
        print("oea bench serve: no sgl_kernel in the SGLang interpreter: each CPU server runs with oea's sgl_kernel "
              "stand-in (SGLang's torch-native paths; oea.launch.sglang_server)", file=sys.stderr)
    return functools.partial(start_sglang, stand_in=stand_in)


def _importable(python: str, module: str) -> bool:
    """Whether ``python`` finds ``module`` (without importing it)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def check_running_engine(arms: list[Arm], engine: str | None) -> None:
    """With ``--engine``: every running server must say it is that engine (one-line ``ValueError`` naming what
    one said, ``engines.require_engine``); an unreachable one raises ``ServerUnreachable`` first."""
    if check_engine(engine) is None:
        return
    from oea.bench.serve.client import check_reachable

    for arm in arms:
        check_reachable(arm.base_url)
        require_engine(arm.base_url, engine)


def summarized_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--summarize FILE``: the rows of an earlier ``--output-file``, to summarise without running anything."""
    if (args.serve_arm or args.base_url or args.base_url_a or args.arm or args.output_file
            or args.vllm_args not in ([], ["--"])):
        raise ValueError("--summarize reads an earlier run: it cannot be combined with servers, arms or --output-file")
    path = Path(args.summarize)
    if path.is_dir():
        raise ValueError(f"--summarize {path} is a directory; give the JSONL file an earlier --output-file wrote")
    if not path.is_file():
        raise ValueError(f"--summarize: no such file: {path}")
    try:
        rows = load_rows(path)
    except json.JSONDecodeError as err:
        raise ValueError(f"--summarize: {path} is not JSON lines written by oea bench serve ({err})") from None
    needed = ("arm", "max_concurrency", "round", "output_throughput", "mean_tpot_ms", "mean_ttft_ms")
    if not rows or any(not set(needed) <= set(row) for row in rows):
        raise ValueError(f"--summarize: {path} has no oea bench serve rows (each needs {', '.join(needed)})")
    return rows


def main(args: argparse.Namespace) -> int:
    """Handler of ``oea bench serve``; returns the exit code."""
    cfg = bench_config(args)
    output_file = Path(args.output_file) if args.output_file else None
    from oea.console import check_output_file, check_plot_file

    if args.plot:  # written at the end: checked before any server is contacted or started
        check_plot_file(args.plot)
    if output_file is not None and not args.summarize:
        check_output_file(output_file, "--output-file", create_folders=True)
    if args.summarize:
        rows = summarized_rows(args)
    elif args.serve_arm:
        if args.base_url or args.base_url_a or args.arm:
            raise ValueError("--serve-arm (restart mode) cannot be combined with --base-url/--arm")
        serve_arms = parse_serve_arms(args.serve_arm)
        arm_args = parse_serve_arm_args(args.serve_arm_args, serve_arms)
        out_dir = Path(args.engine_metrics_dir or (output_file.parent if output_file else Path("oea-bench-serve")))
        rows = run_restarted(serve_arms, list(args.vllm_args), cfg, out_dir, output_file, args.python,
                             args.health_timeout, progress=not args.no_progress, server_nice=args.server_nice,
                             first_round=args.first_round, max_load=args.max_load, load_wait=args.load_wait,
                             engine=args.engine, arm_args=arm_args)
        if args.first_round and output_file is not None:  # an extension: summarise every round in the file
            rows = load_rows(output_file)
    else:
        if args.serve_arm_args:
            raise ValueError("--serve-arm-args is only used with --serve-arm (restart mode)")
        if args.vllm_args and args.vllm_args != ["--"]:
            raise ValueError("server arguments after '--' are only used with --serve-arm (restart mode)")
        arms = parse_arms(args)
        if not arms:
            raise ValueError("give a server: --base-url URL, --base-url-a URL --base-url-b URL, --arm NAME=URL, "
                             "or --serve-arm NAME=ENV ... -- <vllm args>")
        from oea.bench.serve.client import ServerUnreachable

        metrics_files = parse_engine_metrics(args.engine_metrics) if args.engine_metrics else None  # before a request
        try:
            check_running_engine(arms, args.engine)
            enrich = engine_enricher(metrics_files) if metrics_files else None
            rows = run_benchmark(arms, cfg, output_file=output_file, progress=not args.no_progress,
                                 enrich=with_load(enrich))
        except ServerUnreachable as err:
            print(f"oea bench serve: error: {err}", file=sys.stderr)
            return 1
    from oea.bench.serve.summary import ab_summary, plot_ab, print_ab_table

    ab = ab_summary(rows, baseline=args.baseline_arm, seed=cfg.seed)
    if args.plot:
        size = (f"in={cfg.text_input_chars} chars" if cfg.dataset == "text" else f"in={cfg.random_input_len}")
        title = f"{cfg.dataset} {size} out={cfg.random_output_len} tokens"
        if args.summarize:
            title = Path(args.summarize).name
        plot_ab(ab, args.plot, title=title)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summarize(rows), "ab": ab}, indent=1))
    else:
        print_ab_table(ab)
    return 0
