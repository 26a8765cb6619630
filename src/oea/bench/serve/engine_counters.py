"""Speculative-decoding counters from the engine's own Prometheus endpoint (``GET /metrics``), per round.

vLLM (V1) counts, over the server's life, ``vllm:spec_decode_num_drafts`` (requests that carried drafts, one per
request and verify step), ``vllm:spec_decode_num_draft_tokens`` (draft tokens proposed) and
``vllm:spec_decode_num_accepted_tokens`` (draft tokens the target model accepted); each has a ``_total`` series
per engine (label ``engine``), summed here. A round's figures are the differences of two scrapes, taken right
before and right after the round (warm-up requests are outside both):

* ``spec_acceptance_rate`` = accepted / draft tokens (vLLM's "draft acceptance rate");
* ``spec_mean_accepted_length`` = 1 + accepted / drafts: tokens each verify step produces per request, the
  bonus token included (vLLM's "mean acceptance length").

Only the Prometheus text format's plain sample lines are read (``name{labels} value``); comments, other
metrics and unparsable lines are skipped. A server without the endpoint or without speculation gives no
fields, never an error.
"""

from __future__ import annotations

import math
import re
from typing import Any

COUNTERS: dict[str, str] = {  # our key -> vLLM's counter (its "_total" series)
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
SPEC_FIELDS: tuple[str, ...] = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate",
                                "spec_mean_accepted_length")
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def parse_spec_counters(text: str) -> dict[str, float]:
    """``{num_drafts, num_draft_tokens, num_accepted_tokens}`` summed over engines from a ``/metrics`` page;
    ``{}`` when the page has none of them (speculation off, or not vLLM)."""
    wanted = {series: key for key, series in COUNTERS.items()}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in wanted:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        key = wanted[match["name"]]
        totals[key] = totals.get(key, 0.0) + value
    return totals


def scrape(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """The counters of the server at ``base_url`` now; ``{}`` when it has no ``/metrics`` or no counters."""
    import httpx

    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return {}
    return parse_spec_counters(resp.text) if resp.status_code == 200 else {}


def round_fields(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The ``spec_*`` fields of one round from the scrapes before and after it (``{}`` without counters)."""
    if not before or not after or set(before) != set(COUNTERS) or set(after) != set(COUNTERS):
        return {}
    drafts, tokens, accepted = (after[key] - before[key] for key in COUNTERS)
    return {
        "spec_drafts": int(drafts),
        "spec_draft_tokens": int(tokens),
        "spec_accepted_tokens": int(accepted),
        "spec_acceptance_rate": accepted / tokens if tokens > 0 else math.nan,
        "spec_mean_accepted_length": 1.0 + accepted / drafts if drafts > 0 else math.nan,
    }
