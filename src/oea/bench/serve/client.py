"""Serving benchmark for OpenAI-compatible ``/v1/completions`` servers (vLLM, SGLang), with an A/B mode.

Metrics follow ``vllm bench serve`` and ``sglang.bench_serving`` (compare by formula):

* TTFT: time from sending the request to the first streamed chunk carrying output.
* ITL: gaps between consecutive streamed chunks carrying output (one list per request).
* TPOT: per request, (E2EL - TTFT) / (output_tokens - 1); requests with one output token are left out.
* E2EL: end-to-end request latency.
* request/input/output/total throughput: counts over the round's wall-clock duration.
* concurrency: sum of request latencies / duration (SGLang's definition).

Each measured round becomes one JSON line with ``sglang.bench_serving``'s field names
(``mean_ttft_ms``, ``output_throughput``, ...), plus ``arm``, ``round`` and ``seed``; lines are
appended as soon as a round ends, so an interrupted run keeps what it measured. A server that speculates
adds the round's ``spec_*`` fields from its own ``/metrics`` counters (``engine_counters``: acceptance
rate, mean accepted length).

A/B: rounds alternate between arms (order A B, then B A, ...) to cancel slow drift; each round
uses fresh prompts (``seed + round``) so the server's prefix cache cannot favour a later arm.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oea.bench.serve import engine_counters
from oea.bench.serve.prompts import DATASETS, Prompt, make_prompts


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds). ``itl`` holds the gaps after the first chunk."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


class ServerUnreachable(RuntimeError):
    """The benchmark could not reach a server; the message names the URL."""


# ---------------------------------------------------------------- client


def _payload(model: str, prompt: Prompt, extra_body: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt.prompt,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra_body or {})
    return body


STREAM_DONE = "[DONE]"  # the last data payload of an OpenAI-compatible stream


async def stream_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, stripped, ``STREAM_DONE`` included: what a stream
    that ends without it means is the caller's to say. Other lines (blank separators, comments) are skipped."""
    async for line in lines:
        line = line.strip()
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


async def send_request(client: Any, url: str, model: str, prompt: Prompt,
                       extra_body: dict[str, Any] | None = None) -> RequestResult:
    """POST one streamed completion and time it; never raises for HTTP or stream errors (they are
    recorded in ``RequestResult.error``)."""
    import httpx

    result = RequestResult()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=_payload(model, prompt, extra_body)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {body}"
                return result
            async for data in stream_data(resp.aiter_lines()):
                if data == STREAM_DONE:
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:300]
                    return result
                usage = event.get("usage")
                if usage:
                    result.prompt_len = int(usage.get("prompt_tokens") or 0)
                    result.output_len = int(usage.get("completion_tokens") or 0)
                text = "".join(c.get("text") or "" for c in event.get("choices") or [])
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                result.text += text
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    if chunks == 0:
        result.error = "no output chunk in the stream"
        return result
    if result.output_len == 0:  # server sent no usage: one chunk per token, as vLLM streams
        result.output_len = chunks
    if result.prompt_len == 0 and isinstance(prompt.prompt, list):
        result.prompt_len = len(prompt.prompt)
    result.success = True
    return result


async def run_requests(base_url: str, model: str, prompts: Sequence[Prompt], max_concurrency: int,
                       timeout: float = 600.0, extra_body: dict[str, Any] | None = None,
                       on_done: Callable[[RequestResult], None] | None = None,
                       ) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` with at most ``max_concurrency`` in flight. Returns (results in prompt order,
    wall-clock duration in seconds)."""
    import httpx

    if max_concurrency < 1:
        raise ValueError(f"--max-concurrency values must be >= 1, got {max_concurrency}")
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    gate = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        async def one(prompt: Prompt) -> RequestResult:
            async with gate:
                res = await send_request(client, url, model, prompt, extra_body)
            if on_done is not None:
                on_done(res)
            return res

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - start


def check_reachable(base_url: str, timeout: float = 5.0) -> str:
    """Fail fast: ``GET {base_url}/v1/models``; returns the first served model name.

    Raises ``ServerUnreachable`` naming the URL when nothing answers or it answers an error.
    """
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.HTTPError as err:
        raise ServerUnreachable(f"cannot reach {url}: {type(err).__name__}: {err}") from None
    if resp.status_code != 200:
        raise ServerUnreachable(f"{url} answered HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise ServerUnreachable(f"{url} lists no model")
    return str(data[0]["id"])


# ---------------------------------------------------------------- metrics


def _stats(values_s: Sequence[float], prefix: str, percentiles: Sequence[int] = (99,)) -> dict[str, float]:
    """mean/median/std/pN of ``values_s`` (seconds) in milliseconds, as ``{prefix}`` fields."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        out = {f"mean_{prefix}_ms": math.nan, f"median_{prefix}_ms": math.nan, f"std_{prefix}_ms": math.nan}
        out.update({f"p{p}_{prefix}_ms": math.nan for p in percentiles})
        return out
    out = {
        f"mean_{prefix}_ms": float(arr.mean()),
        f"median_{prefix}_ms": float(np.median(arr)),
        f"std_{prefix}_ms": float(arr.std()),
    }
    out.update({f"p{p}_{prefix}_ms": float(np.percentile(arr, p)) for p in percentiles})
    return out


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, float | int]:
    """Round metrics with ``sglang.bench_serving`` field names (times in ms, throughputs per second).

    Only successful requests count; ``completed`` is their number and ``failed`` the rest.
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    metrics: dict[str, float | int] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    metrics.update(_stats([r.latency for r in ok], "e2e_latency"))
    metrics.update(_stats([r.ttft for r in ok], "ttft"))
    metrics.update(_stats(tpots, "tpot"))
    metrics.update(_stats(itls, "itl", percentiles=(95, 99)))
    metrics["max_itl_ms"] = float(max(itls) * 1000.0) if itls else math.nan
    return metrics


# ---------------------------------------------------------------- rounds and A/B


@dataclass(frozen=True)
class Arm:
    """One side of an A/B: a name and the server's base URL."""

    name: str
    base_url: str


@dataclass(frozen=True)
class BenchConfig:
    """What to send. ``concurrencies`` is the ``--max-concurrency`` sweep."""

    model: str | None = None
    dataset: str = "random"
    num_prompts: int = 32
    random_input_len: int = 128
    random_output_len: int = 128
    random_range_ratio: float = 1.0
    text_input_chars: int = 512
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rounds: int = 1
    warmup_requests: int = 2
    seed: int = 0
    timeout: float = 600.0
    extra_body: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"--max-concurrency values must be >= 1, got {list(self.concurrencies)}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {DATASETS}, got {self.dataset!r}")


def arm_order(arms: Sequence[Arm], round_index: int) -> list[Arm]:
    """Arms in the order they run in round ``round_index``: as given on even rounds, reversed on odd
    rounds (A B, B A, A B, ...), so a linear drift hits every arm equally over a pair of rounds."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


def round_seed(seed: int, concurrency_index: int, round_index: int) -> int:
    """The prompt seed of one (concurrency, round) cell; every arm gets the same prompts in it."""
    return seed + 1000 * concurrency_index + round_index


def result_row(cfg: BenchConfig, arm: Arm, model: str, concurrency: int, round_index: int, seed: int,
               metrics: dict[str, float | int], start_time: float = math.nan, end_time: float = math.nan,
               ) -> dict[str, Any]:
    """One JSONL row: ``sglang.bench_serving`` argument and result fields plus ``arm``/``round``/``seed``
    and the round's wall-clock window (``start_time``/``end_time``, Unix seconds)."""
    return {
        "backend": "vllm",
        "dataset_name": cfg.dataset,
        "request_rate": float("inf"),
        "max_concurrency": concurrency,
        "random_input_len": cfg.random_input_len,
        "random_output_len": cfg.random_output_len,
        "random_range_ratio": cfg.random_range_ratio,
        "num_prompts": cfg.num_prompts,
        "arm": arm.name,
        "base_url": arm.base_url,
        "model": model,
        "round": round_index,
        "seed": seed,
        "start_time": start_time,
        "end_time": end_time,
        **metrics,
    }


def append_jsonl(path: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line and flush it to disk at once."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, allow_nan=True) + "\n")
        f.flush()


def run_benchmark(arms: Sequence[Arm], cfg: BenchConfig, output_file: str | Path | None = None,
                  progress: bool = True, after_round: Callable[[dict[str, Any]], None] | None = None,
                  enrich: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the concurrency sweep over ``arms`` and return one row per (concurrency, round, arm).

    Every arm is checked first (``ServerUnreachable`` names the URL) and warmed up with
    ``cfg.warmup_requests`` requests (not recorded). Rows are appended to ``output_file`` as they
    are measured; ``enrich(row)`` may add fields first (e.g. engine-side metrics of that window). A
    failed request is counted in ``failed``; a round with no successful request raises
    ``RuntimeError`` after its row is written.
    """
    if not arms:
        raise ValueError("at least one server is needed (--base-url, or --base-url-a and --base-url-b)")
    models = {arm.name: cfg.model or check_reachable(arm.base_url) for arm in arms}
    if cfg.model:
        for arm in arms:
            check_reachable(arm.base_url)
    for arm in arms:
        if cfg.warmup_requests:
            warm = make_prompts(cfg.dataset, cfg.warmup_requests, cfg.seed - 1, cfg.random_input_len,
                                min(cfg.random_output_len, 16), cfg.random_range_ratio, cfg.text_input_chars)
            results, _ = asyncio.run(run_requests(arm.base_url, models[arm.name], warm, len(warm), cfg.timeout,
                                                  cfg.extra_body))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise ServerUnreachable(f"warm-up against {arm.base_url} failed: {failed[0]}")

    rows: list[dict[str, Any]] = []
    total = len(cfg.concurrencies) * cfg.rounds * len(arms) * cfg.num_prompts
    with _Progress(total, enabled=progress) as bar:
        for ci, concurrency in enumerate(cfg.concurrencies):
            for r in range(cfg.rounds):
                seed = round_seed(cfg.seed, ci, r)
                prompts = make_prompts(cfg.dataset, cfg.num_prompts, seed, cfg.random_input_len,
                                       cfg.random_output_len, cfg.random_range_ratio, cfg.text_input_chars)
                for arm in arm_order(arms, r):
                    bar.describe(f"{arm.name} c={concurrency} round {r + 1}/{cfg.rounds}")
                    counters = engine_counters.scrape(arm.base_url)  # the engine's speculation counters, if any
                    start_time = time.time()
                    results, duration = asyncio.run(run_requests(
                        arm.base_url, models[arm.name], prompts, concurrency, cfg.timeout, cfg.extra_body,
                        on_done=lambda _res: bar.advance()))
                    row = result_row(cfg, arm, models[arm.name], concurrency, r, seed,
                                     compute_metrics(results, duration), start_time, time.time())
                    row.update(engine_counters.round_fields(counters, engine_counters.scrape(arm.base_url)))
                    if enrich is not None:
                        enrich(row)
                    rows.append(row)
                    if output_file is not None:
                        append_jsonl(output_file, row)
                    if after_round is not None:
                        after_round(row)
                    if row["completed"] == 0:
                        errors = sorted({res.error for res in results})
                        raise RuntimeError(f"every request to {arm.base_url} failed at concurrency {concurrency}: "
                                           f"{errors[:3]}")
    return rows


class _Progress:
    """A rich progress bar on stderr (or nothing when disabled)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task("requests", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file written by ``run_benchmark`` (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def row_as_dict(result: RequestResult) -> dict[str, Any]:
    """A request result as a plain dict (for ``--output-details``-style dumps)."""
    return asdict(result)
