"""What the soak watches besides its requests: which engine answers, the server's health over time, and the
memory of every process in the server's process group (API server, engine core, workers).

Memory is read from ``/proc/<pid>/status`` (``VmRSS``, resident set, and its anonymous / file-backed / shared
memory parts ``RssAnon`` / ``RssFile`` / ``RssShmem``) and ``/proc/<pid>/smaps_rollup``
(``Pss``, the proportional share, which does not count pages the processes share twice) on Linux.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENGINES = ("vllm", "sglang")
# /proc/<pid>/status fields that split the RSS: (field, name in the readings)
MEMORY_PARTS = (("RssAnon", "anon"), ("RssFile", "file"), ("RssShmem", "shmem"))
LOOPBACK_NAMES = ("localhost",)


class SoakError(ValueError):
    """Bad input of the soak (a server it cannot use, limits that would not stop it): one line, exit 2."""


def check_loopback(base_url: str) -> str:
    """``base_url`` without a trailing slash; ``SoakError`` unless it is http(s) on a loopback address."""
    parsed = urllib.parse.urlparse(base_url)
    host = parsed.hostname or ""
    if parsed.scheme not in ("http", "https") or not host:
        raise SoakError(f"--base-url must be http://127.0.0.1:PORT (a loopback server), got {base_url!r}")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if not loopback:
        raise SoakError(f"--base-url must name a loopback address (127.0.0.1, ::1, localhost): the soak sends "
                        f"malformed and aborted requests and runs only against a local server, got {host!r}")
    return base_url.rstrip("/")


@dataclass(frozen=True)
class ServerInfo:
    """The engine behind a URL: ``engine`` (one of ``ENGINES``), served model name, its ``max_model_len``, and
    the lengths it serves in full: the longest prompt (``max_prompt_len``) and the longest prompt + output
    (``max_total_len``), both within the model length (``serving_limits``)."""

    base_url: str
    engine: str
    model: str
    max_model_len: int
    version: str = ""
    root: str = ""  # the model's path (vLLM; SGLang when it is served under its path): config.json gives N, top_k
    max_prompt_len: int = 0  # 0: max_model_len - 1
    max_total_len: int = 0  # 0: max_model_len

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_len or self.max_model_len - 1

    @property
    def total_limit(self) -> int:
        return self.max_total_len or self.max_model_len


# SGLang's scheduler serves a prompt only below its ``max_req_input_len`` (``max_req_len`` - 5, where
# ``max_req_len`` is ``--context-length`` - 1 or the KV pool's size - 1) and stops a request after
# ``max_req_len - 1 - prompt`` output tokens (``finish_reason`` "length", whatever ``max_tokens`` asked).
SGLANG_INPUT_MARGIN = 5


def serving_limits(engine: str, max_model_len: int, server_info: Mapping[str, Any] | None
                   ) -> tuple[int, int]:
    """(longest prompt, longest prompt + output) the engine serves in full. vLLM: the model length (a prompt
    of ``max_model_len - 1`` tokens, prompt + ``max_tokens`` up to ``max_model_len``). SGLang: from its
    ``/server_info`` ``max_req_input_len`` (prompt < it; prompt + output <= it + 4), else from the context
    length (the same with ``max_req_len = max_model_len - 1``)."""
    if engine != "sglang":
        return max_model_len - 1, max_model_len
    limit = (server_info or {}).get("max_req_input_len")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 2:
        limit = max_model_len - 1 - SGLANG_INPUT_MARGIN
    prompt = max(1, min(max_model_len - 1, limit - 1))
    return prompt, max(prompt + 1, min(max_model_len, limit + SGLANG_INPUT_MARGIN - 1))


def identify(base_url: str, timeout: float = 10.0) -> ServerInfo:
    """Ask ``GET /v1/models`` who answers; ``SoakError`` naming the URL when nothing answers or the answer is
    not a vLLM or SGLang server (``owned_by``), or gives no ``max_model_len``."""
    import httpx

    url = check_loopback(base_url) + "/v1/models"
    try:
        resp = httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.HTTPError as err:
        raise SoakError(f"cannot reach {url}: {type(err).__name__}: {err}") from None
    try:
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (ValueError, AttributeError):
        data = None
    if not data or not isinstance(data, list) or not isinstance(data[0], dict):
        raise SoakError(f"{url} answered HTTP {resp.status_code} without a model list: not a vLLM or SGLang "
                        f"OpenAI server ({resp.text[:120]!r})")
    first = data[0]
    owner = str(first.get("owned_by", ""))
    if owner not in ENGINES:
        raise SoakError(f"{url}: the server is not vLLM or SGLang (owned_by {owner!r}); oea soak knows only "
                        f"{', '.join(ENGINES)}")
    max_len = first.get("max_model_len")
    if not isinstance(max_len, int) or max_len < 2:
        raise SoakError(f"{url}: no max_model_len in the model list (got {max_len!r}); start the server with "
                        "--max-model-len (vLLM) / --context-length (SGLang)")
    # vLLM says its version at /version; SGLang at /server_info, with the input length its scheduler serves
    about = _get_json(check_loopback(base_url) + ("/server_info" if owner == "sglang" else "/version"), timeout)
    prompt, total = serving_limits(owner, max_len, about)
    return ServerInfo(check_loopback(base_url), owner, str(first["id"]), max_len, str(about.get("version", "")),
                      str(first.get("root") or ""), prompt, total)


def _get_json(url: str, timeout: float) -> dict[str, Any]:
    """The JSON object a GET of ``url`` answers with 200 ({} for anything else)."""
    import httpx

    try:
        answer = httpx.get(url, timeout=timeout, trust_env=False)
        body = answer.json() if answer.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


# A health answer slower than this is "no answer" (a CPU-starved server is slow, not unhealthy); a server
# that gives no answer for longer than ``MAX_SILENCE_S`` in a row is hung.
HEALTH_TIMEOUT_S = 10.0
MAX_SILENCE_S = 60.0
NO_ANSWER = -1  # the request timed out
UNREACHABLE = 0  # the connection failed (refused, reset)


@dataclass
class Health:
    """``GET /health`` every ``interval_s``: (seconds since start, HTTP status, ``UNREACHABLE`` or ``NO_ANSWER``,
    latency in ms). Unhealthy is an answer other than 200 or a failed connection; a timed-out request is
    counted apart, and the longest span without an answer says whether the server hung."""

    samples: list[tuple[float, int, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        bad = [s for s in self.samples if s[1] not in (200, NO_ANSWER)]
        latencies = sorted(s[2] for s in self.samples if s[1] == 200)
        return {"samples": len(self.samples), "unhealthy": len(bad),
                "no_answer": sum(s[1] == NO_ANSWER for s in self.samples),
                "longest_silence_s": round(self.longest_silence_s(), 1),
                "first_unhealthy_s": round(bad[0][0], 1) if bad else None,
                "first_unhealthy_status": bad[0][1] if bad else None,
                "max_latency_ms": round(latencies[-1], 1) if latencies else None,
                "median_latency_ms": round(latencies[len(latencies) // 2], 1) if latencies else None}

    def longest_silence_s(self) -> float:
        """The longest time from a request that got no answer to the next answer (or to the last request's
        end when none came)."""
        longest, silent_since = 0.0, None
        for began, status, ms in self.samples:
            if status == NO_ANSWER:
                silent_since = began if silent_since is None else silent_since
                longest = max(longest, began + ms / 1e3 - silent_since)
            elif silent_since is not None:
                longest, silent_since = max(longest, began + ms / 1e3 - silent_since), None
        return longest


async def watch_health(base_url: str, health: Health, stop: asyncio.Event, interval_s: float = 1.0,
                       timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Poll ``/health`` into ``health`` until ``stop`` is set."""
    import httpx

    start = time.monotonic()
    # a new connection per request: a kept-alive one the server closed while this poller was starved would read
    # as a failed connection (oea.soak.client.KEEPALIVE_S)
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(trust_env=False, timeout=timeout_s, limits=fresh) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                status = (await client.get(base_url + "/health")).status_code
            except httpx.TimeoutException:
                status = NO_ANSWER
            except httpx.HTTPError:
                status = UNREACHABLE
            health.samples.append((began - start, status, (time.monotonic() - began) * 1e3))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


def group_pids(pgid: int) -> list[int]:
    """Every live process whose process group is ``pgid`` (Linux ``/proc``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return sorted(pids)


def _kib(path: str, *keys: str) -> dict[str, int]:
    """The ``key: N kB`` fields of a /proc file that are among ``keys`` ({} when it cannot be read)."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, sep, rest = line.partition(":")
                if sep and key in keys:
                    found[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"
    return os.path.basename(title) if "/" in title else title


def memory(pgid: int) -> dict[str, Any]:
    """RSS, PSS and the RSS's anonymous and file-backed parts (MiB) of every process in group ``pgid`` and
    their sums, with each process's name. Anonymous pages are the heap (what a leak grows); file-backed ones
    are mapped files such as shared libraries' code, read in as new code paths run."""
    processes = []
    for pid in group_pids(pgid):
        status = _kib(f"/proc/{pid}/status", "VmRSS", "RssAnon", "RssFile", "RssShmem")
        if "VmRSS" not in status:
            continue
        pss = _kib(f"/proc/{pid}/smaps_rollup", "Pss").get("Pss")
        processes.append({"pid": pid, "name": _name(pid), "rss_mib": _mib(status["VmRSS"]),
                          "pss_mib": None if pss is None else _mib(pss),
                          **{f"{field}_mib": _mib(status[key]) for key, field in MEMORY_PARTS if key in status}})
    total = {f"{field}_mib": round(sum(p.get(f"{field}_mib") or 0 for p in processes), 1)
             for field in ("rss", "pss", *(f for _, f in MEMORY_PARTS))}
    return {"time": time.time(), **total, "processes": processes}


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)
