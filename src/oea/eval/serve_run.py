"""``oea eval serve``'s runs: the same items through every arm, at every ``--max-concurrency``, every round.

Arms are those of ``oea bench serve`` and run through its machinery (``oea.bench.serve.ab``): running servers
(``--arm NAME=URL``, order ``arm_order``: A B, B A, ...) or restart mode (``--serve-arm NAME=ENV ... -- <server
args>``: a fresh vLLM or SGLang server per arm and round, order ``restart_order``, the server started by
``server_starter``, each with its own ``OEA_METRICS_FILE``). Rows are appended to ``--output-file`` as soon as an
(arm, concurrency, round) cell is answered, so an interrupted run leaves rows that ``--summarize`` reads:

* one ``"kind": "item"`` row per item: ``arm``, ``task``, ``max_concurrency``, ``round``, ``item``, ``output``,
  ``tokens``, ``scores`` (metric -> score) and ``error`` ('' when answered);
* one ``"kind": "cell"`` row per cell: its time window, ``n_items``, ``errors`` and, with the arm's OEA metrics
  file, ``decode_steps`` (decode and verify steps the plugin saw in the window), ``rewritten_steps`` (those OEA
  rewrote), ``active_experts`` and ``active_experts_stock`` (means per layer and step: OEA's and the engine's
  stock routing of the same logits).
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oea.bench.serve.client import Arm, ServerUnreachable, append_jsonl, arm_order, check_reachable, load_rows

# (base URL, model, max concurrency) -> one dict per item: item, output, tokens, scores, error
ItemRunner = Callable[[str, str, int], list[dict[str, Any]]]


@dataclass(frozen=True)
class EvalPlan:
    """What every arm answers: ``task`` (its name in the rows), ``run_items`` (sends the items to one server at
    one concurrency and scores the answers), the ``--max-concurrency`` sweep and the rounds."""

    task: str
    run_items: ItemRunner
    concurrencies: tuple[int, ...]
    rounds: int

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"--max-concurrency values must be >= 1, got {list(self.concurrencies)}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")


def bundled_runner(task: str, count: int, seed: int, timeout: float) -> ItemRunner:
    """``run_items`` of a bundled task (``oea.eval.serve_tasks``): greedy completions, scored per item."""
    from oea.eval.serve_client import complete_items
    from oea.eval.serve_tasks import bundled_items

    items, score = bundled_items(task, count, seed)
    targets = {item.item_id: item.target for item in items}

    def run_items(base_url: str, model: str, concurrency: int) -> list[dict[str, Any]]:
        answers = complete_items(base_url, model, items, concurrency, timeout)
        return [{"item": a.item_id, "output": a.text, "tokens": a.tokens, "error": a.error,
                 "scores": {} if a.error else score(a.text, targets[a.item_id])} for a in answers]

    return run_items


def served_models(arms: Sequence[Arm]) -> dict[str, str]:
    """{arm: the model its server serves} (``GET /v1/models``); ``ValueError`` naming ``--arm`` when a server is not
    OpenAI-compatible or the arms serve different models (a quality A/B compares one model)."""
    models = {}
    for arm in arms:
        try:
            models[arm.name] = check_reachable(arm.base_url)
        except (ServerUnreachable, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--arm {arm.name}={arm.base_url}: not an OpenAI-compatible server with a model "
                             f"(GET /v1/models: {err})") from None
    if len(set(models.values())) > 1:
        listed = ", ".join(f"{name}={model}" for name, model in models.items())
        raise ValueError(f"--arm: the arms serve different models ({listed}); a quality A/B compares one model")
    return models


def oea_counts(metrics_rows: Sequence[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """OEA's work in [start, end] from its metrics rows (``OEA_METRICS_FILE``, vLLM and SGLang write the same):
    decode and verify steps seen and rewritten, mean active experts per layer and step and the stock routing's
    (None without stock figures)."""
    rows = [r for r in metrics_rows
            if start <= r.get("time", -1.0) <= end + 1.0 and (r.get("decode") or r.get("verify"))]
    active = [a for r in rows for a in r.get("active", [])]
    stock = [a for r in rows for a in r.get("active_stock", [])]
    return {"decode_steps": len(rows), "rewritten_steps": sum(bool(r.get("oea")) for r in rows),
            "active_experts": statistics.mean(active) if active else None,
            "active_experts_stock": statistics.mean(stock) if stock else None}


def measure_cell(plan: EvalPlan, arm: str, base_url: str, model: str, concurrency: int, round_index: int,
                 metrics_file: Path | None, output_file: Path | None, extra: dict[str, Any] | None = None,
                 flush_wait: float = 1.0) -> list[dict[str, Any]]:
    """One (arm, concurrency, round) cell: the item rows and the cell row (module docstring), appended to
    ``output_file`` at once."""
    start = time.time()
    answered = plan.run_items(base_url, model, concurrency)
    end = time.time()
    where = {"arm": arm, "task": plan.task, "max_concurrency": concurrency, "round": round_index}
    rows = [{"kind": "item", **where, **answer} for answer in answered]
    cell: dict[str, Any] = {"kind": "cell", **where, "model": model, "base_url": base_url, "start_time": start,
                            "end_time": end, "n_items": len(answered),
                            "errors": sum(bool(a["error"]) for a in answered), **(extra or {})}
    if metrics_file is not None:
        time.sleep(flush_wait)  # the plugin flushes its metrics every OEA_METRICS_FLUSH_S (0.5 s by default)
        cell.update(oea_counts(load_rows(metrics_file) if metrics_file.exists() else [], start, end))
        cell["metrics_file"] = str(metrics_file)
    rows.append(cell)
    if output_file is not None:
        for row in rows:
            append_jsonl(output_file, row)
    return rows


def _note(progress: bool, text: str) -> None:
    if progress:
        print(f"oea eval serve: {text}", file=sys.stderr, flush=True)


def run_running(arms: Sequence[Arm], plan: EvalPlan, models: dict[str, str], metrics_files: dict[str, Path],
                output_file: Path | None, progress: bool = True) -> list[dict[str, Any]]:
    """Running servers: for each concurrency and round, every arm answers every item (order ``arm_order``)."""
    rows: list[dict[str, Any]] = []
    for concurrency in plan.concurrencies:
        for r in range(plan.rounds):
            for arm in arm_order(arms, r):
                _note(progress, f"{arm.name} c={concurrency} round {r + 1}/{plan.rounds}")
                rows += measure_cell(plan, arm.name, arm.base_url, models[arm.name], concurrency, r,
                                     metrics_files.get(arm.name), output_file)
    return rows


def run_restarted(serve_arms: dict[str, dict[str, str]], server_args: list[str], plan: EvalPlan, out_dir: Path,
                  output_file: Path | None, python: str | None, health_timeout: float, engine: str | None,
                  progress: bool = True, server_nice: int | None = None) -> list[dict[str, Any]]:
    """Restart mode: for each round, each arm (order ``restart_order``) gets a fresh server of the engine with its
    environment and ``OEA_METRICS_FILE`` (``out_dir/engine-NAME-roundR.jsonl``), answers the items at every
    concurrency, and is stopped (SIGTERM stops the current server before this process exits, as Ctrl-C does).
    ``server_nice``: every server's priority and this client's (``oea.launch.priority``), set before any server
    starts (a value out of range or refused names ``--server-nice``)."""
    from oea.bench.serve.ab import restart_order, server_starter
    from oea.bench.serve.engines import check_engine, detect_engine, require_engine
    from oea.launch.server_process import oea_env, stop_server, strip_separator, wait_healthy

    server_args = strip_separator(server_args)
    if not server_args:
        raise ValueError("--serve-arm: restart mode needs the server arguments after '--' (vLLM's api_server or "
                         "SGLang's launch_server)")
    engine = check_engine(engine) or detect_engine(server_args)
    if server_nice is not None:  # the client too: its requests keep pace with the servers it measures
        from oea.launch.priority import set_priority

        set_priority(server_nice, "--server-nice")
    out_dir.mkdir(parents=True, exist_ok=True)
    start_server = server_starter(engine, server_args, python)
    rows: list[dict[str, Any]] = []

    def stop_on_sigterm(signum: int, _frame: object) -> None:  # run the finally below on SIGTERM too
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        for r in range(plan.rounds):
            for name in restart_order(list(serve_arms), r):
                metrics_file = out_dir / f"engine-{name}-round{r}.jsonl"
                metrics_file.unlink(missing_ok=True)
                env = oea_env(None, None)
                env.update({"OEA_METRICS_FILE": str(metrics_file), **serve_arms[name]})
                _note(progress, f"starting {engine} for arm {name}, round {r + 1}/{plan.rounds}")
                server = start_server(server_args, env, python=python,
                                      log_path=out_dir / f"server-{name}-round{r}.log", nice=server_nice)
                try:
                    wait_healthy(server, timeout=health_timeout, timeout_name="--health-timeout")
                    require_engine(server.base_url, engine, strict=False)
                    model = served_models([Arm(name, server.base_url)])[name]
                    for concurrency in plan.concurrencies:
                        _note(progress, f"{name} c={concurrency} round {r + 1}/{plan.rounds}")
                        rows += measure_cell(plan, name, server.base_url, model, concurrency, r, metrics_file,
                                             output_file, {"engine": engine, "arm_env": serve_arms[name]})
                finally:
                    stop_server(server)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return rows
